"""SlimGPT's layer rates (Ling et al., NeurIPS 2024): the Incremental Pruning Ratio.

Layer-wise pruning accumulates error: whatever an early block loses, every later block
inherits. SlimGPT therefore prunes shallow blocks least, the rate rising logarithmically
with depth: block ``i`` of ``L`` loses ``r_0 + (r_last - r_0) * log(i + 1) / log(L)`` of its
attention and of its MLP. The paper leaves ``r_0`` free; we take 0 (block 0 stays dense,
where the error would travel furthest) and solve ``r_last`` by bisection on the exact,
unit-rounded parameter count so the plan removes the budget (rates clipped to the
constraints' bounds). Its plans prune with SlimGPT's own selection, the ``obs`` criterion
(``prune.sequential``): greedy structured OBS with the kept columns updated, block by
block on the pruned model.
"""

from __future__ import annotations

import logging
import math

import numpy as np

from gap_engine.plan.baselines import BaselineInputs
from gap_engine.plan.ladders import ladder_removed, ladder_steps_at_rates, smallest_meeting

log = logging.getLogger(__name__)


def log_increase(num_layers: int) -> np.ndarray:
    """(L,) log(i + 1) / log(L): each block's share of the last block's rate (block 0: 0, last: 1)."""
    if num_layers < 2:
        return np.ones(num_layers)
    return np.log(np.arange(1, num_layers + 1)) / math.log(num_layers)


def slimgpt_ladder_steps(inputs: BaselineInputs) -> tuple[np.ndarray, None]:
    """Rungs at rates clip(r_last * log(i + 1) / log(L)), the smallest r_last (bisection) meeting the target."""
    geoms, slots, ladders, locked = inputs.geoms, inputs.slots, inputs.ladders, inputs.locked
    constraints, target, multiple = inputs.constraints, inputs.target, inputs.multiple
    shares = log_increase(len(geoms))

    def steps_at(last: float) -> np.ndarray:
        rates = [
            locked.get(s, float(np.clip(last * shares[layer], constraints.min_rate, constraints.max_rate)))
            for s, (layer, _) in enumerate(slots)
        ]
        return ladder_steps_at_rates(geoms, slots, ladders, rates, multiple)

    smallest_share = shares[shares > 0].min() if (shares > 0).any() else 1.0
    high = constraints.max_rate / smallest_share  # every block at max_rate
    if ladder_removed(ladders, steps_at(0.0)) >= target:
        return steps_at(0.0), None
    last = (
        high
        if ladder_removed(ladders, steps_at(high)) < target
        else smallest_meeting(lambda r: ladder_removed(ladders, steps_at(r)) >= target, 0.0, high)
    )
    log.info("slimgpt: last block's rate %.4f before unit settling", min(last, constraints.max_rate))
    return steps_at(last), None
