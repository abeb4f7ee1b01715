"""Unit ladders: every unit-exact rate a slot can take, for the baselines that plan off the grid.

A slot's ladder lists the distinct shapes its units can be rounded to (GQA-valid head
counts, MLP widths in multiples of ``channel_multiple``), by increasing removal; a slot's
ladder step is its index into that list. The off-grid baselines pick a step per slot and
`fit_to_budget` moves slots one step at a time until the plan removes at least the budget and
less than one further step beyond it. When the prune adds bias compensation a step's removal
is net of the biases it adds (``ComponentGeometry.bias_params_at``), as the DP's costs are.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from gap_engine.core.errors import BudgetError
from gap_engine.model.units import AttentionShape, ComponentGeometry, attention_params
from gap_engine.plan.problem import PARTS, RATE_TOL, Constraints, reach_error


@dataclass(frozen=True)
class Ladder:
    """The distinct unit-rounded shapes a slot may take, by increasing removal."""

    rates: np.ndarray  # (K,) a rate that rounds to each shape
    removed: np.ndarray  # (K,) int64 parameters removed (net of added biases when ``biases``), strictly increasing
    dense: int  # the slot's dense parameters
    biases: bool = False  # removals are net of the biases bias compensation adds


def slot_removed(geom: ComponentGeometry, kind: str, rate: float, multiple: int, biases: bool) -> int:
    """Parameters a slot removes at ``rate``, less the biases its cut adds when ``biases``."""
    removed = 0
    for part in PARTS[kind]:
        removed += geom.removed_at(part, rate, multiple) - (geom.bias_params_at(part, rate, multiple) if biases else 0)
    return removed


def _attention_fractions(geom: ComponentGeometry) -> list[float]:
    g = geom.geometry
    full = attention_params(g, geom.hidden, AttentionShape(g.n_kv_heads, g.group_size), geom.qkv_bias, geom.o_bias)
    return [
        1.0 - attention_params(g, geom.hidden, AttentionShape(kv, q), geom.qkv_bias, geom.o_bias) / full
        for kv in range(1, g.n_kv_heads + 1)
        for q in range(1, g.group_size + 1)
    ]


def _mlp_fractions(geom: ComponentGeometry, multiple: int) -> list[float]:
    width = geom.geometry.intermediate_size
    step = max(1, min(multiple, width))
    return [0.0] + [1.0 - kept / width for kept in range(step, width, step)]


def build_ladders(
    geoms: Sequence[ComponentGeometry],
    slots: Sequence[tuple[int, str]],
    locked: dict[int, float],
    constraints: Constraints,
    multiple: int,
    biases: bool = False,
) -> list[Ladder]:
    """Every slot's ladder (``biases``: removals net of the biases bias compensation adds)."""
    out = []
    for s, (layer, kind) in enumerate(slots):
        geom = geoms[layer]
        parts = PARTS[kind]
        dense = sum(geom.params_at(part, 0.0, multiple) for part in parts)
        candidates: list[float]
        if s in locked:
            candidates = [locked[s]]
        else:
            fractions = {0.0}
            if "attn" in parts:
                fractions.update(_attention_fractions(geom))
            if "mlp" in parts:
                fractions.update(_mlp_fractions(geom, multiple))
            candidates = [r for r in fractions if constraints.min_rate - RATE_TOL <= r <= constraints.max_rate + RATE_TOL]
        by_removed: dict[int, float] = {}
        for rate in sorted(candidates):
            by_removed.setdefault(slot_removed(geom, kind, rate, multiple, biases), rate)
        if not by_removed:
            raise BudgetError(f"layer {layer} {kind} has no unit-exact rate within [{constraints.min_rate:g}, {constraints.max_rate:g}]")
        removals = np.array(sorted(by_removed), dtype=np.int64)
        out.append(Ladder(np.array([by_removed[int(r)] for r in removals]), removals, dense, biases))
    return out


