"""Recovery after pruning: a short fine-tune on calibration text, evaluated before and after.

Structured pruning is followed, in practice, by a short recovery fine-tune (LLM-Pruner: LoRA
brings LLaMA-7B at 20% from perplexity 19.1 back to 17.4), and GAP's own claim is about
models *after* tuning. Three methods, one entry point, :func:`recover`:

* ``lora``: LoRA adapters through ``peft`` on every attention and MLP projection at its pruned
  width, AdamW, merged into the weights at the end (``recover_lora``);
* ``mazo``: masked zeroth-order training (MaZO, EMNLP 2025): forward passes only, memory at
  inference level, and only the weights that matter for the tasks are perturbed (``recover_zo``);
* ``mezo``: the same two-point SPSA step on every projection weight (MeZO, Malladi et al. 2023),
  the comparison MaZO improves on.

Each text source is one *task*; every step draws ``batch_size`` windows from every task and
minimises the mean over tasks of each task's objective (``recover.distill``: the next-token NLL,
the KL to the dense model, or both; the teacher is resolved in ``recovery_dense``). Training reads only each
source's calibration part (``data.calibration_windows``); the held-out part, which never
overlaps it, is kept for the evaluation before and after (perplexity, KL to the dense model,
top-1 agreement, generations; ``evaluate.evaluate``). The recovered model is written as an
ordinary pruned checkpoint (``checkpoint.save_pruned``'s format, so ``load_model`` reloads it) with
``recovery.json`` and ``losses.csv`` beside the weights, LoRA's unmerged adapter in ``adapter/``;
the run goes into the run history. Progress can be saved, cancelled and resumed
(``recover_io``); peak resident memory of training and of plain inference is measured the
same way in the same process (``memory``).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import shutil
import time
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path

import numpy as np
import torch

from gap_engine.core.config import RECOVERY_SCHEDULES, SAVE_DTYPES
from gap_engine.core.errors import DataError
from gap_engine.core.memory import PeakRSS, release_free_memory
from gap_engine.core.progress import NO_HOOKS, Hooks
from gap_engine.evaluate.tasks import PreparedTasks
from gap_engine.model.loaded import LoadedModel, weights_fingerprint
from gap_engine.pipeline.recovery_dense import evaluate_heldout, resolve_objective
from gap_engine.pipeline.recovery_loop import Reporter, probe, train
from gap_engine.recover.cost import STAGES
from gap_engine.recover.distill import check_temperature
from gap_engine.recover.files import (
    RecoveryError,
    RunState,
    check_output_dir,
    check_resumable,
    checkpoint_plan,
    discard,
    load_state,
    partial_dir,
    record_in_history,
    round_to_storage,
    save_state,
    storage_dtype,
    write_checkpoint,
)
from gap_engine.recover.methods import RECOVERY_METHODS, RECOVERY_OBJECTIVES
from gap_engine.recover.train import PROJECTIONS, TaskData, multitask_loss, projection_modules

log = logging.getLogger(__name__)

METHODS = RECOVERY_METHODS.names
SCHEDULES = RECOVERY_SCHEDULES
DEFAULT_LR = {"lora": 3e-3, "mazo": 3e-4, "mezo": 1e-4}  # for SmolLM2-135M; see bench/results/recovery.md
MAX_STEPS = 1_000_000
MAX_RANK = 1024


@dataclass(frozen=True)
class RecoverySettings:
    method: str = "lora"  # lora | mazo | mezo
    objective: str | None = None  # kd | lm | kd+lm; None: kd when the dense base model is reachable, else lm
    temperature: float = 1.0  # distillation temperature τ, in (0, 100]
    kd_weight: float = 0.5  # kd+lm: weight w of kd in w · kd + (1 - w) · lm
    teacher: str | None = None  # the dense model to distil from; None: the checkpoint's base model
    tasks: tuple[str, ...] = ("wiki-sample",)  # text sources, one task each; trained on their calibration part
    split: str = "calibration"  # the only part training may read; "heldout" is refused
    steps: int = 100  # training steps (fewer when time_budget_s runs out first)
    lr: float | None = None  # peak learning rate; None: LoRA DEFAULT_LR, ZO the probe's choice around DEFAULT_LR
    schedule: str = "cosine"  # constant | linear | cosine decay to 0 after the warm-up
    warmup_steps: int = 0  # linear warm-up from 0
    batch_size: int = 2  # windows per task per step
    seq_len: int = 128  # tokens per window
    pool_windows: int = 256  # calibration windows cut per task; every step samples from them
    targets: tuple[str, ...] = PROJECTIONS  # which projections train (all methods)
    rank: int = 8  # LoRA rank r
    alpha: float = 16.0  # LoRA alpha (the update is scaled by alpha / r)
    dropout: float = 0.05  # LoRA dropout
    grad_clip: float = 1.0  # LoRA: clip the adapters' gradient norm (0: off)
    eps: float = 1e-3  # ZO: perturbation scale ε
    mask_fraction: float = 0.05  # MaZO: share of each row's weights that train
    magnitude_weight: float = 0.5  # MaZO: β, weight of |W| against the activation importance
    importance_windows: int = 8  # MaZO: calibration windows per task for the importance
    calib_eval_windows: int = 4  # per task: fixed calibration windows whose loss is reported before/after
    seed: int = 0  # seeds windows, adapters, dropout and ZO directions
    save_every: int = 25  # steps between saved snapshots (and divergence-guard checks)
    guard: bool = True  # at each snapshot, roll back and cut the rate when the calibration objective rose (recover.guard)
    time_budget_s: float | None = None  # stop training after this much wall time (over all segments)
    device: str | None = None  # move the model here first (e.g. "cuda"); None: leave it where it is
    bf16: bool = False  # bf16 autocast for the training forward passes where the device supports it
    eval_samples: int = 8  # held-out windows per task for the before/after evaluation
    eval_seq_len: int = 256  # tokens per held-out window
    eval_generations: int = 2  # greedy generations in each evaluation
    evaluate_before: bool = True  # also evaluate the model before training
    compare_dense: bool = True  # load the dense model for KL, agreement and generations side by side
    record_history: bool = True  # add the run to the run history
    save_dtype: str | None = None  # storage dtype of the recovered checkpoint; None: the input's (bf16 if unknown)

    def validate(self) -> RecoverySettings:
        """Check every field; returns a copy with the tasks normalised.

        Raises:
            RecoveryError, DataError: a value out of range, or the held-out split requested.
        """
        if self.method not in METHODS:
            raise RecoveryError(f"unknown recovery method '{self.method}'; choose one of {', '.join(METHODS)}")
        if self.objective is not None and self.objective not in RECOVERY_OBJECTIVES:
            raise RecoveryError(f"unknown objective '{self.objective}'; choose one of {', '.join(RECOVERY_OBJECTIVES)}")
        bad_temperature = check_temperature(self.temperature)
        if bad_temperature:
            raise RecoveryError(bad_temperature)
        _check_range("kd_weight", self.kd_weight, 0.0, 1.0)
        if self.teacher is not None and not str(self.teacher).strip():
            raise RecoveryError("an empty teacher model name was given")
        if self.save_dtype is not None and self.save_dtype not in SAVE_DTYPES:
            raise RecoveryError(f"unknown save dtype '{self.save_dtype}'; choose one of {', '.join(SAVE_DTYPES)}")
        if self.split != "calibration":
            raise DataError(_HELDOUT_REFUSAL.format(what=f"split '{self.split}'"))
        tasks = tuple(parse_task(t) for t in self.tasks)
        if not tasks:
            raise DataError("recovery needs at least one text source")
        if len(set(tasks)) != len(tasks):
            raise DataError(f"a text source is listed twice: {', '.join(tasks)}")
        _check_int("steps", self.steps, 1, MAX_STEPS)
        lr = self.learning_rate()
        if not (math.isfinite(lr) and 0.0 < lr <= 1.0):
            raise RecoveryError(f"learning rate {lr:g} is outside (0, 1]")
        if self.schedule not in SCHEDULES:
            raise RecoveryError(f"unknown schedule '{self.schedule}'; choose one of {', '.join(SCHEDULES)}")
        _check_int("warmup_steps", self.warmup_steps, 0, self.steps - 1)
        _check_int("batch_size", self.batch_size, 1, 256)
        _check_int("seq_len", self.seq_len, 2, 1 << 16)
        _check_int("pool_windows", self.pool_windows, self.batch_size, 1 << 20)
        unknown = [t for t in self.targets if t not in PROJECTIONS]
        if unknown or not self.targets:
            raise RecoveryError(f"targets must be a non-empty subset of {', '.join(PROJECTIONS)}, got {', '.join(self.targets) or 'none'}")
        _check_int("rank", self.rank, 1, MAX_RANK)
        _check_range("alpha", self.alpha, 0.0, 1e6, low_open=True)
        _check_range("dropout", self.dropout, 0.0, 1.0, high_open=True)
        _check_range("grad_clip", self.grad_clip, 0.0, 1e6)
        _check_range("eps", self.eps, 0.0, 1.0, low_open=True)
        _check_range("mask_fraction", self.mask_fraction, 0.0, 1.0, low_open=True)
        _check_range("magnitude_weight", self.magnitude_weight, 0.0, 1e6)
        _check_int("importance_windows", self.importance_windows, 1, 1 << 16)
        _check_int("calib_eval_windows", self.calib_eval_windows, 1, 1 << 16)
        _check_int("seed", self.seed, 0, 2**63 - 1)
        _check_int("save_every", self.save_every, 1, MAX_STEPS)
        if self.time_budget_s is not None:
            _check_range("time_budget_s", self.time_budget_s, 0.0, 1e9, low_open=True)
        _check_int("eval_samples", self.eval_samples, 1, 1 << 16)
        _check_int("eval_seq_len", self.eval_seq_len, 2, 1 << 16)
        _check_int("eval_generations", self.eval_generations, 0, 16)
        return replace(self, tasks=tasks, targets=tuple(self.targets))

    def learning_rate(self) -> float:
        return float(self.lr) if self.lr is not None else DEFAULT_LR.get(self.method, math.nan)

    @property
    def probes_lr(self) -> bool:
        """True when a zeroth-order run chooses its learning rate by a short probe (no lr given)."""
        return self.lr is None and self.method in ("mazo", "mezo")

    def trajectory(self) -> dict:
        """The settings that decide what training computes; a resumed run must share them."""
        free = {"save_every", "guard", "time_budget_s", "device", "eval_samples", "eval_seq_len", "eval_generations",
                "evaluate_before", "compare_dense", "record_history", "split", "save_dtype"}
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in free}
        out["lr"] = "auto" if self.probes_lr else self.learning_rate()
        out["tasks"], out["targets"] = list(self.tasks), list(self.targets)
        return out


_HELDOUT_REFUSAL = (
    "recovery trains on the calibration split only ({what} requested); the held-out split is kept for evaluation"
)


def parse_task(spec: str) -> str:
    """A task's text source; a trailing ``@calibration`` is allowed, ``@heldout`` refused (DataError)."""
    spec = str(spec).strip()
    base, at, part = spec.rpartition("@")
    if at and part.lower() in ("heldout", "held-out", "held_out", "test", "eval"):
        raise DataError(_HELDOUT_REFUSAL.format(what=f"'{spec}'"))
    if at and part.lower() == "calibration":
        spec = base
    if not spec:
        raise DataError("an empty text source was given")
    return spec


