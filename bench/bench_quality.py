"""Quality benchmark: GAP's DP against the field's methods at equal budget, each with compensation.

For every budget, method (allocator) and compensation, a copy of the model is pruned for real
and measured on held-out text of both built-in sources: perplexity, KL(dense || pruned) per
token and top-1 agreement with the dense model; then, for each method's best compensation at
that budget (lowest mean held-out KL), zero-shot accuracy on the offline task
``gap_wiki_next``. The methods:

- ``dp``: GAP's DP on the default loss table (fisher, KL, wanda criterion);
- ``uniform``: the same rate everywhere, same criterion: with the same compensation a
  comparison against DP isolates the allocator;
- ``flap``: FLAP as its paper built it: fluctuation metric, per-layer standardisation and
  global selection; its own compensation is ``bias``;
- ``slimgpt``: SlimGPT's log-increasing layer rates and greedy OBS block by block with its
  update (criterion ``obs``): its compensation is built in, so it runs with ``none``;
- ``owl`` on request.

Compensations (``prune.compensations``): none, bias, refit, bias+refit, each fitted on the
table's calibration windows. Every row is appended to the CSV as soon as it is measured, with
the load average at its start and end, so an interrupted run keeps what it measured and
``--resume`` measures only what is missing.

    python bench/bench_quality.py [--model smollm2-135m] [--budgets 0.1,0.2,0.3,0.4,0.5]
        [--methods dp:none,dp:bias,...] [--task-limit 100] [--name quality] [--resume]

Settings are small but stated in the report: 16 x 256 calibration tokens (the table's),
8 x 256 held-out tokens per source, the task on its first ``--task-limit`` examples.
"""

from __future__ import annotations

import argparse
import csv
import logging
import math
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from quality_report import report_text
from report import RESULTS, add_eval_args, machine_line

from gap_engine.cli.output import csv_text
from gap_engine.core.config import CLI_TABLE, WindowSpec
from gap_engine.core.fsutil import atomic_write_text, cache_root
from gap_engine.core.progress import Hooks
from gap_engine.data.bos import text_start
from gap_engine.data.windows import batches, calibration_windows
from gap_engine.evaluate.metrics import mean_nll
from gap_engine.evaluate.tasks import dense_task_scores, prepare_tasks, run_tasks, task_settings
from gap_engine.model.loading import load_model
from gap_engine.pipeline.compare import heldout_sets
from gap_engine.pipeline.stages import loss_table, prune_with_plan
from gap_engine.plan.allocator_registry import needs_windows
from gap_engine.plan.allocators import plan_from_table
from gap_engine.prune.compensation_pass import prune_compensated
from gap_engine.prune.compensations import CompensationSettings
from gap_engine.prune.criteria import is_sequential
from gap_engine.prune.importance import compute_importance
from gap_engine.tables.artefact import TableSpec, parse_rate_grid

log = logging.getLogger("bench_quality")
TASK = "gap_wiki_next"
DEFAULT_METHODS = (
    "dp:none,dp:bias,dp:refit,dp:bias+refit,uniform:none,uniform:bias,uniform:refit,uniform:bias+refit,"
    "flap:none,flap:bias,flap:refit,flap:bias+refit,slimgpt:none"
)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--data", default=CLI_TABLE.windows.data, help="calibration text of the table (and of compensation)")
    p.add_argument("--estimator", default=CLI_TABLE.estimator)
    p.add_argument("--objective", default=CLI_TABLE.objective)
    p.add_argument("--samples", type=int, default=CLI_TABLE.windows.n_samples, help="calibration windows")
    p.add_argument("--seq-len", type=int, default=CLI_TABLE.windows.seq_len, help="tokens per calibration window")
    p.add_argument("--rates", default=",".join(f"{r:g}" for r in CLI_TABLE.rate_grid), help="the table's rate grid")
    p.add_argument("--criterion", default="wanda", help="the table's criterion (dp, uniform, owl prune by it)")
    p.add_argument("--budgets", default="0.1,0.2,0.3,0.4,0.5")
    p.add_argument("--methods", default=DEFAULT_METHODS, help="allocator:compensation, comma-separated")
    p.add_argument("--task-limit", type=int, default=100, help="examples of gap_wiki_next per scored model; 0: no task")
    add_eval_args(p)
    p.add_argument("--name", default="quality", help="output files: bench/results/<name>.md and .csv")
    p.add_argument("--resume", action="store_true", help="keep the rows already in <name>.csv (same settings: the caller's word)")
    return p.parse_args(argv)


def read_rows(path: Path) -> list[dict]:
    if not path.exists():
        return []
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


