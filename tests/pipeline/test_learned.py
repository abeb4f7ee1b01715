"""Times that learn this machine (``pipeline.learned``): a finished job's actual / predicted seconds correct the next
prediction of its kind, scaled by the load now; a history that cannot be read is ignored with a log line."""

from __future__ import annotations

import json
import logging
import threading

import pytest
import torch
from conftest import wait_for
from synthetic_tables import synthetic_table

from gap_engine.core.config import WindowSpec
from gap_engine.core.errors import TableError
from gap_engine.core.progress import LOAD_MODEL, PLAN, SCORE_UNITS, Hooks
from gap_engine.evaluate.metrics import EvalSettings
from gap_engine.pipeline import cost_model, learned
from gap_engine.pipeline.jobs import DONE, FAILED, JobManager
from gap_engine.pipeline.learned import Pending, contention, factor_for, history_path, record
from gap_engine.pipeline.runs import baseline_rows, baseline_stages, prune_eval_stages
from gap_engine.tables.artefact import TableSpec

SPEC = TableSpec.from_dict(dict(n_samples=4, seq_len=32, rate_grid=(0.0, 0.5), batch_size=2))
EVAL = EvalSettings(windows=WindowSpec("news-sample", n_samples=2, seq_len=32, batch_size=2), throughput=False, generations=0)
LOAD = 3.0  # the load average every reading returns, so a factor is a number a test can state


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("GAP_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(learned, "load_average", lambda: LOAD)
    return tmp_path / "cache"


def table_seconds() -> cost_model.Prediction:
    predicted = cost_model.table_prediction("smollm2-135m", SPEC, loaded=True)
    assert predicted is not None
    return predicted


def run_seconds() -> cost_model.Prediction:
    predicted = cost_model.run_prediction("smollm2-135m", SPEC.windows, EVAL, prune_eval_stages(EVAL, False), loaded=True)
    assert predicted is not None
    return predicted


def test_a_finished_job_multiplies_the_next_prediction_of_its_kind_only(cache):
    before, run_before = table_seconds(), run_seconds()
    assert before.correction is None and before.where == "not yet measured here"
    record(Pending("table", before.total, before.prices, load_start=LOAD), actual_s=2.5 * before.total)
    after = table_seconds()
    assert after.total == pytest.approx(2.5 * before.total)
    assert after.seconds == pytest.approx({name: 2.5 * seconds for name, seconds in before.seconds.items()})
    assert after.where == "learned from 1 run on this machine" and after.basis.startswith(before.basis) and "x2.5" in after.basis
    assert after.pending().predicted_s == pytest.approx(before.total)  # recorded against the cost model's own seconds
    assert run_seconds() == run_before  # another kind of job learns nothing from a table build
    assert cost_model.table_prediction("smollm2-135m", SPEC, cached=True).correction is None  # nor does a cache hit


def test_the_factor_is_the_median_of_recent_runs_scaled_by_the_load_now(cache, monkeypatch):
    prices, threads = "nominal", torch.get_num_threads()
    for ratio in (1.0, 3.0, 100.0):  # one wild run moves a median of three nowhere
        record(Pending("gguf", 10.0, prices, load_start=LOAD), actual_s=10.0 * ratio)
    assert factor_for("gguf", prices) == learned.Learned(3.0, 3)
    monkeypatch.setattr(learned, "load_average", lambda: LOAD + 8.0)  # busier now than when they ran
    busier = factor_for("gguf", prices)
    assert busier.factor == pytest.approx(3.0 * contention(LOAD + 8.0, threads) / contention(LOAD, threads)) and busier.factor > 3.0
    assert factor_for("gguf", "a measured profile") is None  # runs priced otherwise teach nothing
    assert factor_for("recover", prices) is None


def test_a_run_counts_the_load_it_lived_under_not_only_the_load_it_started_under(cache):
    threads = torch.get_num_threads()
    steady = {"load_start": 3.0, "load_end": 3.0, "threads": threads}
    assert learned.lived_load(steady) == pytest.approx(3.0)  # a steady load stays itself
    own = {"load_start": 3.0, "load_end": 3.0 + threads, "threads": threads}
    assert learned.lived_load(own) == pytest.approx(3.0)  # the job's own threads at the end are not contention
    busier = {"load_start": 1.0, "load_end": 9.0 + threads, "threads": threads}
    assert learned.lived_load(busier) == pytest.approx(5.0)  # started quiet, ended beside 9 other threads
    history = history_path()
    history.parent.mkdir(parents=True)
    run = dict(kind="gguf", predicted_s=10.0, prices="nominal", actual_s=40.0, finished=0.0) | busier
    history.write_text(json.dumps({"finished": [run]}))
    assert factor_for("gguf", "nominal").factor == pytest.approx(4.0 / contention(5.0, threads) * contention(LOAD, threads))


def test_an_unreadable_or_oversized_history_is_ignored_with_a_log_line(cache, caplog):
    path = history_path()
    path.parent.mkdir(parents=True)
    bad = {
        "not json": "{not json",
        "a wrong field": json.dumps({"finished": [{"kind": "table", "predicted_s": "soon"}]}),
        "oversized": json.dumps({"finished": [], "padding": "x" * learned.MAX_BYTES}),
    }
    for what, text in bad.items():
        path.write_text(text)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger=learned.__name__):
            assert table_seconds().correction is None, what
        assert any("ignoring the job-time history" in r.getMessage() for r in caplog.records), what
    before = table_seconds()
    record(Pending("table", before.total, before.prices, load_start=LOAD), actual_s=before.total * 2)  # replaces it
    assert table_seconds().where == "learned from 1 run on this machine"


