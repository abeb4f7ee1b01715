"""The explorer's Recover page through streamlit's AppTest: pick a saved checkpoint, start a
recovery job, cancel it after a few steps, resume it from the saved step, and see the recovered
numbers beside the unrecovered ones and the run in the history.

The checkpoint is a tiny two-layer Llama with the real SmolLM2 tokenizer, pruned to other
widths per block and saved by `checkpoint.save_pruned` under the checkpoints root of a fresh
cache, then recorded in the run history as Prune & evaluate would.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from conftest import stop_jobs
from streamlit.testing.v1 import AppTest

from gap_engine.data.next_sentence import OFFLINE_TASK
from gap_engine.evaluate import history
from gap_engine.pipeline.jobs import manager
from gap_engine.recover.files import partial_dir, saved_step

pytestmark = pytest.mark.slow  # the real SmolLM2 tokenizer and text behind the tiny model

APP = str(Path(__file__).resolve().parents[2] / "app.py")
RECOVER_PAGE = "explorer/recover.py"


@pytest.fixture
def saved_run(smol_tokenizer, tmp_path, monkeypatch) -> history.RunRecord:
    """A fresh cache whose history holds one run with a tiny pruned checkpoint."""
    from conftest import tiny_lm

    from gap_engine.core.config import WindowSpec
    from gap_engine.model.checkpoint import save_pruned
    from gap_engine.model.rateplan import make_plan
    from gap_engine.pipeline.stages import prune_with_plan

    monkeypatch.setenv("GAP_CACHE_DIR", str(tmp_path / "cache"))
    lm = tiny_lm("llama", smol_tokenizer)
    plan = make_plan(lm, [0.5, 0.0], [0.25, 0.5], "wanda", allocator="dp", budget=0.2)
    result = prune_with_plan(lm, plan, WindowSpec(data="news-sample", n_samples=2, seq_len=32, batch_size=2))
    folder = history.new_checkpoint_dir("dp", 0.2)
    save_pruned(lm, plan, result.kept_indices(), folder)
    record = history.RunRecord(model=lm.name, allocator="dp", plan=plan.to_dict(), budget=0.2, checkpoint=str(folder),
                               perplexity={"news-sample": 50000.0})  # fmt: skip
    record.id = history.record_run(record)
    yield record
    stop_jobs(manager(), timeout=120)


def start_page() -> AppTest:
    at = AppTest.from_file(APP, default_timeout=240)
    at.run()
    at.switch_page(RECOVER_PAGE)
    at.run()
    assert not at.exception, [e.value for e in at.exception]
    return at


# Enough steps that a cancel sent once step 2 is saved lands before the last one, however fast the
# machine (with 6, a quiet machine trained all 6 between two polls).
STEPS = 40


def wait_for(condition, what: str, limit: float = 600.0) -> None:
    """Poll a background job's state (a bound on a hang, not a timing assertion)."""
    deadline = time.monotonic() + limit
    while not condition():
        assert time.monotonic() < deadline, f"gave up waiting for {what}"
        time.sleep(0.2)


