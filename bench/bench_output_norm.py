"""Compensation through Gemma 3's post-norms: every allocator's plan fitted with tokens alike and with output-norm weights.

Gemma 3 normalises the outputs of ``o_proj`` and ``down_proj`` again before the residual, so an error there reaches the
model scaled by the inverse size of the token's own output. A fit that counts every token alike (``weighting="tokens"``,
what the compensations did first) sets its bias and refit by the tokens with large outputs; the BOS token, whose MLP
output is tiny in most of Gemma's blocks and which every later token attends to, is not in that fit at all. The
``output-norm`` weighting (``CompensationSettings.weighting``) counts each token, BOS included, by the inverse mean
square of the projection's dense output on it.

This benchmark plans each allocator at each budget once (DP on the default fisher KL table, the baselines on the same
windows), prunes it with each compensation under both weightings, the units the same, and measures every pruned model
window by window on the **selection** part of every held-out source (the evidence may choose a default, so it never
reads the report part). Per allocator, budget and compensation it prints both perplexities (geometric mean over
sources) and the paired bootstrap ratio tokens / output-norm with its 95% interval (above 1: the output-norm fit is
better; met, tie or loss).

    python bench/bench_output_norm.py --model gemma3-270m --allocators flap --budgets 0.2 --name output_norm_flap
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from report import command_line, machine_line, script_argv, write_report

from gap_engine import api
from gap_engine.core.config import HELDOUT_TEXT_NAMES, WindowSpec
from gap_engine.data.windows import heldout_windows
from gap_engine.evaluate.intervals import perplexity_ratio
from gap_engine.evaluate.window_metrics import window_numbers
from gap_engine.prune.compensations import COMPENSATIONS

log = logging.getLogger("bench_output_norm")
SCRIPT = "bench/bench_output_norm.py"
SELECTION = "selection"
WEIGHTINGS = ("tokens", "output-norm")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="gemma3-270m", help="a model whose family has post-norms (Gemma 3)")
    p.add_argument("--allocators", default="flap", help="comma-separated allocators (each plan's own criterion prunes it)")
    p.add_argument("--budgets", default="0.2")
    p.add_argument("--compensations", default="bias,refit,bias+refit", help="comma-separated compensations (not none)")
    p.add_argument("--eval-data", default=",".join(HELDOUT_TEXT_NAMES), help="held-out sources, comma-separated")
    p.add_argument("--selection-windows", type=int, default=8, help="selection windows per held-out source")
    p.add_argument("--eval-seq-len", type=int, default=256)
    p.add_argument("--resamples", type=int, default=2000, help="bootstrap resamples")
    p.add_argument("--name", default="output_norm_flap", help="file bench/results/<name>.md")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = script_argv(argv)
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    compensations = [c for c in args.compensations.split(",") if c]
    for name in compensations:
        COMPENSATIONS.check(name)
        if name == "none":
            raise SystemExit("--compensations: none fits nothing, so it has no weighting to compare")
    load_start, started = os.getloadavg(), time.perf_counter()
    dense = api.load(args.model)
    table = api.loss_table(dense)  # the default table: fisher, KL, 16 x 256 tokens of wiki-sample
    sets = {
        source: heldout_windows(
            dense.tokenizer, WindowSpec(data=source, n_samples=args.selection_windows, seq_len=args.eval_seq_len), SELECTION
        )
        for source in args.eval_data.split(",")
    }
    rows = []
    for budget in [float(b) for b in args.budgets.split(",")]:
        for allocator in args.allocators.split(","):
            for compensation in compensations:
                plan = api.plan(dense, table, budget, allocator=allocator, compensate=compensation)
                nll = {}
                for weighting in WEIGHTINGS:
                    pruned = api.prune(dense, plan, table, compensate=compensation, weighting=weighting)
                    numbers = window_numbers(pruned.model, dense, sets)
                    nll[weighting] = [list(numbers[source].nll) for source in sets]
                    log.info("%s %g %s %s: ppl %.2f", allocator, budget, compensation, weighting, _ppl(nll[weighting]))
                ratio = perplexity_ratio(nll["tokens"], nll["output-norm"], resamples=args.resamples)
                rows.append((budget, allocator, plan.criterion, compensation, _ppl(nll["tokens"]), _ppl(nll["output-norm"]), ratio))
    lines = [
        f"# Compensation through the post-norms on {args.model}: tokens alike against output-norm weights, selection part",
        "",
        f"Generated by `{SCRIPT}`:\n\n```\n{command_line(SCRIPT, argv)}\n```",
        "",
        machine_line(load_start, started),
        "",
        f"Every plan pruned twice, the same units, its compensation fitted on the model family's default windows of the "
        f'table\'s text, once with every token alike (`weighting="tokens"`) and once by output-norm weights, BOS included '
        f'(`weighting="output-norm"`). Perplexity: geometric mean over {", ".join(sets)}, {args.selection_windows} '
        f"selection windows x {args.eval_seq_len} tokens each; ratio tokens / output-norm with its paired bootstrap 95% "
        "interval over windows (above 1: output-norm better). Selection part only: this evidence chooses.",
        "",
        "| budget | allocator (criterion) | compensation | ppl tokens | ppl output-norm | ratio [95%] | verdict |",
        "|---:|---|---|---:|---:|---:|---|",
    ]
    for budget, allocator, criterion, compensation, ppl_tokens, ppl_norm, ratio in rows:
        lines.append(
            f"| {budget:.0%} | {allocator} ({criterion}) | {compensation} | {ppl_tokens:.2f} | {ppl_norm:.2f} | "
            f"{ratio.text()} | {ratio.verdict()} |"
        )
    write_report(args.name, lines, SCRIPT, argv)
    return 0


def _ppl(nll: list[list[float]]) -> float:
    """exp of the mean over sources of each source's mean window NLL."""
    return math.exp(sum(sum(w) / len(w) for w in nll) / len(nll))


if __name__ == "__main__":
    raise SystemExit(main())
