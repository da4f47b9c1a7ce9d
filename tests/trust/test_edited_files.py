"""`parity verdict` on results files: what parity writes re-judges to the same verdict, and an edited
or self-contradictory file never re-judges to PASS (design §4, "v3 consistency").

Every edit starts from a real run of the tiny preset (`real_run`, made once per session): exit 2 is
a usage error naming the field, 3 is INCOMPLETE. The negative control of each edit is the round
trip: the unedited file loads and judges as it was written.
"""

from __future__ import annotations

import json
import re

import pytest

from parity.results import SCENARIOS, run_to_json
from parity.trust.loader import load_results
from parity.judge.verdict import EXIT_CODES, judge_run
from tests.conftest import REAL_RUNS


@pytest.mark.parametrize("name", REAL_RUNS)
def test_what_parity_writes_reads_back_as_written(real_run, name):
    path, doc, code = real_run(name)
    rejudged = run_to_json(judge_run(load_results(path)))
    assert rejudged["verdict"] == doc["verdict"] and EXIT_CODES[doc["verdict"]["code"]] == code
    # Every case, request, arm, comparison and verdict, exactly as written.
    assert rejudged == doc
    scenarios = {"chunked"} if name.startswith("chunk-") else {"layout"} if name == "layout-keyed" else set(SCENARIOS)
    assert {c["scenario"] for c in doc["cases"]} == scenarios


# --- edits ----------------------------------------------------------------------------------------

def _case(doc, scenario="four-arm"):
    return next(c for c in doc["cases"] if c["scenario"] == scenario)


def _arms(doc, scenario="four-arm", request=0):
    case = _case(doc, scenario)
    return case["arms"] if scenario == "four-arm" else case["requests"][request]["arms"]


def _drop_failing_requests(doc, scenario):
    case = _case(doc, scenario)
    # The requests whose graph answer differs from eager (the power check differs by design).
    failing = {c["request"] for c in case["comparisons"] if not c["match"] and c["a"].startswith("bcg")}
    assert failing  # the no-clear runner leaks stale rows: some request fails
    case["requests"] = [r for i, r in enumerate(case["requests"]) if i not in failing]


def _copy_answer(doc, source, target, keep_forced=True):
    arms = _arms(doc)
    arms[target].update({k: arms[source][k] for k in ("token_ids", "token_logprobs", "top_logprobs", "text")})
    if not keep_forced:
        arms[target]["forced"] = None


def _set(obj, **values):
    obj.update(values)


