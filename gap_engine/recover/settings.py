"""What a recovery run is asked to do (``RecoverySettings``), what it reports (``RecoveryResult``,
with its loss curve and learning-rate probe rows) and the error bad settings raise.

Both are recovery's own data: the training code below ``pipeline`` (``recover.train``,
``recover.files``; ``pipeline.cost_model`` prices them) reads the settings and writes the result, so they live
here rather than in ``pipeline.recovery``, which strings the stage together and re-exports them.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any, TypedDict

import numpy as np

from gap_engine.core.config import BUILTIN_TEXT_NAMES, RECOVERY_DEFAULT_TEXTS, RECOVERY_PROJECTIONS, RECOVERY_SCHEDULES, SAVE_DTYPES
from gap_engine.core.errors import DataError, GapError
from gap_engine.data.sources import refuse_as_calibration
from gap_engine.recover.distill import check_temperature
from gap_engine.recover.methods import RECOVERY_METHODS, RECOVERY_OBJECTIVES
from gap_engine.recover.teacher_text import is_teacher_source, normalise

PROJECTIONS = RECOVERY_PROJECTIONS  # short names of the trainable projections


class RecoveryError(GapError):
    """Bad recovery settings, an unusable output folder, or a saved run that does not fit."""


class CurveRow(TypedDict):
    """One training step of a run's loss curve (``losses.csv``)."""

    step: int
    seconds: float  # training wall time when the step ended
    loss: float
    lr: float


class ProbeRow(TypedDict, total=False):
    """One candidate of the zeroth-order learning-rate probe."""

    lr: float
    loss_before: float  # objective on the fixed calibration windows before the probe steps
    loss_after: float  # after them (inf when it blew up)
    best: bool  # present (True) on the candidate whose loss ended lowest


class JudgeRow(TypedDict):
    """One judgement of the weights during training (``recover.judge``)."""

    step: int  # the snapshot judged (0: the starting weights)
    score: float  # higher is better: task accuracy on the selection slice, or minus the held-out KL
    best: bool  # the best so far when it was measured


class RollbackRow(TypedDict):
    """One intervention of the divergence guard (``recover.guard``)."""

    step: int  # the step whose snapshot was judged
    back_to: int  # the step of the snapshot restored
    loss: float | None  # the calibration objective judged (None: not finite)
    lowest: float  # the lowest kept so far
    lr_scale: float  # the rate's factor before this intervention's cut
    action: str  # guard.ROLL_BACK or guard.STOP


METHODS = RECOVERY_METHODS.names
SCHEDULES = RECOVERY_SCHEDULES
DEFAULT_LR = {"lora": 3e-3, "mazo": 3e-4, "mezo": 1e-4}  # for SmolLM2-135M; see bench/results/recovery.md
MAX_STEPS = 1_000_000
MAX_RANK = 1024
# The held-out texts a run is evaluated on when it trains on teacher-written text alone.
HELDOUT_TEXTS = BUILTIN_TEXT_NAMES


