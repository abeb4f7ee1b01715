"""Orchestration: the one place where the stages are strung together.

``stages`` runs load -> windows -> scores -> table -> plan -> prune -> measure;
``compare`` measures several allocators side by side; ``iterative`` prunes in rounds, each
planned on a table of the model the rounds before left; ``runs`` is what the explorer's
background jobs do; ``checkpoints`` prunes a model into a saved checkpoint and evaluates one
(``gap prune``, ``gap eval``); ``recovery`` strings the recovery stage around ``recover``'s step
loop; ``jobs`` runs any of these as a background job the explorer watches. The CLI, the jobs and
the benchmarks call these.
"""

from gap_engine.pipeline.compare import Outcome, Reference, compare, heldout_sets, measure_plan, reference_numbers
from gap_engine.pipeline.iterative import IterativeResult, PlanRound, iterative_prune
from gap_engine.pipeline.runs import BaselinePlan, baseline_rows, prune_and_evaluate, prune_eval_stages
from gap_engine.pipeline.stages import (
    dense_reference,
    importance_for,
    loss_table,
    objective_increase,
    plan_for,
    prune_with_plan,
    pruned_as_saved,
    table_stages,
)

__all__ = [
    "BaselinePlan",
    "IterativeResult",
    "Outcome",
    "PlanRound",
    "Reference",
    "baseline_rows",
    "compare",
    "dense_reference",
    "heldout_sets",
    "importance_for",
    "iterative_prune",
    "loss_table",
    "measure_plan",
    "objective_increase",
    "plan_for",
    "prune_and_evaluate",
    "prune_eval_stages",
    "prune_with_plan",
    "pruned_as_saved",
    "reference_numbers",
    "table_stages",
]
