"""Compensation after surgery, measured: which fit, which target, damping and calibration size.

Reads (or builds) the default loss table of the command line (``config.CLI_TABLE``: fisher,
KL, 16 x 256 tokens of wiki-sample), plans GAP's DP at each budget, and prunes a copy of the
model with every compensation variant (``prune.compensation_pass``), timing the compensation
itself. Every variant prunes the same units (the table's criterion on its windows); only what
the kept units get afterwards differs. Each pruned model is measured on held-out windows of
both built-in texts against the dense model's log-probabilities (computed once): KL to dense
per token, perplexity, top-1 agreement. Target: the best compensation removes at
least 10% of DP's held-out KL at 20% and 25% at 40%.

``--timing`` measures the other target instead, side by side in one run: the default fisher
table built uncached, then a whole model compensated with each variant (compensating must cost
at most the table's build).

    python bench/bench_compensation.py [--budgets 0.2,0.4] [--variants none,bias,...] [--name compensation]
    python bench/bench_compensation.py --timing --variants bias,refit,bias+refit --name compensation_time

A variant is ``mode[/target][@damping][#samples]``: ``refit/dense@0.001#32`` is the refit onto
the dense model's own activations, damping 0.001, fitted on 32 calibration windows of the
table's length (default: target pruned, damping 0.01, the table's windows). Rows are appended
to ``bench/results/<name>.csv`` as they finish; ``--resume`` skips rows already there.
"""

from __future__ import annotations

import argparse
import csv
import logging
import math
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from report import RESULTS, add_eval_args, command_line, machine_line, script_argv, write_report

SCRIPT = "bench/bench_compensation.py"

from gap_engine.cli.output import csv_text
from gap_engine.core.config import CLI_TABLE, WindowSpec
from gap_engine.core.fsutil import atomic_write_text
from gap_engine.data.bos import text_start
from gap_engine.data.windows import batches, calibration_windows
from gap_engine.model.loading import load_model
from gap_engine.pipeline.compare import heldout_sets
from gap_engine.pipeline.stages import loss_table
from gap_engine.plan.allocators import plan_from_table
from gap_engine.prune.compensation_pass import prune_compensated
from gap_engine.prune.compensations import DEFAULT_DAMPING, CompensationSettings
from gap_engine.prune.importance import compute_importance
from gap_engine.tables.artefact import TableSpec

log = logging.getLogger("bench_compensation")
DEFAULT_VARIANTS = "none,bias,bias/dense,refit,refit/dense,bias+refit,refit@0.001,refit@0.1,refit#32"


def parse_variant(text: str) -> CompensationSettings:
    """``mode[/target][@damping][#samples]`` -> the settings; ``#samples`` is the count of the table's text's windows
    the blocks are fitted on (none: the engine's default, the table's own or the model family's floor). Every token
    counts alike, whatever the model family's default weighting, so a file's variants read the same after it changes."""
    rest, _, samples = text.partition("#")
    rest, _, damping = rest.partition("@")
    mode, _, target = rest.partition("/")
    return CompensationSettings(
        mode=mode,
        damping=float(damping or DEFAULT_DAMPING),
        target=target or "pruned",
        samples=int(samples) if samples else None,
        weighting="tokens",
    ).validate()


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--budgets", default="0.2,0.4")
    p.add_argument("--variants", default=DEFAULT_VARIANTS, help="comma-separated mode[/target][@damping][#samples]")
    add_eval_args(p)
    p.add_argument("--name", default="compensation", help="output files: bench/results/<name>.md and .csv")
    p.add_argument("--resume", action="store_true", help="keep the rows already in <name>.csv and measure only the missing ones")
    p.add_argument("--timing", action="store_true", help="time the fisher table's uncached build and the compensations instead")
    return p


