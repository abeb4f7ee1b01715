"""The within-layer step a plan prunes by when no criterion is asked for.

An allocator says how many units each layer loses; a criterion says which go, and may update
the kept columns (``obs``: SlimGPT's structured OBS). Baselines prune by the criterion their
papers prescribe (``allocator_registry.own_criterion``: FLAP, SlimGPT). GAP's DP prunes by its
model family's default step (``adapters.ModelTypeFacts.default_step``) when the table scores
units by the default criterion, and otherwise by the table's own criterion (one chosen
deliberately for the table is kept). The family default is a measured choice, made on the
selection part of held-out text (``bench/results/quality.md``, "The step, on the selection
part"): on SmolLM2 (Llama) DP's plan pruned by OBS ties the table's criterion with bias at
10-30% and beats it at 40-50%; a family without such evidence keeps the table's criterion.

What the step updates decides the compensation that follows by default
(``prune.compensations.default_for``: none after OBS, else the family's default, ``bias`` or
``bias+refit`` on Gemma 3), and so which biases a budget pays for.

A table records the model type it was measured on (``extras["model_type"]``); a table written
before that is read for its model's ``config.json`` where the model's folder is here.
"""

from __future__ import annotations

from gap_engine.core.config import DEFAULT_CRITERION
from gap_engine.model.identity import model_type_of
from gap_engine.plan.allocator_registry import ALLOCATORS, own_criterion
from gap_engine.tables.artefact import LossTable


def table_model_type(table: LossTable) -> str | None:
    """The ``config.model_type`` of the model ``table`` was measured on, or None where it cannot be known."""
    recorded = table.extras.get("model_type")
    return recorded if isinstance(recorded, str) else model_type_of(table.model)


def family_step(model_type: str | None) -> str | None:
    """A model type's default step (a criterion name), or None: the table's own criterion."""
    from gap_engine.model.adapters import model_type_facts  # torch: imported when a plan is made, not by gap --help

    facts = model_type_facts(model_type)
    return facts.default_step or None if facts is not None else None


def takes(criterion: str, compensation: str | None) -> bool:
    """Whether ``compensation`` (None: not asked) may follow a prune by ``criterion``: a criterion that updates the
    kept columns itself (OBS) takes no refit, which would solve its problem again."""
    from gap_engine.prune.criteria import is_sequential
    from gap_engine.prune.sequential import OBS_COMPENSATIONS

    return compensation is None or not is_sequential(criterion) or compensation in OBS_COMPENSATIONS


def plan_criterion(allocator: str, table: LossTable, compensation: str | None = None) -> str:
    """The criterion a plan of ``allocator`` on ``table`` prunes by when none is asked for. A compensation
    asked for that the family's step cannot take (a refit after OBS) asks for the table's criterion instead."""
    own = own_criterion(allocator)
    if own:
        return own
    if ALLOCATORS[allocator].family_step and table.spec.criterion == DEFAULT_CRITERION:
        step = family_step(table_model_type(table))
        if step and takes(step, compensation):
            return step
    return table.spec.criterion
