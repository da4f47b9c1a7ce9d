"""Following vLLM's releases (issue 35): the supported ones as one table (parity/engines/vllm/versions.py),
what each release's CPU servers are told, the fix refused outside the releases it was validated on,
the setup script and CI building those releases, and a newer vLLM's moved patch target named in one line.
Nothing here needs vLLM installed; the real releases are tested in test_vllm_real*.py (marker real_vllm).
"""

from __future__ import annotations

import re
import subprocess
import types

import pytest

from parity.engines.vllm import backend, cpu_patches, servers, versions
from tests.engines.servers import REPO


def test_a_patch_target_a_newer_vllm_moved_is_named_not_a_traceback_deep_in_vllm(monkeypatch):
    """A future vLLM whose CPU platform lost the method parity patches: the server dies on one line
    naming the target, the installed version and the supported ones, and the run's error starts
    with that line. Negative control: the same patch on a module that has the target applies."""
    from parity.engines.launcher import ExitedDuringStartup

    monkeypatch.setattr("parity.engines.fix_records.installed_version", lambda package: "0.35.0")
    moved = types.ModuleType("vllm.platforms.cpu")
    moved.CpuPlatform = type("CpuPlatform", (), {})
    with pytest.raises(cpu_patches.MissingTarget) as missing:
        cpu_patches.cpu_platform_graphs(moved)
    line = str(missing.value)
    assert line.startswith(cpu_patches.MISSING) and "vllm.platforms.cpu.CpuPlatform.check_and_update_config" in line
    assert "vLLM 0.35.0" in line and versions.supported() in line
    failure = ExitedDuringStartup("the vllm bcg server exited while starting (code 1)",
                                  log_tail=f"Traceback (most recent call last):\n  ...\nMissingTarget: {line}\n")
    explained = backend.VllmBackend.explain_exit(None, "bcg", failure)
    assert str(explained).startswith(line) and explained.log_tail == failure.log_tail
    present = types.ModuleType("vllm.triton_utils.importing")
    present.HAS_TRITON = False
    cpu_patches.mark_triton_present(present)
    assert present.HAS_TRITON is True


def test_the_fix_is_refused_outside_the_releases_it_was_validated_on_and_the_tap_warns(capsys):
    from parity.errors import BackendUnavailableError

    with pytest.raises(BackendUnavailableError, match=f"validated on vLLM {', '.join(versions.fix_accepted())}; "
                                                      "this environment has vLLM 0.35.0"):
        backend.check_release("0.35.0", "deepstack-clear")
    backend.check_release("0.35.0", None)  # the tap runs on, as best it can
    assert f"parity supports vLLM {versions.supported()}; this environment has vLLM 0.35.0" in capsys.readouterr().err
    for release in versions.RELEASES:  # the negative control: every supported release, quietly
        backend.check_release(release.version, "deepstack-clear" if release.fix_validated else None)
    assert capsys.readouterr().err == ""


def test_the_setup_script_and_ci_build_exactly_the_supported_releases_newest_first():
    """The version table is the one source: the setup script builds its releases (the newest by
    default) and CI's primary vLLM stage runs the newest, its last stage another supported one."""
    script = (REPO / "scripts" / "setup_vllm_env.sh").read_text()
    listed = re.search(r"^SUPPORTED=\(([^)]*)\)", script, re.M).group(1).split()
    assert listed == [r.version for r in versions.RELEASES] and versions.NEWEST.version == listed[-1]
    ci = dict(re.findall(r"^(VLLM_NEW|VLLM_OLD)=(\S+)$", (REPO / ".ci" / "run").read_text(), re.M))
    assert ci["VLLM_NEW"] == versions.NEWEST.version, ci
    assert versions.release(ci["VLLM_OLD"]) is not None and ci["VLLM_OLD"] != ci["VLLM_NEW"], ci
    refused = subprocess.run(["bash", str(REPO / "scripts" / "setup_vllm_env.sh"), "--version", "0.35.0"],
                             capture_output=True, text=True, timeout=30)
    assert refused.returncode == 2 and f"parity supports vLLM {' '.join(listed)}, not 0.35.0" in refused.stderr


def test_a_cpu_server_is_told_to_use_model_runner_v2_only_where_v1_exists(tmp_path):
    settings = servers.VllmSettings(model="m", max_new_tokens=1, run_dir=tmp_path, device="cpu", graph_backend="emulated")
    for release in versions.RELEASES:
        env = servers.cpu_env(settings, tmp_path / "calls.jsonl", release.version)
        assert (servers.V2_ENV in env) == bool(release.v1_runner), release.version
