"""``gap plan``, ``gap front`` and ``gap compare``: the allocation stage on the command line.

``plan`` turns a loss table and a budget into a plan file, ``front`` writes the whole
budget/loss front of a table as CSV (no model needed), and ``compare`` prunes the model
with every requested allocator at every budget and measures the results. Inputs are all
checked before anything slow runs or any file is written; outputs are written atomically.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from gap_engine.cli.arguments import compensation_from, device_from, parse_fraction, parse_list, parse_locks
from gap_engine.cli.output import StderrProgress, csv_text, table_compensation_text
from gap_engine.cli.table_commands import check_windows_fit, read_sources, spec_from_args
from gap_engine.core.config import HELDOUT_SPLITS, WindowSpec
from gap_engine.core.errors import BudgetError, CompensationError, TableError
from gap_engine.core.fsutil import atomic_write_text
from gap_engine.core.limits import LIMITS
from gap_engine.core.progress import Hooks
from gap_engine.core.validate import decode_text, read_bounded
from gap_engine.model.identity import model_type_of
from gap_engine.model.loading import load_model, recorded_identity
from gap_engine.model.names import resolve_recorded
from gap_engine.pipeline import compare
from gap_engine.pipeline.compare import allocator_spec, check_rows, heldout_sets
from gap_engine.pipeline.stages import loss_table, plan_for
from gap_engine.plan.allocators import check_reach
from gap_engine.plan.evo import EvoSettings
from gap_engine.plan.front import dp_front, front_csv, front_rows
from gap_engine.plan.problem import Constraints, planning_problem
from gap_engine.plan.step import plan_criterion, table_model_type
from gap_engine.prune.compensation_pass import calibration_tokens, check_calibration, fit_windows
from gap_engine.prune.compensations import CompensationSettings, fit_window_count
from gap_engine.prune.criteria import is_sequential
from gap_engine.prune.sequential import OBS_COMPENSATIONS
from gap_engine.tables.artefact import LossTable
from gap_engine.tables.lookup import find_table


def constraints_from(args: argparse.Namespace) -> Constraints:
    min_rate = parse_fraction(args.min_rate, "--min-rate")
    max_rate = parse_fraction(args.max_rate, "--max-rate")
    return Constraints(locked=parse_locks(args.lock), min_rate=min_rate, max_rate=max_rate, coupled=args.coupled)


def read_table(path: str) -> LossTable:
    """The loss table in a JSON file; TableError (one line) when missing or malformed."""
    what = f"loss table {path}"
    return LossTable.from_json(decode_text(read_bounded(path, LIMITS.table_bytes, what, TableError), what, TableError))


def table_model(table: LossTable, path: str | None) -> str:
    """The model the table in file ``path`` names: an older table's relative path read against the table's folder."""
    return (resolve_recorded(table.model, Path(path).parent) if path else None) or table.model


def check_recorded_model(model_arg: str | None, table: LossTable, table_path: str | None = None) -> None:
    """TableError now, before any text or weights are read, when the model's folder records a
    block count or weights fingerprint (a gap checkpoint) other than the table's."""
    name = model_arg or table_model(table, table_path)
    table.check_identity(str(name), *recorded_identity(name))


def _load_for_table(model_arg: str | None, table: LossTable, device=None, table_path: str | None = None):
    """The model named on the command line (or the table's own), checked against the table."""
    check_recorded_model(model_arg, table, table_path)
    lm = load_model(model_arg or table_model(table, table_path), device, hub=model_arg is not None)  # a name from the table stays local
    table.check_model(lm)
    return lm


def budget_for_kept_params(dense_total: int, dense_prunable: int, keep: int) -> float:
    """The budget (fraction of prunable parameters to remove) that leaves ``keep`` parameters in all.

    A plan removes its budget net of the biases its compensation adds (``plan.problem.bias_charges``),
    so the pruned model, biases included, keeps at most ``keep``."""
    fixed = dense_total - dense_prunable  # embeddings, norms, LM head: never pruned
    if keep >= dense_total:
        return 0.0
    if keep <= fixed:
        raise BudgetError(
            f"cannot keep only {keep:,} parameters: embeddings, norms and the LM head alone hold {fixed:,} (the model has {dense_total:,})"
        )
    return (dense_total - keep) / dense_prunable


