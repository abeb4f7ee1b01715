"""Thin orchestration over the stages, shared by the CLI and the app.

Each function here strings stage entry points together (load -> calibrate -> score ->
surgery -> export / evaluate) and holds no maths of its own.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable

from .data import calibration_windows
from .errors import ModelLoadError
from .importance import ImportanceScores, compute_importance
from .models import LoadedModel, load_model
from .plan import RatePlan
from .surgery import PruneResult, apply_plan

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CalibrationSettings:
    data: str = "wiki-sample"  # calibration source (built-in name, file, or HF spec)
    n_samples: int = 16  # windows
    seq_len: int = 256  # tokens per window
    seed: int = 0  # window sampling seed
    batch_size: int = 4  # windows per forward pass


def importance_for(lm: LoadedModel, criterion: str, calib: CalibrationSettings, progress=None) -> ImportanceScores:
    """Importance scores of the dense model on calibration windows (none needed for magnitude)."""
    windows = None
    if criterion != "magnitude":
        windows = calibration_windows(lm.tokenizer, calib.data, calib.n_samples, calib.seq_len, calib.seed)
    return compute_importance(lm, windows, criterion, calib.batch_size, progress)


def prune_with_plan(
    lm: LoadedModel, plan: RatePlan, calib: CalibrationSettings, progress: Callable[[int, int], None] | None = None
) -> PruneResult:
    """Score the dense model with the plan's criterion, then prune it in place."""
    plan.validate()
    plan.check_model(lm)
    scores = None
    if any(plan.attention_rates) or any(plan.mlp_rates):
        scores = importance_for(lm, plan.criterion, calib, progress)
    return apply_plan(lm, plan, scores)


def dense_reference(lm: LoadedModel) -> LoadedModel | None:
    """The dense model a pruned checkpoint came from, when it can be loaded here."""
    if not lm.pruned_from or not lm.pruned_from.get("model"):
        return None
    try:
        dense = load_model(lm.pruned_from["model"])
    except ModelLoadError as exc:
        log.warning("dense reference %s is not available: %s", lm.pruned_from["model"], exc)
        return None
    if lm.pruned_from.get("fingerprint") and dense.fingerprint != lm.pruned_from["fingerprint"]:
        log.warning("dense reference %s has other weights than the ones pruned; not comparing", dense.name)
        return None
    return dense
