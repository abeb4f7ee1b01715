"""``gap plan``, ``gap front`` and ``gap compare``: the allocation stage on the command line.

``plan`` turns a loss table and a budget into a plan file, ``front`` writes the whole
budget/loss front of a table as CSV (no model needed), and ``compare`` prunes the model
with every requested method at every budget and measures the results. Inputs are all
checked before anything slow runs or any file is written; outputs are written atomically.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import sys
from pathlib import Path

from .errors import BudgetError, TableError


# ---- argument parsing (user errors are GapErrors, so main prints one line and exits 2) --------
def parse_locks(values: list[str] | None) -> dict[int, float]:
    """``["0,29", "5:0.25"]`` -> {0: 0.0, 29: 0.0, 5: 0.25}; a layer alone is locked dense.

    Raises:
        BudgetError: bad syntax, or one layer locked at two different rates.
    """
    locks: dict[int, float] = {}
    for value in values or []:
        for item in value.split(","):
            item = item.strip()
            if not item:
                continue
            layer_text, _, rate_text = item.partition(":")
            try:
                layer = int(layer_text)
                rate = float(rate_text) if rate_text else 0.0
            except ValueError:
                raise BudgetError(f"--lock expects LAYER or LAYER:RATE items separated by commas, got '{item}'") from None
            if layer in locks and locks[layer] != rate:
                raise BudgetError(f"layer {layer} is locked twice, at rates {locks[layer]:g} and {rate:g}")
            locks[layer] = rate
    return locks


def parse_fraction(text: str, what: str) -> float:
    try:
        value = float(text)
    except (TypeError, ValueError):
        raise BudgetError(f"{what} must be a number in [0, 1), got '{text}'") from None
    if not 0.0 <= value < 1.0:
        raise BudgetError(f"{what} {value:g} is outside [0, 1): it is a fraction of the prunable parameters")
    return value


def parse_list(text: str, what: str) -> list[str]:
    items = [part.strip() for part in text.split(",") if part.strip()]
    if not items:
        raise BudgetError(f"{what} must be a comma-separated list, got '{text}'")
    return items


def constraints_from(args):
    from .allocation import Constraints

    min_rate = parse_fraction(args.min_rate, "--min-rate")
    max_rate = parse_fraction(args.max_rate, "--max-rate")
    return Constraints(locked=parse_locks(args.lock), min_rate=min_rate, max_rate=max_rate, coupled=args.coupled)


def read_table(path: str):
    """The loss table in a JSON file; TableError (one line) when missing or malformed."""
    from .tables import LossTable

    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc).splitlines()[0]
        raise TableError(f"cannot read loss table {path}: {reason}") from None
    return LossTable.from_json(text)


def _load_for_table(model_arg: str | None, table):
    """The model named on the command line (or the table's own), checked against the table."""
    from .models import load_model

    lm = load_model(model_arg or table.model)
    table.check_model(lm)
    return lm


def csv_text(rows: list[dict]) -> str:
    columns: list[str] = []
    for row in rows:
        columns.extend(k for k in row if k not in columns)
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=columns, lineterminator="\n")
    writer.writeheader()
    for row in rows:
        writer.writerow({k: (f"{v:.6g}" if isinstance(v, float) else v) for k, v in row.items()})
    return buffer.getvalue()


def budget_for_kept_params(dense_total: int, dense_prunable: int, keep: int) -> float:
    """The budget (fraction of prunable parameters to remove) that leaves ``keep`` parameters in all."""
    fixed = dense_total - dense_prunable  # embeddings, norms, LM head: never pruned
    if keep >= dense_total:
        return 0.0
    if keep <= fixed:
        raise BudgetError(
            f"cannot keep only {keep:,} parameters: embeddings, norms and the LM head alone hold {fixed:,} "
            f"(the model has {dense_total:,})"
        )
    return (dense_total - keep) / dense_prunable


