"""Every command that takes a path, given a path that names no regular file: one line, exit 2, at once.

A FIFO blocks whoever opens it for reading until a writer comes (forever in a CI job), /dev/zero
never ends, a socket cannot be opened at all, a symbolic-link loop cannot be followed, and a regular
file whose read blocks (/proc/kmsg, where the machine lets a test open it) must be read without
blocking, media included. Each runs
in a subprocess under a timeout, so a hang fails the test instead of hanging the suite. The timeout
tells a hang from a slow start, not a speed: each command answers in 0.2-2 s here (most of it
importing torch for `run`), but no test holds a machine to a time.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

# A hang, not a slow start: far past the 0.2-2 s a command takes, on a loaded CI machine too.
HANG_S = 60


@pytest.fixture(scope="module")
def special(tmp_path_factory):
    folder = tmp_path_factory.mktemp("special")
    os.mkfifo(folder / "fifo")
    os.symlink("loop", folder / "loop")
    server = socket.socket(socket.AF_UNIX)
    server.bind(str(folder / "sock"))
    yield {"fifo": str(folder / "fifo"), "socket": str(folder / "sock"), "device": "/dev/zero",
           "loop": str(folder / "loop"), "blocking": BLOCKING, "folder": folder}
    server.close()


def _blocking_file() -> str | None:
    """/proc/kmsg: a regular file (size 0) whose read blocks until the kernel logs something."""
    try:
        os.close(os.open("/proc/kmsg", os.O_RDONLY | os.O_NONBLOCK))
    except OSError:
        return None
    return "/proc/kmsg"


BLOCKING = _blocking_file()


# (command line with PATH where the special file goes, the words the one line says for a FIFO)
COMMANDS = [
    ("verdict PATH", None), ("verdict --json PATH", None), ("report PATH", None), ("report --format json PATH", None),
    ("report GOOD PATH", None), ("compare PATH GOOD", None), ("compare GOOD PATH", None), ("localize PATH", None),
    ("merge PATH --out OUT", None), ("merge GOOD --out PATH", "--out"), ("merge GOOD --out OUT --junit PATH", "--junit"),
    ("run --image PATH", "--image"), ("run --video PATH", "--video"), ("run --prompts PATH", "--prompts"),
    ("run --model tiny-qwen3-omni --audio PATH", "--audio"), ("run --out PATH", "--out"),
    ("run --junit PATH", "--junit"), ("localize GOOD --image PATH", "--image"), ("localize GOOD --video PATH", "--video"),
    ("audit --engine vllm --source PATH", "--source"), ("fixtures --write PATH", "--write"),
]


# The options whose path the command writes (or lists as a folder): a regular file there is no read.
WRITTEN = ("--out", "--junit", "--write", "--source")


def _parity(*args: str) -> subprocess.CompletedProcess:
    """The command's result; `subprocess.TimeoutExpired` (the test fails) when it hangs."""
    return subprocess.run([sys.executable, "-m", "parity", *args], capture_output=True, text=True,
                          timeout=HANG_S, stdin=subprocess.DEVNULL)


@pytest.mark.parametrize("kind", ["fifo", "socket", "device", "loop", "blocking"])
@pytest.mark.parametrize("command, option", COMMANDS)
def test_a_special_file_is_one_line_exit_2_at_once(special, real_run, tmp_path, command, option, kind):
    if kind == "blocking" and (special[kind] is None or option in WRITTEN):
        pytest.skip("no regular file whose read blocks can be opened here (/proc/kmsg needs root)"
                    if special[kind] is None else "a path the command writes, not reads")
    good, _, _ = real_run("legacy")
    args = [str(good) if a == "GOOD" else str(tmp_path / "out") if a == "OUT" else special[kind] if a == "PATH" else a
            for a in command.split()]
    result = _parity(*args)
    lines = [line for line in (result.stdout + result.stderr).splitlines() if line.strip()]
    assert result.returncode == 2 and len(lines) == 1 and lines[0].startswith("Error:"), (args, lines)
    assert special[kind] in lines[0] and "Traceback" not in lines[0]
    if option is not None:
        assert option in lines[0], lines


def test_an_empty_path_names_no_file(special):
    for option in ("--image", "--video", "--prompts"):
        result = _parity("run", option, "")
        assert result.returncode == 2 and "Traceback" not in result.stderr, (option, result.stderr)
        assert option in result.stderr and "'.'" not in result.stderr, result.stderr


def test_a_results_file_over_the_cap_is_refused_before_it_is_read(tmp_path, monkeypatch):
    """The cap is checked on the file's size: a huge sparse file is refused without reading a byte."""
    from parity.errors import ResultsFileError
    from parity.trust import loader

    huge = tmp_path / "huge.json"
    with open(huge, "wb") as handle:
        handle.truncate(loader.MAX_FILE_BYTES + 1)  # sparse: no data on disk

    def never(*args, **kwargs):
        raise AssertionError("the file was opened for reading")

    monkeypatch.setattr(os, "open", never)
    with pytest.raises(ResultsFileError, match="holds more than 1024 MiB"):
        loader.load_results(huge)
