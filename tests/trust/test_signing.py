"""Signed results files (design §4d): what parity writes under a key carries an HMAC of its canonical
document; every reader verifies it whenever a key is set, and `--require-signed` refuses unsigned
files. The negative controls: a one-byte edit, another key, a stripped or forged signature."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from parity.errors import ResultsFileError, UsageError
from parity.judge.verdict import judge_run
from parity.results import write_results
from parity.results.signing import ENV_KEY, ENV_KEY_FILE, FIELD, signing_key
from parity.trust.loader import load_results
from tests.helpers_runs import fixed_arms, legacy_arms, make_case, make_run

KEY = "a-ci-secret-of-32-characters-xyz"
OTHER = "another-secret-of-32-characters!"


@pytest.fixture
def keyed(monkeypatch):
    monkeypatch.delenv(ENV_KEY_FILE, raising=False)
    monkeypatch.setenv(ENV_KEY, KEY)
    return monkeypatch


def written(tmp_path: Path, key: str | None, arms=None, name: str = "results.json") -> Path:
    path = tmp_path / name
    run = make_run([make_case(arms or fixed_arms())])
    write_results(run, path, None if key is None else key.encode())
    return path


def test_a_signed_file_reads_back_and_says_the_same(tmp_path: Path, keyed) -> None:
    path = written(tmp_path, KEY)
    signature = json.loads(path.read_text())[FIELD]
    assert signature["algorithm"] == "hmac-sha256" and len(signature["mac"]) == 64
    assert KEY not in path.read_text()  # the key never travels; only its id
    assert judge_run(load_results(path, require_signed=True)).verdict.code == "PASS"
    legacy = written(tmp_path, KEY, legacy_arms(), name="legacy.json")
    assert judge_run(load_results(legacy, require_signed=True)).verdict.code == "FAIL_DEEPSTACK_DROPPED"


def test_a_file_edited_by_one_byte_is_refused(tmp_path: Path, keyed) -> None:
    """A FAIL turned into a PASS by one digit: the edit the loader's rules might not see."""
    path = written(tmp_path, KEY, legacy_arms())
    text = path.read_text()
    at = text.index('"token_ids": [') + len('"token_ids": [')
    edited = text[:at] + ("1" if text[at] != "1" else "2") + text[at + 1:]
    path.write_text(edited)
    with pytest.raises(ResultsFileError, match="does not match its content: it was edited after it was signed"):
        load_results(path)


def test_whitespace_is_not_content(tmp_path: Path, keyed) -> None:
    path = written(tmp_path, KEY)
    path.write_text(json.dumps(json.loads(path.read_text()), indent=4))  # re-indented on the way
    load_results(path, require_signed=True)


def test_another_key_and_a_forged_signature_are_refused(tmp_path: Path, keyed) -> None:
    path = written(tmp_path, OTHER)
    with pytest.raises(ResultsFileError, match="signed with another key"):
        load_results(path)
    doc = json.loads(written(tmp_path, KEY).read_text())
    doc[FIELD]["algorithm"] = "none"
    path.write_text(json.dumps(doc))
    with pytest.raises(ResultsFileError, match="not a hmac-sha256 signature"):
        load_results(path)


def test_unsigned_files_pass_unless_signatures_are_required(tmp_path: Path, keyed) -> None:
    path = written(tmp_path, None)
    load_results(path)  # a key is set, the file has no signature: read, not refused
    with pytest.raises(ResultsFileError, match="is not signed; --require-signed refuses it"):
        load_results(path, require_signed=True)
    signed = json.loads(written(tmp_path, KEY, name="signed.json").read_text())
    del signed[FIELD]  # a signature stripped is an unsigned file
    path.write_text(json.dumps(signed))
    with pytest.raises(ResultsFileError, match="is not signed"):
        load_results(path, require_signed=True)


def test_without_a_key_a_signed_file_reads_and_require_signed_is_a_usage_error(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.delenv(ENV_KEY, raising=False)
    monkeypatch.delenv(ENV_KEY_FILE, raising=False)
    path = written(tmp_path, KEY)
    load_results(path)
    with pytest.raises(UsageError, match="--require-signed needs the key"):
        load_results(path, require_signed=True)


@pytest.mark.parametrize("env, message", [
    ({ENV_KEY: "short"}, "the key is 5 bytes; a signing key needs at least 16"),
    ({ENV_KEY: KEY, ENV_KEY_FILE: "/nonexistent"}, "both set"),
    ({ENV_KEY_FILE: "/nonexistent/key"}, "cannot be read"),
])
def test_a_key_that_cannot_be_used_is_refused_in_one_line(env, message) -> None:
    with pytest.raises(UsageError, match=message):
        signing_key(env)


def test_a_key_file_is_read_without_its_trailing_newline(tmp_path: Path) -> None:
    (tmp_path / "key").write_text(KEY + "\n")
    assert signing_key({ENV_KEY_FILE: str(tmp_path / "key")}) == KEY.encode()


def test_the_ci_recipe_shards_signed_and_the_merge_requiring_them(parity_cli, tmp_path: Path) -> None:
    """README, "Signed results": run the shards with the secret as the key, merge with --require-signed;
    a shard edited on the way is refused, and so is one written without the key."""
    env = {ENV_KEY: KEY, ENV_KEY_FILE: None}
    shards = []
    for k in (1, 2):
        out = tmp_path / f"shard{k}"
        result = parity_cli("run", "--out", str(out), "--no-plot", "--device", "cpu", "--scenario", "four-arm",
                            "--scenario", "reuse", "--max-new-tokens", "4", "--shard", f"{k}/2", env=env)
        assert result.exit_code == 0, result.output
        shards.append(str(out / "results.json"))
    merged = parity_cli("merge", *shards, "--out", str(tmp_path / "merged"), "--no-plot", "--require-signed", env=env)
    assert merged.exit_code == 0, merged.output
    assert parity_cli("verdict", str(tmp_path / "merged" / "results.json"), "--require-signed", env=env).exit_code == 0

    doc = json.loads(Path(shards[1]).read_text())
    doc["cases"][0]["arms"]["bcg_normal"]["token_logprobs"][0] += 0.5
    Path(shards[1]).write_text(json.dumps(doc))
    refused = parity_cli("merge", *shards, "--out", str(tmp_path / "again"), "--no-plot", "--require-signed", env=env)
    assert refused.exit_code == 2 and "edited after it was signed" in refused.output, refused.output
    unsigned = parity_cli("verdict", shards[0], "--require-signed", env={ENV_KEY: None, ENV_KEY_FILE: None})
    assert unsigned.exit_code == 2 and "--require-signed needs the key" in unsigned.output, unsigned.output