def run_plan(args: argparse.Namespace) -> int:
    constraints = constraints_from(args)
    if (args.budget is None) == (args.keep_params is None):
        raise BudgetError("give exactly one of --budget FRACTION or --keep-params N")
    budget = parse_fraction(args.budget, "budget") if args.budget is not None else None
    table = read_table(args.table)
    problem = planning_problem(table, constraints)  # contradictory locks fail here, before the model loads
    compensation = planned_compensation(args, table)
    lm = _load_for_table(args.model, table, device_from(args), args.table)
    if budget is None:
        budget = budget_for_kept_params(lm.param_count(), table.dense_prunable, args.keep_params)
    # The reach is checked before the allocator's slow part, on the problem built above, and
    # what it checked is what the plan is made on.
    reachable = check_reach(lm, table, budget, args.allocator, constraints, compensation.mode, problem=problem)
    evo = EvoSettings(generations=args.evo_generations, offspring=args.evo_offspring)
    plan = plan_for(lm, table, reachable.budget, args.allocator, constraints, evo=evo, compensation=compensation.mode, reachable=reachable)
    plan.save(args.out)
    summary = {
        "out": str(args.out),
        "allocator": plan.allocator,
        "budget": budget,
        "compensation": plan.compensation,
        "removed": plan.params["removed"],
        "bias_params": plan.params.get("bias_params", 0),
        "params_after": plan.params.get("pruned_total_with_biases", plan.params["pruned_total"]),
        "removed_fraction_of_prunable": plan.params["removed_fraction_of_prunable"],
        "predicted_loss": plan.predicted_loss,
        "predicted_from": f"{table.basis(table.cells_for(plan.attention_rates, plan.mlp_rates))} cells ({table.spec.objective}, summed)",
    }
    print(json.dumps(summary) if args.json else "\n".join(f"{k}: {v}" for k, v in summary.items()))
    return 0


def planned_compensation(args: argparse.Namespace, table: LossTable) -> CompensationSettings:
    """The compensation ``gap plan`` counts the plan for: ``--compensate``, else the default of the
    plan's criterion (none for ``obs``, which updates the kept columns itself).

    Raises:
        CompensationError: a refit for a plan of ``obs``, whose update is one (gap prune refuses it too).
    """
    criterion = plan_criterion(args.allocator, table, args.compensate)
    compensation = compensation_from(args, criterion, model_type=table_model_type(table))
    if is_sequential(criterion) and compensation.mode not in OBS_COMPENSATIONS:
        raise CompensationError(
            f"a {args.allocator} plan prunes with criterion '{criterion}', which updates the kept columns itself (a refit); "
            f"it takes --compensate {' or '.join(OBS_COMPENSATIONS)}, not {compensation.mode}"
        )
    return compensation


def run_front(args: argparse.Namespace) -> int:
    constraints = constraints_from(args)
    table = read_table(args.table)
    if args.n_buckets < 1:
        raise BudgetError(f"--n-buckets must be at least 1, got {args.n_buckets}")
    rows = front_rows(table, dp_front(table, constraints, n_buckets=args.n_buckets, smoothed=not args.raw))
    atomic_write_text(args.out, front_csv(rows))
    print(f"{len(rows)} optima from {rows[0]['budget']:.1%} to {rows[-1]['budget']:.1%} of prunable parameters -> {args.out}")
    return 0


def run_compare(args: argparse.Namespace) -> int:
    budgets = [parse_fraction(b, "budget") for b in parse_list(args.budgets, "--budgets")]
    allocators = parse_list(args.allocators, "--allocators")
    for given in allocators:  # ALLOCATOR or ALLOCATOR:CRITERION (dp:obs), refused before anything is read
        allocator_spec(given)
    constraints = constraints_from(args)
    prepared = _prepared_tasks(args)  # before the text is read and the model loads
    compensation = compensation_from(args, model_type=model_type_of(args.model))
    asked = compensation if args.compensate else None  # not asked: each row its step's default
    table = read_table(args.table) if args.table else None
    if table is not None:
        check_recorded_model(args.model, table)  # before the text is read
    spec = None if table is not None else spec_from_args(args, follows=compensation)
    cached = None if spec is None else find_table(args.model, spec, device_from(args))  # before anything loads
    eval_windows = WindowSpec(data=args.eval_data, n_samples=args.eval_samples, seq_len=args.eval_seq_len, seed=args.seed)
    # The table's text is read only to build the table.
    calibration = [] if spec is None or cached is not None else [(spec.windows, "calibration")]
    table_spec = table.spec if table is not None else spec
    if table_spec is not None and (compensation.active or args.fit_samples is not None):  # the fit may read more text than the table did
        fitted = fit_window_count(model_type_of(args.model), table_spec.windows.n_samples, args.fit_samples)
        calibration.append((fit_windows(table_spec.windows, fitted), "calibration"))
    splits = HELDOUT_SPLITS if args.split == "both" else (args.split,)
    check_windows_fit(args.model, *((eval_windows, split) for split in splits), *calibration)
    read_sources(args.eval_data, *((args.data,) if calibration else ()))  # before the model loads
    if table is not None:
        lm = _load_for_table(args.model, table, device_from(args))
        check_calibration(lm, calibration_tokens(table.spec.windows, compensation), compensation)
    else:
        build_spec = spec if spec is not None else spec_from_args(args, follows=compensation)
        lm = load_model(args.model, device_from(args))
        check_calibration(lm, calibration_tokens(build_spec.windows, compensation), compensation)  # before the table is built
        if cached is not None and cached.model_fingerprint == lm.fingerprint:
            table = cached
        else:
            progress = StderrProgress("loss table")
            table = loss_table(lm, build_spec, progress.hooks())
    checked = check_rows(lm, table, budgets, allocators, constraints, asked)  # before anything slow
    heldout = heldout_sets(lm.tokenizer, eval_windows, splits)
    evo = EvoSettings(generations=args.evo_generations, offspring=args.evo_offspring)
    extra, dense_columns = _task_columns(lm, prepared)
    say = Hooks(message=lambda msg: print(msg, file=sys.stderr))  # one line per finished plan
    outcomes = compare(
        lm,
        table,
        budgets,
        allocators,
        heldout,
        constraints,
        evo,
        say,
        extra=extra,
        compensation=asked,
        obs_samples=args.obs_samples,
        checked=checked,
        fit_samples=args.fit_samples,
        fit_weighting=args.fit_weighting,
    )
    for outcome in outcomes:
        outcome.extras = outcome.extras | dense_columns
    atomic_write_text(args.out, csv_text([o.row() for o in outcomes]))
    _print_outcomes(outcomes, list(heldout))
    print(_split_text(splits))
    print(table_compensation_text(table.spec, compensation))
    other = sorted({(o.criterion, o.compensation) for o in outcomes if o.compensation != compensation.mode})
    if other:  # rows whose step takes another compensation (OBS: its update is one)
        print("; ".join(f"rows pruned by {criterion}: compensation {mode}" for criterion, mode in other))
    if prepared is not None:
        _print_task_table(outcomes, list(prepared.tasks), dense_columns)
    print(f"-> {args.out}", file=sys.stderr)
    return 0


