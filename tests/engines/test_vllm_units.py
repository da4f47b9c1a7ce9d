"""The vLLM backend's parts without a server: command lines, capture sizes, the chat bodies and
answers, the tap on vLLM-shaped stand-ins, the plugin's import hook, and the leak verdict.

The same parts run against the real vLLM 0.33.0 code in test_vllm_real.py where it is installed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from parity.errors import UsageError
from parity.evidence import LeakWitness
from parity.results import write_results
from parity.trust.loader import load_results
from parity.engines.channel import TapChannel, TapEntry
from parity.engines.evidence import TaggedRequest, arm_evidence
from parity.engines.http import ServerRejected
from parity.judge.verdict import judge_run
from parity.engines.vllm import client, plugin, servers, tap as taps

from tests.engines.servers import REPO
from tests.helpers_runs import make_evidence, make_run, stream_case



# --- command lines and capture sizes ---------------------------------------------------------------------

def settings(**kwargs) -> servers.VllmSettings:
    return servers.VllmSettings(model="Qwen/Qwen3-VL-8B-Instruct", max_new_tokens=20, run_dir=Path("."), **kwargs)


@pytest.mark.parametrize("graph_mode, cudagraph, breakable", [
    ("full_and_piecewise", "FULL_AND_PIECEWISE", "0"), ("full", "FULL", "0"), ("piecewise", "PIECEWISE", "0"),
    ("breakable", "FULL_AND_PIECEWISE", "1"),
])
def test_the_servers_differ_only_in_the_cudagraph_mode(tmp_path: Path, graph_mode, cudagraph, breakable) -> None:
    s = settings(graph_mode=graph_mode, vllm_args=("--max-model-len", "4096"))
    sizes = s.capture.sizes_for([300])
    eager, graph = (servers.server_flags(s, m, 0.7, sizes) for m in ("eager", "bcg"))
    assert [f for f in graph if f not in eager] == [f"-cc.cudagraph_mode={cudagraph}"]
    assert "-cc.cudagraph_mode=NONE" in eager and "--enforce-eager" not in eager
    for needed in ("--no-enable-prefix-caching", "--seed", "--generation-config", "--cudagraph-capture-sizes"):
        assert needed in graph
    assert graph[graph.index("--generation-config") + 1] == "vllm"
    assert graph[-2:] == ("--max-model-len", "4096") and graph.count("--max-model-len") == 1  # the user's
    assert s.facts.max_model_len == 4096
    env = servers.server_env(s, TapChannel(tmp_path), servers.plan_launch(s).placements["bcg"])
    assert env[servers.BREAKABLE_ENV] == breakable and env[plugin.ENV_VAR] == str(tmp_path.resolve())


def test_each_serving_profile_sets_its_features_alike_in_both_servers() -> None:
    """design §10: the chunked profile's step budget is the chunk (and as many sequences at most);
    the prefix profile turns prefix caching on, reports cached tokens, and caches whole blocks of the
    scenario's page; the default servers never reuse a prefix."""
    s = settings(chunk_size=16)
    sizes = s.capture.sizes_for([300])
    for mode in ("eager", "bcg"):
        default, chunked, prefix = (servers.server_flags(s, mode, 0.7, sizes, p) for p in (None, "chunked", "prefix"))
        assert "--no-enable-prefix-caching" in default and "--enable-prefix-caching" not in default
        assert chunked[chunked.index("--max-num-batched-tokens") + 1] == "16" and chunked.count("--max-num-batched-tokens") == 1
        assert chunked[chunked.index("--max-num-seqs") + 1] == "16" and "--no-enable-prefix-caching" in chunked
        assert "--no-enable-prefix-caching" not in prefix and "--enable-prompt-tokens-details" in prefix
        assert prefix[prefix.index("--block-size") + 1] == "16"
    env = servers.server_env(s, TapChannel(Path("/tmp/x")), servers.plan_launch(s).placements["bcg"])
    assert env[servers.DEV_MODE_ENV] == "1"  # /reset_prefix_cache empties the cache around an ablated request


