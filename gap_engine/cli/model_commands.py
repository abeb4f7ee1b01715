"""``gap models``, ``gap prune`` and ``gap eval``: load, prune and measure one model."""

from __future__ import annotations

import argparse
import json
import sys

from gap_engine.cli.arguments import device_from, spec_from_args, windows_from
from gap_engine.cli.output import StderrProgress
from gap_engine.cli.table_commands import read_sources
from gap_engine.core.device import DeviceError
from gap_engine.core.errors import PlanError
from gap_engine.data.windows import bos_token_id
from gap_engine.evaluate.metrics import EvalSettings, evaluate
from gap_engine.model.adapters import supported_model_types
from gap_engine.model.checkpoint import save_pruned
from gap_engine.model.dispatch import load_dispatched, parse_max_memory
from gap_engine.model.loading import list_models, load_model
from gap_engine.model.rateplan import RatePlan, uniform_plan
from gap_engine.pipeline.iterative import iterative_prune
from gap_engine.pipeline.stages import dense_reference, prune_with_plan


def run_models(args: argparse.Namespace) -> int:
    rows = list_models(verify=args.verify)
    if args.json:
        print(json.dumps({"builtin": rows, "supported_model_types": supported_model_types()}))
        return 0
    for row in rows:
        state = "converted" if row["converted"] else "converts on first use"
        if row["problem"]:
            state = f"damaged: {row['problem']}; converted again on next use"
        elif args.verify and row["converted"]:
            state += ", SHA-256 checked" if row["checksummed"] else ", structure checked (no SHA-256 recorded by the older converter)"
        print(f"{row['name']:<14} {row['description']}  [{state}]")
    print(f"\nAlso: a local model folder, a .gguf file, or a hub id. Architectures: {', '.join(supported_model_types())}")
    return 0


def run_prune(args: argparse.Namespace) -> int:
    if sum(value is not None for value in (args.plan, args.uniform, args.budget)) != 1:
        raise PlanError("give exactly one of --plan P.json, --uniform R or --budget B")
    if args.budget is not None:
        return run_prune_rounds(args)
    plan = RatePlan.load(args.plan) if args.plan else None  # validate before the slow model load
    if (plan.criterion if plan else args.criterion) != "magnitude":
        read_sources(args.data)
    lm = load_model(args.model, device_from(args))
    if plan is None:
        plan = uniform_plan(lm, args.uniform, args.criterion, args.channel_multiple)
    result = prune_with_plan(lm, plan, windows_from(args), StderrProgress("importance"))
    save_pruned(lm, plan, result.kept_indices(), args.out, dtype=args.save_dtype)
    summary = {
        "out": str(args.out),
        "params_before": result.params_before,
        "params_after": result.params_after,
        "removed_fraction_of_prunable": plan.params["removed_fraction_of_prunable"],
        "removed_fraction_of_total": plan.params["removed_fraction_of_total"],
    }
    print(json.dumps(summary) if args.json else "\n".join(f"{k}: {v}" for k, v in summary.items()))
    return 0


def run_prune_rounds(args: argparse.Namespace) -> int:
    """``gap prune --budget B --rounds K``: GAP's DP in rounds, each on a table of the model as it is."""
    if args.rounds < 1:
        raise PlanError(f"--rounds must be at least 1, got {args.rounds}")
    spec = spec_from_args(args)
    read_sources(args.data)  # a bad text source fails before the model loads
    lm = load_model(args.model, device_from(args))
    progress = StderrProgress("round table")
    result = iterative_prune(lm, spec, args.budget, args.rounds, progress=progress, stage=progress.stage)
    save_pruned(result.model, result.plan, result.kept, args.out, dtype=args.save_dtype)
    summary = {
        "out": str(args.out),
        "params_before": lm.param_count(),
        "params_after": result.model.param_count(),
        "removed_fraction_of_prunable": result.removed_fraction,
        "predicted": result.predicted_loss,
        "rounds": [
            {"round": r.index, "predicted": r.predicted, "measured": r.measured, "removed": r.removed} for r in result.rounds
        ],
    }
    if args.json:
        print(json.dumps(summary))
        return 0
    for key in ("out", "params_before", "params_after", "removed_fraction_of_prunable"):
        print(f"{key}: {summary[key]}")
    for r in result.rounds:
        print(f"round {r.index}: removed {r.removed:,}, predicted {spec.objective} +{r.predicted:.4f} (table cells, summed), measured +{r.measured:.4f}")
    return 0


def window_convention_text(tokenizer) -> str:
    """One line saying how every evaluation window starts (issue: Gemma needs its BOS token)."""
    bos = bos_token_id(tokenizer)
    if bos is None:
        return "start with text (this model's tokenizer adds no BOS token)"
    return f"start with {tokenizer.convert_ids_to_tokens(bos)!s} (the model's BOS token: context only, not scored)"


def run_eval(args: argparse.Namespace) -> int:
    read_sources(args.data)
    if args.device_map:
        lm, dense = _dispatched_pair(args)
    else:
        lm = load_model(args.model, device_from(args))
        dense = None if args.no_dense else dense_reference(lm, device_from(args))
    settings = EvalSettings(windows=windows_from(args), throughput=not args.no_throughput, generations=args.generations)
    report = evaluate(lm, dense, settings, progress=lambda msg: print(f"eval: {msg}", file=sys.stderr))
    if args.json:
        print(json.dumps(report.to_dict()))
        return 0
    print(f"model: {report.model}  params: {report.params:,}  size: {report.size_bytes / 2**20:.1f} MiB")
    print(f"windows: {window_convention_text(lm.tokenizer)}")
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


def _dispatched_pair(args: argparse.Namespace):
    """The model (and its dense original) spread over the devices by ``--device-map``."""
    if args.stream or args.device != "auto":
        raise DeviceError("--device-map places the model itself: leave out --device and --stream")
    max_memory = parse_max_memory(args.max_memory)

    def load(name: str, folder: str):
        offload = args.offload_dir / folder if args.offload_dir else None  # one offload index per model
        return load_dispatched(name, args.dtype, args.device_map, max_memory, offload)

    lm = load(args.model, "model")
    dense = None if args.no_dense else dense_reference(lm, loader=lambda name: load(name, "dense"))
    return lm, dense
