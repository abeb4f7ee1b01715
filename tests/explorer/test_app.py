"""The app's page logic through streamlit's AppTest: widgets -> session state -> engine calls.

Tables and runs go to a fresh cache per test (GAP_CACHE_DIR); the converted built-in model
is linked in from the default cache so nothing is converted again. The loss table used by
most tests is a tiny real one: SmolLM2-135M, news-sample, 2 windows of 16 tokens, taylor,
rates 0 / 0.25 / 0.5 / 0.75.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import numpy as np
import pytest
from app_fixtures import (  # noqa: F401
    APP,
    ROOT,
    TINY_SPEC,
    cached_table,
    fresh_cache,
    job_of,
    link_models,
    plotly_specs,
    start,
    start_exact_build,
    texts,
    tiny_eval,
    tiny_table,
    values,
)

from gap_engine.data.next_sentence import OFFLINE_TASK
from gap_engine.evaluate import history
from gap_engine.model.rateplan import RatePlan
from gap_engine.model.units import has_attention_ties
from gap_engine.tables import cache
from gap_engine.views import figures

pytestmark = pytest.mark.slow  # the real built-in model behind every page


# ---- Setup ---------------------------------------------------------------------------------------
def test_setup_defaults_keep_a_first_build_short(fresh_cache):
    at = start()
    assert at.session_state["app_table"] is None
    assert any("No table loaded yet" in t for t in texts(at.info))
    # The defaults (config.APP_TABLE, from bench/results/defaults.md): the fast second-order
    # table of KL to the dense model on 16 x 256 tokens and rates in eighths.
    assert at.radio(key="setup_estimator").value == "fisher"
    assert at.selectbox(key="setup_objective").value == "kl"
    assert at.number_input(key="setup_samples").value == 16
    assert at.number_input(key="setup_seq_len").value == 256
    assert at.text_input(key="setup_rate_grid").value == "0, 0.125, 0.25, 0.375, 0.5, 0.625, 0.75, 0.875"
    assert at.selectbox(key="setup_builtin").value == "smollm2-135m"
    assert at.selectbox(key="setup_builtin_data").value == "wiki-sample"


@pytest.mark.heavy
def test_setup_offers_devices_and_estimates_the_build_before_it_runs(fresh_cache):
    at = start()
    assert at.selectbox(key="setup_device").value == "auto" and "cpu" in at.selectbox(key="setup_device").options
    assert at.selectbox(key="setup_dtype").value == "auto" and at.checkbox(key="setup_stream").value is False
    assert not any(
        "predicted fisher table" in t for t in texts(at.caption)
    )  # not calibrated in a fresh cache: only the nominal expected time
    at.button(key="setup_estimate").click().run(timeout=120)  # calibrates once (a few seconds)
    assert not at.exception
    lines = [t for t in texts(at.caption) if "predicted fisher table of smollm2-135m on cpu float32" in t]
    assert lines and "peak memory" in lines[0]
    at.radio(key="setup_estimator").set_value("exact").run()  # cached now: shown at once
    assert any("predicted exact table of smollm2-135m" in t and "distinct cells" in t for t in texts(at.caption))


def test_setup_bad_inputs_give_messages_not_tracebacks(fresh_cache):
    at = start()
    at.text_input(key="setup_rate_grid").set_value("0, 0.5, 0.25")
    at.button(key="setup_build").click().run()
    assert not at.exception
    assert any("strictly increasing" in t for t in texts(at.error))
    assert "table" not in at.session_state["app_jobs"]

    at.text_input(key="setup_rate_grid").set_value("0, 0.5")
    at.radio(key="setup_data_kind").set_value("Uploaded file").run()
    at.button(key="setup_build").click().run()
    assert any("Upload a .txt or .jsonl" in t for t in texts(at.error))

    at.radio(key="setup_data_kind").set_value("Built-in sample").run()
    at.radio(key="setup_model_kind").set_value("Local folder").run()
    at.text_input(key="setup_local_path").set_value("/no/such/model/folder").run()
    at.button(key="setup_build").click().run()
    job = job_of(at, "table")
    assert job.wait(120)
    at.run()
    assert not at.exception
    errors = texts(at.error)
    assert any("The loss table build failed" in t and "/no/such/model/folder" in t for t in errors), errors
    assert all("Traceback" not in t for t in errors)
    assert at.session_state["app_table"] is None


def test_setup_builds_in_the_background_then_loads_from_the_cache(fresh_cache):
    at = start()
    at.selectbox(key="setup_builtin_data").set_value("news-sample")
    at.radio(key="setup_estimator").set_value("taylor")
    at.number_input(key="setup_samples").set_value(2)
    at.number_input(key="setup_seq_len").set_value(16)
    at.text_input(key="setup_rate_grid").set_value("0, 0.25, 0.5, 0.75")
    at.button(key="setup_build").click().run()
    job = job_of(at, "table")
    assert job.kind == "table"
    assert job.wait(300), job.snapshot()
    at.run()
    assert not at.exception
    table = at.session_state["app_table"]
    assert table is not None and table.delta.shape == (60, 4)
    ready = next(t for t in texts(at.success) if "Loss table ready" in t)
    build_time = next(str(m.value) for m in at.metric if m.label == "Build time")
    assert f"ready in {build_time} (" in ready, (ready, build_time)  # one number for the job's time
    dense = next(m for m in at.metric if m.label == "Dense perplexity")  # a number a person reads, not a bare NLL
    assert str(dense.value) == f"{math.exp(table.dense_objective):.2f}" and f"{table.dense_objective:.4f} nats/token" in dense.proto.delta
    assert [row["key"] for row in cache.list_tables()] == [table.key]
    # The same settings again are a cache hit: priced as one (load and text), not as a build;
    # another rate grid is a build again.
    expected = next(t for t in texts(at.caption) if t.startswith(("Expected time", "Predicted time")))
    assert "cached here: Build reads it instead of building" in expected, expected
    at.text_input(key="setup_rate_grid").set_value("0, 0.5").run()
    expected = next(t for t in texts(at.caption) if t.startswith(("Expected time", "Predicted time")))
    assert "cached here" not in expected, expected

    # A new session (a later visit) starts from the cached table at once, without a job.
    again = start()
    assert again.session_state["app_table"].key == table.key
    assert "table" not in again.session_state["app_jobs"]
    assert any("most recent cached table" in t for t in texts(again.info))


def test_setup_cancel_stops_the_job_with_a_warning(fresh_cache):
    at = start()
    job = start_exact_build(at)
    assert job.active
    at.button(key="app_cancel_table").click().run()
    assert job.wait(120)
    at.run()
    assert job.status == "cancelled"
    assert any("was cancelled" in t for t in texts(at.warning))
    assert at.session_state["app_table"] is None
    assert not at.exception


def test_cached_tables_are_listed_loaded_and_deleted(cached_table):
    at = start()
    assert at.session_state["app_table"].key == cached_table.key  # loaded at once on a new session
    at.session_state["app_table"] = None
    at.run()
    assert at.selectbox(key="setup_cached_key").value == cached_table.key
    at.button(key="setup_load").click().run()
    assert at.session_state["app_table"].key == cached_table.key
    assert any("Loaded cached table" in t for t in texts(at.success))
    # Deleting asks first, saying what goes; "Keep it" keeps it.
    at.button(key="setup_delete").click().run()
    assert [row["key"] for row in cache.list_tables()] == [cached_table.key]
    assert any(f"Delete the loss table `{cached_table.key}` from the cache?" in t for t in texts(at.warning))
    at.button(key="setup_delete_keep").click().run()
    assert [row["key"] for row in cache.list_tables()] == [cached_table.key]
    assert not any("Delete the loss table" in t for t in texts(at.warning))
    at.button(key="setup_delete").click().run()
    at.button(key="setup_delete_confirm").click().run()
    assert cache.list_tables() == []
    assert any("Deleted" in t for t in texts(at.warning) + texts(at.success))
    assert "The cache holds no finished table yet." in texts(at.caption)  # the list shows it gone at once


def test_build_with_a_cached_tables_settings_loads_it_without_a_job(cached_table, smol):
    from gap_engine.data.bos import window_start
    from gap_engine.data.sources import record_fingerprint, text_stamps
    from gap_engine.data.windows import load_corpus
    from gap_engine.model.identity import ModelIdentity, model_stamps, record_model

    # What loading the model and reading the text record in this cache (tests/tables/test_lookup.py
    # sees the loader and the reader record them).
    record_model(
        model_stamps("smollm2-135m"),
        ModelIdentity(smol.fingerprint, smol.num_layers, window_start(smol.tokenizer), has_attention_ties(smol)),
    )
    record_fingerprint(text_stamps("news-sample"), load_corpus("news-sample").fingerprint)
    at = start()
    at.session_state["app_table"] = None
    at.selectbox(key="setup_builtin_data").set_value("news-sample")
    at.radio(key="setup_estimator").set_value("taylor")
    at.selectbox(key="setup_objective").set_value("nll")
    at.number_input(key="setup_samples").set_value(2)
    at.number_input(key="setup_seq_len").set_value(16)
    at.text_input(key="setup_rate_grid").set_value("0, 0.25, 0.5, 0.75")
    at.selectbox(key="setup_device").set_value("cpu")
    at.button(key="setup_build").click().run()
    assert not at.exception
    assert at.session_state["app_table"].key == cached_table.key
    assert any("found without loading the model" in t for t in texts(at.success))
    assert "table" not in at.session_state["app_jobs"]


# ---- Sensitivity ---------------------------------------------------------------------------------
def test_sensitivity_leads_with_the_heatmap_and_compares_a_few_layers(cached_table):
    at = start("explorer/sensitivity.py")
    heatmap, curves = plotly_specs(at)  # the heatmap first: every layer and rate in one picture
    assert {t["type"] for t in heatmap["data"]} == {"heatmap"}
    assert np.allclose(values(heatmap["data"][0]["z"]), cached_table.smoothed[0::2])
    picked = at.multiselect(key="sens_layers").value
    assert picked == figures.layers_to_compare(cached_table) and len(picked) == 4  # not 30 curves per panel
    lines = [t for t in curves["data"] if t["type"] == "scatter"]
    assert len(lines) == 8 and sorted({t["name"] for t in lines}) == sorted(f"layer {layer}" for layer in picked)
    assert sum(bool(t.get("showlegend")) for t in lines) == 4  # each picked layer named once
    at.radio(key="sens_log_y").set_value(True).run()
    curves = plotly_specs(at)[1]
    assert curves["layout"]["yaxis"]["type"] == "log"
    assert all((values(t["y"]) > 0).all() for t in curves["data"])
    at.multiselect(key="sens_kinds").set_value(["mlp"]).run()
    at.multiselect(key="sens_layers").set_value([0, 29]).run()
    assert len(plotly_specs(at)[1]["data"]) == 2
    assert not at.exception


def test_heatmap_rings_the_measured_cells_of_a_refined_table(fresh_cache, tiny_table):
    # The tiny taylor table with some cells marked measured, as a refined table records them.
    measured = np.zeros_like(tiny_table.removed, dtype=bool)
    measured[4:10, 1:3] = True
    mixed = dataclasses.replace(tiny_table, measured=measured | (tiny_table.removed == 0))
    cache.put_table(mixed)
    at = start("explorer/sensitivity.py")
    heatmap = plotly_specs(at)[0]
    rings = [t for t in heatmap["data"] if t["type"] == "scatter"]
    assert [t["name"] for t in rings] == ["measured exactly", "measured exactly"]  # attention and MLP panels
    assert sum(len(t["x"]) for t in rings) == int((measured & (tiny_table.removed > 0)).sum())
    cells = [t for t in heatmap["data"] if t["type"] == "heatmap"][0]
    assert any("measured exactly" in note for row in cells["text"] for note in row)
    assert any("estimated (gradient)" in note for row in cells["text"] for note in row)
    assert any("measured exactly (ringed" in str(c.value) for c in at.caption)


def test_pages_without_a_table_point_to_setup(fresh_cache):
    for page in ("explorer/sensitivity.py", "explorer/planner.py", "explorer/evaluate.py"):
        at = start(page)
        assert any("No loss table yet" in t for t in texts(at.info)), page


# ---- Budget planner: tests/explorer/test_app_budget.py (the budget chart, a release, the pages after it) ----


# ---- Prune & evaluate ----------------------------------------------------------------------------


def test_prune_and_evaluate_records_a_run(cached_table, smol):
    at = start("explorer/evaluate.py")
    assert any("No runs yet" in str(c.value) for c in at.caption)
    assert at.text_input(key="eval_tasks").value == OFFLINE_TASK  # the offline task is preselected
    tiny_eval(at, save=True, task_limit=2)
    assert at.selectbox(key="app_compensation").disabled  # the DP's step on SmolLM2, OBS, is its own compensation
    # The table's criterion with FLAP's bias (fitted on the tiny table's 32 tokens), picked on the page, so that the
    # planner's front pays for the biases (test_app_obs.py and the browser's user path prune by the default, OBS).
    at.selectbox(key="eval_criterion").set_value("wanda").run()
    assert at.selectbox(key="app_compensation").value == "bias" and not at.selectbox(key="app_compensation").disabled
    at.button(key="eval_run").click().run()
    job = job_of(at, "prune_eval")
    assert "task accuracy" in job.snapshot()["stages"] and "compensate" in job.snapshot()["stages"]
    assert job.wait(400), job.snapshot()
    at.run()
    assert job.status == "done", job.error
    assert any("Run 1 finished" in t for t in texts(at.success))
    result = at.session_state["app_last_run"]
    plan = result.plan
    assert plan["allocator"] == "dp" and plan["budget"] == at.session_state["app_budget"] >= 0.2  # the planner's row at 20%
    # the planner's front pays for the biases the compensation adds: the run removes the budget net of them
    assert plan["compensation"] == "bias" and plan["params"]["bias_params"] == result.compensation["bias_params"] > 0
    assert result.params_before - result.params_after == plan["params"]["removed"] - plan["params"]["bias_params"]
    assert result.actual_loss is not None
    runs = history.list_runs()
    assert list(runs["id"]) == [result.run_id]
    # the run, its checkpoint and its card say which compensation the model got (a plan file alone does not)
    assert result.compensation["mode"] == "bias" and runs.loc[0, "compensation"] == "bias"
    assert json.loads((Path(result.checkpoint) / "gap_pruned.json").read_text())["compensation"]["mode"] == "bias"
    assert "| compensation after the cut | bias (fitted block by block on 2 x 16" in (Path(result.checkpoint) / "README.md").read_text()
    assert "compensation bias" in at.subheader[0].value or any("compensation bias" in str(h.value) for h in at.subheader)
    assert runs.loc[0, "ppl:news-sample"] > 0 and runs.loc[0, "kl:news-sample"] >= 0
    assert Path(result.checkpoint).is_dir()
    assert len(plotly_specs(at)) == 3  # the measured frontier, the history chart, predicted vs actual
    assert result.predicted_basis == "estimated"  # a taylor table's cells are estimates
    # Task accuracy ± its standard error beside perplexity, for the run and for dense, on screen and in the history.
    score, dense_score = result.task_accuracy[OFFLINE_TASK], result.dense_task_accuracy[OFFLINE_TASK]
    assert score["n"] == 2 and dense_score["n"] == 2 and score["acc_stderr"] is not None
    [accuracy] = [m for m in at.metric if m.label.startswith(f"Accuracy ({OFFLINE_TASK}")]
    assert accuracy.value == f"{score['acc']:.3f} ± {score['acc_stderr']:.3f}"
    assert accuracy.proto.delta == f"dense {dense_score['acc']:.3f} ± {dense_score['acc_stderr']:.3f}"
    [task_rows] = [d.value for d in at.dataframe if "pruned acc" in d.value.columns]
    [shown] = [d.value for d in at.dataframe if "run" in d.value.columns]  # the history table
    assert shown[f"accuracy ({OFFLINE_TASK})"][0] == accuracy.value
    # a few columns that fit a 1366 px screen; every other one is a pick away
    assert list(shown.columns)[:3] == ["run", "allocator", "budget (of prunable)"] and len(shown.columns) <= 9
    picker = at.multiselect(key="eval_history_columns")
    assert len(picker.options) > len(shown.columns) and "table_key" not in picker.value
    assert list(task_rows["task"]) == [OFFLINE_TASK] and "pruned acc_norm" in task_rows.columns
    assert (
        runs.loc[0, f"acc:{OFFLINE_TASK}"] == score["acc"] and runs.loc[0, f"dense_acc_stderr:{OFFLINE_TASK}"] == dense_score["acc_stderr"]
    )

    # The planner draws the measured run beside the predicted front.
    at.switch_page("explorer/planner.py")
    at.run()
    chart = [e.proto for e in at.get("bidi_component") if e.proto.component_name == "gap_budget_chart"]
    front_fig = json.loads(json.loads(chart[0].json)["front_figure"])
    measured = [t for t in front_fig["data"] if t.get("name") == "dp: measured"]
    assert len(measured) == 1 and values(measured[0]["y"])[0] == pytest.approx(result.actual_loss)
    assert values(measured[0]["customdata"])[0][1] == pytest.approx(result.predicted_loss)  # hover: the prediction

    # Export offers the plan, table, history and the checkpoint.
    at.switch_page("explorer/export.py")
    at.run()
    assert not at.exception
    labels = {b.proto.label for b in at.get("download_button")}
    assert {"Plan (JSON)", "Plan (YAML)", "Loss table (CSV)", "Run history (CSV)", "Checkpoint (zip)"} <= labels
    # The charts' buttons read as words: an identifier such as "pred_vs_actual (HT…" is cut on a narrow screen.
    assert {"predicted vs actual (HTML)", "run history (HTML)"} <= labels and not any("_" in label for label in labels), labels
    assert at.selectbox(key="export_plan_source").value == "planner" or at.selectbox(key="export_plan_source").value.startswith("run-")
    zipped = history.checkpoint_zip(result.checkpoint)
    assert zipped[:2] == b"PK" and len(zipped) > 1_000_000
    # ... and as a llama.cpp file: the bytes the GGUF button serves (the weights are bfloat16 on disk)
    from gap_engine.export import gguf

    assert "Checkpoint (GGUF)" in labels and gguf.gguf_problem(result.checkpoint) is None
    outtype = at.selectbox(key="export_gguf_outtype").value
    # Its time before the click, the cost model's prediction (how close it comes to real
    # builds, cold and warm, is measured by bench/bench_expected.py: no timed assertion here).
    from explorer.job_text import duration_text
    from gap_engine.pipeline.cost_gguf import gguf_seconds

    [expected] = [c.value for c in at.caption if str(c.value).startswith(f"Building the {outtype} GGUF file takes about")]
    assert "predicted" in expected and f"about {duration_text(gguf_seconds(result.checkpoint, outtype))} " in expected
    assert gguf.gguf_bytes(result.checkpoint, outtype)[:4] == b"GGUF"
    assert "bfloat16" in next(b.proto.help for b in at.get("download_button") if b.proto.label == "Checkpoint (zip)")

    # Deleting the run removes its checkpoint too.
    at.switch_page("explorer/evaluate.py")
    at.run()
    at.button(key="eval_delete").click().run()
    assert any(result.checkpoint in str(w.value) for w in at.warning)  # it says the checkpoint goes too
    at.button(key="eval_delete_confirm").click().run()
    assert history.list_runs().empty
    assert not Path(result.checkpoint).exists()


def test_prune_and_evaluate_refuses_a_bad_task_or_folder_before_any_job(cached_table, tmp_path):
    at = start("explorer/evaluate.py")
    tiny_eval(at, task_limit=2)
    at.text_input(key="eval_tasks").set_value(f"{OFFLINE_TASK}, no_such_task_xyz")
    at.button(key="eval_run").click().run()
    assert not at.exception, [e.value for e in at.exception]
    errors = texts(at.error)
    assert len(errors) == 1 and "unknown task 'no_such_task_xyz'" in errors[0] and "\n" not in errors[0], errors
    assert "prune_eval" not in at.session_state["app_jobs"]
    (tmp_path / "tasks").mkdir()
    at.text_input(key="eval_tasks").set_value(OFFLINE_TASK)
    at.text_input(key="eval_task_folder").set_value(str(tmp_path / "tasks"))
    at.button(key="eval_run").click().run()
    errors = texts(at.error)
    assert len(errors) == 1 and "holds no task YAML" in errors[0], errors
    assert "prune_eval" not in at.session_state["app_jobs"]


def test_prune_and_evaluate_cancel_and_uploaded_plan(cached_table, smol):
    at = start("explorer/evaluate.py")
    tiny_eval(at)
    at.button(key="eval_run").click().run()
    job = job_of(at, "prune_eval")
    job.cancel()
    assert job.wait(120)
    at.run()
    assert job.status == "cancelled"
    assert any("Prune and evaluate was cancelled" in t for t in texts(at.warning))
    assert history.list_runs().empty

    # A plan accepted on Export shows up as an allocator here.
    from gap_engine.model.rateplan import uniform_plan

    at.session_state["app_uploaded_plan"] = uniform_plan(smol, 0.25, "wanda").to_dict()
    at.run()
    assert any(o.startswith("uploaded plan") for o in at.selectbox(key="eval_allocator").options)
    assert not at.exception

    # OBS's update is its own compensation: the default bias is not added to the DP's plans on SmolLM2 (its step) nor
    # to SlimGPT's; the table's criterion takes it.
    assert at.selectbox(key="app_compensation").disabled
    at.selectbox(key="eval_allocator").set_value("uniform").run()
    assert not at.selectbox(key="app_compensation").disabled
    at.selectbox(key="eval_allocator").set_value("slimgpt").run()
    assert at.selectbox(key="app_compensation").disabled and at.selectbox(key="app_compensation").value == "bias"
    assert any("updates the kept columns itself" in str(c.value) for c in at.caption)


def test_export_without_runs_still_offers_the_plan_and_table(cached_table):
    at = start("explorer/planner.py")
    at.switch_page("explorer/export.py")
    at.run()
    assert not at.exception
    labels = {b.proto.label for b in at.get("download_button")}
    assert {"Plan (JSON)", "Plan (YAML)", "Loss table (CSV)", "Loss table (JSON)", "Run history (CSV)"} <= labels
    assert "Checkpoint (zip)" not in labels
    assert any(label.endswith("(HTML)") for label in labels)
    assert RatePlan.from_dict(dict(at.session_state["app_plan"])).allocator == "dp"


def test_history_png_is_drawn_on_white_with_its_marks():
    # A stakeholder's export of the run-history chart once came out all black.
    import io

    import pandas as pd
    from PIL import Image

    from explorer.png_export import render_png
    from gap_engine.views import figures

    frame = pd.DataFrame(
        {
            "id": [1, 2, 3],
            "created": ["a", "b", "c"],
            "allocator": ["dp", "uniform", "dp"],
            "budget": [0.1, 0.2, 0.3],
            "ppl:wiki-sample": [40.0, 80.0, 60.0],
        }
    )
    png = render_png({"history": figures.history_figure(frame, "ppl:wiki-sample")})["history"]
    grey = np.asarray(Image.open(io.BytesIO(png)).convert("L"))  # (H, W) 0 black .. 255 white
    assert grey.mean() > 200, grey.mean()  # a white page, as the app shows it
    assert 0.002 < (grey < 160).mean() < 0.2  # with axes, labels and markers on it


def test_export_renders_png_with_the_local_chromium(cached_table):
    at = start("explorer/sensitivity.py")
    at.switch_page("explorer/export.py")
    at.run()
    at.button(key="export_render_png").click().run(timeout=240)
    assert not at.exception
    assert at.session_state["export_png_error"] == "", at.session_state["export_png_error"]
    pngs = at.session_state["export_png"]
    assert {"sensitivity", "heatmap", "planner"} <= set(pngs)
    assert all(data[:8] == b"\x89PNG\r\n\x1a\n" for data in pngs.values())
    labels = {b.proto.label for b in at.get("download_button")}
    assert "planner (PNG)" in labels


def test_a_first_build_on_a_fresh_machine_shows_a_predicted_time_before_build(fresh_cache):
    """With no measurement of this machine, Setup shows the cost model's time for the
    whole build (text and the load included), stage by stage, labelled a prediction, never "not known yet"."""
    at = start()
    texts = [str(c.value) for c in at.caption]
    predicted = [t for t in texts if t.startswith("Predicted time (not yet measured here): about")]
    assert predicted and "nominal CPU speed" in predicted[0] and "gradient pass" in predicted[0], texts
    assert not any("not known yet" in t for t in texts)


def test_a_first_run_shows_a_predicted_time_before_start(cached_table):
    """The same on Prune & evaluate: every stage predicted (task accuracy included)."""
    at = start("explorer/evaluate.py")
    texts = [str(c.value) for c in at.caption]
    predicted = [t for t in texts if t.startswith("Predicted time (not yet measured here): about")]
    assert predicted and "held-out text" in predicted[0] and "task accuracy" in predicted[0] and "nominal CPU speed" in predicted[0], texts
    assert not any("not known yet" in t for t in texts)
    # With the task picker on, lm-eval is imported in the background as the page draws,
    # so the first Start does not block on it for seconds.
    from gap_engine.evaluate import lm_eval_import

    assert at.toggle(key="eval_tasks_on").value and lm_eval_import._warm_up is not None
    lm_eval_import._warm_up.join(120)
    assert lm_eval_import.lm_eval_imported()