EDITS = [
    # A sequence case is complete only with all of its requests.
    # (exit 1: the freshness witness still fails the chunked and warmup cases, whose answers agree)
    ("no-clear", lambda d: [_drop_failing_requests(d, s) for s in ("reuse", "stream", "shrink", "growth")], 1,
     "reuse/rgb-stripes/describe: INCOMPLETE: request 2 of 2 (follow-up (text only)): arm(s) not run"),
    ("no-clear", lambda d: _drop_failing_requests(d, "stream"), 1,  # the reuse case still fails
     "stream/rgb-stripes/describe: INCOMPLETE: request 4 of 5 (text only): arm(s) not run"),
    ("no-clear", lambda d: _set(_case(d, "stream")["requests"][3], label="text"), 2,
     "requests[3].label 'text' is not a request of the stream scenario"),
    ("no-clear", lambda d: _case(d, "stream")["requests"].append(_case(d, "stream")["requests"][0]), 2,
     "requests[5].label 'image' is repeated or out of order"),
    ("no-clear", lambda d: _case(d, "reuse")["requests"].reverse(), 2, "is repeated or out of order"),
    ("no-clear", lambda d: _set(_case(d, "stream")["requests"][3], fixture=_case(d, "stream")["fixture"]), 2,
     "requests[3].fixture is 'rgb-stripes', but 'text only' is a text-only request"),
    ("no-clear", lambda d: _set(_case(d, "stream")["requests"][2], fixture=_case(d, "stream")["fixture"]), 2,
     "requests[2].fixture must be the twin of the case's image"),
    # Another arm's answer whose teacher-forced scores say otherwise, with or without those scores.
    ("legacy", lambda d: _copy_answer(d, "eager_normal", "bcg_normal"), 2,
     "arms.bcg_normal.forced.eager_normal[0] is"),
    ("legacy", lambda d: _copy_answer(d, "eager_normal", "bcg_normal", keep_forced=False), 2,
     "arms.bcg_normal.forced lacks bcg_normal"),
    # Replays in buckets the run never had or that cannot hold the prompt.
    ("default", lambda d: _set(_arms(d)["bcg_normal"]["evidence"], buckets=[16]), 2,
     "evidence.buckets has 16, smaller than its 39-token prompt"),
    ("default", lambda d: _set(_arms(d)["bcg_normal"]["evidence"], buckets=[52]), 2,
     "evidence.buckets has 52, which is not among the run's captured buckets"),
    ("default", lambda d: _set(d["config"], captured_buckets=[16, *d["config"]["captured_buckets"]]), 2,
     "config.captured_buckets lists a bucket twice"),
    ("default", lambda d: _set(_arms(d)["bcg_normal"]["evidence"], max_bucket=32), 2, "larger than its evidence.max_bucket"),
    # Evidence and the tap's record disagree about the replay.
    ("default", lambda d: _set(_arms(d)["bcg_normal"]["deepstack_record"], replay=False), 2,
     "evidence.prefill_replayed is true, but its deepstack_record.replay is false"),
    ("default", lambda d: _set(_arms(d)["bcg_normal"]["evidence"], prefill_replayed=False, replayed_calls=0, buckets=[]),
     2, "evidence.replayed_calls is 0, but its deepstack_record.replay is true"),
    # Counts.
    ("default", lambda d: _set(_arms(d)["bcg_normal"]["evidence"], lm_calls=3), 2,
     "lm_calls is 3, fewer than the prefill and 7 decode steps of its 8 tokens"),
    ("default", lambda d: _set(_arms(d)["eager_normal"]["evidence"], tap_calls=-1), 2, "tap_calls must be >= 0, got -1"),
    ("default", lambda d: _set(_arms(d)["bcg_normal"]["evidence"], lm_calls=10**12, replayed_calls=10**12), 2,
     "lm_calls is 1000000000000, above 10000000"),
    ("default", lambda d: _set(_arms(d)["bcg_normal"]["evidence"], replayed_calls=True), 2,
     "replayed_calls must be int, got bool"),
    ("default", lambda d: _set(_arms(d)["bcg_normal"]["deepstack_record"], nonzero_rows=10**6), 2,
     "nonzero_rows is 1000000, more than the"),
    ("default", lambda d: _set(_arms(d)["bcg_normal"], token_ids=[-1] + _arms(d)["bcg_normal"]["token_ids"][1:]), 2,
     "token_ids[0] must be >= 0, got -1"),
    ("default", lambda d: _set(d["config"], max_new_tokens=4), 2, "has 8 tokens, more than config.max_new_tokens 4"),
    ("default", lambda d: _arms(d)["eager_normal"]["token_logprobs"].__setitem__(0, 0.25), 2,
     "token_logprobs[0] is 0.25: a log-probability cannot be positive"),
    ("default", lambda d: _arms(d)["bcg_normal"]["top_logprobs"][0][0].__setitem__(1, 1.0), 2,
     "top_logprobs[0][0] is 1.0"),
    # DeepStack: one fingerprint per request, power only with an image and a model that consumes it.
    ("default", lambda d: _set(_arms(d)["bcg_normal"]["deepstack_record"], sha256="0" * 64), 2,
     "arms.bcg_normal.deepstack_record differs from eager_normal's"),
    ("default", lambda d: _set(_arms(d)["eager_zero_deepstack"]["deepstack_record"], action="normal"), 2,
     "deepstack_record.action is 'normal', but the arm runs DeepStack 'zero'"),
    # config.plan says which image each case has, the same in every scenario
    ("default", lambda d: (_set(_case(d), fixture=None), _set(d["config"]["plan"][0], image=None)), 2,
     "has another image or prompt than"),
    ("default", lambda d: _set(_case(d), fixture=None), 2, "another image under the same case id"),
    ("default", lambda d: _set(d["config"], deepstack_layers=0), 2, "non-zero DeepStack rows, but config.deepstack_layers is 0"),
    ("default", lambda d: (_set(d["config"], deepstack_layers=0),
                       [_set(a, deepstack_record=None) for c in d["cases"]
                        for a in (c["arms"].values() if "arms" in c else [x for r in c["requests"] for x in r["arms"].values()])]),
     2, "deepstack_record is null, but its tap saw DeepStack rows"),
    ("default", lambda d: (_set(_case(d), fixture=None), _set(d["config"]["plan"][0], image=None),
                           [_set(a, deepstack_record=None) for a in _arms(d).values()]), 2,
     "has another image or prompt than"),
    ("default", lambda d: _set(_case(d), id=""), 2, "cases[0].id is empty"),
    ("default", lambda d: _set(_case(d), id=" \t"), 2, "cases[0].id is empty"),
    # Config fields `parity localize` rebuilds the run from.
    ("default", lambda d: _set(d["config"], preset_seed=2**70), 2, "config.preset_seed is an integer of 22 digits"),
    ("default", lambda d: _set(d["config"], preset_seed=2**64), 2, "config.preset_seed is 18446744073709551616, above 18446744073709551615"),
    ("default", lambda d: _set(d["config"], preset_seed="0"), 2, "config.preset_seed must be int, got str"),
    ("default", lambda d: _set(d["environment"], threads="1"), 2, "environment.threads must be int, got str"),
    ("default", lambda d: _set(d["environment"], threads=10**6), 2, "environment.threads is 1000000, above 8192"),
    ("default", lambda d: _set(d["config"], max_new_tokens="8"), 2, "config.max_new_tokens must be int, got str"),
    ("default", lambda d: _set(d["config"], max_new_tokens=0), 2, "config.max_new_tokens must be >= 1, got 0"),
    ("default", lambda d: _set(d["config"], captured_buckets=[100000]), 2,
     "config.captured_buckets has 100000, beyond the 4096-token context of tiny-qwen3-vl"),
    ("default", lambda d: _set(d["config"], captured_buckets=[*d["config"]["captured_buckets"], 2048]), 2,
     "config.captured_buckets has 2048, but the run's longest prompt"),
    ("default", lambda d: _set(d["config"], captured_buckets=[*d["config"]["captured_buckets"], 50]), 2,
     "has 50, which is not on the bucket ladder"),
    ("default", lambda d: _set(d["config"], buckets=[16]), 2, "which config.buckets [16] does not list"),
    ("default", lambda d: _set(d["config"], buckets="most"), 2, "config.buckets must be 'auto' or a non-empty list"),
    ("default", lambda d: _set(d["config"], model=["tiny-qwen3-vl"]), 2, "config.model must be str, got list"),
    # A video is its decoded frames: fewer frames, or none (an image), is not the built-in video.
    ("video", lambda d: _set(_case(d)["fixture"], frames=3), 2, "3 frames) is not that fixture's"),
    ("video", lambda d: _case(d)["fixture"].pop("frames"), 2, "0 frames) is not that fixture's"),
    ("video", lambda d: _set(_case(d)["fixture"], frames=0), 2, "frames must be a video's frame count"),
]


# --- trust v5: what the file says of the model, the serving path and the arms -------------------------

def _serving(doc, scenario, request, arm):
    return _arms(doc, scenario, request)[arm]["evidence"]["serving"]