def test_the_history_keeps_only_the_newest_records(cache, monkeypatch):
    monkeypatch.setattr(learned, "MAX_RECORDS", 4)
    for seconds in range(1, 8):
        record(Pending("gguf", 1.0, "nominal", load_start=LOAD), actual_s=float(seconds))
    kept = json.loads(history_path().read_text())["finished"]
    assert [r["actual_s"] for r in kept] == [4.0, 5.0, 6.0, 7.0]
    assert set(kept[0]) == {"kind", "predicted_s", "prices", "load_start", "threads", "actual_s", "load_end", "finished"}


def test_a_job_that_ends_well_is_recorded_and_one_that_fails_is_not(cache):
    predicted = table_seconds()
    m, go = JobManager(), threading.Event()

    def work(ctx, fail=False):
        ctx.expect(tuple(predicted.seconds), predicted)
        go.wait(5)
        if fail:
            raise TableError("no table")
        return "ok"

    failed = m.submit("table", lambda ctx: work(ctx, fail=True))
    done = m.submit("table", work)
    go.set()
    assert failed.wait(10) and done.wait(10) and (failed.status, done.status) == (FAILED, DONE)
    assert wait_for(lambda: history_path().exists(), timeout=10)
    (entry,) = json.loads(history_path().read_text())["finished"]
    assert entry["kind"] == "table" and entry["predicted_s"] == pytest.approx(predicted.total) and entry["actual_s"] >= 0.0
    assert table_seconds().where == "learned from 1 run on this machine"


def test_baseline_plans_have_a_predicted_time_for_every_stage_they_enter(cache, make_tiny):
    for allocators in (["uniform", "flap"], ["owl"]):
        predicted = cost_model.baselines_prediction("smollm2-135m", SPEC.windows, "wanda", allocators, budgets=5)
        assert tuple(predicted.seconds) == baseline_stages(allocators) and all(s > 0 for s in predicted.seconds.values())
    lm = make_tiny("llama")
    entered: list[str] = []
    baseline_rows(lm, synthetic_table(lm, data="news-sample"), [0.3], ["uniform", "flap"], hooks=Hooks(stage=entered.append))
    assert [LOAD_MODEL, *entered] == [LOAD_MODEL, SCORE_UNITS, PLAN] == list(baseline_stages(["uniform", "flap"]))
