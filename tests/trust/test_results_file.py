"""The results file (design §4): /2 round trip, /1 still read, and every bad document a usage error."""

import json
from dataclasses import replace
from pathlib import Path

import pytest

from parity.errors import ResultsFileError
from parity.results import SCHEMA, Timings, run_to_json, write_results
from parity.trust.loader import _V2_ONLY_CONFIG, load_results
from parity.judge.verdict import judge_run
from tests.helpers_runs import fixed_arms, legacy_arms, make_case, make_run, scored, stream_case


def _record(replay):
    from tests.helpers_runs import make_record

    return replace(make_record("normal"), calls=2, replay=replay)


def test_round_trip_keeps_every_field(tmp_path: Path):
    from dataclasses import replace

    arms = list(scored(make_case(fixed_arms())).arms)
    arms[2] = replace(arms[2], deepstack_record=_record(True), top_logprobs=(((1, -0.1), (2, -2.0)),) * 5,
                      forced_seconds=0.5)
    run = replace(make_run([make_case(arms), scored(stream_case())]), timings=Timings(load_s=1.5, capture_s=0.25))
    write_results(run, tmp_path / "r.json")
    loaded = judge_run(load_results(tmp_path / "r.json"))
    assert run_to_json(loaded) == run_to_json(run)
    assert loaded.cases[0].arm("bcg_normal").deepstack_record == _record(True)
    assert json.loads((tmp_path / "r.json").read_text())["schema"] == SCHEMA


def _doc():
    return run_to_json(make_run([make_case(fixed_arms()), stream_case()]))


def _arm(d, name="bcg_normal"):
    return d["cases"][0]["arms"][name]


@pytest.mark.parametrize("mutate, message", [
    (lambda d: d.update(schema="parity.results/9"), "schema is 'parity.results/9'"),
    (lambda d: d.pop("cases"), "lacks 'cases'"),
    (lambda d: d["config"].pop("logprob_tol"), "config lacks 'logprob_tol'"),
    (lambda d: d["config"].pop("tie_margin"), "config lacks 'tie_margin'"),
    (lambda d: d["config"].pop("deepstack_layers"), "config lacks 'deepstack_layers'"),
    (lambda d: d["config"].update(logprob_tol=1e-9), "logprob_tol must be >= 1e-06"),
    (lambda d: d["config"].update(logprob_tol=float("nan")), "must be finite"),
    (lambda d: d["config"].update(tie_margin=-1), "tie_margin must be >= 0"),
    (lambda d: _arm(d).update(token_ids="12"), "token_ids must be list"),
    (lambda d: _arm(d).update(token_logprobs=[-0.1]), "5 token_ids but 1 token_logprobs"),
    (lambda d: _arm(d).update(token_logprobs=[-0.1, float("nan"), -0.1, -0.1, -0.1]),
     "arms.bcg_normal.token_logprobs[1] is nan"),
    (lambda d: _arm(d).update(token_logprobs=[-0.1, -0.1, float("-inf"), -0.1, -0.1]), "is -inf"),
    (lambda d: _arm(d).update(mode="eager"), "but arm bcg_normal is 'bcg' / 'normal'"),
    (lambda d: _arm(d).update(deepstack="zero"), "but arm bcg_normal is 'bcg' / 'normal'"),
    (lambda d: d["cases"][0]["arms"].update(turbo=_arm(d)), "unknown arm 'turbo'"),
    (lambda d: _arm(d).pop("evidence"), "lacks 'evidence'"),
    (lambda d: _arm(d).update(evidence=None), "lacks 'evidence'"),
    (lambda d: _arm(d)["evidence"].update(replayed_calls=0), "inconsistent"),
    (lambda d: _arm(d)["evidence"].update(tap_calls=99), "tap_calls 99 > lm_calls"),
    (lambda d: _arm(d).update(forced={"eager_normal": [-0.1]}), "1 scores for 5 reference tokens"),
    (lambda d: _arm(d).update(forced={"nope": [-0.1]}), "unknown reference arm 'nope'"),
    (lambda d: d["cases"][1].update(id=d["cases"][0]["id"]), "appears twice"),
    (lambda d: d["cases"][0].update(scenario="other"), "scenario 'other'"),
    (lambda d: d["cases"][1].update(requests=[]), "non-empty list of requests"),
    (lambda d: d.update(cases=[]), "cases is empty"),
    (lambda d: d.update(timings={"load_s": 1.0, "coffee_s": 2.0}), "timings.coffee_s is not a timing"),
    (lambda d: d.update(timings={"load_s": -1.0}), "timings.load_s must be >= 0"),
    (lambda d: d.update(timings={"total_s": "fast"}), "timings.total_s must be a number"),
    (lambda d: d.update(timings=[1.0]), "timings must be an object"),
])
def test_malformed_documents_name_the_problem(tmp_path: Path, mutate, message):
    doc = _doc()
    mutate(doc)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(doc))  # json.dumps writes NaN as bare NaN: what a forged file holds
    with pytest.raises(ResultsFileError) as info:
        load_results(path)
    assert str(path) in str(info.value) and message in str(info.value)


