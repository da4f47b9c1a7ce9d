"""The DeepStack bug family (design §10, docs/scenarios.md): the fixed runner passes every family
scenario, each planted variant fails its own, and a run that did not reach a scenario's path is
never a PASS."""

from __future__ import annotations

import pytest

from parity.arms import select_arms
from parity.backends.serving import PrefixCache, schedule
from parity.backends.transformers_backend import TransformersBackend
from parity.runner.buckets import BucketPolicy
from parity.design import (
    BATCH, CHUNKED, FAMILY_SCENARIOS, GROWTH, LAYOUT, PLANTED_BUGS, PREFIX, RUNNER_VARIANTS, SCENARIO_SUMMARIES,
    SEQUENCE_REQUESTS, WARMUP,
)
from parity.evidence import EncoderRun, Evidence, ServingEvidence
from parity.judge.evidence_rules import path_not_reached
from parity.run.experiment import run_experiment
from parity.media.catalog import builtin_fixture
from parity.media.fixtures import default_prompts
from parity.runner.graph_runner import PrefillGraphRunner, RunnerVariant
from parity.runner.lm_body import fill_past_mask
from parity.models import load_model
from parity.run.planning import CaseSpec, RunSpec

TOKENS = 8


@pytest.fixture(scope="module")
def tiny_bf16():
    return load_model("tiny-qwen3-vl", device="cpu", dtype="bfloat16")


def _run(loaded, scenarios, runner="fixed", fixture="rgb-stripes", **backend):
    fx = builtin_fixture(fixture)
    spec = RunSpec(model=loaded.name, arms=select_arms("all"), cases=(CaseSpec(fx, default_prompts(fx)[0]),),
                   scenarios=tuple(scenarios), max_new_tokens=TOKENS)
    return run_experiment(spec, TransformersBackend(loaded, max_new_tokens=TOKENS,
                                                    runner_variant=RunnerVariant(runner), **backend))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_fixed_runner_passes_every_family_scenario(request, dtype):
    loaded = request.getfixturevalue("tiny" if dtype == "float32" else "tiny_bf16")
    run = _run(loaded, FAMILY_SCENARIOS)
    assert {c.scenario: c.verdict.code for c in run.cases} == dict.fromkeys(FAMILY_SCENARIOS, "PASS"), run.verdict
    # Each request's graph arm shows the path it was planned to reach.
    for case in run.cases:
        for spec, req in zip(SEQUENCE_REQUESTS[case.scenario], case.requests):
            if spec.proves:
                assert path_not_reached(spec.proves, req.arms[1].evidence if req.arms[1].mode == "bcg"
                                        else case.arm("bcg_normal", case.requests.index(req)).evidence, None) is None


# Layout's bug moves the answer the least (docs/scenarios.md); `mosaic` shows it far above bf16's noise.
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("variant", list(PLANTED_BUGS))
def test_each_planted_bug_fails_its_own_scenario(request, dtype, variant):
    loaded = request.getfixturevalue("tiny" if dtype == "float32" else "tiny_bf16")
    scenario = PLANTED_BUGS[variant][0]
    run = _run(loaded, (scenario,), variant, fixture="mosaic" if scenario == LAYOUT else "rgb-stripes")
    case = run.cases[0]
    if variant == "batch-slot-one":  # fails closed: the batch's rows are refused, never cut to fit
        assert case.verdict.code == "ERROR" and "SlotRejected" in case.verdict.reason, case.verdict
        assert "exceeds the slot's 48 rows" in case.verdict.reason and case.localization is None
        return
    assert case.verdict.code.startswith("FAIL_"), case.verdict
    # The verdict names the request that failed, and the run names the scenario.
    assert case.verdict.reason.startswith("request ") and case.id.startswith(f"{scenario}/")
    # Localized where it happens: the first DeepStack add, or (layout) the encoder's rows at the LM entry.
    expected = "L0" if scenario == LAYOUT else "L0+DS0"
    assert case.localization is not None and case.localization.first_point.label == expected, case.localization


def test_a_planted_bug_is_not_seen_by_the_four_arm_case(tiny):
    """Negative control of the scenarios' worth: the original experiment passes these bugs."""
    for variant in ("chunk-misaligned", "prefix-offset", "layout-keyed"):
        assert _run(tiny, ("four-arm",), variant).verdict.code == "PASS"


