"""Recovery benchmark: LoRA-lm, LoRA-kd, MaZO-kd and MeZO-kd after pruning 20%, DP against uniform.

On smollm2-135m at 20% of the prunable parameters, both plans from the same default loss table
(``gap table`` with its defaults: fisher estimator, KL objective, 16 x 256 tokens of
wiki-sample, criterion wanda). Phases, each skipped where its files exist (a killed benchmark
resumes where it stopped):

1. ``prepare``: the table, the DP plan and the uniform plan at the budget, both pruned
   checkpoints (stored bf16, the default), and ``gap eval`` of both untuned checkpoints with the
   dense model beside them (perplexity, KL to dense, top-1 agreement on held-out wiki-sample and
   news-sample);
2. ``wallclock``: every recipe (method + objective) for the same wall-clock training budget. The
   DP and the uniform checkpoint of one recipe train **side by side**, one process and one torch
   thread each, so that the comparison GAP's tuning claim is about (DP + recovery against uniform
   + the same recovery, at equal budget and time) runs under identical machine conditions; the
   recipes run one after another. ZO learning rates are the engine's default (the automatic
   probe); everything else is the engine's defaults except the batch shape below;
3. ``kd-vs-lm``: LoRA-kd against LoRA-lm on the DP checkpoint, side by side for the same
   wall-clock budget: the objective comparison under identical machine conditions (in
   ``wallclock`` the recipes run one after another, so the machine's load can differ between
   them);
4. ``steps``: MaZO-kd against MeZO-kd on the DP checkpoint at an equal number of steps (1,000 by
   default; shorter windows, so that 1,000 steps fit), one after the other on two threads;
5. ``tasks``: zero-shot accuracy through lm-eval on the offline task ``gap_wiki_next`` for the
   untuned and every recovered checkpoint (dense is measured once and cached by ``gap eval``);
   not timing-sensitive, so it may share the machine;
6. the report: ``bench/results/recovery.md`` and ``bench/results/recovery_curves.csv``.

    python bench/bench_recovery.py --work runs/rec20 [--phases prepare,wallclock,steps,tasks]
        [--budget-s 900] [--zo-steps 1000] [--task-limit 200]

The load average is written beside every run: these machines are shared.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from report import RESULTS, command_line, machine_description, with_header

from gap_engine.core.fsutil import atomic_write_json, atomic_write_text

SCRIPT = "bench/bench_recovery.py"
CURVES = "recovery_curves.csv"
SOURCES = ("wiki-sample", "news-sample")
PLANS = ("dp", "uniform")
RECIPES = (("lora", "lm"), ("lora", "kd"), ("mazo", "kd"), ("mezo", "kd"))  # (method, objective), run in this order
ZO_RECIPES = (("mazo", "kd"), ("mezo", "kd"))
TASK = "gap_wiki_next"
PHASES = ("prepare", "wallclock", "kd-vs-lm", "steps", "tasks")


def phase_list(text: str) -> list[str]:
    """--phases as a list, every name one of PHASES (so the parser itself refuses an unknown one)."""
    phases = [x for x in text.split(",") if x]
    unknown = set(phases) - set(PHASES)
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown phases {sorted(unknown)}; choose from {', '.join(PHASES)}")
    return phases


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--budget", default="0.2", help="fraction of prunable parameters removed")
    p.add_argument("--work", default="runs/rec20", help="folder for the table, plans, checkpoints and run JSON")
    p.add_argument("--phases", type=phase_list, default=list(PHASES), help=f"comma-separated, of {', '.join(PHASES)}")
    p.add_argument("--budget-s", type=float, default=900.0, help="wall-clock training seconds per wallclock run")
    p.add_argument("--threads-per-run", type=int, default=1, help="torch threads of each of the two side-by-side runs")
    p.add_argument("--batch-size", type=int, default=1, help="windows per task per step")
    p.add_argument("--seq-len", type=int, default=128, help="tokens per training window")
    p.add_argument("--zo-steps", type=int, default=1000, help="steps of each run in the equal-steps phase")
    p.add_argument("--zo-seq-len", type=int, default=32, help="tokens per training window in the equal-steps phase")
    p.add_argument(
        "--steps-threads",
        type=int,
        default=2,
        help="equal-steps phase: torch threads per run; above 1 the runs go one after the other (not timed "
        "against each other: the comparison is at equal steps)",
    )
    p.add_argument("--eval-samples", type=int, default=8, help="held-out windows per source")
    p.add_argument("--eval-seq-len", type=int, default=256)
    p.add_argument("--task-limit", type=int, default=200, help=f"examples of {TASK} per model")
    p.add_argument("--out", default=str(RESULTS / "recovery.md"))
    return p


def parse_args(argv=None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


class Bench:
    """Runs ``gap`` commands in processes of their own, side by side when asked, and keeps
    their JSON output beside the checkpoints so that a rerun skips what is done."""

    def __init__(self, args):
        self.args = args
        self.work = Path(args.work).resolve()
        self.work.mkdir(parents=True, exist_ok=True)
        self.log_path = self.work / "bench-log.json"
        self.log: list[dict] = json.loads(self.log_path.read_text()) if self.log_path.exists() else []

    def _record(self, entry: dict) -> None:
        self.log.append(entry)
        atomic_write_json(self.log_path, self.log)

    def run(self, jobs: list[tuple[str, list[str], Path | None]], threads: int) -> None:
        """Run ``jobs`` (label, gap argv, JSON output file or None) at once, ``threads`` torch
        threads each; a job whose output file (or, without one, whose ``--out``) exists is skipped."""
        todo = [(label, argv, out) for label, argv, out in jobs if not self._done(argv, out)]
        if not todo:
            return
        env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
        load_start, started = os.getloadavg(), time.perf_counter()
        procs = []
        for label, argv, out in todo:
            log = open(self.work / f"{label}.log", "w")
            stdout = subprocess.PIPE if out is not None else subprocess.DEVNULL
            procs.append(
                (
                    label,
                    argv,
                    out,
                    log,
                    subprocess.Popen([sys.executable, "-m", "gap_engine", *argv], cwd=ROOT, env=env, stdout=stdout, stderr=log, text=True),
                )
            )
        for label, argv, out, log, proc in procs:
            stdout, _ = proc.communicate()
            log.close()
            seconds = time.perf_counter() - started
            if proc.returncode != 0:
                raise SystemExit(f"{shlex.join(['gap', *argv])} failed ({proc.returncode}); see {self.work / (label + '.log')}")
            if out is not None:
                atomic_write_json(out, json.loads(stdout))
            self._record(
                {
                    "label": label,
                    "command": shlex.join(["gap", *argv]),
                    "threads": threads,
                    "side_by_side": [lab for lab, *_ in todo],
                    "seconds": round(seconds, 1),
                    "load_start": [round(x, 2) for x in load_start],
                    "load_end": [round(x, 2) for x in os.getloadavg()],
                }
            )
            print(f"{label}: {seconds:.0f} s, load {os.getloadavg()[0]:.1f}", flush=True)

    @staticmethod
    def _done(argv: list[str], out: Path | None) -> bool:
        if out is not None:
            return out.exists()
        return Path(argv[argv.index("--out") + 1]).exists()

    def read(self, name: str) -> dict | None:
        path = self.work / f"{name}.json"
        return json.loads(path.read_text()) if path.exists() else None


def eval_argv(bench: Bench, checkpoint: Path) -> list[str]:
    a = bench.args
    return [
        "eval",
        "--model",
        str(checkpoint),
        "--data",
        ",".join(SOURCES),
        "--samples",
        str(a.eval_samples),
        "--seq-len",
        str(a.eval_seq_len),
        "--generations",
        "1",
        "--no-throughput",
        "--json",
    ]


def recover_argv(bench: Bench, checkpoint: Path, method: str, objective: str, out: Path, *, steps: int | None, seq_len: int) -> list[str]:
    a = bench.args
    argv = [
        "recover",
        "--model",
        str(checkpoint),
        "--method",
        method,
        "--objective",
        objective,
        "--data",
        ",".join(SOURCES),
        "--batch-size",
        str(a.batch_size),
        "--seq-len",
        str(seq_len),
        "--schedule",
        "constant",
        "--eval-samples",
        str(a.eval_samples),
        "--eval-seq-len",
        str(a.eval_seq_len),
        "--generations",
        "1",
        "--no-eval-before",
        "--no-history",
        "--save-every",
        "50",
        "--out",
        str(out),
        "--json",
    ]
    if steps is None:  # a wall-clock budget; the step cap is never reached
        return argv + ["--steps", "1000000", "--time-budget", f"{a.budget_s:g}"]
    return argv + ["--steps", str(steps)]


def checkpoints(bench: Bench) -> dict[str, Path]:
    return {"dp": bench.work / "dp20", "uniform": bench.work / "u20"}


def prepare(bench: Bench) -> None:
    a, w = bench.args, bench.work
    bench.run([("table", ["table", "--model", a.model, "--out", str(w / "t.json")], None)], threads=2)
    bench.run([("plan-dp", ["plan", "--table", str(w / "t.json"), "--budget", a.budget, "--out", str(w / "dp.json")], None)], 2)
    bench.run(
        [
            (
                "plan-uniform",
                ["plan", "--table", str(w / "t.json"), "--budget", a.budget, "--allocator", "uniform", "--out", str(w / "uniform.json")],
                None,
            )
        ],
        2,
    )
    for plan, folder in checkpoints(bench).items():
        bench.run([(f"prune-{plan}", ["prune", "--model", a.model, "--plan", str(w / f"{plan}.json"), "--out", str(folder)], None)], 2)
    bench.run(
        [(f"eval-{plan}", eval_argv(bench, folder), w / f"{plan}-none.json") for plan, folder in checkpoints(bench).items()],
        a.threads_per_run,
    )


def wallclock(bench: Bench) -> None:
    for method, objective in RECIPES:
        bench.run(
            [
                (
                    f"{plan}-{method}-{objective}",
                    recover_argv(
                        bench,
                        folder,
                        method,
                        objective,
                        bench.work / f"{plan}-{method}-{objective}",
                        steps=None,
                        seq_len=bench.args.seq_len,
                    ),
                    bench.work / f"{plan}-{method}-{objective}.json",
                )
                for plan, folder in checkpoints(bench).items()
            ],
            bench.args.threads_per_run,
        )


def kd_against_lm(bench: Bench) -> None:
    folder = checkpoints(bench)["dp"]
    bench.run(
        [
            (
                f"dp-lora-{objective}-sbs",
                recover_argv(
                    bench, folder, "lora", objective, bench.work / f"dp-lora-{objective}-sbs", steps=None, seq_len=bench.args.seq_len
                ),
                bench.work / f"dp-lora-{objective}-sbs.json",
            )
            for objective in ("lm", "kd")
        ],
        bench.args.threads_per_run,
    )


def equal_steps(bench: Bench) -> None:
    a, folder = bench.args, checkpoints(bench)["dp"]
    jobs = [
        (
            f"dp-{method}-{objective}-steps",
            recover_argv(
                bench, folder, method, objective, bench.work / f"dp-{method}-{objective}-steps", steps=a.zo_steps, seq_len=a.zo_seq_len
            ),
            bench.work / f"dp-{method}-{objective}-steps.json",
        )
        for method, objective in ZO_RECIPES
    ]
    if a.steps_threads == 1:
        bench.run(jobs, 1)
    else:
        for job in jobs:
            bench.run([job], a.steps_threads)


def task_models(bench: Bench) -> list[tuple[str, Path]]:
    out = [(f"{plan}-none", folder) for plan, folder in checkpoints(bench).items()]
    out += [(f"{plan}-{m}-{o}", bench.work / f"{plan}-{m}-{o}") for m, o in RECIPES for plan in PLANS]
    out += [(f"dp-lora-{o}-sbs", bench.work / f"dp-lora-{o}-sbs") for o in ("lm", "kd")]
    out += [(f"dp-{m}-{o}-steps", bench.work / f"dp-{m}-{o}-steps") for m, o in ZO_RECIPES]
    return [(name, folder) for name, folder in out if folder.exists()]


def tasks(bench: Bench) -> None:
    a = bench.args
    jobs = [
        (
            f"tasks-{name}",
            [
                "eval",
                "--model",
                str(folder),
                "--data",
                "wiki-sample",
                "--samples",
                "1",
                "--seq-len",
                "64",
                "--generations",
                "0",
                "--no-throughput",
                "--tasks",
                TASK,
                "--limit",
                str(a.task_limit),
                "--batch-size",
                "8",
                "--json",
            ],
            bench.work / f"tasks-{name}.json",
        )
        for name, folder in task_models(bench)
    ]
    for i in range(0, len(jobs), 2):  # two at a time: two cores
        bench.run(jobs[i : i + 2], a.threads_per_run)


# ---- the report ------------------------------------------------------------------------------
def nll(perplexity: dict) -> float:
    """The multi-task held-out objective: the mean over tasks of each task's NLL (nats/token)."""
    return sum(math.log(perplexity[s]) for s in SOURCES) / len(SOURCES)


