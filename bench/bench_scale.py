"""Scale on the CPU: precision, streaming, Ray workers, and the cost model.

Four questions, each answered side by side in one run on SmolLM2-135M (and Gemma 3 270M for
the cost model), wiki-sample calibration windows, exact tables:

1. float32 vs bfloat16: table build time, and the held-out perplexity of the 20% DP plan
   each table gives (the pruned model is evaluated in float32 either way). The yardstick for
   "noise" is the same float32 table from other calibration windows (seed 1).
2. Streamed vs resident: build time and peak resident memory (each build in its own process,
   ``ru_maxrss``), and whether the tables are identical.
3. Ray with 1 and 2 local workers vs one process: build time (Ray's start-up apart) and
   whether the tables are identical.
4. The cost model against measured builds: predicted vs measured seconds, for both built-in
   models, exact and fisher, with this machine's measured (cached) profile.
5. Before and after: the same exact and fisher tables and a perplexity with the code of the
   commit this work started from (``--base``, exported with ``git archive``) and with this
   checkout, each in its own process, alternated, so "nothing got slower on the CPU" is a
   side-by-side measurement and not a recollection.

Usage: python bench/bench_scale.py [--samples 4 --seq-len 64 --rates 0,0.25,0.5,0.75] [--skip ray,...] [--base COMMIT]
Prints a markdown report on stdout (progress on stderr).
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # see bench_tables.py: shared cores

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from report import command_line, machine_description, script_argv, write_result

from gap_engine.core.config import WindowSpec
from gap_engine.core.device import DeviceSpec, resolve
from gap_engine.data.windows import calibration_windows, heldout_windows
from gap_engine.evaluate.metrics import perplexity
from gap_engine.model.loading import load_model
from gap_engine.pipeline.cost_model import ModelShape, estimate_build, measured_profile
from gap_engine.pipeline.stages import plan_for, pruned_as_saved
from gap_engine.tables.artefact import TableSpec, parse_rate_grid
from gap_engine.tables.build import measure_table

SCRIPT = "bench/bench_scale.py"

BUDGET = 0.2


def note(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def timed(label: str, fn):
    note(f"{label} ...")
    wall, cpu = time.perf_counter(), time.process_time()
    result = fn()
    seconds = (time.perf_counter() - wall, time.process_time() - cpu)
    note(f"{label}: {seconds[0]:.1f} s wall, {seconds[1]:.1f} s CPU")
    return result, seconds


def spec_for(args, seed: int = 0, **fields) -> TableSpec:
    windows = WindowSpec("wiki-sample", args.samples, args.seq_len, seed, args.batch_size)
    return TableSpec(windows=windows, rate_grid=parse_rate_grid(args.rates), **fields)


def load_avg() -> str:
    return " / ".join(f"{x:.1f}" for x in os.getloadavg())


# ---- 1. precision ---------------------------------------------------------------------------------
def precision(args) -> list[str]:
    out = ["## 1. float32 vs bfloat16 on the CPU (exact table, then the 20% DP plan in float32)", ""]
    fp32 = load_model("smollm2-135m")
    bf16 = load_model("smollm2-135m", DeviceSpec("cpu", "bfloat16"))
    heldout = heldout_windows(fp32.tokenizer, WindowSpec("wiki-sample", args.eval_samples, args.eval_seq_len))
    rows, tables = [], {}
    for label, lm, seed in (("float32", fp32, 0), ("bfloat16", bf16, 0), ("float32, seed 1", fp32, 1)):
        spec = spec_for(args, seed)
        windows = calibration_windows(lm.tokenizer, spec.windows)
        table, (wall, cpu) = timed(f"exact table, {label}", lambda: measure_table(lm, spec, windows))
        plan = plan_for(fp32, table, BUDGET)
        pruned, _ = pruned_as_saved(fp32, plan, spec.windows, save_dtype="float32")
        ppl = perplexity(pruned, heldout, args.batch_size)
        tables[label] = table
        rows.append((label, wall, cpu, plan.predicted_loss, ppl, plan))
    base = rows[0]
    out += [
        "| table | build (wall) | build (CPU) | vs float32 (wall) | plan: predicted loss | plan: held-out ppl | same rates as float32 plan |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for label, wall, cpu, predicted, ppl, plan in rows:
        same = np.mean(np.array(plan.attention_rates + plan.mlp_rates) == np.array(base[5].attention_rates + base[5].mlp_rates))
        out.append(f"| {label} | {wall:.1f} s | {cpu:.1f} s | {wall / base[1]:.2f}x | {predicted:.4f} | {ppl:.3f} | {same:.0%} |")
    diff = np.abs(tables["bfloat16"].cell_objective - tables["float32"].cell_objective)
    noise = np.abs(tables["float32, seed 1"].delta - tables["float32"].delta)
    out += [
        "",
        f"Cells: |bf16 - fp32| objective max {diff.max():.4f}, median {np.median(diff):.4f} nats; the same fp32 table "
        f"from other windows (seed 1) differs by max {noise.max():.4f}, median {np.median(noise):.4f} nats in its deltas. "
        f"Held-out perplexity on {args.eval_samples} x {args.eval_seq_len} wiki-sample tokens never used for calibration; "
        f"the dense model: {perplexity(fp32, heldout, args.batch_size):.3f}.",
        "",
    ]
    return out


# ---- 2. streaming (each build in its own process, for its peak memory) --------------------------
def child_build(args) -> None:
    """Build one table in this process and print its time, peak RSS and values as JSON."""
    stream = args.child == "streamed"
    lm = load_model("smollm2-135m", DeviceSpec("cpu", "float32", stream=stream))
    spec = spec_for(args)
    windows = calibration_windows(lm.tokenizer, spec.windows)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    table, (wall, cpu) = timed(f"{args.child} build", lambda: measure_table(lm, spec, windows))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({"wall": wall, "cpu": cpu, "rss_before_kb": before, "peak_kb": peak, "cells": table.cell_objective.tolist()}))


def streaming(args) -> list[str]:
    results = {}
    for kind in ("resident", "streamed"):
        command = [
            sys.executable,
            __file__,
            "--child",
            kind,
            "--samples",
            str(args.samples),
            "--seq-len",
            str(args.seq_len),
            "--rates",
            args.rates,
            "--batch-size",
            str(args.batch_size),
        ]
        note(f"child process: {kind}")
        done = subprocess.run(command, capture_output=True, text=True, check=True)
        results[kind] = json.loads(done.stdout.strip().splitlines()[-1])
    r, s = results["resident"], results["streamed"]
    same = np.array_equal(np.array(r["cells"]), np.array(s["cells"]))
    out = [
        "## 2. Streamed vs resident (float32, one process each)",
        "",
        "| build | wall | CPU | peak RSS | RSS after loading | identical table |",
        "|---|---:|---:|---:|---:|---|",
    ]
    for kind, res in results.items():
        out.append(
            f"| {kind} | {res['wall']:.1f} s | {res['cpu']:.1f} s | {res['peak_kb'] / 1024:.0f} MiB | {res['rss_before_kb'] / 1024:.0f} MiB | {same if kind == 'streamed' else '-'} |"
        )
    out += [
        "",
        f"Streamed / resident: **{s['wall'] / r['wall']:.2f}x wall, {s['cpu'] / r['cpu']:.2f}x CPU**. On the CPU the device *is* "
        "the host, so streaming moves nothing and cannot lower the peak: it runs the same arithmetic in another loop order "
        "(blocks outermost, cells in groups), which is what this row prices. What it saves on an accelerator is device "
        "memory: only one block, the embeddings/LM head and the cells in flight live there (`bench/plan_scale.py` prices "
        "it for 8B and 70B models; `bench/gpu_check.py` measures it).",
        "",
    ]
    return out


# ---- 3. Ray ----------------------------------------------------------------------------------------
def ray_workers(args) -> list[str]:
    import ray

    from gap_engine.tables.distributed import RayCells, RaySettings, start_ray

    lm = load_model("smollm2-135m")
    spec = spec_for(args)
    windows = calibration_windows(lm.tokenizer, spec.windows)
    single, (single_wall, single_cpu) = timed("single process", lambda: measure_table(lm, spec, windows))
    out = [
        "## 3. Ray: local workers vs one process (float32, exact)",
        "",
        "| build | wall | driver CPU | vs one process (wall) | worker processes | identical table |",
        "|---|---:|---:|---:|---:|---|",
        f"| one process | {single_wall:.1f} s | {single_cpu:.1f} s | 1.00x | - | - |",
    ]
    _, (start_wall, _) = timed("ray start (2 CPUs)", lambda: start_ray(RaySettings(workers=2)))
    for workers in (1, 2):
        cells = RayCells(RaySettings(workers=workers))
        # The first build with n workers also starts their processes (torch imports): timed apart.
        timed(f"ray warm-up, {workers} worker(s)", lambda: measure_table(lm, spec, windows[:, : min(8, args.seq_len)], cells=cells))
        table, (wall, cpu) = timed(f"ray, {workers} worker(s)", lambda: measure_table(lm, spec, windows, cells=cells))
        same = np.array_equal(table.cell_objective, single.cell_objective)
        out.append(
            f"| Ray, {workers} worker(s) | {wall:.1f} s | {cpu:.1f} s | {wall / single_wall:.2f}x | {table.extras['ray_worker_processes']} | {same} |"
        )
    ray.shutdown()
    out += [
        "",
        f"Ray's local start took {start_wall:.1f} s and each worker's first build (process start, torch import) is timed "
        "apart as a warm-up on 8-token windows. Two workers on this machine share its two cores with the driver and every "
        "other session, so the speed-up is bounded by the free cores, not by the method (see the load average).",
        "",
    ]
    return out


# ---- 4. cost model -----------------------------------------------------------------------------------
def cost_model(args) -> list[str]:
    out = [
        "## 4. The cost model against measured builds (CPU float32, measured profile)",
        "",
        "| model | estimator | cells | predicted | measured (wall) | measured / predicted |",
        "|---|---|---:|---:|---:|---:|",
    ]
    placement = resolve(None)
    for name in ("smollm2-135m", "gemma3-270m"):
        lm = load_model(name)
        shape = ModelShape.from_config(lm.model.config, name)
        profile, (calib_wall, _) = timed(
            f"profile of {name}",
            lambda: measured_profile(placement, shape, seq_len=min(args.seq_len, 512), batch=min(args.batch_size, 4), refresh=True),
        )
        for estimator in ("exact", "fisher"):
            spec = spec_for(args, estimator=estimator)
            windows = calibration_windows(lm.tokenizer, spec.windows)
            predicted = estimate_build(shape, spec, profile, dtype_bytes=4)
            table, (wall, _) = timed(f"{estimator} table of {name}", lambda: measure_table(lm, spec, windows))
            cells = table.extras.get("distinct_cells", 0)
            out.append(
                f"| {name} | {estimator} | {cells} (predicted {predicted.cells}) | {predicted.seconds:.1f} s | {wall:.1f} s | {wall / predicted.seconds:.2f} |"
            )
        out.append(
            f"| | profile | | {profile.block_flops / 1e9:.1f} GFLOP/s blocks, {profile.head_flops / 1e9:.1f} GFLOP/s LM head, measured in {calib_wall:.1f} s | | |"
        )
    out += [
        "",
        "Each profile was measured right before its model's builds (`refresh=True`), so both saw about the same load.",
        "",
    ]
    return out


# ---- 5. before and after ----------------------------------------------------------------------------
# Runs against the base commit's package too (which has no devices): only APIs both have, imported
# from the layered packages or, failing that, the base commit's flat modules.
BEFORE_AFTER_CHILD = """
import json, sys, time, os
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
import torch
try:  # the layered package (this commit on)
    from gap_engine.core.config import WindowSpec
    from gap_engine.data.windows import calibration_windows, heldout_windows
    from gap_engine.evaluate.metrics import perplexity
    from gap_engine.model.loading import load_model
    from gap_engine.tables.artefact import TableSpec, parse_rate_grid
    from gap_engine.tables.build import measure_table