def _video_chunks(doc):
    """The chunk records ([start, end, bucket, image rows]) of the video chunked case's first request,
    in every arm (the modes must agree on them)."""
    case = next(c for c in doc["cases"] if c["scenario"] == "chunked" and c["fixture"].get("frames"))
    group = case["requests"][0] if case.get("requests") else case
    return [chunk for arm in group["arms"].values() for chunk in arm["evidence"]["serving"]["chunks"]]


def _chunks_of(total, size, bucket):
    return [[start, min(start + size, total), bucket, 0] for start in range(0, total, size)]


def _forge_chunks(doc, arms=("bcg_normal",), replays=False, cover=None):
    """The issue's attack on a `--chunk-size 1000` run: claim 8-token chunks that replayed."""
    for name in arms:
        arm = _arms(doc, "chunked", 0)[name]
        total = arm["evidence"]["serving"]["prompt_tokens"]
        bcg = arm["mode"] == "bcg"
        chunks = _chunks_of(cover or total, 8, 8 if bcg else None)
        arm["evidence"]["serving"]["chunks"] = chunks
        if bcg:
            arm["evidence"]["buckets"] = [8]
            if replays:  # and the replays' check against eager, to match
                arm["evidence"]["replayed_calls"] = arm["evidence"]["replay_check"]["replays"] = len(chunks)


def _each_arm(doc):
    for case in doc["cases"]:
        for arms in ([case["arms"]] if "arms" in case else [r["arms"] for r in case["requests"]]):
            yield from arms.values()


def _merge_first_chunks(serving, evidence):
    first, second = serving["chunks"][:2]
    serving["chunks"][:2] = [[first[0], second[1], 16, first[3] + second[3]]]
    evidence["buckets"] = sorted({*evidence["buckets"], 16})


def _arm_of(doc, scenario, request, arm):
    return _arms(doc, scenario, request)[arm]


V5_EDITS = [
    # Serving evidence against the run it claims. The issue's --chunk-size 1000 forgery, in one arm or
    # in every arm with the replay count raised to match, claims chunks parity never cuts.
    ("chunk-1000", _forge_chunks, "parity cuts chunks of config.chunk_size 1000"),
    ("chunk-1000", lambda d: _forge_chunks(d, ("bcg_normal", "eager_normal", "eager_zero_deepstack"), replays=True),
     "parity cuts chunks of config.chunk_size 1000"),
    # Each rule on its own, from a run whose chunks are real (chunk size 8).
    ("default", lambda d: _serving(d, "chunked", 0, "bcg_normal")["chunks"].pop(),
     "chunks cover rows [0, 32) of a 39-token prompt, not all of it"),
    ("default", lambda d: _merge_first_chunks(_serving(d, "chunked", 0, "bcg_normal"),
                                              _arm_of(d, "chunked", 0, "bcg_normal")["evidence"]),
     "larger than config.chunk_size 8"),
    ("default", lambda d: _set(_arm_of(d, "chunked", 0, "bcg_normal")["evidence"], replayed_calls=4),
     "shows 5 replayed prefill(s), but"),
    ("default", lambda d: _serving(d, "chunked", 0, "bcg_normal").pop("prompt_tokens"), "prompt_tokens is missing"),
    ("default", lambda d: (_set(_serving(d, "prefix", 1, "bcg_normal"), cached_tokens=16, chunks=[[16, 48, 48, 2]]),
                           _set(_arm_of(d, "prefix", 1, "bcg_normal")["evidence"], buckets=[48])),
     "serving.cached_tokens is 16, but eager_normal's is 24"),
    # DeepStack records where the tap fired, with rows where DeepStack moved the answer.
    ("default", lambda d: _set(_arms(d)["bcg_normal"], deepstack_record=None), "deepstack_record is null, but its tap"),
    ("default", lambda d: [_set(a, deepstack_record=None) for a in _each_arm(d)], "deepstack_record is null, but its tap"),
    ("default", lambda d: [_set(a["deepstack_record"], nonzero_rows=0, nonzero_span=None) for a in _each_arm(d)
                           if a["deepstack_record"]], "has 0 non-zero rows, but zeroing DeepStack changed"),
    ("default", lambda d: [_set(a["deepstack_record"], nonzero_rows=0) for a in _each_arm(d) if a["deepstack_record"]],
     "nonzero_span [6, 18] is not [first, last + 1) of 0 non-zero row(s)"),
    # Closed vocabularies and required provenance.
    ("default", lambda d: _set(d["config"], backend="turbo"), "config.backend 'turbo' is not a backend parity has"),
    ("default", lambda d: _set(d["config"], dtype="int8"), "config.dtype 'int8' is not one parity runs"),
    ("default", lambda d: _set(d["config"], arms=["eager_normal", "eager_zero_deepstack"]),
     "is not one of the arms the run selected"),
    ("default", lambda d: d["environment"].pop("parity_source"), "environment lacks 'parity_source'"),
    ("default", lambda d: _set(d["config"]["plan"][0], prompt_tokens=40), "plans 40 prompt tokens for"),
    ("default", lambda d: [_set(e, prompt_tokens=10**6) for e in d["config"]["plan"]], "plans 1000000 prompt tokens"),
    ("default", lambda d: [_set(e, prompt_tokens=38) for e in d["config"]["plan"] if e["scenario"] == "four-arm"],
     "longer than the 38 tokens config.plan plans"),
    # Which model it judged.
    ("default", lambda d: d["config"].pop("model_identity"), "config.model_identity must be an object"),
    ("default", lambda d: _set(d["config"]["model_identity"], name="tiny-qwen3-vl-moe"),
     "model_identity.name is 'tiny-qwen3-vl-moe', but config.model is 'tiny-qwen3-vl'"),
    ("default", lambda d: _set(d["config"]["model_identity"], kind="checkpoint", seed=None), "is an embedded preset"),
    ("default", lambda d: _set(d["config"]["model_identity"], seed=3), "model_identity.seed is 3, but config.preset_seed"),
    ("default", lambda d: _set(d["config"]["model_identity"], sha256="x" * 64), "sha256 must be 64 lowercase hex"),
]