# ---- subcommands -----------------------------------------------------------------------------
def cmd_plan(args) -> int:
    from .allocation import EvoSettings, check_budget, planning_problem, plan_from_table

    constraints = constraints_from(args)
    if (args.budget is None) == (args.keep_params is None):
        raise BudgetError("give exactly one of --budget FRACTION or --keep-params N")
    budget = parse_fraction(args.budget, "budget") if args.budget is not None else None
    table = read_table(args.table)
    planning_problem(table, constraints)  # contradictory locks fail here, before the model loads
    lm = _load_for_table(args.model, table)
    if budget is None:
        budget = budget_for_kept_params(lm.param_count(), table.dense_prunable, args.keep_params)
    check_budget(lm, table, budget, args.method, constraints)
    evo = EvoSettings(generations=args.evo_generations, offspring=args.evo_offspring)
    plan = plan_from_table(lm, table, budget, args.method, constraints, evo=evo)
    plan.save(args.out)
    summary = {
        "out": str(args.out),
        "method": plan.method,
        "budget": budget,
        "removed": plan.params["removed"],
        "removed_fraction_of_prunable": plan.params["removed_fraction_of_prunable"],
        "predicted_loss": plan.predicted_loss,
    }
    print(json.dumps(summary) if args.json else "\n".join(f"{k}: {v}" for k, v in summary.items()))
    return 0


def cmd_front(args) -> int:
    from .allocation import dp_front, front_csv, front_rows
    from .fsutil import atomic_write_text

    constraints = constraints_from(args)
    table = read_table(args.table)
    if args.n_buckets < 1:
        raise BudgetError(f"--n-buckets must be at least 1, got {args.n_buckets}")
    rows = front_rows(table, dp_front(table, constraints, n_buckets=args.n_buckets, smoothed=not args.raw))
    atomic_write_text(args.out, front_csv(rows))
    print(f"{len(rows)} optima from {rows[0]['budget']:.1%} to {rows[-1]['budget']:.1%} of prunable parameters -> {args.out}")
    return 0


def cmd_compare(args) -> int:
    from .allocation import METHODS, EvoSettings, check_budget, compare, heldout_sets
    from .cli import stderr_progress
    from .fsutil import atomic_write_text
    from .models import load_model
    from .tables import TableSpec, build_table, parse_rate_grid

    budgets = [parse_fraction(b, "budget") for b in parse_list(args.budgets, "--budgets")]
    methods = parse_list(args.methods, "--methods")
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        raise BudgetError(f"unknown method '{unknown[0]}'; choose from {', '.join(METHODS)}")
    constraints = constraints_from(args)
    if args.table:
        table = read_table(args.table)
        lm = _load_for_table(args.model, table)
    else:
        spec_fields = dict(data=args.data, n_samples=args.samples, seq_len=args.seq_len, seed=args.seed, criterion=args.criterion)
        if args.rates:
            spec_fields["rate_grid"] = parse_rate_grid(args.rates)
        spec = TableSpec(**spec_fields).validate()
        lm = load_model(args.model)
        table = build_table(lm, spec, progress=stderr_progress("loss table"))
    for budget in budgets:  # before anything slow: an unreachable budget fails here
        for method in methods:
            check_budget(lm, table, budget, method, constraints)
    heldout = heldout_sets(lm.tokenizer, parse_list(args.eval_data, "--eval-data"), args.eval_samples, args.eval_seq_len, args.seed)
    evo = EvoSettings(generations=args.evo_generations, offspring=args.evo_offspring)
    outcomes = compare(
        lm, table, budgets, methods, heldout, constraints, evo=evo, progress=lambda msg: print(msg, file=sys.stderr)
    )
    rows = [o.row() for o in outcomes]
    atomic_write_text(args.out, csv_text(rows))
    sources = list(heldout)
    header = f"{'method':<8} {'budget':>6} {'removed':>11} {'pred. loss':>10} {'calib +loss':>11} " + " ".join(
        f"{'ppl ' + s:>16}" for s in sources
    )
    print(header)
    dense = outcomes[0].dense_perplexity if outcomes else {}
    print(f"{'dense':<8} {0:>6.0%} {0:>11,} {'':>10} {'':>11} " + " ".join(f"{dense[s]:>16.3f}" for s in sources))
    for o in outcomes:
        predicted = f"{o.predicted_loss:.4f}" if o.predicted_loss is not None else "-"
        print(
            f"{o.method:<8} {o.budget:>6.0%} {o.removed:>11,} {predicted:>10} {o.calib_loss_increase:>11.4f} "
            + " ".join(f"{o.perplexity[s]:>16.3f}" for s in sources)
        )
    print(f"-> {args.out}", file=sys.stderr)
    return 0


