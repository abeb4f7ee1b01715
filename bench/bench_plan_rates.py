"""Per-layer rates that each allocator picks at one budget: where a plan puts its cuts.

A diagnostic beside the quality benchmark: when an allocator's pruned model is far worse
than another's at the same budget, this prints where their plans differ. The plans are made
exactly as `bench_quality.py` makes them (the default fisher KL table on 16 x 256 tokens of
wiki-sample, wanda units; flap and slimgpt with their own criteria on the same windows).
Rates are fractions of each block's attention (q, k, v, o) and MLP parameters.

    python bench/bench_plan_rates.py --model gemma3-270m --budget 0.2 [--allocators flap,dp,uniform]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from report import script_argv

from gap_engine.core.config import CLI_TABLE, WindowSpec
from gap_engine.data.windows import calibration_windows
from gap_engine.model.loading import load_model
from gap_engine.pipeline.stages import loss_table
from gap_engine.plan.allocators import plan_from_table
from gap_engine.tables.artefact import TableSpec


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--budget", type=float, default=0.2)
    p.add_argument("--allocators", default="flap,dp,uniform")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = script_argv(argv)
    args = build_parser().parse_args(argv)
    lm = load_model(args.model)
    windows = CLI_TABLE.windows
    calib = WindowSpec(data=windows.data, n_samples=windows.n_samples, seq_len=windows.seq_len, batch_size=8)
    spec = TableSpec(
        windows=calib, criterion="wanda", rate_grid=CLI_TABLE.rate_grid, estimator=CLI_TABLE.estimator, objective=CLI_TABLE.objective
    )
    table = loss_table(lm, spec)
    tokens = calibration_windows(lm.tokenizer, calib)
    print(f"{args.model} at {args.budget:.0%} of its prunable parameters: per-layer rates (attention / MLP)")
    for allocator in args.allocators.split(","):
        plan = plan_from_table(lm, table, args.budget, allocator, windows=tokens)
        attention = " ".join(f"{r:.2f}" for r in plan.attention_rates)
        mlp = " ".join(f"{r:.2f}" for r in plan.mlp_rates)
        print(f"{allocator:>8} attention: {attention}")
        print(f"{allocator:>8} MLP:       {mlp}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
