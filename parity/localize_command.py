"""`parity localize`: a finished run's localizations, recomputed from its results file (design §7).

The model is loaded again from the file's config (model, preset seed, dtype, runner variant, graph
backend, captured buckets) on the run's device, and each request is rebuilt: built-in fixtures and
twins by name, checked against the stored sha256; user images by sha256 from `--image`; prompts
from the file. Everything a user can get wrong is checked before the model loads (the loader holds
every field the rebuild reads: a transformers run's own fields, in closed vocabularies).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from parity.backends.protocol import Request
from parity import registry
from parity.errors import UsageError
from parity.design import SEQUENCE_REQUESTS
from parity.media.catalog import builtin_fixture, builtin_names
from parity.media.fixtures import RESHAPED_SIZES, Fixture, image_fixture
from parity.media.videos import video_fixture
from parity.model_identity import CONFIG_KEY as IDENTITY_KEY
from parity.model_identity import read_identity, same_model
from parity.run.localization import localize_run, target_of
from parity.results import CaseResult, FixtureInfo, RunResult, write_results
from parity.results.signing import signing_key
from parity.trust.loader import load_results
from parity.judge.verdict import judge_run

@dataclass(frozen=True)
class LocalizeOptions:
    results: Path
    case: str | None = None  # None: every case whose bcg arm disagrees with eager
    images: tuple[str, ...] = ()  # the run's user images (matched by sha256)
    videos: tuple[str, ...] = ()  # and its user videos
    threshold: float | None = None  # None: the run's, else the dtype's default
    device: str | None = None  # None: the run's
    write: bool = False


@dataclass(frozen=True)
class Localized:
    run: RunResult  # the file's run, re-judged, with the new localizations
    case_ids: tuple[str, ...]  # the cases localized, in file order
    written: tuple[Path, ...] = ()


def localize_results(options: LocalizeOptions) -> Localized:
    run = judge_run(load_results(options.results))
    config = run.config
    if not registry.of_run(config).localizes:
        raise UsageError(f"{options.results}: a {config.get('backend')} run cannot be localized, since its graph is "
                         "the runtime's own and parity cannot probe it per layer; rerun the failing case on the "
                         "transformers backend with the same checkpoint")
    cases = _selected(run, options.case)
    if not cases:
        return Localized(run, ())
    user = _user_fixtures(options.images, options.videos)
    requests = {case.id: _requests(case, user) for case in cases}
    backend = _backend(run, options.device, requests)
    try:
        threshold = options.threshold or config.get("localize_threshold")
        run = localize_run(run, backend, requests, threshold, only=options.case)
    finally:
        backend.close()
    ids = tuple(case.id for case in cases)
    return _written(run, ids, options.results) if options.write else Localized(run, ids)


def _selected(run: RunResult, case_id: str | None) -> list[CaseResult]:
    if case_id is None:
        return [case for case in run.cases if target_of(case) is not None]
    case = next((c for c in run.cases if c.id == case_id), None)
    if case is None:
        raise UsageError(f"unknown case {case_id!r}; cases in the file: {', '.join(c.id for c in run.cases)}")
    if target_of(case) is None:
        raise UsageError(f"case {case_id} is {case.verdict.code}: no bcg arm of it disagrees with its eager "
                         "reference, so there is nothing to localize")
    return [case]


# --- requests ------------------------------------------------------------------------------------

def _user_fixtures(paths: Sequence[str], videos: Sequence[str] = ()) -> list[Fixture]:
    """The given images and videos, and their twins (a stream case's third request)."""
    images = [image_fixture(path) for path in paths] + [video_fixture(path) for path in videos]
    return images + [image.twin() for image in images]


def _requests(case: CaseResult, user: Sequence[Fixture]) -> tuple[Request, ...]:
    """The case's requests as the run sent them, each with its scenario's serving features."""
    if not case.is_sequence:
        return (Request(_fixture(case.fixture, user, case.id), case.prompt),)
    specs = {spec.label: spec for spec in SEQUENCE_REQUESTS[case.scenario]}
    return tuple(Request(_fixture(r.fixture, user, case.id), r.prompt, specs[r.label].serving) for r in case.requests)


def _fixture(info: FixtureInfo | None, user: Sequence[Fixture], case_id: str) -> Fixture | None:
    """The image the run used: identified by the sha256 of its pixels, never by name alone."""
    if info is None:
        return None
    same = [f for f in user if _matches(f, info)]
    if same:
        return dataclasses.replace(same[0], name=info.name)
    known = builtin_names(twins=True, videos=True)
    if info.name in known:
        fixture = builtin_fixture(info.name)
        if _matches(fixture, info):
            return fixture
    # A built-in given twice or as a file is stored under another name (`rgb-stripes-2`); the layout
    # scenario sends a built-in resized, and a user image resized.
    candidates = [*map(builtin_fixture, known), *user]
    candidates += [f.reshaped(layout) for f in list(candidates) for layout in RESHAPED_SIZES]
    same = [f for f in candidates if _matches(f, info)]
    if same:
        return dataclasses.replace(same[0], name=info.name)
    if info.name in known:
        raise UsageError(f"case {case_id}: {info.kind} {info.name!r} has sha256 {info.sha256[:16]}… in the file, "
                         f"but parity's built-in {info.name!r} has {builtin_fixture(info.name).sha256[:16]}…; give "
                         f"the {info.kind} the run used with --{info.kind}")
    raise UsageError(f"case {case_id}: user {info.kind} {info.name!r} (sha256 {info.sha256[:16]}…) was not "
                     f"given; pass it with --{info.kind} PATH")


def _matches(fixture: Fixture, info: FixtureInfo) -> bool:
    return fixture.sha256 == info.sha256 and tuple(fixture.size) == tuple(info.size)


# --- the model -----------------------------------------------------------------------------------

def _backend(run: RunResult, device: str | None, requests: dict[str, tuple[Request, ...]]):
    import torch

    from parity.backends.options import apply_thread_policy
    from parity.design import DEFAULT_CHUNK_TOKENS
    from parity.backends.transformers_backend import TransformersBackend
    from parity.runner.buckets import BucketPolicy
    from parity.runner.graph_runner import RunnerVariant
    from parity.models import load_model
    from parity.presets import PRESETS

    config, environment = run.config, run.environment
    ran_on = str(environment.get("device", "cpu"))
    if (device or ran_on) == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda: no CUDA device is available here" if device else
                         "the run was on cuda and no CUDA device is available here; pass --device cpu (the errors "
                         "then differ within the noise)")
    device = device or ran_on
    embedded = config["model"] in PRESETS
    threads = environment.get("threads") if device == "cpu" and ran_on == "cpu" else None
    # The run's thread count reproduces its numerics, but never more threads than this machine has: a
    # file's count (up to 8192 is valid) would only oversubscribe the CPUs and crawl.
    threads = min(threads, os.cpu_count() or 1) if isinstance(threads, int) and threads > 0 else None
    apply_thread_policy(threads, embedded)
    seed = config.get("preset_seed") if embedded else None
    loaded = load_model(str(config["model"]), device=device, dtype=str(config["dtype"]), seed=seed)
    recorded = read_identity(config[IDENTITY_KEY])
    if not same_model(loaded.identity, recorded):  # a localization of other weights would describe no run
        raise UsageError(f"the file judged {recorded.describe()}, but {config['model']} loads as "
                         f"{loaded.identity.describe()} here: not the model the run judged")
    captured = tuple(int(b) for b in config["captured_buckets"])
    context = loaded.adapter.max_positions
    if any(b > context for b in captured):  # a checkpoint's context is known only now; capturing past it hangs
        raise UsageError(f"config.captured_buckets has {max(captured)}, beyond the {context}-token context of "
                         f"{config['model']}; the file was not written by a run of this model")
    # The run's captured buckets, exactly: the same bucket for every prompt, the same graphs.
    backend = TransformersBackend(loaded, max_new_tokens=int(config.get("max_new_tokens", 1)),
                                  runner_variant=RunnerVariant(config["runner"]),
                                  graph_backend=str(config["graph_backend"]) if device == ran_on else "auto",
                                  buckets=BucketPolicy(captured, loaded.adapter.max_positions),
                                  chunk_size=config.get("chunk_size") or DEFAULT_CHUNK_TOKENS,
                                  poison=config.get("poison") is True)
    # Each bucket size is a prompt length that needs exactly that bucket; the run's serving features
    # decide whether its context graphs were captured too.
    backend.prepare(("bcg",), captured, sorted({r.serving for rs in requests.values() for r in rs}, key=repr))
    return backend


def _written(run: RunResult, ids: tuple[str, ...], path: Path) -> Localized:
    """The localizations stored back into the results file (atomically), the plots beside it."""
    from parity.reporting.plots import plot_localization

    cases, plots = [], []
    try:
        for case in run.cases:
            if case.id in ids and case.localization is not None:
                plot = plot_localization(case, Path(path).parent)
                plots.append(plot)
                case = dataclasses.replace(case, localization_plot=plot.name)
            cases.append(case)
        run = dataclasses.replace(run, cases=tuple(cases))
        # Rewritten in place: signed again with the environment's key (the loader verified it with the same).
        write_results(run, Path(path), signing_key())
    except OSError as err:  # a full disk, a folder made read-only: the file as it was stays
        raise UsageError(f"--write: cannot write beside {path} ({err.strerror or err}); the results file is "
                         "unchanged") from None
    return Localized(run, ids, (Path(path), *plots))
