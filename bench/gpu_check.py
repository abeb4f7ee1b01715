"""The scale checks that need a GPU, in one short run: ``python bench/gpu_check.py``.

For smollm2-135m and gemma3-270m on ``cuda`` (one device is enough):

1. exact tables in float32 and bfloat16 on the GPU, and bf16 streamed (blocks from the host):
   build time, cell-tokens per second, peak GPU memory, and agreement with the CPU float32
   table (max abs difference of the cell objectives, Spearman of the deltas); streamed vs
   resident bf16 must agree to the last bits a deterministic GPU gives;
2. the fisher estimate in bf16 on the GPU against the CPU fisher table (Spearman), resident
   and streamed (the block-by-block backward pass), and the two against each other;
3. a 20% DP plan from the bf16 GPU table, pruned and evaluated on the GPU in bf16: held-out
   perplexity beside the same plan pruned and evaluated on the CPU in float32, KL to dense,
   prefill/decode tokens per second and their speed-up over the dense model; the dense model
   evaluated once more spread over every visible GPU with ``--device-map auto``;
4. the cost model: this GPU's measured profile, and its predicted seconds and peak memory
   for the bf16 exact build beside the measured ones.

The CPU float32 reference tables come from ``bench/results/gpu_check_reference.json`` when
its table keys match the ones this checkout computes (same windows and weights), otherwise
they are built on this machine's CPU first (a minute or two with 16 cores). Results go to
``$OUT/gpu_check.json`` and ``$OUT/gpu_check.md`` (``--out`` to change the folder).

    python bench/gpu_check.py [--models smollm2-135m,gemma3-270m] [--samples 4 --seq-len 128] [--out DIR]
    python bench/gpu_check.py --write-reference   # on a CPU machine: refresh the committed CPU tables
    python bench/gpu_check.py --device cpu --models smollm2-135m --samples 1 --seq-len 32 --rates 0,0.5 \
        --eval-samples 1 --out /tmp/gpu_check   # smoke test of this script on a CPU (bf16 on the CPU)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch
from scipy.stats import spearmanr

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from report import machine_description, script_argv, with_header

from gap_engine.core.config import WindowSpec
from gap_engine.core.device import DeviceSpec, resolve
from gap_engine.data.windows import calibration_fingerprint, calibration_windows
from gap_engine.evaluate.metrics import EvalSettings, evaluate
from gap_engine.model.dispatch import describe_device_map, load_dispatched
from gap_engine.model.loading import load_model
from gap_engine.pipeline.cost_model import ModelShape, estimate_build, measured_profile
from gap_engine.pipeline.stages import plan_for, pruned_as_saved
from gap_engine.tables.artefact import LossTable, TableSpec, parse_rate_grid, table_key
from gap_engine.tables.build import measure_table

SCRIPT = "bench/gpu_check.py"

REFERENCE = Path(__file__).resolve().parent / "results" / "gpu_check_reference.json"
RATES = "0,0.125,0.25,0.375,0.5,0.625,0.75,0.875"


def note(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def spec_of(args, estimator: str = "exact") -> TableSpec:
    return TableSpec(
        windows=WindowSpec("wiki-sample", args.samples, args.seq_len, 0, args.batch_size),
        rate_grid=parse_rate_grid(args.rates),
        estimator=estimator,
    )


def cpu_references(args, names: list[str]) -> dict[str, dict[str, LossTable]]:
    """CPU float32 exact and fisher tables per model: committed ones when their keys match, else built here."""
    stored = json.loads(REFERENCE.read_text()) if REFERENCE.is_file() else {}
    out = {}
    for name in names:
        lm = load_model(name, DeviceSpec("cpu", "float32"))
        out[name] = {}
        for estimator in ("exact", "fisher"):
            spec = spec_of(args, estimator)
            key = table_key(lm, spec, calibration_fingerprint(spec.windows))
            text = stored.get(key)
            if text is None:
                note(f"building the CPU float32 {estimator} table of {name} (no committed one for {key})")
                table = measure_table(lm, spec, calibration_windows(lm.tokenizer, spec.windows), key=key)
                stored[key] = table.to_json()
            out[name][estimator] = LossTable.from_json(stored[key])
    if args.write_reference:
        REFERENCE.write_text(json.dumps(stored, indent=0) + "\n")
    return out


def reset_peak() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()


def peak_bytes() -> int:
    """Peak GPU memory since the last reset (0 in a CPU smoke run)."""
    if not torch.cuda.is_available():
        return 0
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated()


def gpu_table(name: str, spec: TableSpec, device: DeviceSpec) -> tuple[LossTable, dict]:
    lm = load_model(name, device)
    windows = calibration_windows(lm.tokenizer, spec.windows)
    reset_peak()
    started = time.perf_counter()
    table = measure_table(lm, spec, windows)
    peak = peak_bytes()
    seconds = time.perf_counter() - started
    cells = table.extras.get("distinct_cells", 0)
    return table, {
        "seconds": seconds,
        "peak_gpu_bytes": peak,
        "cells": cells,
        "cell_tokens_per_s": cells * windows.numel() / seconds,  # calibration tokens through one cell's suffix, per second
        "placement": table.extras.get("placement"),
    }


def agreement(table: LossTable, reference: LossTable) -> dict:
    mask = reference.removed > 0
    return {
        "max_abs_cell_diff": float(np.abs(table.cell_objective - reference.cell_objective).max()),
        "spearman_delta": float(spearmanr(table.delta[mask], reference.delta[mask])[0]),
    }


def check_model(args, name: str, reference: dict[str, LossTable]) -> dict:
    result: dict = {"model": name}
    spec = spec_of(args)
    for label, device in (
        ("fp32", DeviceSpec(args.device, "float32")),
        ("bf16", DeviceSpec(args.device, "bfloat16")),
        ("bf16_streamed", DeviceSpec(args.device, "bfloat16", stream=True)),
    ):
        note(f"{name}: exact table on the GPU, {label}")
        table, stats = gpu_table(name, spec, device)
        result[f"exact_{label}"] = stats | agreement(table, reference["exact"])
        result.setdefault("tables", {})[label] = table
    streamed, resident = result["tables"]["bf16_streamed"], result["tables"]["bf16"]
    result["streamed_vs_resident_max_abs"] = float(np.abs(streamed.cell_objective - resident.cell_objective).max())
    if not args.no_ray:
        result["ray_vs_resident_max_abs"] = ray_check(name, spec, resident, args.device)
    note(f"{name}: fisher table on the GPU, bf16")
    fisher, stats = gpu_table(name, spec_of(args, "fisher"), DeviceSpec(args.device, "bfloat16"))
    result["fisher_bf16"] = stats | agreement(fisher, reference["fisher"])
    note(f"{name}: fisher table on the GPU, bf16 streamed (block-by-block backward)")
    fisher_streamed, stats = gpu_table(name, spec_of(args, "fisher"), DeviceSpec(args.device, "bfloat16", stream=True))
    result["fisher_bf16_streamed"] = stats | agreement(fisher_streamed, reference["fisher"])
    result["fisher_streamed_vs_resident_max_abs"] = float(np.abs(fisher_streamed.cell_objective - fisher.cell_objective).max())
    result.update(prune_and_evaluate(args, name, resident))
    result.update(cost_model(args, name, spec, result["exact_bf16"]))
    del result["tables"]
    return result


def ray_check(name: str, spec: TableSpec, resident: LossTable, device: str) -> float:
    """One Ray worker on the GPU (its own process and CUDA context): max abs difference to the resident bf16 table."""
    from gap_engine.tables.distributed import RayCells, RaySettings

    note(f"{name}: exact bf16 table through one Ray worker on the GPU")
    lm = load_model(name, DeviceSpec(device, "bfloat16"))
    table = measure_table(lm, spec, calibration_windows(lm.tokenizer, spec.windows), cells=RayCells(RaySettings(workers=1)))
    return float(np.abs(table.cell_objective - resident.cell_objective).max())


def prune_and_evaluate(args, name: str, table: LossTable) -> dict:
    settings = EvalSettings(windows=WindowSpec("wiki-sample,news-sample", args.eval_samples, 256), generations=1)
    out = {}
    for label, device in (("gpu_bf16", DeviceSpec(args.device, "bfloat16")), ("cpu_fp32", DeviceSpec("cpu", "float32"))):
        note(f"{name}: 20% DP plan pruned and evaluated, {label}")
        dense = load_model(name, device)
        plan = plan_for(dense, table, 0.2)
        gpu = label == "gpu_bf16"
        reset_peak()
        pruned, _ = pruned_as_saved(dense, plan, table.spec.windows, save_dtype="float32")  # each in its own dtype, as before
        report = evaluate(pruned, dense, settings if gpu else EvalSettings(settings.windows, throughput=False, generations=0))
        out[f"eval_{label}"] = {
            "perplexity": report.perplexity,
            "dense_perplexity": report.dense["perplexity"],
            "kl_to_dense": report.kl_to_dense,
            "throughput": report.throughput,
            "peak_gpu_bytes": peak_bytes() if gpu else None,
        }
    if args.device != "cpu":
        note(f"{name}: the dense model evaluated with --device-map auto (accelerate, every visible GPU)")
        spread = load_dispatched(name, "bfloat16", "auto")
        report = evaluate(spread, None, EvalSettings(settings.windows, throughput=False, generations=0))
        out["eval_device_map"] = {"perplexity": report.perplexity, "device_map": describe_device_map(spread.device_map)}
    return out


def cost_model(args, name: str, spec: TableSpec, measured: dict) -> dict:
    placement = resolve(DeviceSpec(args.device, "bfloat16"))
    lm = load_model(name)
    shape = ModelShape.from_config(lm.model.config, name)
    profile = measured_profile(placement, shape, seq_len=args.seq_len, batch=args.batch_size, refresh=True)
    predicted = estimate_build(shape, spec, profile, dtype_bytes=2)
    return {
        "cost_model": {
            "profile": profile.__dict__,
            "predicted_seconds": predicted.seconds,
            "predicted_device_bytes": predicted.device_bytes,
            "measured_seconds": measured["seconds"],
            "measured_peak_gpu_bytes": measured["peak_gpu_bytes"],
        }
    }


def markdown(results: list[dict], env: dict) -> str:
    lines = ["# GPU check (bench/gpu_check.py)", "", f"- {machine_description()}", f"- {env}", ""]
    lines += [
        "| model | table | seconds | peak GPU memory | cell-tokens/s | max abs diff vs CPU fp32 | Spearman vs CPU |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        for label in ("exact_fp32", "exact_bf16", "exact_bf16_streamed", "fisher_bf16", "fisher_bf16_streamed"):
            s = r[label]
            lines.append(
                f"| {r['model']} | {label} | {s['seconds']:.1f} | {s['peak_gpu_bytes'] / 2**30:.2f} GiB | "
                f"{s['cell_tokens_per_s']:.3g} | {s['max_abs_cell_diff']:.2e} | {s['spearman_delta']:.3f} |"
            )
    lines += [
        "",
        "| model | streamed vs resident bf16 (max abs) | Ray vs resident bf16 (max abs) | ppl GPU bf16 (wiki) | ppl CPU fp32 (wiki) | prefill speed-up | "
        "decode speed-up | predicted / measured build s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        g, c, cm = r["eval_gpu_bf16"], r["eval_cpu_fp32"], r["cost_model"]
        t = g["throughput"] or {}
        lines.append(
            f"| {r['model']} | {r['streamed_vs_resident_max_abs']:.2e} | {r.get('ray_vs_resident_max_abs', float('nan')):.2e} | {g['perplexity']['wiki-sample']:.3f} | "
            f"{c['perplexity']['wiki-sample']:.3f} | {t.get('prefill_speedup', float('nan')):.2f} | "
            f"{t.get('decode_speedup', float('nan')):.2f} | {cm['predicted_seconds']:.1f} / {cm['measured_seconds']:.1f} |"
        )
    lines += [
        "",
        "| model | fisher streamed vs resident bf16 (max abs) | dense ppl, --device-map auto (wiki) | its device map |",
        "|---|---:|---:|---|",
    ]
    for r in results:
        spread = r.get("eval_device_map") or {"perplexity": {"wiki-sample": float("nan")}, "device_map": "-"}
        lines.append(
            f"| {r['model']} | {r['fisher_streamed_vs_resident_max_abs']:.2e} | {spread['perplexity']['wiki-sample']:.3f} | {spread['device_map']} |"
        )
    return "\n".join(lines) + "\n"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="smollm2-135m,gemma3-270m")
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--out", default=os.environ.get("OUT", "bench/results"))
    parser.add_argument("--write-reference", action="store_true", help="build the CPU tables and store them in the reference file")
    parser.add_argument("--no-ray", action="store_true", help="skip the one-worker Ray build on the GPU")
    parser.add_argument("--device", default="cuda", help="cuda (the check); cpu runs every step as a smoke test of this script")
    parser.add_argument("--eval-samples", type=int, default=8)
    parser.add_argument("--rates", default=RATES, help="the table's rate grid (a smaller one for a CPU smoke run)")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = script_argv(argv)
    args = build_parser().parse_args(argv)
    names = [n.strip() for n in args.models.split(",") if n.strip()]
    references = cpu_references(args, names)
    if args.write_reference:
        note(f"wrote {REFERENCE}")
        return 0
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("gpu_check: no CUDA device is visible; nothing to check (--device cpu smoke-tests the script)", file=sys.stderr)
        return 2
    env = {"device": args.device, "torch": torch.__version__, "cuda": torch.version.cuda}
    if torch.cuda.is_available():
        env |= {"gpu": torch.cuda.get_device_name(0), "memory_gib": round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1)}
    results = []
    for name in names:
        results.append(check_model(args, name, references[name]))
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "gpu_check.json").write_text(json.dumps({"env": env, "results": results}, indent=2, default=str))
    text = with_header(markdown(results, env), SCRIPT, argv, files=["gpu_check.json"])
    (Path(args.out) / "gpu_check.md").write_text(text)
    print(text, end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