def _check(doc, arm="bcg_normal", scenario="four-arm", request=0):
    return _arm_of(doc, scenario, request, arm)["evidence"]["replay_check"]


def _departure(doc):
    return _check(doc)["departure"]


# The replay check against eager on its own shape (design §6): required where parity replays in-process,
# held to itself. "legacy" is a run whose four-arm graph arm departs (the drop, at L0+DS0).
REPLAY_CHECK_EDITS = [
    ("default", lambda d: _arm_of(d, "four-arm", 0, "bcg_normal")["evidence"].pop("replay_check"),
     "replayed a graph but records no replay_check"),
    ("default", lambda d: _set(_arm_of(d, "four-arm", 0, "eager_normal")["evidence"], replay_check=_check(d)),
     "only an in-process arm that replayed checks its replays"),
    ("default", lambda d: _set(_check(d, "bcg_normal", "chunked"), replays=1), "replay_check covers 1 graph replay(s)"),
    ("default", lambda d: _check(d)["tensors"].update(keys=[0.5, 0.0]), "its keys replay delta exceeds its bound"),
    # Trust v7: a bound is the graph's, measured once per run. The claim, 13.4 beside 0 and 0:
    ("default", lambda d: (_check(d)["tensors"].update(keys=[0.5, 13.4]), _check(d)["bounds"]["prefill 48"].update(keys=13.4)),
     "bounds['prefill 48'].keys is 13.4: a graph's bound is measured once per run, the same for every arm"),
    ("default", lambda d: _check(d)["tensors"].update(keys=[0.5, 13.4]), "its keys bound 13.4 is not the largest of its graphs' (0)"),
    ("default", lambda d: _check(d).pop("bounds"), "records bounds per graph for no tensor, but holds logits"),
    ("default", lambda d: _check(d)["tensors"].update(gradients=[0.0, 0.0]), "tensors.gradients is not a checked tensor"),
    ("default", lambda d: _check(d)["tensors"].update(keys=[-1.0, 0.0]), "deltas, bounds and padding noise are >= 0"),
    ("legacy", lambda d: _set(_check(d), departure=None), "replay delta exceeds its bound, but no departure"),
    ("legacy", lambda d: _set(_departure(d), delta=99.0), "is not within the keys deltas and bounds it records"),
    ("legacy", lambda d: _set(_departure(d), point="L99+DS99+L1"), "names no checked tensor, replay, row or point"),
    ("legacy", lambda d: _set(_departure(d), replay=3), "names no checked tensor, replay, row or point"),
    # Trust v7: a check holds exactly the tensors its replays had (v6's layout FAIL flipped by deleting one).
    ("default", lambda d: _check(d)["tensors"].pop("keys"), "holds logits, hidden, values, but its replays had "
                                                              "logits, hidden, keys, values"),
    ("default", lambda d: [_check(d)["tensors"].pop(t) for t in ("hidden", "keys", "values")], "holds logits, but"),
    ("default", lambda d: _check(d, "bcg_normal", "layout", 1)["tensors"].pop("encoder"),
     "(a prefill replayed, an encoder graph ran)"),
    ("default", lambda d: _check(d)["tensors"].update(encoder=[0.0, 0.0]), "an encoder graph did not run"),
]


def _in_both_modes(doc, scenario, request, edit, arms=("bcg_normal", "eager_normal")):
    for name in arms:
        edit(_arm_of(doc, scenario, request, name)["evidence"]["serving"])


# Trust v6: every field a path proof reads, held to another record of the same fact (path_proofs.py).
# "chunk-20" is the INCONCLUSIVE_NOT_REPLAYED chunked run: its image rows all in the first chunk.
def _fresh(doc, arm="bcg_normal", name="input_embeds"):
    return next(r for r in _arm_of(doc, "four-arm", 0, arm)["evidence"]["freshness"] if r["input"] == name)


def _drop_record(doc, name):
    evidence = _arm_of(doc, "four-arm", 0, "bcg_normal")["evidence"]
    evidence["freshness"] = [r for r in evidence["freshness"] if r["input"] != name]


# The freshness witness's records (design §6) have a closed shape too: every replayed bucket's graph,
# the inputs every prefill graph reads, counts that add up, and poison counted exactly when it ran.
FRESHNESS_EDITS = [
    ("default", lambda d: _arm_of(d, "four-arm", 0, "bcg_normal")["evidence"].pop("freshness"),
     "freshness covers the graphs of buckets none, but the arm replayed in [48]"),
    ("default", lambda d: _drop_record(d, "input_embeds"), "without input_embeds, which every prefill graph reads"),
    ("default", lambda d: _set(_arm_of(d, "four-arm", 0, "eager_normal")["evidence"], freshness=[_fresh(d)]),
     "freshness is recorded, but only an arm whose replays parity watched has one"),
    ("default", lambda d: _set(_fresh(d), graph="decode 48"), "names graph 'decode 48', not prefill N or context N"),
    ("default", lambda d: _set(_fresh(d), replays=2), "counts other replays of the prefill 48 graph"),
    ("default", lambda d: _set(_fresh(d), stale=60, first=[0]), "60 offending rows of the 48 read"),
    ("default", lambda d: _set(_fresh(d), left_by="the first request"), "left_by must be an image's sha256"),
    ("default", lambda d: _set(_fresh(d), poisoned=0), "counts poisoned rows of input_embeds, but the run did not poison"),
    ("default", lambda d: _set(d["config"], poison=True), "which a run with --poison counts"),
]

