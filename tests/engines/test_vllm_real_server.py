"""parity against real vLLM servers (each supported release, versions.py) on this CPU: vLLM's own `CudaGraphManager` (FULL) and
breakable wrapper capturing and replaying through parity's emulated graph (docs/vllm-runbook.md,
"On a CPU"; docs/engines/vllm-cpu.md).

Marked `real_vllm`; skipped, with the reason, where no supported vLLM is installed. `.ci/run` runs
them in its vLLM stage, in an environment outside the repository. Each run starts two real
servers, one after the other (about 40 s each to start on 2 cores): the released runner in both
graph modes (the leak), parity's `deepstack-clear` fix in both, vLLM's default mode with its
piecewise compile, a configuration the stand-in attention cannot compute (an `ERROR` naming the
op), a server forced onto the V1 runner, and the MoE and Qwen3-Omni presets, released and fixed.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from parity.arms import BCG_NORMAL, BCG_ZERO, EAGER_NORMAL, EAGER_ZERO
from parity.engines.vllm import deepstack_clear, servers, versions
from parity.engines.vllm.freshness import STANDIN_METADATA
from tests.engines.servers import installed, real_vllm_marks

_FOUND = installed("vllm")

pytestmark = real_vllm_marks()
MAX_NEW_TOKENS = 8
IMAGE_TOKENS = 12  # the rgb-stripes fixture's visual tokens in the tiny preset: the rows a leak leaves


def parity_run(out: Path, *args: str):
    from click.testing import CliRunner

    from parity.cli import cli

    result = CliRunner().invoke(cli, ["run", "--backend", "vllm", "--device", "cpu", "--out", str(out), "--no-plot",
                                      "--max-new-tokens", str(MAX_NEW_TOKENS), *args],
                                catch_exceptions=False, prog_name="parity")
    doc = json.loads((out / "results.json").read_text()) if (out / "results.json").exists() else None
    return result, doc


def assert_no_server_left() -> None:
    """The servers these tests started (their process groups), not every vLLM server on the machine:
    a neighbour's job may serve beside them."""
    from parity.engines.launcher import groups_left_running

    left = groups_left_running()
    assert not left, f"vLLM server process groups left running: {left}"


RUNS: dict[tuple[str, bool], tuple] = {}


CORE = ("--scenario", "four-arm", "--scenario", "reuse", "--scenario", "stream")


def run_of(tmp_path_factory, graph_mode: str, fixed: bool):
    """One run per (graph mode, fix), shared by the tests that read it: the FULL mode over every
    scenario (the bug family's three server profiles, design §10), breakable over the core three."""
    key = (graph_mode, fixed)
    if key not in RUNS:
        out = tmp_path_factory.mktemp(f"{graph_mode}-{'fixed' if fixed else 'released'}")
        fix = ("--vllm-fix", deepstack_clear.FIX) if fixed else ()
        scenarios = ("--scenario", "all") if graph_mode == "full" else CORE
        RUNS[key] = (out, *parity_run(out, "--graph-mode", graph_mode, *scenarios, *fix))
    return RUNS[key]


def core_cases(doc: dict) -> list[dict]:
    return [c for c in doc["cases"] if c["scenario"] in ("four-arm", "reuse", "stream")]


