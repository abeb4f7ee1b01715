"""The takeaway a stakeholder reads, measured at the explorer's defaults.

Builds (or reads) the explorer's default loss table (``config.APP_TABLE``: fisher, KL, 16 x 256
tokens of wiki-sample, rates in eighths), then at each budget prunes GAP's DP plan and uniform
pruning with the default compensation, and the same DP plan again without compensation, each measured
on the Prune & evaluate page's held-out windows (``config.APP_EVAL_WINDOWS``: 8 x 128 tokens of
wiki-sample, report split) and recorded in a history of its own. The result is what the app
would say: the takeaway sentence (`evaluate.takeaway`) and the compensation sentence of each DP
run, with their paired bootstrap intervals over the held-out windows.

    python bench/bench_takeaway.py [--budgets 0.2,0.4] [--eval-samples 8] [--eval-seq-len 128]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from report import command_line, machine_line, script_argv, write_report

SCRIPT = "bench/bench_takeaway.py"

from gap_engine.core.config import APP_EVAL_WINDOWS, APP_TABLE, DEFAULT_COMPENSATION, WindowSpec
from gap_engine.evaluate import history
from gap_engine.evaluate.metrics import EvalSettings
from gap_engine.evaluate.takeaway import compensation_takeaway, takeaway
from gap_engine.model.loading import load_model
from gap_engine.model.rateplan import RatePlan
from gap_engine.pipeline.runs import prune_and_evaluate
from gap_engine.pipeline.stages import loss_table
from gap_engine.prune.compensations import NO_COMPENSATION, CompensationSettings
from gap_engine.tables.artefact import TableSpec


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--budgets", default="0.2,0.4", help="fractions of prunable parameters removed, comma-separated")
    parser.add_argument("--eval-samples", type=int, default=APP_EVAL_WINDOWS.n_samples)
    parser.add_argument("--eval-seq-len", type=int, default=APP_EVAL_WINDOWS.seq_len)
    parser.add_argument("--name", default="takeaway", help="bench/results/<name>.md")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    started, load_start = time.perf_counter(), os.getloadavg()
    budgets = [float(b) for b in args.budgets.split(",")]
    dense = load_model(args.model)
    spec = TableSpec(windows=APP_TABLE.windows, estimator=APP_TABLE.estimator, objective=APP_TABLE.objective, rate_grid=APP_TABLE.rate_grid)
    table = loss_table(dense, spec)
    windows = WindowSpec(data=APP_EVAL_WINDOWS.data, n_samples=args.eval_samples, seq_len=args.eval_seq_len)
    settings = EvalSettings(windows=windows, throughput=False, generations=0)
    compensated = CompensationSettings(mode=DEFAULT_COMPENSATION)
    lines = [
        f"# The takeaway at the explorer's defaults ({args.model})",
        "",
        f"Command: `{command_line(SCRIPT, script_argv(argv))}`",
        "",
        f"Loss table `{table.key}` ({spec.estimator}, {spec.objective}, {spec.windows.n_samples} x {spec.windows.seq_len} tokens of "
        f"{spec.windows.data}); held-out: {windows.n_samples} windows x {windows.seq_len} tokens of {windows.data} (report split), "
        f"the Prune & evaluate page's. Compensation: {DEFAULT_COMPENSATION} (the default) unless said. Brackets: 95% paired "
        "bootstrap intervals over the held-out windows (2,000 resamples).",
        "",
    ]
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / history.HISTORY_FILE
        for budget in budgets:
            dp = prune_and_evaluate(dense, settings, table=table, budget=budget, history_path=path, compensation=compensated)
            prune_and_evaluate(
                dense, settings, table=table, budget=budget, allocator="uniform", history_path=path, compensation=compensated
            )
            # The same plan without compensation (a plan made for none would spend the biases' budget on other rates).
            prune_and_evaluate(
                dense, settings, table=table, plan=RatePlan.from_dict(dp.plan), history_path=path, compensation=NO_COMPENSATION
            )
            records = history.runs(path)
            dp_run = dp.run_id
            said, twin = takeaway(records, dp_run), compensation_takeaway(records, dp_run)
            lines += [f"## {budget:.0%} of prunable parameters removed", "", f"- **Takeaway** ({said.verdict}): {said.text}"]
            lines += [f"- **Compensation** ({twin.verdict}): {twin.text}" if twin else "- **Compensation**: not measured", ""]
    lines.append(machine_line(load_start, started))
    write_report(args.name, lines, SCRIPT, script_argv(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
