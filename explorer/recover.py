"""Recover: a short fine-tune of a pruned checkpoint (LoRA, MaZO or MeZO), beside the unrecovered run.

The checkpoint is one saved by Prune & evaluate (any run of the history with a checkpoint).
Training reads the calibration part of each chosen text (one task each) and the model is
evaluated on their held-out parts before and after. The work is a background job with
stages, an ETA and Cancel; the same request after a cancel resumes from the last saved step.
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

import pandas as pd
import streamlit as st

from explorer import ownership
from explorer.confirm import ask_first, confirmation
from explorer.glossary import GLOSSARY
from explorer.job_panel import job_controls
from explorer.job_text import duration_text
from explorer.messages import clear_message, set_message
from explorer.page_paths import EVALUATE_PAGE
from explorer.session_jobs import remember_job, session_job
from explorer.session_keys import init_page
from explorer.task_picker import checked_task_settings, task_defaults, task_examples, task_picker
from gap_engine.core.config import APP_EVAL_WINDOWS, RECOVERY_DEFAULT_TEXTS
from gap_engine.core.errors import GapError, one_line
from gap_engine.data.windows import BUILTIN_SOURCES
from gap_engine.evaluate import history
from gap_engine.evaluate.tasks import score_text
from gap_engine.model.checkpoint import is_pruned_checkpoint
from gap_engine.pipeline.cost_model import recovery_prediction
from gap_engine.pipeline.jobs import manager, recover_task
from gap_engine.pipeline.recovery import DEFAULT_LR, RecoveryResult, RecoverySettings, app_output_dir
from gap_engine.recover.files import discard, partial_dir, saved_step
from gap_engine.recover.methods import RECOVERY_METHODS, RECOVERY_OBJECTIVES
from gap_engine.recover.teacher_text import DEFAULT_TOKENS, SOURCE
from gap_engine.views import figures

TEXT_LABELS = {SOURCE: "teacher: text the dense model writes"}  # the named texts go by their own names

OBJECTIVE_HELP = {
    "default": "kd when the dense model the checkpoint was pruned from is on this machine, else lm",
    **{name: RECOVERY_OBJECTIVES.describe(name) for name in RECOVERY_OBJECTIVES},
}
DEFAULTS = {
    "recover_run": None,
    "recover_method": "lora",
    "recover_objective": "default",
    "recover_temperature": 1.0,
    "recover_sources": list(RECOVERY_DEFAULT_TEXTS),
    "recover_steps": 20,
    "recover_lr": 0.0,
    "recover_minutes": 0.0,
    "recover_teacher_tokens": DEFAULT_TOKENS,
    "recover_eval_every": 0,
    "recover_batch_size": 2,
    "recover_seq_len": 128,
    "recover_rank": 8,
    "recover_mask_fraction": 0.05,
    # The held-out windows of Prune & evaluate: the dense and unrecovered numbers here are the ones shown there.
    "recover_eval_samples": APP_EVAL_WINDOWS.n_samples,
    "recover_eval_seq_len": APP_EVAL_WINDOWS.seq_len,
    "recover_generations": 1,
} | task_defaults("recover_")
init_page("recover_", DEFAULTS)
st.title("Recover")
ss = st.session_state


def checkpoint_runs() -> dict[int, history.RunRecord]:
    """Runs of the history whose saved checkpoint is still on disk, newest first."""
    try:
        records = history.runs()
    except GapError as exc:
        st.error(one_line(exc))
        return {}
    found = [r for r in records if r.checkpoint and is_pruned_checkpoint(r.checkpoint)]
    return {int(r.id): r for r in reversed(found)}


def run_label(record: history.RunRecord) -> str:
    budget = f" at {record.budget:.2%}" if record.budget is not None else ""
    ppl = ", ".join(f"ppl {v:.1f} ({k})" for k, v in list(record.perplexity.items())[:1])
    return f"run {record.id}: {record.allocator}{budget}" + (f" · {ppl}" if ppl else "")


def judge_tasks() -> tuple[str, ...]:
    """The picker's tasks when snapshots are judged and task accuracy is on (else judged by held-out KL)."""
    if not int(ss["recover_eval_every"]) or not ss["recover_tasks_on"]:
        return ()
    return tuple(name.strip() for name in str(ss["recover_tasks"]).split(",") if name.strip())


