"""Quality benchmark of the allocators at equal budget, on a real model.

Builds (or reads from the cache) a loss table of the model with the default settings of
the command line (``config.CLI_TABLE``; every one can be overridden), then for every
budget and allocator makes a plan, prunes a copy of the model with it (same within-layer
criterion and calibration windows for every allocator) and measures, through
``pipeline.compare``: parameters removed, the table's prediction and what it rests on
(measured or estimated cells), the same objective measured on the calibration windows,
the calibration NLL increase, and held-out perplexity on each source. GAP's DP is also
run restricted to MLP channels (attention kept dense), the reference a table that
misprices attention loses to. Optionally runs the evolutionary refinement of the DP plan
at one budget. Writes a CSV and a markdown report. Targets: at 20%,
(DP perplexity - dense) / (uniform perplexity - dense) <= 0.15, and DP never worse than
its MLP-only plan.

    python bench/bench_quality.py [--model smollm2-135m] [--estimator refine --objective kl
        --samples 16 --seq-len 256 --rates 0,0.125,...] [--budgets 0.1,0.2,0.3,0.4,0.5]
        [--allocators dp,uniform,flap,owl] [--evo-budgets 0.2] [--name quality] [--resume]

An interrupted run keeps what it measured in the CSV (written after the allocators, again
after evo); ``--resume`` with the same settings measures only the plans that are missing.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import logging
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from report import RESULTS, add_eval_args, machine_line

from gap_engine.cli.output import csv_text
from gap_engine.core.config import CLI_TABLE, WindowSpec
from gap_engine.core.fsutil import atomic_write_text
from gap_engine.core.progress import Hooks
from gap_engine.data.windows import calibration_windows
from gap_engine.model.loading import load_model
from gap_engine.pipeline import compare
from gap_engine.pipeline.compare import Outcome, heldout_sets, measure_plan, reference_numbers
from gap_engine.pipeline.stages import loss_table
from gap_engine.plan.allocators import plan_from_table
from gap_engine.plan.evo import EvoSettings
from gap_engine.plan.problem import Constraints
from gap_engine.prune.importance import compute_importance
from gap_engine.tables.artefact import LossTable, TableSpec, parse_rate_grid

log = logging.getLogger("bench_quality")
TARGET_RATIO = 0.15
MLP_ONLY = "dp, MLP only"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--data", default=CLI_TABLE.windows.data, help="calibration text of the table")
    p.add_argument("--estimator", default=CLI_TABLE.estimator)
    p.add_argument("--objective", default=CLI_TABLE.objective)
    p.add_argument("--samples", type=int, default=CLI_TABLE.windows.n_samples, help="calibration windows of the table")
    p.add_argument("--seq-len", type=int, default=CLI_TABLE.windows.seq_len, help="tokens per calibration window")
    p.add_argument("--rates", default=",".join(f"{r:g}" for r in CLI_TABLE.rate_grid), help="the table's rate grid")
    p.add_argument("--criterion", default="wanda")
    p.add_argument("--budgets", default="0.1,0.2,0.3,0.4,0.5")
    p.add_argument("--allocators", default="dp,uniform,flap,owl")
    p.add_argument("--mlp-only", action=argparse.BooleanOptionalAction, default=True, help="also DP restricted to MLP channels")
    p.add_argument("--evo-budgets", default="0.2", help="budgets for the evo refinement, comma-separated; empty: skip")
    p.add_argument("--evo-generations", type=int, default=4)
    p.add_argument("--evo-offspring", type=int, default=4)
    add_eval_args(p)
    p.add_argument("--lock", default="", help="layers kept dense, e.g. 0,29 (none by default)")
    p.add_argument("--name", default="quality", help="output files: bench/results/<name>.md and .csv")
    p.add_argument(
        "--resume",
        action="store_true",
        help="keep the plans already in <name>.csv (same settings: the caller's word) and measure only the missing ones",
    )
    return p.parse_args(argv)


def mlp_only(table: LossTable) -> LossTable:
    """The table with every attention rate above 0 made useless to the DP (removes nothing, costs a lot)."""
    attention = np.array([kind == "attn" for _, kind in table.components])[:, None] & (np.arange(len(table.rate_grid)) > 0)[None, :]
    removed = np.where(attention, 0, table.removed)
    losses = np.where(attention, 1e6, table.losses())
    return dataclasses.replace(table, removed=removed, smoothed=losses, delta=np.where(attention, 1e6, table.delta))


def earlier_outcomes(path: Path, objective: str) -> dict[tuple[str, float], Outcome]:
    """(allocator, budget) -> Outcome of an earlier, interrupted run's CSV in the same objective."""
    if not path.exists():
        return {}
    with path.open(newline="") as f:
        rows = [Outcome.from_row(row) for row in csv.DictReader(f)]
    return {(o.allocator, round(o.budget, 6)): o for o in rows if o.objective == objective}


