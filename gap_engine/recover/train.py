"""The training side of recovery: task batches, the multi-task loss, and one run per method.

``TaskData`` cuts, per task (text source), a pool of windows from the source's calibration
part and samples every step's batch from every pool with a generator seeded by
``(seed, step, task)``. ``multitask_loss`` gives each task's mean next-token NLL from one
forward pass. ``ZORun`` (MaZO with a mask, MeZO without; maths in ``recover.zo``) and
``LoraRun`` (peft; ``recover.lora``) share one shape: ``prepare`` once, ``step``, ``tensors``
and ``optimizer_state`` for snapshots, ``restore`` on resume, ``finish`` at the end.
``pipeline.recovery.recover`` drives them; settings are ``recover.settings.RecoverySettings``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from gap_engine.core.config import RECOVERY_PROJECTIONS, WindowSpec
from gap_engine.core.errors import DataError
from gap_engine.core.progress import Hooks, reporting
from gap_engine.data.bos import Tokenizer
from gap_engine.data.windows import calibration_windows, load_corpus
from gap_engine.model.loaded import LoadedModel
from gap_engine.recover import lora as recover_lora
from gap_engine.recover import zo as recover_zo
from gap_engine.recover.distill import Objective
from gap_engine.recover.settings import ProbeRow, RecoveryError, RecoverySettings

log = logging.getLogger(__name__)

PROJECTIONS = RECOVERY_PROJECTIONS  # short names of the trainable projections


# ---- data ----------------------------------------------------------------------------------
class TaskData:
    """Per task, a pool of calibration windows; each step samples ``batch_size`` from every pool.

    Teacher-written text (``teacher:N``) is one task whose pool is every sequence the teacher
    wrote (``recover.teacher_text``), given by :meth:`set_teacher_text` once it is written (the
    named texts are read first, so their mistakes surface before the teacher loads); a named
    text's pool is ``pool_windows`` windows of its calibration part.
    """

    def __init__(self, lm: LoadedModel, settings: RecoverySettings):
        self.settings = settings
        self.pools: list[torch.Tensor] = []  # per task: (n_pool, T); the teacher's is empty until set
        for spec in settings.tasks:
            named = spec != settings.teacher_source
            self.pools.append(_named_pool(lm, settings, spec) if named else torch.empty(0, 0, dtype=torch.long))

    def set_teacher_text(self, windows: torch.Tensor) -> None:
        """The teacher-written sequences: (n, start + seq_len), the pool of the ``teacher:N`` task."""
        spec = self.settings.teacher_source
        if spec is None:
            raise DataError("this run reads no teacher-written text")
        if windows.shape[0] < self.settings.batch_size:
            raise DataError(f"{spec} is too short for one batch: {windows.shape[0]} sequences, a batch needs {self.settings.batch_size}")
        self.pools[self.settings.tasks.index(spec)] = windows

    def batch(self, step: int) -> torch.Tensor:
        """The windows of one step, task-major: (n_tasks * batch_size, T)."""
        rows = []
        for task, pool in enumerate(self.pools):
            rng = np.random.default_rng([self.settings.seed, step, task])
            rows.append(pool[torch.from_numpy(rng.choice(pool.shape[0], self.settings.batch_size, replace=False))])
        return torch.cat(rows)

    def fixed(self, count: int) -> list[torch.Tensor]:
        """Per task, its first ``count`` pool windows: the calibration loss reported before and after."""
        return [pool[:count] for pool in self.pools]


def _named_pool(lm: LoadedModel, settings: RecoverySettings, spec: str) -> torch.Tensor:
    """(n_pool, T) windows of a named text's calibration part."""
    calibration = load_corpus(spec).part("calibration")  # a held-out-only source is refused here
    if not calibration:
        raise DataError(f"text source '{spec}' has no calibration part to train on (it is too small to split)")
    tokens = _token_count(lm.tokenizer, calibration)
    n_pool = min(settings.pool_windows, tokens // settings.seq_len)
    if n_pool < settings.batch_size:
        raise DataError(
            f"text source '{spec}' is too short for one batch: its calibration part has {tokens} tokens, "
            f"a batch needs {settings.batch_size} x {settings.seq_len} = {settings.batch_size * settings.seq_len}"
        )
    return calibration_windows(lm.tokenizer, WindowSpec(data=spec, n_samples=n_pool, seq_len=settings.seq_len, seed=settings.seed))


def _token_count(tokenizer: Tokenizer, texts: Iterable[str]) -> int:
    encoded = tokenizer(list(texts), add_special_tokens=False, verbose=False)["input_ids"]
    return sum(len(ids) for ids in encoded) + max(0, len(encoded) - 1)


def multitask_loss(model: nn.Module, batch: torch.Tensor, n_tasks: int, bf16: bool = False) -> torch.Tensor:
    """Per-task mean next-token NLL of a task-major batch.

    Args:
        batch: (n_tasks * b, T) token ids, the windows of task i in rows i*b .. (i+1)*b - 1.
        bf16: run the forward pass under bf16 autocast (the loss itself is float32).
    Returns:
        (n_tasks,) losses (with the graph, when grads are on).
    """
    with torch.autocast(device_type=batch.device.type, dtype=torch.bfloat16, enabled=bf16):
        logits = model(input_ids=batch, use_cache=False).logits  # (B, T, V)
    logits = logits[:, :-1].float()
    vocab = logits.shape[-1]
    nll = F.cross_entropy(logits.reshape(-1, vocab), batch[:, 1:].reshape(-1), reduction="none")  # (B*(T-1),)
    per_window = nll.view(batch.shape[0], -1).mean(1)  # (B,)
    return per_window.view(n_tasks, -1).mean(1)  # (n_tasks,)


# ---- the two kinds of training -------------------------------------------------------------
def projection_modules(lm: LoadedModel, short_names: Iterable[str]) -> list[tuple[str, torch.nn.Linear]]:
    """(module path, linear) of the chosen projections of every block, in block order."""
    paths = {id(module): name for name, module in lm.model.named_modules()}
    out: list[tuple[str, nn.Linear]] = []
    for layer in lm.adapter.layers(lm.model):
        q, k, v, o = lm.adapter.attention_projections(layer)
        gate, up, down = lm.adapter.mlp_projections(layer)
        by_short = dict(zip(PROJECTIONS, (q, k, v, o, gate, up, down)))
        out.extend((paths[id(by_short[s])], by_short[s]) for s in PROJECTIONS if s in short_names)
    return out


def module_names(lm: LoadedModel, short_names: Iterable[str]) -> list[str]:
    a = lm.adapter
    full = dict(zip(PROJECTIONS, (a.query_name, a.key_name, a.value_name, a.output_name, a.gate_name, a.up_name, a.down_name)))
    return [full[s] for s in PROJECTIONS if s in short_names]


def check_saved_tensors(tensors: dict[str, torch.Tensor], expected: dict[str, tuple[int, ...] | None]) -> None:
    """RecoveryError unless a snapshot holds exactly the tensors ``expected`` names, each of its
    shape (None: any) and finite: the snapshot of another model, or a tampered one, is refused,
    never half-loaded or broadcast into the weights."""
    unknown, missing = sorted(set(tensors) - set(expected)), sorted(set(expected) - set(tensors))
    if unknown or missing:
        name, why = (unknown[0], "that this model has no place for") if unknown else (missing[0], "missing")
        raise RecoveryError(f"the saved recovery state is not this model's: tensor {name[:120]} {why}; start over without resume")
    for name, shape in expected.items():
        tensor = tensors[name]
        if shape is not None and tuple(tensor.shape) != shape:
            raise RecoveryError(
                f"the saved tensor {name[:120]} has shape {tuple(tensor.shape)}, this model's {shape}; start over without resume"
            )
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            raise RecoveryError(f"the saved tensor {name[:120]} holds non-finite values; start over without resume")


def _fits_mask(columns: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether saved MaZO columns index ``weight``: (rows, k) integers within its width."""
    if columns.is_floating_point() or columns.dim() != 2 or columns.shape[0] != weight.shape[0]:
        return False
    return columns.numel() == 0 or bool(((columns >= 0) & (columns < weight.shape[1])).all())


class ZORun:
    """MaZO (with a mask) or MeZO (without): two forward passes per step (plus the teacher's
    one when distilling), the objective's loss as the scalar the SPSA estimate differences."""

    def __init__(self, lm: LoadedModel, settings: RecoverySettings, objective: Objective | None = None):
        self.lm, self.settings = lm, settings
        self.objective = objective or Objective(bf16=settings.bf16)
        self.targets = [recover_zo.ZOTarget(name, lin) for name, lin in projection_modules(lm, settings.targets)]
        self.optimizer_state: dict[str, Any] | None = None  # ZO keeps no optimizer state
        self.workspace: recover_zo.Workspace | None = None

    @property
    def trainable_params(self) -> int:
        return sum(t.updated_params for t in self.targets)

    def prepare(self, data: TaskData, hooks: Hooks) -> None:
        if self.settings.method != "mazo":
            return
        linears = [t.linear for t in self.targets]
        norms: list[list[torch.Tensor]] = []  # per task: per target
        for spec, pool in zip(self.settings.tasks, data.pools):
            hooks.say(f"weight importance on {spec}")
            with reporting(hooks.replaced(progress=None)):  # the recovery's steps are its progress
                norms.append(
                    recover_zo.input_feature_norms(
                        self.lm.model, linears, pool[: self.settings.importance_windows], self.settings.batch_size
                    )
                )
        for j, target in enumerate(self.targets):
            target.columns = recover_zo.mask_columns(
                target.linear.weight, [n[j] for n in norms], self.settings.mask_fraction, self.settings.magnitude_weight
            )

    def restore(self, tensors: dict[str, torch.Tensor], optimizer_state: dict[str, Any] | None) -> None:
        """Put a snapshot back; RecoveryError when its tensors are not this run's (another
        model's names or shapes, a mask pointing outside its weight, non-finite values)."""
        masked = self.settings.method == "mazo"
        expected: dict[str, tuple[int, ...] | None] = {}
        for target in self.targets:
            weight = target.linear.weight
            columns = tensors.get(f"{target.name}::columns") if masked else None
            if masked:
                expected[f"{target.name}::columns"] = None  # its own shape, checked below
                if columns is not None and not _fits_mask(columns, weight):
                    raise RecoveryError(
                        f"the saved mask of {target.name} does not fit its {tuple(weight.shape)} weight; start over without resume"
                    )
            expected[f"{target.name}::values"] = tuple(columns.shape) if columns is not None else tuple(weight.shape)
        check_saved_tensors(tensors, expected)
        for target in self.targets:
            if masked:
                target.columns = tensors[f"{target.name}::columns"].to(target.linear.weight.device)
            target.load_values(tensors[f"{target.name}::values"])

    def tensors(self) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for target in self.targets:
            out[f"{target.name}::values"] = target.trainable_values()
            if target.columns is not None:
                out[f"{target.name}::columns"] = target.columns
        return out

    @property
    def model(self) -> nn.Module:
        """The model the objective is evaluated on (the perturbed weights live in it)."""
        return self.lm.model

    def step(self, step: int, batch: torch.Tensor, lr: float) -> float:
        n_tasks = len(self.settings.tasks)
        teacher = self.objective.teacher_log_probs(batch)  # once: both perturbed passes compare with it

        def loss_fn() -> float:
            return float(self.objective.per_task(self.lm.model, batch, n_tasks, teacher).mean())

        seed = recover_zo.step_seed(self.settings.seed, step)
        if self.workspace is None:  # after prepare or restore: the mask decides its size
            self.workspace = recover_zo.Workspace(self.targets)
        return recover_zo.zo_step(self.lm.model, self.targets, loss_fn, seed, self.settings.eps, lr, self.workspace).loss

    def finish(self, adapter_dir: Path) -> tuple[nn.Module, Path | None]:
        return self.lm.model, None


class LoraRun:
    """LoRA adapters through peft, AdamW, merged at the end."""

    def __init__(self, lm: LoadedModel, settings: RecoverySettings, objective: Objective | None = None):
        self.lm, self.settings = lm, settings
        self.objective = objective or Objective(bf16=settings.bf16)
        self.peft = recover_lora.attach(
            lm.model, module_names(lm, settings.targets), settings.rank, settings.alpha, settings.dropout, settings.seed
        )
        self.peft.peft_config["default"].base_model_name_or_path = lm.source
        self.optimizer = recover_lora.make_optimizer(self.peft, settings.learning_rate())
        self.trainable_params = sum(p.numel() for p in recover_lora.trainable(self.peft))  # adapters

    def prepare(self, data: TaskData, hooks: Hooks) -> None:
        return None

    def restore(self, tensors: dict[str, torch.Tensor], optimizer_state: dict[str, Any] | None) -> None:
        """Put a snapshot back; RecoveryError when its adapters or optimizer state are not this run's."""
        check_saved_tensors(tensors, {name: tuple(t.shape) for name, t in recover_lora.adapter_tensors(self.peft).items()})
        recover_lora.load_adapter_tensors(self.peft, tensors)
        if optimizer_state is not None:
            try:
                self.optimizer.load_state_dict(optimizer_state)
            except (ValueError, KeyError, TypeError, RuntimeError) as exc:
                raise RecoveryError(
                    f"the saved optimizer state does not fit this run ({type(exc).__name__}); start over without resume"
                ) from None

    def tensors(self) -> dict[str, torch.Tensor]:
        return recover_lora.adapter_tensors(self.peft)

    @property
    def model(self) -> nn.Module:
        """The model the objective is evaluated on: the peft wrapper, adapters active (eval mode
        between steps, so no dropout)."""
        return self.peft

    @property
    def optimizer_state(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def step(self, step: int, batch: torch.Tensor, lr: float) -> float:
        n_tasks = len(self.settings.tasks)
        teacher = self.objective.teacher_log_probs(batch)
        return recover_lora.train_step(
            self.peft,
            self.optimizer,
            lambda: self.objective.per_task(self.peft, batch, n_tasks, teacher).mean(),
            lr,
            recover_zo.step_seed(self.settings.seed, step),
            self.settings.grad_clip,
        )

    def finish(self, adapter_dir: Path) -> tuple[nn.Module, Path | None]:
        """Save the unmerged adapter, then merge it; returns (plain model, adapter folder)."""
        recover_lora.save_adapter(self.peft, adapter_dir)
        return recover_lora.merge(self.peft), adapter_dir


# ---- the objective on fixed windows: the probe's comparison and the divergence guard ----------
class CalibrationObjective:
    """The run's training objective (lm, kd or kd+lm) on the fixed calibration windows, a
    deterministic number for one set of weights: what the learning-rate probe compares candidates
    on and what the divergence guard (``recover.guard``) watches.

    One window at a time, the teacher's log-probabilities recomputed for each: all 8 windows in
    one pass held (windows, T, vocab) logits, log-probabilities and divergences at once, and the
    guard's check set the run's peak memory (MaZO-kd at 1.22x inference over 1,000 steps, against
    the 1.1x MaZO is sold on). The tasks have equal window counts, so the mean over windows is
    the mean of the per-task means the training loss reports.
    """

    def __init__(self, run: ZORun | LoraRun, data: TaskData):
        self.run = run
        device = next(run.lm.model.parameters()).device
        self.windows = torch.cat(data.fixed(run.settings.calib_eval_windows)).to(device)  # task-major

    @torch.no_grad()
    def __call__(self) -> float:
        objective = self.run.objective
        losses = [
            float(objective.per_task(self.run.model, window, 1, objective.teacher_log_probs(window))[0]) for window in self.windows.split(1)
        ]
        value = sum(losses) / len(losses)
        return value if np.isfinite(value) else float("inf")


# ---- the zeroth-order learning rate -------------------------------------------------------------
PROBE_FACTORS = (3.0, 1.0, 0.3, 0.1, 0.01)  # candidates, as multiples of the default rate, largest first (0.01: gemma3-270m diverged at 1x)
PROBE_STEPS = 4  # ZO steps per candidate


def probe_learning_rate(
    run: ZORun, data: TaskData, default_lr: float, restore: Callable[[], None], hooks: Hooks
) -> tuple[float, list[ProbeRow]]:
    """A ZO learning rate that lowers this model's loss without diverging later: every
    candidate runs the first ``PROBE_STEPS`` steps at a constant rate from the starting weights
    (``restore`` puts them back, bit for bit, after each); the one whose objective on the fixed
    calibration windows ends lowest is the best (the larger on a tie), and the run trains one
    candidate below it. A rate that makes the loss rise or blow up loses to a smaller one; the
    step back is what a learning-rate range test does, because the rate that descends fastest
    over a few steps sits at the edge of instability: on the uniform 20% checkpoint of
    smollm2-135m the best of the probe (9e-4, MaZO-kd) was lowest after 4 steps and took held-out
    perplexity from 207 to 2,737 in 69 (bench/results/recovery.md).

    Args:
        hooks: told each candidate as a message; its cancel is polled before every probe step
            (the starting weights are put back first).
    Returns:
        (chosen rate, one row per candidate: lr, loss before, loss after, and ``best`` on the
        lowest one).
    """
    from gap_engine.core.errors import CancelledError

    loss = CalibrationObjective(run, data)
    start = loss()
    device = loss.windows.device
    rows: list[ProbeRow] = []
    for factor in PROBE_FACTORS:
        lr = default_lr * factor
        hooks.say(f"probing the learning rate: {lr:.3g}")
        for step in range(PROBE_STEPS):
            if hooks.is_cancelled():
                restore()
                raise CancelledError("recovery cancelled while probing the learning rate")
            run.step(step, data.batch(step).to(device), lr)
        rows.append({"lr": lr, "loss_before": start, "loss_after": loss()})
        restore()
    best = min(range(len(rows)), key=lambda i: (rows[i]["loss_after"], -rows[i]["lr"]))
    rows[best]["best"] = True
    chosen = rows[min(best + 1, len(rows) - 1)]["lr"]  # candidates run largest first: the next is one notch smaller
    log.info("ZO learning-rate probe: %s; best %g, chose %g", rows, rows[best]["lr"], chosen)
    return chosen, rows
