"""Benchmark of the planner's DP front (core/knapsack.py) at two shapes, against the loop it replaced.

Shapes: 64 components x 16 rates x 4,096 buckets (an 8B model's 32 layers) and 160 x 32 x
8,192 (a 70B model's 80 layers, Llama-3-70B sizes). For each, times (median of repeats,
time.perf_counter, one thread) `solve_front` and `tests/reference.py`'s `loop_front` (the
same DP as a plain loop) in alternation, so both see the same load; checks that
the two fronts are identical on every budget (values, choices, removals); times
single-budget solves; and, at the small shape, a pure-Python version of the covering DP.
Writes markdown (``--out``, default ``bench/results/planner.md``) with the machine and the load
average before and after. Targets: the 160 x 32 x 8,192 front <= 50 ms; the 64 x 16 x 4,096
front no slower than before.

    python bench/bench_planner.py [--repeats 21] [--reference-repeats 3] [--out FILE]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")  # one core, as the target says
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the references
from reference import loop_front, uniform_choice
from report import RESULTS, command_line, machine_line, script_argv, write_result

from gap_engine.core.knapsack import solve_budget, solve_front, undominated

SCRIPT = "bench/bench_planner.py"
TARGET_MS = 50.0

# name -> (components, rates, buckets, attention parameters, MLP parameters) per layer
SHAPES = {
    "8B": (64, 16, 4096, 16_777_216, 45_088_768),
    "70B": (160, 32, 8192, 2 * 8192 * 8192 + 2 * 8192 * 1024, 3 * 8192 * 28672),
}


def make_instance(n_comp: int, n_rates: int, attn: int, mlp: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A Llama-like table: attention and MLP components alternate, convex noisy loss curves."""
    rng = np.random.default_rng(seed)
    rate_grid = np.linspace(0.0, 0.75, n_rates)  # (R,)
    sizes = np.where(np.arange(n_comp) % 2 == 0, attn, mlp)  # (C,) attn / MLP params
    costs = np.round(rate_grid[None, :] * sizes[:, None]).astype(np.int64)  # (C, R)
    sensitivity = rng.lognormal(mean=0.0, sigma=1.0, size=(n_comp, 1))  # (C, 1)
    losses = sensitivity * rate_grid[None, :] ** 2 + rng.normal(0.0, 1e-3, (n_comp, n_rates))  # (C, R)
    losses[:, 0] = 0.0
    return costs, losses, rate_grid