def mean_kl(report: dict) -> float:
    return sum(report["kl_to_dense"][s] for s in SOURCES) / len(SOURCES)


def row(label: str, report: dict, dense: dict, extra: list[str]) -> str:
    ppl = report["perplexity"]
    return (
        f"| {label} | "
        + " | ".join(extra)
        + " | "
        + " | ".join(f"{ppl[s]:.2f} ({ppl[s] / dense[s]:.2f}x)" for s in SOURCES)
        + f" | {nll(ppl):.4f} | "
        + " | ".join(f"{report['kl_to_dense'][s]:.4f}" for s in SOURCES)
        + " | "
        + " | ".join(f"{report['top1_agreement'][s]:.3f}" for s in SOURCES)
        + " |"
    )


def train_time(result: dict) -> str:
    """Wall and CPU seconds of training (CPU: every thread of the process; runs recorded before
    the engine measured it show only the wall time)."""
    cpu = result.get("train_cpu_seconds")
    return f"{result['train_seconds']:.0f}" + (f" / {cpu:.0f}" if cpu is not None else "")


def task_cell(result: dict | None, key: str = "task_accuracy") -> str:
    """acc ± stderr in points of ``gap eval --json``'s ``task_accuracy`` (or ``dense_task_accuracy``)."""
    entry = (result or {}).get(key, {}).get(TASK)
    if entry is None:
        return "not run"
    return f"{100 * entry['acc']:.1f} ± {100 * entry['acc_stderr']:.1f} (n={entry['n']})"