@pytest.mark.parametrize("graph_mode", ["full", "breakable"])
def test_released_leaks_an_images_deepstack_into_later_text_requests(tmp_path_factory, graph_mode) -> None:
    out, result, doc = run_of(tmp_path_factory, graph_mode, fixed=False)
    assert result.exit_code == 1, result.output[-3000:]
    assert doc["verdict"]["code"] == "FAIL_STALE_STATE", doc["verdict"]
    codes = {c["scenario"]: c["verdict"]["code"] for c in core_cases(doc)}
    assert codes == {"four-arm": "PASS", "reuse": "FAIL_STALE_STATE", "stream": "FAIL_STALE_STATE"}
    stream = next(c for c in doc["cases"] if c["scenario"] == "stream")
    # The freshness witness names the input, the rows and the request that left them.
    assert "(text only)" in stream["verdict"]["reason"] and "read deepstack rows [6, 7, 8" in stream["verdict"]["reason"] \
        and "that request 3 (twin image" in stream["verdict"]["reason"], stream["verdict"]
    text_only = next(r for r in stream["requests"] if r["fixture"] is None)
    graph = next(a for a in text_only["arms"].values() if a["mode"] == "bcg")
    eager = next(a for a in text_only["arms"].values() if a["mode"] == "eager")
    assert graph["evidence"]["leak"]["rows"] == IMAGE_TOKENS  # the witness, from the model process
    assert graph["evidence"]["prefill_replayed"] is True  # vLLM's own dispatcher replayed it
    assert graph["token_ids"] != eager["token_ids"]  # and the answer really moved
    config = doc["config"]
    assert config["vllm_device"] == "cpu" and config["vllm_graph_backend"] == "emulated"
    assert config["vllm_compile_mode"] == "none" and config["vllm_fix"] is None
    assert all("VLLM::Worker" in p[0] for p in config["vllm_tap_processes"].values())
    assert doc["environment"]["vllm"] == _FOUND
    log = (out / "vllm-bcg.log").read_text()
    assert "Capturing CUDA graphs" in log  # vLLM's own words
    if versions.release(_FOUND).v1_runner:  # a release with V1 to fall back to is told to use V2, and says so
        assert config["vllm_server_env"]["bcg"][servers.V2_ENV] == "1" and "Using V2 Model Runner" in log
    else:  # 0.34 has V2 alone, and calls the variable redundant
        assert servers.V2_ENV not in config["vllm_server_env"]["bcg"] and "is redundant" not in log
    assert not list(out.glob("*.standin-calls.jsonl"))  # no unfaithful stand-in call
    assert "localization is not available on the vllm backend" in result.output
    assert_no_server_left()


@pytest.mark.parametrize("graph_mode", ["full", "breakable"])
def test_the_fix_passes_every_scenario_and_leaves_eager_untouched(tmp_path_factory, graph_mode) -> None:
    out, result, doc = run_of(tmp_path_factory, graph_mode, fixed=True)
    # FULL runs the family too, two of whose paths vLLM has no way to reach: INCONCLUSIVE, exit 3.
    assert result.exit_code == (3 if graph_mode == "full" else 0), result.output[-3000:]
    assert [c["verdict"]["code"] for c in core_cases(doc)] == ["PASS", "PASS", "PASS"], doc["verdict"]
    for case in core_cases(doc)[1:]:
        for request in case["requests"]:
            assert all(a["evidence"].get("leak") is None for a in request["arms"].values()), request["label"]
    notes = {r["note"] for records in doc["config"]["vllm_fix_records"].values() for r in records}
    assert {"wrapped DefaultModelState.prepare_inputs_embeds",
            "wrapped Qwen3VLForConditionalGeneration._set_deepstack_input_embeds"} <= notes
    _, _, released = run_of(tmp_path_factory, graph_mode, fixed=False)
    for fixed_case, released_case in zip(doc["cases"], released["cases"]):  # the fix never moves an eager answer
        assert eager_answers(fixed_case) == eager_answers(released_case), fixed_case["id"]
    four = doc["cases"][0]["arms"]
    assert four[BCG_NORMAL]["token_ids"] == four[EAGER_NORMAL]["token_ids"]
    assert four[BCG_ZERO]["token_ids"] == four[EAGER_ZERO]["token_ids"] != four[EAGER_NORMAL]["token_ids"]
    assert_no_server_left()


def case_of(doc: dict, scenario: str) -> dict:
    return next(c for c in doc["cases"] if c["scenario"] == scenario)


def serving_of(case: dict, request: int) -> dict:
    arms = case["requests"][request]["arms"].values()
    return next(a for a in arms if a["mode"] == "bcg" and a["deepstack"] == "normal")["evidence"]["serving"]


UNREACHABLE = {"growth": "sizes its DeepStack buffers once", "layout": "-cc.cudagraph_mm_encoder",
               "batch": "one at a time"}


