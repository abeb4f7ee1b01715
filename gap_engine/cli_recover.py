"""``gap recover``: fine-tune a pruned checkpoint (LoRA, MaZO or MeZO) and save it as a checkpoint.

``register(subparsers)`` adds the subcommand to the `gap` parser. Settings are checked before
the model is loaded and the output folder is probed before anything is written; bad input
raises a GapError with one line (`gap` prints it and exits 2). Progress goes to stderr, the
summary (or with ``--json`` one JSON object) to stdout.
"""

from __future__ import annotations

import json
import sys
import time

from .recover import METHODS, PROJECTIONS, SCHEDULES, RecoverySettings

_DEFAULTS = RecoverySettings()


def register(subparsers) -> None:
    """Add `recover` to the `gap` subcommands."""
    p = subparsers.add_parser(
        "recover",
        help="recover a pruned model with a short fine-tune (LoRA, MaZO or MeZO)",
        description="Fine-tune a pruned checkpoint on the calibration part of one or more text sources "
        "(each source is one task), evaluate it before and after on their held-out parts, and save it "
        "as a pruned checkpoint that loads like any other.",
    )
    p.add_argument("--model", required=True, help="a `gap prune` folder (a dense model is allowed too)")
    p.add_argument("--method", required=True, choices=METHODS, help="lora (peft), mazo (masked zeroth-order) or mezo (zeroth-order)")
    p.add_argument("--data", default="wiki-sample", help="comma-separated text sources, one task each (calibration part only)")
    p.add_argument("--split", default="calibration", help="the part of the text to train on: only 'calibration' is allowed")
    p.add_argument("--steps", type=int, required=True, help="training steps")
    p.add_argument("--out", required=True, help="output checkpoint folder (written atomically; work goes to OUT.partial)")
    p.add_argument("--resume", action="store_true", help="continue the run saved in OUT.partial")
    p.add_argument("--lr", type=float, help="peak learning rate (default: lora 3e-3, mazo 3e-4, mezo 1e-4)")
    p.add_argument("--schedule", default=_DEFAULTS.schedule, choices=SCHEDULES)
    p.add_argument("--warmup", type=int, default=_DEFAULTS.warmup_steps, help="warm-up steps")
    p.add_argument("--batch-size", type=int, default=_DEFAULTS.batch_size, help="windows per task per step")
    p.add_argument("--seq-len", type=int, default=_DEFAULTS.seq_len, help="tokens per training window")
    p.add_argument("--pool-windows", type=int, default=_DEFAULTS.pool_windows, help="calibration windows cut per task")
    p.add_argument("--targets", default=",".join(PROJECTIONS), help="projections that train, from " + ",".join(PROJECTIONS))
    p.add_argument("--rank", type=int, default=_DEFAULTS.rank, help="LoRA rank")
    p.add_argument("--alpha", type=float, default=_DEFAULTS.alpha, help="LoRA alpha")
    p.add_argument("--dropout", type=float, default=_DEFAULTS.dropout, help="LoRA dropout")
    p.add_argument("--eps", type=float, default=_DEFAULTS.eps, help="ZO perturbation scale")
    p.add_argument("--mask-fraction", type=float, default=_DEFAULTS.mask_fraction, help="MaZO: share of each row that trains")
    p.add_argument("--magnitude-weight", type=float, default=_DEFAULTS.magnitude_weight, help="MaZO: weight of |W| in the importance")
    p.add_argument("--seed", type=int, default=_DEFAULTS.seed)
    p.add_argument("--save-every", type=int, default=_DEFAULTS.save_every, help="steps between saved snapshots")
    p.add_argument("--time-budget", type=float, help="stop training after this many seconds")
    p.add_argument("--device", help="train on this device (e.g. cuda); default: where the model loads")
    p.add_argument("--bf16", action="store_true", help="bf16 autocast for the training forward passes")
    p.add_argument("--eval-samples", type=int, default=_DEFAULTS.eval_samples, help="held-out windows per task")
    p.add_argument("--eval-seq-len", type=int, default=_DEFAULTS.eval_seq_len)
    p.add_argument("--generations", type=int, default=_DEFAULTS.eval_generations)
    p.add_argument("--no-eval-before", action="store_true", help="skip the evaluation before training")
    p.add_argument("--no-dense", action="store_true", help="do not load the dense model for KL and agreement")
    p.add_argument("--no-history", action="store_true", help="do not add the run to the run history")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    p.set_defaults(func=cmd_recover)


def settings_from(args) -> RecoverySettings:
    """The RecoverySettings the arguments describe, validated (RecoveryError/DataError on bad values)."""
    return RecoverySettings(
        method=args.method,
        tasks=tuple(s.strip() for s in args.data.split(",") if s.strip()),
        split=args.split,
        steps=args.steps,
        lr=args.lr,
        schedule=args.schedule,
        warmup_steps=args.warmup,
        batch_size=args.batch_size,
        seq_len=args.seq_len,
        pool_windows=args.pool_windows,
        targets=tuple(t.strip() for t in args.targets.split(",") if t.strip()),
        rank=args.rank,
        alpha=args.alpha,
        dropout=args.dropout,
        eps=args.eps,
        mask_fraction=args.mask_fraction,
        magnitude_weight=args.magnitude_weight,
        seed=args.seed,
        save_every=args.save_every,
        time_budget_s=args.time_budget,
        device=args.device,
        bf16=args.bf16,
        eval_samples=args.eval_samples,
        eval_seq_len=args.eval_seq_len,
        eval_generations=args.generations,
        evaluate_before=not args.no_eval_before,
        compare_dense=not args.no_dense,
        record_history=not args.no_history,
    ).validate()


def _stderr_progress():
    """A (done, total, eta, message) callback: one redrawn status line per step, stages on their own line."""
    state = {"stage": None}

    def report(done: int, total: int, eta: float | None, message: str) -> None:
        if eta is None:
            if message != state["stage"]:
                print(f"\rrecover: {message}", file=sys.stderr, flush=True)
                state["stage"] = message
            return
        minutes, seconds = divmod(round(eta), 60)
        print(f"\rrecover: {message}, ETA {minutes}m{seconds:02d}s   ", end="", file=sys.stderr, flush=True)
        if done >= total:
            print(file=sys.stderr)

    return report


def cmd_recover(args) -> int:
    from .models import load_model
    from .recover import check_output_dir, recover

    settings = settings_from(args)
    check_output_dir(args.out)  # before the slow load; recover() checks again against the model
    lm = load_model(args.model)
    if lm.pruned_from is None:
        print(f"note: {args.model} is a dense model, not a pruned gap checkpoint: recovering it as is", file=sys.stderr)
    started = time.perf_counter()
    result = recover(lm, settings, progress=_stderr_progress(), out_dir=args.out, resume=args.resume)
    if args.json:
        print(json.dumps(result.to_dict(), default=str))
        return 0
    summary = {
        "out": result.checkpoint,
        "method": result.method,
        "dense_input": result.dense_input,
        "steps": f"{result.steps_done}/{result.steps_requested} ({result.stopped})"
        + (f", resumed at {result.resumed_from}" if result.resumed_from else ""),
        "train_seconds": f"{result.train_seconds:.1f}",
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
    summary["wall_seconds"] = f"{time.perf_counter() - started:.1f}"
    print("\n".join(f"{k}: {v}" for k, v in summary.items()))
    for g in result.after.get("generations", []):
        print(f"> {g['prompt']}\n  model: {g['model']!r}" + (f"\n  dense: {g['dense']!r}" if "dense" in g else ""))
    return 0
