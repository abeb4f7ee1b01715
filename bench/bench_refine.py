"""Refined tables against the full exact table, and how the gradient estimate prices attention.

For each calibration seed, on the same windows: the full exact table, the fisher estimate
and the refined tables (``estimator="refine"``: fisher, then exact cells where the DP's
plans go; optionally every attention cell too). Reported, side by side in one run:

1. build: wall and CPU seconds, cells measured, each against the exact table;
2. plans at every budget: the table's prediction, the measured objective on the
   calibration windows, the plan's loss read off the exact table (regret against the exact
   optimum) and held-out perplexity on every source; the noise is the difference between
   the exact tables of two seeds;
3. attention pricing: Spearman of the estimate against the exact cells per component type,
   and how far the estimate is off (median ratio estimate / exact).

    python bench/bench_refine.py [--samples 8 --seq-len 128 --seeds 0,1 --budgets 0.1,0.2,0.3,0.4]
        [--no-neighbours-seeds 0] [--all-attention-seeds 0]
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse
import logging
import sys
import time
from pathlib import Path

import numpy as np
from scipy.stats import spearmanr

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from report import add_eval_args, command_line, machine_line, script_argv, write_report

SCRIPT = "bench/bench_refine.py"

from gap_engine.core.config import QUICK_RATE_GRID, WindowSpec
from gap_engine.core.progress import Hooks
from gap_engine.data.windows import calibration_windows
from gap_engine.model.loading import load_model
from gap_engine.pipeline.compare import heldout_sets, measure_plan, reference_numbers
from gap_engine.pipeline.stages import loss_table
from gap_engine.plan.allocators import plan_from_table
from gap_engine.prune.importance import compute_importance
from gap_engine.tables.artefact import TableSpec, parse_rate_grid

log = logging.getLogger("bench_refine")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--data", default="wiki-sample")
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--seeds", default="0,1")
    p.add_argument("--rates", default=",".join(f"{r:g}" for r in QUICK_RATE_GRID))
    p.add_argument("--objective", default="kl")
    p.add_argument("--budgets", default="0.1,0.2,0.3,0.4")
    p.add_argument("--no-neighbours-seeds", default="0", help="seeds that also get refine without the neighbouring cells")
    p.add_argument("--all-attention-seeds", default="0", help="seeds that also get refine with every attention cell; empty: none")
    add_eval_args(p)
    p.add_argument("--name", default="refine", help="output: bench/results/<name>.md")
    return p


def parse_args(argv=None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def variants(args, seed: int) -> dict[str, dict]:
    budgets = parse_rate_grid(args.budgets, "budgets")
    out = {
        "exact": {"estimator": "exact"},
        "fisher": {"estimator": "fisher"},
        "refine": {"estimator": "refine", "refine_budgets": budgets},
    }
    if str(seed) in args.no_neighbours_seeds.split(","):
        out["refine, no neighbours"] = {"estimator": "refine", "refine_budgets": budgets, "refine_neighbours": 0}
    if str(seed) in args.all_attention_seeds.split(","):
        out["refine, all attention"] = {"estimator": "refine", "refine_budgets": budgets, "refine_attention": "all"}
    return out


def build(lm, spec: TableSpec, label: str):
    """The table (from the cache when there) and its build's wall and CPU seconds."""
    log.info("%s: building (or reading) the table", label)
    started = time.perf_counter()
    table = loss_table(lm, spec, hooks=Hooks(progress=lambda d, t, eta: log.info("%s: %d/%d", label, d, t) if d % 25 == 0 else None))
    log.info("%s: %.0f s here, recorded build %.0f s", label, time.perf_counter() - started, table.build_seconds)
    return table


def exact_cells_of(table, plan) -> list[tuple[int, int]]:
    return table.cells_for(plan.attention_rates, plan.mlp_rates)