def settings_from_state() -> RecoverySettings:
    """The page's RecoverySettings, validated (RecoveryError/DataError on a bad value)."""
    steps, every = int(ss["recover_steps"]), int(ss["recover_eval_every"])
    objective = ss["recover_objective"]
    texts = [f"{SOURCE}:{int(ss['recover_teacher_tokens'])}" if name == SOURCE else name for name in ss["recover_sources"]]
    return RecoverySettings(
        method=ss["recover_method"],
        objective=None if objective == "default" else objective,
        temperature=float(ss["recover_temperature"]),
        tasks=tuple(texts),
        steps=steps,
        lr=float(ss["recover_lr"]) or None,
        batch_size=int(ss["recover_batch_size"]),
        seq_len=int(ss["recover_seq_len"]),
        rank=int(ss["recover_rank"]),
        mask_fraction=float(ss["recover_mask_fraction"]),
        save_every=every or max(1, min(25, steps // 4)),  # judged snapshots are saved ones
        time_budget_s=float(ss["recover_minutes"]) * 60 or None,
        eval_every=every,
        eval_tasks=judge_tasks(),
        # The last examples judge, the first ones (the picker's count) are reported: apart while 2 x count fits the task.
        eval_task_examples=max(1, int(ss.get("recover_task_limit") or DEFAULTS["recover_task_limit"])),  # not drawn with tasks off
        eval_samples=int(ss["recover_eval_samples"]),
        eval_seq_len=int(ss["recover_eval_seq_len"]),
        eval_generations=int(ss["recover_generations"]),
    ).validate()


def start_recovery(checkpoint: str) -> None:
    clear_message("recover")
    try:
        settings = settings_from_state()
        out_dir = app_output_dir(checkpoint, settings)
    except GapError as exc:
        set_message("recover", "error", one_line(exc))
        return
    tasks_ok, task_settings = checked_task_settings("recover_", "recover")  # the engine's check, as for gap eval --tasks
    if not tasks_ok:
        return
    task = recover_task(checkpoint, settings, out_dir, task_settings, maker=ownership.owner())
    job = manager().submit(
        "recover", task, key=str(out_dir), label=f"{settings.method} on {Path(checkpoint).name}",
        params={"checkpoint": checkpoint, "settings": asdict(settings)},  # a reload fills the form from them
        owner=ownership.owner(),
    )  # fmt: skip
    remember_job("recover", job)


def start_over(out_dir: Path) -> None:
    discard(partial_dir(out_dir))
    set_message("recover", "info", "The saved partial run was discarded; Recover starts from step 0.")


# ---- what to recover -----------------------------------------------------------------------------
candidates = checkpoint_runs()
if not candidates:
    st.info("No saved checkpoint yet: run **Prune & evaluate** with *Save checkpoint* on, then come back.")
    st.page_link(EVALUATE_PAGE, label="Go to Prune & evaluate", icon=":material/science:")
    st.stop()
last = ss["app_last_run"].run_id if ss.get("app_last_run") else None
if ss["recover_run"] not in candidates:
    ss["recover_run"] = last if last in candidates else next(iter(candidates))
left, right = st.columns([1, 1], gap="large")
with left:
    st.subheader("Checkpoint and method")
    st.selectbox("Pruned checkpoint", list(candidates), key="recover_run", format_func=lambda i: run_label(candidates[i]))
    chosen = candidates[ss["recover_run"]]
    st.caption(f"`{chosen.checkpoint}`")
    st.radio("Method", RECOVERY_METHODS.names, key="recover_method", format_func=RECOVERY_METHODS.label)
    method = ss["recover_method"]
    st.radio(
        "Objective",
        ("default", *RECOVERY_OBJECTIVES.names),
        key="recover_objective",
        horizontal=True,
        format_func=lambda o: o,
        help=" · ".join(f"{k}: {v}" for k, v in OBJECTIVE_HELP.items()),
    )
    st.caption(OBJECTIVE_HELP[ss["recover_objective"]])
    st.multiselect(
        "Training text (calibration part; one task each)",
        [*BUILTIN_SOURCES, SOURCE],
        key="recover_sources",
        format_func=lambda name: TEXT_LABELS.get(name, name),
        help="teacher: sequences the dense model writes itself (sampled at temperature 1, top-p 0.95, seeded), "
        "written once and cached; distilling on them keeps what the dense model could do.",
    )
    if SOURCE in ss["recover_sources"]:
        st.number_input("Tokens the dense model writes", min_value=128, max_value=1 << 20, step=4096, key="recover_teacher_tokens")
    c1, c2 = st.columns(2)
    c1.number_input("Steps", min_value=1, max_value=100_000, step=10, key="recover_steps")
    c2.number_input("Stop after (minutes, 0: no limit)", min_value=0.0, max_value=600.0, step=1.0, key="recover_minutes")
with right:
    st.subheader("Settings")
    c1, c2 = st.columns(2)
    default_lr = f"{DEFAULT_LR[method]:g}" if method == "lora" else f"probed around {DEFAULT_LR[method]:g}"
    c1.number_input(f"Learning rate (0: {default_lr})", min_value=0.0, max_value=1.0, step=1e-4, format="%g", key="recover_lr")
    c2.number_input("Windows per task per step", min_value=1, max_value=64, step=1, key="recover_batch_size")
    c1, c2 = st.columns(2)
    c1.number_input("Tokens per training window", min_value=8, max_value=2048, step=8, key="recover_seq_len")
    if method == "lora":
        c2.number_input("LoRA rank", min_value=1, max_value=256, step=1, key="recover_rank")
    elif method == "mazo":
        c2.number_input(
            "Share of each row that trains", min_value=0.001, max_value=1.0, step=0.01, format="%.3f", key="recover_mask_fraction"
        )
    if ss["recover_objective"] in ("default", "kd", "kd+lm"):
        c1.number_input("Distillation temperature", min_value=0.05, max_value=100.0, step=0.5, key="recover_temperature")
    c1, c2, c3 = st.columns(3)
    c1.number_input("Held-out samples", min_value=1, max_value=256, step=1, key="recover_eval_samples")
    c2.number_input("Tokens per sample", min_value=8, max_value=2048, step=8, key="recover_eval_seq_len")
    c3.number_input("Generations", min_value=0, max_value=3, step=1, key="recover_generations")
    task_picker("recover_")
    st.number_input(
        "Keep the best snapshot, judged every (steps; 0: the last)",
        min_value=0,
        max_value=100_000,
        step=5,
        key="recover_eval_every",
        help="Every K steps (and at the start and the end) the snapshot is scored and the best one is saved: by the "
        "tasks above on their last examples (as many as the examples per task, apart from the first ones reported), "
        "else by held-out KL to the dense model.",
    )

# ---- start, resume, cancel -----------------------------------------------------------------------
try:
    out_dir = app_output_dir(chosen.checkpoint, settings_from_state())
except GapError as exc:
    out_dir = None
    st.warning(one_line(exc))
else:
    # This machine's cached speed, else nominal CPU prices (never measured on a page view: it takes seconds).
    predicted = recovery_prediction(chosen.checkpoint, settings_from_state(), task_examples=task_examples("recover_"))
    if predicted is not None:
        before, _, after = predicted.seconds.values()
        parts = [(predicted.tasks_s, "scoring tasks"), (predicted.text_s, "writing teacher text")]
        parts.append((predicted.judge_s, f"judging {predicted.judgements} snapshots"))
        scoring = "".join(f", {duration_text(seconds)} of it {what}" for seconds, what in parts if seconds)
        st.caption(
            f"Predicted time ({predicted.where}): about {duration_text(predicted.total)} "
            f"({predicted.step_s:.2g} s per step, {duration_text(before)} before training, "
            f"{duration_text(after)} after{scoring}; {predicted.basis})"
        )
running = session_job("recover")
reached = saved_step(out_dir) if out_dir is not None else None
if reached is not None and not (running and running.active):
    st.info(f"A run with these settings stopped at step {reached} of {ss['recover_steps']}: Recover resumes it from there.")
    ask_first(st, "Start over…", "recover_start_over", str(out_dir), icon=":material/restart_alt:")
    confirmation(
        "recover_start_over",
        str(out_dir),
        f"Discard the saved partial run (step {reached} of {ss['recover_steps']}, in `{partial_dir(out_dir)}`)? "
        "Recover then starts from step 0; the steps done so far are lost.",
        "Discard it",
        start_over,
        (out_dir,),
    )
label = "Resume recovery" if reached is not None else "Recover"
job_controls(
    "recover", label, "recover_go", start_recovery, ":material/healing:", "Recovery", "recover", args=(chosen.checkpoint,), type="primary"
)

# ---- the latest recovery beside the unrecovered model ----------------------------------------------
# Short row names, explained once: a 390 px phone shows the four columns whole.
MEASURES = (("perplexity", "perplexity"), ("held-out KL", "kl_to_dense"), ("top-1 agreement", "top1_agreement"))
CALIBRATION_HELP = "Calibration loss: the next-token loss on fixed windows of the text's calibration part, which training read."
MEASURE_HELP = (
    "On each text's held-out part: perplexity; held-out KL, the KL divergence from dense in nats/token; top-1 agreement, "
    "the share of tokens whose most likely next token is dense's. " + CALIBRATION_HELP
)
NUMBERS = st.column_config.NumberColumn(format="%.5g")  # 51115.1673 as 51115 and 10.8134 as 10.813: five digits fit a phone


def comparison(result: RecoveryResult) -> dict[str, pd.DataFrame]:
    """Per held-out text, one row per measure and one column each for dense, the unrecovered
    checkpoint and the recovered model."""
    before, after = result.before or {}, result.after
    dense = (after.get("dense") or {}).get("perplexity", {})
    dense_calibration = after.get("dense_calib_loss") or [None] * len(result.tasks)  # results written before it was measured: blank
    calibration = {
        task: triple for task, *triple in zip(result.tasks, dense_calibration, result.calib_loss_before, result.calib_loss_after)
    }
    tables = {}
    for task in after["perplexity"]:
        rows = [
            {"measure": measure, "dense": dense.get(task) if key == "perplexity" else (0.0 if key == "kl_to_dense" else 1.0),
             "unrecovered": before.get(key, {}).get(task), "recovered": after.get(key, {}).get(task)}
            for measure, key in MEASURES
        ]  # fmt: skip
        if task in calibration:
            dense_loss, before_loss, after_loss = calibration[task]
            rows.append({"measure": "calibration loss", "dense": dense_loss, "unrecovered": before_loss, "recovered": after_loss})
        tables[task] = pd.DataFrame(rows)
    return tables


def task_tables(result: RecoveryResult) -> dict[str, pd.DataFrame]:
    """Per lm-eval task, one row each for dense, the unrecovered checkpoint and the recovered model
    (three narrow columns rather than one wide row per task)."""
    models = (
        ("dense", (result.after or {}).get("dense_task_accuracy") or {}),
        ("unrecovered", (result.before or {}).get("task_accuracy") or {}),
        ("recovered", (result.after or {}).get("task_accuracy") or {}),
    )
    tables = {}
    for task in (result.after or {}).get("task_accuracy") or {}:
        rows = [
            {"model": label, "acc": score_text(scores.get(task)), "acc_norm": score_text(scores.get(task), "acc_norm")}
            for label, scores in models
        ]
        frame = pd.DataFrame(rows)
        tables[task] = frame if frame["acc_norm"].notna().any() else frame.drop(columns="acc_norm")
    return tables


def mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


result = ss.get("app_last_recovery")
if result:
    st.divider()
    run_text = f" (history run {result.run_id})" if result.run_id is not None else ""
    st.subheader(f"{result.method}: {result.steps_done} of {result.steps_requested} steps{run_text}")
    if result.objective_note:
        st.caption(result.objective_note.capitalize() + f"; saved as {result.save_dtype}")
    if result.guard_summary:
        st.warning("Divergence guard: " + result.guard_summary + ".")
    c = st.columns(2) + st.columns(2)  # two per row: long values stay whole at 1400 px and on a phone
    c[0].metric("Training time", f"{result.train_seconds:.0f} s", f"stopped: {result.stopped}", delta_color="off", delta_arrow="off")
    c[1].metric(
        "Peak memory while training",
        f"{result.peak_rss / 2**20:.0f} MiB",
        f"{result.rss_ratio:.2f}x inference ({result.inference_rss / 2**20:.0f} MiB)",
        delta_color="off",
        delta_arrow="off",
    )
    c[2].metric("Trained parameters", f"{result.trainable_params:,}")
    texts = len(result.calib_loss_after)
    c[3].metric(
        "Calibration loss", f"{mean(result.calib_loss_after):.3f}",
        f"from {mean(result.calib_loss_before):.3f}" + (f", mean of {texts} texts" if texts > 1 else ""),
        delta_color="off", delta_arrow="off", help=CALIBRATION_HELP + " Per text in the tables below.",
    )  # fmt: skip
    st.markdown("**Dense, unrecovered and recovered**", help=MEASURE_HELP)
    for i, (task, frame) in enumerate(comparison(result).items()):
        st.caption(f"{task}")
        st.dataframe(frame, hide_index=True, width="stretch", key=f"recover_comparison_{i}", placeholder="—",
                     column_config={name: NUMBERS for name in ("dense", "unrecovered", "recovered")})  # fmt: skip
    by_task = task_tables(result)
    if by_task:
        st.markdown("**Task accuracy** (lm-eval)", help=GLOSSARY["task accuracy"])
        for i, (task, frame) in enumerate(by_task.items()):
            examples = ((result.after or {}).get("task_accuracy") or {}).get(task, {}).get("n")
            st.caption(f"{task}" + (f", {examples} examples" if examples else ""))
            st.dataframe(frame, hide_index=True, width="stretch", key=f"recover_tasks_table_{i}", placeholder="—")
    if result.judge_curve:
        st.markdown(f"**Judged snapshots**: step {result.best_step} kept, the best by {result.judge}")
        st.plotly_chart(figures.curve_figure(result.judge_curve, "score", "score", height=240), key=f"recover_judge_chart_{result.run_id}",
                        width="stretch", theme=None)  # fmt: skip
    if result.curve:
        st.markdown("**Training loss** (each step's multi-task batch)")
        st.plotly_chart(figures.curve_figure(result.curve, "loss", "loss (nats/token)"), key=f"recover_loss_chart_{result.run_id}",
                        width="stretch", theme=None)  # fmt: skip
    generations = (result.after or {}).get("generations") or []
    if generations:
        before_text = {g["prompt"]: g["model"] for g in (result.before or {}).get("generations", [])}
        st.markdown("**Greedy generations**")
        for g in generations:  # one narrow table per prompt: the continuations wrap whole on a phone
            st.table(
                pd.DataFrame([
                    {"model": "prompt", "continuation": g["prompt"]},
                    {"model": "dense", "continuation": g.get("dense", "")},
                    {"model": "unrecovered", "continuation": before_text.get(g["prompt"], "")},
                    {"model": "recovered", "continuation": g["model"]},
                ]),
                hide_index=True,
            )  # fmt: skip
    st.caption(f"Recovered checkpoint: `{result.checkpoint}`" + (f" · unmerged adapter: `{result.adapter}`" if result.adapter else ""))