def test_capture_sizes_are_vllms_ladder_up_to_what_the_run_needs() -> None:
    assert [servers.ladder_ceiling(n) for n in (1, 2, 3, 5, 8, 9, 255, 256, 257, 300)] == \
        [1, 2, 4, 8, 8, 16, 256, 256, 272, 304]
    sizes = servers.CaptureSizes(None, None).sizes_for([41, 280])
    assert sizes[:5] == (1, 2, 4, 8, 16) and sizes[-2:] == (272, 288) and len(sizes) == 3 + 31 + 3
    capped = servers.CaptureSizes(None, 256)
    assert capped.sizes_for([280])[-1] == 256 and capped.bucket_of(280) is None and capped.bucket_of(250) == 256
    explicit = servers.CaptureSizes((64, 16), None)
    assert explicit.sizes_for([500]) == (16, 64) and explicit.bucket_of(17) == 64 and explicit.bucket_of(65) is None


@pytest.mark.parametrize("flag", ["-cc.cudagraph_mode=NONE", "-cc", "--compilation-config.mode=0", "-O0", "-O=2",
                                  "--optimization-level", "--enforce-eager", "--cudagraph-capture-sizes",
                                  "--max-cudagraph-capture-size=8", "--enable-prefix-caching", "--seed=1",
                                  "--gpu-memory-utilization", "--generation-config", "--port", "--model"])
def test_flags_parity_owns_are_refused(flag: str) -> None:
    with pytest.raises(UsageError, match="--vllm-arg may not set .*differ only in the CUDA-graph mode"):
        servers.split_vllm_args([f"--dtype bfloat16 {flag}"])


def test_user_flags_are_split_and_read_as_vllm_reads_them() -> None:
    args = servers.split_vllm_args(["-tp 2", "--pipeline-parallel-size=2", "--max-num-batched-tokens 16384",
                                    "--limit-mm-per-prompt", '{"image": 2}', "--otlp-traces-endpoint", "-1"])
    facts = servers.ServerFacts.parse(args)
    assert (facts.gpus_per_server, facts.max_batched_tokens, facts.max_model_len) == (4, 16384, 8192)
    counts = servers.ServerFacts.parse(servers.split_vllm_args(["--max-model-len 32k --max-num-batched-tokens=2K"]))
    assert (counts.max_model_len, counts.max_batched_tokens) == (32000, 2048)
    assert servers.ServerFacts.parse(servers.split_vllm_args(["--max-model-len auto"])).max_model_len is None
    with pytest.raises(UsageError, match="--max-model-len needs one count"):
        servers.ServerFacts.parse(servers.split_vllm_args(["--max-model-len lots"]))
    with pytest.raises(UsageError, match="-tp needs one integer"):
        servers.ServerFacts.parse(servers.split_vllm_args(["-tp two"]))
    with pytest.raises(UsageError, match="each vLLM server needs 4 GPUs .*--vllm-arg"):
        servers.plan_launch(settings(vllm_args=args, gpus=(0, 1)))
    with pytest.raises(UsageError, match="unknown --graph-mode 'fast'"):
        servers.graph_mode("fast")


def test_a_plugin_allowlist_keeps_parity_and_an_empty_one_names_it(tmp_path: Path, monkeypatch) -> None:
    placement = servers.plan_launch(settings()).placements["eager"]
    monkeypatch.setenv(servers.PLUGINS_ENV, "")  # vLLM: "" loads no plugin at all
    assert servers.server_env(settings(), TapChannel(tmp_path), placement)[servers.PLUGINS_ENV] == "parity"
    monkeypatch.setenv(servers.PLUGINS_ENV, "lora_filesystem_resolver")
    assert servers.server_env(settings(), TapChannel(tmp_path), placement)[servers.PLUGINS_ENV] == \
        "lora_filesystem_resolver,parity"
    monkeypatch.delenv(servers.PLUGINS_ENV)
    assert servers.PLUGINS_ENV not in servers.server_env(settings(), TapChannel(tmp_path), placement)


# --- the chat bodies and answers ---------------------------------------------------------------------------

def answer_doc(ids=(7, 8), prompt=(1, 2, 3)) -> dict:
    steps = [{"token": f"token_id:{t}", "logprob": -0.5, "top_logprobs": [{"token": f"token_id:{t}", "logprob": -0.5},
                                                                          {"token": "token_id:99", "logprob": -2.0}]}
             for t in ids]
    return {"choices": [{"message": {"content": "ab"}, "token_ids": list(ids), "logprobs": {"content": steps}}],
            "prompt_token_ids": list(prompt)}