@dataclass(frozen=True)
class RecoverySettings:
    method: str = "lora"  # lora | mazo | mezo
    objective: str | None = None  # kd | lm | kd+lm; None: kd when the dense base model is reachable, else lm
    temperature: float = 1.0  # distillation temperature τ, in (0, 100]
    kd_weight: float = 0.5  # kd+lm: weight w of kd in w · kd + (1 - w) · lm
    teacher: str | None = None  # the dense model to distil from; None: the checkpoint's base model
    # Text sources, one task each, trained on their calibration part ("teacher[:N]": text the teacher writes).
    tasks: tuple[str, ...] = RECOVERY_DEFAULT_TEXTS
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
    cpu_budget_s: float | None = None  # stop training after this much CPU time of the process (over all segments)
    device: str | None = None  # move the model here first (e.g. "cuda"); None: leave it where it is
    bf16: bool = False  # bf16 autocast for the training forward passes where the device supports it
    eval_texts: tuple[str, ...] | None = None  # held-out texts of the evaluation; None: the named training texts (HELDOUT_TEXTS if none)
    eval_tasks: tuple[str, ...] = ()  # lm-eval tasks that judge the snapshots during training (recover.judge)
    eval_every: int = 0  # steps between judgements (a multiple of save_every; 0: none); without eval_tasks, by held-out KL
    eval_task_examples: int = 100  # examples of each judging task: its last ones, the selection slice
    eval_samples: int = 8  # held-out windows per task for the before/after evaluation
    eval_seq_len: int = 256  # tokens per held-out window
    eval_generations: int = 2  # greedy generations in each evaluation
    evaluate_before: bool = True  # also evaluate the model before training
    compare_dense: bool = True  # load the dense model for KL, agreement and generations side by side
    record_history: bool = True  # add the run to the run history
    save_dtype: str | None = None  # storage dtype of the recovered checkpoint; None: the input's (bf16 if unknown)
    force_size: bool = False  # past the teacher-text ceilings (tokens, predicted time) knowingly (--force-size)

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
        if self.teacher is not None and self.objective == "lm" and not any(is_teacher_source(t) for t in self.tasks):
            raise RecoveryError(
                f"the teacher {self.teacher} would go unused: objective lm distils from no model and no teacher text is asked; "
                "use kd or kd+lm, --data teacher, or leave out the teacher"
            )
        if self.save_dtype is not None and self.save_dtype not in SAVE_DTYPES:
            raise RecoveryError(f"unknown save dtype '{self.save_dtype}'; choose one of {', '.join(SAVE_DTYPES)}")
        if self.split != "calibration":
            raise DataError(_HELDOUT_REFUSAL.format(what=f"split '{self.split}'"))
        tasks = tuple(parse_task(t, self.force_size) for t in self.tasks)
        if not tasks:
            raise DataError("recovery needs at least one text source")
        if len(set(tasks)) != len(tasks) or sum(map(is_teacher_source, tasks)) > 1:
            raise DataError(f"a text source is listed twice: {', '.join(tasks)}")
        for task in tasks:
            refuse_as_calibration(task)  # training reads the calibration part, which a held-out-only source lacks
        eval_texts = None if self.eval_texts is None else tuple(parse_task(t) for t in self.eval_texts)
        if eval_texts is not None and (not eval_texts or any(is_teacher_source(t) for t in eval_texts)):
            raise DataError("the held-out evaluation reads named texts (e.g. wiki-sample), not teacher text")
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
        for budget in ("time_budget_s", "cpu_budget_s"):
            if getattr(self, budget) is not None:
                _check_range(budget, getattr(self, budget), 0.0, 1e9, low_open=True)
        _check_judge(self)
        _check_int("eval_samples", self.eval_samples, 1, 1 << 16)
        _check_int("eval_seq_len", self.eval_seq_len, 2, 1 << 16)
        _check_int("eval_generations", self.eval_generations, 0, 16)
        return replace(self, tasks=tasks, targets=tuple(self.targets), eval_texts=eval_texts, eval_tasks=tuple(self.eval_tasks))

    @property
    def teacher_source(self) -> str | None:
        """The training text the teacher writes (``teacher:N``), or None."""
        return next((t for t in self.tasks if is_teacher_source(t)), None)

    @property
    def heldout_texts(self) -> tuple[str, ...]:
        """The texts whose held-out parts evaluate the run."""
        if self.eval_texts:
            return tuple(self.eval_texts)
        named = tuple(t for t in self.tasks if not is_teacher_source(t))
        return named or HELDOUT_TEXTS

    def learning_rate(self) -> float:
        return float(self.lr) if self.lr is not None else DEFAULT_LR.get(self.method, math.nan)

    @property
    def probes_lr(self) -> bool:
        """True when a zeroth-order run chooses its learning rate by a short probe (no lr given)."""
        return self.lr is None and self.method in ("mazo", "mezo")

    def trajectory(self) -> dict[str, Any]:
        """The settings that decide what training computes; a resumed run must share them."""
        free = {
            "save_every",
            "guard",
            "time_budget_s",
            "cpu_budget_s",
            "eval_texts",
            "device",
            "eval_samples",
            "eval_seq_len",
            "eval_generations",
            "evaluate_before",
            "compare_dense",
            "record_history",
            "split",
            "save_dtype",
            "force_size",
        }
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in free}
        out["lr"] = "auto" if self.probes_lr else self.learning_rate()
        out["tasks"], out["targets"], out["eval_tasks"] = list(self.tasks), list(self.targets), list(self.eval_tasks)
        if not self.eval_every:  # runs saved before judging existed match runs without it
            for name in ("eval_tasks", "eval_every", "eval_task_examples"):
                out.pop(name)
        return out


_HELDOUT_REFUSAL = "recovery trains on the calibration split only ({what} requested); the held-out split is kept for evaluation"


def parse_task(spec: str, force_size: bool = False) -> str:
    """A task's text source; a trailing ``@calibration`` is allowed, ``@heldout`` refused (DataError);
    teacher text is written ``teacher:N`` (``recover.teacher_text.normalise``; ``force_size``: past its ceiling)."""
    spec = str(spec).strip()
    if is_teacher_source(spec):
        return normalise(spec, force_size)
    base, at, part = spec.rpartition("@")
    if at and part.lower() in ("heldout", "held-out", "held_out", "test", "eval"):
        raise DataError(_HELDOUT_REFUSAL.format(what=f"'{spec}'"))
    if at and part.lower() == "calibration":
        spec = base
    if not spec:
        raise DataError("an empty text source was given")
    return spec


