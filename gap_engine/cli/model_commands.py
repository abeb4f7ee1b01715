"""``gap models``, ``gap prune`` and ``gap eval``: load, prune and measure one model."""

from __future__ import annotations

import argparse
import json
import sys

from ..adapters import supported_model_types
from ..checkpoint import save_pruned
from ..errors import PlanError
from ..evaluate import EvalSettings, evaluate
from ..models import list_models, load_model
from ..pipeline import dense_reference, prune_with_plan
from ..plan import RatePlan, uniform_plan
from .arguments import windows_from
from .output import StderrProgress


def run_models(args: argparse.Namespace) -> int:
    rows = list_models()
    if args.json:
        print(json.dumps({"builtin": rows, "supported_model_types": supported_model_types()}))
        return 0
    for row in rows:
        state = "converted" if row["converted"] else "converts on first use"
        print(f"{row['name']:<14} {row['description']}  [{state}]")
    print(f"\nAlso: a local model folder, a .gguf file, or a hub id. Architectures: {', '.join(supported_model_types())}")
    return 0


def run_prune(args: argparse.Namespace) -> int:
    if (args.plan is None) == (args.uniform is None):
        raise PlanError("give exactly one of --plan P.json or --uniform R")
    plan = RatePlan.load(args.plan) if args.plan else None  # validate before the slow model load
    lm = load_model(args.model)
    if plan is None:
        plan = uniform_plan(lm, args.uniform, args.criterion, args.channel_multiple)
    result = prune_with_plan(lm, plan, windows_from(args), StderrProgress("importance"))
    save_pruned(lm, plan, result.kept_indices(), args.out, dtype=args.dtype)
    summary = {
        "out": str(args.out),
        "params_before": result.params_before,
        "params_after": result.params_after,
        "removed_fraction_of_prunable": plan.params["removed_fraction_of_prunable"],
        "removed_fraction_of_total": plan.params["removed_fraction_of_total"],
    }
    print(json.dumps(summary) if args.json else "\n".join(f"{k}: {v}" for k, v in summary.items()))
    return 0


def run_eval(args: argparse.Namespace) -> int:
    lm = load_model(args.model)
    dense = None if args.no_dense else dense_reference(lm)
    settings = EvalSettings(windows=windows_from(args), throughput=not args.no_throughput, generations=args.generations)
    report = evaluate(lm, dense, settings, progress=lambda msg: print(f"eval: {msg}", file=sys.stderr))
    if args.json:
        print(json.dumps(report.to_dict()))
        return 0
    print(f"model: {report.model}  params: {report.params:,}  size: {report.size_bytes / 2**20:.1f} MiB")
    for source, ppl in report.perplexity.items():
        line = f"perplexity[{source}]: {ppl:.3f}"
        if report.dense:
            line += (
                f"  (dense {report.dense['perplexity'][source]:.3f}, KL {report.kl_to_dense[source]:.4f}, "
                f"top-1 agree {report.top1_agreement[source]:.3f})"
            )
        print(line)
    if report.throughput:
        print("throughput: " + ", ".join(f"{k}={v:.2f}" for k, v in report.throughput.items() if isinstance(v, float)))
    for g in report.generations:
        print(f"> {g['prompt']}\n  model: {g['model']!r}" + (f"\n  dense: {g['dense']!r}" if "dense" in g else ""))
    return 0