def test_released_leaks_on_every_family_path_it_reaches_in_full_mode(tmp_path_factory) -> None:
    """Findings (docs/scenarios.md): under FULL replay the stale DeepStack reaches a request's own
    later chunks (a text-only chunk reads the rows its image chunk left) and the suffix after a
    prefix-cache hit; the warm-up text request reads rows at its scoring."""
    _, _, doc = run_of(tmp_path_factory, "full", fixed=False)
    codes = {c["scenario"]: c["verdict"]["code"] for c in doc["cases"]}
    leaked = ("reuse", "stream", "shrink", "chunked", "prefix", "growth", "warmup", "batch")
    assert codes == {"four-arm": "PASS", **dict.fromkeys(leaked, "FAIL_STALE_STATE"),
                     "layout": "INCONCLUSIVE_NOT_REPLAYED"}, codes
    reasons = {c["scenario"]: c["verdict"]["reason"] for c in doc["cases"]}
    assert "request 1 of 3 (image, in chunks)" in reasons["chunked"] and "that its own earlier steps left" in reasons["chunked"]
    assert "request 2 of 3 (image, question extended" in reasons["prefix"] and "that request 1 (" in reasons["prefix"]
    assert "served before this one was scored" in reasons["warmup"], reasons["warmup"]
    assert UNREACHABLE["layout"] in reasons["layout"]


def test_the_fix_passes_every_family_path_vllm_reaches_with_its_own_evidence(tmp_path_factory) -> None:
    _, _, doc = run_of(tmp_path_factory, "full", fixed=True)
    codes = {c["scenario"]: c["verdict"]["code"] for c in doc["cases"]}
    assert codes == {**dict.fromkeys(("four-arm", "reuse", "stream", "shrink", "chunked", "prefix", "warmup"), "PASS"),
                     **dict.fromkeys(UNREACHABLE, "INCONCLUSIVE_NOT_REPLAYED")}, codes
    for scenario, why in UNREACHABLE.items():
        assert why in case_of(doc, scenario)["verdict"]["reason"]
    servers_run = doc["config"]["vllm_servers"]
    chunk_flags = servers_run["bcg-chunked"]
    assert chunk_flags[chunk_flags.index("--max-num-batched-tokens") + 1] == "8"
    assert "--enable-prefix-caching" in servers_run["bcg-prefix"] and "--no-enable-prefix-caching" in servers_run["bcg"]
    chunks = serving_of(case_of(doc, "chunked"), 0)["chunks"]  # vLLM's own scheduler chunked it, FULL replayed each
    assert len([c for c in chunks if c[3]]) >= 2 and all(c[2] is not None for c in chunks), chunks
    prefix = case_of(doc, "prefix")
    assert serving_of(prefix, 0)["cached_tokens"] == 0
    hit = serving_of(prefix, 2)  # a whole-block hit that ends inside the image: its rest is in the suffix
    assert hit["cached_tokens"] > 0 and hit["chunks"][0][3] > 0 and hit["chunks"][0][2] is not None, hit
    assert serving_of(case_of(doc, "warmup"), 1)["graph_ready"] is True


def test_the_shrinking_stream_reads_the_long_request_s_tail_and_the_fix_clears_it(tmp_path_factory) -> None:
    """Issue 44 on the real engine (FULL): after a long image request and a shorter one, a text
    request as long as the first reads the rows past the shorter one's, which the long request
    left; with the fix, every request answers as eager."""
    _, _, released = run_of(tmp_path_factory, "full", fixed=False)
    case = case_of(released, "shrink")
    reason = case["verdict"]["reason"]
    assert case["verdict"]["code"] == "FAIL_STALE_STATE", case["verdict"]
    assert reason.startswith("request 3 of 3 (text only") and "that request 1 (large image" in reason, reason
    text = next(a for a in case["requests"][2]["arms"].values() if a["mode"] == "bcg" and a["deepstack"] == "normal")
    assert text["evidence"]["prefill_replayed"] is True  # the text request replayed, in the large image's bucket
    _, _, fixed = run_of(tmp_path_factory, "full", fixed=True)
    assert case_of(fixed, "shrink")["verdict"]["code"] == "PASS"
    assert eager_answers(case_of(fixed, "shrink")) == eager_answers(case)  # the fix leaves eager untouched


