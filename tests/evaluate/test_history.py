"""Run history in a real SQLite file: record, list, export, delete, corrupt files."""

from __future__ import annotations

import io
import threading

import pandas as pd
import pytest

from gap_engine.evaluate import history
from gap_engine.evaluate.history import HistoryError, RunRecord

REPORT = {
    "model": "smollm2-135m (pruned)",
    "params": 120_000_000,
    "size_bytes": 480_000_000,
    "perplexity": {"wiki-sample": 21.5, "news-sample": 40.25},
    "dense": {"model": "smollm2-135m", "params": 134_515_008, "perplexity": {"wiki-sample": 18.0, "news-sample": 33.0}},
    "kl_to_dense": {"wiki-sample": 0.12, "news-sample": 0.2},
    "top1_agreement": {"wiki-sample": 0.8, "news-sample": 0.7},
    "throughput": {"prefill_speedup": 1.1, "decode_speedup": 1.05},
    "generations": [{"prompt": "The capital of France is", "model": " Paris.", "dense": " Paris, the"}],
    "seconds": 12.5,
}
PLAN = {
    "model": "smollm2-135m",
    "num_layers": 2,
    "attention_rates": [0.0, 0.25],
    "mlp_rates": [0.125, 0.5],
    "params": {"dense_total": 134_515_008},
}


def make_record(**overrides) -> RunRecord:
    record = RunRecord.from_report(
        PLAN,
        REPORT,
        allocator="dp",
        table_key="smollm2-135m-nll-split-exact-abc",
        budget=0.2,
        params={"eval": {"n_samples": 4}},
        predicted_loss=0.3,
        actual_loss=0.35,
        checkpoint="/tmp/ckpt",
    )
    for name, value in overrides.items():
        setattr(record, name, value)
    return record


def test_round_trip_in_a_real_file(tmp_path):
    db = tmp_path / "runs" / "history.sqlite"
    run_id = history.record_run(make_record(), db)
    assert db.is_file()
    stored = history.get_run(run_id, db)
    assert stored.id == run_id
    assert stored.plan == PLAN
    assert stored.perplexity == REPORT["perplexity"]
    assert stored.dense_perplexity == REPORT["dense"]["perplexity"]
    assert stored.kl == REPORT["kl_to_dense"]
    assert stored.generations == REPORT["generations"]
    assert stored.prefill_speedup == 1.1 and stored.decode_speedup == 1.05
    assert stored.predicted_loss == 0.3 and stored.actual_loss == 0.35
    assert stored.dense_params == 134_515_008 and stored.pruned_params == 120_000_000
    assert stored.params == {"eval": {"n_samples": 4}}
    assert stored.checkpoint == "/tmp/ckpt" and stored.seconds == 12.5


def test_list_runs_flattens_per_source_columns(tmp_path):
    db = tmp_path / "h.sqlite"
    first = history.record_run(make_record(), db)
    second = history.record_run(make_record(allocator="uniform", budget=0.3, perplexity={"wiki-sample": 30.0}), db)
    frame = history.list_runs(db)
    assert list(frame["id"]) == [first, second]
    assert list(frame.columns[: len(history.BASE_COLUMNS)]) == history.BASE_COLUMNS
    assert frame.loc[0, "ppl:wiki-sample"] == 21.5
    assert frame.loc[1, "ppl:wiki-sample"] == 30.0
    assert pd.isna(frame.loc[1, "ppl:news-sample"])
    assert frame.loc[0, "kl:news-sample"] == 0.2
    assert list(frame["allocator"]) == ["dp", "uniform"]


def test_list_runs_shows_the_net_change_and_the_biases(tmp_path):
    """pruned_params counts the compensation's biases; bias_params says how many, net_removed is the net change."""
    db = tmp_path / "h.sqlite"
    history.record_run(make_record(params={"compensation": {"mode": "bias", "bias_params": 34_560}}), db)
    history.record_run(make_record(params={"compensation": None}), db)
    frame = history.list_runs(db)
    assert list(frame["bias_params"]) == [34_560, 0]
    assert list(frame["net_removed"]) == [134_515_008 - 120_000_000] * 2


def test_csv_export_parses_back(tmp_path):
    db = tmp_path / "h.sqlite"
    history.record_run(make_record(), db)
    text = history.to_csv(db)
    parsed = pd.read_csv(io.StringIO(text))
    assert parsed.loc[0, "model"] == "smollm2-135m"
    assert parsed.loc[0, "budget"] == 0.2