except ImportError:  # the base commit's flat modules
    from gap_engine.core.config import WindowSpec
    from gap_engine.data import calibration_windows, heldout_windows
    from gap_engine.evaluate import perplexity
    from gap_engine.model.loading import load_model
    from gap_engine.tables import TableSpec, measure_table, parse_rate_grid
samples, seq_len, rates, batch = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
lm = load_model("smollm2-135m")
out = {}
for estimator in ("exact", "fisher"):
    spec = TableSpec(windows=WindowSpec("wiki-sample", samples, seq_len, 0, batch), rate_grid=parse_rate_grid(rates), estimator=estimator)
    windows = calibration_windows(lm.tokenizer, spec.windows)
    wall, cpu = time.perf_counter(), time.process_time()
    table = measure_table(lm, spec, windows)
    out[estimator] = {"wall": time.perf_counter() - wall, "cpu": time.process_time() - cpu, "cells": table.cell_objective.tolist()}
held = heldout_windows(lm.tokenizer, WindowSpec("wiki-sample", 8, 128))
wall, cpu = time.perf_counter(), time.process_time()
ppl = perplexity(lm, held, batch)
out["perplexity"] = {"wall": time.perf_counter() - wall, "cpu": time.process_time() - cpu, "value": ppl}
print(json.dumps(out))
"""


def before_after(args) -> list[str]:
    import tempfile

    root = Path(__file__).resolve().parents[1]
    base_dir = Path(tempfile.mkdtemp(prefix="gap_base_"))
    archive = subprocess.run(["git", "-C", str(root), "archive", args.base, "gap_engine"], capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(base_dir)], input=archive, check=True)
    env = dict(os.environ, GAP_CACHE_DIR=os.environ.get("GAP_CACHE_DIR", str(root / "cache")))
    runs: dict[str, list[dict]] = {"before": [], "after": []}
    for repeat in range(args.repeats):
        for label, path in (("before", base_dir), ("after", root)):
            note(f"{label} ({repeat + 1}/{args.repeats}): exact + fisher tables and a perplexity")
            done = subprocess.run(
                [sys.executable, "-c", BEFORE_AFTER_CHILD, str(args.samples), str(args.seq_len), args.rates, str(args.batch_size)],
                capture_output=True,
                text=True,
                check=True,
                env=env | {"PYTHONPATH": str(path)},
                cwd=str(path),
            )
            runs[label].append(json.loads(done.stdout.strip().splitlines()[-1]))
    out = [
        f"## 5. Before and after on the CPU (float32): base `{args.base}` vs this checkout, {args.repeats} alternated runs each",
        "",
        "| step | before (best CPU s) | after (best CPU s) | after / before (CPU) | before (best wall s) | after (best wall s) | same values |",
        "|---|---:|---:|---:|---:|---:|---|",
    ]
    for step in ("exact", "fisher", "perplexity"):
        b = min(r[step]["cpu"] for r in runs["before"]), min(r[step]["wall"] for r in runs["before"])
        a = min(r[step]["cpu"] for r in runs["after"]), min(r[step]["wall"] for r in runs["after"])
        key = "cells" if step != "perplexity" else "value"
        same = runs["before"][0][step][key] == runs["after"][0][step][key]
        out.append(
            f"| {step} table | {b[0]:.1f} | {a[0]:.1f} | {a[0] / b[0]:.2f}x | {b[1]:.1f} | {a[1]:.1f} | {same} |".replace(
                "perplexity table", "held-out perplexity"
            )
        )
    out += [
        "",
        "Best of the alternated runs: the load of other sessions only ever adds time, so the minimum is the fairest estimate of each.",
        "",
    ]
    return out


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--rates", default="0,0.25,0.5,0.75")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--eval-samples", type=int, default=8)
    parser.add_argument("--eval-seq-len", type=int, default=128)
    parser.add_argument("--skip", default="", help="comma list of parts to skip: precision, streaming, ray, cost, before-after")
    parser.add_argument("--base", default="0018aa2", help="the commit to compare with in part 5 (where this work started)")
    parser.add_argument("--repeats", type=int, default=2, help="alternated runs of each side in part 5")
    parser.add_argument("--child", choices=("resident", "streamed"), help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, default=None, help="also write the markdown report here")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = script_argv(argv)
    args = build_parser().parse_args(argv)
    if args.child:
        child_build(args)
        return 0
    skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    started = time.perf_counter()
    report = [
        "# Scale benchmark (bench/bench_scale.py)",
        "",
        f"- command: `{command_line(SCRIPT, argv)}`",
        f"- {machine_description()}",
        f"- tables: exact, split, nll, wanda, {args.samples} x {args.seq_len} wiki-sample tokens, rates {args.rates}",
        f"- load average at start (1/5/15 min): {load_avg()}",
        "",
    ]
    print("\n".join(report), flush=True)  # each part as it completes: a failure later keeps the earlier ones
    for name, part in (
        ("precision", precision),
        ("streaming", streaming),
        ("ray", ray_workers),
        ("cost", cost_model),
        ("before-after", before_after),
    ):
        if name not in skip:
            lines = part(args) + [f"(load average after this part: {load_avg()})", ""]
            print("\n".join(lines), flush=True)
            report += lines
    report.append(f"Total {time.perf_counter() - started:.0f} s; load average at the end {load_avg()}.")
    print(report[-1])
    if args.out:
        write_result(args.out, report, SCRIPT, argv)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
