"""Tables that know compensation follows: are their plans better once the cut is compensated?

Builds two loss tables of the same settings (estimator, windows, rate grid), one whose cells
are measured plainly and one whose cells are measured with the cut block compensated
(``TableSpec.compensation``: the cell's loss is that of what surgery with that compensation
ships), plans GAP's DP at each budget from each, prunes every plan with the same compensation
(and, for reference, without), and measures held-out KL to dense, perplexity and top-1 on both
built-in texts against the dense model's log-probabilities (computed once). Both tables are
cached (a second run reads them), so an interrupted run resumes its measured cells.

    python bench/bench_compensated_tables.py [--compensate refit] [--estimator exact] [--samples 6 --seq-len 256]
        [--rates 0,0.25,0.5,0.75] [--budgets 0.2,0.4] [--name compensated_tables]

Exact cells are expensive on two CPU cores: the defaults (6 x 256 tokens, the fewest a refit of
SmolLM2's 1,536 MLP channels allows, and a grid in quarters) keep one table near an hour there.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_compensation import dense_reference, measure
from report import add_eval_args, command_line, machine_line, script_argv, write_report

SCRIPT = "bench/bench_compensated_tables.py"

from gap_engine.core.config import WindowSpec
from gap_engine.data.windows import calibration_windows
from gap_engine.model.loading import load_model
from gap_engine.pipeline.compare import heldout_sets
from gap_engine.pipeline.stages import loss_table
from gap_engine.plan.allocators import plan_from_table
from gap_engine.prune.compensation_pass import prune_compensated
from gap_engine.prune.compensations import NO_COMPENSATION, CompensationSettings
from gap_engine.prune.importance import compute_importance
from gap_engine.tables.artefact import TableSpec, parse_rate_grid

log = logging.getLogger("bench_compensated_tables")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--compensate", default="refit")
    p.add_argument("--estimator", default="exact")
    p.add_argument("--objective", default="kl")
    p.add_argument("--samples", type=int, default=6)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--rates", default="0,0.25,0.5,0.75")
    p.add_argument("--budgets", default="0.2,0.4")
    add_eval_args(p)
    p.add_argument("--name", default="compensated_tables", help="output file: bench/results/<name>.md")
    return p


def parse_args(argv=None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def main(argv=None) -> int:
    argv = script_argv(argv)
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    load_start, started = os.getloadavg(), time.perf_counter()
    dense = load_model(args.model)
    windows = WindowSpec(n_samples=args.samples, seq_len=args.seq_len)
    base = dict(windows=windows, rate_grid=parse_rate_grid(args.rates), objective=args.objective, estimator=args.estimator)
    compensation = CompensationSettings(mode=args.compensate).validate()
    tables = {}
    for kind, mode in (("plain cells", "none"), (f"cells with {compensation.mode}", compensation.mode)):
        table_load = os.getloadavg()[0]
        tables[kind] = loss_table(dense, TableSpec(**base, compensation=mode).validate())
        log.info("%s table %s: %.0f s (load %.1f)", kind, tables[kind].key, tables[kind].build_seconds, table_load)
    ids = calibration_windows(dense.tokenizer, windows)
    scores = compute_importance(dense, ids, "wanda", windows.batch_size)
    heldout = heldout_sets(dense.tokenizer, WindowSpec(data=args.eval_data, n_samples=args.eval_samples, seq_len=args.eval_seq_len))
    reference = dense_reference(dense, heldout)
    rows = []
    for budget in [float(b) for b in args.budgets.split(",")]:
        for kind, table in tables.items():
            plan = plan_from_table(dense, table, budget, "dp")
            for pruned_with in (compensation, NO_COMPENSATION):
                pruned = dense.copy()
                prune_compensated(pruned, plan, scores, windows, pruned_with)
                row = {"budget": budget, "table": kind, "pruned with": pruned_with.mode, "predicted": plan.predicted_loss}
                rows.append(row | measure(pruned, reference))
                log.info("%s", rows[-1])
                del pruned
    write_report(args.name, report_lines(args, argv, tables, rows, list(heldout), load_start, started), SCRIPT, argv)
    return 0


def report_lines(args, argv, tables, rows, sources, load_start, started) -> list[str]:
    command = command_line(SCRIPT, argv)
    lines = [
        f"# Tables that know compensation follows: {args.model}",
        "",
        f"Generated by `bench/bench_compensated_tables.py`:\n\n```\n{command}\n```",
        "",
        machine_line(load_start, started),
        "",
        f"Both tables: {args.estimator} cells of {args.objective} on {args.samples} x {args.seq_len} tokens of wiki-sample, rates "
        f"{args.rates}, criterion wanda; one measures every cell plainly, the other with the cut block compensated "
        f"({args.compensate}). Build times: "
        + "; ".join(f"{kind} {t.build_seconds:.0f} s ({t.extras.get('cpu_seconds', float('nan')):.0f} CPU s)" for kind, t in tables.items())
        + f". Each DP plan is pruned with {args.compensate} and without; held-out: {args.eval_samples} windows x "
        f"{args.eval_seq_len} tokens per source, KL per token against the dense model.",
        "",
        "| budget | table | pruned with | predicted | " + " | ".join(f"KL {s} | ppl {s} | top-1 {s}" for s in sources) + " |",
        "|---:|---|---|---:|" + "---:|---:|---:|" * len(sources),
    ]
    for row in rows:
        cells = " | ".join(f"{row[f'kl_{s}']:.4f} | {row[f'ppl_{s}']:.2f} | {row[f'top1_{s}']:.3f}" for s in sources)
        lines.append(f"| {row['budget']:.0%} | {row['table']} | {row['pruned with']} | {row['predicted']:.4f} | {cells} |")
    if rows:
        lines += ["", "Dense perplexity: " + ", ".join(f"{s} {rows[0][f'dense_ppl_{s}']:.2f}" for s in sources) + "."]
    return lines


if __name__ == "__main__":
    sys.exit(main())
