"""The stakeholder view of Prune & evaluate and Export: a run leads with its takeaway, its plan is
measured with the other compensation in one click, and the two are compared with an interval and
drawn on the measured frontier.

The real built-in model behind the page; the tiny cached table of ``app_fixtures`` (news-sample,
2 windows of 16 tokens) and held-out evaluation on 2 windows of 16 tokens.
"""

from __future__ import annotations

import pytest
from app_fixtures import cached_table, fresh_cache, job_of, plotly_specs, start, texts, tiny_eval, tiny_table  # noqa: F401

from gap_engine.evaluate import history

pytestmark = pytest.mark.slow  # the real built-in model behind the page


def finished(at, kind: str = "prune_eval"):
    job = job_of(at, kind)
    assert job.wait(400), job.snapshot()
    at.run()
    assert job.status == "done", job.error
    return at.session_state["app_last_run"]


def test_a_run_leads_with_its_takeaway_and_uniform_and_no_compensation_are_one_click_away(cached_table):
    at = start("explorer/evaluate.py")
    tiny_eval(at)
    at.button(key="eval_run").click().run()
    first = finished(at)
    assert first.compensation is None and first.plan["criterion"] == "obs"  # the page's default: SmolLM2's DP step, OBS
    [said] = [t for t in texts(at.info) if "of prunable parameters removed" in t]
    assert f"GAP's plan (run {first.run_id}) gives perplexity {first.report['perplexity']['news-sample']:.1f} [" in said
    assert "No uniform run at this budget on these held-out windows yet" in said  # nothing made up to compare with

    at.button(key=f"eval_beside_uniform_{first.run_id}").click().run()
    uniform = finished(at)
    stored = history.get_run(uniform.run_id)
    assert stored.allocator == "uniform" and stored.budget == first.plan["budget"] and uniform.compensation is None
    assert stored.plan["criterion"] == "obs"  # pruned as the DP run was: only the allocator differs
    [said] = [t for t in texts(at.info) if "of prunable parameters removed" in t]
    assert f"GAP's plan (run {first.run_id}) keeps perplexity" in said and f"where uniform pruning (run {uniform.run_id}) gives" in said
    assert said.count("[") == 3  # both perplexities and their ratio carry an interval

    at.session_state["app_last_run"] = first  # back to the DP run, as a reload of its link shows it
    at.run()
    assert not any(b.key == f"eval_beside_uniform_{first.run_id}" for b in at.button)  # compared: no button
    at.button(key=f"eval_beside_same_plan_{first.run_id}").click().run()
    twin = finished(at)
    assert twin.run_id != first.run_id and twin.compensation["mode"] == "bias"  # FLAP's bias after the OBS update
    assert (twin.plan["attention_rates"], twin.plan["mlp_rates"]) == (first.plan["attention_rates"], first.plan["mlp_rates"])
    stored = history.get_run(twin.run_id)
    assert stored.params["eval"]["windows"]["n_samples"] == 2 and stored.prefill_speedup is None  # its windows, no timing
    [compared] = [t for t in texts(at.info) if t.startswith("The same plan with bias compensation")]
    assert f"(run {twin.run_id}) keeps perplexity" in compared and f"where without compensation (run {first.run_id}) gives" in compared
    assert compared.count("[") == 3  # both perplexities and their ratio carry an interval
    assert not any(b.key == f"eval_beside_same_plan_{twin.run_id}" for b in at.button)  # measured both ways: the comparison, no button
    [frontier] = [s for s in plotly_specs(at) if any(t.get("name") == "dp + bias" for t in s["data"])]
    runs = [t for t in frontier["data"] if "error_y" in t]  # the intervals, as error bars
    assert sorted(t["name"] for t in runs) == ["dp", "dp", "dp + bias", "dp + bias", "uniform", "uniform"]  # both panels
    assert any(str(t.get("name", "")).startswith("dense ") for t in frontier["data"])  # the dense model's, with its interval

    at.switch_page("explorer/export.py")
    at.run()
    assert not at.exception
    assert any("of prunable parameters removed" in t and "perplexity" in t for t in texts(at.info))
    assert "measured frontier (HTML)" in {b.proto.label for b in at.get("download_button")}
