"""Refinement settings, replayed on finished exact tables: how many cells, how good the plans.

A refined table's rounds decide only from the estimate and the cells measured so far
(``tables.refine.refinement_rounds``), so replaying them against a full exact table on the
same windows gives exactly the cells a real build would measure, without measuring again
(tests/tables/test_refine.py checks the replay against a real build). For every setting this
reports the cells measured (count, and their share of the exact build's cost: a cell of
layer i runs blocks i..L-1 and the LM head) and, at every budget, the regret of the refined
table's DP plan on the exact table (its summed exact loss minus the exact optimum; 0 means
the exact table's plan). Reads the exact and fisher tables from the cache (bench_refine.py
builds them); only the importance scores are computed here.

    python bench/bench_refine_whatif.py [--samples 8 --seq-len 128 --rates 0,0.25,0.5,0.75 --seeds 0,1]
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse
import dataclasses
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from report import command_line, machine_line, script_argv, write_report

SCRIPT = "bench/bench_refine_whatif.py"

from gap_engine.core.config import WindowSpec
from gap_engine.data.windows import calibration_fingerprint, calibration_windows
from gap_engine.model.loading import load_model
from gap_engine.plan.allocators import plan_from_table
from gap_engine.prune.importance import compute_importance
from gap_engine.tables import cache
from gap_engine.tables.artefact import TableSpec, isotonic_smooth, parse_rate_grid, table_key
from gap_engine.tables.cells import distinct_cuts, unit_cuts
from gap_engine.tables.refine import RefineProblem, current_objective, refinement_rounds

SETTINGS = [
    {"refine_neighbours": 0},
    {"refine_neighbours": 1},
    {"refine_neighbours": 2},
    {"refine_neighbours": 0, "refine_attention": "all"},
    {"refine_neighbours": 1, "refine_attention": "all"},
    {"refine_neighbours": 1, "refine_budgets": (0.2,)},
    {"refine_neighbours": 0, "refine_budgets": (0.1, 0.2, 0.3, 0.4, 0.5)},
]


def cached(lm, spec: TableSpec):
    key = table_key(lm, spec, calibration_fingerprint(spec.windows))
    table = cache.get_table(key)
    if table is None:
        raise SystemExit(f"no cached table {key}: run bench/bench_refine.py with the same settings first")
    return table


def regret(lm, table, exact, budget: float) -> float:
    plan = plan_from_table(lm, table, budget)
    losses = exact.losses()
    chosen = exact.cells_for(plan.attention_rates, plan.mlp_rates)
    optimum = plan_from_table(lm, exact, budget).predicted_loss
    return float(sum(losses[cell] for cell in chosen)) - optimum


def base_spec(args, seed: int) -> TableSpec:
    windows = WindowSpec(args.data, args.samples, args.seq_len, seed, batch_size=8)
    return TableSpec(windows=windows, rate_grid=parse_rate_grid(args.rates), objective=args.objective)


def seed_rows(lm, args, seed: int, budgets, exact_tables: dict) -> list[str]:
    """This seed's rows; ``exact_tables``: seed -> exact table (the other seeds' give the noise rows)."""
    base = base_spec(args, seed)
    exact = exact_tables[seed]
    others = {s: t for s, t in exact_tables.items() if s != seed}
    fisher = cached(lm, dataclasses.replace(base, estimator="fisher"))
    scores = compute_importance(lm, calibration_windows(lm.tokenizer, base.windows), base.criterion, 8)
    jobs, owner = distinct_cuts(unit_cuts(lm, scores, exact.components, base.rate_grid, base.channel_multiple))
    head = lm.adapter.lm_head(lm.model)
    block = sum(p.numel() for p in lm.adapter.layers(lm.model)[0].parameters())
    cost = {(c, r): lm.num_layers - cut.layer + head.in_features * head.out_features / block for c, r, cut in jobs}
    total_cost = sum(cost.values())
    problem = RefineProblem(
        fisher.delta, owner, exact.removed, exact.dense_prunable, tuple(k for _, k in exact.components), exact.dense_objective
    )
    rows = [
        f"| {seed} | fisher (nothing measured) | 0 | 0% | - | " + " | ".join(f"{regret(lm, fisher, exact, b):.4f}" for b in budgets) + " |"
    ]
    for other_seed, other in others.items():  # noise: another seed's exact plans, scored on this seed's exact table
        rows.append(
            f"| {seed} | noise: seed {other_seed}'s exact plans | - | - | - | "
            + " | ".join(f"{regret(lm, other, exact, b):.4f}" for b in budgets)
            + " |"
        )
    # The least any refinement can measure and still end with the exact table's plans resting
    # on measured cells: the cells those plans use (search for them costs more on top).
    plans = [plan_from_table(lm, exact, b) for b in budgets]
    needed = {owner[cell] for plan in plans for cell in exact.cells_for(plan.attention_rates, plan.mlp_rates)} - {None}
    rows.append(
        f"| {seed} | bound: only the exact plans' own cells | {len(needed)} of {len(jobs)} | {sum(cost[c] for c in needed) / total_cost:.0%} | - | "
        + " | ".join("0" for _ in budgets)
        + " |"
    )
    for setting in SETTINGS:
        spec = dataclasses.replace(base, estimator="refine", **({"refine_budgets": budgets} | setting))
        measured, rounds = refinement_rounds(
            problem, spec, lambda todo, m: m.update({cell: float(exact.cell_objective[cell]) for cell in todo})
        )
        objective = current_objective(exact.dense_objective, fisher.delta, owner, measured)
        delta = objective - exact.dense_objective
        refined = dataclasses.replace(exact, delta=delta, smoothed=isotonic_smooth(delta), cell_objective=objective)
        share = sum(cost[cell] for cell in measured) / total_cost
        label = ", ".join(f"{k.removeprefix('refine_')}={v}" for k, v in setting.items())
        rows.append(
            f"| {seed} | {label} | {len(measured)} of {len(jobs)} | {share:.0%} | {rounds} | "
            + " | ".join(f"{regret(lm, refined, exact, b):.4f}" for b in budgets)
            + " |"
        )
    return rows


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--data", default="wiki-sample")
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--rates", default="0,0.25,0.5,0.75")
    parser.add_argument("--objective", default="kl")
    parser.add_argument("--seeds", default="0,1")
    parser.add_argument("--budgets", default="0.1,0.2,0.3,0.4")
    parser.add_argument("--name", default="refine_whatif")
    return parser


def main(argv=None) -> int:
    argv = script_argv(argv)
    args = build_parser().parse_args(argv)
    load_start, started = os.getloadavg(), time.perf_counter()
    lm = load_model(args.model)
    budgets = parse_rate_grid(args.budgets, "budgets")
    seeds = [int(s) for s in args.seeds.split(",") if s]
    exact = {seed: cached(lm, dataclasses.replace(base_spec(args, seed), estimator="exact")) for seed in seeds}
    rows = []
    for seed in seeds:
        rows += seed_rows(lm, args, seed, budgets, exact)
    lines = [
        f"# Refinement settings replayed on the exact tables: {args.model}",
        "",
        "```",
        command_line(SCRIPT, argv),
        "```",
        "",
        machine_line(load_start, started),
        "",
        f"Tables: objective {args.objective}, {args.data} calibration, {args.samples} x {args.seq_len} tokens, rates "
        f"{args.rates}; budgets in view {args.budgets} unless a row says otherwise. Cost share: the measured cells' "
        "share of the exact build's cell cost (blocks run plus the LM head). Regret: the refined table's DP plan at "
        "each budget, its summed loss on the exact table minus the exact optimum (KL nats per token). "
        "Noise rows: the other seed's exact plans scored the same way on this seed's exact table (what two "
        "calibration samples of the same size disagree by). Bound row: the cells the exact table's own plans "
        "use, which any refinement must measure to end on them; it needs a search on top.",
        "",
        "| seed | setting | cells measured | cost share | rounds | " + " | ".join(f"regret at {b:.0%}" for b in budgets) + " |",
        "|---:|---|---:|---:|---:|" + "---:|" * len(budgets),
        *rows,
        "",
    ]
    write_report(args.name, lines, SCRIPT, argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
