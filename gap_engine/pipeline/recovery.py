"""Recovery after pruning: a short fine-tune on calibration text, evaluated before and after.

Structured pruning is followed, in practice, by a short recovery fine-tune (LLM-Pruner: LoRA
brings LLaMA-7B at 20% from perplexity 19.1 back to 17.4), and GAP's own claim is about
models *after* tuning. Three methods, one entry point, :func:`recover`:

* ``lora``: LoRA adapters through ``peft`` on every attention and MLP projection at its pruned
  width, AdamW, merged into the weights at the end (``recover.lora``);
* ``mazo``: masked zeroth-order training (MaZO, EMNLP 2025): forward passes only, memory at
  inference level, and only the weights that matter for the tasks are perturbed (``recover.zo``);
* ``mezo``: the same two-point SPSA step on every projection weight (MeZO, Malladi et al. 2023),
  the comparison MaZO improves on.

Each text source is one *task*; every step draws ``batch_size`` windows from every task and
minimises the mean over tasks of each task's objective (``recover.distill``: the next-token NLL,
the KL to the dense model, or both; the teacher is resolved in ``recovery_dense``). Training reads only each
source's calibration part (``data.windows.calibration_windows``); the held-out part, which never
overlaps it, is kept for the evaluation before and after (perplexity, KL to the dense model,
top-1 agreement, generations; ``evaluate.metrics.evaluate``). The recovered model is written as an
ordinary pruned checkpoint (``model.checkpoint.save_pruned``'s format, so ``load_model`` reloads it) with
``recovery.json`` and ``losses.csv`` beside the weights, LoRA's unmerged adapter in ``adapter/``;
the run goes into the run history. Progress can be saved, cancelled and resumed
(``recover.files``); peak resident memory of training and of plain inference is measured the
same way in the same process (``core.memory``).
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import time
from dataclasses import asdict, replace
from functools import partial
from pathlib import Path

import torch

from gap_engine.core.device import placement_of
from gap_engine.core.errors import SizeLimitError
from gap_engine.core.limits import FORCE_HINT, LIMITS, forced
from gap_engine.core.memory import PeakRSS, release_free_memory
from gap_engine.core.progress import EVALUATING_AFTER, NO_HOOKS, PREPARING, TRAINING, Hooks
from gap_engine.evaluate.tasks import PreparedTasks
from gap_engine.model.loaded import LoadedModel, weights_fingerprint
from gap_engine.model.storage import round_to_storage
from gap_engine.pipeline import cost_model
from gap_engine.pipeline.recovery_dense import evaluate_heldout, resolve_objective
from gap_engine.recover import teacher_text
from gap_engine.recover.files import (
    RecoveryError,
    RunState,
    check_output_dir,
    check_resumable,
    checkpoint_plan,
    discard,
    load_best,
    load_state,
    partial_dir,
    read_result,
    record_in_history,
    save_state,
    storage_dtype,
    write_checkpoint,
)
from gap_engine.recover.judge import Judge, KLJudge, TaskJudge
from gap_engine.recover.loop import Reporter, probe, train
from gap_engine.recover.methods import RECOVERY_METHODS
from gap_engine.recover.settings import DEFAULT_LR, RecoveryResult, RecoverySettings
from gap_engine.recover.train import TaskData, multitask_loss, projection_modules

log = logging.getLogger(__name__)

# The settings and the result are recovery's own data (recover.settings); callers keep importing
# them from here, beside the stage that takes and returns them.
__all__ = ["DEFAULT_LR", "RecoveryResult", "RecoverySettings", "app_output_dir", "finished_recovery", "recover"]


def app_output_dir(checkpoint: str | Path, settings: RecoverySettings) -> Path:
    """Where the explorer writes the recovery of ``checkpoint``: a folder under the checkpoints
    root named by the checkpoint and a digest of the training settings, so the same request
    after a cancel or a crash finds its ``.partial`` run again and resumes it."""
    from gap_engine.evaluate.history import checkpoints_root

    settings = settings.validate()
    digest = hashlib.sha256(json.dumps(settings.trajectory(), sort_keys=True).encode()).hexdigest()[:10]
    return checkpoints_root() / f"{Path(checkpoint).name}-{settings.method}-{digest}"


def finished_recovery(run_id: int, history_path: Path | None = None) -> RecoveryResult:
    """The result of the history's recovery run ``run_id``, as its recovered checkpoint's
    ``recovery.json`` keeps it (the history row holds only part of it: no curve, generations,
    guard rows or dense task scores), with its history id.

    Raises:
        RecoveryError, HistoryError: no such run, a run that is not a recovery, or a checkpoint
            folder that is gone or holds no readable result.
    """
    from gap_engine.evaluate import history

    record = history.get_run(run_id, history_path)
    if "recovery" not in record.params or not record.checkpoint:
        raise RecoveryError(f"run {run_id} of the history is not a recovery with a checkpoint")
    result = read_result(record.checkpoint)
    result.run_id = record.id
    return result


# ---- the entry point -----------------------------------------------------------------------
def recover(
    lm: LoadedModel,
    settings: RecoverySettings,
    hooks: Hooks = NO_HOOKS,
    out_dir: str | Path = "recovered",
    resume: bool = True,
    history_path: Path | None = None,
    teacher: LoadedModel | None = None,
    lm_eval_tasks: PreparedTasks | None = None,
    judge_tasks: PreparedTasks | None = None,
) -> RecoveryResult:
    """Fine-tune ``lm`` on its tasks' calibration text, evaluate it, and save it as a checkpoint.

    Args:
        lm: a pruned checkpoint (``load_model`` of a ``gap prune`` folder) or a dense model
            (allowed: the result says ``dense_input``). Its weights are changed in place.
        settings: the method and its settings (validated here).
        hooks: the name of each stage as it starts (``core.progress.RECOVERY_STAGES``: preparing, training,
            evaluating after), a message for every phase and step, then progress (steps done,
            total steps, ETA seconds or None: None at a phase); cancel polled before every step
            and during the importance and evaluation passes, and on cancel the step reached is saved.
        out_dir: the recovered checkpoint's folder, written atomically at the end; the run works
            in ``<out_dir>.partial/`` until then.
        resume: continue the run saved in ``<out_dir>.partial/`` (its settings and starting
            weights must match); False discards it and starts over.
        history_path: the run history database; None: the default under the cache root.
        teacher: the dense model to distil from, already loaded (None: ``settings.teacher``, else
            the checkpoint's base model, loaded here on the student's device and dtype).
        lm_eval_tasks: prepared lm-eval tasks: their accuracy before and after training and the dense
            model's join the evaluations (``task_accuracy``, ``dense_task_accuracy``) and the history.
        judge_tasks: the prepared ``settings.eval_tasks``, which judge the snapshots every
            ``settings.eval_every`` steps; the best is saved (``recover.judge``).
    Returns:
        RecoveryResult (``to_dict()`` is JSON-ready).
    Raises:
        RecoveryError, DataError: bad settings, text too short, an unwritable ``out_dir``, a saved
            run that does not fit. CancelledError: cancelled (resume to continue).
    """
    started = time.perf_counter()
    settings = settings.validate()
    out_dir = Path(out_dir).expanduser()
    check_output_dir(out_dir, lm.source)
    reporter, enter = Reporter(hooks, settings.steps), hooks.enter
    enter(PREPARING)
    device = _place(lm, settings)
    dense_input, start_fingerprint, (plan, kept) = lm.pruned_from is None, lm.fingerprint, _checked_plan(lm, settings)
    reporter.stage("reading the calibration text")
    data = TaskData(lm, settings)  # every input error surfaces before anything is written
    objective, teacher, note = resolve_objective(lm, settings, teacher, reporter.stage, device)
    settings = replace(settings, objective=objective.name)
    reporter.stage(note)
    trajectory = _trajectory(settings, teacher, data, reporter)
    dense = teacher if teacher is not None and settings.teacher is None else None  # the dense reference, when it is one
    work = partial_dir(out_dir)
    state, saved = _start_state(lm, settings, trajectory, data, work, resume, reporter, dense, lm_eval_tasks)
    resumed_from = state.step
    _measure_inference(lm, data, settings, state, device)
    run = RECOVERY_METHODS.function(settings.method)(lm, settings, objective)
    settings = _ready(run, data, settings, state, saved, work, reporter)
    judge = _judge(lm, run, settings, dense, judge_tasks)
    enter(TRAINING)
    stopped = train(run, data, settings, state, work, reporter, device, judge)
    _keep_best(run, state, work, reporter)
    enter(EVALUATING_AFTER)
    adapter_dir, save_dtype = _finish_weights(lm, run, settings, work, reporter)
    calib_after, after = _evaluate_after(lm, data, settings, reporter, start_fingerprint, dense, lm_eval_tasks)
    result = _result(settings, state, run, out_dir, adapter_dir, dense_input, resumed_from, stopped, calib_after, after)
    result.objective_note, result.teacher, result.save_dtype = note, teacher.name if teacher else None, save_dtype
    result.judge = judge.description if judge is not None else ""
    reporter.stage(f"writing {out_dir}")
    result.total_seconds = time.perf_counter() - started
    write_checkpoint(lm, plan, kept, out_dir, result, adapter_dir)
    result.run_id = record_in_history(lm, plan, result, history_path) if settings.record_history else None
    discard(work)
    reporter.step(state.step, 0.0, "done")
    return result


def _checked_plan(lm: LoadedModel, settings: RecoverySettings):
    """(plan, kept indices) the recovered checkpoint is written with; RecoveryError for a LoRA rank too wide."""
    if lm.pruned_from is None:
        log.warning("%s is not a pruned gap checkpoint: recovering a dense model", lm.name)
    plan_and_kept = checkpoint_plan(lm)
    _check_rank(lm, settings)
    return plan_and_kept


def _evaluate_after(lm, data: TaskData, settings: RecoverySettings, reporter: Reporter, start_fingerprint: str, dense, lm_eval_tasks):
    """(calibration losses, held-out evaluation) of the trained weights."""
    reporter.stage("calibration loss after training")
    calib_after = _calib_losses(lm, data, settings)
    calibration = partial(_calib_losses, data=data, settings=settings)
    after = evaluate_heldout(lm, settings, "after", reporter.phases(), start_fingerprint, dense, lm_eval_tasks, calibration=calibration)
    return calib_after, after


def _trajectory(settings: RecoverySettings, teacher: LoadedModel | None, data: TaskData, reporter: Reporter) -> dict:
    """The settings a resumed run must share, with the teacher's fingerprint and the key of the
    text it wrote (written first, when the run reads teacher text)."""
    trajectory = settings.trajectory() | {"teacher_fingerprint": teacher.fingerprint if teacher else None}
    if settings.teacher_source is not None and teacher is not None:
        trajectory["teacher_text"] = _write_teacher_text(teacher, settings, data, reporter)
    return trajectory


def _keep_best(run, state: RunState, work: Path, reporter: Reporter) -> None:
    """Put back the snapshot the judge rated best, when it is not the last one trained."""
    if state.best_step is not None and state.best_step != state.step:
        reporter.stage(f"keeping the snapshot of step {state.best_step}, the best judged")
        run.restore(load_best(work, state.best_step), None)


def _write_teacher_text(teacher: LoadedModel, settings: RecoverySettings, data: TaskData, reporter: Reporter) -> str:
    """The teacher-written text of ``settings.teacher_source`` into ``data`` (from the cache, or
    written now with progress and ETA); returns its cache key (a resumed run must read the same)."""
    spec = teacher_text.TeacherTextSpec(
        tokens=teacher_text.parse_tokens(str(settings.teacher_source), settings.force_size), seq_len=settings.seq_len, seed=settings.seed
    )
    check_teacher_text_time(teacher, spec, str(settings.teacher_source), settings.force_size)
    reporter.stage(f"teacher text: {spec.sequences:,} sequences of {spec.seq_len} tokens written by {teacher.name}")
    data.set_teacher_text(teacher_text.teacher_text(teacher, spec, reporter.hooks))
    dtype = str(next(teacher.model.parameters()).dtype).removeprefix("torch.")
    return teacher_text.cache_key(spec, teacher.fingerprint, dtype)


def check_teacher_text_time(teacher: LoadedModel, spec: teacher_text.TeacherTextSpec, source: str, force: bool = False) -> None:
    """SizeLimitError before a token is written when the cost model (``cost_model.teacher_text_prediction``) says
    writing ``spec`` with ``teacher`` here takes longer than ``LIMITS.teacher_seconds``, unless ``force`` (or
    GAP_FORCE_SIZE=1) lifts it; text the cache holds costs nothing and passes."""
    dtype = str(placement_of(teacher).dtype).removeprefix("torch.")
    if force or forced() or teacher_text.is_cached(spec, teacher.fingerprint, dtype):
        return
    priced = cost_model.teacher_text_prediction(teacher, spec.tokens, spec.seq_len)
    if priced is None or priced[0] <= LIMITS.teacher_seconds:
        return
    seconds, basis = priced
    fits = int(spec.sequences * LIMITS.teacher_seconds / seconds) * spec.seq_len  # the price is about linear in the sequences
    fewer = f"ask for at most {teacher_text.SOURCE}:{fits}" if fits else "use a smaller teacher or a faster device"
    raise SizeLimitError(
        f"{source} would take about {_hours(seconds)} for {teacher.name} to write here ({basis}), past the limit of "
        f"{_hours(LIMITS.teacher_seconds)} for teacher text; {fewer}, or {FORCE_HINT}"
    )


def _hours(seconds: float) -> str:
    return f"{seconds / 3600:.1f} h" if seconds >= 3600 else f"{seconds / 60:.0f} min" if seconds >= 60 else f"{seconds:.0f} s"


def _judge(lm: LoadedModel, run, settings: RecoverySettings, dense: LoadedModel | None, judge_tasks: PreparedTasks | None) -> Judge | None:
    """What judges the snapshots (``recover.judge``), or None when ``eval_every`` is 0."""
    if not settings.eval_every:
        return None
    if settings.eval_tasks:
        if judge_tasks is None:
            raise RecoveryError(f"--eval-tasks {', '.join(settings.eval_tasks)} were not prepared for this run")
        return TaskJudge(lm, judge_tasks, settings.eval_task_examples)
    if dense is None:
        raise RecoveryError("--eval-every without --eval-tasks judges by held-out KL to the dense model, which is not loaded here")
    texts = settings.heldout_texts
    return KLJudge(run.model, lm, dense.model, texts, settings.eval_samples, settings.eval_seq_len, settings.seed)


def _place(lm: LoadedModel, settings: RecoverySettings) -> torch.device:
    """Move the model to ``settings.device`` (when given); RecoveryError where bf16 is asked of a GPU without it."""
    if settings.device:
        lm.model.to(settings.device)
    device = next(lm.model.parameters()).device
    if settings.bf16 and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise RecoveryError(f"bf16 is not supported on {torch.cuda.get_device_name(device)}")
    return device


def _start_state(
    lm: LoadedModel,
    settings: RecoverySettings,
    trajectory: dict,
    data: TaskData,
    work: Path,
    resume: bool,
    reporter: Reporter,
    dense: LoadedModel | None,
    lm_eval_tasks: PreparedTasks | None = None,
):
    """(run state, saved snapshot or None): the saved run in ``work`` when resuming, else a fresh
    state with the losses and evaluation before training (an earlier partial run is discarded)."""
    saved = load_state(work) if resume else None
    if saved is not None:
        check_resumable(saved[0], trajectory, lm.fingerprint, work)
        log.info("resuming %s recovery at step %d of %d", settings.method, saved[0].step, settings.steps)
        return saved[0], saved
    if work.exists():
        log.info("discarding the earlier partial run in %s", work)
        discard(work)
    state = RunState(trajectory=trajectory, start_fingerprint=lm.fingerprint)
    reporter.stage("calibration loss before training")
    state.calib_before = _calib_losses(lm, data, settings)
    if settings.evaluate_before:
        state.before = evaluate_heldout(lm, settings, "before", reporter.phases(), lm.fingerprint, dense, lm_eval_tasks)
    return state, None


def _ready(run, data: TaskData, settings: RecoverySettings, state: RunState, saved, work: Path, reporter: Reporter):
    """Prepare a fresh run (MaZO's mask, the first snapshot, the ZO rate probe) or restore a saved
    one; returns the settings with the learning rate the run trains at."""
    if saved is None:
        run.prepare(data, reporter.phases())
        save_state(work, state, run.tensors(), run.optimizer_state)
        if settings.probes_lr:
            probe(run, data, settings, state, work, reporter)
    else:
        run.restore(saved[1], saved[2])
    return replace(settings, lr=state.lr) if state.lr is not None else settings


def _finish_weights(lm: LoadedModel, run, settings: RecoverySettings, work: Path, reporter: Reporter):
    """Merge (LoRA) and round the trained weights to the storage dtype, so the evaluation after
    training sees exactly what the checkpoint will hold; returns (adapter folder or None, dtype)."""
    reporter.stage("merging adapters" if settings.method == "lora" else "finishing")
    adapter_tmp = work / "adapter"
    shutil.rmtree(adapter_tmp, ignore_errors=True)
    lm.model, adapter_dir = run.finish(adapter_tmp)
    save_dtype = settings.save_dtype or storage_dtype(lm)
    round_to_storage(lm.model, save_dtype)
    lm.fingerprint = weights_fingerprint(lm.model)
    return adapter_dir, save_dtype


def _measure_inference(lm: LoadedModel, data: TaskData, settings: RecoverySettings, state: RunState, device) -> None:
    """Peak resident memory of plain inference of the same model at the training batch, into ``state``."""
    release_free_memory(collect_garbage=False)
    with PeakRSS() as meter:
        with torch.no_grad():
            multitask_loss(lm.model, data.batch(0).to(device), len(settings.tasks), settings.bf16)
        state.inference_rss = max(state.inference_rss, meter.peak())
        state.rss_method = meter.method


def _result(
    settings,
    state: RunState,
    run,
    out_dir: Path,
    adapter_dir,
    dense_input: bool,
    resumed_from: int,
    stopped: str,
    calib_after: list[float],
    after: dict,
) -> RecoveryResult:
    """The RecoveryResult of a finished run."""
    return RecoveryResult(
        method=settings.method,
        tasks=list(settings.tasks),
        checkpoint=str(out_dir),
        adapter=str(out_dir / "adapter") if adapter_dir else None,
        dense_input=dense_input,
        steps_requested=settings.steps,
        steps_done=state.step,
        resumed_from=resumed_from,
        stopped=stopped,
        lr=settings.learning_rate(),
        lr_probe=state.lr_probe,
        train_seconds=state.train_seconds,
        train_cpu_seconds=state.train_cpu_seconds,
        total_seconds=0.0,
        trainable_params=run.trainable_params,
        peak_rss=state.peak_rss,
        inference_rss=state.inference_rss,
        rss_method=state.rss_method,
        calib_loss_before=state.calib_before,
        calib_loss_after=calib_after,
        before=state.before,
        after=after,
        objective=settings.objective or "lm",
        curve=state.curve,
        rollbacks=state.rollbacks,
        lr_scale=state.lr_scale,
        judge_curve=state.judge_curve,
        best_step=state.best_step,
        judge_seconds=state.judge_seconds,
        settings=asdict(settings),
    )


def _check_rank(lm: LoadedModel, settings: RecoverySettings) -> None:
    if settings.method != "lora":
        return
    narrowest = min(min(lin.in_features, lin.out_features) for _, lin in projection_modules(lm, settings.targets))
    if settings.rank > narrowest:
        raise RecoveryError(f"LoRA rank {settings.rank} exceeds the narrowest target projection ({narrowest} wide)")


@torch.no_grad()
def _calib_losses(lm: LoadedModel, data: TaskData, settings: RecoverySettings) -> list[float]:
    device = next(lm.model.parameters()).device
    return [float(multitask_loss(lm.model, windows.to(device), 1, settings.bf16)[0]) for windows in data.fixed(settings.calib_eval_windows)]
