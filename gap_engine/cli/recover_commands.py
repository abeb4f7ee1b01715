"""``gap recover``: fine-tune a pruned checkpoint (LoRA, MaZO or MeZO) and save it as a checkpoint.

Settings are checked before the model is loaded and the output folder is probed before
anything is written; bad input raises a GapError with one line (``gap`` prints it and exits 2).
Progress goes to stderr, the summary (or with ``--json`` one JSON object) to stdout.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from gap_engine.cli.arguments import device_from
from gap_engine.cli.output import format_seconds
from gap_engine.core.jsontext import json_text
from gap_engine.core.progress import Hooks
from gap_engine.evaluate.tasks import prepare_tasks, task_settings
from gap_engine.model.loading import load_model
from gap_engine.pipeline.cost_model import recovery_prediction
from gap_engine.pipeline.recovery import RecoveryResult, RecoverySettings, recover
from gap_engine.recover.files import RecoveryError, check_output_dir, check_saved_state, partial_dir

# argparse destination -> RecoverySettings field, for the options whose None means "keep the default".
_TUNABLES = {
    "schedule": "schedule", "warmup": "warmup_steps", "batch_size": "batch_size", "seq_len": "seq_len",
    "pool_windows": "pool_windows", "rank": "rank", "alpha": "alpha", "dropout": "dropout", "eps": "eps",
    "mask_fraction": "mask_fraction", "magnitude_weight": "magnitude_weight", "seed": "seed",
    "save_every": "save_every", "eval_samples": "eval_samples", "eval_seq_len": "eval_seq_len",
    "generations": "eval_generations", "objective": "objective", "temperature": "temperature",
    "kd_weight": "kd_weight", "teacher": "teacher", "save_dtype": "save_dtype", "eval_every": "eval_every",
    "eval_task_examples": "eval_task_examples",
}  # fmt: skip


def _names(text: str | None) -> tuple[str, ...]:
    return tuple(part.strip() for part in (text or "").split(",") if part.strip())


def settings_from(args: argparse.Namespace) -> RecoverySettings:
    """The RecoverySettings the arguments describe, validated (RecoveryError/DataError on bad values)."""
    given = {field: getattr(args, dest) for dest, field in _TUNABLES.items() if getattr(args, dest) is not None}
    if args.targets is not None:
        given["targets"] = _names(args.targets)
    if args.eval_data is not None:
        given["eval_texts"] = _names(args.eval_data)
    if args.eval_tasks is not None:
        given["eval_tasks"] = _names(args.eval_tasks)
    return RecoverySettings(
        method=args.method,
        tasks=_names(args.data),
        split=args.split,
        steps=args.steps,
        lr=args.lr,
        time_budget_s=args.time_budget,
        cpu_budget_s=args.cpu_budget,
        bf16=args.bf16,
        evaluate_before=not args.no_eval_before,
        compare_dense=not args.no_dense,
        record_history=not args.no_history,
        guard=not args.no_guard,
        force_size=args.force_size,
        **given,
    ).validate()


class _StageProgress:
    """recover's hooks on stderr: phases on their own line, steps redrawn in place (recover tells
    each phase or step as a message, then its progress: the line is written at the progress)."""

    def __init__(self, stream=None):
        self.stream = stream or sys.stderr
        self.stage: str | None = None
        self.message = ""

    def hooks(self) -> Hooks:
        return Hooks(progress=self.progress, message=self.say)

    def say(self, message: str) -> None:
        self.message = message

    def progress(self, done: int, total: int, eta: float | None) -> None:
        message = self.message
        if eta is None:
            if message != self.stage:
                self.stream.write(f"\rrecover: {message}\n")
                self.stage = message
        else:
            self.stream.write(f"\rrecover: {message}, eta {format_seconds(eta)}   " + ("\n" if done >= total else ""))
        self.stream.flush()


def _summary(result: RecoveryResult) -> dict:
    summary = {
        "out": result.checkpoint,
        "method": result.method,
        "objective": result.objective_note.removeprefix("objective ") or result.objective,
        "saved_as": result.save_dtype,
        "dense_input": result.dense_input,
        "steps": f"{result.steps_done}/{result.steps_requested} ({result.stopped})"
        + (f", resumed at {result.resumed_from}" if result.resumed_from else ""),
        "train_seconds": f"{result.train_seconds:.1f}",
        **({"divergence_guard": result.guard_summary} if result.guard_summary else {}),
        **({"kept_snapshot": _judge_line(result)} if result.judge else {}),
        "trainable_params": f"{result.trainable_params:,}",
        "peak_rss": f"{result.peak_rss / 2**20:.0f} MiB ({result.rss_ratio:.2f}x inference {result.inference_rss / 2**20:.0f} MiB)",
        "calibration_loss": ", ".join(
            f"{task} {b:.4f} -> {a:.4f}" for task, b, a in zip(result.tasks, result.calib_loss_before, result.calib_loss_after)
        ),
    }
    before = (result.before or {}).get("perplexity", {})
    for task, ppl in result.after["perplexity"].items():
        line = f"{before[task]:.3f} -> {ppl:.3f}" if task in before else f"{ppl:.3f}"
        if result.after.get("kl_to_dense"):
            line += f" (KL to dense {result.after['kl_to_dense'][task]:.4f}, top-1 agree {result.after['top1_agreement'][task]:.3f})"
        summary[f"perplexity[{task}]"] = line
    if result.adapter:
        summary["adapter"] = result.adapter
    if result.run_id is not None:
        summary["history_run"] = result.run_id
    return summary


def _judge_line(result: RecoveryResult) -> str:
    curve = ", ".join(f"{row['step']}: {row['score']:.4g}" for row in result.judge_curve)
    return f"step {result.best_step}, the best by {result.judge} ({curve}; {result.judge_seconds:.0f} s judging)"


def run_recover(args: argparse.Namespace) -> int:
    settings = settings_from(args)
    check_output_dir(args.out)  # before the slow load; recover() checks again against the model
    if args.resume:
        check_saved_state(partial_dir(Path(args.out).expanduser()))  # a tampered state.json costs no load
    if args.stream:
        # Training needs every block's weights and gradients at once; streaming is for tables and evaluation.
        raise RecoveryError("gap recover trains the whole model at once: --stream is not available here")
    judge_tasks = None
    if settings.eval_tasks:  # read before the model loads: a task mistake costs no load
        judge_tasks = prepare_tasks(task_settings(settings.eval_tasks))
    lm = load_model(args.model, device_from(args))
    if lm.pruned_from is None:
        print(f"note: {args.model} is a dense model, not a pruned gap checkpoint: recovering it as is", file=sys.stderr)
    predicted = recovery_prediction(args.model if Path(args.model).is_dir() else lm.source, settings, lm.placement)
    if predicted is not None:
        print(
            f"recover: expected about {format_seconds(predicted.total)} ({format_seconds(predicted.step_s)} per step; {predicted.basis})",
            file=sys.stderr,
        )
    started = time.perf_counter()
    result = recover(lm, settings, _StageProgress().hooks(), out_dir=args.out, resume=args.resume, judge_tasks=judge_tasks)
    if args.json:
        print(json_text(result.to_dict(), "recovery result", default=str))
        return 0
    summary = _summary(result)
    summary["wall_seconds"] = f"{time.perf_counter() - started:.1f}"
    print("\n".join(f"{k}: {v}" for k, v in summary.items()))
    for g in result.after.get("generations", []):
        print(f"> {g['prompt']}\n  model: {g['model']!r}" + (f"\n  dense: {g['dense']!r}" if "dense" in g else ""))
    return 0
