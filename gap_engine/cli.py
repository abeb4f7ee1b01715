"""The ``gap`` command line (also ``python -m gap_engine``).

Each subcommand parses its arguments, calls engine functions and prints what they return.
User errors surface as one line on stderr and exit status 2; an interrupt exits 130.
Progress goes to stderr, results to stdout (``--json`` prints exactly one JSON object).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time

from . import __version__
from .errors import GapError, PlanError

log = logging.getLogger("gap_engine")


def _quiet_transformers() -> None:
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()


def stderr_progress(label: str):
    """A (done, total[, eta]) callback that redraws one status line on stderr."""
    started = time.perf_counter()

    def report(done: int, total: int, eta: float | None = None) -> None:
        if eta is None and done:
            eta = (time.perf_counter() - started) / done * (total - done)
        eta_text = f", ETA {eta:.0f}s" if eta is not None else ""
        end = "\n" if done >= total else ""
        print(f"\r{label}: {done}/{total}{eta_text}   ", end=end, file=sys.stderr, flush=True)

    return report


def _rate(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}' is not a number") from None
    if not 0.0 <= value < 1.0:
        raise argparse.ArgumentTypeError(f"rate {value} is outside [0, 1)")
    return value


def add_calibration_args(p: argparse.ArgumentParser, samples: int = 16, seq_len: int = 256) -> None:
    p.add_argument("--data", default="wiki-sample", help="calibration text: wiki-sample, news-sample, a .txt/.jsonl file, or an HF spec")
    p.add_argument("--samples", type=int, default=samples, help="calibration windows")
    p.add_argument("--seq-len", type=int, default=seq_len, help="tokens per window")
    p.add_argument("--seed", type=int, default=0, help="window sampling seed")


def calibration_from(args):
    from .pipeline import CalibrationSettings

    return CalibrationSettings(data=args.data, n_samples=args.samples, seq_len=args.seq_len, seed=args.seed)


# ---- subcommands ------------------------------------------------------------------------
def cmd_models(args) -> int:
    from .adapters import ADAPTERS
    from .models import list_models

    rows = list_models()
    if args.json:
        print(json.dumps({"builtin": rows, "supported_model_types": sorted(ADAPTERS)}))
        return 0
    for row in rows:
        state = "converted" if row["converted"] else "converts on first use"
        print(f"{row['name']:<14} {row['description']}  [{state}]")
    print(f"\nAlso: a local model folder, a .gguf file, or a hub id. Architectures: {', '.join(sorted(ADAPTERS))}")
    return 0


def cmd_prune(args) -> int:
    from .export import save_pruned
    from .models import load_model
    from .pipeline import prune_with_plan
    from .plan import RatePlan, uniform_plan

    if (args.plan is None) == (args.uniform is None):
        raise PlanError("give exactly one of --plan P.json or --uniform R")
    plan = RatePlan.load(args.plan) if args.plan else None  # validate before the slow model load
    lm = load_model(args.model)
    if plan is None:
        plan = uniform_plan(lm, args.uniform, args.criterion, args.channel_multiple)
    result = prune_with_plan(lm, plan, calibration_from(args), stderr_progress("importance"))
    save_pruned(lm, result, args.out, dtype=args.dtype)
    summary = {
        "out": str(args.out),
        "params_before": result.params_before,
        "params_after": result.params_after,
        "removed_fraction_of_prunable": plan.params["removed_fraction_of_prunable"],
        "removed_fraction_of_total": plan.params["removed_fraction_of_total"],
    }
    print(json.dumps(summary) if args.json else "\n".join(f"{k}: {v}" for k, v in summary.items()))
    return 0


def cmd_eval(args) -> int:
    from .evaluate import EvalSettings, evaluate
    from .models import load_model
    from .pipeline import dense_reference

    lm = load_model(args.model)
    dense = None if args.no_dense else dense_reference(lm)
    settings = EvalSettings(
        data=tuple(s for s in args.data.split(",") if s),
        n_samples=args.samples,
        seq_len=args.seq_len,
        seed=args.seed,
        throughput=not args.no_throughput,
        generations=args.generations,
    )
    report = evaluate(lm, dense, settings, progress=lambda msg: print(f"eval: {msg}", file=sys.stderr))
    if args.json:
        print(json.dumps(report.to_dict()))
        return 0
    print(f"model: {report.model}  params: {report.params:,}  size: {report.size_bytes / 2**20:.1f} MiB")
    for source, ppl in report.perplexity.items():
        line = f"perplexity[{source}]: {ppl:.3f}"
        if report.dense:
            line += f"  (dense {report.dense['perplexity'][source]:.3f}, KL {report.kl_to_dense[source]:.4f}, top-1 agree {report.top1_agreement[source]:.3f})"
        print(line)
    if report.throughput:
        print("throughput: " + ", ".join(f"{k}={v:.2f}" for k, v in report.throughput.items() if isinstance(v, float)))
    for g in report.generations:
        print(f"> {g['prompt']}\n  model: {g['model']!r}" + (f"\n  dense: {g['dense']!r}" if "dense" in g else ""))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gap", description="Layer-adaptive structured pruning of LLMs (GAP)")
    parser.add_argument("--version", action="version", version=f"gap_engine {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("models", help="list the built-in models and supported architectures")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_models)

    p = sub.add_parser("prune", help="prune a model with a plan (or a uniform rate) and save a checkpoint")
    p.add_argument("--model", required=True, help="built-in name, local folder, .gguf file or hub id")
    p.add_argument("--plan", help="a plan JSON/YAML file")
    p.add_argument("--uniform", type=_rate, help="every layer and component at this rate, in [0, 1)")
    p.add_argument("--criterion", default="wanda", choices=["magnitude", "wanda", "flap", "taylor"])
    p.add_argument("--channel-multiple", type=int, default=8)
    p.add_argument("--out", required=True, help="output folder (replaced atomically)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"], help="storage precision of the weights")
    p.add_argument("--json", action="store_true")
    add_calibration_args(p)
    p.set_defaults(func=cmd_prune)

    p = sub.add_parser("eval", help="held-out perplexity, KL to dense, throughput and generations")
    p.add_argument("--model", required=True)
    p.add_argument("--data", default="wiki-sample", help="comma-separated held-out sources")
    p.add_argument("--samples", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--generations", type=int, default=3)
    p.add_argument("--no-dense", action="store_true", help="do not compare with the dense original")
    p.add_argument("--no-throughput", action="store_true")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    p.set_defaults(func=cmd_eval)

    for register in _extra_commands():
        register(sub)
    return parser


def _extra_commands():
    """Subcommand groups that live beside the stages they drive."""
    from . import cli_export, cli_planning, cli_tables

    return [cli_tables.register, cli_planning.register, cli_export.register]


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr
    )
    _quiet_transformers()
    try:
        return args.func(args)
    except GapError as exc:
        print(f"gap: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("gap: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
