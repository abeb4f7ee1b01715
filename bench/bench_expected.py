"""Times before Start: the cost model's predictions against the real work (issues 22 and 32).

Setup, Prune & evaluate, Recover and Export say what a job will take before it starts: the cost
model's prediction (``pipeline.expected``), which issues 22 and 32 ask to be within 2x of the real
work. This benchmark measures, side by side in one run, on a machine nobody measured (a fresh
cache: nominal prices):

1. a fisher table build of SmolLM2-135M at two window sizes (``table_prediction``: the build's
   stages, without loading the model and reading the text, which the run does once before);
2. scoring the offline lm-eval task on the dense model (``expected.scoring_seconds``);
3. a prune-and-evaluate run at the explorer's defaults on the second table, the model in memory
   (``run_prediction``: planning, pruning, the measured increase, held-out text, throughput,
   generations and the checkpoint), once;
4. recovering that checkpoint at the explorer's defaults with 10 steps, no tasks, by LoRA and by
   MeZO (its rate probe included), loads included (``recovery_prediction``), once each;
5. the Export page's GGUF file of pruned checkpoints (uniform plans, saved in bfloat16) at f16
   and q8_0 (``gguf_seconds``): cold, each alone in a fresh Python process that still has to
   import transformers' model code (a first click), and warm, repeated in one process that built
   once already (the explorer after a run).

Each row prints predicted / wall and predicted / CPU (CPU seconds over torch's threads for
the torch work; what it costs with the cores to itself, which a busy machine stretches less).
Target: every ratio within 0.5-2x on at least one of the two. These are measurements, not
tests: the tests check what the pages show against the cost model, never a clock.

    python bench/bench_expected.py [--repeats 3] [--budgets 0.2,0.4] [--task-limits 4,16]
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
HEADER = "| work | runs | predicted | wall | CPU | predicted / wall | predicted / CPU |"

# GGUF builds of one checkpoint in one fresh process, each timed with the prediction taken just before it.
GGUF_BUILDS = """
import json, sys, time
from gap_engine.export import gguf
from gap_engine.pipeline.expected import gguf_seconds
folder, outtype, repeats = sys.argv[1], sys.argv[2], int(sys.argv[3])
rows = []
for _ in range(repeats):
    predicted, wall, cpu = gguf_seconds(folder, outtype), time.perf_counter(), time.process_time()
    size = len(gguf.gguf_bytes(folder, outtype))
    rows.append({"predicted": predicted, "wall": time.perf_counter() - wall, "cpu": time.process_time() - cpu, "bytes": size})
print(json.dumps(rows))
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3, help="timed runs of each build, scoring and warm GGUF build")
    parser.add_argument("--budgets", default="0.2,0.4", help="uniform pruning budgets of the GGUF checkpoints")
    parser.add_argument("--task-limits", default="4,16", help="examples of the offline task scored")
    parser.add_argument("--workdir", default="runs/bench_expected")
    return parser