def test_empty_history(tmp_path):
    db = tmp_path / "h.sqlite"
    frame = history.list_runs(db)
    assert frame.empty and list(frame.columns) == history.BASE_COLUMNS
    assert history.to_csv(db).strip() == ",".join(history.BASE_COLUMNS)


def test_delete_and_clear(tmp_path):
    db = tmp_path / "h.sqlite"
    ids = [history.record_run(make_record(), db) for _ in range(3)]
    history.delete_run(ids[1], db)
    assert [r.id for r in history.runs(db)] == [ids[0], ids[2]]
    with pytest.raises(HistoryError, match="no run with id"):
        history.delete_run(ids[1], db)
    with pytest.raises(HistoryError, match="no run with id"):
        history.get_run(999, db)
    assert history.clear(db) == 2
    assert history.runs(db) == []


def test_a_runs_maker_is_kept_beside_it_and_goes_with_it(tmp_path):
    db = tmp_path / "h.sqlite"
    ids = [history.record_run(make_record(), db) for _ in range(3)]
    history.set_run_maker(ids[0], "ab" * 16, db)
    history.set_run_maker(ids[2], "cd" * 16, db)
    assert history.run_makers(db) == {ids[0]: "ab" * 16, ids[2]: "cd" * 16}
    assert "maker" not in history.list_runs(db).columns  # never in the table, the CSV or the report
    for bad in ("AB" * 16, "ab", "ab" * 40, "../x"):
        with pytest.raises(HistoryError, match="maker"):
            history.set_run_maker(ids[1], bad, db)
    with pytest.raises(HistoryError, match="no run with id"):
        history.set_run_maker(999, "ab" * 16, db)
    history.delete_run(ids[0], db)
    assert history.run_makers(db) == {ids[2]: "cd" * 16}
    history.clear(db)
    assert history.run_makers(db) == {}


def test_default_path_is_under_the_cache_root(tmp_path, monkeypatch):
    monkeypatch.setenv("GAP_CACHE_DIR", str(tmp_path))
    assert history.history_path() == tmp_path / "runs" / "history.sqlite"
    run_id = history.record_run(make_record())
    assert (tmp_path / "runs" / "history.sqlite").is_file()
    assert history.get_run(run_id).allocator == "dp"


def test_a_corrupt_file_is_a_clear_error(tmp_path):
    db = tmp_path / "h.sqlite"
    db.write_bytes(b"this is not a database" * 100)
    with pytest.raises(HistoryError, match="unreadable"):
        history.list_runs(db)


@pytest.mark.slow
def test_concurrent_writers(tmp_path):
    db = tmp_path / "h.sqlite"
    errors = []

    def write():
        try:
            for _ in range(5):
                history.record_run(make_record(), db)
        except Exception as exc:  # pragma: no cover - the assertion below reports it
            errors.append(exc)

    threads = [threading.Thread(target=write) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert len(history.runs(db)) == 20


def test_speed_ups_whose_repeat_ranges_overlap_read_within_noise():
    """DP 1.12x against uniform 1.27x, repeats 1.02-1.54x and 1.10-1.45x: not a difference."""
    from gap_engine.evaluate import runcompare

    def run(run_id, allocator, median, repeats):
        throughput = {"prefill_speedup_repeats": repeats, "prefill_speedup_range": [min(repeats), max(repeats)]}
        return RunRecord(
            model="m", allocator=allocator, plan={}, budget=0.2503, params={"throughput": throughput}, prefill_speedup=median, id=run_id
        )

    dp, uniform, fast = (
        run(1, "dp", 1.12, [1.02, 1.12, 1.54]),
        run(2, "uniform", 1.27, [1.10, 1.27, 1.45]),
        run(3, "uniform", 1.9, [1.8, 1.9, 2.0]),
    )
    assert runcompare.within_noise(dp, uniform, "prefill") and not runcompare.within_noise(dp, fast, "prefill")
    assert runcompare.within_noise(dp, RunRecord(model="m", allocator="x", plan={}), "prefill") is None  # no repeats: nothing said
    speed = runcompare.comparison_frame([dp, uniform, fast]).set_index("measure").loc["prefill speed vs dense"]
    assert "within noise of run 1" in speed["run 2"] and "vs run 1" not in speed["run 2"].replace("within noise of run 1", "")
    assert "within noise" not in speed["run 3"] and "+69.6% vs run 1" in speed["run 3"]
    assert "within noise of dense" not in speed["run 1"]  # 1.02-1.54x does not reach 1.00x
    budget = runcompare.comparison_frame([dp]).set_index("measure").loc["budget (of prunable)"]
    assert budget["run 1"] == "25.03%" and runcompare.run_label(dp) == "run 1: dp at 25.03%"
