"""The baseline allocators GAP is compared against, held to the same budget and constraints.

Each baseline decides how many parameters every slot loses; which heads and channels go
is the table's criterion, unless the baseline's paper prescribes its own (its entry's
``criterion``: the plan then records that criterion). Each is one function named by an entry of
``allocator_registry.ALLOCATORS``, returning a step on each slot's unit ladder (and, for FLAP,
what each slot wanted before rounding) that ``ladders.fit_to_budget`` then fits to the budget:

- ``uniform``: one rate r for every slot; r by bisection on the exact, unit-rounded
  parameter count, not limited to the grid.
- ``flap``: FLAP's adaptive structure search (An et al., AAAI 2024) on FLAP's own
  fluctuation metric (``importance.flap_standardised``): scores standardised within each
  layer, the globally lowest units go first, a unit weighing the parameters it frees; its
  plans prune with the ``flap`` criterion. FLAP's third part, its bias compensation, is
  chosen when pruning (``--compensate bias``). Heads are rounded to GQA-valid shapes.
- ``owl``: OWL's outlier-weighted layerwise rates (Yin et al., ICML 2024): layers with
  more activation-weighted outliers (|W| * ||X|| above M times the layer mean) are pruned
  less, rates spread over +-lambda around the mean.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from gap_engine.core.errors import InvariantError
from gap_engine.model.loaded import LoadedModel
from gap_engine.model.units import ComponentGeometry
from gap_engine.plan.ladders import Ladder, ladder_removed, ladder_steps_at_rates, nearest_ladder_steps, smallest_meeting
from gap_engine.plan.problem import Constraints
from gap_engine.prune.importance import ImportanceScores, LayerScores, flap_standardised, input_statistics

log = logging.getLogger(__name__)

OWL_OUTLIER_M = 5.0  # OWL's M: an entry is an outlier above M times its layer's mean score
OWL_LAMBDA = 0.08  # OWL's lambda: layer rates spread over [mean - lambda, mean + lambda]


@dataclass
class BaselineInputs:
    """What a baseline allocator reads: the model, the slots and their ladders, the target."""

    lm: LoadedModel  # the dense LoadedModel
    criterion: str  # the table's within-layer criterion
    geoms: list[ComponentGeometry]  # per-layer counting geometry
    slots: tuple[tuple[int, str], ...]  # (layer, kind) per slot
    ladders: list[Ladder]  # unit-exact rates per slot
    locked: dict[int, float]  # slot -> locked rate
    constraints: Constraints  # rate bounds
    target: float  # parameters to remove (at least)
    multiple: int  # MLP channel multiple
    windows: torch.Tensor | None  # (N, T) calibration token ids, for data-driven baselines
    scores: ImportanceScores | None  # importance scores of the criterion, when already computed
    batch_size: int  # windows per forward pass


def uniform_ladder_steps(inputs: BaselineInputs) -> tuple[np.ndarray, None]:
    """The smallest common rate (bisection) whose unit-rounded plan removes the target."""
    geoms, slots, ladders, locked = inputs.geoms, inputs.slots, inputs.ladders, inputs.locked
    constraints, target, multiple = inputs.constraints, inputs.target, inputs.multiple

    def steps_at(rate: float) -> np.ndarray:
        rates = [locked.get(s, rate) for s in range(len(slots))]
        return ladder_steps_at_rates(geoms, slots, ladders, rates, multiple)

    low, high = constraints.min_rate, constraints.max_rate
    if ladder_removed(ladders, steps_at(high)) < target:
        rate = high
    elif ladder_removed(ladders, steps_at(low)) >= target:
        rate = low
    else:
        rate = smallest_meeting(lambda r: ladder_removed(ladders, steps_at(r)) >= target, low, high)
    log.info("uniform: common rate %.4f before unit settling", rate)
    return steps_at(rate), None


def _flap_wanted(
    geoms: list[ComponentGeometry],
    slots: tuple[tuple[int, str], ...],
    ladders: list[Ladder],
    locked: dict[int, float],
    standardised: list[LayerScores],
    target: float,
    max_rate: float,
) -> np.ndarray:
    """Per-slot parameters FLAP's global threshold removes (before unit rounding).

    ``standardised`` holds FLAP's per-layer z-scores (``importance.flap_standardised``);
    units go globally, lowest first, until the target is met, a slot never past
    ``max_rate`` of its parameters. A head costs its q/o slice plus its share of its
    group's k/v (FLAP's weight of 4 * head_dim / 3 channels, for GQA); a channel its
    gate/up/down column, 3 * hidden.
    """
    z_parts: list[np.ndarray] = []  # per layer and unit type: the units' z-scores
    unit_params: list[np.ndarray] = []  # parameters each unit removes
    unit_slot: list[np.ndarray] = []  # the slot each unit belongs to
    fixed = 0
    for s, (layer, kind) in enumerate(slots):
        if s in locked:
            fixed += int(ladders[s].removed[0])
            continue
        geom = geoms[layer]
        g = geom.geometry
        if kind in ("attn", "block"):
            z = standardised[layer].head.numpy()  # (H,)
            per_head = 2 * geom.hidden * g.head_dim * (1.0 + 1.0 / g.group_size)
            z_parts.append(z)
            unit_params.append(np.full(len(z), per_head))
            unit_slot.append(np.full(len(z), s))
        if kind in ("mlp", "block"):
            z = standardised[layer].channel.numpy()  # (I,)
            z_parts.append(z)
            unit_params.append(np.full(len(z), 3.0 * geom.hidden))
            unit_slot.append(np.full(len(z), s))
    wanted = np.zeros(len(slots))
    for s in locked:
        wanted[s] = ladders[s].removed[0]
    if not z_parts:
        return wanted
    z_all = np.concatenate(z_parts)
    params_all = np.concatenate(unit_params)
    slot_all = np.concatenate(unit_slot).astype(np.intp)
    cap = np.array([max_rate * ladder.dense for ladder in ladders])
    need = target - fixed
    for u in np.argsort(z_all, kind="stable"):
        if need <= 0:
            break
        s = slot_all[u]
        if wanted[s] + params_all[u] > cap[s] + 1e-6:
            continue
        wanted[s] += params_all[u]
        need -= params_all[u]
    return wanted


def flap_ladder_steps(inputs: BaselineInputs) -> tuple[np.ndarray, np.ndarray]:
    """FLAP's global threshold on its standardised fluctuation scores, rounded to each slot's nearest ladder step."""
    if inputs.windows is None:
        raise InvariantError("the allocator checks that FLAP was given calibration windows")
    standardised = flap_standardised(inputs.lm, inputs.windows, inputs.batch_size)
    wanted = _flap_wanted(
        inputs.geoms, inputs.slots, inputs.ladders, inputs.locked, standardised, inputs.target, inputs.constraints.max_rate
    )
    return nearest_ladder_steps(inputs.ladders, wanted), wanted


def outlier_ratios(lm: LoadedModel, windows: torch.Tensor, m: float = OWL_OUTLIER_M, batch_size: int = 4) -> np.ndarray:
    """OWL's layerwise outlier ratio D_l: the share of a layer's |W| * ||X|| entries above
    ``m`` times their mean, over all seven projections of the layer.

    Args:
        lm: the dense LoadedModel.
        windows: (N, T) calibration token ids.
        m: the outlier multiple (OWL's M).
    Returns:
        (L,) float64 ratios in [0, 1].
    """
    lm = lm.private()  # its inputs are read by hooks: never on a model other threads run
    layers = list(lm.adapter.layers(lm.model))
    # q, gate: one input each that k/v and up share.
    groups: dict[tuple[int, str], tuple[nn.Linear, ...]] = {}
    for i, layer in enumerate(layers):
        q, k, v, o = lm.adapter.attention_projections(layer)
        gate, up, down = lm.adapter.mlp_projections(layer)
        groups[i, "qkv"] = (q, k, v)
        groups[i, "o"] = (o,)
        groups[i, "gate_up"] = (gate, up)
        groups[i, "down"] = (down,)
    stats = input_statistics(lm, windows, {key: linears[0] for key, linears in groups.items()}, batch_size)
    ratios = np.zeros(len(layers))
    for i in range(len(layers)):
        metrics: list[torch.Tensor] = []
        for name in ("qkv", "o", "gate_up", "down"):
            norm = stats[i, name].l2()  # (in,)
            for linear in groups[i, name]:
                metrics.append((linear.weight.detach().abs().cpu().double() * norm[None, :]).reshape(-1))  # (out*in,)
        metric = torch.cat(metrics)
        ratios[i] = float((metric > m * metric.mean()).double().mean())
    return ratios


def owl_offsets(ratios: np.ndarray, lam: float = OWL_LAMBDA) -> np.ndarray:
    """Per-layer rate offsets around the mean rate: more outliers, less pruning.

    The ratios are scaled to [0, 2*lambda] and centred; offset_l = mean - scaled_l.
    """
    ratios = np.asarray(ratios, dtype=np.float64)
    spread = ratios.max() - ratios.min()
    scaled = np.zeros_like(ratios) if spread <= 0 else (ratios - ratios.min()) / spread * (2.0 * lam)
    offsets: np.ndarray = scaled.mean() - scaled
    return offsets


def owl_ladder_steps(inputs: BaselineInputs) -> tuple[np.ndarray, None]:
    """Rungs at rates clip(t + offset_l) with the smallest shift t (bisection) that meets the target."""
    geoms, slots, ladders, locked = inputs.geoms, inputs.slots, inputs.ladders, inputs.locked
    constraints, target, multiple = inputs.constraints, inputs.target, inputs.multiple
    if inputs.windows is None:
        raise InvariantError("OWL was given no calibration windows (the allocator checks for them)")
    ratios = outlier_ratios(inputs.lm, inputs.windows, batch_size=inputs.batch_size)
    offsets = owl_offsets(ratios)
    log.info("owl: outlier ratios %s", np.array2string(ratios, precision=4))

    def steps_at(shift: float) -> np.ndarray:
        rates = [
            locked.get(s, float(np.clip(shift + offsets[layer], constraints.min_rate, constraints.max_rate)))
            for s, (layer, _) in enumerate(slots)
        ]
        return ladder_steps_at_rates(geoms, slots, ladders, rates, multiple)

    low, high = constraints.min_rate - offsets.max() - 1e-6, constraints.max_rate - offsets.min() + 1e-6
    if ladder_removed(ladders, steps_at(low)) >= target:
        return steps_at(low), None
    return steps_at(smallest_meeting(lambda shift: ladder_removed(ladders, steps_at(shift)) >= target, low, high)), None


Baseline = Callable[[BaselineInputs], "tuple[np.ndarray, np.ndarray | None]"]  # the ladder steps it picks, what it wanted