def test_recover_page_runs_cancels_resumes_and_compares(saved_run):
    at = start_page()
    assert at.selectbox(key="recover_run").value == saved_run.id
    assert any(str(saved_run.checkpoint) in str(c.value) for c in at.caption)
    at.radio(key="recover_method").set_value("mazo")
    at.multiselect(key="recover_sources").set_value(["news-sample"])
    at.number_input(key="recover_steps").set_value(STEPS)
    at.number_input(key="recover_lr").set_value(0.05)
    at.number_input(key="recover_batch_size").set_value(1)
    at.number_input(key="recover_seq_len").set_value(16)
    at.number_input(key="recover_eval_samples").set_value(1)
    at.number_input(key="recover_eval_seq_len").set_value(16)
    at.number_input(key="recover_generations").set_value(0)
    assert at.toggle(key="recover_tasks_on").value and at.text_input(key="recover_tasks").value == OFFLINE_TASK
    at.number_input(key="recover_task_limit").set_value(2)
    at.run()
    assert at.button(key="recover_go").label == "Recover"
    assert set(at.radio(key="recover_objective").options) == {"default", "kd", "lm", "kd+lm"}
    assert any(
        "Predicted time (not yet measured here): about" in str(c.value) and "of it scoring tasks" in str(c.value) for c in at.caption
    )  # before Start, from the cost model
    from gap_engine.core.fsutil import cache_root

    # ... at nominal prices: a page view never measures this machine (it takes seconds).
    assert any("nominal CPU speed" in str(c.value) for c in at.caption) and not list(cache_root().glob("costmodel/profile-*.json"))
    at.button(key="recover_go").click().run()
    assert not at.exception, [e.value for e in at.exception]
    job = manager().get(at.session_state["app_jobs"]["recover"])
    out_dir = Path(job.key)
    asked, job_link = form(at), dict(at.query_params)
    assert asked["recover_run"] == saved_run.id and asked["recover_steps"] == STEPS and "jobs" in job_link

    # Stages and steps arrive as progress; cancel once two steps are saved (save_every is 1 here).
    seen = []
    wait_for(lambda: job.snapshot()["expected_total"] is not None or not job.active, "the plan")
    assert job.snapshot()["expected_total"] > 0  # declared before the model loads: an ETA from the first second
    assert not list(cache_root().glob("costmodel/profile-*.json"))  # nor does the job's first ETA
    wait_for(lambda: seen.append(job.snapshot()["message"]) or (saved_step(out_dir) or 0) >= 2 or not job.active, "step 2")
    assert any("calibration" in m for m in seen) and any("mazo step" in m for m in seen), seen
    job.cancel()
    wait_for(lambda: not job.active, "the cancel")
    assert job.status == "cancelled", job.error
    reached = saved_step(out_dir)
    assert reached is not None and 2 <= reached < STEPS and not out_dir.exists()

    # The link of the running job (a reload during the run, read here once it stopped): the form is the job's.
    reloaded = AppTest.from_file(APP, default_timeout=240)
    reloaded.query_params.update(job_link)
    reloaded.run()
    reloaded.switch_page(RECOVER_PAGE)
    reloaded.run()
    assert reloaded.session_state["app_jobs"]["recover"] == job.id and form(reloaded) == asked

    at.run()
    assert any("Recovery was cancelled" in str(w.value) for w in at.warning)
    assert any(f"stopped at step {reached} of {STEPS}" in str(i.value) for i in at.info)
    assert at.button(key="recover_go").label == "Resume recovery"
    at.button(key="recover_go").click().run()
    resumed = manager().get(at.session_state["app_jobs"]["recover"])
    assert resumed.id != job.id and resumed.key == job.key
    wait_for(lambda: not resumed.active, "the resumed run")
    assert resumed.status == "done", resumed.error
    assert resumed.result.resumed_from == reached and resumed.result.steps_done == STEPS
    assert [row["step"] for row in resumed.result.curve] == list(range(1, STEPS + 1))
    assert out_dir.is_dir() and not partial_dir(out_dir).exists()

    at.run()
    assert not at.exception, [e.value for e in at.exception]
    assert any("Recovery finished" in str(s.value) for s in at.success)
    assert any("Objective lm (next-token loss): the dense base model" in str(c.value) for c in at.caption)
    [frame] = [d for d in at.dataframe if "measure" in d.value.columns and "recovered" in d.value.columns]  # one per held-out text
    table = frame.value.set_index("measure")
    assert list(table.columns) == ["dense", "unrecovered", "recovered"]  # four columns in all: whole on a 390 px phone
    assert list(table.index) == ["perplexity", "held-out KL", "top-1 agreement", "calibration loss"]  # short names, explained in help
    before, after = table.loc["perplexity", "unrecovered"], table.loc["perplexity", "recovered"]
    assert before > 0 and after > 0 and before != after
    calibration = table.loc["calibration loss"]  # per text, where the metric's one line was cut off
    assert [calibration["unrecovered"], calibration["recovered"]] == [
        resumed.result.calib_loss_before[0],
        resumed.result.calib_loss_after[0],
    ]
    assert {m.label: m.value for m in at.metric}["Calibration loss"] == f"{resumed.result.calib_loss_after[0]:.3f}"
    assert at.button(key="recover_go").label == "Recover"  # the finished run left no partial state
    # Task accuracy: the recovered model beside the unrecovered checkpoint (scored before training,
    # kept across the cancel) and dense (not here: the tiny model's base is nowhere, so nothing is cached).
    [tasks_frame] = [d.value.set_index("model") for d in at.dataframe if "model" in d.value.columns]  # one per task, a row per model
    recovered, unrecovered = (getattr(resumed.result, part)["task_accuracy"][OFFLINE_TASK] for part in ("after", "before"))
    assert recovered["n"] == unrecovered["n"] == 2
    assert any(c == f"{OFFLINE_TASK}, 2 examples" for c in texts(at.caption))
    assert list(tasks_frame.index) == ["dense", "unrecovered", "recovered"]
    assert tasks_frame.loc["recovered", "acc"] == f"{recovered['acc']:.3f} ± {recovered['acc_stderr']:.3f}"
    assert tasks_frame.loc["unrecovered", "acc"] == f"{unrecovered['acc']:.3f} ± {unrecovered['acc_stderr']:.3f}"
    assert tasks_frame.isna().loc["dense", "acc"]

    runs = history.runs()
    assert [r.allocator for r in runs] == ["dp", "dp+mazo"]
    assert runs[-1].checkpoint == str(out_dir)
    assert runs[-1].tasks["model"][OFFLINE_TASK] == recovered and runs[0].tasks == {}  # rows with and without tasks load side by side
    # The recovered checkpoint is itself offered for a further recovery.
    options = at.selectbox(key="recover_run").options
    assert len(options) == 2 and options[0].startswith(f"run {runs[-1].id}: dp+mazo"), options

    # A reload (a new session given the URL, the job's result gone) shows the same result panel,
    # read back from the recovered checkpoint's recovery.json.
    assert at.query_params["recovery"] == str(runs[-1].id)
    again = AppTest.from_file(APP, default_timeout=240)
    again.query_params.update(at.query_params)
    again.run()
    again.switch_page(RECOVER_PAGE)
    again.run()
    assert not again.exception, [e.value for e in again.exception]
    assert again.session_state["app_jobs"].get("recover") is None  # nothing but the URL carried it
    # The run's settings and checkpoint, not the page's defaults; "default" as the objective it resolved to.
    assert form(again) == asked | {"recover_objective": "lm"}
    shown = panel(at)
    assert len(shown["tables"]) == 2 and len(shown["metrics"]) == 4 and len(shown["captions"]) == 2, shown
    assert panel(again) == shown
    assert any(f"history run {runs[-1].id}" in h for h in panel(again)["headings"]), panel(again)["headings"]
    assert any(str(out_dir) in c for c in panel(again)["captions"])
    (out_dir / "recovery.json").write_text('{"method": "lora"}')  # a result file that is not one: said, not shown
    broken = AppTest.from_file(APP, default_timeout=240)
    broken.query_params.update(at.query_params)
    broken.run()
    broken.switch_page(RECOVER_PAGE)
    broken.run()
    assert not broken.exception and not panel(broken)["tables"]
    assert any(
        f"recovery run {runs[-1].id} from the link cannot be shown" in str(w.value) and "is not a recovery result" in str(w.value)
        for w in broken.warning
    ), [w.value for w in broken.warning]


