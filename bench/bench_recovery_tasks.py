"""Recovery judged by task accuracy at the budgets where accuracy is lost.

SmolLM2-135M pruned 30% and 40% of its prunable parameters by the DP plan and by the uniform
plan (both from the default loss table), each recovered for the same CPU time (``--cpu-budget``,
one torch thread) by four recipes:

* ``lora-kd-text``: LoRA, kd, on the built-in texts (wiki-sample, news-sample);
* ``lora-kd-teacher``: LoRA, kd, on text the dense model wrote (``--data teacher``);
* ``lora-kdlm-both``: LoRA, kd+lm, on both (teacher text and the two built-in texts);
* ``mazo-kd-teacher``: MaZO, kd, on teacher text (the learning rate from the engine's probe).

Every model (dense, the four untuned checkpoints, every recovered one) is then measured by one
``gap eval``: accuracy on all 500 examples of the offline task ``gap_wiki_next`` (lm-eval), and
held-out perplexity and KL to dense on 8 x 256 tokens of wiki-sample and of news-sample.

Resumable: each finished run adds one row to ``bench/results/recovery_tasks.jsonl`` (committed
beside the report, so rows outlive the work folder) and is skipped when the benchmark runs again; a
run killed while training resumes from its last snapshot (its CPU budget counts every segment).
Each command runs on one thread (``OMP_NUM_THREADS=1``); to use two cores, run two processes on
different checkpoints (``--only``) in the same ``--work`` folder once the table, plans and
checkpoints are prepared: rows are merged under a lock, and each process rewrites the whole report
from every row. The load average is written beside every run. Rows marked ``reconstructed`` were
parsed back from an earlier report whose raw rows were lost (values to the printed precision). Order:
dense, then DP 30% (untuned, the four recipes), uniform 30%, DP 40%, uniform 40%; training is
bounded by CPU time, so rows run under different loads still compare at equal work.

    nice -n 10 python bench/bench_recovery_tasks.py --work runs/rt [--cpu-budget 900] [--only dp30]
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from report import RESULTS, command_line, machine_description, with_header

SCRIPT = "bench/bench_recovery_tasks.py"
MODEL = "smollm2-135m"
TEXTS = "wiki-sample,news-sample"
TASK = "gap_wiki_next"
BUDGETS = ("30", "40")
PLANS = ("dp", "uniform")
# name -> (method, objective, training texts)
RECIPES = {
    "lora-kd-text": ("lora", "kd", TEXTS),
    "lora-kd-teacher": ("lora", "kd", "teacher"),
    "lora-kdlm-both": ("lora", "kd+lm", "teacher," + TEXTS),
    "mazo-kd-teacher": ("mazo", "kd", "teacher"),
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--work", default="runs/rt", help="folder for the table, plans, checkpoints, logs and rows.jsonl")
    p.add_argument("--cpu-budget", type=float, default=900.0, help="CPU-seconds of training per recovery")
    p.add_argument("--teacher-tokens", type=int, default=None, help="tokens of teacher text (default: the engine's)")
    p.add_argument("--only", default="", help="comma-separated checkpoints to run (e.g. dp30,uniform30); default all")
    p.add_argument("--recipes", default=",".join(RECIPES), help="comma-separated recipes to run")
    p.add_argument("--report-only", action="store_true", help="rewrite the report from rows.jsonl and stop")
    p.add_argument("--out", default=str(RESULTS / "recovery_tasks.md"))
    p.add_argument("--rows", default=str(RESULTS / "recovery_tasks.jsonl"), help="the rows file (one JSON row per run)")
    return p


def parse_args(argv=None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


class Bench:
    def __init__(self, args):
        self.args = args
        self.work = Path(args.work).resolve()
        self.work.mkdir(parents=True, exist_ok=True)
        self.rows_path = Path(args.rows).resolve()
        self.rows = read_rows(self.rows_path)

    def done(self, label: str) -> bool:
        self.rows = read_rows(self.rows_path)  # another process on the other core may have added rows
        return any(row["label"] == label for row in self.rows)

    def gap(self, label: str, argv: list[str], json_out: bool) -> tuple[dict | None, dict]:
        """Run one ``gap`` command on one thread; (its JSON output or None, a timing record)."""
        env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
        load_start, started, cpu = os.getloadavg(), time.perf_counter(), os.times()
        with open(self.work / f"{label}.log", "w") as log:
            proc = subprocess.run(
                [sys.executable, "-m", "gap_engine", *argv], cwd=ROOT, env=env, stderr=log, text=True,
                stdout=subprocess.PIPE if json_out else subprocess.DEVNULL,
            )  # fmt: skip
        if proc.returncode != 0:
            raise SystemExit(f"{shlex.join(['gap', *argv])} failed ({proc.returncode}); see {self.work / (label + '.log')}")
        after = os.times()
        record = {
            "command": shlex.join(["gap", *argv]),
            "seconds": round(time.perf_counter() - started, 1),
            "cpu_seconds": round(after.children_user + after.children_system - cpu.children_user - cpu.children_system, 1),
            "load_start": [round(x, 2) for x in load_start],
            "load_end": [round(x, 2) for x in os.getloadavg()],
        }
        print(f"{label}: {record['seconds']:.0f} s, load {record['load_end'][0]:.1f}", flush=True)
        return (json.loads(proc.stdout) if json_out else None), record

    def append(self, row: dict) -> None:
        """Merge one row into the rows file under a lock (a second process may be writing), then the report."""
        from gap_engine.core.fsutil import atomic_write_text

        self.rows_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.work / "rows.lock", "w") as lock:  # in the work folder: never committed
            fcntl.flock(lock, fcntl.LOCK_EX)
            rows = [r for r in read_rows(self.rows_path) if r["label"] != row["label"]] + [row]
            atomic_write_text(self.rows_path, "".join(json.dumps(r) + "\n" for r in rows))
            self.rows = rows
            write_report(self.rows, self.args)


def read_rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def prepare(bench: Bench) -> None:
    """The table, the plans and the pruned checkpoints (each skipped where it exists)."""
    w = bench.work
    if not (w / "t.json").exists():
        bench.gap("table", ["table", "--model", MODEL, "--out", str(w / "t.json")], False)
    for budget in BUDGETS:
        for plan in PLANS:
            plan_file, folder = w / f"{plan}{budget}.json", w / f"{plan}{budget}"
            if not plan_file.exists():
                extra = ["--allocator", "uniform"] if plan == "uniform" else []
                bench.gap(f"plan-{plan}{budget}", ["plan", "--table", str(w / "t.json"), "--budget", f"0.{budget}", *extra,
                                                   "--out", str(plan_file)], False)  # fmt: skip
            if not folder.exists():
                bench.gap(f"prune-{plan}{budget}", ["prune", "--model", MODEL, "--plan", str(plan_file), "--out", str(folder)], False)


def teacher_text(bench: Bench) -> None:
    """Write the teacher text once (timed on its own: every teacher recipe then reads the cache)."""
    if bench.done("teacher-text"):
        return
    tokens = f":{bench.args.teacher_tokens}" if bench.args.teacher_tokens else ""
    code = (
        "import torch; torch.set_num_threads(1)\n"
        "from gap_engine.core.progress import Hooks\n"
        "from gap_engine.model.loading import load_model\n"
        "from gap_engine.recover import teacher_text as t\n"
        f"spec = t.TeacherTextSpec(tokens=t.parse_tokens('teacher{tokens}'), seq_len=128, seed=0)\n"
        f"t.teacher_text(load_model('{MODEL}'), spec, Hooks(message=print))\n"
    )
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    load_start, started = os.getloadavg(), time.perf_counter()
    with open(bench.work / "teacher-text.log", "w") as log:
        subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, stdout=log, stderr=log, check=True)
    bench.append(
        {
            "label": "teacher-text",
            "kind": "teacher-text",
            "tokens": bench.args.teacher_tokens,
            "seconds": round(time.perf_counter() - started, 1),
            "load_start": [round(x, 2) for x in load_start],
            "load_end": [round(x, 2) for x in os.getloadavg()],
        }
    )


def measure(bench: Bench, label: str, model: str) -> tuple[dict, dict]:
    """``gap eval``: task accuracy on every example, held-out perplexity and KL on both texts."""
    argv = ["eval", "--model", model, "--data", TEXTS, "--samples", "8", "--seq-len", "256", "--generations", "0",
            "--no-throughput", "--tasks", TASK, "--batch-size", "8", "--json"]  # fmt: skip
    report, record = bench.gap(f"eval-{label}", argv, True)
    assert report is not None
    task = (report.get("task_accuracy") or {}).get(TASK, {})
    numbers = {
        "acc": task.get("acc"),
        "acc_stderr": task.get("acc_stderr"),
        "n": task.get("n"),
        "dense_acc": ((report.get("dense_task_accuracy") or {}).get(TASK) or {}).get("acc"),
        "perplexity": report.get("perplexity"),
        "kl": report.get("kl_to_dense"),
        "dense_perplexity": (report.get("dense") or {}).get("perplexity"),
    }
    return numbers, record


def untuned(bench: Bench, checkpoints: list[str]) -> None:
    for name in ["dense", *checkpoints]:
        label = f"{name}-none"
        if bench.done(label):
            continue
        numbers, record = measure(bench, label, MODEL if name == "dense" else str(bench.work / name))
        bench.append({"label": label, "kind": "untuned", "checkpoint": name, "recipe": "none", **numbers, "eval": record})


def recovery(bench: Bench, checkpoint: str, recipe: str) -> None:
    label = f"{checkpoint}-{recipe}"
    if bench.done(label):
        return
    method, objective, data = RECIPES[recipe]
    if "teacher" in data and bench.args.teacher_tokens:
        data = data.replace("teacher", f"teacher:{bench.args.teacher_tokens}")
    out = bench.work / label
    argv = ["recover", "--model", str(bench.work / checkpoint), "--method", method, "--objective", objective, "--data", data,
            "--eval-data", TEXTS, "--batch-size", "1", "--seq-len", "128", "--warmup", "10", "--steps", "1000000",
            "--cpu-budget", str(bench.args.cpu_budget), "--save-every", "50", "--eval-samples", "1", "--eval-seq-len", "64",
            "--generations", "0", "--no-eval-before", "--no-history", "--resume", "--json", "--out", str(out)]  # fmt: skip
    result_file = bench.work / f"{label}.json"
    if result_file.exists():
        result, train_record = json.loads(result_file.read_text()), {"command": "(an earlier run)"}
    else:
        result, train_record = bench.gap(f"recover-{label}", argv, True)
        result_file.write_text(json.dumps(result))
    assert result is not None
    numbers, eval_record = measure(bench, label, str(out))
    bench.append(
        {
            "label": label,
            "kind": "recovered",
            "checkpoint": checkpoint,
            "recipe": recipe,
            "steps": result["steps_done"],
            "stopped": result["stopped"],
            "train_seconds": round(result["train_seconds"], 1),
            "train_cpu_seconds": round(result["train_cpu_seconds"], 1),
            "lr": result["lr"],
            "rollbacks": len(result.get("rollbacks") or []),
            "tokens_seen": result.get("tokens_seen"),
            **numbers,
            "train": train_record,
            "eval": eval_record,
        }
    )


# ---- the report -----------------------------------------------------------------------------------
def _pct(row: dict | None) -> str:
    if not row or row.get("acc") is None:
        return "-"
    return f"{100 * row['acc']:.1f} ± {100 * (row.get('acc_stderr') or 0):.1f}"


def _ppl(row: dict, text: str) -> str:
    value, dense = (row.get("perplexity") or {}).get(text), (row.get("dense_perplexity") or {}).get(text)
    if value is None:
        return "-"
    return f"{value:.2f}" + (f" ({value / dense:.2f}x)" if dense else "")


def _kl(row: dict, text: str) -> str:
    value = (row.get("kl") or {}).get(text)
    return "-" if value is None else f"{value:.4f}"


def _load(row: dict) -> str:
    record = row.get("train") or row.get("eval") or {}
    start, end = record.get("load_start"), record.get("load_end")
    return f"{start[0]:.1f} -> {end[0]:.1f}" if start and end else "-"


def regenerating_argv(args) -> list[str]:
    """The arguments that make every row (each run skipped where its row exists) and the report."""
    return ["--work", "runs/rt", "--cpu-budget", f"{args.cpu_budget:g}"]


RECONSTRUCTED_MARK = "(r)"


def write_report(rows: list[dict], args) -> None:
    from gap_engine.core.fsutil import atomic_write_text

    by = {row["label"]: row for row in rows}
    wiki, news = TEXTS.split(",")
    reconstructed = [row["label"] for row in rows if row.get("reconstructed")]
    argv = regenerating_argv(args)
    lines = [
        "# Recovery judged by task accuracy: DP and uniform at 30% and 40%, four recipes at equal CPU time",
        "",
        "Generated by `bench/bench_recovery_tasks.py` (its docstring describes the runs); rewritten after every row:",
        "",
        "```",
        "nice -n 10 " + command_line(SCRIPT, argv),
        "```",
        "",
        f"{machine_description()} (read when this report was written). Every command one process on one torch thread, "
        "at most two at once (the load column: 1-minute load average at the start and end of "
        "the recovery, else of the evaluation). Task: `gap_wiki_next`, all examples (lm-eval acc ± its standard error, "
        f"in points). Held-out: 8 x 256 tokens of each text, never trained on; perplexity (x dense) and KL(dense || model).",
        "",
    ]
    if reconstructed:
        lines += [
            f"**{len(reconstructed)} of {len(rows)} rows are reconstructed, not measured by this file's runs** (marked "
            f"{RECONSTRUCTED_MARK}): their runs' raw rows were lost and their numbers were parsed back from an earlier printed "
            "report, to its printed precision. Deleting those rows from the rows file and running the command again "
            "measures them anew (about 15 CPU-minutes of training and an evaluation each). Reconstructed: "
            + ", ".join(reconstructed)
            + ".",
            "",
        ]
    teacher = by.get("teacher-text")
    if teacher:
        mark = f" {RECONSTRUCTED_MARK}" if teacher.get("reconstructed") else ""
        lines += [f"Teacher text{mark}: written once in {teacher['seconds']:.0f} s (load {teacher['load_start'][0]:.1f} -> "
                  f"{teacher['load_end'][0]:.1f}), then read from the cache by every teacher recipe.", ""]  # fmt: skip
    header = (
        f"| checkpoint | recipe | steps | train CPU s | acc (n) | ppl {wiki} | ppl {news} | KL {wiki} | KL {news} | load |\n"
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---|"
    )
    lines += [header]
    order = ["dense-none"] + [f"{plan}{b}-{r}" for b in BUDGETS for plan in PLANS for r in ("none", *RECIPES)]
    for label in order:
        row = by.get(label)
        if row is None:
            continue
        steps = str(row.get("steps", "")) + (f" ({row['rollbacks']} rollbacks)" if row.get("rollbacks") else "")
        cpu = f"{row['train_cpu_seconds']:.0f}" if row.get("train_cpu_seconds") is not None else ""
        mark = f" {RECONSTRUCTED_MARK}" if row.get("reconstructed") else ""
        lines.append(
            f"| {row['checkpoint']}{mark} | {row['recipe']} | {steps} | {cpu} | {_pct(row)} ({row.get('n', '-')}) | {_ppl(row, wiki)} | "
            f"{_ppl(row, news)} | {_kl(row, wiki)} | {_kl(row, news)} | {_load(row)} |"
        )
    lines += ["", "## Targets", "", *targets(by), ""]
    atomic_write_text(Path(args.out), with_header("\n".join(lines), SCRIPT, argv, files=[Path(args.rows).name]))


def targets(by: dict) -> list[str]:
    """Each target of this benchmark met or missed, with its margin (or 'not measured yet')."""
    out = []

    def acc(label: str) -> float | None:
        row = by.get(label)
        return None if not row or row.get("acc") is None else 100 * row["acc"]

    def resting(*labels: str) -> str:
        """' Rests on reconstructed rows: ...' when any row a verdict reads was not measured by this file's runs."""
        names = [label for label in labels if (by.get(label) or {}).get("reconstructed")]
        return f" Rests on reconstructed rows: {', '.join(names)}." if names else ""

    dense = acc("dense-none")
    best = max(((acc(f"dp30-{r}"), r) for r in RECIPES if acc(f"dp30-{r}") is not None), default=None)
    if dense is not None and best is not None and acc("dp30-none") is not None:
        gap_dense, gain = best[0] - dense, best[0] - acc("dp30-none")
        out.append(
            f"- DP 30% + 15 CPU-minutes of recovery, best recipe {best[1]} at {best[0]:.1f}: within 2 points of dense "
            f"{dense:.1f}: {'met' if gap_dense >= -2 else 'MISSED'} ({gap_dense:+.1f} from dense, {gap_dense + 2:+.1f} against "
            f"the target); at least 3 above untuned {acc('dp30-none'):.1f}: {'met' if gain >= 3 else 'MISSED'} ({gain:+.1f})."
            + resting("dense-none", "dp30-none", *(f"dp30-{r}" for r in RECIPES))
        )
    for budget in BUDGETS:
        for plan in PLANS:
            text, teach = by.get(f"{plan}{budget}-lora-kd-text"), by.get(f"{plan}{budget}-lora-kd-teacher")
            if not text or not teach:
                continue
            acc_margin = 100 * (teach["acc"] - text["acc"])
            kl_pairs = {t: ((teach["kl"] or {}).get(t, 0), (text["kl"] or {}).get(t, 0)) for t in TEXTS.split(",")}
            kl_lower = all(teacher_kl < text_kl for teacher_kl, text_kl in kl_pairs.values())
            verdict = "met on accuracy" if acc_margin > 0 else ("met on KL" if kl_lower else "MISSED")
            out.append(
                f"- {plan} {budget}%: teacher text beats built-in text (LoRA kd, equal CPU time): {verdict}; accuracy "
                f"{acc_margin:+.1f} points; KL to dense, teacher against built-in text: "
                + ", ".join(f"{a:.4f} vs {b:.4f} ({t})" for t, (a, b) in kl_pairs.items())
                + "."
                + resting(f"{plan}{budget}-lora-kd-text", f"{plan}{budget}-lora-kd-teacher")
            )
    for budget in BUDGETS:
        for recipe in RECIPES:
            dp, uniform = by.get(f"dp{budget}-{recipe}"), by.get(f"uniform{budget}-{recipe}")
            if not dp or not uniform:
                continue
            margin = 100 * (dp["acc"] - uniform["acc"])
            out.append(
                f"- DP + {recipe} beats uniform + {recipe} at {budget}%: {'met' if margin > 0 else 'MISSED'}, {margin:+.1f} points."
                + resting(f"dp{budget}-{recipe}", f"uniform{budget}-{recipe}")
            )
    missing = [f"{plan}{b}-{r}" for b in BUDGETS for plan in PLANS for r in ("none", *RECIPES) if f"{plan}{b}-{r}" not in by]
    if missing:
        out.append(f"- not measured yet ({len(missing)} rows): " + ", ".join(missing) + ".")
    return out


def main(argv=None) -> None:
    args = parse_args(argv)
    bench = Bench(args)
    if args.report_only:
        write_report(bench.rows, args)
        return
    prepare(bench)
    only = [c for c in args.only.split(",") if c] or [f"{plan}{b}" for b in BUDGETS for plan in PLANS]
    recipes = [r for r in args.recipes.split(",") if r]
    untuned(bench, [])  # dense first: every other row is read against it
    for budget in BUDGETS:  # 30% first, and DP first within it: the first two targets need only DP at 30%
        for plan in PLANS:
            if f"{plan}{budget}" not in only:
                continue
            untuned(bench, [f"{plan}{budget}"])
            for recipe in recipes:
                if "teacher" in RECIPES[recipe][2]:
                    teacher_text(bench)  # only once some recipe reads it, so a run of built-in-text recipes never waits for it
                recovery(bench, f"{plan}{budget}", recipe)


if __name__ == "__main__":
    main()