# ---- registration ------------------------------------------------------------------------------
def _add_constraint_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--lock",
        action="append",
        metavar="LAYERS",
        help="keep layers at a rate: '0,29' (dense) or '0:0.0,5:0.25'; negative counts from the end; repeatable",
    )
    p.add_argument("--min-rate", default="0.0", help="lowest rate of any unlocked component")
    p.add_argument("--max-rate", default="0.95", help="highest rate of any unlocked component")
    p.add_argument("--coupled", action="store_true", help="a layer's attention and MLP share one rate")


def _add_evo_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--evo-generations", type=int, default=4, help="evo: rounds of mutation and selection")
    p.add_argument("--evo-offspring", type=int, default=4, help="evo: candidates per round")


def register(subparsers) -> None:
    """Add ``plan``, ``front`` and ``compare`` to the ``gap`` parser."""
    from .allocation import METHODS
    from .importance import CRITERIA

    p = subparsers.add_parser("plan", help="choose per-layer rates for a budget from a loss table")
    p.add_argument("--table", required=True, help="a loss table JSON file")
    p.add_argument("--budget", help="fraction of prunable parameters to remove, in [0, 1)")
    p.add_argument("--keep-params", type=int, help="instead of --budget: total parameters the pruned model may keep")
    p.add_argument("--method", default="dp", choices=METHODS)
    p.add_argument("--model", help="the model (default: the one the table names); its fingerprint must match the table")
    p.add_argument("--out", required=True, help="plan file: .json, or .yaml/.yml")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    _add_constraint_args(p)
    _add_evo_args(p)
    p.set_defaults(func=cmd_plan)

    p = subparsers.add_parser("front", help="the optimal loss for every budget (CSV), from a loss table alone")
    p.add_argument("--table", required=True, help="a loss table JSON file")
    p.add_argument("--out", required=True, help="CSV file")
    p.add_argument("--n-buckets", type=int, default=4096, help="budget resolution")
    p.add_argument("--raw", action="store_true", help="plan on the raw deltas, not the smoothed table")
    _add_constraint_args(p)
    p.set_defaults(func=cmd_front)

    p = subparsers.add_parser("compare", help="prune with several methods at several budgets and measure them")
    p.add_argument("--model", required=True)
    p.add_argument("--budgets", default="0.1,0.2,0.3", help="comma-separated fractions of prunable parameters")
    p.add_argument("--methods", default="dp,uniform", help=f"comma-separated, from {','.join(METHODS)}")
    p.add_argument("--table", help="use this loss table instead of building one")
    p.add_argument("--data", default="wiki-sample", help="calibration text for the table")
    p.add_argument("--samples", type=int, default=16, help="calibration windows")
    p.add_argument("--seq-len", type=int, default=256, help="tokens per window")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--criterion", default="wanda", choices=CRITERIA)
    p.add_argument("--rates", help="the table's rate grid, e.g. 0,0.125,0.25,...")
    p.add_argument("--eval-data", default="wiki-sample,news-sample", help="comma-separated held-out sources")
    p.add_argument("--eval-samples", type=int, default=16)
    p.add_argument("--eval-seq-len", type=int, default=256)
    p.add_argument("--out", required=True, help="results CSV")
    _add_constraint_args(p)
    _add_evo_args(p)
    p.set_defaults(func=cmd_compare)
