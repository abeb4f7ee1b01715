"""Benchmark of the loss-table stage on SmolLM2-135M with wiki-sample (CPU).

Three questions, one run:

1. Speed: the fast exact build (stored block inputs, suffix-only forwards, masking,
   one measurement per distinct cut) against the naive build (a full forward of a sliced
   copy per cell), on the same windows; and how far the default 16-rate grid gets.
2. Estimates: the first-order (taylor) and second-order (fisher) tables: time, speed-up
   over the exact table, Spearman rank correlation with it, and what the planner makes of
   each at a 20% budget (the plan's loss read off the exact table).
3. Noise: one exact build that keeps every window's value apart (``tables.exact.window_cells``);
   tables from disjoint window groups play the part of two seeds. Reported: the share of
   negative cells, the group-to-group agreement, and how isotonic smoothing, more tokens
   and the KL objective change it.
4. The cache: `gap table` of the default table of smollm2-135m in a fresh process
   each, in an empty cache: the miss (a build), the hit found before anything loads
   (``tables.lookup``), and the hit the old way (the recorded stamps removed: the model
   loaded and the text read before the cache is read). Target: the hit at most 2 s and at
   least 10x faster than the miss.
5. The model's content fingerprint (every weight value, the config and the tokenizer: what
   every cache key and plan check names a model by) against reading the weights, side by
   side in one process; and a load of unchanged files, which reads the fingerprint its
   first load recorded. Target: hashing SmolLM2-135M under 1 s, a small fraction of a load.

Usage: python bench/bench_tables.py [--samples 2 --seq-len 64 --noise-samples 16 --noise-seq-len 32] [--skip speed,noise,cache,fingerprint]
Prints a markdown report on stdout (progress on stderr).
"""

from __future__ import annotations

import os

# Other processes share this machine's two cores: spinning OpenMP workers then make every
# small op wait for a time slice (25x slower blocks were seen). Passive waiting avoids it.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from scipy.stats import spearmanr

# The naive build is a test reference (tests/reference.py), not part of the package.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from reference import naive_build_table
from report import command_line, machine_description, script_argv, write_result

from gap_engine.core.config import FULL_RATE_GRID as DEFAULT_RATE_GRID
from gap_engine.core.config import WindowSpec
from gap_engine.core.fsutil import cache_root
from gap_engine.core.knapsack import solve_budget
from gap_engine.data.windows import calibration_windows
from gap_engine.model.loading import load_model
from gap_engine.model.units import block_geometries
from gap_engine.tables.artefact import TableSpec, isotonic_smooth
from gap_engine.tables.build import measure_table
from gap_engine.tables.exact import window_cells

SCRIPT = "bench/bench_tables.py"

GRID4 = (0.0, 0.25, 0.5, 0.75)
BUDGET = 0.20


