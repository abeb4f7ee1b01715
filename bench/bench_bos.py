"""Dense held-out perplexity of the built-in models with and without a leading BOS token.

A window cut from a token stream encoded without special tokens starts with text, never
with the beginning-of-sequence token; Gemma is trained to always see it first. This benchmark measures, on the same held-out windows and the same counted
tokens (the text tokens after the first one), each model's perplexity when the window
starts with text (the old convention) and with the model's BOS token (the new one for a
model whose tokenizer prepends it). For a model whose tokenizer adds no BOS the new
windows are the old ones; its perplexity with its BOS token forced in front is shown too.

    python bench/bench_bos.py [--samples 8 --seq-len 128] [--name bos]
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from report import command_line, machine_line, script_argv, write_report

SCRIPT = "bench/bench_bos.py"

from gap_engine.core.config import WindowSpec
from gap_engine.data.bos import bos_token_id, window_start
from gap_engine.data.windows import batches, heldout_windows
from gap_engine.model.loading import load_model
from gap_engine.tables.cells import objective_per_window, objective_positions


def perplexity(lm, windows: torch.Tensor, start: int, batch_size: int = 4) -> float:
    """exp(mean NLL) of the targets after position ``start + 1``: the same text tokens for both conventions."""
    total = 0.0
    with torch.inference_mode():
        for batch in batches(windows, batch_size):
            logits = lm.model(input_ids=batch, use_cache=False).logits
            total += float(objective_per_window(logits, batch, "nll", None, start).sum())
    return math.exp(total / objective_positions(windows, "nll", start))


def measure(name: str, sources: list[str], args) -> list[str]:
    lm = load_model(name)
    tokenizer = lm.tokenizer
    bos = bos_token_id(tokenizer) if bos_token_id(tokenizer) is not None else tokenizer.bos_token_id
    rows = []
    for source in sources:
        windows = heldout_windows(tokenizer, WindowSpec(source, args.samples, args.seq_len))
        text = windows[:, 1:] if window_start(tokenizer) == "bos" else windows  # (N, T): the old windows
        with_bos = torch.cat([torch.full((text.shape[0], 1), bos, dtype=text.dtype), text], dim=1)  # (N, 1 + T)
        started = time.perf_counter()
        before, forced = perplexity(lm, text, 0), perplexity(lm, with_bos, 1)
        after = forced if window_start(tokenizer) == "bos" else before
        token = tokenizer.convert_ids_to_tokens(bos).replace("|", "\\|")  # a bare | would end the table cell
        rows.append(
            f"| {name} | {source} | {window_start(tokenizer)} (`{token}`) | "
            f"{before:.2f} | {forced:.2f} | **{after:.2f}** | {time.perf_counter() - started:.0f} s |"
        )
        print(rows[-1], file=sys.stderr, flush=True)
    return rows


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="smollm2-135m,gemma3-270m")
    parser.add_argument("--data", default="wiki-sample,news-sample", help="held-out sources")
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--name", default="bos", help="output: bench/results/<name>.md")
    return parser


def main(argv=None) -> int:
    argv = script_argv(argv)
    args = build_parser().parse_args(argv)
    load, started = os.getloadavg(), time.perf_counter()
    sources = [s for s in args.data.split(",") if s]
    lines = [
        "# Dense perplexity with and without the BOS token (issue 14)",
        "",
        "```",
        command_line(SCRIPT, argv),
        "```",
        "",
        f"Held-out windows: {args.samples} x {args.seq_len} text tokens per source (seed 0), never overlapping "
        "calibration text. Every column counts the same tokens: the text tokens after the first of each window.",
        "",
        "| model | held-out text | the model's convention (BOS token) | before: windows start with text | "
        "with BOS in front | **after: as the model expects** | time |",
        "|---|---|---|---:|---:|---:|---:|",
    ]
    for name in [m for m in args.models.split(",") if m]:
        lines += measure(name, sources, args)
    lines += ["", machine_line(load, started), ""]
    write_report(args.name, lines, SCRIPT, argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
