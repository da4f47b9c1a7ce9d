import json
from pathlib import Path

import pytest

from parity.errors import ResultsFileError
from parity.results import SCHEMA, load_results, run_to_json, write_results
from parity.tap import DeepStackRecord
from parity.verdict import judge_run
from tests.helpers_runs import fixed_arms, make_case, make_run


def test_round_trip_keeps_every_field(tmp_path: Path):
    from dataclasses import replace

    record = DeepStackRecord((4, 6), "float32", 2, 1.5, "ab" * 32, "normal", calls=3, replay=True)
    arms = list(fixed_arms())
    arms[0] = replace(arms[0], deepstack_record=record, top_logprobs=(((1, -0.1), (2, -2.0)),) * 5)
    run = make_run([make_case(arms)])
    write_results(run, tmp_path / "r.json")
    loaded = judge_run(load_results(tmp_path / "r.json"))
    assert run_to_json(loaded) == run_to_json(run)
    assert loaded.cases[0].arm("eager_normal").deepstack_record == record


def _doc():
    return run_to_json(make_run([make_case(fixed_arms())]))


@pytest.mark.parametrize("mutate, message", [
    (lambda d: d.update(schema="parity.results/2"), "schema is 'parity.results/2'"),
    (lambda d: d.pop("cases"), "lacks 'cases'"),
    (lambda d: d["config"].pop("logprob_tol"), "config lacks 'logprob_tol'"),
    (lambda d: d["config"].update(logprob_tol=-1), "logprob_tol must be >= 0"),
    (lambda d: d["cases"][0]["arms"]["bcg_normal"].update(token_ids="12"), "token_ids must be list"),
    (lambda d: d["cases"][0]["arms"]["bcg_normal"].update(token_logprobs=[-0.1]), "5 token_ids but 1 token_logprobs"),
    (lambda d: d["cases"][0]["arms"]["bcg_normal"].update(mode="turbo"), "mode 'turbo'"),
    (lambda d: d["cases"][0].update(scenario="other"), "scenario 'other'"),
    (lambda d: d.update(cases=[]), "cases is empty"),
])
def test_malformed_documents_name_the_problem(tmp_path: Path, mutate, message):
    doc = _doc()
    mutate(doc)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(ResultsFileError) as info:
        load_results(path)
    assert str(path) in str(info.value) and message in str(info.value)


def test_missing_and_non_json_files(tmp_path: Path):
    with pytest.raises(ResultsFileError, match="no such file"):
        load_results(tmp_path / "nope.json")
    (tmp_path / "x.json").write_text("{not json")
    with pytest.raises(ResultsFileError, match="not JSON"):
        load_results(tmp_path / "x.json")
    assert _doc()["schema"] == SCHEMA
