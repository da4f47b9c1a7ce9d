"""Every command through CliRunner: outputs, exit codes, and one-line errors for bad input."""

import json

import pytest

from parity.cli import cli
from parity.errors import UsageError

COMMANDS = ["run", "verdict", "report", "localize", "compare", "fixtures", "arms", "models"]


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_has_help(parity_cli, command):
    result = parity_cli(command, "--help")
    assert result.exit_code == 0
    first_paragraph = " ".join(cli.commands[command].help.split("\n\n")[0].split())
    assert first_paragraph and first_paragraph in " ".join(result.output.split())
    assert f"Usage: parity {command}" in result.output


def test_top_level_help_documents_exit_codes(parity_cli):
    result = parity_cli("--help")
    text = " ".join(result.output.split())
    assert result.exit_code == 0 and "0 PASS, 1 FAIL_*, 2 usage error" in text
    assert "130 interrupted (Ctrl-C), 143 terminated (SIGTERM)" in text
    assert set(COMMANDS) <= set(cli.commands)


def test_sglang_options_on_the_transformers_backend_warn(parity_cli, monkeypatch):
    import parity.run_command

    def stop(*args):
        raise UsageError("stopped before loading")

    monkeypatch.setattr(parity.run_command, "create_backend", stop)
    result, _, _ = parity_cli.run("--gpus", "0,1", "--concurrent", "--mem-fraction", "0.5")
    warnings = [line for line in result.stderr.splitlines() if line.startswith("warning:")]
    assert warnings == ["warning: --concurrent, --gpus, --mem-fraction only apply to --backend sglang or vllm; "
                        "ignored with --backend transformers"]
    result, _, _ = parity_cli.run("--backend", "sglang", "--graph-mode", "full", "--vllm-arg", "-tp 2", "--gpus", "0")
    warnings = [line for line in result.stderr.splitlines() if line.startswith("warning:")]
    assert warnings == ["warning: --vllm-arg, --graph-mode only apply to --backend vllm; ignored with --backend sglang"]
    result, _, _ = parity_cli.run()
    assert "warning" not in result.stderr  # nothing given, nothing said


def test_a_large_plan_says_its_size_before_it_starts(parity_cli, monkeypatch, tmp_path):
    import parity.run_command
    from parity.run.planning import RunSpec, planned_arm_runs

    started = []
    monkeypatch.setattr(parity.run_command, "create_backend", lambda *a: started.append(1) or (_ for _ in ()).throw(
        UsageError("stopped before loading")))
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(f"prompt {i}" for i in range(30)))
    result, _, _ = parity_cli.run("--fixture", "all", "--prompts", str(prompts), "--scenario", "all",
                                  "--max-new-tokens", "20")
    from parity.media.fixtures import builtin_fixtures

    from parity.design import SEQUENCE_REQUESTS

    # four-arm 4; each sequence's requests x 2 modes, and its eager power arm
    runs = len(builtin_fixtures()) * 30 * (4 + sum(len(r) * 2 + 1 for r in SEQUENCE_REQUESTS.values()))
    note = f"{runs} arm runs planned, roughly "
    assert note in result.stderr and "minutes on a CPU" in result.stderr and started
    assert result.output.index(note) < result.output.index("stopped before loading")
    result, _, _ = parity_cli.run("--fixture", "all", "--prompts", str(prompts), "--model", "Qwen/Qwen3-VL-8B-Instruct")
    assert f"{len(builtin_fixtures()) * 30 * 4} arm runs planned (each a full generation" in result.stderr
    assert "planned" not in parity_cli.run("--scenario", "all")[0].stderr  # an ordinary plan says nothing
    assert planned_arm_runs(RunSpec("m", (), (), repeat=3)) == 0


def test_version(parity_cli):
    from parity import __version__

    result = parity_cli("--version")
    assert result.exit_code == 0 and result.output.strip() == f"parity {__version__}"


def test_listing_commands(parity_cli, tmp_path):
    assert "bcg_zero_deepstack" in parity_cli("arms").output
    models = parity_cli("models").output
    assert all(name in models for name in ("tiny-qwen3-vl ", "tiny-qwen3-vl-moe", "tiny-qwen3-vl-nodeepstack"))
    result = parity_cli("fixtures", "--write", str(tmp_path / "pngs"))
    assert result.exit_code == 0 and "rgb-stripes" in result.output and "128x96" in result.output
    from parity.media.fixtures import builtin_fixtures

    written = {p.name for p in (tmp_path / "pngs").iterdir()}
    assert {f"{f.name}.png" for f in builtin_fixtures()} | {f"{f.twin().name}.png" for f in builtin_fixtures()} == written