def _split_text(splits: Sequence[str]) -> str:
    """What the perplexity columns were measured on, in words."""
    meaning = {"report": "report (held-out text reported on)", "selection": "selection (held-out text choices are made on)"}
    return "held-out windows: " + " and ".join(meaning[split] for split in splits) + "; the two parts never share a document"


def _prepared_tasks(args: argparse.Namespace):
    from .model_commands import task_settings_from

    settings = task_settings_from(args)
    if settings is None:
        return None
    from gap_engine.evaluate.tasks import prepare_tasks

    return prepare_tasks(settings)


def _task_columns(lm, prepared):
    """(a function giving a pruned model's task columns, the dense model's columns), or (None, {})."""
    if prepared is None:
        return None, {}
    from gap_engine.evaluate.tasks import model_and_dense_scores, run_tasks, score_columns

    print(f"task accuracy on {', '.join(prepared.tasks)} (lm-eval): dense", file=sys.stderr)
    _, dense_scores = model_and_dense_scores(lm, None, prepared)
    return (lambda pruned: score_columns(run_tasks(pruned, prepared))), score_columns(dense_scores, "dense_")


def _print_task_table(outcomes, tasks: list[str], dense_columns: dict) -> None:
    """Accuracy (± its standard error) per task, dense first, then every allocator and budget."""

    def cell(columns: dict, prefix: str, task: str) -> str:
        acc = columns.get(f"{prefix}acc_{task}")
        return f"{acc:.3f} ± {columns.get(f'{prefix}acc_stderr_{task}', 0):.3f}" if acc is not None else "-"

    print("task accuracy (lm-eval acc ± stderr)")
    print(f"{'allocator':<9} {'budget':>6} " + " ".join(f"{t[:20]:>20}" for t in tasks))
    print(f"{'dense':<9} {0:>6.0%} " + " ".join(f"{cell(dense_columns, 'dense_', t):>20}" for t in tasks))
    for o in outcomes:
        print(f"{o.allocator:<9} {o.budget:>6.0%} " + " ".join(f"{cell(o.extras, '', t):>20}" for t in tasks))


def _print_outcomes(outcomes, sources: list[str]) -> None:
    objective = outcomes[0].objective if outcomes else "nll"
    header = (
        f"{'allocator':<9} {'criterion':<9} {'budget':>6} {'removed':>11} {'predicted':>10} {'from cells':>10} {'measured':>10} "
        f"{'calib +nll':>10} " + " ".join(f"{'ppl ' + s:>16}" for s in sources)
    )
    print(
        f"predicted: the table's sum of single-component {objective} increases; measured: the {objective} "
        "increase of the whole pruned model on the same calibration windows"
    )
    print(header)
    dense = outcomes[0].dense_perplexity if outcomes else {}
    print(f"{'dense':<9} {'':<9} {0:>6.0%} {0:>11,} {'':>10} {'':>10} {'':>10} {'':>10} " + " ".join(f"{dense[s]:>16.3f}" for s in sources))
    for o in outcomes:
        predicted = f"{o.predicted_loss:.4f}" if o.predicted_loss is not None else "-"
        measured = f"{o.calib_objective_increase:.4f}" if o.calib_objective_increase is not None else "-"
        print(
            f"{o.allocator:<9} {o.criterion:<9} {o.budget:>6.0%} {o.removed:>11,} {predicted:>10} {o.predicted_basis or '-':>10} {measured:>10} "
            f"{o.calib_loss_increase:>10.4f} " + " ".join(f"{o.perplexity[s]:>16.3f}" for s in sources)
        )