def row_key(row: dict) -> tuple[str, str, str, str]:
    return (row["model"], f"{float(row['budget']):.4f}", row["allocator"], row["compensation"])


def dense_logprobs(dense, windows: torch.Tensor, path: Path, batch_size: int) -> np.ndarray:
    """The dense model's next-token log-probabilities on ``windows`` at the counted positions,
    (N, T-1-start, V) float32, computed once and kept on disk (0.4 GB per source for SmolLM2's
    vocabulary, 2.1 GB for Gemma 3's at 8 x 256 tokens)."""
    if path.exists():
        return np.load(path, mmap_mode="r")
    start = text_start(dense.tokenizer, windows)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".partial.npy")
    vocab = dense.model.get_output_embeddings().weight.shape[0]
    out = np.lib.format.open_memmap(partial, mode="w+", dtype=np.float32, shape=(*windows[:, start + 1 :].shape, vocab))
    with torch.inference_mode():
        for b, batch in enumerate(batches(windows, batch_size)):
            logits = dense.model(input_ids=batch, use_cache=False).logits[:, start:-1]  # (B, T-1-start, V)
            logp = F.log_softmax(logits.float(), -1)
            out[b * batch_size : b * batch_size + len(batch)] = logp.numpy()
    out.flush()
    del out
    partial.rename(path)
    return np.load(path, mmap_mode="r")


@torch.inference_mode()
def measure(pruned, dense_logp: dict, heldout: dict, batch_size: int) -> dict:
    """Held-out perplexity, KL(dense || pruned) per token and top-1 agreement per source."""
    out = {}
    for source, windows in heldout.items():
        start = text_start(pruned.tokenizer, windows)
        nll = kl = agree = 0.0
        for b, batch in enumerate(batches(windows, batch_size)):
            logp = F.log_softmax(pruned.model(input_ids=batch, use_cache=False).logits[:, start:-1].float(), -1)  # (B, T', V)
            logp_d = torch.from_numpy(np.asarray(dense_logp[source][b * batch_size : b * batch_size + len(batch)], dtype=np.float32))
            targets = batch[:, start + 1 :]
            nll -= logp.gather(-1, targets[..., None]).sum().item()
            kl += (logp_d.exp() * (logp_d - logp)).sum().item()
            agree += (logp.argmax(-1) == logp_d.argmax(-1)).sum().item()
        count = windows[:, start + 1 :].numel()
        out |= {f"ppl_{source}": math.exp(nll / count), f"kl_{source}": kl / count, f"top1_{source}": agree / count}
    return out