PATH_EDITS = [
    # The forgery, two integers: the image rows split over both chunks, in one arm or in both modes.
    ("chunk-20", lambda d: _set(_serving(d, "chunked", 0, "bcg_normal"), chunks=[[0, 20, 20, 6], [20, 39, 20, 6]]),
     "chunks is [[0, 20, 6], [20, 39, 6]], but eager_normal's is [[0, 20, 12], [20, 39, 0]]"),
    ("chunk-20", lambda d: _in_both_modes(d, "chunked", 0, lambda s: _set(s, chunks=[[0, 20, c[2], 6], [20, 39, c[2], 6]])
                                          if (c := s["chunks"][0]) else None),
     "has 6 image rows, but [0, 20) holds 12 row(s) of the image span [6, 18]"),
    # ... with the span moved to match: the DeepStack record, and the twin of the same size, disagree.
    ("chunk-20", lambda d: _in_both_modes(d, "chunked", 0, lambda s: _set(s, image_span=[14, 26], chunks=[
        [0, 20, s["chunks"][0][2], 6], [20, 39, s["chunks"][1][2], 6]])),
     "image_span is [14, 26], but the arm's DeepStack record saw its non-zero rows at [6, 18]"),
    # ... and the records moved with them: the preset's own chat template puts the image at row 6.
    ("chunk-20", lambda d: [(_set(s := a["evidence"]["serving"], image_span=[14, 26], chunks=[
        [0, 20, s["chunks"][0][2], 6], [20, 39, s["chunks"][1][2], 6]]),
        a["deepstack_record"] and _set(a["deepstack_record"], nonzero_span=[14, 26]))
        for a in _each_arm(d) if (a["evidence"].get("serving") or {}).get("image_span")],
     "image_span starts at row 14, but tiny-qwen3-vl's chat template puts an image's first row at 6"),
    # Trust v7: the span moved in every arm of the file (so every neighbour agrees), against where the
    # tap saw the image's rows as the run happened.
    ("chunk-20", lambda d: [_set(a["evidence"]["serving"], image_span=[14, 26], chunks=[
        [0, 20, c[0][2], 6], [20, 39, c[1][2], 6]]) for a in _each_arm(d)
        if (c := (a["evidence"].get("serving") or {}).get("chunks"))],
     "image_span is [14, 26], but the arm's DeepStack record saw its non-zero rows at [6, 18]"),
    ("default", lambda d: _in_both_modes(d, "growth", 0, lambda s: _set(s, image_span=[6, 30]),
                                         arms=("bcg_normal", "eager_normal", "eager_zero_deepstack")),
     "image_span [6, 30] holds 24 rows, but the arm's DeepStack record saw 12"),
    # The anchor of "chunks tile the prompt": the arm's own prompt, and the plan.
    ("chunk-1000", lambda d: _in_both_modes(d, "chunked", 0, lambda s: _set(s, prompt_tokens=20, chunks=[[0, 20, c[2], 12]])
                                            if (c := s["chunks"][0]) else None),
     "prompt_tokens is 20, but the arm's evidence records a 39-token prompt"),
    # A warm graph: only where a graph replayed, as the runner captures them.
    ("default", lambda d: _set(_serving(d, "warmup", 1, "bcg_normal"), graph_ready=False),
     "every graph is captured at start-up, and its first prefill replayed"),
    ("default", lambda d: _set(_serving(d, "warmup", 1, "eager_normal"), graph_ready=True), "replayed no graph"),
    # A grown buffer: from the largest captured bucket, to a prompt a graph arm served eagerly.
    ("default", lambda d: (g := _serving(d, "growth", 2, "bcg_normal")["buffer_growth"]).__setitem__(1, g[1] - 1),
     "grows to a prompt a graph arm served eagerly"),
    ("default", lambda d: _serving(d, "growth", 2, "bcg_normal")["buffer_growth"].__setitem__(0, 32),
     "starts at the largest captured bucket"),
    ("default", lambda d: _serving(d, "growth", 2, "bcg_normal")["buffer_growth"].__setitem__(1, 900),
     "more than the longest planned prompt"),
    # Trust v7: a video's chunk rows, held to its DeepStack record (its span holds timestamps too).
    ("video", lambda d: [c.__setitem__(3, max(0, c[3] - 2)) for c in _video_chunks(d)],
     "image rows in all, but the arm's DeepStack record saw"),
    # An encoder graph: its grid, its image, its key, and whether it was a replay.
    ("default", lambda d: _serving(d, "layout", 1, "bcg_normal")["encoder"].update(patches=64),
     "64 patches, but grid 1x16x8 holds 128"),
    ("default", lambda d: _serving(d, "layout", 1, "bcg_normal")["encoder"].update(grid=[1, 8, 16], key="grid 1x8x16"),
     "is not shaped as the"),
    ("default", lambda d: _serving(d, "layout", 1, "bcg_normal")["encoder"].update(key="128 patches"),
     "its key is '128 patches', but runner 'fixed' keys it 'grid 1x16x8'"),
    ("default", lambda d: _serving(d, "layout", 2, "bcg_normal")["encoder"].update(replayed=False),
     "was captured by an earlier request of the case, yet it is not a replay"),
    ("default", lambda d: _set(_serving(d, "layout", 0, "eager_normal"), encoder=_serving(d, "layout", 0, "bcg_normal")[
        "encoder"]), "replayed a graph but records no replay_check"),
    # A cache hit: whole pages, from an earlier request's rows, for a request served from the cache.
    ("default", lambda d: _in_both_modes(d, "prefix", 1, lambda s: _set(s, cached_tokens=40, chunks=[
        [40, 48, s["chunks"][0][2], 0]])), "no earlier request of the case with its image and mode prefilled that many"),
    ("default", lambda d: _in_both_modes(d, "prefix", 1, lambda s: _set(s, cached_tokens=28, chunks=[
        [28, 48, s["chunks"][0][2], 0]])), "not a whole number of config.prefix_cache_page 8-token pages"),
    ("default", lambda d: _in_both_modes(d, "prefix", 0, lambda s: _set(s, cached_tokens=8, chunks=[
        [8, 39, s["chunks"][0][2], 10]]), arms=("bcg_normal", "eager_normal", "eager_zero_deepstack")),
     "the request is not served from a filled prefix cache"),
]