def test_vllms_default_mode_compiles_piecewise_graphs_and_passes_every_scenario(tmp_path: Path) -> None:
    """full_and_piecewise (the default): vLLM's piecewise compile with dynamo's eager backend, its
    CUDAGraphWrapper pieces and FULL decode graphs replayed through the emulation; the clear runs
    in Python between the pieces, so no leak, as the code says."""
    result, doc = parity_run(tmp_path, *CORE)
    assert result.exit_code == 0, result.output[-3000:]
    assert [c["verdict"]["code"] for c in doc["cases"]] == ["PASS", "PASS", "PASS"], doc["verdict"]
    assert doc["config"]["vllm_compile_mode"] == servers.CPU_COMPILE_PIECEWISE
    assert doc["cases"][0]["arms"][BCG_NORMAL]["evidence"]["prefill_replayed"] is True
    log = (tmp_path / "vllm-bcg.log").read_text()
    assert "Capturing CUDA graphs (PIECEWISE)" in log and "Capturing CUDA graphs (FULL)" in log
    assert_no_server_left()


def eager_answers(case: dict) -> list:
    arms = [case["arms"]] if "arms" in case else [r["arms"] for r in case["requests"]]
    return [a["token_ids"] for group in arms for a in group.values() if a["mode"] == "eager"]


def test_a_configuration_the_standin_attention_cannot_compute_is_an_error_naming_the_op(tmp_path: Path) -> None:
    """A sliding window: the stand-in attention never approximates it; the run says which op."""
    result, doc = parity_run(tmp_path, "--graph-mode", "full",
                             "--vllm-arg", """--hf-overrides '{"text_config": {"sliding_window": 16}}'""")
    assert result.exit_code == 4, result.output[-3000:]
    assert doc["verdict"]["code"] == "ERROR", doc["verdict"]
    assert "torch.ops._C.cpu_attention_with_kv_cache (sliding_window)" in doc["verdict"]["reason"], doc["verdict"]
    assert_no_server_left()


@pytest.mark.skipif(not versions.nearest(_FOUND).v1_runner, reason="this vLLM has no V1 model runner (0.34 removed it)")
def test_a_server_on_the_v1_runner_is_an_error_that_says_so(tmp_path: Path, monkeypatch) -> None:
    real_env = servers.cpu_env
    monkeypatch.setattr(servers, "cpu_env", lambda *a: {**real_env(*a), servers.V2_ENV: "0"})
    result, doc = parity_run(tmp_path, "--graph-mode", "full")
    assert result.exit_code == 4, result.output[-3000:]
    assert doc["verdict"]["code"] == "ERROR" and "vLLM built its V1 model runner" in doc["verdict"]["reason"], \
        doc["verdict"]
    assert_no_server_left()


# --- video (design §12): a lossless file at vLLM's 2 fps, one video_url part --------------------------------

VIDEO_RUNS: dict[bool, tuple] = {}


def video_run(tmp_path_factory, fixed: bool):
    if fixed not in VIDEO_RUNS:
        out = tmp_path_factory.mktemp(f"video-{'fixed' if fixed else 'released'}")
        fix = ("--vllm-fix", deepstack_clear.FIX) if fixed else ()
        VIDEO_RUNS[fixed] = (out, *parity_run(out, "--graph-mode", "full", "--video", "video-bouncing-bar",
                                              "--scenario", "stream", "--scenario", "prefix", *fix))
    return VIDEO_RUNS[fixed]


