"""Iterative planning: prune a share of the budget, re-measure on the pruned model, plan the rest.

A loss table prices every component alone on the dense model, and the DP adds those prices
up; the components interact, so a plan's true loss is more than the sum (at 20% of
SmolLM2-135M, +76%: see bench/results/quality.md). Iterative planning narrows the gap the
way iterative pruning does: ``rounds`` rounds, each removing an equal share of the budget
(in parameters of the dense model) with the DP on a table measured on the model as the
earlier rounds left it, so every later table sees the earlier cuts. Each round is pruned
physically (``surgery``), and its table is built like any other (cached under the pruned
model's own fingerprint, resumable, cancellable).

The result is a pruned model, not a plan for the dense model: the units each round removes
are chosen by importance scores of the model at that round. Its plan (the share of each
component's dense parameters gone, on the dense model's fingerprint, and every block's
attention shape: rounds can reach a shape that ties in size with the one its rate rounds
to, see ``units``) gives exactly the widths, and its kept indices (composed over the rounds,
into the dense model's heads and channels) say which units survived, so it saves as an
ordinary pruned checkpoint.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace

from gap_engine.core.errors import CompensationError, InvariantError
from gap_engine.core.progress import NO_HOOKS, Hooks
from gap_engine.data.windows import calibration_windows
from gap_engine.model.loaded import LoadedModel
from gap_engine.model.rateplan import RatePlan, make_plan, plan_widths
from gap_engine.model.slicing import layer_widths
from gap_engine.model.units import block_geometries
from gap_engine.pipeline.stages import loss_table, objective_increase, plan_for, prune_with_plan, pruned_by
from gap_engine.plan.problem import Constraints
from gap_engine.prune.compensation_pass import calibration_tokens, check_calibration
from gap_engine.prune.compensations import NO_COMPENSATION, CompensationSettings
from gap_engine.prune.criteria import is_sequential
from gap_engine.prune.sequential import check_follows_obs
from gap_engine.tables.artefact import LossTable, TableSpec

log = logging.getLogger(__name__)


@dataclass
class PlanRound:
    """One round of iterative planning."""

    index: int  # 1-based
    table_key: str  # the table measured on the model at the start of the round
    budget: float  # fraction of that model's prunable parameters this round removes
    removed: int  # parameters the round removed
    predicted: float  # the round's table prediction (summed cells), in the table's objective
    measured: float | None  # the same objective measured on the calibration windows: round's model vs the one before


@dataclass
class IterativeResult:
    """A model pruned in rounds, and what each round predicted and measured."""

    model: LoadedModel  # the pruned model
    budget: float  # requested fraction of the dense model's prunable parameters
    removed: int  # prunable parameters removed in all
    removed_fraction: float  # of the dense model's prunable parameters
    attention_rates: list[float]  # per layer: share of the dense attention parameters gone
    mlp_rates: list[float]  # per layer: share of the dense MLP parameters gone
    rounds: list[PlanRound] = field(default_factory=list)
    plan: RatePlan | None = None  # the widths as a plan for the dense model (allocator "dp-iterative")
    kept: dict = field(default_factory=dict)  # kept_kv_heads, kept_heads, kept_channels per layer, in dense indices
    bias_params: int = 0  # parameters the compensation's biases added (not in ``removed``)

    @property
    def predicted_loss(self) -> float:
        """The rounds' predictions added up."""
        return float(sum(r.predicted for r in self.rounds))


def prunable_params(lm: LoadedModel, channel_multiple: int, dense: LoadedModel | None = None) -> tuple[int, list[int], list[int]]:
    """(all prunable parameters, per-layer attention, per-layer MLP) of a model as it is now;
    given the ``dense`` model it was pruned from, o_proj counts with a bias only where dense's has
    one (bias compensation's added biases are not parameters a plan's rates remove)."""
    geoms = block_geometries(lm)
    if dense is not None:
        geoms = [replace(g, o_bias=d.o_bias) for g, d in zip(geoms, block_geometries(dense))]
    attention = [g.params_at("attn", 0.0) for g in geoms]
    mlp = [g.params_at("mlp", 0.0, channel_multiple) for g in geoms]
    return sum(attention) + sum(mlp), attention, mlp


def widths_plan(dense: LoadedModel, pruned: LoadedModel, criterion: str, channel_multiple: int, **meta) -> RatePlan:
    """A plan for ``dense`` that gives it ``pruned``'s widths: each component's share of its dense
    parameters gone, and every block's attention shape as reached (a rate alone may round to
    another shape of the same size).

    Raises:
        InvariantError: the plan's widths are not ``pruned``'s (a bug).
    """
    _, dense_attention, dense_mlp = prunable_params(dense, channel_multiple)
    _, attention, mlp = prunable_params(pruned, channel_multiple, dense)
    shapes = [[g.n_kv_heads, g.group_size] for g in (pruned.adapter.geometry(layer) for layer in pruned.adapter.layers(pruned.model))]
    plan = make_plan(
        dense,
        [1.0 - a / d for a, d in zip(attention, dense_attention)],
        [1.0 - m / d for m, d in zip(mlp, dense_mlp)],
        criterion,
        channel_multiple,
        attention_shapes=shapes,
        **meta,
    )
    if plan_widths(dense, plan) != layer_widths(pruned.adapter, pruned.model):
        raise InvariantError("a plan made from a pruned model's widths gives other widths")
    return plan


def compose_kept(kept: dict, round_kept: dict) -> dict:
    """Kept indices into the dense model after one more round (``round_kept`` indexes the round's model)."""
    return {name: [[layer[i] for i in chosen] for layer, chosen in zip(kept[name], round_kept[name])] for name in kept}


