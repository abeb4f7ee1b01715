"""The divergence guard of recovery: roll back to the last good snapshot and cut the rate.

A zeroth-order run's learning rate comes from a four-step probe, and four steps do not show
every instability: on the uniform 20% checkpoint of smollm2-135m the probe's best rate for
MaZO-kd lowered the calibration objective after 4 steps and took held-out perplexity from 207 to
2,737 in the next 69 (bench/results/recovery.md); on gemma3-270m every candidate above the
smallest raised the loss. Training can also drift later, when the schedule is still high.

So at every snapshot (``save_every`` steps) the run measures its training objective on the
fixed calibration windows, the same deterministic number the probe compares candidates on. A
snapshot is kept only when that number is within ``TOLERANCE`` of the lowest seen so far; else
the run goes back to the last kept snapshot (weights, optimizer state, step), divides its rate by
``LR_CUT`` and trains on. After ``MAX_ROLLBACKS`` cuts it stops at the last kept snapshot, so a
user is handed the best weights seen rather than a diverged model. The kept snapshots' losses
never exceed ``(1 + TOLERANCE)`` times the lowest, so slow drift is caught as surely as a jump.

This module is the decision only; ``pipeline.recovery`` measures, saves and restores.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# Relative rise of the calibration objective over the lowest kept that still counts as healthy.
# Slow divergence starts small: on the uniform 20% checkpoint MaZO-kd at 3e-4 stood 4% above its
# start after 25 steps and, given 70, took held-out perplexity from 125.9 to 174.7 (2 x 256 tokens
# of wiki-sample); the diverging 9e-4 stood 71% above it at step 25.
TOLERANCE = 0.02
ABSOLUTE_TOLERANCE = 1e-4  # nats: a rise this small is rounding, also where the objective starts at 0
LR_CUT = 3.0  # each rollback divides the rate by this (the probe's candidates are ~3x apart)
MAX_ROLLBACKS = 3  # then stop: the rate is 27x below where it started and still does not train

KEEP, ROLL_BACK, STOP = "keep", "roll back", "stop"


@dataclass(frozen=True)
class Verdict:
    action: str  # KEEP, ROLL_BACK or STOP
    reason: str  # one line for the progress stream and the result


def judge(loss: float, lowest: float, rollbacks_so_far: int) -> Verdict:
    """What to do with a snapshot whose calibration objective is ``loss``.

    Args:
        loss: the training objective on the fixed calibration windows now (may be nan or inf).
        lowest: the lowest such value over the kept snapshots (the start counts as one).
        rollbacks_so_far: how many times this run has rolled back already.
    """
    if math.isfinite(loss) and loss <= lowest * (1.0 + TOLERANCE) + ABSOLUTE_TOLERANCE:
        return Verdict(KEEP, f"calibration objective {loss:.4f} (lowest {min(loss, lowest):.4f})")
    shown = f"{loss:.4f}" if math.isfinite(loss) else str(loss)
    rise = f"calibration objective {shown} rose above {lowest:.4f} by more than {TOLERANCE:.0%}"
    if rollbacks_so_far >= MAX_ROLLBACKS:
        return Verdict(STOP, f"{rise} after {MAX_ROLLBACKS} rate cuts: stopping at the last good snapshot")
    return Verdict(ROLL_BACK, f"{rise}: back to the last good snapshot, learning rate / {LR_CUT:g}")