FORM = ("recover_run", "recover_method", "recover_objective", "recover_sources", "recover_steps", "recover_lr", "recover_batch_size",
        "recover_seq_len", "recover_rank", "recover_mask_fraction", "recover_eval_samples", "recover_eval_seq_len", "recover_generations",
        "recover_minutes")  # fmt: skip


def form(at: AppTest) -> dict:
    """Recover's form as the page draws it."""
    return {key: at.session_state[key] for key in FORM}


def texts(elements) -> list[str]:
    return [str(e.value) for e in elements]


def panel(at: AppTest) -> dict:
    """What the result panel shows: headings, metrics, tables and captions."""
    return {
        "headings": [str(h.value) for h in at.subheader],
        "metrics": [(m.label, m.value, str(m.proto.delta)) for m in at.metric],
        "tables": [d.value.to_json() for d in at.dataframe if "recovered" in d.value.columns or "model" in d.value.columns],
        "captions": [str(c.value) for c in at.caption if str(c.value).startswith(("Recovered checkpoint", "Objective"))],
    }


def test_recover_page_without_checkpoints_points_to_prune_and_evaluate(tmp_path, monkeypatch):
    monkeypatch.setenv("GAP_CACHE_DIR", str(tmp_path / "cache"))
    at = start_page()
    assert any("No saved checkpoint yet" in str(i.value) for i in at.info)