def missing(done: dict, allocators: list[str], budgets: list[float]) -> dict[tuple[str, ...], list[float]]:
    """Allocators still to run -> the budgets they are missing at (grouped so each group is one compare call)."""
    groups: dict[tuple[str, ...], list[float]] = {}
    for budget in budgets:
        todo = tuple(a for a in allocators if (a, round(budget, 6)) not in done)
        if todo:
            groups.setdefault(todo, []).append(budget)
    return groups


def mlp_only_outcomes(lm, table, budgets, heldout, constraints) -> list[Outcome]:
    """GAP's DP restricted to MLP channels, pruned and measured like every allocator."""
    calib_spec = table.spec.windows
    windows = calibration_windows(lm.tokenizer, calib_spec)
    scores = compute_importance(lm, windows, table.spec.criterion, calib_spec.batch_size)
    reference = reference_numbers(lm, windows, heldout, calib_spec.batch_size)
    restricted = mlp_only(table)
    out = []
    for budget in budgets:
        started = time.perf_counter()
        plan = plan_from_table(lm, restricted, budget, "dp", constraints)
        assert not any(plan.attention_rates), "the MLP-only plan took attention heads"
        outcome = measure_plan(lm, plan, calib_spec, windows, heldout, scores, reference, table)
        outcome.allocator = MLP_ONLY
        outcome.extras = {"seconds": round(time.perf_counter() - started, 1)}
        out.append(outcome)
        log.info("%s at %.0f%%: %s", MLP_ONLY, 100 * budget, outcome.perplexity)
    return out


def write_csv(outcomes: list[Outcome], path: Path) -> None:
    atomic_write_text(path, csv_text([o.row() for o in outcomes]))


def ratio(dp: Outcome, uniform: Outcome, source: str) -> float:
    dense = dp.dense_perplexity[source]
    return (dp.perplexity[source] - dense) / (uniform.perplexity[source] - dense)


def settings_lines(args, table: LossTable, sources, dense: Outcome) -> list[str]:
    measured = int(table.measured_cells()[table.removed > 0].sum())
    return [
        "## Settings",
        "",
        f"- Loss table: estimator {table.spec.estimator}, objective {table.spec.objective}, split attention/MLP, "
        f"{table.spec.windows.data} calibration, {table.spec.windows.n_samples} windows x {table.spec.windows.seq_len} "
        f"tokens (windows start with {table.window_start}), criterion {table.spec.criterion}, rate grid "
        f"{', '.join(f'{r:g}' for r in table.rate_grid)} ({len(table.components)} components x {len(table.rate_grid)} rates); "
        f"{measured} of {int((table.removed > 0).sum())} cells measured exactly, the rest estimated; its build took "
        f"{table.build_seconds:.0f} s wall, {table.extras.get('cpu_seconds', float('nan')):.0f} s CPU.",
        f"- Every allocator prunes the same units inside a layer (the table's criterion on the same calibration "
        f"windows); only the per-layer rates differ. Budgets are fractions of the {table.dense_prunable:,} prunable "
        f"parameters (all attention and MLP projections). '{MLP_ONLY}' is GAP's DP with every attention kept dense.",
        f"- predicted: the table's sum of single-component {table.spec.objective} increases (from measured, "
        f"estimated or mixed cells); measured: the same objective with the whole plan applied, on the table's "
        f"calibration windows; calib. +NLL: the calibration NLL increase. Held-out perplexity: {args.eval_samples} "
        f"windows x {args.eval_seq_len} tokens per source ({', '.join(sources)}), never overlapping calibration text.",
        f"- Dense: calibration NLL {dense.dense_calib_loss:.4f}; perplexity "
        + ", ".join(f"{s} {dense.dense_perplexity[s]:.3f}" for s in sources)
        + ".",
        "",
    ]