def test_a_generation_answer_is_read_by_token_id() -> None:
    parsed = client.parse_completion(answer_doc())
    assert parsed.generation.token_ids == (7, 8) and parsed.prompt_ids == (1, 2, 3)
    assert parsed.generation.top_logprobs[0] == ((7, -0.5), (99, -2.0))
    bad = answer_doc()
    bad["choices"][0]["token_ids"] = [7, 9]
    with pytest.raises(ServerRejected, match="name different tokens"):
        client.parse_completion(bad)
    bad = answer_doc()
    bad["choices"][0]["logprobs"]["content"][0]["token"] = "hello"
    with pytest.raises(ServerRejected, match="garbles"):
        client.parse_completion(bad)


def test_scores_are_kept_only_where_the_server_scored_exactly_the_reference() -> None:
    doc = {"prompt_token_ids": [1, 2, 7, 8], "prompt_logprobs": [None, {"2": {"logprob": -1.0}},
                                                                 {"7": {"logprob": -0.25}}, {"8": {"logprob": -0.5}}]}
    assert client.parse_scores(doc, [7, 8]) == (-0.25, -0.5)
    assert client.parse_scores(doc, [7, 9]) is None  # re-tokenized into other tokens: no score, no tf delta
    with pytest.raises(ServerRejected, match="garbles"):
        client.parse_scores({"prompt_token_ids": [1, 2], "prompt_logprobs": [None]}, [2])
    body = client.score_body("Describe.", client.media_part(b"\0", is_video=False), "ab", "tag")
    assert body["continue_final_message"] and not body["add_generation_prompt"] and body["prompt_logprobs"] == 0
    assert body["messages"][0]["content"][0] == {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}}
    assert body["request_id"] == "tag"
    video = client.generate_body("Describe.", client.media_part(b"\0", is_video=True), 4, "v")
    assert video["messages"][0]["content"][0] == {"type": "video_url",
                                                  "video_url": {"url": "data:video/x-matroska;base64,AA=="}}


# --- the tap on vLLM-shaped objects ------------------------------------------------------------------------

class FakeModel:
    """Qwen3-VL's DeepStack buffers and setter, as vLLM 0.33 has them (3 levels of [16, 2])."""

    def __init__(self) -> None:
        self.deepstack_input_embeds = [torch.zeros(16, 2) for _ in range(3)]
        self.deepstack_input_embeds_num_tokens = 0

    def _set_deepstack_input_embeds(self, embeds) -> None:
        for level, buffer in enumerate(self.deepstack_input_embeds):
            buffer[:embeds.shape[1]].copy_(embeds[level])
        self.deepstack_input_embeds_num_tokens = embeds.shape[1]


class FakeState:
    def __init__(self, model, tap, embeds=None) -> None:
        self.model, self.embeds = model, embeds
        self.set = taps.wrap_setter(FakeModel._set_deepstack_input_embeds, tap)

    def prepare_inputs_embeds(self, scheduled, input_batch, req_states):
        if self.embeds is not None:
            self.set(self.model, self.embeds)
        return "inputs_embeds"


def step(tap, state, tokens: int, padded: int, mode: str | None, tag: str = "t1"):
    if mode is not None:
        manager = SimpleNamespace(use_breakable_cg=mode == "BREAKABLE")
        kind = "PIECEWISE" if mode == "BREAKABLE" else mode
        taps.wrap_dispatch(lambda m, *a: SimpleNamespace(cg_mode=SimpleNamespace(name=kind), num_tokens=padded),
                           tap)(manager)
    batch = SimpleNamespace(num_tokens=tokens, num_tokens_after_padding=padded, req_ids=[f"chatcmpl-{tag}-x"])
    return taps.wrap_step(FakeState.prepare_inputs_embeds, tap)(state, {}, batch, None)


def image_embeds() -> torch.Tensor:
    embeds = torch.zeros(3, 10, 2)  # [levels, tokens, hidden]: image rows 2..5
    embeds[:, 2:6] = torch.arange(1, 25, dtype=torch.float32).reshape(3, 4, 2)
    return embeds


