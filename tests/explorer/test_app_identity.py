"""One plan by identity, one table by name, one label per quantity, through AppTest.

The plan the planner releases is stored under its content hash; the URL carries the hash, so
a reload (a new session given the old URL) prunes and exports that very plan, or says it
cannot restore it and refuses to re-derive another. A session whose URL names no table opens
the newest cached one and says so, with every cached table listed and its form filled in.
Same tiny real table and fresh cache as tests/explorer/test_app.py.
"""

from __future__ import annotations

import numpy as np
import pytest
from app_fixtures import cached_table, fresh_cache, job_of, start, texts, tiny_eval, tiny_table  # noqa: F401
from test_app_budget import chart, release

from gap_engine.core.config import APP_EVAL_WINDOWS, WindowSpec
from gap_engine.evaluate import history
from gap_engine.model.rateplan import RatePlan
from gap_engine.pipeline.runs import PruneEvalResult
from gap_engine.pipeline.stages import loss_table
from gap_engine.tables.artefact import TableSpec

pytestmark = pytest.mark.slow  # the real built-in model behind every page


def reload(at, page: str | None = None):
    return start(page, query=at.query_params)


def test_a_reload_prunes_and_exports_the_released_plan_by_its_hash(cached_table, smol):
    at = start("explorer/planner.py")
    at.multiselect(key="planner_locked").set_value([3]).run()  # constraints a reload must not lose
    at.selectbox(key="planner_lock_rate").set_value(0.5).run()
    data = chart(at)
    release(at, data, int(np.searchsorted(data["budgets"], 0.3)))
    digest = at.session_state["app_plan_hash"]
    plan = RatePlan.from_dict(dict(at.session_state["app_plan"]))
    assert plan.content_hash() == digest and at.query_params["plan"] == digest
    assert plan.attention_rates[3] == 0.5 and plan.mlp_rates[3] == 0.5

    again = reload(at, "explorer/evaluate.py")  # the reload lands on Prune & evaluate
    assert again.session_state["app_plan_hash"] == digest
    shown = [t for t in texts(again.caption) if digest in t]
    assert shown and f"+{plan.predicted_loss:.4f}" in shown[0], texts(again.caption)
    tiny_eval(again)
    again.button(key="eval_run").click().run()
    job = job_of(again, "prune_eval")
    assert job.wait(400), job.snapshot()
    again.run()
    assert job.status == "done", job.error
    result = again.session_state["app_last_run"]
    assert result.plan_hash == digest and result.plan["mlp_rates"] == plan.mlp_rates
    assert history.runs()[-1].params["plan_hash"] == digest
    assert any(digest in str(h.value) for h in again.subheader)
    assert any(m.label.startswith("Held-out KL to dense") for m in again.metric)
    assert any("(calibration)" in m.label for m in again.metric)

    again.switch_page("explorer/planner.py")
    again.run()  # the planner, restored with its locks, shows the same plan
    assert again.session_state["app_plan_hash"] == digest
    again.switch_page("explorer/export.py")
    again.run()
    assert not again.exception, [e.value for e in again.exception]
    source = again.selectbox(key="export_plan_source")
    assert f"dp at {plan.budget:.2%}, plan {digest}" in source.format_func("planner")
    assert f"plan {digest}" in source.format_func(f"run-{result.run_id}")
    assert any(f"Plan `{digest}` · budget {plan.budget:.2%}" in t for t in texts(again.caption))


def test_the_link_never_pairs_a_budget_with_the_plan_of_another(cached_table):
    """A CI run of tests/browser/test_browser_identity.py read the link of a release under load: the new
    budget beside the previous plan's hash. The run the release started was interrupted by the
    next one after it had set the budget and before it released the plan, and app.py syncs the
    URL in a finally all the same. That half-done state is set up here directly: the link then
    names the budget and no plan, and the next full run names both."""
    at = start("explorer/planner.py")
    data = chart(at)
    release(at, data, int(np.searchsorted(data["budgets"], 0.3)))
    digest, released = at.session_state["app_plan_hash"], at.session_state["app_budget"]
    assert at.query_params["plan"] == digest
    later = data["budgets"][int(np.searchsorted(data["budgets"], 0.4))]
    at.session_state["app_budget"] = later  # what the interrupted run leaves: the budget, not yet the plan
    at.switch_page("explorer/sensitivity.py")
    at.run()
    assert at.query_params["budget"] == repr(float(later)) and "plan" not in at.query_params, dict(at.query_params)
    at.switch_page("explorer/planner.py")
    at.run()
    assert at.session_state["app_plan"]["budget"] == at.session_state["app_budget"] == later != released
    assert at.query_params["plan"] == at.session_state["app_plan_hash"] != digest