def test_files_that_cannot_be_read(tmp_path: Path):
    with pytest.raises(ResultsFileError, match="no such file"):
        load_results(tmp_path / "nope.json")
    (tmp_path / "x.json").write_text("{not json")
    with pytest.raises(ResultsFileError, match="not JSON"):
        load_results(tmp_path / "x.json")
    (tmp_path / "deep.json").write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(ResultsFileError, match="nested too deeply"):
        load_results(tmp_path / "deep.json")
    with pytest.raises(ResultsFileError, match="cannot be read"):
        load_results(tmp_path / ("n" * 5000 + ".json"))
    with pytest.raises(ResultsFileError, match="cannot be read"):
        load_results(tmp_path / "x.json" / "under-a-file.json")
    with pytest.raises(ResultsFileError, match="is a folder, not a file"):
        load_results(tmp_path)
    (tmp_path / "latin1.json").write_bytes(b"\xff\xfe{")
    with pytest.raises(ResultsFileError, match="cannot be read"):
        load_results(tmp_path / "latin1.json")


# --- /1 files --------------------------------------------------------------------------------------

def v1_doc(bcg_replay=True, arms=None):
    """A results file as parity 0.1 wrote it: no evidence, replay in each arm's DeepStack record."""
    doc = run_to_json(make_run([make_case(arms or fixed_arms())]))
    doc["schema"] = "parity.results/1"
    for key in _V2_ONLY_CONFIG:
        doc["config"].pop(key, None)
    for name, arm in doc["cases"][0]["arms"].items():
        for key in ("evidence", "forced", "forced_seconds"):
            arm.pop(key)
        record = _record(bcg_replay if name.startswith("bcg") else False).to_json()
        arm["deepstack_record"] = dict(record, action=arm["deepstack"])
    return doc


def test_a_v1_file_is_still_judged(tmp_path: Path):
    path = tmp_path / "v1.json"
    path.write_text(json.dumps(v1_doc()))
    run = judge_run(load_results(path))
    # Every case passed, but a /1 file records no plan: never a PASS on what it cannot show.
    assert run.schema == "parity.results/1" and run.cases[0].verdict.code == "PASS"
    assert run.verdict.code == "INCONCLUSIVE_UNVERIFIED" and "records no plan" in run.verdict.reason
    path.write_text(json.dumps(v1_doc(arms=legacy_arms())))
    assert judge_run(load_results(path)).verdict.code == "FAIL_DEEPSTACK_DROPPED"