def reference_front(bucketed: list[list[int]], losses: list[list[float]], n_budget: int) -> list[float]:
    """The covering DP of the planner's docstring in plain Python lists (no numpy)."""
    width = n_budget + 1
    prev = [0.0] + [math.inf] * n_budget
    for cost_row, loss_row in zip(bucketed, losses):
        best = [math.inf] * width
        for shift, loss in zip(cost_row, loss_row):
            for b in range(width):
                cand = prev[b - shift if b > shift else 0] + loss
                if cand < best[b]:
                    best[b] = cand
        prev = best
    return prev


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def median_ms(fn: Callable[[], object], repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def side_by_side_ms(first: Callable[[], object], second: Callable[[], object], repeats: int) -> tuple[float, float, float, float]:
    """Medians of two functions timed in alternation, so a change of load hits both: wall ms of
    each, then this process's CPU ms of each (what the work cost when other processes share the cores)."""
    first(), second()  # warm-up
    walls: tuple[list[float], list[float]] = ([], [])
    cpus: tuple[list[float], list[float]] = ([], [])
    for _ in range(repeats):
        for i, fn in enumerate((first, second)):
            start, cpu = time.perf_counter(), time.process_time()
            fn()
            walls[i].append(time.perf_counter() - start)
            cpus[i].append(time.process_time() - cpu)
    wall_a, wall_b, cpu_a, cpu_b = (1e3 * statistics.median(times) for times in (*walls, *cpus))
    return wall_a, wall_b, cpu_a, cpu_b


def same_front(front, before: dict[str, np.ndarray]) -> bool:
    return all(np.array_equal(getattr(front, name), before[name]) for name in ("best_loss", "choices", "removed"))


def bench_shape(name: str, args: argparse.Namespace) -> bool:
    n_comp, n_rates, n_buckets, attn, mlp = SHAPES[name]
    costs, losses, rate_grid = make_instance(n_comp, n_rates, attn, mlp)
    total = int(costs[:, -1].sum())
    front = solve_front(costs, losses, n_buckets=n_buckets)
    identical = same_front(front, loop_front(costs, losses, None, n_buckets))
    size = int(front.bucket_size)
    bucketed = np.minimum((costs + size // 2) // size, front.budgets[-1])
    kept = undominated(bucketed, losses, np.ones_like(costs, dtype=bool))

    new_ms, old_ms, new_cpu, old_cpu = side_by_side_ms(
        lambda: solve_front(costs, losses, n_buckets=n_buckets), lambda: loop_front(costs, losses, None, n_buckets), args.repeats
    )
    rows = [
        (f"full front, vectorised (`solve_front`); CPU {new_cpu:.2f} ms", new_ms),
        (f"full front, the loop before issue 35 (`loop_front`); CPU {old_cpu:.2f} ms", old_ms),
    ]
    for share in (0.3, 0.7):
        budget = share * total
        ms = median_ms(lambda: solve_budget(costs, losses, removed_params=budget, n_buckets=n_buckets), args.repeats)
        path = "covering DP" if 2 * budget <= total else "slack DP from the top"
        rows.append((f"one budget, {share:.0%} of removable (`solve_budget`, {path})", ms))
    agree = True
    if name == "8B":
        reference = reference_front(bucketed.tolist(), losses.tolist(), int(front.budgets[-1]))
        agree = bool(np.allclose(reference, front.best_loss, rtol=1e-12, atol=1e-12))
        ref_ms = median_ms(lambda: reference_front(bucketed.tolist(), losses.tolist(), int(front.budgets[-1])), args.reference_repeats)
        rows.append(("full front, pure Python reference", ref_ms))

    print(f"## {name} shape: {n_comp} components x {n_rates} rates x {n_buckets:,} buckets\n")
    print(f"- most removable W = {total:,} parameters, bucket size {size:,}, B + 1 = {len(front.budgets):,} budgets")
    print(
        f"- options kept per component after dropping dominated ones: attention {int(kept[0].sum())} of {n_rates}, "
        f"MLP {int(kept[1].sum())} of {n_rates}"
    )
    print(f"- median of {args.repeats} runs, the two fronts alternating (pure Python: {args.reference_repeats}), after one warm-up\n")
    print("| solve | median wall ms |")
    print("|---|---:|")
    for label, ms in rows:
        print(f"| {label} | {ms:.2f} |")
    print()
    print(f"- before / now, full front: **{old_ms / new_ms:.1f}x** wall, {old_cpu / new_cpu:.1f}x CPU")
    print(f"- identical to the loop on all {len(front.budgets):,} budgets (values, choices, removals): {identical}")
    if name == "8B":
        print(f"- pure Python / now: {rows[-1][1] / new_ms:.0f}x; pure-Python values agree: {agree}")
        verdict = "met" if new_ms <= old_ms else "MISSED"
        print(f"- target no slower than before: {verdict} ({new_ms:.2f} ms vs {old_ms:.2f} ms)")
    else:
        verdict = "met" if new_ms <= TARGET_MS else "MISSED"
        print(f"- target full front <= {TARGET_MS:.0f} ms: {verdict} ({new_ms:.2f} ms wall, {new_cpu:.2f} ms CPU)")
    budget = 0.3 * total
    planned = front.plan_at(budget)
    uniform = uniform_choice(costs, rate_grid, budget)
    picked = np.arange(n_comp)
    print(
        f"- at 30% of removable: DP summed loss {losses[picked, planned].sum():.4f} "
        f"(removes {costs[picked, planned].sum():,}) vs uniform rate {rate_grid[uniform[0]]:.2f} "
        f"{losses[picked, uniform].sum():.4f} (removes {costs[picked, uniform].sum():,})\n"
    )
    return identical and agree


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=21, help="timed runs of each numpy solve")
    parser.add_argument("--reference-repeats", type=int, default=3, help="timed runs of the pure-Python DP")
    parser.add_argument("--out", type=Path, default=RESULTS / "planner.md", help="the markdown report")
    return parser


def main(argv: list[str] | None = None) -> None:
    argv = script_argv(argv)
    args = build_parser().parse_args(argv)
    load_start, started = os.getloadavg(), time.perf_counter()
    report = io.StringIO()
    with contextlib.redirect_stdout(report):  # every part prints its markdown; the report is all of it
        print(
            f"- {platform.python_implementation()} {platform.python_version()}, numpy {np.__version__}, "
            f"{cpu_name()} ({os.cpu_count()} logical CPUs; numpy elementwise ops run on one)\n"
        )
        ok = all([bench_shape(name, args) for name in SHAPES])
    lines = [
        "# Planner benchmark",
        "",
        f"Command (from the repository root; one thread, OMP_NUM_THREADS=1): `{command_line(SCRIPT, argv)}`",
        "",
        machine_line(load_start, started),
        "",
        "The two fronts are timed in alternation, so their ratio is measured under the same load; each also reports "
        "this process's CPU time. `loop_front` (in `tests/reference.py`) is the implementation the vectorised front "
        "replaced (one pass over every budget per option, two masked copies each).",
        "",
        *report.getvalue().rstrip("\n").splitlines(),
    ]
    write_result(args.out, lines, SCRIPT, argv)
    if not ok:
        sys.exit("the fronts disagree")


if __name__ == "__main__":
    main()