def app_output_dir(checkpoint: str | Path, settings: RecoverySettings) -> Path:
    """Where the explorer writes the recovery of ``checkpoint``: a folder under the checkpoints
    root named by the checkpoint and a digest of the training settings, so the same request
    after a cancel or a crash finds its ``.partial`` run again and resumes it."""
    from gap_engine.evaluate.history import checkpoints_root

    settings = settings.validate()
    digest = hashlib.sha256(json.dumps(settings.trajectory(), sort_keys=True).encode()).hexdigest()[:10]
    return checkpoints_root() / f"{Path(checkpoint).name}-{settings.method}-{digest}"


def _check_int(name: str, value, low: int, high: int) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or not low <= value <= high:
        raise RecoveryError(f"{name} must be an integer in [{low}, {high}], got {value!r}")


def _check_range(name: str, value, low: float, high: float, low_open: bool = False, high_open: bool = False) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    ok = ok and (value > low if low_open else value >= low) and (value < high if high_open else value <= high)
    if not ok:
        interval = f"{'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"
        raise RecoveryError(f"{name} must be a number in {interval}, got {value!r}")


@dataclass
class RecoveryResult:
    method: str
    tasks: list[str]
    checkpoint: str  # the recovered pruned checkpoint (load_model reloads it)
    adapter: str | None  # LoRA: the unmerged adapter (peft format)
    dense_input: bool  # True: the model was not a gap checkpoint (recovering a dense model)
    steps_requested: int
    steps_done: int
    resumed_from: int  # the step a resumed run continued from (0: a fresh run)
    stopped: str  # "steps", "time budget" or "diverged" (the guard's last rate cut did not help: the last good snapshot)
    lr: float  # peak learning rate
    lr_probe: list[dict]  # ZO without a given rate: the probed candidates (lr, loss before, loss after)
    train_seconds: float  # training wall time, over every segment
    train_cpu_seconds: float  # process CPU time (every thread) while training: wall time is what a shared machine leaves
    total_seconds: float  # this call's wall time
    trainable_params: int  # LoRA adapters, or the weights ZO perturbs (masked for MaZO)
    peak_rss: int  # bytes: peak resident memory while training
    inference_rss: int  # bytes: peak resident memory of one forward pass at the training batch
    rss_method: str  # how memory was measured
    calib_loss_before: list[float]  # per task: NLL on fixed calibration windows
    calib_loss_after: list[float]
    before: dict | None  # EvalReport.to_dict() before training
    after: dict  # EvalReport.to_dict() after training
    objective: str = "lm"  # what training minimised: kd | lm | kd+lm
    objective_note: str = ""  # why this objective and which teacher (said in the output)
    teacher: str | None = None  # the model distilled from
    save_dtype: str = ""  # storage dtype of the recovered checkpoint
    curve: list[dict] = field(default_factory=list)  # per step: step, seconds, loss, lr
    rollbacks: list[dict] = field(default_factory=list)  # the divergence guard's: step, back_to, loss, lowest, lr_scale, action
    lr_scale: float = 1.0  # the rate's factor after the guard's cuts (1: none)
    run_id: int | None = None  # row in the run history
    settings: dict = field(default_factory=dict)

    @property
    def rss_ratio(self) -> float:
        return self.peak_rss / self.inference_rss if self.inference_rss else math.nan

    @property
    def guard_summary(self) -> str | None:
        """One line on what the divergence guard did, or None when it never stepped in."""
        if not self.rollbacks:
            return None
        steps = ", ".join(str(row["step"]) for row in self.rollbacks)
        if self.stopped == "diverged":
            return (f"the calibration objective rose at every rate tried ({len(self.rollbacks)} checks, at step {steps}): "
                    f"stopped at the last good snapshot, step {self.steps_done}")
        return (f"the calibration objective rose {len(self.rollbacks)} time(s) (at step {steps}): rolled back to the last "
                f"good snapshot each time and trained on at {self.lr_scale:.3g} x the rate")

    @property
    def tokens_seen(self) -> int:
        """Training tokens read (windows of every task, every step done; repeats counted)."""
        per_step = len(self.tasks) * int(self.settings.get("batch_size", 0)) * int(self.settings.get("seq_len", 0))
        return self.steps_done * per_step

    def to_dict(self) -> dict:
        out = asdict(self)
        out["rss_ratio"] = self.rss_ratio
        out["tokens_seen"] = self.tokens_seen
        out["rss_delta"] = self.peak_rss - self.inference_rss
        return out


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
) -> RecoveryResult:
    """Fine-tune ``lm`` on its tasks' calibration text, evaluate it, and save it as a checkpoint.

    Args:
        lm: a pruned checkpoint (``load_model`` of a ``gap prune`` folder) or a dense model
            (allowed: the result says ``dense_input``). Its weights are changed in place.
        settings: the method and its settings (validated here).
        hooks: the name of each stage as it starts (``recover.cost.STAGES``: preparing, training,
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
    reporter, cancel, enter = Reporter(hooks, settings.steps), hooks.cancel, hooks.enter
    enter(STAGES[0])
    device = _place(lm, settings)
    dense_input, start_fingerprint = lm.pruned_from is None, lm.fingerprint
    if dense_input:
        log.warning("%s is not a pruned gap checkpoint: recovering a dense model", lm.name)
    plan, kept = checkpoint_plan(lm)
    _check_rank(lm, settings)
    reporter.stage("reading the calibration text")
    data = TaskData(lm, settings)  # every input error surfaces before anything is written
    objective, teacher, note = resolve_objective(lm, settings, teacher, reporter.stage, device)
    settings = replace(settings, objective=objective.name)
    reporter.stage(note)
    trajectory = settings.trajectory() | {"teacher_fingerprint": teacher.fingerprint if teacher else None}
    dense = teacher if teacher is not None and settings.teacher is None else None  # the dense reference, when it is one
    work = partial_dir(out_dir)
    state, saved = _start_state(lm, settings, trajectory, data, work, resume, reporter, cancel, dense, lm_eval_tasks)
    resumed_from = state.step
    _measure_inference(lm, data, settings, state, device)

    run = RECOVERY_METHODS.function(settings.method)(lm, settings, objective)
    settings = _ready(run, data, settings, state, saved, work, reporter, cancel)
    enter(STAGES[1])
    stopped = train(run, data, settings, state, work, reporter, cancel, device)
    enter(STAGES[2])
    adapter_dir, save_dtype = _finish_weights(lm, run, settings, work, reporter)
    reporter.stage("calibration loss after training")
    calib_after = _calib_losses(lm, data, settings)
    after = evaluate_heldout(lm, settings, "after", reporter.stage, cancel, start_fingerprint, dense, lm_eval_tasks)
    result = _result(settings, state, run, out_dir, adapter_dir, dense_input, resumed_from, stopped, calib_after, after)
    result.objective_note, result.teacher, result.save_dtype = note, teacher.name if teacher else None, save_dtype
    reporter.stage(f"writing {out_dir}")
    result.total_seconds = time.perf_counter() - started
    write_checkpoint(lm, plan, kept, out_dir, result, adapter_dir)
    if settings.record_history:
        result.run_id = record_in_history(lm, plan, result, history_path)
    discard(work)
    reporter.step(state.step, 0.0, "done")
    return result


def _place(lm: LoadedModel, settings: RecoverySettings) -> torch.device:
    """Move the model to ``settings.device`` (when given); RecoveryError where bf16 is asked of a GPU without it."""
    if settings.device:
        lm.model.to(settings.device)
    device = next(lm.model.parameters()).device
    if settings.bf16 and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise RecoveryError(f"bf16 is not supported on {torch.cuda.get_device_name(device)}")
    return device


def _start_state(lm: LoadedModel, settings: RecoverySettings, trajectory: dict, data: TaskData, work: Path, resume: bool,
                 reporter: Reporter, cancel, dense: LoadedModel | None, lm_eval_tasks: PreparedTasks | None = None):
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
        state.before = evaluate_heldout(lm, settings, "before", reporter.stage, cancel, lm.fingerprint, dense, lm_eval_tasks)
    return state, None


def _ready(run, data: TaskData, settings: RecoverySettings, state: RunState, saved, work: Path, reporter: Reporter, cancel):
    """Prepare a fresh run (MaZO's mask, the first snapshot, the ZO rate probe) or restore a saved
    one; returns the settings with the learning rate the run trains at."""
    if saved is None:
        run.prepare(data, Hooks(message=reporter.stage, cancel=cancel))
        save_state(work, state, run.tensors(), run.optimizer_state)
        if settings.probes_lr:
            probe(run, data, settings, state, work, reporter, cancel)
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


def _result(settings, state: RunState, run, out_dir: Path, adapter_dir, dense_input: bool, resumed_from: int, stopped: str,
            calib_after: list[float], after: dict) -> RecoveryResult:
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
    return [
        float(multitask_loss(lm.model, windows.to(device), 1, settings.bf16)[0])
        for windows in data.fixed(settings.calib_eval_windows)
    ]