def test_an_unarmed_tap_passes_through_and_records_nothing(tmp_path: Path) -> None:
    channel = TapChannel(tmp_path)
    channel.create()
    tap, model = taps.StepTap(channel, capturing=lambda: False), FakeModel()
    assert step(tap, FakeState(model, tap, image_embeds()), 10, 16, "FULL") == "inputs_embeds"
    assert float(model.deepstack_input_embeds[0].abs().sum()) > 0 and not channel.records_path.exists()


@pytest.mark.parametrize("control", ["record", "zero"])
def test_the_setter_is_fingerprinted_in_parity_layout_and_zeroed_for_the_zero_arm(tmp_path: Path, control) -> None:
    from parity.runner.tap import fingerprint

    channel = TapChannel(tmp_path)
    channel.create()
    channel.arm(control, "t1")
    tap, model = taps.StepTap(channel, capturing=lambda: False), FakeModel()
    step(tap, FakeState(model, tap, image_embeds()), 10, 16, "BREAKABLE")
    (entry,) = channel.entries("t1")
    rows = image_embeds().permute(1, 0, 2).reshape(10, 6)  # [tokens, hidden * levels]
    assert entry.record.sha256 == fingerprint(rows, "normal").sha256 and entry.record.nonzero_rows == 4
    assert (entry.mode, entry.replay, entry.tokens, entry.raw_tokens, entry.extend) == ("BREAKABLE", True, 16, 10, True)
    held = float(sum(level.abs().sum() for level in model.deepstack_input_embeds))
    assert (held == 0.0) is (control == "zero") and entry.record.action == ("zero" if control == "zero" else "normal")


def test_the_leak_witness_counts_real_rows_an_earlier_request_left(tmp_path: Path) -> None:
    channel = TapChannel(tmp_path)
    channel.create()
    tap, model = taps.StepTap(channel, capturing=lambda: False), FakeModel()
    channel.arm("record", "image")
    step(tap, FakeState(model, tap, image_embeds()), 10, 16, "FULL", tag="image")  # replayed: no clear runs
    channel.arm("record", "text")
    step(tap, FakeState(model, tap), 4, 8, "FULL", tag="text")  # reads rows 0..3: rows 2, 3 are the image's
    step(tap, FakeState(model, tap), 1, 1, None, tag="text")  # a decode step whose dispatch was not seen
    prefill, decode = channel.entries("text")
    assert (prefill.stale_rows, prefill.stale_source, prefill.uncleared, prefill.record) == (2, "image", 10, None)
    assert (decode.stale_rows, decode.replay, decode.extend) == (0, None, False)
    evidence = arm_evidence([TaggedRequest(4, False, (prefill, decode))], 16, {"image": "abc"})
    assert evidence.leak == LeakWitness(rows=2, steps=1, source_sha256="abc")
    assert evidence.inconsistency() is None
    # The image's own steps read only rows they wrote.
    assert channel.entries("image")[0].stale_rows == 0


def shrinking_stream_text(tmp_path: Path) -> TapEntry:
    """The shrinking stream through the tap: a long image request (rows 2..13 of 14), a shorter one
    over its first rows (rows 1..2 of 4), then 14 tokens of text; the text's prefill entry."""
    channel = TapChannel(tmp_path)
    channel.create()
    tap, model = taps.StepTap(channel, capturing=lambda: False), FakeModel()
    long_image = torch.zeros(3, 14, 2)
    long_image[:, 2:14] = 1.0  # rows 2..13
    short_image = torch.zeros(3, 4, 2)
    short_image[:, 1:3] = 2.0  # rows 1..2
    for tag, embeds in (("long", long_image), ("short", short_image)):
        channel.arm("record", tag)
        step(tap, FakeState(model, tap, embeds), embeds.shape[1], 16, "FULL", tag=tag)
    channel.arm("record", "text")
    step(tap, FakeState(model, tap), 14, 16, "FULL", tag="text")
    (text,) = channel.entries("text")
    return text