def regenerating_argv(a: argparse.Namespace) -> list[str]:
    """The arguments that make the whole report: every phase, run or resumed in ``--work``."""
    return [
        *("--work", str(a.work), "--budget-s", f"{a.budget_s:g}", "--zo-steps", str(a.zo_steps)),
        *("--zo-seq-len", str(a.zo_seq_len), "--eval-samples", str(a.eval_samples), "--task-limit", str(a.task_limit)),
    ]


def markdown(bench: Bench) -> str:
    a = bench.args
    untuned = {plan: bench.read(f"{plan}-none") for plan in PLANS}
    dense = untuned["dp"]["dense"]["perplexity"]
    lines = [
        "# Recovery after pruning 20%: LoRA-lm, LoRA-kd, MaZO-kd, MeZO-kd; DP plan against uniform",
        "",
        "Generated by `bench/bench_recovery.py` (its docstring describes the phases):",
        "",
        "```",
        command_line(SCRIPT, regenerating_argv(a)),
        "```",
        "",
        f"{machine_description()} (read when this report was written). Every command below ran in a "
        "process of its own; `threads` is its torch thread count, `side by side` the runs that shared the machine "
        "with it. Load average (1, 5, 15 min) at its start and end:",
        "",
        "| run | command | threads | side by side | seconds | load start | load end |",
        "|---|---|---:|---|---:|---|---|",
    ]
    for entry in bench.log:
        lines.append(
            f"| {entry['label']} | `{entry['command']}` | {entry['threads']} | {', '.join(entry['side_by_side'])} | "
            f"{entry['seconds']:.0f} | {', '.join(f'{x:.2f}' for x in entry['load_start'])} | "
            f"{', '.join(f'{x:.2f}' for x in entry['load_end'])} |"
        )
    lines += [
        "",
        "## Settings",
        "",
        "- " + "; ".join(_plan_line(bench.work / f"{plan}.json", plan) for plan in PLANS) + ".",
        f"- Training: tasks {', '.join(SOURCES)} (calibration parts), every step {a.batch_size} window(s) x "
        f"{a.seq_len} tokens per task, constant learning rate (ZO: the engine's automatic probe; LoRA: its default), "
        f"kd at temperature 1 from the dense model the checkpoint was pruned from.",
        f"- Held-out evaluation: {a.eval_samples} windows x {a.eval_seq_len} tokens per source, never overlapping the "
        "calibration text; multi-task NLL is the mean over the two sources of the held-out NLL (nats/token); "
        "KL is KL(dense || model) per token; top-1 is agreement of the greedy next token with dense.",
        "- Dense: perplexity " + ", ".join(f"{s} {dense[s]:.3f}" for s in SOURCES) + f" (multi-task NLL {nll(dense):.4f}).",
        "",
    ]
    header = (
        "| run | steps | train s (wall / CPU) | lr | peak / inference memory | ppl wiki (x dense) | ppl news (x dense) | "
        "multi-task NLL | KL wiki | KL news | top-1 wiki | top-1 news |"
    )
    rule = "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
    lines += [f"## Equal wall clock: {a.budget_s:g} s of training per run", "", header, rule]
    runs: dict[str, dict] = {}
    for plan in PLANS:
        lines.append(row(f"{plan}, none", untuned[plan], dense, ["0", "0", "", ""]))
        for method, objective in RECIPES:
            name = f"{plan}-{method}-{objective}"
            r = bench.read(name)
            if r is None:
                continue
            runs[name] = r
            lines.append(
                row(
                    f"{plan}, {method}-{objective}",
                    r["after"],
                    dense,
                    [str(r["steps_done"]), train_time(r), f"{r['lr']:.3g}", f"{r['rss_ratio']:.2f}x"],
                )
            )
    side_by_side = {o: bench.read(f"dp-lora-{o}-sbs") for o in ("lm", "kd")}
    if any(side_by_side.values()):
        lines += [
            "",
            f"## LoRA-kd against LoRA-lm on the DP checkpoint, side by side ({a.budget_s:g} s each)",
            "",
            header,
            rule,
            row("dp, none", untuned["dp"], dense, ["0", "0", "", ""]),
        ]
        for objective, r in side_by_side.items():
            if r is not None:
                runs[f"dp-lora-{objective}-sbs"] = r
                lines.append(
                    row(
                        f"dp, lora-{objective}",
                        r["after"],
                        dense,
                        [str(r["steps_done"]), train_time(r), f"{r['lr']:.3g}", f"{r['rss_ratio']:.2f}x"],
                    )
                )
    steps_runs = {m: bench.read(f"dp-{m}-kd-steps") for m, _ in ZO_RECIPES}
    if any(steps_runs.values()):
        lines += [
            "",
            f"## Equal steps: MaZO-kd against MeZO-kd on the DP checkpoint ({a.zo_seq_len}-token windows)",
            "",
            header,
            rule,
            row("dp, none", untuned["dp"], dense, ["0", "0", "", ""]),
        ]
        for method, r in steps_runs.items():
            if r is not None:
                lines.append(
                    row(
                        f"dp, {method}-kd",
                        r["after"],
                        dense,
                        [str(r["steps_done"]), train_time(r), f"{r['lr']:.3g}", f"{r['rss_ratio']:.2f}x"],
                    )
                )
    task_results = {name: bench.read(f"tasks-{name}") for name, _ in task_models(bench)}
    if any(task_results.values()):
        first = next(r for r in task_results.values() if r is not None)
        lines += [
            "",
            f"## Zero-shot accuracy on `{TASK}` (lm-eval, first {a.task_limit} examples, acc ± stderr in points)",
            "",
            "| model | acc |",
            "|---|---:|",
            f"| dense | {task_cell(first, 'dense_task_accuracy')} |",
        ]
        lines += [f"| {name} | {task_cell(r)} |" for name, r in task_results.items()]
    lines += ["", "## Targets", "", *targets(bench, untuned, runs, steps_runs, dense), ""]
    return "\n".join(lines)