def test_a_chunk_larger_than_the_prompt_is_not_reached(tiny):
    run = _run(tiny, (CHUNKED,), chunk_size=512)
    assert run.verdict.code == "INCONCLUSIVE_NOT_REPLAYED"
    assert "did not reach the chunked scenario's path (chunks)" in run.verdict.reason
    assert "give a smaller --chunk-size" in run.verdict.reason
    # The planted bug is not caught where its path is not reached, and is not called a PASS either.
    assert _run(tiny, (CHUNKED,), "chunk-misaligned", chunk_size=512).verdict.code == "INCONCLUSIVE_NOT_REPLAYED"


def test_a_long_request_that_fits_a_bucket_is_not_reached(tiny):
    """An explicit bucket past the long request: it replays, the buffer never grows."""
    run = _run(tiny, (GROWTH,), "growth-rebind", buckets=BucketPolicy.parse((48, 512), tiny.adapter.max_positions))
    assert run.verdict.code == "INCONCLUSIVE_NOT_REPLAYED"
    assert "the DeepStack buffer did not grow" in run.verdict.reason


def test_a_cache_that_never_hits_is_not_reached(tiny, monkeypatch):
    monkeypatch.setattr(PrefixCache, "lookup", lambda self, action, key: (0, None, None))
    run = _run(tiny, (PREFIX,), "prefix-offset")
    assert run.verdict.code == "INCONCLUSIVE_NOT_REPLAYED"
    assert "no prompt row came from the prefix cache" in run.verdict.reason


def test_a_graph_first_captured_by_an_image_is_not_a_warm_up(tiny, monkeypatch):
    cold = ServingEvidence(graph_ready=False)
    assert "was not captured before it arrived" in path_not_reached("graph captured before", Evidence(
        1, 1, True, (48,), 1, serving=cold), None)
    # A runner that captures every graph at start-up and then says one was not warm contradicts itself
    # (trust v6: readiness is the runner's, not a free number): its arm fails on the rule, never passes.
    monkeypatch.setattr(PrefillGraphRunner, "warmed_without_deepstack", lambda self, n, context=False: False)
    run = _run(tiny, (WARMUP,))
    assert run.verdict.code == "ERROR" and "graph_ready is false" in run.verdict.reason


def test_layout_needs_equal_tokens_on_another_grid():
    def with_encoder(grid, patches):
        return Evidence(1, 1, True, (64,), 1, serving=ServingEvidence(encoder=EncoderRun(grid, patches, "k", False)))

    wide = with_encoder((1, 8, 16), 128)
    assert path_not_reached("encoder graph", with_encoder((1, 16, 8), 128), wide) is None
    assert "not the same token count" in path_not_reached("encoder graph", with_encoder((1, 16, 16), 256), wide)
    assert "not the same token count on another grid" in path_not_reached("encoder graph", wide, wide)
    assert "did not go through the encoder graphs" in path_not_reached("encoder graph", Evidence(
        1, 1, True, (64,), 1, serving=ServingEvidence()), wide)


def test_the_prefix_scenario_hits_the_cache_past_and_inside_the_image(tiny):
    """On the built-in fixtures the extended question's hit ends past the image, the other
    question's inside it: both ways a cached prefix can cut DeepStack rows."""
    case = _run(tiny, (PREFIX,)).cases[0]
    hits = [case.arm("bcg_normal", i).evidence.serving for i in (1, 2)]
    first, end = hits[0].image_span
    assert hits[0].cached_tokens >= end and first < hits[1].cached_tokens < end


def test_schedule_and_mask():
    windows = schedule(39, 16, 8)
    assert [(w.start, w.end, w.cached) for w in windows] == [(16, 24, 16), (24, 32, 16), (32, 39, 16)]
    assert [(w.start, w.end) for w in schedule(10, 0, None)] == [(0, 10)]
    import torch

    mask = torch.zeros(4, 6 + 4, dtype=torch.bool)
    fill_past_mask(mask, past_rows=3, rows=2)
    assert mask[:2, :3].all() and not mask[:, 3:6].any()  # the real past, not the slot's stale rows
    assert mask[0, 6:].tolist() == [True, False, False, False] and mask[1, 6:].tolist() == [True, True, False, False]
    assert mask[2:, :6].sum() == 0 and mask[2, 8] and mask[3, 9] and mask[2:].sum() == 2  # padded rows: only themselves


