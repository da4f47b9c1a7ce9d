"""Runs of the experiment through the library on an embedded model: the runner and backend classes
a test substitutes (tests/mutants.py), the scenarios and fixtures it asks for, 8 tokens."""

from __future__ import annotations

from parity.arms import select_arms
from parity.backends.transformers_backend import TransformersBackend
from parity.media.catalog import builtin_fixture
from parity.media.fixtures import default_prompts
from parity.run.experiment import run_experiment
from parity.run.planning import CaseSpec, RunSpec
from parity.runner.graph_runner import PrefillGraphRunner, RunnerVariant


def library_run(loaded, runner_class=PrefillGraphRunner, backend_class=TransformersBackend, scenarios=("four-arm",),
                fixtures=("rgb-stripes",), max_new_tokens=8, repeat=1, variant=RunnerVariant.FIXED, poison=False):
    cases = tuple(CaseSpec(fx, default_prompts(fx)[0]) for fx in map(builtin_fixture, fixtures))
    spec = RunSpec(model=loaded.name, arms=select_arms("all"), cases=cases,
                   scenarios=scenarios, max_new_tokens=max_new_tokens, repeat=repeat)
    return run_experiment(spec, backend_class(loaded, max_new_tokens=max_new_tokens, runner_class=runner_class,
                                              runner_variant=variant, poison=poison))