def _check_rounds(dense: LoadedModel, spec: TableSpec, rounds: int, compensation: CompensationSettings, criterion: str | None) -> None:
    """What ``iterative_prune`` refuses before the first table is built."""
    if rounds < 1:
        raise ValueError(f"rounds must be at least 1, got {rounds}")
    if compensation.active and rounds > 1:
        raise CompensationError(f"compensation '{compensation.mode}' follows a one-shot cut; prune in one round (--rounds 1) to compensate")
    if criterion is not None and is_sequential(criterion):
        check_follows_obs(compensation)
    check_calibration(dense, calibration_tokens(spec.windows, compensation), compensation)


def iterative_prune(
    dense: LoadedModel,
    spec: TableSpec,
    budget: float,
    rounds: int,
    constraints: Constraints = Constraints(),
    measure: bool = True,
    hooks: Hooks = NO_HOOKS,
    use_cache: bool = True,
    first_table: LossTable | None = None,
    compensation: CompensationSettings = NO_COMPENSATION,
    criterion: str | None = None,
    obs_samples: int | None = None,
) -> IterativeResult:
    """Prune a copy of ``dense`` to ``budget`` in ``rounds`` rounds of table -> DP -> surgery.

    Args:
        dense: the dense model (not modified).
        spec: how every round's table is measured (its windows also score the units).
        budget: fraction of the dense model's prunable parameters to remove in all.
        rounds: at least 1; 1 is the one-shot DP plan.
        constraints: as for the DP, in every round.
        measure: also measure each round's objective increase on the calibration windows.
        hooks, use_cache: as for ``loss_table``; each round is also announced as a message.
        first_table: the dense model's table under ``spec`` if at hand (``tables.lookup``); round 1
            uses it only when it is for these weights, else reads or builds its own.
        compensation: what the kept units get after the cut, fitted on the table's windows: one
            round only (a later round's cut would be fitted to a pruned model); ``budget`` pays for its biases.
        criterion, obs_samples: what chooses every round's units (None: the table's criterion; ``obs``
            prunes the DP's rates with its OBS update, ``stages.pruned_by``), and ``obs``'s window count.
    Returns:
        IterativeResult with the pruned model.
    Raises:
        CompensationError: compensation with more than one round, a refit after ``obs``, or too little calibration text.
    """
    _check_rounds(dense, spec, rounds, compensation, criterion)
    current = dense.copy()
    total = prunable_params(dense, spec.channel_multiple)[0]
    out = IterativeResult(current, budget, 0, 0.0, [], [])
    geoms = [dense.adapter.geometry(layer) for layer in dense.adapter.layers(dense.model)]
    out.kept = {
        "kept_kv_heads": [list(range(g.n_kv_heads)) for g in geoms],
        "kept_heads": [list(range(g.n_heads)) for g in geoms],
        "kept_channels": [list(range(g.intermediate_size)) for g in geoms],
    }
    cancel = Hooks(cancel=hooks.cancel)  # the plan's criterion scores each round's units (obs: chooses them while pruning)
    for index in range(1, rounds + 1):
        hooks.check_cancelled(f"iterative planning cancelled before round {index} of {rounds}")
        hooks.say(f"round {index} of {rounds}: loss table of the model as it is")
        if index == 1 and first_table is not None and first_table.model_fingerprint == current.fingerprint:
            table = first_table
        else:
            table = loss_table(current, spec, hooks, use_cache)
        now = prunable_params(current, spec.channel_multiple)[0]
        share = max(0.0, (budget * total * index / rounds - (total - now)) / now)
        plan = pruned_by(plan_for(current, table, share, "dp", constraints, compensation=compensation.mode), criterion)
        if plan.predicted_loss is None:
            raise InvariantError("a plan made from a table has no predicted loss")
        windows = calibration_windows(current.tokenizer, spec.windows)
        before = current.copy() if measure else None
        result = prune_with_plan(current, plan, spec.windows, cancel, compensation=compensation, obs_samples=obs_samples)
        out.kept = compose_kept(out.kept, result.kept_indices())
        measured = None
        if before is not None:
            measured = objective_increase(current, before, windows, spec.objective, spec.windows.batch_size)
        removed = int(result.plan.params["removed"])
        out.rounds.append(PlanRound(index, table.key, share, removed, float(plan.predicted_loss), measured))
        log.info("round %d/%d: removed %d parameters, predicted %.4f, measured %s", index, rounds, removed, plan.predicted_loss, measured)
    out.removed = total - prunable_params(current, spec.channel_multiple, dense)[0]
    out.removed_fraction = out.removed / total
    meta = {"allocator": "dp-iterative", "budget": budget, "predicted_loss": out.predicted_loss, "compensation": compensation.mode}
    out.plan = widths_plan(dense, current, criterion or spec.criterion, spec.channel_multiple, **meta)
    out.attention_rates, out.mlp_rates = out.plan.attention_rates, out.plan.mlp_rates
    out.bias_params = added = result.params_after - int(result.plan.params["pruned_total"])  # the compensation's biases (0 without)
    if out.plan.params["pruned_total"] + added != current.param_count():
        raise InvariantError(f"the rounds left {current.param_count()} parameters, their widths say {out.plan.params['pruned_total']}")
    current.pruned_from = {"model": dense.name, "fingerprint": dense.fingerprint, "plan": out.plan.to_dict()}
    if result.compensation is not None:
        current.pruned_from["compensation"] = result.compensation
    return out
