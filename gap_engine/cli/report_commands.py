"""``gap report``: one self-contained HTML file for stakeholders (see `report`).

    gap report --table T.json [--plan P.json] [--run RUN_ID | --eval EVAL.json] --out report.html

The table is required; the plan comes from ``--plan``, else from the run, else it is the
DP front row at ``--budget``. Every input is read and checked before the file is written,
and the file is written atomically.
"""

from __future__ import annotations

import argparse
import json
import sys

from gap_engine.cli.arguments import parse_fraction
from gap_engine.cli.plan_commands import read_table
from gap_engine.core.config import DEFAULT_BUDGET
from gap_engine.core.errors import BudgetError
from gap_engine.evaluate import history
from gap_engine.model.rateplan import RatePlan
from gap_engine.plan.problem import Constraints
from gap_engine.views import report


def run_report(args: argparse.Namespace) -> int:
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
        constraints = Constraints.from_dict((record.params or {}).get("constraints"))
    if args.budget is not None and plan is not None:
        raise BudgetError("--budget picks a DP front row when there is no plan; a plan or run brings its own budget")
    budget = parse_fraction(args.budget, "--budget") if args.budget is not None else DEFAULT_BUDGET
    command = "gap report " + " ".join(sys.argv[2:]) if sys.argv[1:2] == ["report"] else "gap report"
    text = report.build_report(table, plan, evaluation, budget=budget, constraints=constraints, source=f"Made with `{command}`.")
    path = report.write_report(args.out, text)
    summary = {
        "out": str(path),
        "bytes": len(text.encode("utf-8")),
        "plan": plan.allocator if plan else "dp front row",
        "evaluation": bool(evaluation),
    }
    if args.json:
        print(json.dumps(summary))
    else:
        print(f"wrote {path} ({summary['bytes'] / 2**20:.1f} MiB; opens offline in any browser)")
    return 0