@pytest.mark.parametrize("edit, code", [
    (lambda d: d["cases"][0]["arms"]["bcg_normal"]["deepstack_record"].update(replay=False), "INCONCLUSIVE_NOT_REPLAYED"),
    (lambda d: d["cases"][0]["arms"]["bcg_zero_deepstack"].update(deepstack_record=None), "ERROR"),
    (lambda d: [a.update(deepstack_record=None) for a in d["cases"][0]["arms"].values()], "INCONCLUSIVE_NOT_REPLAYED"),
    (lambda d: d["cases"][0]["arms"]["eager_normal"]["deepstack_record"].update(replay=True), "INCONCLUSIVE_NOT_REPLAYED"),
    # One fingerprint per request holds in /1 too: a record that lost its rows is refused.
    (lambda d: d["cases"][0]["arms"]["bcg_normal"]["deepstack_record"].update(nonzero_rows=0), None),
])
def test_a_v1_file_never_passes_on_missing_or_contrary_evidence(tmp_path: Path, edit, code):
    doc = v1_doc()
    edit(doc)
    path = tmp_path / "v1.json"
    path.write_text(json.dumps(doc))
    if code is None:
        with pytest.raises(ResultsFileError, match="differs from eager_normal's"):
            load_results(path)
    else:
        assert judge_run(load_results(path)).verdict.code == code


@pytest.mark.parametrize("field, where", [
    ("evidence", lambda d: d["cases"][0]["arms"]["bcg_normal"]), ("forced", lambda d: d["cases"][0]["arms"]["eager_normal"]),
    ("plan", lambda d: d["config"]), ("tie_margin", lambda d: d["config"]),
])
def test_a_v1_file_with_a_v2_field_is_a_relabelled_file(tmp_path: Path, field, where):
    doc = v1_doc()
    where(doc)[field] = {} if field in ("evidence", "forced") else 0.1 if field == "tie_margin" else []
    path = tmp_path / "v1.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(ResultsFileError, match=f"{field} is a parity.results/2 field"):
        load_results(path)


def test_a_v1_reuse_case_never_passes(tmp_path: Path):
    """A /1 reuse case has neither evidence nor the power arm v3 asks of every sequence."""
    doc = v1_doc()
    case = doc["cases"][0]
    case.update(id="reuse/rgb-stripes/describe", scenario="reuse", primer="image request")
    case["arms"] = {name: dict(arm, deepstack_record=None) for name, arm in case["arms"].items()
                    if name in ("eager_normal", "bcg_normal")}
    path = tmp_path / "v1.json"
    path.write_text(json.dumps(doc))
    run = judge_run(load_results(path))
    assert run.cases[0].requests[0].label.startswith("follow-up") and run.verdict.code == "INCOMPLETE"
    assert "eager_zero_deepstack" in run.verdict.reason


def test_json_that_python_cannot_hold_is_refused(tmp_path: Path):
    doc = json.dumps(_doc()).replace('"max_new_tokens": 20', '"max_new_tokens": 1' + "0" * 5000, 1)
    (tmp_path / "huge.json").write_text(doc)
    with pytest.raises(ResultsFileError, match="config.max_new_tokens is an integer of 5001 digits"):
        load_results(tmp_path / "huge.json")
    (tmp_path / "twice.json").write_text('{"schema": "parity.results/2", "cases": [{"id": "a", "id": "b"}]}')
    with pytest.raises(ResultsFileError, match=r"cases\[0\] has the key 'id' twice"):
        load_results(tmp_path / "twice.json")


@pytest.mark.parametrize("config, message", [
    ({"buckets": "auto", "captured_buckets": [48, 50]}, "not on the bucket ladder"),
    ({"repeat": 2}, "config.repeat 2"),
])
def test_the_rules_that_need_no_v2_data_hold_for_v1_files(tmp_path: Path, config, message):
    doc = v1_doc()
    doc["config"].update(config)
    path = tmp_path / "v1.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(ResultsFileError, match=message):
        load_results(path)


@pytest.mark.parametrize("backend", ["sglang", "vllm"])
def test_a_server_run_names_the_release_it_judged(tmp_path: Path, backend):
    doc = run_to_json(make_run([make_case(fixed_arms())], backend=backend))
    assert load_results(_written(tmp_path, doc)).environment[backend]
    doc["environment"][backend] = None
    with pytest.raises(ResultsFileError, match=f"environment.{backend} is None, but a {backend} run whose servers "
                                               "answered names the release it judged"):
        load_results(_written(tmp_path, doc))


def _written(tmp_path: Path, doc: dict) -> Path:
    path = tmp_path / "results.json"
    path.write_text(json.dumps(doc))
    return path