BACKEND_FIELDS = {"vllm": ("vllm_servers", "vllm_concurrent", "vllm_launches", "vllm_args", "vllm_device", "engine")}


def _relabelled(doc, backend, add_fields=False, drop_own=False):
    """The issue's relabel: config.backend switched to a server backend, selecting its lenient rules."""
    from tests.helpers_runs import BACKEND_CONFIG, ENGINE_VERSIONS

    doc["config"]["backend"] = backend
    if add_fields:  # its own fields, keeping the run's chunk size
        doc["config"].update({k: v for k, v in BACKEND_CONFIG[backend].items() if k not in doc["config"]})
        doc["environment"][backend] = ENGINE_VERSIONS[backend]
    if drop_own:
        for key in set(BACKEND_CONFIG["transformers"]) - set(BACKEND_CONFIG[backend]):
            doc["config"].pop(key, None)


# Strictness is the backend's: a file relabelled from another backend is refused (trust v6).
BACKEND_EDITS = [
    ("chunk-1000", lambda d: (_forge_chunks(d), _relabelled(d, "vllm")), "config.engine is missing: every vllm run writes it"),
    ("chunk-1000", lambda d: (_forge_chunks(d), _relabelled(d, "sglang", add_fields=True)),
     "is a transformers run's field, but config.backend is 'sglang': a file relabelled from another backend"),
    ("chunk-1000", lambda d: (_forge_chunks(d, ("bcg_normal", "eager_normal", "eager_zero_deepstack"), replays=True),
                              _relabelled(d, "vllm", add_fields=True, drop_own=True)),
     "replay_check is recorded, but only an in-process arm that replayed checks its replays"),
    # Trust v7: a relabel whose server fields are present but hold nothing.
    ("chunk-1000", lambda d: (_relabelled(d, "vllm", add_fields=True, drop_own=True),
                              d["config"].update({k: None for k in BACKEND_FIELDS["vllm"]})),
     "but every vllm run writes"),
    ("chunk-1000", lambda d: (_relabelled(d, "sglang", add_fields=True, drop_own=True), _set(d["config"], sglang_servers={})),
     "config.sglang_servers must name each server's command"),
    ("chunk-1000", lambda d: (_relabelled(d, "vllm", add_fields=True, drop_own=True), _set(d["config"], vllm_launches="2")),
     "config.vllm_launches is '2', but every vllm run writes int there"),
    ("chunk-1000", lambda d: (_relabelled(d, "vllm", add_fields=True, drop_own=True), _set(d["config"], engine_version="0.33.0")),
     "config.engine_version is '0.33.0', but environment.vllm is '0.34.0'"),
    ("default", lambda d: _set(d["config"], runner="turbo"), "config.runner 'turbo' is not one parity has"),
    ("default", lambda d: _set(d["config"], graph_backend="tpu-graph"), "config.graph_backend 'tpu-graph' is not one"),
    ("default", lambda d: _set(d["environment"], device="tpu"), "environment.device 'tpu' is not one parity runs on"),
    ("default", lambda d: _set(d, interrupted=True), "interrupted is true, but every planned case, arm and repeat"),
]


def test_v6_s_layout_fail_no_longer_flips_by_deleting_the_encoder_tensor(real_run, parity_cli, tmp_path):
    """Trust v7, defect 2: the layout-keyed runner failed only through the replay check; deleting the
    check's `encoder` entry and nulling its departure made it PASS. The check's shape is now closed,
    and the freshness witness of the encoder graphs fails it as well (its records cannot be dropped
    either: below)."""
    _, doc, code = real_run("layout-keyed")
    assert code == 1 and doc["verdict"]["code"] == "FAIL_INPUT_NOT_FRESH"  # the negative control, as written
    for arm in _each_arm(doc):
        check = arm["evidence"].get("replay_check")
        if check is not None:
            check["tensors"].pop("encoder", None)
            check["departure"] = None
    edited = tmp_path / "edited.json"
    edited.write_text(json.dumps(doc))
    result = parity_cli("verdict", str(edited))
    assert result.exit_code == 2 and "an encoder graph ran" in result.output, result.output


def test_the_encoder_graphs_witness_cannot_be_dropped_from_a_file(real_run, parity_cli, tmp_path):
    """Deleting the encoder graph's freshness records (the stale grid the layout-keyed run read) is
    refused: an arm whose image went through an encoder graph lists it, with its pixel slot."""
    _, doc, _ = real_run("layout-keyed")
    for arm in _each_arm(doc):
        arm["evidence"]["freshness"] = [r for r in arm["evidence"].get("freshness", [])
                                        if not r["graph"].startswith("encoder ")]
    edited = tmp_path / "edited.json"
    edited.write_text(json.dumps(doc))
    result = parity_cli("verdict", str(edited))
    assert result.exit_code == 2 and "lists no vision-encoder graph" in result.output, result.output


def test_the_chunked_run_the_path_forgeries_start_from_is_not_a_pass(real_run):
    _, doc, code = real_run("chunk-20")
    assert code == 3 and doc["verdict"]["code"] == "INCONCLUSIVE_NOT_REPLAYED"