def test_released_leaks_a_videos_deepstack_even_past_a_hit_over_all_its_rows(tmp_path_factory) -> None:
    out, result, doc = video_run(tmp_path_factory, fixed=False)
    assert result.exit_code == 1, result.output[-3000:]
    assert {c["scenario"]: c["verdict"]["code"] for c in doc["cases"]} == dict.fromkeys(("stream", "prefix"),
                                                                                        "FAIL_STALE_STATE")
    assert doc["cases"][0]["fixture"]["frames"] == 5
    # The extended question's hit covers every video row: its suffix has none of its own to compute,
    # and what the graph reads there is the earlier request's, left in the buffer.
    hit = serving_of(case_of(doc, "prefix"), 1)
    assert hit["cached_tokens"] >= hit["image_span"][1] and hit["chunks"][0][3] == 0, hit
    assert "request 2 of 3" in case_of(doc, "prefix")["verdict"]["reason"]
    assert sorted(p.suffix for p in (out / "media").iterdir()) == [".mkv", ".mkv"]  # the video and its twin
    assert_no_server_left()


def test_the_fix_passes_a_video_and_a_hit_over_all_its_rows(tmp_path_factory) -> None:
    _, result, doc = video_run(tmp_path_factory, fixed=True)
    assert result.exit_code == 0, result.output[-3000:]
    assert [c["verdict"]["code"] for c in doc["cases"]] == ["PASS", "PASS"], doc["verdict"]
    hit = serving_of(case_of(doc, "prefix"), 1)
    assert hit["cached_tokens"] >= hit["image_span"][1], hit
    for case in doc["cases"]:
        for request in case["requests"]:
            assert all(a["evidence"].get("leak") is None for a in request["arms"].values()), request["label"]
    assert_no_server_left()


def run_variant(tmp_path: Path, model: str, variant: str, scenario: str):
    """One case of `scenario` on `rgb-stripes` on real CPU servers (`full`) running the fix's test-only
    `variant` (the CLI offers the fix proper only: the variant goes to the backend directly)."""
    from parity.arms import select_arms
    from parity.backends.options import BackendOptions
    from parity.media.catalog import builtin_fixture
    from parity.media.fixtures import default_prompts
    from parity.registry import create_backend
    from parity.run.experiment import run_experiment
    from parity.run.planning import CaseSpec, RunSpec

    fixture = builtin_fixture("rgb-stripes")
    spec = RunSpec(model=model, arms=select_arms("all"), cases=(CaseSpec(fixture, default_prompts(fixture)[0]),),
                   scenarios=(scenario,), max_new_tokens=MAX_NEW_TOKENS)
    options = BackendOptions(name="vllm", model=model, device="cpu", engine={"vllm_fix": variant, "graph_mode": "full"})
    backend = create_backend(options, MAX_NEW_TOKENS, tmp_path)
    try:
        return run_experiment(spec, backend, warn=lambda _: None)
    finally:
        backend.close()


# --- MoE and Qwen3-Omni (issue 54): vLLM's CPU experts through parity's stand-ins (cpu_ops,
# docs/engines/vllm-cpu.md §8); Qwen3-Omni saved as the whole model vLLM serves (its thinker inside) ---------

MEDIA = ("--graph-mode", "full", "--fixture", "rgb-stripes", "--video", "video-bouncing-bar", "--scenario",
         "four-arm", "--scenario", "reuse")
MODELS = ("tiny-qwen3-vl-moe", "tiny-qwen3-omni")


def assert_self_checks_held(doc: dict) -> None:
    """No arm failed parity's check of its own results: teacher forcing agreed with generation at the
    fp32 floor (the stand-in experts read no count on the host, so a replay routes its own rows)."""
    errors = [a["error"] for c in doc["cases"] for group in (c, *c.get("requests", ()))
              for a in (group.get("arms") or {}).values() if a.get("error")]
    assert errors == [], errors[:2]