def test_a_plan_the_link_names_but_cannot_restore_is_said_so_and_not_replaced(cached_table):
    at = start("explorer/evaluate.py", query={"table": cached_table.key, "budget": "0.3", "plan": "0123456789ab"})
    warned = [t for t in texts(at.warning) if "0123456789ab" in t]
    assert warned and "cannot be restored" in warned[0], texts(at.warning)
    assert at.session_state["app_plan"] is None
    at.button(key="eval_run").click().run()
    assert "prune_eval" not in at.session_state["app_jobs"]  # no re-derived plan runs in its place
    assert any("never another one" in t for t in texts(at.error)), texts(at.error)


def test_a_session_without_a_table_in_its_link_says_which_table_it_opened_and_why(cached_table, smol):
    other = loss_table(smol, TableSpec(windows=WindowSpec("news-sample", n_samples=3, seq_len=8), estimator="taylor", rate_grid=(0.0, 0.5)))
    at = start()
    assert at.session_state["app_table"].key == other.key  # the newest
    [note] = [t for t in texts(at.info) if "names no table" in t]
    assert other.key in note and cached_table.key in note and "The cache holds 2" in note
    assert "3 x 8 tokens" in note
    assert at.number_input(key="setup_samples").value == 3 and at.number_input(key="setup_seq_len").value == 8  # the form is the table's
    assert at.radio(key="setup_estimator").value == "taylor"


def test_a_runs_numbers_say_which_text_and_how_noisy_they_are(cached_table):
    at = start("explorer/evaluate.py")
    throughput = {
        "prefill_speedup": 1.12,
        "prefill_speedup_range": [0.95, 1.31],
        "decode_speedup": 1.05,
        "decode_speedup_range": [1.01, 1.1],
    }
    at.session_state["app_last_run"] = PruneEvalResult(
        run_id=7, plan={"allocator": "dp", "budget": 0.2503}, plan_hash="0123456789ab", objective="kl",
        predicted_loss=0.52, actual_loss=0.77, predicted_basis="estimated",
        report={"params": 100, "dense": {"params": 130, "perplexity": {"wiki-sample": 29.06}}, "perplexity": {"wiki-sample": 62.89},
                "kl_to_dense": {"wiki-sample": 0.858}, "throughput": throughput},
        checkpoint=None, seconds=1.0, stage_seconds={}, params_before=130, params_after=100,
    )  # fmt: skip
    at.run()
    assert not at.exception, [e.value for e in at.exception]
    metrics = {m.label: m for m in at.metric}
    assert "Held-out KL to dense (wiki-sample)" in metrics and "Calibration KL to dense (measured)" in metrics
    speed = metrics["Prefill speed vs dense"]
    assert speed.proto.delta == "range 0.95–1.31x"  # the median never alone; the sentence below says the rest
    (said,) = [t for t in texts(at.caption) if t.startswith("Speed against dense")]
    assert "0.95–1.31x, within noise" in said and "decode 1.05x (1.01–1.10x)" in said
    assert any("0123456789ab" in str(h.value) and "25.03%" in str(h.value) for h in at.subheader)
    # Recover measures on the held-out windows Prune & evaluate uses: one dense (and unrecovered) perplexity.
    at.switch_page("explorer/recover.py")
    at.run()
    windows = (at.session_state["recover_eval_samples"], at.session_state["recover_eval_seq_len"])
    assert (
        windows
        == (at.session_state["eval_samples"], at.session_state["eval_seq_len"])
        == (APP_EVAL_WINDOWS.n_samples, APP_EVAL_WINDOWS.seq_len)
    )


def test_technical_terms_have_a_help_sentence_and_the_sample_says_what_it_holds(cached_table):
    from pathlib import Path

    from explorer.glossary import GLOSSARY

    at = start()
    assert "fisher:" in at.radio(key="setup_estimator").proto.help and "taylor:" in at.radio(key="setup_estimator").proto.help
    assert "wanda" in at.selectbox(key="setup_criterion").proto.help
    assert "split:" in at.selectbox(key="setup_mode").proto.help and "nats/token:" in at.selectbox(key="setup_objective").proto.help
    dense = next(m for m in at.metric if m.label.startswith("Dense "))  # the tiny table's objective is nll
    assert dense.label == "Dense perplexity" and "nats/token" in dense.proto.delta
    assert dense.proto.help == GLOSSARY["dense objective"] and "calibration windows" in dense.proto.help  # what the label leaves out
    at.radio(key="setup_data_kind").set_value("Built-in sample")
    at.selectbox(key="setup_builtin_data").set_value("wiki-sample").run()
    assert any(t.startswith("104 English Wikipedia articles") and "206-page" in t for t in texts(at.caption)), texts(at.caption)
    pages = "\n".join(p.read_text() for p in (Path(__file__).resolve().parents[2] / "explorer").glob("*.py"))
    unused = [term for term in GLOSSARY if f'GLOSSARY["{term}"]' not in pages and f"GLOSSARY['{term}']" not in pages]
    assert unused == [], unused  # every term explained is shown somewhere