def test_a_forged_clean_check_still_leaves_the_dropped_answers(real_run, parity_cli, tmp_path):
    """Erasing a departure (tensors and all) cannot make the legacy drop pass: its answers still show it."""
    _, doc, _ = real_run("legacy")
    for arm in _each_arm(doc):
        check = arm["evidence"].get("replay_check")
        if check is not None:
            check["departure"] = None
            check["tensors"] = {name: [0.0, 0.0] for name in check["tensors"]}
    edited = tmp_path / "edited.json"
    edited.write_text(json.dumps(doc))
    result = parity_cli("verdict", str(edited))
    assert result.exit_code == 1 and "FAIL_DEEPSTACK_DROPPED" in result.output


@pytest.mark.parametrize("name, edit, message", V5_EDITS + REPLAY_CHECK_EDITS + FRESHNESS_EDITS + PATH_EDITS + BACKEND_EDITS)
def test_a_v5_edit_is_refused_naming_the_field(parity_cli, real_run, tmp_path, name, edit, message):
    _, doc, _ = real_run(name)
    edit(doc)
    edited = tmp_path / "edited.json"
    edited.write_text(json.dumps(doc))
    result = parity_cli("verdict", str(edited))
    assert result.exit_code == 2 and message in result.output and "Traceback" not in result.output, result.output


def test_where_no_template_is_recomputed_one_span_per_image_size_holds_a_moved_span(parity_cli, real_run, tmp_path,
                                                                                    monkeypatch):
    """A checkpoint's template is not recomputed (its tokenizer may be elsewhere): there, an image's
    span and records moved in one case's arms still disagree with the twin of the same size."""
    monkeypatch.setattr("parity.trust.path_proofs.PRESETS", {})
    _, doc, _ = real_run("chunk-20")
    for name in ("bcg_normal", "eager_normal"):
        arm = _arm_of(doc, "chunked", 0, name)
        serving = arm["evidence"]["serving"]
        _set(serving, image_span=[14, 26], chunks=[[0, 20, serving["chunks"][0][2], 6], [20, 39, serving["chunks"][1][2], 6]])
        if arm["deepstack_record"]:
            _set(arm["deepstack_record"], nonzero_span=[14, 26])
    edited = tmp_path / "edited.json"
    edited.write_text(json.dumps(doc))
    result = parity_cli("verdict", str(edited))
    assert result.exit_code == 2 and "of an image of the same size, is" in result.output, result.output


def test_the_chunk_size_run_the_forgeries_start_from_is_not_a_pass(real_run):
    """The negative control of the chunk forgeries: as written, the run never reached the chunked path."""
    _, doc, code = real_run("chunk-1000")
    assert code == 3 and doc["verdict"]["code"] == "INCONCLUSIVE_NOT_REPLAYED"


@pytest.mark.parametrize("literal, message", [
    ("1" * 400, "is an integer of 400 digits"),
    ("-" + "9" * 310, "is an integer of 310 digits"),
    ("1" * 401 + ".5", "is inf: numbers in a results file must be finite"),
    ("1e400", "is inf: numbers in a results file must be finite"),
    ("123456789012345678901", "is an integer of 21 digits"),
])
@pytest.mark.parametrize("command", [("verdict",), ("verdict", "--json"), ("report", "--format", "json"),
                                     ("merge", "--out", "OUT")])
def test_numbers_past_any_bound_are_refused_naming_the_field(parity_cli, real_run, tmp_path, literal, message, command):
    path, _, _ = real_run("legacy")
    text = re.sub(r'"lm_calls": \d+', f'"lm_calls": {literal}', path.read_text(), count=1)
    edited = tmp_path / "edited.json"
    edited.write_text(text)
    args = [str(tmp_path / "out") if a == "OUT" else a for a in command]
    result = parity_cli(*args[:1], str(edited), *args[1:])
    assert result.exit_code == 2 and message in result.output and "evidence.lm_calls" in result.output, result.output
    assert "Traceback" not in result.output


@pytest.mark.parametrize("name, edit, code, message", EDITS)
def test_an_edited_file_never_rejudges_to_pass(parity_cli, real_run, tmp_path, name, edit, code, message):
    _, doc, _ = real_run(name)
    edit(doc)
    edited = tmp_path / "edited.json"
    edited.write_text(json.dumps(doc))
    result = parity_cli("verdict", str(edited))
    assert result.exit_code == code and message in result.output, result.output
    if code == 2:  # a usage error names the file
        assert str(edited) in result.output and "Traceback" not in result.output


def test_a_key_given_twice_is_refused_where_it_is(parity_cli, real_run, tmp_path):
    path, doc, _ = real_run("legacy")
    text = path.read_text()
    # A passing bcg_normal before the real one: json keeps the last key, but a reader might keep the first.
    edited = text.replace('"bcg_normal": {', '"bcg_normal": ' + json.dumps(_arms(doc)["eager_normal"]) + ', "bcg_normal": {', 1)
    (tmp_path / "twice.json").write_text(edited)
    result = parity_cli("verdict", str(tmp_path / "twice.json"))
    assert result.exit_code == 2 and "cases[0].arms has the key 'bcg_normal' twice" in result.output, result.output
    (tmp_path / "twice.json").write_text(text.replace('"schema"', '"schema": "parity.results/2", "schema"', 1))
    result = parity_cli("verdict", str(tmp_path / "twice.json"))
    assert result.exit_code == 2 and "document has the key 'schema' twice" in result.output, result.output


@pytest.mark.parametrize("edit, message", [
    (lambda d: _set(d["config"], preset_seed=2**70), "config.preset_seed"),
    (lambda d: _set(d["config"], captured_buckets=[100000]), "config.captured_buckets"),
    (lambda d: _set(d["config"], max_new_tokens="x"), "config.max_new_tokens"),
    (lambda d: _set(d["environment"], threads=0), "environment.threads"),
])
def test_localize_refuses_the_fields_it_would_rebuild_from(parity_cli, real_run, tmp_path, edit, message):
    _, doc, _ = real_run("legacy")
    edit(doc)
    edited = tmp_path / "edited.json"
    edited.write_text(json.dumps(doc))
    result = parity_cli("localize", str(edited))
    assert result.exit_code == 2 and message in result.output and "Traceback" not in result.output, result.output


