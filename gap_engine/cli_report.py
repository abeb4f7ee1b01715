"""``gap report``: one self-contained HTML file for stakeholders (see `report`).

    gap report --table T.json [--plan P.json] [--run RUN_ID | --eval EVAL.json] --out report.html

The table is required; the plan comes from ``--plan``, else from the run, else it is the
DP front row at ``--budget``. Every input is read and checked before the file is written,
and the file is written atomically.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from .errors import BudgetError


def cmd_report(args) -> int:
    from . import history, report
    from .allocation import Constraints
    from .cli_planning import parse_fraction, read_table
    from .plan import RatePlan

    table = read_table(args.table)
    plan = RatePlan.load(args.plan) if args.plan else None
    evaluation, constraints = None, Constraints()
    if args.eval:
        if plan is None:
            raise report.ReportError("--eval needs --plan: an evaluation file does not say which plan made the model")
        evaluation = report.read_evaluation(args.eval)
    elif args.run is not None:
        record = history.get_run(args.run)
        run_plan = RatePlan.from_dict(dict(record.plan))
        if plan is not None and (plan.attention_rates, plan.mlp_rates) != (run_plan.attention_rates, run_plan.mlp_rates):
            raise report.ReportError(f"run {args.run} pruned another plan than {args.plan}: give one of them")
        plan = plan or run_plan
        evaluation = report.evaluation_from_run(record)
        raw = (record.params or {}).get("constraints") or {}
        if raw:
            constraints = Constraints(
                locked={int(k): float(v) for k, v in (raw.get("locked") or {}).items()},
                min_rate=float(raw.get("min_rate", 0.0)),
                max_rate=float(raw.get("max_rate", 0.95)),
                coupled=bool(raw.get("coupled", False)),
            )
    if args.budget is not None and plan is not None:
        raise BudgetError("--budget picks a DP front row when there is no plan; a plan or run brings its own budget")
    budget = parse_fraction(args.budget, "--budget") if args.budget is not None else 0.2
    command = "gap report " + " ".join(sys.argv[2:]) if sys.argv[1:2] == ["report"] else "gap report"
    text = report.build_report(table, plan, evaluation, budget=budget, constraints=constraints, source=f"Made with `{command}`.")
    path = report.write_report(args.out, text)
    summary = {"out": str(path), "bytes": len(text.encode("utf-8")), "plan": plan.method if plan else "dp front row", "evaluation": bool(evaluation)}
    if args.json:
        print(json.dumps(summary))
    else:
        print(f"wrote {path} ({summary['bytes'] / 2**20:.1f} MiB; opens offline in any browser)")
    return 0


def register(subparsers) -> None:
    """Add ``report`` to the ``gap`` parser."""
    p = subparsers.add_parser("report", help="one self-contained HTML report: table settings, sensitivity, front, plan, evaluation")
    p.add_argument("--table", required=True, help="a loss table JSON file")
    p.add_argument("--plan", help="the chosen plan (JSON or YAML); default: the run's plan, else the DP front row at --budget")
    source = p.add_mutually_exclusive_group()
    source.add_argument("--run", type=int, help="a run id of the history (its plan, numbers and generations)")
    source.add_argument("--eval", help="a `gap eval --json` output file of the pruned model (needs --plan)")
    p.add_argument("--budget", help="without a plan or run: report the DP front row at this fraction of prunable parameters (default 0.2)")
    p.add_argument("--out", required=True, type=Path, help="the HTML file to write")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    p.set_defaults(func=cmd_report)