def _plan_line(path: Path, label: str) -> str:
    params = json.loads(path.read_text())["params"]
    return (
        f"{label} removes {params['removed']:,} of {params['dense_prunable']:,} prunable parameters "
        f"({params['removed_fraction_of_prunable']:.2%})"
    )


def targets(bench: Bench, untuned: dict, runs: dict, steps_runs: dict, dense: dict) -> list[str]:
    out = []
    paired = "dp-lora-kd-sbs" in runs and "dp-lora-lm-sbs" in runs  # side by side: the fair comparison
    kd, lm = (runs["dp-lora-kd-sbs"], runs["dp-lora-lm-sbs"]) if paired else (runs.get("dp-lora-kd"), runs.get("dp-lora-lm"))
    if kd is not None:
        ratio = kd["after"]["perplexity"]["wiki-sample"] / dense["wiki-sample"]
        cpu = kd.get("train_cpu_seconds")
        spent = f"{cpu / 60:.1f} CPU-minutes" if cpu is not None else "CPU time not recorded"
        out.append(
            f"- DP + LoRA-kd, {bench.args.budget_s / 60:g} wall-clock minutes of training on one thread ({spent}): "
            f"held-out wiki perplexity at most 1.3x dense: {'met' if ratio <= 1.3 else 'MISSED'}, {ratio:.2f}x."
        )
    if kd is not None and lm is not None:
        better = [s for s in SOURCES if kd["after"]["perplexity"][s] < lm["after"]["perplexity"][s]]
        out.append(
            f"- DP + LoRA-kd better than LoRA-lm at the same wall clock ({'side by side' if paired else 'one after the other'}; "
            "held-out perplexity, both sources): "
            f"{'met' if len(better) == len(SOURCES) else 'MISSED'}, "
            + ", ".join(f"{s} {kd['after']['perplexity'][s]:.2f} vs {lm['after']['perplexity'][s]:.2f}" for s in SOURCES)
            + f"; KL {mean_kl(kd['after']):.4f} vs {mean_kl(lm['after']):.4f}."
        )
    for method, objective in RECIPES:
        dp, uni = runs.get(f"dp-{method}-{objective}"), runs.get(f"uniform-{method}-{objective}")
        if dp is None or uni is None:
            continue
        wins = [s for s in SOURCES if dp["after"]["perplexity"][s] < uni["after"]["perplexity"][s]]
        out.append(
            f"- DP + {method}-{objective} beats uniform + {method}-{objective} (equal budget and time): "
            f"{'met' if len(wins) == len(SOURCES) else 'MISSED'}, "
            + ", ".join(f"{s} {dp['after']['perplexity'][s]:.2f} vs {uni['after']['perplexity'][s]:.2f}" for s in SOURCES)
            + "."
        )
    mazo, mezo = steps_runs.get("mazo"), steps_runs.get("mezo")
    if mazo is not None and mezo is not None:
        a, b = nll(mazo["after"]["perplexity"]), nll(mezo["after"]["perplexity"])
        out.append(
            f"- MaZO beats MeZO at equal steps ({mazo['steps_done']} and {mezo['steps_done']}) on the held-out "
            f"multi-task NLL: {'met' if a < b else 'MISSED'}, {a:.4f} vs {b:.4f} (untuned {nll(untuned['dp']['perplexity']):.4f}); "
            f"mean KL {mean_kl(mazo['after']):.4f} vs {mean_kl(mezo['after']):.4f}."
        )
    if mazo is not None:
        out.append(
            f"- MaZO's peak memory at most 1.1x inference: {'met' if mazo['rss_ratio'] <= 1.1 else 'MISSED'}, "
            f"{mazo['rss_ratio']:.3f}x (kd: the teacher is resident in both measurements)."
        )
        before, after = mean_kl(untuned["dp"]), mean_kl(mazo["after"])
        share = (before - after) / before
        out.append(
            f"- MaZO removes at least a quarter of the DP plan's KL increase: {'met' if share >= 0.25 else 'MISSED'}, "
            f"{share:.1%} (mean KL {before:.4f} -> {after:.4f})."
        )
    out.append("- Step time against two forward passes: see `bench/results/zo_step.md`.")
    return out


def curves_csv(bench: Bench) -> str:
    lines = ["run,step,seconds,loss,lr"]
    for path in sorted(bench.work.glob("*-*.json")):
        result = json.loads(path.read_text())
        for r in result.get("curve", []) if isinstance(result, dict) else []:
            lines.append(f"{path.stem},{r['step']},{r['seconds']:.2f},{r['loss']:.5f},{r['lr']:.3g}")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    args = parse_args(argv)
    bench = Bench(args)
    for phase, fn in (
        ("prepare", prepare),
        ("wallclock", wallclock),
        ("kd-vs-lm", kd_against_lm),
        ("steps", equal_steps),
        ("tasks", tasks),
    ):
        if phase in args.phases:
            fn(bench)
    RESULTS.mkdir(exist_ok=True)
    atomic_write_text(RESULTS / CURVES, curves_csv(bench))
    report = with_header(markdown(bench), SCRIPT, regenerating_argv(args), files=[CURVES])
    atomic_write_text(Path(args.out), report)
    print(report, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