def parse_args(argv=None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


@torch.inference_mode()
def dense_reference(dense, heldout, batch_size: int = 4) -> dict[str, list[tuple[torch.Tensor, torch.Tensor]]]:
    """Per source, per batch: (token ids, the dense model's (B, T-1-start, V) log-probabilities)."""
    out = {}
    for source, windows in heldout.items():
        start = text_start(dense.tokenizer, windows)
        out[source] = [
            (batch, F.log_softmax(dense.model(input_ids=batch).logits[:, start:-1].float(), -1)) for batch in batches(windows, batch_size)
        ]
    return out


@torch.inference_mode()
def measure(pruned, reference) -> dict[str, float]:
    """KL to dense, perplexity and top-1 agreement on every held-out source (positions as ``compare_logits`` counts them)."""
    row: dict[str, float] = {}
    for source, parts in reference.items():
        nll = dense_nll = kl = agree = 0.0
        count = 0
        for batch, logp_d in parts:
            start = batch.shape[1] - 1 - logp_d.shape[1]
            logp = F.log_softmax(pruned.model(input_ids=batch).logits[:, start:-1].float(), -1)  # (B, T-1-start, V)
            targets = batch[:, start + 1 :, None]
            nll -= float(logp.gather(-1, targets).sum())
            dense_nll -= float(logp_d.gather(-1, targets).sum())
            kl += float((logp_d.exp() * (logp_d - logp)).sum())
            agree += float((logp.argmax(-1) == logp_d.argmax(-1)).sum())
            count += targets.numel()
        row |= {
            f"kl_{source}": kl / count,
            f"ppl_{source}": math.exp(nll / count),
            f"top1_{source}": agree / count,
            f"dense_ppl_{source}": math.exp(dense_nll / count),
        }
    return row


def main(argv=None) -> int:
    argv = script_argv(argv)
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    load_start, started = os.getloadavg(), time.perf_counter()
    csv_path = RESULTS / f"{args.name}.csv"
    rows = list(csv.DictReader(csv_path.open(newline=""))) if args.resume and csv_path.exists() else []
    done = {(row["budget"], row["variant"]) for row in rows}
    dense = load_model(args.model)
    spec = TableSpec(windows=CLI_TABLE.windows, rate_grid=CLI_TABLE.rate_grid, objective=CLI_TABLE.objective, estimator=CLI_TABLE.estimator)
    table_load = os.getloadavg()[0]
    table_started = time.perf_counter()
    table = loss_table(dense, spec, use_cache=not args.timing)  # --timing: built here, uncached, beside the compensations
    table_seconds = time.perf_counter() - table_started if args.timing else table.build_seconds
    log.info("fisher table: %.1f s (load %.1f)", table_seconds, table_load)
    windows = calibration_windows(dense.tokenizer, spec.windows)
    scores = compute_importance(dense, windows, spec.criterion, spec.windows.batch_size)
    heldout = heldout_sets(dense.tokenizer, WindowSpec(data=args.eval_data, n_samples=args.eval_samples, seq_len=args.eval_seq_len))
    reference = {} if args.timing else dense_reference(dense, heldout)
    for budget in [float(b) for b in args.budgets.split(",")]:
        plan = plan_from_table(dense, table, budget, "dp")
        for variant in args.variants.split(","):
            if (f"{budget:g}", variant) in done:
                continue
            settings = parse_variant(variant)
            pruned = dense.copy()
            load = os.getloadavg()[0]
            begun = time.perf_counter()
            prune_compensated(pruned, plan, scores, spec.windows, settings)
            seconds = time.perf_counter() - begun
            row = {"budget": f"{budget:g}", "variant": variant, "seconds": round(seconds, 1), "load": round(load, 1)}
            row |= {"table_seconds": round(table_seconds, 1), "table_load": round(table_load, 1), "params": pruned.param_count()}
            row |= {} if args.timing else measure(pruned, reference)
            rows.append({k: str(v) for k, v in row.items()})
            atomic_write_text(csv_path, csv_text(rows))
            log.info("%s at %g: %s", variant, budget, row)
            del pruned
    sources = [] if args.timing else list(heldout)
    lines = report_lines(args, argv, rows, sources, load_start, started)
    write_report(args.name, lines, SCRIPT, argv, files=[csv_path.name])
    return 0


def report_lines(args, argv, rows, sources, load_start, started) -> list[str]:
    command = command_line(SCRIPT, argv)
    lines = [
        f"# Compensation after surgery: {args.model}",
        "",
        f"Generated by `bench/bench_compensation.py`:\n\n```\n{command}\n```",
        "",
        machine_line(load_start, started),
        "",
        "Variants: `mode[/target][@damping][#samples]` (default target pruned, damping 0.01, the model family's windows: the table's 16 x 256 tokens, at least 64 on Gemma 3). "
        "Every variant prunes the same units of the same DP plan (default fisher KL table); held-out KL is per token, "
        f"on {args.eval_samples} windows x {args.eval_seq_len} tokens per source; 'KL cut' is the share of the uncompensated "
        "plan's KL that the variant removes, averaged over the sources; 'time' is the compensation alone (load average "
        "at its start in brackets), beside the default fisher table's build time: measured uncached in the same run with "
        "`--timing`, else the cached table's own record.",
        "",
        # --timing measures no text: its last column is the ratio the target is about
        "| budget | variant | time s (load) | fisher table s (load) | "
        + ("KL cut | " + " | ".join(f"KL {s} | ppl {s} | top-1 {s}" for s in sources) if sources else "time / table")
        + " |",
        "|---:|---|---:|---:|---:|" + "---:|---:|---:|" * len(sources),
    ]
    base = {row["budget"]: row for row in rows if row["variant"] == "none"}
    for row in rows:
        none = base.get(row["budget"])
        cut = "-"
        if none is not None and sources:
            cut = f"{sum(1 - float(row[f'kl_{s}']) / float(none[f'kl_{s}']) for s in sources) / len(sources):.1%}"
        cells = " | ".join(f"{float(row[f'kl_{s}']):.4f} | {float(row[f'ppl_{s}']):.2f} | {float(row[f'top1_{s}']):.3f}" for s in sources)
        last = f"{cut} | {cells}" if sources else f"{float(row['seconds']) / float(row['table_seconds']):.2f}x"
        lines.append(
            f"| {float(row['budget']):.0%} | {row['variant']} | {row['seconds']} ({row['load']}) | "
            f"{row['table_seconds']} ({row['table_load']}) | {last} |"
        )
    dense = rows[0] if rows else {}
    if sources:
        lines += ["", "Dense perplexity: " + ", ".join(f"{s} {float(dense.get(f'dense_ppl_{s}', 'nan')):.2f}" for s in sources) + "."]
    return lines


if __name__ == "__main__":
    sys.exit(main())
