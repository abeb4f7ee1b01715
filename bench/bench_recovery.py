"""Recovery benchmark: LoRA, MaZO and MeZO after pruning 20%, the DP plan against uniform.

On smollm2-135m at 20% of the prunable parameters, with the same within-layer criterion
(wanda) for both plans:

1. prepare (each step skipped when its file exists): a fisher KL loss table
   (16 x 256 tokens, rates 0, 1/8, ..., 7/8), the DP plan at budget 0.2, the uniform plan at
   the same budget from the same table, and both pruned checkpoints (``gap table``,
   ``gap plan``, ``gap prune``);
2. no tuning: ``gap eval`` of both checkpoints on held-out wiki-sample and news-sample, with
   the dense model beside them (perplexity, KL, top-1 agreement);
3. for each plan and method, ``gap recover`` in a process of its own (so its memory
   measurements start clean): LoRA and MaZO for a fixed wall-clock budget, MeZO for exactly
   the steps MaZO made (the equal-steps comparison); the same held-out evaluation after;
4. the report: ``bench/results/recovery.md`` (perplexities, memory against plain inference
   measured in the same process, the targets) and ``bench/results/recovery_curves.csv``
   (loss per step with wall time).

    python bench/bench_recovery.py [--budget-s 480] [--work runs/recovery]

A killed benchmark resumes: finished runs are read back from ``<work>/<plan>-<method>.json``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shlex
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from gap_engine.core.fsutil import atomic_write_json, atomic_write_text  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
SOURCES = ("wiki-sample", "news-sample")
PLANS = ("dp", "uniform")
METHODS = ("lora", "mazo", "mezo")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--budget", default="0.2", help="fraction of prunable parameters removed")
    p.add_argument("--budget-s", type=float, default=480.0, help="wall-clock training budget per LoRA/MaZO run")
    p.add_argument("--work", default="runs/recovery", help="folder for tables, plans, checkpoints and run JSON")
    p.add_argument("--batch-size", type=int, default=1, help="windows per task per step")
    p.add_argument("--seq-len", type=int, default=128, help="tokens per training window")
    p.add_argument("--eval-samples", type=int, default=4)
    p.add_argument("--eval-seq-len", type=int, default=256)
    return p.parse_args(argv)


class Bench:
    def __init__(self, args):
        self.args = args
        self.work = Path(args.work)
        self.work.mkdir(parents=True, exist_ok=True)
        self.commands: list[str] = []
        self.loads: list[tuple[str, tuple[float, float, float]]] = []
        self.env = dict(os.environ, PYTHONPATH=str(ROOT))

    def gap(self, argv: list[str], label: str) -> str:
        """Run `gap ARGV` in its own process; its stderr goes to <work>/<label>.log; returns stdout."""
        command = ["gap", *argv]
        self.commands.append(shlex.join(command))
        self.loads.append((f"{label} start", os.getloadavg()))
        started = time.perf_counter()
        with open(self.work / f"{label}.log", "w") as log:
            proc = subprocess.run([sys.executable, "-m", "gap_engine", *argv], cwd=ROOT, env=self.env,
                                  stdout=subprocess.PIPE, stderr=log, text=True)
        self.loads.append((f"{label} end ({time.perf_counter() - started:.0f} s)", os.getloadavg()))
        print(f"{label}: {time.perf_counter() - started:.0f} s, load {os.getloadavg()[0]:.1f}", flush=True)
        if proc.returncode != 0:
            raise SystemExit(f"{shlex.join(command)} failed ({proc.returncode}); see {self.work / (label + '.log')}")
        return proc.stdout

    def once(self, path: Path, argv: list[str], label: str) -> None:
        if path.exists():
            self.commands.append(shlex.join(["gap", *argv]) + "   # reused")
            return
        self.gap(argv, label)

    def cached_json(self, path: Path, argv: list[str], label: str) -> dict:
        if path.exists():
            self.commands.append(shlex.join(["gap", *argv]) + "   # reused")
            return json.loads(path.read_text())
        result = json.loads(self.gap(argv, label))
        atomic_write_json(path, result)
        return result


def prepare(bench: Bench) -> dict[str, Path]:
    a, w = bench.args, bench.work
    rates = ",".join(f"{i / 8:g}" for i in range(8))
    bench.once(w / "t.json", ["table", "--model", a.model, "--estimator", "fisher", "--objective", "kl", "--samples", "16",
                              "--seq-len", "256", "--rates", rates, "--out", str(w / "t.json")], "table")
    bench.once(w / "dp.json", ["plan", "--table", str(w / "t.json"), "--budget", a.budget, "--out", str(w / "dp.json")], "plan-dp")
    bench.once(w / "uniform.json", ["plan", "--table", str(w / "t.json"), "--budget", a.budget, "--allocator", "uniform",
                                    "--out", str(w / "uniform.json")], "plan-uniform")
    checkpoints = {"dp": w / "dp20", "uniform": w / "u20"}
    for plan, folder in checkpoints.items():
        bench.once(folder, ["prune", "--model", a.model, "--plan", str(w / f"{plan}.json"), "--out", str(folder)], f"prune-{plan}")
    return checkpoints


def recover_argv(bench: Bench, checkpoint: Path, method: str, out: Path, steps: int | None) -> list[str]:
    a = bench.args
    argv = ["recover", "--model", str(checkpoint), "--method", method, "--data", ",".join(SOURCES),
            "--batch-size", str(a.batch_size), "--seq-len", str(a.seq_len), "--schedule", "constant",
            "--eval-samples", str(a.eval_samples), "--eval-seq-len", str(a.eval_seq_len), "--generations", "1",
            "--no-eval-before", "--save-every", "10", "--out", str(out), "--json"]
    if steps is None:  # a wall-clock budget; the step cap is never reached
        argv += ["--steps", "100000", "--time-budget", f"{a.budget_s:g}"]
    else:
        argv += ["--steps", str(steps)]
    return argv


def multitask_nll(perplexity: dict) -> float:
    """The multi-task objective on held-out text: the mean over tasks of each task's NLL."""
    return sum(math.log(perplexity[s]) for s in SOURCES) / len(SOURCES)