@pytest.mark.parametrize("model", MODELS)
def test_released_leaks_a_moe_model_s_deepstack_on_images_and_video(tmp_path: Path, model: str) -> None:
    result, doc = parity_run(tmp_path, "--model", model, *MEDIA)
    assert result.exit_code == 1, result.output[-3000:]
    assert_self_checks_held(doc)
    codes = {(c["scenario"], c["fixture"]["name"]): c["verdict"]["code"] for c in doc["cases"]}
    # A four-arm case serves one image per server, so nothing earlier can leak into it; reuse's text
    # follow-up reads the rows its image request left.
    assert codes == {("four-arm", "rgb-stripes"): "PASS", ("four-arm", "video-bouncing-bar"): "PASS",
                     ("reuse", "rgb-stripes"): "FAIL_STALE_STATE",
                     ("reuse", "video-bouncing-bar"): "FAIL_STALE_STATE"}, codes
    assert_no_server_left()


@pytest.mark.parametrize("model", MODELS)
def test_the_fix_passes_a_moe_model_on_images_and_video(tmp_path: Path, model: str) -> None:
    result, doc = parity_run(tmp_path, "--model", model, *MEDIA, "--vllm-fix", deepstack_clear.FIX)
    assert result.exit_code == 0, result.output[-3000:]
    assert_self_checks_held(doc)
    assert [c["verdict"]["code"] for c in doc["cases"]] == ["PASS"] * 4, doc["verdict"]
    assert all(a["evidence"].get("leak") is None for c in doc["cases"] for r in c.get("requests", ())
               for a in r["arms"].values())
    assert_no_server_left()


def test_a_clear_that_skips_the_omni_thinker_is_caught(tmp_path: Path) -> None:
    """The planted Omni bug (`deepstack-clear-skip-thinker`): the setter is wrapped, so the fix looks in
    place, but the clear passes over the thinker's buffers; the text follow-up reads the image's rows."""
    (case,) = run_variant(tmp_path, "tiny-qwen3-omni", deepstack_clear.SKIP_THINKER, "reuse").cases
    assert case.verdict.code == "FAIL_STALE_STATE", case.verdict.reason
    assert "(text only)" in case.verdict.reason, case.verdict.reason
    assert_no_server_left()


# The freshness witness (design §6, "Inside vLLM"): what a FULL graph of tiny-qwen3-vl reads on this CPU.
JUDGED = {"input_embeds", "mrope_positions", "slot_mapping", "query_start_loc", "seq_lens", "block_table[0]", "deepstack"}


def test_the_witness_lists_every_input_of_every_replayed_graph_and_the_fix_keeps_each_fresh(tmp_path_factory) -> None:
    _, _, doc = run_of(tmp_path_factory, "full", fixed=True)
    four = doc["cases"][0]["arms"][BCG_NORMAL]["evidence"]["freshness"]
    graphs = {r["graph"] for r in four}
    assert {g.split(" (")[0].split()[0] for g in graphs} == {"prefill", "decode"} and all(g.endswith("(full)") for g in graphs)
    for graph in graphs:
        inputs = {r["input"] for r in four if r["graph"] == graph}
        assert JUDGED <= inputs, (graph, inputs)
        assert inputs - JUDGED <= {STANDIN_METADATA}, inputs  # the stand-in attention's, listed
    for case in doc["cases"]:
        for request in case.get("requests") or [case]:
            for arm in request["arms"].values():
                stale = [r for r in (arm.get("evidence") or {}).get("freshness", ()) if r["stale"] + r["unwritten"] + r["miswritten"]]
                assert not stale, (case["id"], arm.get("name"), stale)


@pytest.mark.parametrize("variant, name", [("deepstack-clear-mrope-stale", "mrope_positions"),
                                           ("deepstack-clear-embeds-stale", "input_embeds")])
def test_a_refresh_planted_stale_in_vllms_runner_is_caught_and_named_by_the_witness(tmp_path: Path, variant, name) -> None:
    (case,) = run_variant(tmp_path, "tiny-qwen3-vl", variant, "four-arm").cases
    assert case.verdict.code == "FAIL_STALE_STATE", case.verdict.reason
    assert f"read {name} rows" in case.verdict.reason and "freshness witness" in case.verdict.reason
    offending = {r.input for arm in case.all_arms() if arm.evidence for r in arm.evidence.freshness if not r.fresh}
    assert offending == {name}, offending  # the planted input alone
    assert_no_server_left()
