"""Interaction: what the summed table predicts against what a plan measures, one-shot and iterative.

A loss table prices every component alone; a plan's true loss is more than the sum. For
each budget this benchmark prunes the default model with GAP's DP in one shot and in
``k`` rounds (``pipeline.iterative``: each round removes an equal share of the budget,
planned on a table of the model as the earlier rounds left it) and reports side by side:
every round's prediction against its measured objective (the round's model against the
one before it, on the calibration windows), the whole model's measured objective and NLL
increase against the dense model, held-out perplexity, and the time the rounds took.

    python bench/bench_interaction.py [--estimator fisher --objective kl --samples 16 --seq-len 256]
        [--budgets 0.2,0.3] [--rounds 1,2,3]
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse
import logging
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from report import add_eval_args, command_line, machine_line, script_argv, write_report

SCRIPT = "bench/bench_interaction.py"

from gap_engine.core.config import CLI_TABLE, WindowSpec
from gap_engine.core.progress import Hooks
from gap_engine.data.windows import calibration_windows
from gap_engine.evaluate.metrics import mean_nll
from gap_engine.model.loading import load_model
from gap_engine.pipeline.compare import heldout_sets
from gap_engine.pipeline.iterative import iterative_prune
from gap_engine.pipeline.stages import objective_increase
from gap_engine.tables.artefact import TableSpec, parse_rate_grid

log = logging.getLogger("bench_interaction")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--data", default=CLI_TABLE.windows.data)
    p.add_argument("--estimator", default=CLI_TABLE.estimator)
    p.add_argument("--objective", default=CLI_TABLE.objective)
    p.add_argument("--samples", type=int, default=CLI_TABLE.windows.n_samples)
    p.add_argument("--seq-len", type=int, default=CLI_TABLE.windows.seq_len)
    p.add_argument("--rates", default=",".join(f"{r:g}" for r in CLI_TABLE.rate_grid))
    p.add_argument("--budgets", default="0.2,0.3")
    p.add_argument("--rounds", default="1,2,3")
    add_eval_args(p)
    p.add_argument("--name", default="interaction", help="output: bench/results/<name>.md")
    return p


def parse_args(argv=None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    argv = script_argv(argv)
    command = command_line(SCRIPT, argv)
    load_start, started = os.getloadavg(), time.perf_counter()
    lm = load_model(args.model)
    windows_spec = WindowSpec(args.data, args.samples, args.seq_len, 0, batch_size=8)
    spec = TableSpec(windows=windows_spec, rate_grid=parse_rate_grid(args.rates), objective=args.objective, estimator=args.estimator)
    calib = calibration_windows(lm.tokenizer, windows_spec)
    heldout = heldout_sets(lm.tokenizer, WindowSpec(args.eval_data, args.eval_samples, args.eval_seq_len))
    sources = list(heldout)
    dense_nll = mean_nll(lm, calib, 8)
    dense_ppl = {s: math.exp(mean_nll(lm, ids, 8)) for s, ids in heldout.items()}
    summary, rounds_lines = [], []
    for budget in parse_rate_grid(args.budgets, "budgets"):
        for k in [int(x) for x in args.rounds.split(",") if x]:
            clock = time.perf_counter()
            result = iterative_prune(lm, spec, budget, k, hooks=Hooks(stage=log.info, message=log.info))
            seconds = time.perf_counter() - clock
            total = objective_increase(result.model, lm, calib, args.objective, 8)
            nll = mean_nll(result.model, calib, 8) - dense_nll
            ppl = {s: math.exp(mean_nll(result.model, ids, 8)) for s, ids in heldout.items()}
            gap = total - result.predicted_loss
            summary.append(
                f"| {budget:.0%} | {k} | {result.removed_fraction:.2%} | {result.predicted_loss:.4f} | {total:.4f} | "
                f"{gap:+.4f} ({gap / max(result.predicted_loss, 1e-12):+.0%}) | {nll:.4f} | "
                + " | ".join(f"{ppl[s]:.3f}" for s in sources)
                + f" | {seconds:.0f} s |"
            )
            log.info(summary[-1])
            for r in result.rounds:
                rounds_lines.append(
                    f"| {budget:.0%} | {k} | {r.index} | {r.budget:.2%} | {r.predicted:.4f} | {r.measured:.4f} | "
                    f"{(r.measured - r.predicted) / max(r.predicted, 1e-12):+.0%} |"
                )
    lines = [
        f"# Interaction: predicted against measured, one-shot and iterative DP: {args.model}",
        "",
        "```",
        command,
        "```",
        "",
        machine_line(load_start, started),
        "",
        f"Every round's table: {args.estimator}, objective {args.objective}, {args.data} calibration, {args.samples} x "
        f"{args.seq_len} tokens (seed 0), rates {args.rates}, criterion wanda; the same windows score the units and "
        f"measure the objective. 1 round is the one-shot DP plan. Held-out: {args.eval_samples} x {args.eval_seq_len} "
        f"tokens per source; dense " + ", ".join(f"{s} {dense_ppl[s]:.3f}" for s in sources) + ".",
        "",
        "## The whole plan",
        "",
        f"predicted: the rounds' summed table predictions; measured: {args.objective} of the pruned model against the "
        "dense one on the calibration windows; gap: measured - predicted; time: the rounds' table builds, planning "
        "and surgery (tables read from the cache count as read).",
        "",
        f"| budget | rounds | removed | predicted {args.objective} | measured {args.objective} | gap | calib. +NLL | "
        + " | ".join(f"ppl {s}" for s in sources)
        + " | time |",
        "|---:|---:|---:|---:|---:|---:|---:|" + "---:|" * len(sources) + "---:|",
        *summary,
        "",
        "## Every round",
        "",
        f"A round's prediction is its table's sum of cells on the model as the earlier rounds left it; measured is "
        f"that round's {args.objective} increase over the same model (for KL: the pruned model against the round's "
        "starting model, which is why the rounds do not add up to the whole plan's KL against the dense model).",
        "",
        "| budget | rounds | round | share of the model's prunable parameters | predicted | measured | gap |",
        "|---:|---:|---:|---:|---:|---:|---:|",
        *rounds_lines,
        "",
    ]
    write_report(args.name, lines, SCRIPT, argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
