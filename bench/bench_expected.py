"""Times before Start: the cost model's predictions against the real work, before and after it learns this machine.

Setup, Prune & evaluate, Recover, the planner's baselines and Export say what a job will take before it starts: the
cost model's prediction (``pipeline.cost_model``) on nominal prices, multiplied, once jobs of its kind finished here, by
what they taught (``pipeline.learned``: the median of their actual / predicted, scaled by the load now). This benchmark
runs, on a fresh cache (no profile of this machine, no finished job) and under whatever load the machine has:

1. fisher table builds of SmolLM2-135M at two window sizes, ``--repeats`` each (``table_prediction``: the build's
   stages, without loading the model and reading the text, which the run does once before);
2. scoring the offline lm-eval task on the dense model (``cost_model.scoring_seconds``; part of a run, not a job);
3. prune-and-evaluate runs at the explorer's defaults (DP at 20%, no tasks) on the second table, the model in memory
   (``run_prediction``), twice;
4. recoveries of that checkpoint at the explorer's defaults with 10 steps, no tasks: LoRA twice, then MeZO, its rate
   probe included, loads included (``recovery_prediction``);
5. baseline plans (uniform and FLAP at the planner's five budgets) on the second table, twice (``baselines_prediction``);
6. the Export page's GGUF file of pruned checkpoints (uniform plans, saved in bfloat16) at f16 and q8_0
   (``gguf_prediction``, built by ``gguf_file`` as the page does): cold, first in a fresh Python process that still
   imports transformers' model code, and warm, repeated in that process.

Every job is recorded as the explorer records it, so each later one of its kind is predicted with what the earlier
ones taught. Each row prints the nominal prediction over the wall time (before learning) and the learned one (after
learning, on the runs that had an earlier one of their kind). Target: after one finished job, under load 4 or more,
the learned prediction within 1.5x of the wall time. These are measurements, not tests: the tests check the
learning's arithmetic and what the pages show, never a clock.

    python bench/bench_expected.py [--repeats 2] [--busy 0] [--budgets 0.2,0.4] [--task-limits 4,16]
        [--workdir runs/bench_expected]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from report import command_line, machine_line, script_argv, write_report

SCRIPT = "bench/bench_expected.py"

REPO = Path(__file__).resolve().parents[1]
MODEL = "smollm2-135m"
OUTTYPES = ("f16", "q8_0")
HEADER = "| work | runs | load at start | nominal | learned (from runs) | wall | CPU | nominal / wall | learned / wall |"
RULE = "|---|---:|---:|---:|---:|---:|---:|---:|---:|"
TARGET, BUSY = 1.5, 4.0  # learned within 1.5x of the wall time, on runs that started at load 4 or more

# GGUF builds of one checkpoint in one fresh process, each predicted just before it and recorded as the page records it.
GGUF_BUILDS = """
import json, os, sys, time
from gap_engine.pipeline.cost_gguf import gguf_file, gguf_prediction
folder, outtype, repeats = sys.argv[1], sys.argv[2], int(sys.argv[3])
rows = []
for _ in range(repeats):
    p, load = gguf_prediction(folder, outtype), os.getloadavg()[0]
    wall, cpu = time.perf_counter(), time.process_time()
    size = len(gguf_file(folder, outtype))
    factor, runs = (p.correction.factor, p.correction.runs) if p.correction else (1.0, 0)
    rows.append({"nominal": p.total / factor, "learned": p.total if runs else None, "runs": runs, "load": load,
                 "wall": time.perf_counter() - wall, "cpu": time.process_time() - cpu, "bytes": size})
print(json.dumps(rows))
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=2, help="runs of each table build, scoring and warm GGUF build")
    parser.add_argument("--budgets", default="0.2,0.4", help="uniform pruning budgets of the GGUF checkpoints")
    parser.add_argument("--task-limits", default="4,16", help="examples of the offline task scored")
    parser.add_argument("--workdir", default="runs/bench_expected")
    parser.add_argument(
        "--busy",
        type=int,
        default=0,
        help="processes spinning on one core each for the whole run: load added, to check the target under load 4+",
    )
    return parser


def spin() -> None:
    while True:
        pass


def start_busy(n: int) -> list:
    """``n`` processes that each keep one core busy until the run ends (daemons: they die with it)."""
    import multiprocessing

    spinners = [multiprocessing.Process(target=spin, daemon=True) for _ in range(n)]
    for p in spinners:
        p.start()
    return spinners


