"""Zeroth-order step time: one MaZO and one MeZO step against two plain forward passes of the same batch.

The issue's targets: a MaZO step at most 1.3x and a MeZO step at most 2x the time of two plain
forward passes (the two loss evaluations a ZO step cannot avoid). Measured on a built-in model
(dense, or a checkpoint given with --model) at the recovery defaults (two tasks, 2 windows x 128
tokens each per step), in one process, each timing the median of --reps repetitions after one
warm-up:

* two plain forward passes with the next-token loss (``multitask_loss``, no gradients);
* one ZO step (``ZORun.step``: two perturbed passes and the update) for MaZO and MeZO, with the
  ``lm`` objective and with ``kd`` (the dense teacher's pass added, once per step);
* with --baseline-rev, the same steps with ``recover_zo`` as it was at that git revision (the
  per-step clones and ``z`` allocations), for the before/after comparison.

    python bench/bench_zo_step.py [--model smollm2-135m] [--reps 5] [--baseline-rev 13348a0]

Writes bench/results/zo_step.md (with the command and the load average before and after).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from report import RESULTS, command_line, machine_line, script_argv, write_result

from gap_engine.core.progress import NO_HOOKS
from gap_engine.model.loading import load_model
from gap_engine.pipeline.recovery import RecoverySettings
from gap_engine.recover import zo as recover_zo
from gap_engine.recover.distill import Objective
from gap_engine.recover.train import TaskData, ZORun, multitask_loss

SCRIPT = "bench/bench_zo_step.py"
ZO_PATHS = {"13348a0": "gap_engine/recover_zo.py"}  # where recover_zo lived before the layered packages


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m", help="built-in name or checkpoint folder (the student)")
    p.add_argument("--teacher", default=None, help="the kd teacher (default: the checkpoint's base model, or --model)")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--batch-size", type=int, default=2, help="windows per task per step")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--baseline-rev", default=None, help="git revision whose recover_zo to time as the baseline")
    p.add_argument("--out", default=str(RESULTS / "zo_step.md"))
    return p


def parse_args(argv=None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def median_seconds(fn, reps: int) -> float:
    fn()  # warm-up: allocator, kernels, first-touch pages
    times = []
    for _ in range(reps):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def old_zo_module(rev: str):
    """recover_zo as it was at ``rev``, imported under another name."""
    source = subprocess.run(
        ["git", "-C", str(ROOT), "show", f"{rev}:{ZO_PATHS.get(rev, 'gap_engine/recover/zo.py')}"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    path = Path(tempfile.mkdtemp()) / "recover_zo_baseline.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("recover_zo_baseline", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


def time_method(lm, teacher, method: str, args, zo_module=None) -> dict:
    """Median seconds of one step of ``method`` with each objective (the module's zo_step when given)."""
    settings = RecoverySettings(
        method=method, tasks=("wiki-sample", "news-sample"), batch_size=args.batch_size, seq_len=args.seq_len, lr=1e-6
    ).validate()
    data = TaskData(lm, settings)
    batch = data.batch(0)
    out = {}
    for name in ("lm", "kd"):
        objective = Objective(name, teacher=teacher.model if name == "kd" else None)
        run = ZORun(lm, settings, objective)
        run.prepare(data, NO_HOOKS)
        if zo_module is None:
            out[name] = median_seconds(lambda: run.step(0, batch, 1e-6), args.reps)
            print(f"{method} {name}: {out[name]:.3f} s", flush=True)  # as it goes: a loaded machine may not reach the table
            continue
        targets = [zo_module.ZOTarget(t.name, t.linear, t.columns) for t in run.targets]

        def old_step():
            log_p = objective.teacher_log_probs(batch)
            loss = lambda: float(objective.per_task(lm.model, batch, 2, log_p).mean())  # noqa: E731
            zo_module.zo_step(lm.model, targets, loss, recover_zo.step_seed(0, 0), 1e-3, 1e-6)

        out[name] = median_seconds(old_step, args.reps)
        print(f"{method} {name} (baseline): {out[name]:.3f} s", flush=True)
    return out


def main(argv=None) -> int:
    argv = script_argv(argv)
    args = parse_args(argv)
    command = command_line(SCRIPT, argv)
    load_before, started = os.getloadavg(), time.perf_counter()
    lm = load_model(args.model)
    teacher_name = args.teacher or (lm.pruned_from or {}).get("model") or args.model
    teacher = load_model(teacher_name)
    settings = RecoverySettings(tasks=("wiki-sample", "news-sample"), batch_size=args.batch_size, seq_len=args.seq_len).validate()
    batch = TaskData(lm, settings).batch(0)

    def two_forwards():
        with torch.no_grad():
            multitask_loss(lm.model, batch, 2)
            multitask_loss(lm.model, batch, 2)

    forward2 = median_seconds(two_forwards, args.reps)
    with torch.no_grad():
        teacher_pass = median_seconds(lambda: Objective("kd", teacher=teacher.model).teacher_log_probs(batch), args.reps)
    print(f"two forwards: {forward2:.3f} s, teacher pass: {teacher_pass:.3f} s, load {os.getloadavg()}", flush=True)
    rows = {m: time_method(lm, teacher, m, args) for m in ("mazo", "mezo")}
    baseline = {}
    if args.baseline_rev:
        old = old_zo_module(args.baseline_rev)
        baseline = {m: time_method(lm, teacher, m, args, old) for m in ("mazo", "mezo")}
    targets = {"mazo": 1.3, "mezo": 2.0}
    lines = [
        "# Zeroth-order step time against two plain forward passes",
        "",
        f"Command: `{command}`",
        "",
        f"Model {args.model} ({lm.param_count():,} parameters), teacher {teacher_name}; batch: 2 tasks x "
        f"{args.batch_size} windows x {args.seq_len} tokens; float32; median of {args.reps} after a warm-up.",
        "",
        machine_line(load_before, started),
        "",
        f"Two plain forward passes (no gradients, next-token loss): **{forward2:.3f} s**. "
        f"One teacher pass (kd's extra, log-softmax at temperature 1): {teacher_pass:.3f} s.",
        "",
        "| method | objective | step (s) | x two forwards | target | met |"
        + (f" before (rev {args.baseline_rev}, s) | x two forwards before |" if baseline else ""),
        "|---|---|---:|---:|---:|---|" + ("---:|---:|" if baseline else ""),
    ]
    for method, by_objective in rows.items():
        for name, seconds in by_objective.items():
            ratio = seconds / forward2
            met = "yes" if ratio <= targets[method] else f"no (by {ratio - targets[method]:.2f}x)"
            row = f"| {method} | {name} | {seconds:.3f} | {ratio:.2f} | {targets[method]:.1f} | {met} |"
            if baseline:
                old = baseline[method][name]
                row += f" {old:.3f} | {old / forward2:.2f} |"
            lines.append(row)
    lines += [
        "",
        "The targets are defined for the ZO step itself (the lm rows); a kd step adds one teacher forward pass "
        "(no perturbation, no update), so its ratio is about the lm ratio plus the teacher's share.",
        "",
    ]
    write_result(Path(args.out), lines, SCRIPT, argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