class Run:
    """One model's benchmark: its table, windows and plans, rows appended to the CSV as measured."""

    def __init__(self, args, csv_path: Path):
        self.args, self.csv_path = args, csv_path
        self.rows = read_rows(csv_path) if args.resume else []
        self.done = {row_key(r): r for r in self.rows}
        self.dense = load_model(args.model)
        self.calib = WindowSpec(data=args.data, n_samples=args.samples, seq_len=args.seq_len, batch_size=8)
        spec = TableSpec(
            windows=self.calib,
            criterion=args.criterion,
            rate_grid=parse_rate_grid(args.rates),
            estimator=args.estimator,
            objective=args.objective,
        )
        self.table = loss_table(self.dense, spec, hooks=Hooks(progress=lambda d, t, eta: None))
        self.windows = calibration_windows(self.dense.tokenizer, self.calib)
        self.heldout = heldout_sets(
            self.dense.tokenizer, WindowSpec(data=args.eval_data, n_samples=args.eval_samples, seq_len=args.eval_seq_len)
        )
        self.scores: dict = {}
        folder = cache_root() / "bench" / "dense_logprobs"
        name = f"{self.dense.fingerprint}-{args.eval_samples}x{args.eval_seq_len}"
        self.dense_logp = {s: dense_logprobs(self.dense, w, folder / f"{name}-{s}.npy", 8) for s, w in self.heldout.items()}
        self.dense_ppl = {f"dense_ppl_{s}": math.exp(mean_nll(self.dense, w, 8)) for s, w in self.heldout.items()}
        self.tasks = prepare_tasks(task_settings(TASK, limit=args.task_limit)) if args.task_limit > 0 else None
        self.dense_row = self.dense_task()

    def scores_for(self, criterion: str):
        if is_sequential(criterion):
            return None
        if criterion not in self.scores:
            self.scores[criterion] = compute_importance(self.dense, self.windows, criterion, self.calib.batch_size)
        return self.scores[criterion]

    def plan(self, allocator: str, budget: float):
        windows = self.windows if needs_windows(allocator) else None
        return plan_from_table(
            self.dense, self.table, budget, allocator, windows=windows, scores=self.scores_for(self.table.spec.criterion)
        )

    def prune(self, plan, compensation: str):
        pruned = self.dense.copy()
        if is_sequential(plan.criterion):
            if compensation != "none":
                raise SystemExit(f"{plan.allocator} compensates inside its criterion; run it with compensation none")
            return pruned, prune_with_plan(pruned, plan, self.calib)
        settings = CompensationSettings(mode=compensation)
        return pruned, prune_compensated(pruned, plan, self.scores_for(plan.criterion), self.calib, settings)

    def task_accuracy(self, pruned) -> dict:
        if self.tasks is None:
            return {}
        score = run_tasks(pruned, self.tasks)[TASK]
        return {"task_acc": score.acc, "task_stderr": score.acc_stderr, "task_n": score.n}

    def dense_task(self) -> dict:
        """The dense model's task accuracy as row columns (cached per model and task settings)."""
        if self.tasks is None:
            return {}
        score = dense_task_scores(self.dense.fingerprint, "float32", self.tasks, lambda names: run_tasks(self.dense, self.tasks, names))[
            TASK
        ]
        return {"dense_task_acc": round(score.acc, 4)}

    def save(self) -> None:
        atomic_write_text(self.csv_path, csv_text(self.rows))

    def method(self, budget: float, allocator: str, compensations: list[str]) -> None:
        """Every compensation of one allocator at one budget, then the task on the best of them."""
        plan = None
        best: tuple[float, object, dict] | None = None  # (mean KL, pruned model, row) of the best so far
        for compensation in compensations:
            key = (self.args.model, f"{budget:.4f}", allocator, compensation)
            row = self.done.get(key)
            if row is None:
                plan = plan or self.plan(allocator, budget)
                load_start, started = os.getloadavg()[0], time.perf_counter()
                pruned, result = self.prune(plan, compensation)
                prune_s = time.perf_counter() - started
                row = {"model": self.args.model, "budget": budget, "allocator": allocator, "criterion": plan.criterion}
                row |= {
                    "compensation": compensation,
                    "removed": plan.params["removed"],
                    "removed_fraction": plan.params["removed_fraction_of_prunable"],
                }
                row |= measure(pruned, self.dense_logp, self.heldout, self.calib.batch_size) | self.dense_ppl
                row |= {"prune_s": round(prune_s, 1), "eval_s": round(time.perf_counter() - started - prune_s, 1)}
                row |= {"load_start": round(load_start, 2), "load_end": round(os.getloadavg()[0], 2), "best": ""} | self.dense_row
                self.rows.append(row)
                self.done[key] = row
                self.save()
                log.info(
                    "%s %s at %.0f%%: %s",
                    allocator,
                    compensation,
                    100 * budget,
                    {k: v for k, v in row.items() if k.startswith(("ppl", "kl"))},
                )
            else:
                pruned = None
            kl = sum(float(row[f"kl_{s}"]) for s in self.heldout) / len(self.heldout)
            if best is None or kl < best[0]:
                best = (kl, pruned, row)
        assert best is not None
        _, pruned, row = best
        for other in compensations:
            self.done[(self.args.model, f"{budget:.4f}", allocator, other)]["best"] = "yes" if other == row["compensation"] else ""
        if self.tasks is not None and not row.get("task_acc"):
            if pruned is None:
                pruned, _ = self.prune(plan or self.plan(allocator, budget), row["compensation"])
            load_start, started = os.getloadavg()[0], time.perf_counter()
            row |= self.task_accuracy(pruned) | {"task_s": round(time.perf_counter() - started, 1), "task_load": round(load_start, 2)}
        self.save()


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stdout)
    command = " ".join(["python bench/bench_quality.py", *(sys.argv[1:] if argv is None else argv)])
    load_start, started = os.getloadavg(), time.perf_counter()
    csv_path, md_path = RESULTS / f"{args.name}.csv", RESULTS / f"{args.name}.md"
    run = Run(args, csv_path)
    methods: dict[str, list[str]] = {}
    for item in args.methods.split(","):
        allocator, _, compensation = item.strip().partition(":")
        methods.setdefault(allocator, []).append(compensation or "none")
    for budget in [float(b) for b in args.budgets.split(",") if b]:
        for allocator, compensations in methods.items():
            run.method(budget, allocator, compensations)
    text = report_text(args, command, run, machine_line(load_start, started))
    atomic_write_text(md_path, text)
    log.info("wrote %s and %s", md_path, csv_path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
