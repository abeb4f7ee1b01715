"""Non-finite numbers from a model: refused when it loads, and named when a measurement is not a number.

One NaN weight makes every loss, perplexity and KL measured on the model NaN, and a printed
"perplexity nan" with exit status 0 reads as a result. So a model whose weights hold a
non-finite value, or whose config asks for a normalisation epsilon that is not a small
positive number (``rms_norm_eps: -1`` takes the square root of a negative variance), is
refused as it loads; and any measurement that still comes out non-finite (a float16 overflow,
a model built by hand) is an error naming the likeliest cause, never a number to report.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from gap_engine.core.errors import GapError, ModelLoadError

# Config fields holding a normalisation epsilon, as the supported families name them.
NORM_EPS_FIELDS = ("rms_norm_eps", "layer_norm_eps", "layer_norm_epsilon", "norm_eps")


class NonFiniteMeasurement(GapError):
    """A measurement deep in a pass was not finite; the stage that ran the pass names the cause."""


def config_problem(config: Any) -> str | None:
    """What is wrong with a config's normalisation epsilon, or None."""
    for name in NORM_EPS_FIELDS:
        value = getattr(config, name, None)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not (math.isfinite(value) and 0.0 < value < 1.0):
            return f"its config's {name} is {str(value)[:40]}, not a small positive number"
    return None


def weights_problem(model: nn.Module) -> str | None:
    """Where a model's weights hold non-finite values ("3 non-finite values, first in NAME"), or None.

    One float32 sum per materialised parameter (meta tensors, not loaded yet, are skipped): a NaN
    or infinity anywhere makes the sum non-finite, and only then are the values counted.
    """
    first, count = None, 0
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.device.type == "meta" or not param.is_floating_point():
                continue
            if bool(torch.isfinite(param.sum(dtype=torch.float32))):
                continue
            bad = int((~torch.isfinite(param)).sum())
            if bad:
                first, count = first or name, count + bad
    if not count:
        return None
    return f"its weights hold {count:,} non-finite value{'s' if count > 1 else ''}, first in {first}"


def check_model_finite(model: nn.Module, name: str) -> None:
    """ModelLoadError (one line) when ``model`` cannot give a finite measurement: a non-finite
    weight, or a normalisation epsilon that is not a small positive number."""
    problem = config_problem(getattr(model, "config", None)) or weights_problem(model)
    if problem:
        raise ModelLoadError(f"model {name}: {problem}; no measurement on it would be a number")


def non_finite_cause(model: nn.Module) -> str:
    """The likeliest reason a measurement of ``model`` was not finite, for the error that says so."""
    problem = config_problem(getattr(model, "config", None)) or weights_problem(model)
    if problem:
        return problem
    dtype = next((p.dtype for p in model.parameters()), torch.float32)
    return f"its weights are finite, so the computation overflowed in {str(dtype).removeprefix('torch.')} (try --dtype float32)"


def check_finite(value: float, what: str, model: nn.Module, error: type[GapError]) -> float:
    """``value`` when finite; ``error`` naming ``what`` and the cause (`non_finite_cause`) otherwise."""
    if math.isfinite(value):
        return value
    raise error(f"{what} is {value}, not a number: {non_finite_cause(model)}")