def nearest_ladder_steps(ladders: list[Ladder], wanted_removed: np.ndarray) -> np.ndarray:
    """Each slot's step whose removal is closest to what it wanted to remove."""
    return np.array([int(np.argmin(np.abs(ladder.removed - w))) for ladder, w in zip(ladders, wanted_removed)], dtype=np.intp)


def fit_to_budget(ladders: list[Ladder], ladder_steps: np.ndarray, target: float, wanted_removed: np.ndarray | None = None) -> np.ndarray:
    """Move slots one ladder step at a time until the plan removes at least ``target`` and less
    than one further step beyond it, whole unit by whole unit.

    Up: finest steps first (ties: the slot furthest below what it wanted), each slot once
    per pass. Down: the largest step that keeps the budget met (ties: furthest above what
    it wanted), each slot once per pass, until no step fits. The final surplus is smaller
    than every slot's next step down, e.g. one group of ``channel_multiple`` MLP channels.
    """
    steps = ladder_steps.copy()
    wanted = np.zeros(len(ladders)) if wanted_removed is None else np.asarray(wanted_removed, dtype=np.float64)
    removed = sum(int(ladder.removed[k]) for ladder, k in zip(ladders, steps))

    def now(s: int) -> int:
        return int(ladders[s].removed[steps[s]])

    while removed < target:
        ups = [
            (int(ladders[s].removed[steps[s] + 1]) - now(s), -(wanted[s] - now(s)), s)
            for s in range(len(ladders))
            if steps[s] + 1 < len(ladders[s].removed)
        ]
        if not ups:
            raise BudgetError(f"cannot remove {target:,.0f} parameters within these constraints")
        for freed, _, s in sorted(ups):
            steps[s] += 1
            removed += freed
            if removed >= target:
                break
    lowered_any = True
    while lowered_any:
        lowered_any, moved = False, set()
        while True:
            downs = [
                (now(s) - int(ladders[s].removed[steps[s] - 1]), now(s) - wanted[s], s)
                for s in range(len(ladders))
                if steps[s] > 0 and s not in moved
            ]
            fitting = [d for d in downs if removed - d[0] >= target]
            if not fitting:
                break
            restored, _, s = max(fitting)
            steps[s] -= 1
            removed -= restored
            moved.add(s)
            lowered_any = True
    return steps


def ladder_removed(ladders: list[Ladder], ladder_steps: np.ndarray) -> int:
    return int(sum(int(ladder.removed[k]) for ladder, k in zip(ladders, ladder_steps)))


def ladder_rates(ladders: list[Ladder], ladder_steps: np.ndarray) -> list[float]:
    return [float(ladder.rates[k]) for ladder, k in zip(ladders, ladder_steps)]


def ladder_reach(allocator: str, budget: float, ladders: list[Ladder], dense: int) -> None:
    low = sum(int(ladder.removed[0]) for ladder in ladders)
    high = sum(int(ladder.removed[-1]) for ladder in ladders)
    if budget * dense > high:
        raise reach_error(allocator, budget, low, high, dense)


def ladder_steps_at_rates(
    geoms: Sequence[ComponentGeometry], slots: Sequence[tuple[int, str]], ladders: list[Ladder], rates: Sequence[float], multiple: int
) -> np.ndarray:
    """Each slot's ladder step that units rounding gives at the given rates (clamped to the ladder)."""
    wanted = np.array(
        [slot_removed(geoms[layer], kind, float(r), multiple, ladder.biases) for (layer, kind), r, ladder in zip(slots, rates, ladders)],
        dtype=np.float64,
    )
    return nearest_ladder_steps(ladders, wanted)


def smallest_meeting(meets: Callable[[float], bool], low: float, high: float, steps: int = 60) -> float:
    """Bisection: the smallest x in (low, high] with meets(x), given meets(high) and not meets(low)."""
    for _ in range(steps):
        mid = 0.5 * (low + high)
        if meets(mid):
            high = mid
        else:
            low = mid
    return high
