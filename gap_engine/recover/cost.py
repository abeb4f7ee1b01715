"""What a recovery run will cost before it starts: seconds per stage from the checkpoint's shape.

The same device profile as the table builds' cost model (``costmodel.measured_profile``: this
machine's FLOP/s on a one-layer model of the target's shape, measured once and cached) prices
the forward passes a run makes; the checkpoint is read from its ``config.json`` alone (the
per-layer widths of a gap checkpoint included), so nothing is loaded. Work counted, in forward
passes of the student (``F``, over the step's tokens) and of the dense teacher (``D``):

* a step: LoRA ``3F`` (forward and backward; the frozen weights need input gradients only),
  MaZO and MeZO ``2F`` plus drawing ``z`` three times for every perturbed weight (priced by
  timing ``recover.zo.direction`` here: on the CPU its pieces are drawn by every torch thread),
  and ``D`` more with a distilling objective;
* before training: the held-out evaluation (student and dense model over every task's
  held-out windows, plus greedy generations), the calibration loss, MaZO's importance pass, the
  ZO learning-rate probe (``PROBE_FACTORS x PROBE_STEPS`` steps);
* after training: the calibration loss and the held-out evaluation again;
* lm-eval tasks, when asked: lm-eval's import, the checkpoint's and the dense model's scores
  before training, the recovered model's after (the dense scores are cached by then), each
  priced as Prune & evaluate prices them (``evaluate.tasks.scoring_seconds``);
* teacher-written text not yet in the cache: its tokens at the dense model's forward price per
  token times :data:`GENERATION_FACTOR` (decoding one token at a time), an order of magnitude;
* judging snapshots (``recover.judge``): a task slice scored, or the held-out KL windows run
  through both models, at the start, every ``eval_every`` steps and at the end.

Loading the checkpoint and the dense model is priced as Prune & evaluate prices a load; the
checkpoint write is not counted (seconds on this machine). The estimate
is a guide for the ETA shown from the first second; once steps run, their measured time takes over.
"""

from __future__ import annotations

import functools
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gap_engine.evaluate.tasks import TASK_IMPORT_S, scoring_seconds
from gap_engine.recover.train import PROBE_FACTORS, PROBE_STEPS
from gap_engine.tables.costmodel import (
    DeviceProfile,
    ModelShape,
    block_flops_per_token,
    folder_load_seconds,
    head_flops_per_token,
    measured_profile,
    nominal_for,
    scoring_profile,
)

if TYPE_CHECKING:
    from gap_engine.core.device import Placement
    from gap_engine.recover.settings import RecoverySettings

LORA_FORWARDS = 3.0  # a LoRA step in forward passes: forward, backward through the frozen blocks, adapters
ZO_FORWARDS = 2.0  # a ZO step's two perturbed loss evaluations
Z_DRAWS = 3  # z is drawn for the + pass, the - pass and the update
GENERATED_TOKENS = 24  # evaluate.EvalSettings.max_new_tokens
STAGES = ("preparing", "training", "evaluating after")
# Writing teacher text, per token, against a full-window forward pass of the dense model: decoding
# 64 rows a token at a time with the cache cost 10.5 ms a token and the nucleus draw ~2 ms, where a
# full 128-token window cost 8.2 ms a token (smollm2-135m, one thread, this machine under load).
GENERATION_FACTOR = 1.5


@dataclass(frozen=True)
class RecoveryEstimate:
    """Expected seconds of a recovery run, per stage."""

    prepare_s: float  # evaluation before, calibration loss, importance, learning-rate probe
    step_s: float  # one training step
    steps: int
    finish_s: float  # calibration loss and evaluation after
    basis: str  # where the prices come from
    budget_s: float | None = None  # the run's time budget (wall or CPU), which caps training
    tasks_s: float = 0.0  # of prepare_s and finish_s: scoring lm-eval tasks
    text_s: float = 0.0  # of prepare_s: writing teacher text (0 when the cache has it)
    judge_s: float = 0.0  # one judgement of a snapshot (0: not judged); train_s counts every one
    every: int = 0  # steps between judgements

    @property
    def train_s(self) -> float:
        seconds = self.step_s * self.steps
        seconds = seconds if self.budget_s is None else min(seconds, self.budget_s)
        return seconds + self.judgements * self.judge_s

    @property
    def judgements(self) -> int:
        """Snapshots judged: the start, every ``eval_every`` steps of those the budget allows, the end."""
        if not self.judge_s or not self.every:
            return 0
        steps = self.steps if self.budget_s is None or not self.step_s else min(self.steps, int(self.budget_s / self.step_s))
        return 1 + steps // self.every + bool(steps % self.every)

    @property
    def total_s(self) -> float:
        return self.prepare_s + self.train_s + self.finish_s

    def by_stage(self) -> dict[str, float]:
        return dict(zip(STAGES, (self.prepare_s, self.train_s, self.finish_s)))