def _check_judge(settings: RecoverySettings) -> None:
    """The judging settings: a positive multiple of ``save_every`` (judged snapshots are saved
    ones, so a resumed run keeps the best one it had), and tasks only with a period."""
    _check_int("eval_every", settings.eval_every, 0, MAX_STEPS)
    _check_int("eval_task_examples", settings.eval_task_examples, 1, 1 << 16)
    if settings.eval_tasks and not settings.eval_every:
        raise RecoveryError("--eval-tasks judges snapshots during training: give --eval-every K too")
    if any(not str(name).strip() for name in settings.eval_tasks):
        raise RecoveryError("an empty --eval-tasks name was given")
    if settings.eval_every and settings.eval_every % settings.save_every:
        raise RecoveryError(
            f"--eval-every {settings.eval_every} must be a multiple of --save-every {settings.save_every}: "
            "the judged weights are the saved snapshots"
        )


def _check_int(name: str, value: object, low: int, high: int) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or not low <= value <= high:
        raise RecoveryError(f"{name} must be an integer in [{low}, {high}], got {value!r}")


def _check_range(name: str, value: object, low: float, high: float, low_open: bool = False, high_open: bool = False) -> None:
    ok = (
        isinstance(value, (int, float))
        and not isinstance(value, bool)
        and math.isfinite(value)
        and (value > low if low_open else value >= low)
        and (value < high if high_open else value <= high)
    )
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
    stopped: str  # "steps", "time budget", "CPU budget" or "diverged" (the guard's last rate cut did not help: the last good snapshot)
    lr: float  # peak learning rate
    lr_probe: list[ProbeRow]  # ZO without a given rate: the probed candidates (lr, loss before, loss after)
    train_seconds: float  # training wall time, over every segment
    train_cpu_seconds: float  # process CPU time (every thread) while training: wall time is what a shared machine leaves
    total_seconds: float  # this call's wall time
    trainable_params: int  # LoRA adapters, or the weights ZO perturbs (masked for MaZO)
    peak_rss: int  # bytes: peak resident memory while training
    inference_rss: int  # bytes: peak resident memory of one forward pass at the training batch
    rss_method: str  # how memory was measured
    calib_loss_before: list[float]  # per task: NLL on fixed calibration windows
    calib_loss_after: list[float]
    before: dict[str, Any] | None  # EvalReport.to_dict() before training
    after: dict[str, Any]  # EvalReport.to_dict() after training
    objective: str = "lm"  # what training minimised: kd | lm | kd+lm
    objective_note: str = ""  # why this objective and which teacher (said in the output)
    teacher: str | None = None  # the model distilled from
    save_dtype: str = ""  # storage dtype of the recovered checkpoint
    curve: list[CurveRow] = field(default_factory=list)  # per step: step, seconds, loss, lr
    rollbacks: list[RollbackRow] = field(default_factory=list)  # the divergence guard's: step, back_to, loss, lowest, lr_scale, action
    lr_scale: float = 1.0  # the rate's factor after the guard's cuts (1: none)
    judge: str = ""  # what judged the snapshots (recover.judge; "": none)
    judge_curve: list[JudgeRow] = field(default_factory=list)  # per judged snapshot: step, score, best
    best_step: int | None = None  # the judged snapshot the checkpoint holds (None: not judged, the last step)
    judge_seconds: float = 0.0  # wall time spent judging, apart from train_seconds
    run_id: int | None = None  # row in the run history
    settings: dict[str, Any] = field(default_factory=dict)  # RecoverySettings.trajectory() and the teacher's fingerprint

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
            return (
                f"the calibration objective rose at every rate tried ({len(self.rollbacks)} checks, at step {steps}): "
                f"stopped at the last good snapshot, step {self.steps_done}"
            )
        return (
            f"the calibration objective rose {len(self.rollbacks)} time(s) (at step {steps}): rolled back to the last "
            f"good snapshot each time and trained on at {self.lr_scale:.3g} x the rate"
        )

    @property
    def tokens_seen(self) -> int:
        """Training tokens read (windows of every task, every step done; repeats counted)."""
        per_step = len(self.tasks) * int(self.settings.get("batch_size", 0)) * int(self.settings.get("seq_len", 0))
        return self.steps_done * per_step

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["rss_ratio"] = self.rss_ratio
        out["tokens_seen"] = self.tokens_seen
        out["rss_delta"] = self.peak_rss - self.inference_rss
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RecoveryResult:
        """The result ``to_dict()`` gave (``recovery.json``), its derived keys dropped; the
        values are taken as they are (``recover.files.read_result`` checks them first)."""
        names = {f.name for f in fields(cls)}
        return cls(**{key: value for key, value in data.items() if key in names})