def seed_section(lm, args, seed: int, heldout, sources) -> tuple[list[str], dict]:
    windows_spec = WindowSpec(args.data, args.samples, args.seq_len, seed, batch_size=8)
    budgets = parse_rate_grid(args.budgets, "budgets")
    grid = parse_rate_grid(args.rates)
    tables = {}
    for label, fields in variants(args, seed).items():
        spec = TableSpec(windows=windows_spec, rate_grid=grid, objective=args.objective, **fields)
        tables[label] = build(lm, spec, f"seed {seed} {label}")
    exact = tables["exact"]
    calib = calibration_windows(lm.tokenizer, windows_spec)
    scores = compute_importance(lm, calib, exact.spec.criterion, 8)
    reference = reference_numbers(lm, calib, heldout, 8)
    lines = [f"### Seed {seed}: {args.samples} x {args.seq_len} calibration tokens", "", "Build:", ""]
    lines += [
        "| table | wall | CPU | cells measured | of exact's | wall vs exact | CPU vs exact | rounds |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    n_distinct = exact.extras["distinct_cells"]
    for label, table in tables.items():
        cpu = table.extras.get("cpu_seconds", float("nan"))
        cells = {"exact": n_distinct, "fisher": 0}.get(label, table.extras.get("refined_cells", 0))
        lines.append(
            f"| {label} | {table.build_seconds:.0f} s | {cpu:.0f} s | {cells} | {cells / n_distinct:.0%} | "
            f"{table.build_seconds / exact.build_seconds:.1%} | {cpu / exact.extras['cpu_seconds']:.1%} | {table.extras.get('refine_rounds', '-')} |"
        )
    lines += [
        "",
        "Plans (DP on each table; KL in nats per token; regret: the plan's summed loss on the exact table minus the exact optimum):",
        "",
    ]
    lines += [
        "| budget | table | predicted | measured calib. KL | regret on exact | " + " | ".join(f"ppl {s}" for s in sources) + " |",
        "|---:|---|---:|---:|---:|" + "---:|" * len(sources),
    ]
    measured: dict = {}
    results: dict = {}
    for budget in budgets:
        optimum = None
        for label, table in tables.items():
            plan = plan_from_table(lm, table, budget)
            on_exact = float(sum(exact.losses()[cell] for cell in exact_cells_of(exact, plan)))
            optimum = on_exact if label == "exact" else optimum
            key = (tuple(plan.attention_rates), tuple(plan.mlp_rates))
            if key not in measured:
                log.info("seed %d %s at %.0f%%: pruning and measuring", seed, label, 100 * budget)
                measured[key] = measure_plan(lm, plan, windows_spec, calib, heldout, scores, reference, table)
            outcome = measured[key]
            results[budget, label] = outcome
            ppl = " | ".join(f"{outcome.perplexity[s]:.3f}" for s in sources)
            lines.append(
                f"| {budget:.0%} | {label} | {plan.predicted_loss:.4f} | {outcome.calib_objective_increase:.4f} | "
                f"{on_exact - optimum:.4f} | {ppl} |"
            )
    lines += ["", "Dense: " + ", ".join(f"{s} {reference.perplexity[s]:.3f}" for s in sources) + ".", ""]
    lines += pricing(exact, tables["fisher"])
    return lines, {"tables": tables, "results": results}


def pricing(exact, fisher) -> list[str]:
    lines = ["Attention pricing (fisher estimate against the exact cells, distinct cells that remove something):", ""]
    lines += [
        "| component | cells | Spearman | median estimate / exact | share under half the exact value | late layers (last third): median ratio |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    distinct = exact.removed > 0
    late = max(layer for layer, _ in exact.components) * 2 // 3
    for kind in ("attn", "mlp"):
        rows = np.array([k == kind for _, k in exact.components])
        late_rows = np.array([k == kind and layer >= late for layer, k in exact.components])
        mask = distinct & rows[:, None]
        truth, est = exact.delta[mask], fisher.delta[mask]
        ratio = est / np.maximum(truth, 1e-12)
        late_mask = distinct & late_rows[:, None]
        late_ratio = fisher.delta[late_mask] / np.maximum(exact.delta[late_mask], 1e-12)
        lines.append(
            f"| {kind} | {int(mask.sum())} | {spearmanr(truth, est)[0]:.3f} | {np.median(ratio):.2f} | "
            f"{float((ratio < 0.5).mean()):.0%} | {np.median(late_ratio):.2f} |"
        )
    return lines + [""]


def summary(args, per_seed: dict, sources) -> list[str]:
    seeds = sorted(per_seed)
    budgets = parse_rate_grid(args.budgets, "budgets")
    lines = ["## Summary", ""]
    if len(seeds) >= 2:
        a, b = seeds[:2]
        lines += [
            f"Noise: held-out perplexity of the exact table's plans from seed {a} and seed {b} (same held-out windows); "
            f"refine and fisher against the exact plan of their own seed.",
            "",
            "| budget | source | exact, seed-to-seed difference (noise) | "
            + " | ".join(f"|{label} - exact|, seed {s}" for s in (a, b) for label in ("refine", "fisher"))
            + " |",
            "|---:|---|---:|" + "---:|" * 4,
        ]
        for budget in budgets:
            for source in sources:
                ppl = {
                    (s, label): per_seed[s]["results"][budget, label].perplexity[source]
                    for s in (a, b)
                    for label in ("exact", "refine", "fisher")
                }
                noise = abs(ppl[a, "exact"] - ppl[b, "exact"])
                cells = [abs(ppl[s, label] - ppl[s, "exact"]) for s in (a, b) for label in ("refine", "fisher")]
                lines.append(f"| {budget:.0%} | {source} | {noise:.3f} | " + " | ".join(f"{c:.3f}" for c in cells) + " |")
        lines.append("")
    return lines


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    argv = script_argv(argv)
    command = command_line(SCRIPT, argv)
    load_start = os.getloadavg()
    started, cpu_started = time.perf_counter(), time.process_time()
    lm = load_model(args.model)
    eval_windows = WindowSpec(args.eval_data, args.eval_samples, args.eval_seq_len)
    heldout = heldout_sets(lm.tokenizer, eval_windows)
    sources = list(heldout)
    sections, per_seed = [], {}
    for seed in [int(s) for s in args.seeds.split(",") if s]:
        lines, per_seed[seed] = seed_section(lm, args, seed, heldout, sources)
        sections += lines
    header = [
        f"# Refined tables against the full exact table: {args.model}",
        "",
        "```",
        command,
        "```",
        "",
        machine_line(load_start, started) + f" CPU time of the run: {time.process_time() - cpu_started:.0f} s. "
        "Tables read from the cache keep the times of their build.",
        "",
        f"Tables: objective {args.objective}, {args.data} calibration, {args.samples} x {args.seq_len} tokens, rates "
        f"{args.rates}, criterion wanda, split mode; refine measures the cells of the DP plans at {args.budgets} and "
        f"one distinct cut on each side (no neighbours, seeds {args.no_neighbours_seeds or 'none'}: the chosen cells only; "
        f"all attention, seeds {args.all_attention_seeds or 'none'}: every attention cell too). Held-out: {args.eval_samples} x {args.eval_seq_len} tokens of "
        f"{', '.join(sources)}.",
        "",
    ]
    write_report(args.name, header + summary(args, per_seed, sources) + ["## Per seed", ""] + sections, SCRIPT, argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