def results_lines(outcomes, sources, objective) -> list[str]:
    lines = [
        "## Results",
        "",
        f"| budget | allocator | removed (of prunable) | predicted {objective} | from cells | measured {objective} | "
        "calib. +NLL | " + " | ".join(f"ppl {s}" for s in sources) + " |",
        "|---:|---|---:|---:|---|---:|---:|" + "---:|" * len(sources),
    ]
    for o in sorted(outcomes, key=lambda o: (round(o.budget, 6), o.allocator != "dp")):
        predicted = f"{o.predicted_loss:.4f}" if o.predicted_loss is not None else "-"
        measured = f"{o.calib_objective_increase:.4f}" if o.calib_objective_increase is not None else "-"
        ppl = " | ".join(f"{o.perplexity[s]:.3f}" for s in sources)
        lines.append(
            f"| {o.budget:.0%} | {o.allocator} | {o.removed:,} ({o.removed_fraction:.2%}) | {predicted} | "
            f"{o.predicted_basis or '-'} | {measured} | {o.calib_loss_increase:.4f} | {ppl} |"
        )
    return lines


def target_lines(outcomes, sources) -> list[str]:
    by_key = {(round(o.budget, 6), o.allocator): o for o in outcomes}
    budgets = sorted({round(o.budget, 6) for o in outcomes})
    lines = ["", "## DP against uniform", ""]
    lines.append(f"Ratio = (DP perplexity - dense) / (uniform perplexity - dense); target <= {TARGET_RATIO} at 20%.")
    lines += [
        "",
        "| budget | " + " | ".join(f"ratio {s}" for s in sources) + " | calib. NLL ratio |",
        "|---:|" + "---:|" * (len(sources) + 1),
    ]
    for budget in budgets:
        dp, uni = by_key.get((budget, "dp")), by_key.get((budget, "uniform"))
        if dp is not None and uni is not None:
            cells = " | ".join(f"{ratio(dp, uni, s):.3f}" for s in sources)
            lines.append(f"| {budget:.0%} | {cells} | {dp.calib_loss_increase / uni.calib_loss_increase:.3f} |")
    losses = []
    for budget in budgets:
        dp = by_key.get((budget, "dp"))
        for o in outcomes:
            if dp is None or round(o.budget, 6) != budget or o.allocator in ("dp", "evo"):
                continue
            worse = [s for s in sources if o.perplexity[s] < dp.perplexity[s]]
            if worse:
                losses.append(
                    f"- {budget:.0%}: {o.allocator} beats dp on "
                    + ", ".join(f"{s} ({o.perplexity[s]:.3f} vs {dp.perplexity[s]:.3f})" for s in worse)
                )
    lines += [
        "",
        f"## Where DP loses to a baseline or to its own MLP-only plan (held-out perplexity; target: nowhere against '{MLP_ONLY}')",
        "",
    ]
    return lines + (losses or ["- nowhere in this run."])