def test_the_command_line_lists_the_family_and_every_backend_serves_it(parity_cli):
    assert set(RUNNER_VARIANTS) == {v.value for v in RunnerVariant}
    help_text = " ".join(parity_cli("run", "--help").output.split())
    for name in SCENARIO_SUMMARIES:
        assert f"{name}:" in help_text
    for variant in PLANTED_BUGS:
        assert variant in help_text
    # A server backend takes a family scenario (here it stops later, at the engine not installed).
    taken = parity_cli("run", "--backend", "sglang", "--scenario", "chunked", "--chunk-size", "4")
    assert "cannot serve it" not in taken.output and "--chunk-size" not in taken.output


def _family_arm(doc, scenario, request, arm="bcg_normal"):
    case = next(c for c in doc["cases"] if c["scenario"] == scenario)
    return case["requests"][request]["arms"][arm]


@pytest.mark.parametrize("scenario, request_index, edit, code, needle", [
    # Evidence removed or emptied: the path is no longer shown, so never a PASS.
    (CHUNKED, 0, lambda s: s.clear(), 2, "lacks 'chunks'"),
    # A hit edited away leaves a replay smaller than its prompt: a story no execution tells.
    (PREFIX, 1, lambda s: s.update(cached_tokens=0, chunks=[]), 2, "a replayed prompt fits its bucket"),
    (GROWTH, 1, lambda s: s.update(buffer_growth=None), 3, "the DeepStack buffer did not grow"),
    (WARMUP, 1, lambda s: s.update(graph_ready=False), 2, "every graph is captured at start-up"),
    # Evidence that cannot describe one execution is refused outright.
    (CHUNKED, 0, lambda s: s["chunks"].pop(1), 2, "chunks must follow each other"),
    (LAYOUT, 1, lambda s: s["encoder"].update(grid=[1, 8]), 2, "grid must be [t, h, w]"),
    # A shared forward claimed by one request alone, or rows that do not tile it.
    (BATCH, 0, lambda s: s.pop("batch"), 2, "of the case's requests name it"),
    (BATCH, 3, lambda s: s["batch"].update(own=[0, 10]), 2, "do not tile"),
    (BATCH, 1, lambda s: s["batch"].update(rows=500), 2, "do not fit the bucket"),
])
def test_an_edited_serving_path_never_passes(real_run, parity_cli, tmp_path, scenario, request_index, edit, code,
                                             needle):
    import json

    _, doc, exit_code = real_run("default")
    assert exit_code == 0
    edit(_family_arm(doc, scenario, request_index)["evidence"]["serving"])
    path = tmp_path / "edited.json"
    path.write_text(json.dumps(doc))
    result = parity_cli("verdict", str(path))
    assert result.exit_code == code and needle in result.output, result.output


@pytest.mark.parametrize("scenario, variant", [(LAYOUT, "layout-keyed"), (GROWTH, "growth-rebind")])
def test_parity_localize_rebuilds_a_family_case(parity_cli, scenario, variant):
    """The command rebuilds the case from its file (the resized images, the serving features, the
    runner's state after the requests before it) and finds what the run found."""
    result, doc, out = parity_cli.run("--scenario", scenario, "--runner", variant, "--max-new-tokens", "6")
    assert result.exit_code == 1
    stored = doc["cases"][0]["localization"]
    again = parity_cli("localize", str(out / "results.json"))
    assert again.exit_code == 0, again.output
    first = stored["points"][stored["first_divergent"]]
    request = stored["request"] + 1
    if scenario == LAYOUT:  # the replay check saw it first in the vision encoder: the one place named
        assert (f"first divergent (request {request}): the vision encoder's output, before decoder layer 0"
                in again.output and f"every layer from {first['layer']} inherits it" in again.output), again.output
        return
    where = "before any DeepStack add" if first["deepstack_block"] is None else "after DeepStack block 0 is added"
    assert f"first divergent layer (request {request}): {first['layer']}, {where}" in again.output