def layer_shapes(config: dict[str, Any], name: str = "") -> tuple[ModelShape, list[ModelShape]]:
    """(the dense shape, one shape per block at its own widths) from a config.json's content."""
    from types import SimpleNamespace

    dense = ModelShape.from_config(SimpleNamespace(**config), name)
    per_layer = config.get("per_layer_config") or {}
    shapes = []
    for i in range(dense.layers):
        widths = per_layer.get(str(i)) or {}
        shapes.append(
            replace(
                dense,
                heads=int(widths.get("num_attention_heads", dense.heads)),
                kv_heads=int(widths.get("num_key_value_heads", dense.kv_heads)),
                intermediate=int(widths.get("intermediate_size", dense.intermediate)),
            )
        )
    return dense, shapes


@functools.lru_cache(maxsize=4)
def _direction_seconds_per_value(device: str, threads: int) -> float:
    """Seconds per value of a ZO direction drawn here with ``threads`` torch threads, timed
    once per process (on a 1024 x 2048 matrix, as ``recover.zo.direction`` draws it)."""
    import torch

    from gap_engine.recover import zo

    target = zo.ZOTarget("cost probe", torch.nn.Linear(2048, 1024, bias=False, device=device))
    out = torch.empty(1024, 2048, device=device)
    zo.direction(0, target, 0, out=out)
    started = time.perf_counter()
    for step in range(1, 4):
        zo.direction(0, target, step, out=out)
    if out.device.type == "cuda":
        torch.cuda.synchronize(out.device)
    return (time.perf_counter() - started) / (3 * out.numel())


def _torch_threads() -> int:
    import torch

    return torch.get_num_threads()


def _perturbed_weights(shapes: list[ModelShape], settings: RecoverySettings) -> float:
    """Weights a ZO step perturbs: the target projections, masked to MaZO's fraction."""
    fractions: dict[str, Callable[[ModelShape], int]] = {
        "q": lambda s: s.heads * s.head_dim,
        "k": lambda s: s.kv_heads * s.head_dim,
        "v": lambda s: s.kv_heads * s.head_dim,
        "o": lambda s: s.heads * s.head_dim,
        "gate": lambda s: s.intermediate,
        "up": lambda s: s.intermediate,
        "down": lambda s: s.intermediate,
    }
    total: int = sum(s.hidden * fractions[t](s) for s in shapes for t in settings.targets)
    return total * (settings.mask_fraction if settings.method == "mazo" else 1.0)


def _step_seconds(settings: RecoverySettings, shapes: list[ModelShape], forward: float, teacher_pass: float, placement: Placement) -> float:
    """One training step: LoRA's forward and backward, or ZO's two passes and draws of ``z``, plus the teacher's pass."""
    if settings.method == "lora":
        return LORA_FORWARDS * forward + teacher_pass
    draws = Z_DRAWS * _perturbed_weights(shapes, settings) * _direction_seconds_per_value(str(placement.device), _torch_threads())
    return ZO_FORWARDS * forward + draws + teacher_pass