def evo_lines(args, evos: list[Outcome]) -> list[str]:
    objective = evos[0].objective
    lines = [
        "",
        "## Evolutionary refinement of the DP plan",
        "",
        f"{args.evo_generations} generations x {args.evo_offspring} offspring, scored by the true calibration NLL "
        f"(units zero-masked on the dense model, equal to slicing), starting from the DP plan. DP predicted: the "
        f"table's sum of cells ({objective}); the other columns are calibration NLL increases except the last "
        f"(evo's measured {objective}). Gain: how much lower evo's calibration NLL is than the DP plan's.",
        "",
        f"| budget | plans scored | time | DP predicted ({objective}) | DP calib. +NLL | evo calib. +NLL | gain | evo measured {objective} |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for evo in evos:
        x = evo.extras
        lines.append(
            f"| {evo.budget:.0%} | {x['evo_evaluations']} | {x['seconds']:.0f} s | {x['dp_predicted']:.4f} | "
            f"{x['dp_actual']:.4f} | {x['evo_actual']:.4f} | {x['dp_actual'] - x['evo_actual']:.4f} | {evo.calib_objective_increase:.4f} |"
        )
    return lines


def markdown(args, command, table, outcomes, evos, sources, machine: str, kept: int) -> str:
    lines = [
        f"# Allocation quality at equal budget: {args.model}",
        "",
        "Generated by `bench/bench_quality.py`:",
        "",
        "```",
        command,
        "```",
        "",
        machine,
        "",
    ]
    if kept:
        lines += [
            f"Resumed: {kept} of the {len(outcomes)} plans below were read from the CSV of an earlier run with the "
            "same settings that was interrupted (their seconds are that run's); the time above is this run's.",
            "",
        ]
    lines += settings_lines(args, table, sources, outcomes[0])
    lines += results_lines(outcomes, sources, table.spec.objective)
    lines += target_lines(outcomes, sources)
    if evos:
        lines += evo_lines(args, evos)
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stdout)
    command = " ".join(["python bench/bench_quality.py", *(sys.argv[1:] if argv is None else argv)])
    load_start, started = os.getloadavg(), time.perf_counter()
    budgets = [float(b) for b in args.budgets.split(",") if b]
    allocators = [m for m in args.allocators.split(",") if m]
    constraints = Constraints(locked={int(x): 0.0 for x in args.lock.split(",") if x})
    csv_path, md_path = RESULTS / f"{args.name}.csv", RESULTS / f"{args.name}.md"

    lm = load_model(args.model)
    windows = WindowSpec(data=args.data, n_samples=args.samples, seq_len=args.seq_len, batch_size=8)
    spec = TableSpec(
        windows=windows, criterion=args.criterion, rate_grid=parse_rate_grid(args.rates), estimator=args.estimator, objective=args.objective
    )
    table = loss_table(lm, spec, hooks=Hooks(progress=lambda d, t, eta: log.info("table step %d/%d", d, t) if d % 20 == 0 else None))
    heldout = heldout_sets(lm.tokenizer, WindowSpec(data=args.eval_data, n_samples=args.eval_samples, seq_len=args.eval_seq_len))
    done = earlier_outcomes(csv_path, table.spec.objective) if args.resume else {}
    earlier = set(done)
    if done:
        log.info("%d plans kept from %s", len(done), csv_path)
    for todo, at in missing(done, allocators, budgets).items():
        for outcome in compare(lm, table, at, list(todo), heldout, constraints, hooks=Hooks(message=log.info)):
            done[outcome.allocator, round(outcome.budget, 6)] = outcome
    if args.mlp_only:
        todo = [b for b in budgets if (MLP_ONLY, round(b, 6)) not in done]
        for outcome in mlp_only_outcomes(lm, table, todo, heldout, constraints) if todo else []:
            done[MLP_ONLY, round(outcome.budget, 6)] = outcome
    outcomes: list[Outcome] = [done[a, round(b, 6)] for b in budgets for a in allocators]
    outcomes += [done[MLP_ONLY, round(b, 6)] for b in budgets] if args.mlp_only else []
    write_csv(outcomes, csv_path)
    evos = []
    settings = EvoSettings(generations=args.evo_generations, offspring=args.evo_offspring)
    for budget in [float(b) for b in args.evo_budgets.split(",") if b]:
        evo = done.get(("evo", round(budget, 6)))
        if evo is None:
            evo = compare(lm, table, [budget], ["evo"], heldout, constraints, settings, Hooks(message=log.info))[0]
        evos.append(evo)
        write_csv(outcomes + evos, csv_path)  # after each: a resumed run keeps it
    outcomes += evos
    kept = sum((o.allocator, round(o.budget, 6)) in earlier for o in outcomes)
    atomic_write_text(md_path, markdown(args, command, table, outcomes, evos, list(heldout), machine_line(load_start, started), kept))
    log.info("wrote %s and %s", md_path, csv_path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
