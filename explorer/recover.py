"""Recover: a short fine-tune of a pruned checkpoint (LoRA, MaZO or MeZO), beside the unrecovered run.

The checkpoint is one saved by Prune & evaluate (any run of the history with a checkpoint).
Training reads the calibration part of each chosen text (one task each) and the model is
evaluated on their held-out parts before and after. The work is a background job with
stages, an ETA and Cancel; the same request after a cancel resumes from the last saved step.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import streamlit as st

from explorer import common
from gap_engine.core.config import APP_EVAL_WINDOWS
from gap_engine.core.errors import GapError, one_line
from gap_engine.data.windows import BUILTIN_SOURCES
from gap_engine.evaluate import history
from gap_engine.evaluate.tasks import task_table_rows
from gap_engine.model.checkpoint import is_pruned_checkpoint
from gap_engine.pipeline.recovery import DEFAULT_LR, RecoveryResult, RecoverySettings, app_output_dir
from gap_engine.recover.cost import estimate_for_checkpoint
from gap_engine.recover.files import discard, partial_dir, saved_step
from gap_engine.recover.methods import RECOVERY_METHODS, RECOVERY_OBJECTIVES
from gap_engine.views.jobs import manager, recover_task

OBJECTIVE_HELP = {
    "default": "kd when the dense model the checkpoint was pruned from is on this machine, else lm",
    **{name: RECOVERY_OBJECTIVES.describe(name) for name in RECOVERY_OBJECTIVES},
}
DEFAULTS = {
    "recover_run": None,
    "recover_method": "lora",
    "recover_objective": "default",
    "recover_temperature": 1.0,
    "recover_sources": ["wiki-sample", "news-sample"],
    "recover_steps": 20,
    "recover_lr": 0.0,
    "recover_minutes": 0.0,
    "recover_batch_size": 2,
    "recover_seq_len": 128,
    "recover_rank": 8,
    "recover_mask_fraction": 0.05,
    # The held-out windows of Prune & evaluate: the dense and unrecovered numbers here are the ones shown there.
    "recover_eval_samples": APP_EVAL_WINDOWS.n_samples,
    "recover_eval_seq_len": APP_EVAL_WINDOWS.seq_len,
    "recover_generations": 1,
} | common.task_defaults("recover_")
common.init_page("recover_", DEFAULTS)
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


def settings_from_state() -> RecoverySettings:
    """The page's RecoverySettings, validated (RecoveryError/DataError on a bad value)."""
    steps = int(ss["recover_steps"])
    objective = ss["recover_objective"]
    return RecoverySettings(
        method=ss["recover_method"],
        objective=None if objective == "default" else objective,
        temperature=float(ss["recover_temperature"]),
        tasks=tuple(ss["recover_sources"]),
        steps=steps,
        lr=float(ss["recover_lr"]) or None,
        batch_size=int(ss["recover_batch_size"]),
        seq_len=int(ss["recover_seq_len"]),
        rank=int(ss["recover_rank"]),
        mask_fraction=float(ss["recover_mask_fraction"]),
        save_every=max(1, min(25, steps // 4)),
        time_budget_s=float(ss["recover_minutes"]) * 60 or None,
        eval_samples=int(ss["recover_eval_samples"]),
        eval_seq_len=int(ss["recover_eval_seq_len"]),
        eval_generations=int(ss["recover_generations"]),
    ).validate()


def start_recovery(checkpoint: str) -> None:
    common.clear_message("recover")
    try:
        settings = settings_from_state()
        out_dir = app_output_dir(checkpoint, settings)
    except GapError as exc:
        common.set_message("recover", "error", one_line(exc))
        return
    tasks_ok, task_settings = common.checked_task_settings("recover_", "recover")  # the engine's check, as for gap eval --tasks
    if not tasks_ok:
        return
    task = recover_task(checkpoint, settings, out_dir, task_settings)
    job = manager().submit("recover", task, key=str(out_dir), label=f"{settings.method} on {Path(checkpoint).name}")
    common.remember_job("recover", job)


def start_over(out_dir: Path) -> None:
    discard(partial_dir(out_dir))
    common.set_message("recover", "info", "The saved partial run was discarded; Recover starts from step 0.")


# ---- what to recover -----------------------------------------------------------------------------
candidates = checkpoint_runs()
if not candidates:
    st.info("No saved checkpoint yet: run **Prune & evaluate** with *Save checkpoint* on, then come back.")
    st.page_link(common.EVALUATE_PAGE, label="Go to Prune & evaluate", icon=":material/science:")
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
    st.radio("Objective", ("default", *RECOVERY_OBJECTIVES.names), key="recover_objective", horizontal=True,
             format_func=lambda o: o, help=" · ".join(f"{k}: {v}" for k, v in OBJECTIVE_HELP.items()))
    st.caption(OBJECTIVE_HELP[ss["recover_objective"]])
    st.multiselect("Training text (calibration part; one task each)", list(BUILTIN_SOURCES), key="recover_sources")
    c1, c2 = st.columns(2)
    c1.number_input("Steps", min_value=1, max_value=100_000, step=10, key="recover_steps")
    c2.number_input("Stop after (minutes, 0: no limit)", min_value=0.0, max_value=600.0, step=1.0, key="recover_minutes")
with right:
    st.subheader("Settings")
    c1, c2 = st.columns(2)
    default_lr = f"{DEFAULT_LR[method]:g}" if method == "lora" else f"probed around {DEFAULT_LR[method]:g}"
    c1.number_input(
        f"Learning rate (0: {default_lr})", min_value=0.0, max_value=1.0, step=1e-4, format="%.5f", key="recover_lr"
    )
    c2.number_input("Windows per task per step", min_value=1, max_value=64, step=1, key="recover_batch_size")
    c1, c2 = st.columns(2)
    c1.number_input("Tokens per training window", min_value=8, max_value=2048, step=8, key="recover_seq_len")
    if method == "lora":
        c2.number_input("LoRA rank", min_value=1, max_value=256, step=1, key="recover_rank")
    elif method == "mazo":
        c2.number_input("Share of each row that trains", min_value=0.001, max_value=1.0, step=0.01, format="%.3f", key="recover_mask_fraction")
    if ss["recover_objective"] in ("default", "kd", "kd+lm"):
        c1.number_input("Distillation temperature", min_value=0.05, max_value=100.0, step=0.5, key="recover_temperature")
    c1, c2, c3 = st.columns(3)
    c1.number_input("Held-out samples", min_value=1, max_value=256, step=1, key="recover_eval_samples")
    c2.number_input("Tokens per sample", min_value=8, max_value=2048, step=8, key="recover_eval_seq_len")
    c3.number_input("Generations", min_value=0, max_value=3, step=1, key="recover_generations")
    common.task_picker("recover_")

# ---- start, resume, cancel -----------------------------------------------------------------------
try:
    out_dir = app_output_dir(chosen.checkpoint, settings_from_state())
except GapError as exc:
    out_dir = None
    st.warning(one_line(exc))
else:
    estimate = estimate_for_checkpoint(chosen.checkpoint, settings_from_state(), task_examples=common.task_examples("recover_"))
    if estimate is not None:
        scoring = f", {common.duration_text(estimate.tasks_s)} of it scoring tasks" if estimate.tasks_s else ""
        st.caption(
            f"Expected time: about {common.duration_text(estimate.total_s)} "
            f"({estimate.step_s:.2g} s per step, {common.duration_text(estimate.prepare_s)} before training, "
            f"{common.duration_text(estimate.finish_s)} after{scoring}; {estimate.basis})"
        )
running = common.session_job("recover")
reached = saved_step(out_dir) if out_dir is not None else None
if reached is not None and not (running and running.active):
    st.info(f"A run with these settings stopped at step {reached} of {ss['recover_steps']}: Recover resumes it from there.")
    st.button("Start over", key="recover_start_over", on_click=start_over, args=(out_dir,), icon=":material/restart_alt:")
label = "Resume recovery" if reached is not None else "Recover"
common.job_controls(
    "recover", label, "recover_go", start_recovery, ":material/healing:", "Recovery", "recover", args=(chosen.checkpoint,), type="primary"
)


# ---- the latest recovery beside the unrecovered model ----------------------------------------------
def comparison(result: RecoveryResult) -> pd.DataFrame:
    """One row per measure and held-out text, one column each for dense, the unrecovered
    checkpoint and the recovered model: four columns, so a 390 px phone shows them whole."""
    before, after = result.before or {}, result.after
    dense = (after.get("dense") or {}).get("perplexity", {})
    rows = []
    for task in after["perplexity"]:
        for measure, key, dense_value in (
            ("perplexity", "perplexity", dense.get(task)),
            ("held-out KL to dense", "kl_to_dense", 0.0),
            ("top-1 agreement with dense", "top1_agreement", 1.0),
        ):
            rows.append({
                "measure": f"{measure} ({task})",
                "dense": dense_value,
                "unrecovered": before.get(key, {}).get(task),
                "recovered": after.get(key, {}).get(task),
            })  # fmt: skip
    return pd.DataFrame(rows)


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
    losses = ", ".join(f"{b:.3f} → {a:.3f}" for b, a in zip(result.calib_loss_before, result.calib_loss_after))
    c[3].metric("Calibration loss per task", losses)
    st.dataframe(comparison(result), hide_index=True, width="stretch", key="recover_comparison")
    recovered_tasks = (result.after or {}).get("task_accuracy") or {}
    if recovered_tasks:
        st.markdown("**Task accuracy** (lm-eval)", help=common.GLOSSARY["task accuracy"])
        rows = task_table_rows([
            ("dense", (result.after or {}).get("dense_task_accuracy") or {}),
            ("unrecovered", (result.before or {}).get("task_accuracy") or {}),
            ("recovered", recovered_tasks),
        ])  # fmt: skip
        st.dataframe(pd.DataFrame(rows), hide_index=True, width="stretch", key="recover_tasks_table")
    if result.curve:
        st.markdown("**Training loss** (each step's multi-task batch)")
        curve = pd.DataFrame(result.curve)
        st.line_chart(curve, x="step", y="loss", height=260)
    generations = (result.after or {}).get("generations") or []
    if generations:
        before_text = {g["prompt"]: g["model"] for g in (result.before or {}).get("generations", [])}
        st.markdown("**Greedy generations**")
        st.table(
            pd.DataFrame(
                [
                    {"prompt": g["prompt"], "dense": g.get("dense", ""), "unrecovered": before_text.get(g["prompt"], ""), "recovered": g["model"]}
                    for g in generations
                ]
            ),
            hide_index=True,
        )
    st.caption(f"Recovered checkpoint: `{result.checkpoint}`" + (f" · unmerged adapter: `{result.adapter}`" if result.adapter else ""))