def parse_args(argv=None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def row(work: str, runs: list[dict]) -> tuple[str, list[float], bool | None]:
    """A table row of medians over ``runs`` (each: nominal, learned or None, runs learned from, load, wall, cpu); the
    nominal / wall ratios, and whether the learned prediction met the target (None: no busy run had one)."""
    wall, cpu, load = (statistics.median(r[key] for r in runs) for key in ("wall", "cpu", "load"))
    nominal = statistics.median(r["nominal"] for r in runs)
    taught = [r for r in runs if r["learned"] is not None]
    learned_text, learned_ratio, met = "—", "—", None
    if taught:
        learned = statistics.median(r["learned"] for r in taught)
        ratios = [r["learned"] / r["wall"] for r in taught]
        learned_text = f"{learned:.2f} s ({'-'.join(dict.fromkeys(str(r['runs']) for r in taught))})"
        learned_ratio = f"**{statistics.median(ratios):.2f}**"
        busy = [ratio for r, ratio in zip(taught, ratios) if r["load"] >= BUSY]
        met = all(1 / TARGET <= ratio <= TARGET for ratio in busy) if busy else None
    text = (f"| {work} | {len(runs)} | {load:.1f} | {nominal:.2f} s | {learned_text} | {wall:.2f} s | {cpu:.2f} s | "
            f"{nominal / wall:.2f} | {learned_ratio} |")  # fmt: skip
    return text, [r["nominal"] / r["wall"] for r in runs], met


def learning_run(prediction, work, kept=None) -> dict:
    """Time ``work()`` against ``prediction`` (its stages in ``kept``, else all), and record it as a job of its kind."""
    from gap_engine.pipeline import learned

    factor, taught = (prediction.correction.factor, prediction.correction.runs) if prediction.correction else (1.0, 0)
    seconds = sum(s for stage, s in prediction.seconds.items() if kept is None or stage in kept)
    pending = learned.Pending(prediction.kind, seconds / factor, prediction.prices)
    wall, cpu = timed(work)
    learned.record(pending, wall)
    return {"nominal": seconds / factor, "learned": seconds if taught else None, "runs": taught, "load": pending.load_start,
            "wall": wall, "cpu": cpu}  # fmt: skip


def timed(work) -> tuple[float, float]:
    """(wall, CPU over torch's threads) seconds of ``work()``."""
    import torch

    cpu, wall = time.process_time(), time.perf_counter()
    work()
    return time.perf_counter() - wall, (time.process_time() - cpu) / torch.get_num_threads()


def table_builds(lm, repeats: int, kept: dict) -> list:
    from gap_engine.core.config import WindowSpec
    from gap_engine.core.progress import LOAD_MODEL, READ_TEXT
    from gap_engine.data.windows import calibration_windows
    from gap_engine.pipeline import cost_model
    from gap_engine.pipeline.stages import loss_table
    from gap_engine.tables.artefact import TableSpec

    rows = []
    for n_samples, seq_len in ((2, 64), (4, 128)):
        spec = TableSpec(windows=WindowSpec(n_samples=n_samples, seq_len=seq_len), estimator="fisher", objective="kl")
        calibration_windows(lm.tokenizer, spec.windows)  # the text read and cached before: not timed
        build = set(cost_model.table_prediction(MODEL, spec).seconds) - {LOAD_MODEL, READ_TEXT}
        runs = [
            learning_run(cost_model.table_prediction(MODEL, spec), lambda: kept.update(table=loss_table(lm, spec, use_cache=False)), build)
            for _ in range(repeats)
        ]
        rows.append(row(f"fisher table, {n_samples} x {seq_len} tokens", runs))
    return rows


def task_scoring(lm, limits: list[int], repeats: int) -> list:
    import torch

    from gap_engine.evaluate.tasks import TASK_BATCH, TaskSettings, prepare_tasks, run_tasks
    from gap_engine.pipeline import cost_model
    from gap_engine.pipeline.learned import load_average

    shape, profile = cost_model.model_shape(MODEL), cost_model.nominal_profile(torch.get_num_threads())
    rows = []
    for limit in limits:
        prepared = prepare_tasks(TaskSettings(limit=limit, batch_size=TASK_BATCH))
        predicted = cost_model.scoring_seconds(
            limit, lambda tokens, seq_len: cost_model.forward_seconds(shape, profile, tokens, seq_len, 1)
        )
        run_tasks(lm, prepared)  # lm-eval's import and first call, priced apart (TASK_IMPORT_S): not timed
        runs = []
        for _ in range(repeats):
            load = load_average()
            wall, cpu = timed(lambda: run_tasks(lm, prepared))
            runs.append({"nominal": predicted, "learned": None, "runs": 0, "load": load, "wall": wall, "cpu": cpu})
        rows.append(row(f"offline task scoring, {limit} examples", runs))
    return rows


def prune_eval_runs(lm, table, work: Path) -> list:
    """The explorer's Prune & evaluate defaults without tasks (DP at 20%, 8 x 128 held-out tokens, throughput, 3
    generations, the checkpoint saved) with the model in memory, as the app runs it after a build; twice."""
    from gap_engine.core.config import APP_EVAL_WINDOWS
    from gap_engine.evaluate.metrics import EvalSettings
    from gap_engine.pipeline import cost_model
    from gap_engine.pipeline.runs import prune_and_evaluate, prune_eval_stages
    from gap_engine.plan.step import plan_criterion
    from gap_engine.prune.compensations import default_for
    from gap_engine.prune.criteria import is_sequential

    settings = EvalSettings(windows=APP_EVAL_WINDOWS)
    step = plan_criterion("dp", table)  # the DP's default step on this model (OBS on SmolLM2), its own compensation
    compensation = default_for(step, lm.model_type)
    stages = prune_eval_stages(settings, checkpoint=True, compensated=compensation.active)
    run = dict(
        table=table, budget=0.2, checkpoint_dir=work / "run-checkpoint", history_path=work / "history.sqlite", compensation=compensation
    )
    runs = [
        learning_run(cost_model.run_prediction(MODEL, table.spec.windows, settings, stages, "dp", loaded=True, sequential=is_sequential(step)),
                     lambda: prune_and_evaluate(lm, settings, **run))
        for _ in range(2)
    ]  # fmt: skip
    return [row(f"prune and evaluate, DP at 20% ({step}, {compensation.mode}), {' + '.join(stages[1:])}", runs)]


def recoveries(checkpoint: Path, work: Path) -> list:
    """The explorer's Recover defaults with 10 steps and no tasks, from loading the checkpoint on: LoRA, LoRA, MeZO."""
    import shutil

    from gap_engine.model.loading import load_model
    from gap_engine.pipeline import cost_model
    from gap_engine.pipeline.recovery import RecoverySettings, recover

    rows = []
    for method, repeats in (("lora", 2), ("mezo", 1)):
        settings = RecoverySettings(
            method=method, tasks=("wiki-sample", "news-sample"), steps=10, eval_samples=8, eval_seq_len=128,
            eval_generations=1, save_every=5, record_history=False,
        ).validate()  # fmt: skip
        out = work / f"recovered-{method}"
        runs = []
        for _ in range(repeats):
            shutil.rmtree(out, ignore_errors=True)
            runs.append(
                learning_run(
                    cost_model.recovery_prediction(checkpoint, settings),
                    lambda: recover(load_model(str(checkpoint)), settings, out_dir=out),
                )
            )
        rows.append(row(f"{method} recovery, 10 steps, 2 texts, kd (its dense teacher loaded)", runs))
    return rows


def baseline_plans(lm, table) -> list:
    """The planner's Compute baselines at its defaults: uniform and FLAP at five budgets, the model in memory; twice."""
    from gap_engine.pipeline import cost_model
    from gap_engine.pipeline.runs import baseline_rows
    from gap_engine.plan.front_view import baseline_budgets

    allocators, budgets = ["uniform", "flap"], baseline_budgets(0.9)
    spec = table.spec
    runs = [
        learning_run(cost_model.baselines_prediction(MODEL, spec.windows, spec.criterion, allocators, len(budgets), loaded=True),
                     lambda: baseline_rows(lm, table, budgets, allocators))
        for _ in range(2)
    ]  # fmt: skip
    return [row(f"baseline plans, uniform and FLAP at {len(budgets)} budgets", runs)]


def gguf_builds(work: Path, budgets: list[float], repeats: int, commands: list[str]) -> list:
    env = os.environ | {"PYTHONPATH": str(REPO)}
    rows = []
    for budget in budgets:
        folder = work / f"uniform-{budget:g}"
        prune = ["-m", "gap_engine", "prune", "--model", MODEL, "--uniform", f"{budget:g}", "--out", str(folder)]
        made = (folder / "config.json").exists()
        commands.append(" ".join(["python", *prune]) + ("  # made by an earlier run" if made else ""))
        if not made:
            subprocess.run([sys.executable, *prune], cwd=REPO, env=env, capture_output=True, text=True, check=True)
        for outtype in OUTTYPES:
            script = [sys.executable, "-c", GGUF_BUILDS, str(folder), outtype, str(1 + repeats)]
            done = subprocess.run(script, cwd=REPO, env=env, capture_output=True, text=True, check=True)
            measured = json.loads(done.stdout.strip().splitlines()[-1])
            for kind, picked in (("cold", measured[:1]), ("warm", measured[1:])):
                rows.append(row(f"{outtype} GGUF of a {budget:.0%} checkpoint ({measured[0]['bytes'] / 1e6:.0f} MB), {kind}", picked))
    return rows


def main(argv=None) -> int:
    argv = script_argv(argv)
    args = parse_args(argv)
    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    load_start, started, commands = os.getloadavg(), time.perf_counter(), []
    spinners = start_busy(args.busy)
    import torch

    from gap_engine.model.loading import load_model

    torch.set_num_threads(2)
    from gap_engine.core.fsutil import cache_root

    lm = load_model(MODEL)  # from the user's cache (the built-in model's conversion), then:
    converted = cache_root() / "models" / MODEL
    os.environ["GAP_CACHE_DIR"] = tempfile.mkdtemp(prefix="bench-expected-")  # no profile, no finished job: nominal prices
    (cache_root() / "models").mkdir(parents=True)
    (cache_root() / "models" / MODEL).symlink_to(converted)  # the recoveries' teacher and the checkpoints load without converting
    kept: dict = {}
    sections = {
        "1. Fisher table builds": table_builds(lm, args.repeats, kept),
        "2. Task scoring (lm-eval, the dense model; part of a run, so nothing learned)": task_scoring(
            lm, [int(n) for n in args.task_limits.split(",")], args.repeats
        ),
        "3. Prune-and-evaluate runs": prune_eval_runs(lm, kept["table"], work),
    }
    sections["4. Recovery"] = recoveries(work / "run-checkpoint", work)
    sections["5. Baseline plans"] = baseline_plans(lm, kept["table"])
    sections["6. Export's GGUF file"] = gguf_builds(work, [float(b) for b in args.budgets.split(",")], args.repeats, commands)
    for p in spinners:
        p.terminate()
    lines = [
        "# Times before Start: predicted against measured, before and after learning this machine",
        "",
        "```",
        command_line(SCRIPT, argv),
        "```",
        "",
        "with the checkpoints from:",
        "",
        "```",
        *commands,
        "```",
        "",
        machine_line(load_start, started),
        "",
        *(
            [
                f"Load added by this run: {args.busy} process{'es' if args.busy != 1 else ''} spinning on one core each "
                "(``--busy``), beside whatever else the machine ran.",
                "",
            ]
            if args.busy
            else []
        ),
        "A fresh cache: no profile of this machine and no finished job, so the first job of each kind is predicted on "
        "nominal prices, and each later one also with what the earlier ones of its kind taught (``pipeline.learned``). "
        "*Nominal* is the cost model's prediction before learning, *learned* the one the pages show after it (in brackets: "
        "how many finished jobs of the kind it learned from), both medians over the runs (learned: over the runs that had "
        "one). *Load at start* is the 1-minute load average when each run started (median). CPU is CPU seconds over "
        "torch's threads for the torch work, process CPU seconds for the GGUF builds (numpy, one thread). A GGUF build is "
        "cold when it is the first in a fresh process (it imports transformers' model code) and warm when the process "
        "built once already.",
    ]
    verdicts = []
    for title, rows in sections.items():
        lines += ["", f"## {title}", "", HEADER, RULE, *(text for text, _, _ in rows)]
        verdicts += [met for _, _, met in rows if met is not None]
    every = [r for rows in sections.values() for _, ratios, _ in rows for r in ratios]
    met = bool(verdicts) and all(verdicts)
    lines += [
        "",
        f"Nominal / wall from {min(every):.2f} to {max(every):.2f}. Learned predictions of runs that started at load "
        f"{BUSY:g} or more: {sum(verdicts)} of {len(verdicts)} rows within {TARGET:g}x of the wall time; target (every "
        f"such row within {TARGET:g}x after one finished job): "
        + ("met." if met else "NOT met." if verdicts else f"not shown (no run started at load {BUSY:g} or more)."),
    ]
    write_report("expected", lines, SCRIPT, argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