def _one_line_error(result, code=2):
    assert result.exit_code == code, result.output
    assert "Traceback" not in result.output
    return result.output


@pytest.mark.parametrize("args, message", [
    (["--model", "no-such-model-anywhere"], "its config cannot be loaded"),
    (["--arms", "eager_normal,warp"], "unknown arm warp"),
    (["--fixture", "plaid"], "unknown fixture 'plaid'"),
    (["--image", "/nonexistent/cat.png"], "no such file"),
    (["--max-new-tokens", "0"], "must be > 0"),
    (["--max-new-tokens", "-3"], "must be > 0"),
    (["--logprob-tol", "-0.1"], "finite number >= 1e-05"),
    (["--logprob-tol", "1e-9"], "finite number >= 1e-05"),
    (["--logprob-tol", "nan"], "finite number >= 1e-05"),
    (["--logprob-tol", "inf"], "finite number >= 1e-05"),
    (["--logprob-tol", "1e-6"], "finite number >= 1e-05"),  # v2's floor: below the fp32 noise of an AVX2 CPU
    (["--logprob-tol", "tight"], "expected 'auto' or a number"),
    (["--tie-margin", "nan"], "finite number >= 0"),
    (["--tie-margin", "-0.1"], "finite number >= 0"),
    (["--fixture", "all", "--fixture", "nope"], "unknown fixture 'nope'"),
    (["--max-new-tokens", "100000"], "exceeds the model's context of 4096 positions"),
    (["--prompt", "describe the colors " * 1000], "exceeds the model's context"),
    (["--threads", "0"], "must be between 1 and this machine's"),
    (["--threads", "1000000"], "must be between 1 and this machine's"),
    (["--buckets", ""], "expected auto or a comma list of bucket sizes"),
    (["--buckets", "0,16"], "bucket sizes must be > 0"),
    (["--buckets", "100000"], "--buckets 100000: larger than the model's context of 4096 positions"),
    (["--seed", str(2**64)], "is not in the range 0<=x<=9223372036854775807"),
    (["--seed", "-1"], "is not in the range"),
    (["--arms", "all,bcg_normal"], "`all` already names every arm"),
    (["--arms", " , "], "expected `all` or a comma list of arm names"),
    (["--model", ""], "'--model': must not be empty"),
    (["--out", ""], "'--out': must not be empty; leave --out out"),
    (["--junit", " "], "'--junit': must not be empty"),
    (["--arms", "bcg_normal,eager_normal", "--scenario", "stream"], "needs all arms; give --arms all"),
    (["--arms", "eager_normal", "--scenario", "all"], "needs all arms"),
    (["--seed", "3", "--model", "Qwen/Qwen3-VL-8B-Instruct"], "a seed builds an embedded preset"),
    (["--repeat", "0"], "0 is not in the range 1<=x<=100"),
    (["--repeat", "101"], "101 is not in the range 1<=x<=100"),
    (["--buckets", "16,x"], "comma list of integers"),
    (["--device", "tpu"], "Invalid value"),
    (["--prompt", "  "], "must not be empty"),
    (["--prompts", "/nonexistent/prompts.txt"], "cannot be read"),
])
def test_run_bad_input_is_a_usage_error(parity_cli, monkeypatch, args, message):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    result, doc, out = parity_cli.run(*args)
    assert message in _one_line_error(result)
    assert doc is None and not out.exists()  # refused before anything was written


def test_bad_images_are_usage_errors_that_leave_no_files(parity_cli, tmp_path, monkeypatch):
    from PIL import Image

    (tmp_path / "fake.png").write_text("hello")
    Image.new("RGB", (64 * 210, 64)).save(tmp_path / "thin.png")
    Image.new("RGB", (512, 512)).save(tmp_path / "big.png")
    junit = tmp_path / "out" / "junit.xml"
    for image, message in (("fake.png", "not a readable image"), ("thin.png", "processor refuses image 'thin'"),
                           ("big.png", "decompression")):
        with monkeypatch.context() as patch:
            if image == "big.png":
                patch.setattr(Image, "MAX_IMAGE_PIXELS", 1000)
            result, doc, out = parity_cli.run("--image", str(tmp_path / image), "--junit", str(junit))
        assert message in _one_line_error(result).lower().replace("decompressionbomb", "decompression")
        assert doc is None and not out.exists() and not junit.exists()


def test_unwritable_output_folder(parity_cli, tmp_path):
    (tmp_path / "file").write_text("")
    result = parity_cli("run", "--out", str(tmp_path / "file" / "sub"))
    assert "cannot be written" in _one_line_error(result)