def test_a_missing_request_is_not_run_and_the_others_keep_their_places(real_run, tmp_path):
    from parity.results import SEQUENCE_REQUESTS

    _, doc, _ = real_run("no-clear")
    assert _case(doc, "stream")["localization"]["request"] == 3  # the text-only request leaks stale rows
    del _case(doc, "stream")["requests"][1]
    path = tmp_path / "edited.json"
    path.write_text(json.dumps(doc))
    case = next(c for c in judge_run(load_results(path)).cases if c.scenario == "stream")
    assert [r.label for r in case.requests] == [spec.label for spec in SEQUENCE_REQUESTS["stream"]]
    assert case.requests[1].arms == () and case.localization.request == 3  # its place in the scenario
    assert case.verdict.code == "INCOMPLETE" and case.verdict.reason == (
        "request 2 of 5 (image, DeepStack zeroed): arm(s) not run: eager_zero_deepstack, bcg_zero_deepstack")


def test_localize_refuses_buckets_past_a_checkpoints_context(parity_cli, tiny, tmp_path):
    folder = tmp_path / "checkpoint"
    tiny.adapter.model.save_pretrained(folder)
    tiny.adapter.processor.save_pretrained(folder)
    _, doc, _ = parity_cli.run("--model", str(folder), "--runner", "legacy", "--buckets", "48", "--max-new-tokens", "4")
    # Consistent everywhere but past the checkpoint's 4096 positions, which only loading it tells.
    doc["config"].update(buckets=[8192], captured_buckets=[8192])
    for arm in doc["cases"][0]["arms"].values():
        arm["evidence"].update(max_bucket=8192, buckets=[8192] if arm["mode"] == "bcg" else [])
        for record in arm["evidence"].get("freshness", []):
            record["graph"] = "prefill 8192"
    edited = tmp_path / "edited.json"
    edited.write_text(json.dumps(doc))
    assert parity_cli("verdict", str(edited)).exit_code == 1  # the loader cannot know the context
    result = parity_cli("localize", str(edited))
    assert result.exit_code == 2 and "config.captured_buckets has 8192, beyond the 4096-token context" in result.output


def test_an_interrupted_run_reads_back_and_does_not_pass(parity_cli, monkeypatch):
    from parity.backends.transformers_backend import TransformersSession

    real, calls = TransformersSession.answer, {"n": 0}

    def interrupted(self, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 30:  # in the eager pass, before the later fixtures' larger buckets ran
            raise KeyboardInterrupt
        return real(self, *args, **kwargs)

    monkeypatch.setattr(TransformersSession, "answer", interrupted)
    result, doc, out = parity_cli.run("--scenario", "all", "--fixture", "all", "--max-new-tokens", "2")
    assert result.exit_code == 130 and doc["interrupted"] is True
    assert any(not r["arms"] for c in doc["cases"] if "requests" in c for r in c["requests"])
    rejudged = run_to_json(judge_run(load_results(out / "results.json")))
    assert rejudged == doc and rejudged["verdict"]["code"] == "INCOMPLETE"


# --- every one-field edit (issue 21) -----------------------------------------------------------------

def _places(node, path=()):
    """Every object key and the first item of every list, with its value (one place per field)."""
    if isinstance(node, dict):
        for key, value in node.items():
            if key not in ("comparisons", "verdict"):  # recomputed, never read
                yield path + (key,), value
                yield from _places(value, path + (key,))
    elif isinstance(node, list) and node:
        yield path + (0,), node[0]
        yield from _places(node[0], path + (0,))


def _other_values(value):
    if isinstance(value, bool):
        return [not value]
    if isinstance(value, int):
        return [0, 1, value + 1, value * 2]
    if isinstance(value, float):
        return [0.0, value * 10, value / 10, 100.0]
    if isinstance(value, str):
        return ["", "parity.results/1", "auto", "user", "fixed", "bfloat16"]
    if isinstance(value, list):
        return [[], value[:-1]]
    return [{}]


def test_no_one_field_edit_of_a_failing_run_rejudges_to_pass(parity_cli, tmp_path):
    """Every field of a failing run's file deleted, nulled or changed, one at a time, and one arm's
    whole answer copied into another: never exit 0, never a traceback."""
    from click.testing import CliRunner

    from parity.cli import cli

    _, doc, _ = parity_cli.run("--runner", "legacy", "--max-new-tokens", "3", name="legacy")
    path, runner = tmp_path / "edited.json", CliRunner()

    def verdict_of(edited) -> int:
        path.write_text(json.dumps(edited))
        result = runner.invoke(cli, ["verdict", str(path)])
        assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
        return result.exit_code

    tried = 0
    for place, value in list(_places(doc)):
        for change in [None, "delete", *_other_values(value)]:
            edited = json.loads(json.dumps(doc))
            holder = edited
            for key in place[:-1]:
                holder = holder[key]
            if change == "delete":
                holder.pop(place[-1])
            else:
                holder[place[-1]] = change
            assert verdict_of(edited) != 0, (place, change)
            tried += 1
    arms = doc["cases"][0]["arms"]
    for target in arms:
        for source in arms:
            if source != target:
                edited = json.loads(json.dumps(doc))
                for key in ("token_ids", "text", "token_logprobs", "top_logprobs"):
                    edited["cases"][0]["arms"][target][key] = arms[source][key]
                assert verdict_of(edited) != 0, (target, source)
                tried += 1
    assert tried > 500 and verdict_of(doc) == 1  # the negative control: the file as written is the FAIL
