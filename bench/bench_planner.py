"""Benchmark of gap_engine.core.knapsack at the target size: 64 components x 16 rates x 4096 buckets.

Times (median of repeats, time.perf_counter) the full Pareto front, single-budget solves,
and a pure-Python version of the same covering DP on the same bucketed instance, checks
that the two DPs agree, and prints a markdown table. Target: full front <= 50 ms.

    python bench/bench_planner.py [--repeats 21] [--reference-repeats 3]
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")  # one core, as the target says
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the grid-uniform reference
from reference import uniform_choice

from gap_engine.core.knapsack import solve_budget, solve_front

N_COMPONENTS = 64
N_RATES = 16
N_BUCKETS = 4096
TARGET_MS = 50.0


def make_instance(seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A Llama-like table: 32 attention + 32 MLP components, convex noisy loss curves."""
    rng = np.random.default_rng(seed)
    rate_grid = np.linspace(0.0, 0.75, N_RATES)  # (R,)
    sizes = np.where(np.arange(N_COMPONENTS) % 2 == 0, 16_777_216, 45_088_768)  # (C,) attn / MLP params
    costs = np.round(rate_grid[None, :] * sizes[:, None]).astype(np.int64)  # (C, R)
    sensitivity = rng.lognormal(mean=0.0, sigma=1.0, size=(N_COMPONENTS, 1))  # (C, 1)
    losses = sensitivity * rate_grid[None, :] ** 2 + rng.normal(0.0, 1e-3, (N_COMPONENTS, N_RATES))  # (C, R)
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


def median_ms(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=21, help="timed runs of each numpy solve")
    parser.add_argument("--reference-repeats", type=int, default=3, help="timed runs of the pure-Python DP")
    args = parser.parse_args()

    costs, losses, rate_grid = make_instance()
    total = int(costs[:, -1].sum())
    front = solve_front(costs, losses, n_buckets=N_BUCKETS)
    size = int(front.bucket_size)
    bucketed = np.minimum((costs + size // 2) // size, front.budgets[-1])
    reference = reference_front(bucketed.tolist(), losses.tolist(), int(front.budgets[-1]))
    agree = np.allclose(reference, front.best_loss, rtol=1e-12, atol=1e-12)

    rows = []
    front_ms = median_ms(lambda: solve_front(costs, losses, n_buckets=N_BUCKETS), args.repeats)
    rows.append(("full front, numpy (`solve_front`)", front_ms))
    for share in (0.3, 0.7):
        budget = share * total
        ms = median_ms(lambda: solve_budget(costs, losses, removed_params=budget, n_buckets=N_BUCKETS), args.repeats)
        path = "covering DP" if 2 * budget <= total else "slack DP from the top"
        rows.append((f"one budget, {share:.0%} of removable (`solve_budget`, {path})", ms))
    ref_ms = median_ms(lambda: reference_front(bucketed.tolist(), losses.tolist(), int(front.budgets[-1])), args.reference_repeats)
    rows.append(("full front, pure Python reference", ref_ms))

    print(f"## {N_COMPONENTS} components x {N_RATES} rates x {N_BUCKETS} buckets\n")
    print(
        f"- {platform.python_implementation()} {platform.python_version()}, numpy {np.__version__}, "
        f"{cpu_name()} ({os.cpu_count()} logical CPUs; numpy elementwise ops run on one)"
    )
    print(f"- most removable W = {total:,} parameters, bucket size {size:,}, B + 1 = {len(front.budgets)} budgets")
    print(f"- median of {args.repeats} runs (pure Python: {args.reference_repeats}), after one warm-up\n")
    print("| solve | median ms |")
    print("|---|---:|")
    for name, ms in rows:
        print(f"| {name} | {ms:.2f} |")
    print()
    print(f"- pure Python / numpy full front: **{ref_ms / front_ms:.0f}x**")
    print(f"- numpy and pure-Python fronts agree on all {len(front.budgets)} budgets: {agree}")
    verdict = "met" if front_ms <= TARGET_MS else "MISSED"
    print(f"- target full front <= {TARGET_MS:.0f} ms: {verdict} ({front_ms:.2f} ms)")

    budget = 0.3 * total
    planned = front.plan_at(budget)
    uniform = uniform_choice(costs, rate_grid, budget)
    picked = np.arange(N_COMPONENTS)
    print(
        f"- at 30% of removable: DP summed loss {losses[picked, planned].sum():.4f} "
        f"(removes {costs[picked, planned].sum():,}) vs uniform rate {rate_grid[uniform[0]]:.2f} "
        f"{losses[picked, uniform].sum():.4f} (removes {costs[picked, uniform].sum():,})"
    )
    if not agree:
        sys.exit("numpy and pure-Python DPs disagree")


if __name__ == "__main__":
    main()
