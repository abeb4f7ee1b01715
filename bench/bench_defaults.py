"""The evidence behind the table defaults: objective and calibration tokens of the fast table.

For the default model, builds the gradient-estimate table (fisher) with the old default
objective (NLL) and with KL to the dense model, on several calibration sizes and seeds,
and measures what each table's DP plans give on held-out text. Reported side by side: the
build's wall and CPU seconds (with the load average: the machine is shared) and the
held-out perplexity of the plans at each budget, per seed and averaged. The default is
the size whose plans are best among those that build in about 2-3 minutes on 2 cores.

    python bench/bench_defaults.py [--sizes nll:8x128,kl:8x128,kl:16x128,kl:16x256,kl:32x256]
        [--seeds 0,1] [--budgets 0.1,0.2,0.3]
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

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from report import add_eval_args, command_line, machine_line, script_argv, write_report

SCRIPT = "bench/bench_defaults.py"

from gap_engine.core.config import QUICK_RATE_GRID, WindowSpec
from gap_engine.data.windows import calibration_windows
from gap_engine.evaluate.metrics import mean_nll
from gap_engine.model.loading import load_model
from gap_engine.pipeline.compare import heldout_sets
from gap_engine.pipeline.stages import loss_table, pruned_as_saved
from gap_engine.plan.allocators import plan_from_table
from gap_engine.prune.importance import compute_importance
from gap_engine.tables.artefact import TableSpec, parse_rate_grid

log = logging.getLogger("bench_defaults")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--data", default="wiki-sample")
    p.add_argument("--estimator", default="fisher")
    p.add_argument("--sizes", default="nll:8x128,kl:8x128,kl:16x128,kl:16x256,kl:32x256", help="objective:windowsxtokens, comma-separated")
    p.add_argument("--seeds", default="0,1")
    p.add_argument("--rates", default=",".join(f"{r:g}" for r in QUICK_RATE_GRID))
    p.add_argument("--budgets", default="0.1,0.2,0.3")
    add_eval_args(p)
    p.add_argument("--name", default="defaults", help="output: bench/results/<name>.md")
    return p


def parse_args(argv=None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def sizes(text: str) -> list[tuple[str, int, int]]:
    out = []
    for item in text.split(","):
        objective, _, shape = item.partition(":")
        n, _, t = shape.partition("x")
        out.append((objective, int(n), int(t)))
    return out


def held_out(lm, plan, windows_spec, scores, heldout, seen: dict) -> dict[str, float]:
    """Held-out perplexity per source of the model pruned with ``plan`` (measured once per distinct plan)."""
    key = (tuple(plan.attention_rates), tuple(plan.mlp_rates), windows_spec)
    if key not in seen:
        pruned, _ = pruned_as_saved(lm, plan, windows_spec, scores=scores, save_dtype="float32")  # float32, as the recorded results
        seen[key] = {source: math.exp(mean_nll(pruned, ids, 8)) for source, ids in heldout.items()}
    return seen[key]


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    argv = script_argv(argv)
    command = command_line(SCRIPT, argv)
    load_start, started = os.getloadavg(), time.perf_counter()
    lm = load_model(args.model)
    heldout = heldout_sets(lm.tokenizer, WindowSpec(args.eval_data, args.eval_samples, args.eval_seq_len))
    sources = list(heldout)
    dense = {source: math.exp(mean_nll(lm, ids, 8)) for source, ids in heldout.items()}
    budgets = parse_rate_grid(args.budgets, "budgets")
    seeds = [int(s) for s in args.seeds.split(",") if s]
    rows, per_seed, seen = [], [], {}
    for objective, n, t in sizes(args.sizes):
        builds, ppl = [], {(b, s): [] for b in budgets for s in sources}
        for seed in seeds:
            windows_spec = WindowSpec(args.data, n, t, seed, batch_size=4)
            spec = TableSpec(windows=windows_spec, rate_grid=parse_rate_grid(args.rates), objective=objective, estimator=args.estimator)
            load = os.getloadavg()[0]
            table = loss_table(lm, spec)
            builds.append((table.build_seconds, table.extras.get("cpu_seconds", float("nan")), load))
            scores = compute_importance(lm, calibration_windows(lm.tokenizer, windows_spec), spec.criterion, 4)
            for budget in budgets:
                plan = plan_from_table(lm, table, budget)
                result = held_out(lm, plan, windows_spec, scores, heldout, seen)
                for source in sources:
                    ppl[budget, source].append(result[source])
                per_seed.append(
                    f"| {objective} | {n} x {t} | {seed} | {budget:.0%} | {plan.predicted_loss:.4f} | "
                    + " | ".join(f"{result[s]:.3f}" for s in sources)
                    + " |"
                )
                log.info(per_seed[-1])
        wall, cpu, load = (float(np.mean(x)) for x in zip(*builds))
        cells = " | ".join(f"{np.mean(ppl[b, s]):.2f}" for b in budgets for s in sources)
        rows.append(f"| {objective} | {n} x {t} = {n * t} | {wall:.0f} s | {cpu:.0f} s | {load:.1f} | {cells} |")
    lines = [
        f"# Table defaults from evidence: {args.model}",
        "",
        "```",
        command,
        "```",
        "",
        machine_line(load_start, started),
        "",
        f"Every table: {args.estimator} estimate, {args.data} calibration, rates {args.rates}, criterion wanda, split mode. "
        f"Plans: GAP's DP on the table at each budget, pruned for real (the table's own windows score the units). "
        f"Held-out: {args.eval_samples} x {args.eval_seq_len} tokens per source, never overlapping calibration text; "
        f"dense perplexity " + ", ".join(f"{s} {dense[s]:.3f}" for s in sources) + ". Build times are the "
        f"mean over seeds {args.seeds} of wall and of this process's CPU seconds, with the 1-minute load average at "
        f"the build's start; a table read from the cache keeps the times of its build.",
        "",
        "## Mean held-out perplexity over seeds",
        "",
        "| objective | windows x tokens | build wall | build CPU | load | "
        + " | ".join(f"{b:.0%} {s}" for b in budgets for s in sources)
        + " |",
        "|---|---|---:|---:|---:|" + "---:|" * (len(budgets) * len(sources)),
        *rows,
        "",
        "## Per seed",
        "",
        "| objective | windows x tokens | seed | budget | predicted | " + " | ".join(f"ppl {s}" for s in sources) + " |",
        "|---|---|---:|---:|---:|" + "---:|" * len(sources),
        *per_seed,
        "",
    ]
    write_report(args.name, lines, SCRIPT, argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