def test_recover_page_bad_settings_give_a_message_and_no_job(saved_run):
    at = start_page()
    at.multiselect(key="recover_sources").set_value([])
    at.run()
    assert any("at least one text source" in str(w.value) for w in at.warning)
    at.button(key="recover_go").click().run()
    assert not at.exception
    assert "recover" not in at.session_state["app_jobs"]
    assert any("at least one text source" in str(e.value) for e in at.error)


@pytest.fixture
def saved_run_with_dense(smol_tokenizer, tmp_path, monkeypatch) -> history.RunRecord:
    """A history run whose tiny checkpoint was pruned from a dense model saved on disk: the teacher
    that writes the training text loads."""
    from conftest import tiny_lm

    from gap_engine.core.config import WindowSpec
    from gap_engine.model.checkpoint import save_pruned
    from gap_engine.model.loading import load_model
    from gap_engine.model.rateplan import make_plan
    from gap_engine.pipeline.stages import prune_with_plan

    monkeypatch.setenv("GAP_CACHE_DIR", str(tmp_path / "cache"))
    dense_dir = tmp_path / "tiny-dense"
    tiny_lm("llama", smol_tokenizer, initializer_range=0.1).model.save_pretrained(dense_dir)
    smol_tokenizer.save_pretrained(dense_dir)
    dense = load_model(str(dense_dir))
    plan = make_plan(dense, [0.5, 0.25], [0.5, 0.5], "wanda", allocator="dp", budget=0.3)
    result = prune_with_plan(dense, plan, WindowSpec(data="news-sample", n_samples=2, seq_len=32, batch_size=2))
    folder = history.new_checkpoint_dir("dp", 0.3)
    save_pruned(dense, plan, result.kept_indices(), folder)
    record = history.RunRecord(model=dense.name, allocator="dp", plan=plan.to_dict(), budget=0.3, checkpoint=str(folder),
                               perplexity={"news-sample": 500.0})  # fmt: skip
    record.id = history.record_run(record)
    yield record
    stop_jobs(manager(), timeout=120)


def test_recover_page_trains_on_teacher_text_and_keeps_the_best_judged_snapshot(saved_run_with_dense):
    at = start_page()
    at.multiselect(key="recover_sources").set_value(["teacher"])
    at.run()
    at.number_input(key="recover_teacher_tokens").set_value(128)
    for key, value in (("recover_steps", 4), ("recover_seq_len", 16), ("recover_batch_size", 1), ("recover_eval_samples", 1),
                       ("recover_eval_seq_len", 16), ("recover_generations", 0), ("recover_task_limit", 2), ("recover_eval_every", 2)):  # fmt: skip
        at.number_input(key=key).set_value(value)
    at.run()
    caption = next(str(c.value) for c in at.caption if "Predicted time (not yet measured here): about" in str(c.value))
    assert "of it writing teacher text" in caption and "of it judging 3 snapshots" in caption  # steps 0, 2 and 4
    at.button(key="recover_go").click().run()
    assert not at.exception, [e.value for e in at.exception]
    job = manager().get(at.session_state["app_jobs"]["recover"])
    seen: list[str] = []
    wait_for(lambda: seen.append(job.snapshot()["message"]) or not job.active, "the recovery")
    assert job.status == "done", job.error
    assert any("teacher text" in str(m) for m in seen) and any("judging step 2" in str(m) for m in seen), seen
    result = job.result
    assert result.tasks == ["teacher:128"] and set(result.after["perplexity"]) == {"wiki-sample", "news-sample"}
    assert [row["step"] for row in result.judge_curve] == [0, 2, 4] and "last 2 examples" in result.judge
    # The panel of the finished run (app.py hands a finished job's result to the session; set here,
    # as this AppTest runs the page alone after switch_page).
    at.session_state["app_last_recovery"] = result
    at.run()
    assert not at.exception, [e.value for e in at.exception]
    assert any(f"step {result.best_step} kept" in str(m.value) and "last 2 examples" in str(m.value) for m in at.markdown)