def main(argv=None) -> int:
    args = parse_args(argv)
    bench = Bench(args)
    started = time.perf_counter()
    checkpoints = prepare(bench)
    eval_argv = ["--data", ",".join(SOURCES), "--samples", str(args.eval_samples), "--seq-len", str(args.eval_seq_len),
                 "--generations", "1", "--no-throughput", "--json"]
    untuned = {plan: bench.cached_json(bench.work / f"{plan}-none.json", ["eval", "--model", str(folder), *eval_argv],
                                       f"eval-{plan}") for plan, folder in checkpoints.items()}
    runs: dict[tuple[str, str], dict] = {}
    for plan, folder in checkpoints.items():
        for method in METHODS:
            steps = runs[(plan, "mazo")]["steps_done"] if method == "mezo" else None
            out = bench.work / f"{plan}-{method}"
            runs[(plan, method)] = bench.cached_json(
                bench.work / f"{plan}-{method}.json", recover_argv(bench, folder, method, out, steps), f"recover-{plan}-{method}"
            )
    RESULTS.mkdir(exist_ok=True)
    atomic_write_text(RESULTS / "recovery_curves.csv", curves_csv(runs))
    report = markdown(bench, untuned, runs, time.perf_counter() - started)
    atomic_write_text(RESULTS / "recovery.md", report)
    print(report)
    return 0


def curves_csv(runs: dict) -> str:
    lines = ["plan,method,step,seconds,loss,lr"]
    for (plan, method), result in runs.items():
        lines += [f"{plan},{method},{r['step']},{r['seconds']:.2f},{r['loss']:.5f},{r['lr']:.3g}" for r in result["curve"]]
    return "\n".join(lines) + "\n"


def _fmt_delta(after: float, before: float) -> str:
    return f"{after:.3f} ({after - before:+.3f})"