def note(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


class Clock:
    """Wall and CPU seconds of one step (CPU time of this process, all threads).

    Other processes share this machine, so wall time swings with their load from minute to
    minute; this process's CPU time is what the work itself cost and compares two builds
    run minutes apart much more fairly. Speed-ups are given on both.
    """

    def __init__(self, wall: float, cpu: float):
        self.wall, self.cpu = wall, cpu

    def __str__(self) -> str:
        return f"{self.wall:.1f} s ({self.cpu:.1f} s CPU)"

    def ratio(self, other: Clock) -> str:
        """self / other as 'wall x (CPU x)'."""
        return f"{self.wall / other.wall:.2f}x ({self.cpu / other.cpu:.2f}x CPU)"


def timed(label: str, fn):
    note(f"{label} ...")
    wall, cpu = time.perf_counter(), time.process_time()
    result = fn()
    clock = Clock(time.perf_counter() - wall, time.process_time() - cpu)
    note(f"{label}: {clock}")
    return result, clock


def nonzero_cells(table_or_mask) -> np.ndarray:
    """Cells with rate > 0 that remove something (the ones a table measures)."""
    removed = table_or_mask.removed if hasattr(table_or_mask, "removed") else table_or_mask
    mask = removed > 0
    mask[:, 0] = False
    return mask


def spearman(a: np.ndarray, b: np.ndarray, mask: np.ndarray) -> float:
    return float(spearmanr(a[mask], b[mask])[0])


def plan_for(removed: np.ndarray, losses: np.ndarray, budget_params: float) -> np.ndarray:
    return solve_budget(removed, losses, removed_params=budget_params)


def plan_loss(choice: np.ndarray, losses: np.ndarray) -> float:
    return float(losses[np.arange(len(choice)), choice].sum())


# ---- 1 + 2: speed and estimates ------------------------------------------------------------------
def speed_and_estimates(lm, args) -> list[str]:
    base_windows = WindowSpec("wiki-sample", args.samples, args.seq_len, 0, args.batch_size)
    windows = calibration_windows(lm.tokenizer, base_windows)
    tokens = args.samples * args.seq_len
    base = dict(windows=base_windows)
    out = [f"## 1. Exact build vs naive build ({args.samples} windows x {args.seq_len} tokens = {tokens} tokens, split mode)", ""]
    out += [
        "| grid | cells (rate > 0) | distinct cells measured | naive build | exact build | speed-up | exact cells/s | max abs diff |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    spec4 = TableSpec(rate_grid=GRID4, **base)
    exact4, t_exact4 = timed("exact, 4-rate grid", lambda: measure_table(lm, spec4, windows))
    naive4, t_naive4 = timed("naive, 4-rate grid", lambda: naive_build_table(lm, spec4, windows=windows))
    cells4 = exact4.delta.shape[0] * (len(GRID4) - 1)
    diff4 = float(np.abs(exact4.cell_objective - naive4.cell_objective).max())
    out.append(
        f"| 0, 1/4, 1/2, 3/4 | {cells4} | {exact4.extras['distinct_cells']} | {t_naive4} | {t_exact4} "
        f"| **{t_naive4.ratio(t_exact4)}** | {cells4 / t_exact4.wall:.2f} | {diff4:.1e} |"
    )
    spec16 = TableSpec(rate_grid=DEFAULT_RATE_GRID, **base)
    exact16, t_exact16 = timed("exact, 16-rate grid", lambda: measure_table(lm, spec16, windows))
    # Every naive cell is one full forward, so the naive 16-rate build is estimated from the
    # naive 4-rate build's time per forward (its cells plus the dense reference).
    cells16 = exact16.delta.shape[0] * (len(DEFAULT_RATE_GRID) - 1)
    scale = (cells16 + 1) / (cells4 + 1)
    naive16 = Clock(t_naive4.wall * scale, t_naive4.cpu * scale)
    _, t_forwards = timed(f"{args.calibration_forwards} full forwards", lambda: full_forwards(lm, windows, args))
    out.append(
        f"| 0, 1/16, ..., 15/16 (default) | {cells16} | {exact16.extras['distinct_cells']} | {naive16} est. "
        f"| {t_exact16} | **{naive16.ratio(t_exact16)}** est. | {cells16 / t_exact16.wall:.2f} | - |"
    )
    per_forward = Clock(t_forwards.wall / args.calibration_forwards, t_forwards.cpu / args.calibration_forwards)
    out += [
        "",
        f"Times are wall seconds and, in brackets, this process's CPU seconds (other processes shared the two "
        f"cores, see the load average; CPU time is the fairer comparison). Every naive cell is one full forward "
        f"over the windows, so the naive 16-rate time is the naive 4-rate time scaled by (cells + 1); "
        f"a plain full forward timed right after the 16-rate build took {per_forward} "
        f"(the naive 4-rate build: {Clock(t_naive4.wall / (cells4 + 1), t_naive4.cpu / (cells4 + 1))} per cell). "
        f"Exact cells/s counts all table cells (rate > 0) per wall second of build, importance scores and the "
        f"dense pass included.",
        "",
    ]

    out += ["## 2. Gradient estimates vs the exact table (same windows, 16-rate grid)", ""]
    out += [
        "| estimator | time | speed-up over exact | Spearman vs exact (raw) | Spearman (smoothed) | "
        f"plan at {BUDGET:.0%}: predicted loss on exact smoothed table | on exact raw table |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    mask = nonzero_cells(exact16)
    budget = BUDGET * exact16.dense_prunable
    smooth_truth, raw_truth = exact16.losses(), exact16.losses(smoothed=False)
    exact_plan = plan_for(exact16.removed, smooth_truth, budget)
    out.append(f"| exact | {t_exact16} | 1x | 1 | 1 | {plan_loss(exact_plan, smooth_truth):.4f} | {plan_loss(exact_plan, raw_truth):.4f} |")
    for method in ("taylor", "fisher"):
        spec = TableSpec(estimator=method, rate_grid=DEFAULT_RATE_GRID, **base)
        approx, seconds = timed(f"{method} estimate", lambda: measure_table(lm, spec, windows))
        rho = spearman(exact16.delta, approx.delta, mask)
        rho_s = spearman(exact16.smoothed, approx.smoothed, mask)
        plan = plan_for(approx.removed, approx.losses(), budget)
        out.append(
            f"| {method} | {seconds} | {t_exact16.ratio(seconds)} | {rho:.3f} | {rho_s:.3f} | "
            f"{plan_loss(plan, smooth_truth):.4f} | {plan_loss(plan, raw_truth):.4f} |"
        )
    out += [
        "",
        f"Plans come from planner.solve_budget on each table's smoothed losses with a budget of {BUDGET:.0%} of the "
        f"prunable parameters ({budget:,.0f}); the last two columns are the plan's summed loss (nats per token) read "
        f"off the exact table, i.e. what the measured table predicts for each plan. Held-out perplexity of the plans "
        f"is measured elsewhere.",
        "",
    ]
    return out


def full_forwards(lm, windows, args) -> None:
    with torch.inference_mode():
        for _ in range(args.calibration_forwards):
            for start in range(0, windows.shape[0], args.batch_size):
                batch = windows[start : start + args.batch_size]
                logits = lm.model(input_ids=batch, use_cache=False).logits
                torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))


# ---- 3: noise -----------------------------------------------------------------------------------------
def _group_stats(values: np.ndarray, mask: np.ndarray, removed: np.ndarray, groups, budget: float, smoothed: bool) -> dict:
    """Agreement between tables of disjoint window groups (pairs of index arrays)."""
    rhos, rel, negative, same_rate, regret = [], [], [], [], []
    for a_idx, b_idx in groups:
        table_a, table_b = values[..., a_idx].mean(-1), values[..., b_idx].mean(-1)
        negative += [float((table_a[mask] < 0).mean()), float((table_b[mask] < 0).mean())]
        if smoothed:
            table_a, table_b = isotonic_smooth(table_a), isotonic_smooth(table_b)
        rhos.append(spearman(table_a, table_b, mask))
        rel.append(float(np.linalg.norm((table_a - table_b)[mask]) / np.linalg.norm(((table_a + table_b) / 2)[mask])))
        plan_a = plan_for(removed, table_a, budget)
        plan_b = plan_for(removed, table_b, budget)
        same_rate.append(float((plan_a == plan_b).mean()))
        regret.append(plan_loss(plan_a, table_b) - plan_loss(plan_b, table_b))
    return {
        "negative": np.mean(negative),
        "spearman": np.mean(rhos),
        "rel_diff": np.mean(rel),
        "same_rate": np.mean(same_rate),
        "regret": np.mean(regret),
    }


def noise(lm, args) -> list[str]:
    n, t = args.noise_samples, args.noise_seq_len
    window_spec = WindowSpec("wiki-sample", n, t, 1, args.batch_size)
    windows = calibration_windows(lm.tokenizer, window_spec)
    spec = TableSpec(windows=window_spec, rate_grid=GRID4)
    cells, seconds = timed("per-window exact cells (noise)", lambda: window_cells(lm, spec, windows))
    mask = cells.distinct.copy()
    prunable = sum(g.params_at("attn", 0.0) + g.params_at("mlp", 0.0) for g in block_geometries(lm))
    budget = BUDGET * prunable
    rng = np.random.default_rng(0)
    out = [
        f"## 3. Noise: tables from disjoint groups of windows ({n} windows x {t} tokens, seed 1, 4-rate grid, split mode)",
        "",
        f"One exact build kept every window's cell values ({seconds}); a group's table is the mean over "
        f"its windows, so two disjoint groups are two independent draws of calibration text (like two seeds) of "
        f"the same size. Each row averages {args.noise_splits} random splits. Columns: share of measured cells "
        f"with a negative raw value; Spearman and relative L2 difference between the two groups' tables over the "
        f"{int(mask.sum())} measured cells; and for the DP plans at {BUDGET:.0%} on each group's table, the share of "
        f"components given the same rate and the regret of group A's plan judged by group B's table (B's summed "
        f"loss of A's plan minus that of B's own optimum, in nats per token of the row's objective).",
        "",
        "| objective | windows per group (tokens) | table | negative cells | Spearman A vs B | rel. L2 diff | same rate in plans | regret of A's plan on B (nats) |",
        "|---|---:|---|---:|---:|---:|---:|---:|",
    ]
    sizes = [k for k in (1, 2, 4, 8, 16, 32) if 2 * k <= n]
    for objective in ("nll", "kl"):
        values = getattr(cells, objective)  # (C, R, N)
        for k in sizes:
            groups = []
            for _ in range(args.noise_splits):
                perm = rng.permutation(n)
                groups.append((perm[:k], perm[k : 2 * k]))
            for smoothed in (False, True):
                s = _group_stats(values, mask, cells.removed, groups, budget, smoothed)
                out.append(
                    f"| {objective} | {k} ({k * t}) | {'smoothed' if smoothed else 'raw'} | {s['negative']:.1%} | "
                    f"{s['spearman']:.3f} | {s['rel_diff']:.3f} | {s['same_rate']:.0%} | {s['regret']:.4f} |"
                )
    # How strongly the two objectives agree on the full set of windows, and the estimates on these windows.
    full = {"nll": cells.nll.mean(-1), "kl": cells.kl.mean(-1)}
    out += [
        "",
        f"On all {n} windows ({n * t} tokens), the NLL and KL tables rank the measured cells with Spearman "
        f"{spearman(full['nll'], full['kl'], mask):.3f}; {float((full['nll'][mask] < 0).mean()):.1%} of NLL cells are "
        f"negative (KL cells cannot be). Gradient estimates on the same {n} windows against these exact tables "
        f"(Spearman over the measured cells):",
        "",
        "| objective | estimator | time | Spearman vs exact |",
        "|---|---|---:|---:|",
    ]
    for objective, method in (("nll", "taylor"), ("nll", "fisher"), ("kl", "fisher")):
        est_spec = TableSpec(windows=window_spec, rate_grid=GRID4, objective=objective, estimator=method)
        approx, est_seconds = timed(f"{method} estimate of {objective}", lambda: measure_table(lm, est_spec, windows))
        out.append(f"| {objective} | {method} | {est_seconds} | {spearman(full[objective], approx.delta, mask):.3f} |")
    out.append("")
    return out


# ---- 4: the cache ----------------------------------------------------------------------------------
def gap_table_run(env: dict, out: Path) -> Clock:
    """`gap table` of the default table of smollm2-135m in a fresh process: its wall and CPU seconds."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    wall = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "gap_engine", "table", "--model", "smollm2-135m", "--out", str(out)],
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    wall = time.perf_counter() - wall
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode != 0:
        raise SystemExit(f"gap table failed ({done.returncode}): {done.stderr[-2000:]}")
    return Clock(wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime))


def cache_hit_and_miss(args) -> list[str]:
    root = Path(__file__).resolve().parents[1]
    with tempfile.TemporaryDirectory() as tmp:
        cache_dir = Path(tmp) / "cache"
        cache_dir.mkdir()
        (cache_dir / "models").symlink_to(cache_root() / "models", target_is_directory=True)  # the converted model, not its conversion
        env = dict(os.environ, GAP_CACHE_DIR=str(cache_dir), PYTHONPATH=str(root))
        outs = [Path(tmp) / f"table-{i}.json" for i in range(2 + args.hit_repeats + 1)]
        note("miss: building the default table in an empty cache ...")
        miss = gap_table_run(env, outs[0])
        note(f"miss: {miss}")
        hits = [gap_table_run(env, out) for out in outs[1 : 1 + args.hit_repeats]]
        note(f"hits: {', '.join(map(str, hits))}")
        shutil.rmtree(cache_dir / "stamps")  # what the build's load and read recorded: the lookup cannot know the inputs
        old = gap_table_run(env, outs[1 + args.hit_repeats])
        note(f"hit the old way: {old}")
        again = gap_table_run(env, outs[-1])  # the old way's load recorded them again
        identical = len({out.read_bytes() for out in outs}) == 1
    hit = Clock(statistics.median(h.wall for h in hits), statistics.median(h.cpu for h in hits))
    verdict = "met" if hit.wall <= 2.0 and miss.wall >= 10 * hit.wall else "MISSED"
    return [
        "## 4. The cache: `gap table --model smollm2-135m` (the default table) in a fresh process each, in an empty cache",
        "",
        "| run | wall (CPU of the process) |",
        "|---|---:|",
        f"| miss: the table built (model loaded, text read, fisher pass) | {miss} |",
        f"| hit, found before anything loads (median of {args.hit_repeats}) | **{hit}** |",
        f"| hit the old way (stamps removed: model loaded and text read first, then the cache) | {old} |",
        f"| hit after the old way (its load recorded the stamps again) | {again} |",
        "",
        f"- miss / hit: **{miss.ratio(hit)}**; old-way hit / hit: {old.ratio(hit)}",
        f"- the {len(outs)} written tables are byte-identical: {identical}",
        f"- target hit <= 2 s and >= 10x faster than the miss: {verdict}",
        "",
    ]


# ---- 5: the content fingerprint -------------------------------------------------------------------
LLAMA_8B_PARAMS = 8_030_261_248  # Llama 3 8B, for the scale line


def fingerprint_cost(args) -> list[str]:
    from gap_engine.core.fingerprint import sampled_state_fingerprint
    from gap_engine.model.identity import builtin_folder
    from gap_engine.model.loaded import model_fingerprint

    load_model("smollm2-135m")  # converted and recorded, so its folder exists and the last column reads the record
    firsts, hashes, samples, remembered = [], [], [], []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.hash_repeats):  # interleaved: a burst of load from other processes hits every column alike
            copy = Path(tmp) / f"copy-{i}"  # new files: nothing recorded, so this load hashes them
            shutil.copytree(builtin_folder("smollm2-135m"), copy)
            lm, first = timed(f"first load of a fresh copy ({i + 1})", lambda copy=copy: load_model(str(copy)))
            _, hashed = timed(f"content fingerprint ({i + 1})", lambda lm=lm: model_fingerprint(lm.model, lm.tokenizer))
            _, sampled = timed(f"sampled fingerprint ({i + 1})", lambda lm=lm: sampled_state_fingerprint(lm.model.state_dict()))
            _, again = timed(f"load of the same, unchanged files ({i + 1})", lambda copy=copy: load_model(str(copy)))
            firsts.append(first), hashes.append(hashed), samples.append(sampled), remembered.append(again)
            del lm
            shutil.rmtree(copy)

    def median(clocks: list[Clock]) -> Clock:
        return Clock(statistics.median(c.wall for c in clocks), statistics.median(c.cpu for c in clocks))

    first, hashed, sampled, again = median(firsts), median(hashes), median(samples), median(remembered)
    lm = load_model("smollm2-135m")
    hashed_bytes = 4 * sum(t.numel() for t in {t.data_ptr(): t for t in lm.model.state_dict().values()}.values())
    per_cpu_second = hashed_bytes / hashed.cpu
    verdict = "met" if hashed.cpu < 1.0 else "MISSED"
    return [
        f"## 5. The content fingerprint of smollm2-135m (median of {args.hash_repeats}, interleaved)",
        "",
        "| step | wall (CPU of this process) |",
        "|---|---:|",
        f"| first load of a fresh copy of the folder: read, finite check, fingerprint | {first} |",
        f"| **content fingerprint**: every value ({hashed_bytes / 1e6:.0f} MB as float32), config, tokenizer | **{hashed}** |",
        f"| the sample it replaces (~4,096 values a tensor; blind to most edits) | {sampled} |",
        f"| load of the same, unchanged files: the fingerprint read from the first load's record | {again} |",
        "",
        f"- fingerprint / first load: **{hashed.ratio(first)}**; unchanged load / first load: {again.ratio(first)}",
        f"- target: under 1 s for 135M parameters: {verdict} on CPU seconds ({hashed.cpu:.2f} s; wall {hashed.wall:.2f} s "
        "at the load average above, where other processes take their share of the two cores)",
        f"- an 8B model (Llama 3 8B, {LLAMA_8B_PARAMS / 1e9:.2f}B values, {4 * LLAMA_8B_PARAMS / 1e9:.0f} GB as float32) at "
        f"{per_cpu_second / 1e9:.2f} GB per CPU second: about {4 * LLAMA_8B_PARAMS / per_cpu_second:.0f} CPU seconds on its first "
        "load, spread over the hashing threads, then none while its files keep their size, times and inode (a fresh copy, "
        "an edit or a rewrite is hashed again)",
        "",
    ]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=2, help="windows for the speed and estimate parts")
    parser.add_argument("--seq-len", type=int, default=64, help="tokens per window for the speed and estimate parts")
    parser.add_argument("--noise-samples", type=int, default=16, help="windows for the noise part (split into groups)")
    parser.add_argument("--noise-seq-len", type=int, default=32, help="tokens per window for the noise part")
    parser.add_argument("--noise-splits", type=int, default=6, help="random group splits averaged per row")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--calibration-forwards", type=int, default=20, help="full forwards timed after the 16-rate build")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    parser.add_argument("--skip", default="", help="comma list of parts to skip: speed, noise, cache, fingerprint")
    parser.add_argument("--hit-repeats", type=int, default=3, help="cache hits timed (each a fresh process)")
    parser.add_argument("--hash-repeats", type=int, default=3, help="fingerprint timings (part 5), interleaved with weight reads")
    parser.add_argument("--out", type=Path, default=None, help="write the markdown report here")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = script_argv(argv)
    args = build_parser().parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    started, cpu_started = time.perf_counter(), time.process_time()
    load_before = os.getloadavg()
    lm, load_clock = timed("load smollm2-135m", lambda: load_model("smollm2-135m")) if {"speed", "noise"} - skip else (None, None)
    report = [
        "# Loss-table benchmark",
        "",
        f"- command: `{command_line(SCRIPT, argv)}`",
        f"- {machine_description()}; OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY')}",
        "- model: smollm2-135m (30 blocks, 9 heads / 3 KV heads, MLP 1536, vocab 49152)"
        + (f", loaded in {load_clock.wall:.1f} s" if load_clock else "")
        + "; data: wiki-sample calibration windows; criterion wanda; objective nll unless stated (part 4: the CLI's defaults)",
        f"- load average at start (1/5/15 min): {load_before[0]:.1f} / {load_before[1]:.1f} / {load_before[2]:.1f}",
        "",
    ]
    if "speed" not in skip:
        report += speed_and_estimates(lm, args)
    if "noise" not in skip:
        report += noise(lm, args)
    if "cache" not in skip:
        report += cache_hit_and_miss(args)
    if "fingerprint" not in skip:
        report += fingerprint_cost(args)
    load_after = os.getloadavg()
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    report += [
        f"Total bench time {time.perf_counter() - started:.0f} s ({time.process_time() - cpu_started:.0f} s CPU here, "
        f"{children.ru_utime + children.ru_stime:.0f} s in the `gap` processes of part 4); load average at the end "
        f"{load_after[0]:.1f} / {load_after[1]:.1f} / {load_after[2]:.1f}.",
    ]
    if args.out:
        write_result(args.out, report, SCRIPT, argv)
    else:
        print("\n".join(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
