"""Prune & evaluate with another criterion than the plan's: a plan pruned by ``obs`` (SlimGPT's
structured OBS) on its own number of calibration windows; the run records both.

The real built-in model behind the page; the tiny cached table of ``app_fixtures`` (news-sample,
2 windows of 16 tokens). The planner's DP plan on SmolLM2 is OBS's by default (the Llama family's
step: tests/explorer/test_app.py prunes it); here an uploaded uniform plan that cuts 5% of the first
block's MLP, its own criterion wanda, is pruned by OBS picked on the page.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from app_fixtures import cached_table, fresh_cache, job_of, start, tiny_eval, tiny_table  # noqa: F401

from gap_engine.evaluate import history

pytestmark = pytest.mark.slow  # the real built-in model behind the page


def test_prune_and_evaluate_prunes_a_plan_by_obs(cached_table, smol):
    from gap_engine.model.rateplan import make_plan

    at = start("explorer/evaluate.py")
    criterion = at.selectbox(key="eval_criterion")
    assert criterion.value == "the plan's own" and any(option.startswith("obs — SlimGPT") for option in criterion.options)
    assert criterion.options[0] == "the plan's own (obs)"  # the planner's DP plan: SmolLM2's step
    assert at.selectbox(key="app_compensation").disabled  # OBS's update is its compensation
    assert any(n.key == "eval_obs_samples" for n in at.number_input)  # asked for obs, the DP plan's step
    assert not any(n.key == "eval_fit_samples" for n in at.number_input)  # OBS fits on its own windows
    first_mlp = [0.05] + [0.0] * (smol.num_layers - 1)
    at.session_state["app_uploaded_plan"] = make_plan(smol, [0.0] * smol.num_layers, first_mlp, "wanda", allocator="uniform").to_dict()
    at.run()
    tiny_eval(at, save=True)
    at.selectbox(key="eval_allocator").set_value("uploaded plan").run()
    assert at.selectbox(key="eval_criterion").options[0] == "the plan's own (wanda)"
    assert not at.selectbox(key="app_compensation").disabled
    at.number_input(key="eval_fit_samples").set_value(5).run()  # wanda's plan: its bias may read more windows
    assert not any(t.key == "eval_fit_through_norms" for t in at.toggle)  # SmolLM2's blocks have no post-norms to fit through
    at.selectbox(key="eval_criterion").set_value("obs").run()
    assert not any(n.key == "eval_fit_samples" for n in at.number_input)
    assert at.selectbox(key="app_compensation").disabled  # OBS's update is its compensation
    at.number_input(key="eval_obs_samples").set_value(3).run()
    at.button(key="eval_run").click().run()
    job = job_of(at, "prune_eval")
    assert "criterion obs" in job.snapshot()["label"]
    assert job.wait(400), job.snapshot()
    at.run()
    assert job.status == "done", job.error
    result = at.session_state["app_last_run"]
    assert (result.plan["allocator"], result.plan["criterion"]) == ("uniform", "obs") and result.compensation is None
    [record] = history.runs()
    assert record.plan["criterion"] == "obs" and record.params["obs_windows"]["n_samples"] == 3
    assert record.params.get("compensation") is None  # the windows asked for the bias went with it: OBS fits on its own
    assert json.loads((Path(result.checkpoint) / "plan.json").read_text())["criterion"] == "obs"
    assert any("criterion obs" in str(h.value) for h in at.subheader)
