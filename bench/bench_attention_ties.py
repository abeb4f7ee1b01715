"""The evidence behind the attention tie rule: of two GQA shapes with the same parameter count,
which loses less?

A block's attention keeps ``g`` KV groups of ``q`` query heads each, g * (q + 1) head-sized
slices of q/k/v/o. On SmolLM2-135M (3 KV groups of 3 heads) two pairs tie: (3 groups, 1 head)
with (2, 2) at 50% of the attention removed, and (2, 1) with (1, 3) at 67%. For each listed
layer this measures the exact table cell of every tied shape (the units chosen by the
criterion's scores exactly as surgery chooses them, ``surgery.select_attention``; the rest of
the model dense) on calibration windows and on held-out windows of the same text, as KL to the
dense model and as the NLL increase, and counts which shape of each pair loses less.

    python bench/bench_attention_ties.py [--layers 0,4,8,12,16,20,24,28] [--samples 8] [--seq-len 128]
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse
import logging
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from report import command_line, machine_line, script_argv, write_report

from gap_engine.core.config import WindowSpec
from gap_engine.data.windows import calibration_windows, heldout_windows
from gap_engine.model.loading import load_model
from gap_engine.model.units import AttentionShape, attention_params
from gap_engine.prune.importance import compute_importance
from gap_engine.prune.surgery import select_attention
from gap_engine.tables.cells import Cut, cell_per_window, objective_positions
from gap_engine.tables.exact import dense_pass

# (more KV groups, more query heads) of each pair with one parameter count, on 3 groups of 3.
SCRIPT = "bench/bench_attention_ties.py"
PAIRS = ((AttentionShape(3, 1), AttentionShape(2, 2)), (AttentionShape(2, 1), AttentionShape(1, 3)))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--data", default="wiki-sample")
    parser.add_argument("--criterion", default="wanda")
    parser.add_argument("--layers", default="0,4,8,12,16,20,24,28")
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--out", default="attention_ties")
    return parser


def parse_args(argv=None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def shape_cells(lm, windows, scores, layers: list[int]) -> dict[tuple[int, AttentionShape], dict[str, float]]:
    """(layer, shape) -> {"kl", "nll"}: the objective increase per counted position with that layer's attention cut to the shape."""
    state = dense_pass(lm, windows, 4, ("kl", "nll"))
    positions = {name: objective_positions(windows, name, state.start) for name in ("kl", "nll")}
    dense_nll = state.objective_sum / positions["nll"]
    out = {}
    for layer in layers:
        geom = lm.adapter.geometry(lm.adapter.layers(lm.model)[layer])
        for shape in (s for pair in PAIRS for s in pair):
            _, kept = select_attention(scores.layers[layer].head, geom.n_kv_heads, shape)
            heads = tuple(h for h in range(geom.n_heads) if h not in kept)
            sums = cell_per_window(lm, state, Cut(layer, heads, ()), ("kl", "nll"))
            out[layer, shape] = {
                "kl": float(sums["kl"].sum()) / positions["kl"],
                "nll": float(sums["nll"].sum()) / positions["nll"] - dense_nll,
            }
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    argv = script_argv(argv)
    command = command_line(SCRIPT, argv)
    load_start, started = os.getloadavg(), time.perf_counter()
    lm = load_model(args.model)
    layers = [int(x) for x in args.layers.split(",")]
    spec = WindowSpec(args.data, args.samples, args.seq_len, batch_size=4)
    calib, heldout = calibration_windows(lm.tokenizer, spec), heldout_windows(lm.tokenizer, spec)
    scores = compute_importance(lm, calib, args.criterion, 4)
    cells = {"calibration": shape_cells(lm, calib, scores, layers), "held-out": shape_cells(lm, heldout, scores, layers)}
    geom = lm.adapter.geometry(lm.adapter.layers(lm.model)[0])
    hidden = lm.adapter.attention_projections(lm.adapter.layers(lm.model)[0])[0].in_features
    lines = [
        "# Attention shape ties: which of two shapes of one size loses less",
        "",
        f"Command: `{command}`",
        "",
        machine_line(load_start, started),
        "",
        f"{args.model}: {geom.n_kv_heads} KV groups of {geom.group_size} query heads, head_dim {geom.head_dim}. "
        f"Criterion {args.criterion}, {args.samples} x {args.seq_len} tokens of {args.data} (calibration windows score "
        "the units; held-out windows of the same text never overlap them). A cell: one layer's attention cut to the "
        "shape, the rest dense; KL to the dense model and NLL increase, per counted position.",
        "",
    ]
    for more_groups, more_heads in PAIRS:
        removed = 1 - attention_params(geom, hidden, more_groups, False, False) / attention_params(
            geom, hidden, AttentionShape(geom.n_kv_heads, geom.group_size), False, False
        )
        lines += [
            f"## ({more_groups.kv_groups} groups x {more_groups.heads_per_group} head) against "
            f"({more_heads.kv_groups} x {more_heads.heads_per_group}): {more_groups.n_heads} against "
            f"{more_heads.n_heads} query heads, both remove {removed:.1%} of the attention",
            "",
            "| layer | windows | KL, more groups | KL, more heads | NLL +, more groups | NLL +, more heads | KL winner |",
            "|---:|---|---:|---:|---:|---:|---|",
        ]
        wins = {"calibration": [0, 0], "held-out": [0, 0]}
        for layer in layers:
            for which, table in cells.items():
                a, b = table[layer, more_groups], table[layer, more_heads]
                winner = 0 if a["kl"] < b["kl"] else 1
                wins[which][winner] += 1
                lines.append(
                    f"| {layer} | {which} | {a['kl']:.5f} | {b['kl']:.5f} | {a['nll']:+.5f} | {b['nll']:+.5f} | "
                    f"{'more groups' if winner == 0 else 'more heads'} |"
                )
        lines.append("")
        for which, (_, heads) in wins.items():
            mean_a = sum(cells[which][layer, more_groups]["kl"] for layer in layers) / len(layers)
            mean_b = sum(cells[which][layer, more_heads]["kl"] for layer in layers) / len(layers)
            lines.append(
                f"- {which}: more query heads loses less KL on {heads} of {len(layers)} layers "
                f"(mean KL {mean_b:.5f} against {mean_a:.5f} for more KV groups)."
            )
        lines.append("")
    write_report(args.out, lines, SCRIPT, argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