def test_the_leak_witness_names_the_request_that_left_most_of_the_rows(tmp_path: Path) -> None:
    """Each stale row's writer is the latest request whose rows reached it, so the tail is the long
    request's, not the last writer's."""
    text = shrinking_stream_text(tmp_path)
    # rows 1, 2 (short's) and 4..13 (the long request's tail; row 3 it left too, zeroed by short)
    assert (text.stale_rows, text.stale_source) == (12, "long")


# --- the plugin ---------------------------------------------------------------------------------------------

FAKE_VLLM = {
    "vllm/__init__.py": "",
    "vllm/v1/__init__.py": "", "vllm/v1/worker/__init__.py": "", "vllm/v1/worker/gpu/__init__.py": "",
    "vllm/v1/worker/gpu/cudagraph_utils.py": "class CudaGraphManager:\n    def dispatch(self, *a): return None\n",
    "vllm/v1/worker/gpu/model_states/__init__.py": "",
    "vllm/v1/worker/gpu/model_states/default.py":
        "class DefaultModelState:\n    def prepare_inputs_embeds(self, a, b, c): return 'embeds'\n",
    "vllm/model_executor/__init__.py": "", "vllm/model_executor/models/__init__.py": "",
    "vllm/model_executor/models/qwen3_vl.py": "class Qwen3VLForConditionalGeneration:\n    pass\n",
}
_PROBE = """
import json, sys
from parity.engines.vllm import plugin
plugin.register(); plugin.register()  # vLLM may load plugins more than once per process
from vllm.v1.worker.gpu.cudagraph_utils import CudaGraphManager
from vllm.v1.worker.gpu.model_states.default import DefaultModelState
from vllm.model_executor.models.qwen3_vl import Qwen3VLForConditionalGeneration as Q
print("WRAPPED=" + json.dumps([getattr(CudaGraphManager.dispatch, "__parity_tap__", False),
      getattr(DefaultModelState.prepare_inputs_embeds, "__parity_tap__", False),
      getattr(getattr(Q, "_set_deepstack_input_embeds", None), "__parity_tap__", False),
      getattr(DefaultModelState.prepare_inputs_embeds, "__wrapped__", None) is not None,
      sum(type(f).__name__ == "AfterImport" for f in sys.meta_path),
      "torch" in sys.modules]))
"""


@pytest.mark.parametrize("armed", [True, False])
def test_the_plugin_wraps_vllms_classes_as_they_are_imported_and_only_when_armed(tmp_path: Path, armed) -> None:
    for name, text in FAKE_VLLM.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    env = {k: v for k, v in os.environ.items() if k != plugin.ENV_VAR} | {"PYTHONPATH": f"{tmp_path}:{REPO}"}
    if armed:
        env[plugin.ENV_VAR] = str(tmp_path / "tap")
    proc = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, env=env, timeout=60)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("WRAPPED=")), None)
    assert line is not None, proc.stderr
    wrapped = json.loads(line.removeprefix("WRAPPED="))
    # This fake vLLM lacks the setter: the plugin says so in the server's log and serves on.
    assert wrapped == ([True, True, False, True, 1, False] if armed else [False, False, False, False, 0, False])
    assert ("parity: vllm.model_executor.models.qwen3_vl.Qwen3VLForConditionalGeneration._set_deepstack_input_embeds "
            "not found" in proc.stderr) is armed


def test_the_fix_is_activated_with_the_tap_armed_too(tmp_path: Path) -> None:
    """Both variables set (how parity starts a fixed server): the fix answers too; in this fake
    vLLM, without a release version, it refuses and records why where parity reads it."""
    from parity.engines import fix_records
    from parity.engines.vllm import deepstack_clear, versions

    for name, text in FAKE_VLLM.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}:{REPO}", plugin.ENV_VAR: str(tmp_path / "tap"),
           deepstack_clear.ENV_FIX: deepstack_clear.FIX}
    (tmp_path / "tap").mkdir()  # parity makes the channel folder before it starts a server
    proc = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, env=env, timeout=60)
    assert "WRAPPED=" in proc.stdout, proc.stderr
    (record,) = fix_records.read_records(tmp_path / "tap")
    assert record.refused and f"validated on vLLM {', '.join(versions.fix_accepted())}" in record.note


# --- the verdict ---------------------------------------------------------------------------------------------