def parse_args(argv=None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def row(work: str, predicted: float, timings: list[tuple[float, float]]) -> tuple[str, list[float]]:
    """A table row of the median (wall, CPU) of ``timings`` and the ratios that decide the target."""
    wall, cpu = statistics.median(t[0] for t in timings), statistics.median(t[1] for t in timings)
    ratios = [predicted / wall, predicted / cpu]
    text = f"| {work} | {len(timings)} | {predicted:.2f} s | {wall:.2f} s | {cpu:.2f} s | **{ratios[0]:.2f}** | {ratios[1]:.2f} |"
    return text, ratios


def timed(work) -> tuple[float, float]:
    """(wall, CPU over torch's threads) seconds of ``work()``."""
    import torch

    cpu, wall = time.process_time(), time.perf_counter()
    work()
    return time.perf_counter() - wall, (time.process_time() - cpu) / torch.get_num_threads()


def table_builds(lm, repeats: int, kept: dict) -> list[tuple[str, list[float]]]:
    from gap_engine.core.config import WindowSpec
    from gap_engine.core.progress import LOAD_MODEL, READ_TEXT
    from gap_engine.data.windows import calibration_windows
    from gap_engine.pipeline import expected
    from gap_engine.pipeline.stages import loss_table
    from gap_engine.tables.artefact import TableSpec

    rows = []
    for n_samples, seq_len in ((2, 64), (4, 128)):
        spec = TableSpec(windows=WindowSpec(n_samples=n_samples, seq_len=seq_len), estimator="fisher", objective="kl")
        prediction = expected.table_prediction(MODEL, spec)
        assert prediction.basis == f"{expected.PREDICTED}: {expected.NOMINAL_BASIS}", prediction.basis  # a fresh cache
        predicted = sum(seconds for stage, seconds in prediction.seconds.items() if stage not in (LOAD_MODEL, READ_TEXT))
        calibration_windows(lm.tokenizer, spec.windows)  # the text read and cached before: not timed
        timings = [timed(lambda: kept.update(table=loss_table(lm, spec, use_cache=False))) for _ in range(repeats)]
        rows.append(row(f"fisher table, {n_samples} x {seq_len} tokens", predicted, timings))
    return rows


def task_scoring(lm, limits: list[int], repeats: int) -> list[tuple[str, list[float]]]:
    import torch

    from gap_engine.evaluate.tasks import TASK_BATCH, TaskSettings, prepare_tasks, run_tasks
    from gap_engine.pipeline import expected

    shape, profile = expected.model_shape(MODEL), expected.nominal_profile(torch.get_num_threads())
    rows = []
    for limit in limits:
        prepared = prepare_tasks(TaskSettings(limit=limit, batch_size=TASK_BATCH))
        predicted = expected.scoring_seconds(limit, lambda tokens, seq_len: expected.forward_seconds(shape, profile, tokens, seq_len, 1))
        run_tasks(lm, prepared)  # lm-eval's import and first call, priced apart (TASK_IMPORT_S): not timed
        timings = [timed(lambda: run_tasks(lm, prepared)) for _ in range(repeats)]
        rows.append(row(f"offline task scoring, {limit} examples", predicted, timings))
    return rows


def prune_eval_run(lm, table, work: Path) -> list[tuple[str, list[float]]]:
    """The explorer's Prune & evaluate defaults (DP at 20%, 8 x 128 held-out tokens, throughput, 3
    generations, the checkpoint saved) with the model in memory, as the app runs it after a build."""
    from gap_engine.core.config import APP_EVAL_WINDOWS
    from gap_engine.evaluate.metrics import EvalSettings
    from gap_engine.pipeline import expected
    from gap_engine.pipeline.runs import prune_and_evaluate, prune_eval_stages

    settings = EvalSettings(windows=APP_EVAL_WINDOWS)
    stages = prune_eval_stages(settings, checkpoint=True)
    prediction = expected.run_prediction(MODEL, table.spec.windows, settings, stages, "dp", loaded=True)
    folder = work / "run-checkpoint"
    run = dict(table=table, budget=0.2, checkpoint_dir=folder, history_path=work / "history.sqlite")
    timing = timed(lambda: prune_and_evaluate(lm, settings, **run))
    return [row(f"prune and evaluate, DP at 20%, {' + '.join(stages[1:])}", prediction.total, [timing])]


def recoveries(checkpoint: Path, work: Path) -> list[tuple[str, list[float]]]:
    """The explorer's Recover defaults with 10 steps and no tasks, from loading the checkpoint on."""
    import shutil

    from gap_engine.model.loading import load_model
    from gap_engine.pipeline import expected
    from gap_engine.pipeline.recovery import RecoverySettings, recover

    rows = []
    for method in ("lora", "mezo"):
        settings = RecoverySettings(
            method=method, tasks=("wiki-sample", "news-sample"), steps=10, eval_samples=8, eval_seq_len=128,
            eval_generations=1, save_every=5, record_history=False,
        ).validate()  # fmt: skip
        prediction = expected.recovery_prediction(checkpoint, settings)
        out = work / f"recovered-{method}"
        shutil.rmtree(out, ignore_errors=True)
        timing = timed(lambda: recover(load_model(str(checkpoint)), settings, out_dir=out))
        rows.append(row(f"{method} recovery, 10 steps, 2 texts, kd (its dense teacher loaded)", prediction.total, [timing]))
    return rows


def gguf_builds(work: Path, budgets: list[float], repeats: int, commands: list[str]) -> list[tuple[str, list[float]]]:
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
                predicted = statistics.median(r["predicted"] for r in picked)
                work_name = f"{outtype} GGUF of a {budget:.0%} checkpoint ({measured[0]['bytes'] / 1e6:.0f} MB), {kind}"
                rows.append(row(work_name, predicted, [(r["wall"], r["cpu"]) for r in picked]))
    return rows


def main(argv=None) -> int:
    argv = script_argv(argv)
    args = parse_args(argv)
    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    load_start, started, commands = os.getloadavg(), time.perf_counter(), []
    import torch

    from gap_engine.model.loading import load_model

    torch.set_num_threads(2)
    from gap_engine.core.fsutil import cache_root

    lm = load_model(MODEL)  # from the user's cache (the built-in model's conversion), then:
    converted, users_cache = cache_root() / "models" / MODEL, os.environ.get("GAP_CACHE_DIR")
    os.environ["GAP_CACHE_DIR"] = tempfile.mkdtemp(prefix="bench-expected-")  # no measured profile: nominal prices
    (cache_root() / "models").mkdir(parents=True)
    (cache_root() / "models" / MODEL).symlink_to(converted)  # the recoveries' teacher loads without converting again
    kept: dict = {}
    sections = {
        "1. Fisher table builds": table_builds(lm, args.repeats, kept),
        "2. Task scoring (lm-eval, the dense model)": task_scoring(lm, [int(n) for n in args.task_limits.split(",")], args.repeats),
        "3. A prune-and-evaluate run": prune_eval_run(lm, kept["table"], work),
    }
    sections["4. Recovery"] = recoveries(work / "run-checkpoint", work)
    os.environ.pop("GAP_CACHE_DIR")  # the checkpoints are pruned from the user's cache too
    os.environ.update({"GAP_CACHE_DIR": users_cache} if users_cache else {})
    sections["5. Export's GGUF file"] = gguf_builds(work, [float(b) for b in args.budgets.split(",")], args.repeats, commands)
    lines = [
        "# Times before Start: predicted against measured",
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
        "Predictions on nominal prices (a fresh cache: no profile of this machine). Times are medians; CPU is CPU "
        "seconds over torch's threads for the table builds and task scoring, process CPU seconds for the GGUF builds "
        "(numpy, one thread). A GGUF build is cold when it is the first in a fresh process (it imports transformers' "
        "model code) and warm when the process built once already.",
    ]
    met = True
    for title, rows in sections.items():
        lines += ["", f"## {title}", "", HEADER, "|---|---:|---:|---:|---:|---:|---:|", *(text for text, _ in rows)]
        met = met and all(any(0.5 <= r <= 2.0 for r in ratios) for _, ratios in rows)
    every = [r for rows in sections.values() for _, ratios in rows for r in ratios[:1]]
    lines += [
        "",
        f"Predicted / wall from {min(every):.2f} to {max(every):.2f}; target (0.5-2x on wall or CPU): {'met' if met else 'NOT met'}.",
    ]
    write_report("expected", lines, SCRIPT, argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
