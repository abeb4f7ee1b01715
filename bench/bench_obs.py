"""OBS's channel greedy: the deferred-inverse path against the step-by-step update, side by side.

On real Gram matrices (the inputs of SmolLM2's ``down_proj`` over calibration windows of
wiki-sample) and real weights, each chosen block's MLP channels are removed greedily at several
fractions twice: by ``prune.obs.greedy_remove`` (one-column blocks: the inverse's rank-one
updates deferred, the weights updated along memory) and by the textbook loop it replaced,
written out here (every step rewrites the whole (n, n) inverse). Reported per block and
fraction: both times (best of ``--repeats``), their ratio, whether the two removed the same
channels in the same order, and the largest relative difference of the weights they leave.

    python bench/bench_obs.py [--blocks 0,15,29 --fractions 0.25,0.5,0.75 --samples 16 --seq-len 256]
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from report import command_line, machine_line, script_argv, write_report

SCRIPT = "bench/bench_obs.py"

from gap_engine.core.config import WindowSpec
from gap_engine.data.windows import calibration_windows
from gap_engine.model.loading import load_model
from gap_engine.prune.obs import OBS_DAMPING, damped_inverse, greedy_remove


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--data", default="wiki-sample")
    p.add_argument("--samples", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--blocks", default="0,15,29", help="blocks whose down_proj is pruned")
    p.add_argument("--fractions", default="0.25,0.5,0.75", help="fractions of the channels removed")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--name", default="obs")
    return p


def step_by_step(weight: torch.Tensor, inverse: torch.Tensor, count: int) -> list[int]:
    """The greedy as first written: E_c = ||W_c||^2 / [H^-1]_cc, then the whole inverse and weight updated."""
    removed = torch.zeros(weight.shape[1], dtype=torch.bool)
    order = []
    for _ in range(count):
        diag = torch.diagonal(inverse)
        errors = torch.where(diag > 0, weight.pow(2).sum(0) / diag.clamp_min(1e-300), torch.inf)
        errors[removed] = torch.inf
        c = int(torch.argmin(errors))
        row = inverse[c] / inverse[c, c]  # (n,)
        weight -= torch.outer(weight[:, c], row)
        inverse -= torch.outer(inverse[:, c], row)
        weight[:, c] = 0.0
        inverse[c, :] = 0.0
        inverse[:, c] = 0.0
        removed[c] = True
        order.append(c)
    return order


def down_proj_grams(lm, windows: torch.Tensor, blocks: list[int]) -> dict[int, torch.Tensor]:
    """Each block's down_proj input Gram matrix (float64) over every calibration token."""
    grams: dict[int, torch.Tensor] = {}
    handles = []
    layers = lm.adapter.layers(lm.model)
    for b in blocks:
        down = lm.adapter.mlp_projections(layers[b])[2]
        grams[b] = torch.zeros(down.in_features, down.in_features, dtype=torch.float64)

        def add(module, args, b=b):
            x = args[0].detach().reshape(-1, args[0].shape[-1]).double()
            grams[b] += x.T @ x

        handles.append(down.register_forward_pre_hook(add))
    with torch.no_grad():
        for start in range(0, len(windows), 4):
            lm.model(input_ids=windows[start : start + 4])
    for handle in handles:
        handle.remove()
    return grams


def best_time(run, repeats: int):
    best, result = float("inf"), None
    for _ in range(repeats):
        started = time.perf_counter()
        result = run()
        best = min(best, time.perf_counter() - started)
    return best, result


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    started, load_start = time.perf_counter(), os.getloadavg()
    lm = load_model(args.model)
    spec = WindowSpec(data=args.data, n_samples=args.samples, seq_len=args.seq_len).validate()
    blocks = [int(b) for b in args.blocks.split(",")]
    grams = down_proj_grams(lm, calibration_windows(lm.tokenizer, spec), blocks)
    layers = lm.adapter.layers(lm.model)
    rows = []
    for b in blocks:
        weight = lm.adapter.mlp_projections(layers[b])[2].weight.detach().double()
        inverse = damped_inverse(grams[b], OBS_DAMPING)
        width = weight.shape[1]
        for fraction in (float(f) for f in args.fractions.split(",")):
            count = round(fraction * width)
            columns = [torch.tensor([c]) for c in range(width)]
            fast_w = weight.clone()
            fast_s, fast = best_time(lambda: greedy_remove(fast_w.copy_(weight), inverse.clone(), columns, count), args.repeats)
            slow_w = weight.clone()
            slow_s, slow = best_time(lambda: step_by_step(slow_w.copy_(weight), inverse.clone(), count), args.repeats)
            same = fast.order == slow
            diff = float((fast_w - slow_w).abs().max() / slow_w.abs().max())
            rows.append(
                f"| {b} | {width} | {fraction:.0%} ({count}) | {slow_s:.2f} | {fast_s:.2f} | {slow_s / fast_s:.1f}x | {same} | {diff:.1e} |"
            )
    lines = [
        command_line(SCRIPT, script_argv(argv)),
        "",
        f"# OBS's channel greedy on {args.model}: deferred inverse against the step-by-step update",
        "",
        machine_line(load_start, started),
        "",
        f"Each block's `down_proj` on the Gram matrix of its inputs over {args.samples} x {args.seq_len} tokens of {args.data} "
        f"(damping {OBS_DAMPING}); the channels removed greedily by `prune.obs.greedy_remove` and by the step-by-step loop "
        f"it replaced (`step_by_step` above: the whole (n, n) inverse rewritten at every step). Times are the best of "
        f"{args.repeats}, measured one after the other in this run; `same order` says whether both removed the same channels "
        "in the same order; `weights` is the largest difference of the weights they leave, relative to the largest weight.",
        "",
        "| block | channels | removed | step by step (s) | deferred (s) | ratio | same order | weights |",
        "|---:|---:|---:|---:|---:|---:|---|---:|",
        *rows,
    ]
    write_report(args.name, lines, SCRIPT, script_argv(argv))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