def leaked_stream(rows: int = 12):
    """A stream whose graph sequence answers exactly as eager, but whose text-only request read
    rows the twin image's request left (the leak witness fired)."""
    case = stream_case()
    text_only = case.requests[3]
    bcg = text_only.arms[1]
    leak = LeakWitness(rows=rows, steps=2, source_sha256=case.requests[2].fixture.sha256)  # the twin image's
    arms = (text_only.arms[0], replace(bcg, evidence=replace(make_evidence("bcg", tap_calls=0), leak=leak)))
    requests = list(case.requests)
    requests[3] = replace(text_only, arms=arms)
    return replace(case, requests=tuple(requests))


def test_a_sequence_whose_leak_witness_fired_never_passes_even_with_equal_answers(tmp_path: Path) -> None:
    assert make_run([stream_case()], backend="vllm").verdict.code == "PASS"  # the control: no witness
    run = make_run([leaked_stream()], backend="vllm")
    assert run.verdict.code == "FAIL_STALE_STATE"
    assert run.cases[0].verdict.reason.startswith(
        "request 4 of 5 (text only): arm bcg_normal received 12 DeepStack row(s) left in the engine's buffer by "
        "request 3 (twin image"), run.cases[0].verdict.reason
    assert "in 2 step(s) (leak witness" in run.cases[0].verdict.reason
    # The witness is in the file and survives a round trip; a file without it (every older file) loads.
    write_results(run, tmp_path / "results.json")
    assert judge_run(load_results(tmp_path / "results.json")).verdict == run.verdict
    doc = json.loads((tmp_path / "results.json").read_text())
    assert doc["cases"][0]["requests"][3]["arms"]["bcg_normal"]["evidence"]["leak"]["rows"] == 12
    assert "leak" not in doc["cases"][0]["requests"][0]["arms"]["bcg_normal"]["evidence"]
    from parity.reporting.report import render_markdown

    report = render_markdown(run)
    assert "received 12 DeepStack row(s)" in report and "LEAK WITNESS: 12 stale DeepStack row(s) read in 2" in report


def test_a_leak_witness_that_contradicts_its_counts_is_refused(tmp_path: Path) -> None:
    from parity.errors import ResultsFileError

    write_results(make_run([leaked_stream()], backend="vllm"), tmp_path / "results.json")
    doc = json.loads((tmp_path / "results.json").read_text())
    doc["cases"][0]["requests"][3]["arms"]["bcg_normal"]["evidence"]["leak"]["steps"] = 999
    (tmp_path / "bad.json").write_text(json.dumps(doc))
    with pytest.raises(ResultsFileError, match="leak witness"):
        load_results(tmp_path / "bad.json")


# --- the command line ----------------------------------------------------------------------------------------

def test_the_documented_command_exits_2_with_one_line_where_vllm_or_a_gpu_is_missing(parity_cli) -> None:
    result, doc, _ = parity_cli.run("--backend", "vllm", "--model", "Qwen/Qwen3-VL-8B-Instruct", "--scenario", "all",
                                    "--graph-mode", "full")
    lines = result.output.strip().splitlines()
    assert result.exit_code == 2 and doc is None and len(lines) == 1, result.output
    assert lines[0].startswith("Error: ") and ("vLLM is not installed" in lines[0] or "needs a CUDA GPU" in lines[0])


@pytest.mark.parametrize("args, message", [
    (("--backend", "vllm", "--model", "Qwen/Qwen3-VL-8B-Instruct", "--vllm-arg", "-O0"), "--vllm-arg may not set -O"),
    (("--backend", "vllm"), "embedded preset"),
])
def test_vllm_options_are_checked_before_anything_starts(parity_cli, args, message) -> None:
    result, _, _ = parity_cli.run(*args, device=None)  # an embedded preset is served on the CPU only
    assert result.exit_code == 2 and message in result.output, result.output


def test_importing_parity_and_its_vllm_backend_never_imports_vllm() -> None:
    code = "import sys, parity.cli, parity.engines.vllm.backend, parity.engines.vllm.plugin; print('vllm' in sys.modules)"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env=os.environ | {"PYTHONPATH": str(REPO)})
    assert proc.stdout.strip() == "False", proc.stderr