def test_results_file_errors(parity_cli, tmp_path):
    (tmp_path / "x.json").write_text("[1, 2")
    (tmp_path / "other.json").write_text(json.dumps({"schema": "other/1"}))
    for command in ("verdict", "report"):
        assert "no such file" in _one_line_error(parity_cli(command, str(tmp_path / "missing.json")))
        assert "not JSON" in _one_line_error(parity_cli(command, str(tmp_path / "x.json")))
        out = _one_line_error(parity_cli(command, str(tmp_path / "other.json")))
        assert "other.json" in out and "schema is 'other/1'" in out


def test_sglang_backend_unavailable_is_a_usage_error(parity_cli):
    import importlib.util

    if importlib.util.find_spec("sglang") is not None:
        pytest.skip("SGLang is installed here")
    result, _, _ = parity_cli.run("--backend", "sglang", "--model", "Qwen/Qwen3-VL-8B-Instruct")
    assert "SGLang is not installed" in _one_line_error(result)
    result, _, _ = parity_cli.run("--backend", "sglang", "--device", "cpu")  # the preset, served from a folder
    assert "SGLang is not installed" in _one_line_error(result)
    result, _, _ = parity_cli.run("--backend", "sglang", "--model", "Qwen/Qwen3-VL-8B-Instruct", "--mem-fraction", "1.5")
    assert "memory fraction" in _one_line_error(result)


def test_a_seed_for_a_checkpoint_on_sglang_is_a_usage_error(parity_cli):
    result, _, _ = parity_cli.run("--backend", "sglang", "--model", "Qwen/Qwen3-VL-8B-Instruct", "--seed", "3")
    assert "--seed builds an embedded preset" in _one_line_error(result)


def test_unwritable_junit_path_fails_before_the_run(parity_cli, tmp_path):
    (tmp_path / "file").write_text("")
    result, doc, _ = parity_cli.run("--junit", str(tmp_path / "file" / "junit.xml"))
    assert "--junit" in _one_line_error(result) and doc is None


# Which backends use each option that not every backend uses: the spec of `parity run`'s warnings.
USED_BY = {
    ("--runner", "legacy"): {"transformers"},
    ("--localize-threshold", "0.5"): {"transformers"},
    ("--buckets", "64"): {"transformers", "vllm"},
    ("--graph-backend", "emulated"): {"transformers", "sglang", "vllm"},
    ("--threads", "1"): {"transformers", "sglang", "vllm"},
    ("--device", "cuda"): {"transformers", "sglang", "vllm"},
    ("--sglang-arg", "--chunked-prefill-size 64"): {"sglang"},
    ("--sglang-fix", "deepstack-slot"): {"sglang"},
    ("--vllm-arg", "--enable-prefix-caching"): {"vllm"},
    ("--graph-mode", "full"): {"vllm"},
    ("--vllm-fix", "deepstack-clear"): {"vllm"},
    ("--concurrent", None): {"sglang", "vllm"},
    ("--gpus", "0"): {"sglang", "vllm"},
    ("--ready-timeout", "5"): {"sglang", "vllm"},
    ("--mem-fraction", "0.5"): {"sglang", "vllm"},
}


@pytest.mark.parametrize("backend", ["transformers", "sglang", "vllm"])
@pytest.mark.parametrize("option, value", list(USED_BY))
def test_every_option_a_backend_does_not_use_is_said_before_it_loads(parity_cli, monkeypatch, backend, option, value):
    import parity.run_command

    def not_run(*args, **kwargs):  # the warning comes first: nothing is loaded, checked or run
        raise SystemExit(0)

    monkeypatch.setattr(parity.run_command, "execute_run", not_run)
    args = ["run", "--backend", backend, option] + ([value] if value is not None else [])
    result = parity_cli(*args)
    warnings = [line for line in result.stderr.splitlines() if line.startswith("warning:") and option in line]
    assert result.exit_code == 0, result.output
    assert bool(warnings) == (backend not in USED_BY[(option, value)]), (backend, option, result.stderr)
    if warnings:
        assert f"ignored with --backend {backend}" in warnings[0]


def test_vllm_on_the_cpu_needs_vllm_and_no_gpu(parity_cli):
    """Where vLLM is absent (this suite's environment), the CPU path asks for vLLM only."""
    import importlib.util

    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is installed here: tests/engines/test_vllm_real_server.py runs the real servers")
    result = parity_cli("run", "--backend", "vllm", "--device", "cpu")
    assert result.exit_code == 2 and "vLLM is not installed" in result.output and "GPU" not in result.output
