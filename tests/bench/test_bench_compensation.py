"""bench/bench_compensation.py without a model: a variant's window count travels as the compensation's own
``samples``, so a variant without one gets what the engine gives a user (the table's windows, or the model
family's floor: 64 on Gemma 3) and one with it gets exactly that many."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from bench_compensation import parse_variant

from gap_engine.core.errors import CompensationError


def test_a_variant_names_its_mode_target_damping_and_fit_windows():
    settings = parse_variant("refit/dense@0.001#32")
    assert (settings.mode, settings.target, settings.damping, settings.samples) == ("refit", "dense", 0.001, 32)
    plain = parse_variant("bias+refit")
    assert (plain.mode, plain.target, plain.samples) == ("bias+refit", "pruned", None)
    assert parse_variant("bias+refit#16").samples == 16  # asked for: the family's floor does not apply


def test_a_variant_that_fits_nothing_refuses_a_window_count():
    with pytest.raises(CompensationError):
        parse_variant("none#32")