def estimate_recovery(
    config: dict[str, Any],
    settings: RecoverySettings,
    placement: Placement,
    distils: bool,
    measure: bool = True,
    task_examples: int = 0,
    profile: DeviceProfile | None = None,
    text_tokens: int = 0,
) -> RecoveryEstimate | None:
    """Expected seconds of ``settings`` (a validated recover.RecoverySettings) on the model ``config`` describes.

    Args:
        config: the checkpoint's config.json content (``per_layer_config`` read when present).
        placement: a ``device.Placement`` (where the run computes).
        distils: whether the objective runs the dense teacher (kd, kd+lm).
        measure: False never measures: this machine's cached profile, else nominal CPU prices
            (``costmodel.nominal_for``), else None (an accelerator never measured).
            A page view and a job's first ETA use False: measured on a busy machine, one layer's
            millisecond calls read 1.25 GFLOP/s in a walkthrough and priced a 112 s run at 13 min 50 s.
        task_examples: lm-eval examples scored per model (every task's together; 0: no tasks).
        profile: the prices to use (None: this machine's measured profile).
        text_tokens: teacher-written tokens to generate first (0: none, or in the cache).
    """
    dense, shapes = layer_shapes(config, str(config.get("_name_or_path", "")))
    given = profile
    nominal = nominal_for(placement)
    profile = profile or measured_profile(placement, dense, seq_len=settings.seq_len, batch=settings.batch_size, measure=measure) or nominal
    if profile is None:
        return None
    # lm-eval scores in its own batches: priced at that shape when this machine was measured there.
    scoring = (given or scoring_profile(placement, dense, measure) or nominal or profile) if task_examples > 0 else profile

    def per_token(block_shapes: list[ModelShape], seq_len: int, prices: DeviceProfile = profile) -> float:
        blocks = sum(block_flops_per_token(s, seq_len) for s in block_shapes) / prices.block_flops
        return blocks + head_flops_per_token(dense) / prices.head_flops

    n_tasks, n_texts = len(settings.tasks), len(settings.heldout_texts)
    step_tokens = n_tasks * settings.batch_size * settings.seq_len

    student, teacher = per_token(shapes, settings.seq_len), per_token([dense] * dense.layers, settings.seq_len)
    text = text_tokens * teacher * GENERATION_FACTOR
    step = _step_seconds(settings, shapes, student * step_tokens, teacher * step_tokens if distils else 0.0, placement)
    eval_tokens = n_texts * settings.eval_samples * settings.eval_seq_len
    evaluation = eval_tokens * (per_token(shapes, settings.eval_seq_len) + (teacher if settings.compare_dense else 0.0))
    judged = len(settings.eval_tasks) * settings.eval_task_examples  # a judgement: a task slice, else the KL windows through both models
    judge = scoring_seconds(judged, lambda n, t: n * per_token(shapes, t, scoring)) if judged else eval_tokens * (student + teacher)
    generation = settings.eval_generations * GENERATED_TOKENS * (1 + settings.compare_dense) * per_token(shapes, 1)
    calib = n_tasks * settings.calib_eval_windows * settings.seq_len * student
    prepare = calib + (evaluation + generation if settings.evaluate_before else 0.0)
    if settings.method == "mazo":
        prepare += n_tasks * settings.importance_windows * settings.seq_len * student
    if settings.probes_lr:
        prepare += len(PROBE_FACTORS) * (PROBE_STEPS * step + calib)
    finish = calib + evaluation + generation
    tasks_before = tasks_after = 0.0
    if task_examples > 0:
        scored = scoring_seconds(task_examples, lambda tokens, seq_len: tokens * per_token(shapes, seq_len, scoring))
        dense_scored = (
            scoring_seconds(task_examples, lambda tokens, seq_len: tokens * per_token([dense] * dense.layers, seq_len, scoring))
            if settings.compare_dense
            else 0.0
        )
        first = TASK_IMPORT_S + scored + dense_scored  # the dense model is scored once, then read from the cache
        tasks_before, tasks_after = (first, scored) if settings.evaluate_before else (0.0, first)
    budgets = [b for b in (settings.time_budget_s, settings.cpu_budget_s) if b]
    return RecoveryEstimate(
        prepare + tasks_before + text,
        step,
        settings.steps,
        finish + tasks_after,
        f"cost model: {profile.basis}",
        min(budgets) if budgets else None,
        tasks_before + tasks_after,
        text,
        judge if settings.eval_every else 0.0,
        settings.eval_every,
    )


def estimate_for_checkpoint(
    folder: str | Path, settings: RecoverySettings, placement: Placement | None = None, measure: bool = True, task_examples: int = 0
) -> RecoveryEstimate | None:
    """:func:`estimate_recovery` of a checkpoint folder (CPU float32 unless ``placement`` says otherwise);
    None when the folder has no readable config.json. Whether the run distils is guessed from the
    objective: kd unless ``lm`` is asked (the default when the base model is reachable).
    ``task_examples``: lm-eval examples scored per model (0: no tasks)."""
    from gap_engine.core.device import DeviceSpec, resolve

    try:
        config = json.loads((Path(folder).expanduser() / "config.json").read_text())
    except (OSError, ValueError):
        return None
    placement = placement or resolve(DeviceSpec("cpu", "float32"))
    settings = settings.validate()
    text = _uncached_text_tokens(Path(folder).expanduser(), settings, str(placement.dtype).removeprefix("torch."))
    estimate = estimate_recovery(config, settings, placement, settings.objective != "lm", measure, task_examples, text_tokens=text)
    if estimate is None:
        return None
    # The job loads the checkpoint, and the dense model when it distils or compares with it.
    return replace(estimate, prepare_s=estimate.prepare_s + _load_seconds(Path(folder).expanduser(), config, settings))


def _uncached_text_tokens(folder: Path, settings: RecoverySettings, dtype: str) -> int:
    """Teacher-written tokens the run will generate: none when it reads none, or when the cache
    holds the text for the checkpoint's recorded base model (its weights fingerprint)."""
    from gap_engine.recover import teacher_text

    if settings.teacher_source is None:
        return 0
    spec = teacher_text.TeacherTextSpec(
        tokens=teacher_text.parse_tokens(settings.teacher_source), seq_len=settings.seq_len, seed=settings.seed
    )
    try:
        base = json.loads((folder / "gap_pruned.json").read_text()).get("base_fingerprint")
    except (OSError, ValueError, AttributeError):
        base = None
    cached = settings.teacher is None and isinstance(base, str) and teacher_text.is_cached(spec, base, dtype)
    return 0 if cached else spec.sequences * spec.seq_len


def _load_seconds(folder: Path, config: dict[str, Any], settings: RecoverySettings) -> float:
    """Loading the checkpoint and the dense model, at the loading prices Prune & evaluate uses."""
    dense, _ = layer_shapes(config, str(config.get("_name_or_path", "")))
    needed = settings.objective != "lm" or settings.compare_dense or settings.teacher_source is not None
    teacher = folder_load_seconds(None, dense.total_params) if needed else 0.0
    return folder_load_seconds(folder, dense.total_params) + teacher
