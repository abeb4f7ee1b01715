"""``gap report``: one self-contained HTML file for stakeholders (see `report`).

    gap report --table T.json [--plan P.json] [--run RUN_ID | --eval EVAL.json] [--recovered-eval R.json] --out report.html

The table is required; the plan comes from ``--plan``, else from the run, else it is the
DP front row at ``--budget``. Every input is read and checked before the file is written,
and the file is written atomically.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from gap_engine.cli.arguments import parse_fraction
from gap_engine.cli.plan_commands import read_table
from gap_engine.core.config import DEFAULT_BUDGET
from gap_engine.core.errors import BudgetError
from gap_engine.model.rateplan import RatePlan
from gap_engine.views import report


def run_report(args: argparse.Namespace) -> int:
    table = read_table(args.table)
    inputs = report.report_inputs(RatePlan.load(args.plan) if args.plan else None, args.run, args.eval, plan_name=str(args.plan))
    plan, evaluation, constraints = inputs.plan, inputs.evaluation, inputs.constraints
    if args.recovered_eval:
        if evaluation is None:
            raise report.ReportError("--recovered-eval needs --run or --eval: the recovered row sits beside the pruned model's")
        evaluation["recovered_tasks"] = report.read_evaluation(args.recovered_eval)["tasks"]
    if args.budget is not None and plan is not None:
        raise BudgetError("--budget picks a DP front row when there is no plan; a plan or run brings its own budget")
    budget = parse_fraction(args.budget, "--budget") if args.budget is not None else DEFAULT_BUDGET
    command = "gap report " + " ".join(sys.argv[2:]) if sys.argv[1:2] == ["report"] else "gap report"
    text = report.build_report(
        table, plan, evaluation, budget=budget, constraints=constraints, source=f"Made with `{command}`.", story=inputs.story
    )
    path = report.write_report(args.out, text)
    summary: dict[str, Any] = {
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