def markdown(bench: Bench, untuned: dict, runs: dict, seconds: float) -> str:
    a = bench.args
    dense = untuned["dp"]["dense"]["perplexity"]
    lines = [
        "# Recovery after pruning: LoRA, MaZO and MeZO at 20%, DP plan against uniform",
        "",
        "Generated by `bench/bench_recovery.py`:",
        "",
        "```",
        f"python bench/bench_recovery.py --budget-s {a.budget_s:g} --work {a.work}",
        "```",
        "",
        "which ran, each in its own process:",
        "",
        "```",
        *bench.commands,
        "```",
        "",
        f"Machine: {platform.machine()}, {torch.get_num_threads()} torch threads on 2 cores shared with other sessions, "
        f"no GPU; torch {torch.__version__}. The whole benchmark took {seconds / 60:.0f} min. Load average (1, 5, 15 min) "
        "at the start and end of each run:",
        "",
        "| run | load average |",
        "|---|---|",
        *[f"| {label} | {l1:.2f}, {l5:.2f}, {l15:.2f} |" for label, (l1, l5, l15) in bench.loads],
        "",
        "## Settings",
        "",
        f"- Model {a.model}; both plans come from the same fisher KL table with criterion wanda: "
        + "; ".join(_plan_line(bench.work / f"{plan}.json", plan) for plan in PLANS) + ".",
        f"- Training: tasks {', '.join(SOURCES)} (calibration parts only), every step {a.batch_size} window(s) x "
        f"{a.seq_len} tokens from each task, constant learning rate. LoRA and MaZO train for a wall-clock budget of "
        f"{a.budget_s:g} s each; MeZO trains for exactly as many steps as MaZO did on the same plan.",
        "- Learning rates (the engine's defaults; how they were chosen is in the notes below): "
        + ", ".join(f"{m} {runs[('dp', m)]['lr']:g}" for m in METHODS)
        + f"; LoRA rank {runs[('dp', 'lora')]['settings']['rank']}, alpha {runs[('dp', 'lora')]['settings']['alpha']:g}, "
        f"dropout {runs[('dp', 'lora')]['settings']['dropout']:g}, all seven projections; ZO eps "
        f"{runs[('dp', 'mazo')]['settings']['eps']:g}; MaZO keeps {runs[('dp', 'mazo')]['settings']['mask_fraction']:g} "
        f"of every row (magnitude weight {runs[('dp', 'mazo')]['settings']['magnitude_weight']:g}).",
        f"- Held-out evaluation: {a.eval_samples} windows x {a.eval_seq_len} tokens per source, never overlapping the "
        "calibration text; the multi-task objective is the mean over the two tasks of the held-out NLL (nats/token).",
        f"- Dense model: perplexity wiki-sample {dense['wiki-sample']:.3f}, news-sample {dense['news-sample']:.3f} "
        f"(multi-task NLL {multitask_nll(dense):.4f}).",
        "",
        "## Held-out perplexity",
        "",
        "| plan | recovery | steps | train s | ppl wiki-sample | ppl news-sample | multi-task NLL | KL wiki | KL news | top-1 wiki | top-1 news |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for plan in PLANS:
        base = untuned[plan]
        lines.append(
            f"| {plan} | none | 0 | 0 | {base['perplexity']['wiki-sample']:.3f} | {base['perplexity']['news-sample']:.3f} | "
            f"{multitask_nll(base['perplexity']):.4f} | {base['kl_to_dense']['wiki-sample']:.4f} | "
            f"{base['kl_to_dense']['news-sample']:.4f} | {base['top1_agreement']['wiki-sample']:.3f} | "
            f"{base['top1_agreement']['news-sample']:.3f} |"
        )
        for method in METHODS:
            r = runs[(plan, method)]
            after = r["after"]
            lines.append(
                f"| {plan} | {method} | {r['steps_done']} | {r['train_seconds']:.0f} | "
                f"{_fmt_delta(after['perplexity']['wiki-sample'], base['perplexity']['wiki-sample'])} | "
                f"{_fmt_delta(after['perplexity']['news-sample'], base['perplexity']['news-sample'])} | "
                f"{multitask_nll(after['perplexity']):.4f} | {after['kl_to_dense']['wiki-sample']:.4f} | "
                f"{after['kl_to_dense']['news-sample']:.4f} | {after['top1_agreement']['wiki-sample']:.3f} | "
                f"{after['top1_agreement']['news-sample']:.3f} |"
            )
    lines += [
        "",
        "Calibration loss (the training objective, on 4 fixed calibration windows of each task, before -> after):",
        "",
        "| plan | method | wiki-sample | news-sample | mean |",
        "|---|---|---:|---:|---:|",
    ]
    for plan in PLANS:
        for method in METHODS:
            r = runs[(plan, method)]
            b, f = r["calib_loss_before"], r["calib_loss_after"]
            lines.append(
                f"| {plan} | {method} | {b[0]:.4f} -> {f[0]:.4f} | {b[1]:.4f} -> {f[1]:.4f} | "
                f"{sum(b) / 2:.4f} -> {sum(f) / 2:.4f} ({sum(f) / 2 - sum(b) / 2:+.4f}) |"
            )
    lines += [
        "",
        "## Peak resident memory",
        "",
        "Measured in each run's process by the kernel's high-water mark (VmHWM, reset through /proc/self/clear_refs): "
        "plain inference is one no-grad forward pass of the training batch through the same model, just before "
        "training; training is the whole step loop. Both include the Python runtime, torch and the loaded model.",
        "",
        "| plan | method | trained params | inference MiB | training MiB | ratio | delta MiB |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for plan in PLANS:
        for method in METHODS:
            r = runs[(plan, method)]
            lines.append(
                f"| {plan} | {method} | {r['trainable_params']:,} | {r['inference_rss'] / 2**20:.0f} | "
                f"{r['peak_rss'] / 2**20:.0f} | {r['rss_ratio']:.3f} | {r['rss_delta'] / 2**20:+.0f} |"
            )
    lines += ["", "## Targets", ""] + targets(untuned, runs, dense)
    lines += [
        "",
        "## Loss curves",
        "",
        "Per step: the training loss (LoRA: before the update; ZO: the mean of the two perturbed evaluations) and the "
        "wall time since training started, in `bench/results/recovery_curves.csv`. Every fifth step here:",
        "",
        "| plan | method | step: loss @ seconds |",
        "|---|---|---|",
    ]
    for plan in PLANS:
        for method in METHODS:
            curve = runs[(plan, method)]["curve"]
            picked = [row for row in curve if row["step"] % 5 == 0 or row["step"] == 1 or row is curve[-1]]
            lines.append(f"| {plan} | {method} | " + ", ".join(f"{r['step']}: {r['loss']:.3f} @ {r['seconds']:.0f}" for r in picked) + " |")
    lines += ["", "## Generations (greedy, 24 tokens)", ""]
    for plan in PLANS:
        g = untuned[plan]["generations"][0]
        lines.append(f"- prompt {g['prompt']!r}; dense: {g['dense']!r}; {plan} untuned: {g['model']!r}")
        for method in METHODS:
            lines.append(f"  - {plan} + {method}: {runs[(plan, method)]['after']['generations'][0]['model']!r}")
    return "\n".join(lines) + "\n"


def _plan_line(path: Path, label: str) -> str:
    params = json.loads(path.read_text())["params"]
    return (
        f"{label} removes {params['removed']:,} of {params['dense_prunable']:,} prunable parameters "
        f"({params['removed_fraction_of_prunable']:.2%}; {params['pruned_total']:,} left)"
    )


def targets(untuned: dict, runs: dict, dense: dict) -> list[str]:
    out = []
    for source in SOURCES:
        base = untuned["dp"]["perplexity"][source]
        lora = runs[("dp", "lora")]["after"]["perplexity"][source]
        removed = (base - lora) / (base - dense[source])
        out.append(
            f"- LoRA removes at least half of the DP plan's perplexity increase over dense ({source}): "
            f"{'met' if removed >= 0.5 else 'MISSED'}, it removes {removed:.1%} "
            f"({base:.2f} -> {lora:.2f}, dense {dense[source]:.2f})."
        )
    for method in METHODS:
        dp, uni = runs[("dp", method)]["after"]["perplexity"], runs[("uniform", method)]["after"]["perplexity"]
        wins = [s for s in SOURCES if dp[s] < uni[s]]
        out.append(
            f"- DP after {method} beats uniform after {method}: {'met' if len(wins) == len(SOURCES) else 'MISSED'} "
            + ", ".join(f"{s} {dp[s]:.2f} vs {uni[s]:.2f}" for s in SOURCES) + "."
        )
    for plan in PLANS:
        mazo, lora = runs[(plan, "mazo")], runs[(plan, "lora")]
        out.append(
            f"- MaZO's peak memory within 1.2x of inference ({plan}): {'met' if mazo['rss_ratio'] <= 1.2 else 'MISSED'}, "
            f"{mazo['rss_ratio']:.3f}x (LoRA {lora['rss_ratio']:.3f}x, MeZO {runs[(plan, 'mezo')]['rss_ratio']:.3f}x)."
        )
    for plan in PLANS:
        mazo, mezo = runs[(plan, "mazo")], runs[(plan, "mezo")]
        a, b = multitask_nll(mazo["after"]["perplexity"]), multitask_nll(mezo["after"]["perplexity"])
        none = multitask_nll(untuned[plan]["perplexity"])
        out.append(
            f"- MaZO beats MeZO at equal steps ({mazo['steps_done']} and {mezo['steps_done']}) on the held-out multi-task "
            f"objective ({plan}): {'met' if a < b else 'MISSED'}, {a:.4f} vs {b:.4f} nats (untuned {none:.4f})."
        )
    return out


if __name__ == "__main__":
    sys.exit(main())
