"""``gap models``, ``gap prune`` and ``gap eval``: load, prune and measure one model."""

from __future__ import annotations

import argparse
import json
import sys

from gap_engine.cli.arguments import compensation_from, device_from, spec_from_args, windows_from
from gap_engine.cli.output import StderrProgress, table_compensation_text
from gap_engine.cli.table_commands import check_windows_fit, read_sources
from gap_engine.core.config import DEFAULT_CRITERION, WindowSpec
from gap_engine.core.device import DeviceError
from gap_engine.core.errors import CompensationError, OptionError, PlanError
from gap_engine.core.jsontext import json_text
from gap_engine.core.progress import Hooks
from gap_engine.data.bos import bos_token_id
from gap_engine.evaluate.metrics import EvalSettings
from gap_engine.model.adapters import supported_model_types
from gap_engine.model.dispatch import load_dispatched, parse_max_memory
from gap_engine.model.identity import model_type_of
from gap_engine.model.loading import list_models, load_model
from gap_engine.model.rateplan import RatePlan, uniform_plan
from gap_engine.pipeline.checkpoints import evaluate_model, prune_rounds_to_checkpoint, prune_to_checkpoint
from gap_engine.pipeline.stages import dense_reference, obs_windows, pruned_by
from gap_engine.plan.step import family_step, takes
from gap_engine.prune.compensation_pass import calibration_tokens, check_calibration, fit_windows
from gap_engine.prune.compensations import NO_COMPENSATION, CompensationSettings, adds_biases, with_family_fit
from gap_engine.prune.criteria import is_sequential
from gap_engine.prune.sequential import check_follows_obs
from gap_engine.tables.lookup import find_table


def run_models(args: argparse.Namespace) -> int:
    rows = list_models(verify=args.verify)
    if args.json:
        print(json.dumps({"builtin": rows, "supported_model_types": supported_model_types()}))
        return 0
    for row in rows:
        state = "converted" if row["converted"] else "converts on first use"
        if row["problem"]:
            state = f"damaged: {row['problem']}; converted again on next use"
        elif args.verify and row["converted"]:
            state += ", SHA-256 checked" if row["checksummed"] else ", structure checked (no SHA-256 recorded by the older converter)"
        print(f"{row['name']:<14} {row['description']}  [{state}]")
    print(f"\nAlso: a local model folder, a .gguf file, or a hub id. Architectures: {', '.join(supported_model_types())}")
    return 0


def run_prune(args: argparse.Namespace) -> int:
    if sum(value is not None for value in (args.plan, args.uniform, args.budget)) != 1:
        raise PlanError("give exactly one of --plan P.json, --uniform R or --budget B")
    if args.budget is not None:
        return run_prune_rounds(args)
    plan = RatePlan.load(args.plan) if args.plan else None  # validate before the slow model load
    # --criterion chooses the units; a plan's own criterion does unless --criterion is given.
    given: frozenset[str] = getattr(args, "given_options", frozenset())
    criterion = args.criterion if plan is None or "criterion" in given else plan.criterion
    plan = pruned_by(plan, criterion) if plan is not None else None
    compensation = _prune_compensation(args, criterion, plan.compensation if plan else None)
    obs_needs = _obs_windows_needed(args, criterion)
    if criterion != "magnitude" or compensation.active:
        check_windows_fit(args.model, (windows_from(args), "calibration"), *obs_needs, *_fit_windows_needed(args, compensation))
        read_sources(args.data)
    lm = load_model(args.model, device_from(args))
    check_calibration(lm, calibration_tokens(windows_from(args), compensation), compensation)  # before the units are scored
    if plan is None:
        plan = uniform_plan(lm, args.uniform, criterion, args.channel_multiple, compensation.mode, compensation.adds_bias)
    label = "OBS blocks" if obs_needs else "importance" if not compensation.active else "importance, then compensated blocks"
    progress = StderrProgress(label)
    pruned = prune_to_checkpoint(lm, plan, windows_from(args), args.out, args.save_dtype, progress.hooks(), compensation, args.obs_samples)
    if pruned.bias_params and not adds_biases(plan.compensation):
        print(
            f"gap: note: the plan was counted without the {pruned.bias_params:,} parameters the {compensation.mode} compensation's "
            f"biases add (plan it with gap plan --compensate {compensation.mode} to pay for them from its budget)",
            file=sys.stderr,
        )
    summary = pruned.to_dict()
    print(json.dumps(summary) if args.json else "\n".join(f"{k}: {v}" for k, v in summary.items()))
    return 0


def _prune_compensation(args: argparse.Namespace, criterion: str, planned: str | None = None) -> CompensationSettings:
    """``compensation_from`` for a prune by ``criterion``, fitted on the model family's windows and weighed as its
    family weighs tokens where neither is asked (``with_family_fit``; after OBS, the weighting of its bias); CompensationError now, before anything loads, for a refit after ``obs``'s update (which is one)."""
    compensation = compensation_from(args, criterion, planned, model_type_of(args.model))
    if is_sequential(criterion):
        check_follows_obs(compensation)
        return compensation  # its bias weighed as the family weighs tokens already (compensation_from)
    return with_family_fit(compensation, model_type_of(args.model), windows_from(args).n_samples)


def _obs_windows_needed(args: argparse.Namespace, criterion: str) -> tuple[tuple[WindowSpec, str], ...]:
    """The calibration windows ``obs`` reads (for ``check_windows_fit``): none unless ``criterion``
    is sequential; OptionError for ``--obs-samples`` beside a plan that another criterion prunes
    (the preflight cannot read the plan)."""
    if not is_sequential(criterion):
        if args.obs_samples is not None:
            raise OptionError(f"gap prune: --obs-samples cannot apply: this plan is pruned by criterion {criterion}, not obs")
        return ()
    return ((obs_windows(windows_from(args), args.obs_samples), "calibration"),)


def _fit_windows_needed(args: argparse.Namespace, compensation: CompensationSettings) -> tuple[tuple[WindowSpec, str], ...]:
    """The calibration windows the compensation is fitted on, where ``--fit-samples`` sized them (for ``check_windows_fit``)."""
    if compensation.samples is None:
        return ()
    return ((fit_windows(windows_from(args), compensation.samples), "calibration"),)


def run_prune_rounds(args: argparse.Namespace) -> int:
    """``gap prune --budget B --rounds K``: GAP's DP in rounds, each on a table of the model as it is."""
    if args.rounds < 1:
        raise PlanError(f"--rounds must be at least 1, got {args.rounds}")
    step = family_step(model_type_of(args.model))  # the DP's step: the model family's (plan.step), unless asked otherwise
    if step and "criterion" not in getattr(args, "given_options", frozenset()) and takes(step, args.compensate):
        args.criterion = step
    # A compensation follows a one-shot cut; rounds re-table the pruned model, so they default to none.
    compensation = NO_COMPENSATION if args.rounds > 1 and not args.compensate else _prune_compensation(args, args.criterion)
    if compensation.active and args.rounds > 1:
        raise CompensationError(f"--compensate {compensation.mode} follows a one-shot cut; use --rounds 1 (or --compensate none)")
    if args.fit_samples is not None and not compensation.active:
        raise OptionError("--fit-samples cannot apply: nothing is compensated after the cut (rounds above 1 compensate nothing)")
    # obs scores no table: the tables score units by the default criterion, and obs prunes their DP's rates.
    table_criterion = DEFAULT_CRITERION if is_sequential(args.criterion) else args.criterion
    spec = spec_from_args(args, follows=compensation, criterion=table_criterion)
    first_table = find_table(args.model, spec, device_from(args))  # round 1's table, looked up before anything loads
    check_windows_fit(
        args.model, (spec.windows, "calibration"), *_obs_windows_needed(args, args.criterion), *_fit_windows_needed(args, compensation)
    )
    read_sources(args.data)  # a bad text source fails before the model loads
    lm = load_model(args.model, device_from(args))
    progress = StderrProgress("round table")
    result = prune_rounds_to_checkpoint(
        lm,
        spec,
        args.budget,
        args.rounds,
        args.out,
        args.save_dtype,
        progress.hooks(),
        first_table=first_table,
        compensation=compensation,
        criterion=args.criterion,
        obs_samples=args.obs_samples,
    )
    summary = {
        "out": str(args.out),
        "params_before": lm.param_count(),
        "params_after": result.model.param_count(),
        "bias_params": result.bias_params,
        "removed_fraction_of_prunable": result.removed_fraction,
        "compensation": compensation.mode,
        "criterion": args.criterion,
        "predicted": result.predicted_loss,
        "rounds": [{"round": r.index, "predicted": r.predicted, "measured": r.measured, "removed": r.removed} for r in result.rounds],
    }
    if is_sequential(args.criterion):
        summary["obs_windows"] = obs_windows(spec.windows, args.obs_samples).n_samples
    if compensation.samples is not None:
        summary["fit_windows"] = compensation.samples
    if compensation.weighted:
        summary["fit_weighting"] = compensation.weighting
    if args.json:
        print(json.dumps(summary))
        return 0
    for key in ("out", "params_before", "params_after", "bias_params", "removed_fraction_of_prunable", "compensation", "criterion"):
        print(f"{key}: {summary[key]}")
    for r in result.rounds:
        print(
            f"round {r.index}: removed {r.removed:,}, predicted {spec.objective} {r.predicted:+.4f} (table cells, summed), measured {r.measured:+.4f}"
        )
    if is_sequential(args.criterion):
        print(
            f"units: chosen and updated by {args.criterion} on {summary['obs_windows']} calibration windows; "
            f"the tables scored units by {spec.criterion}"
        )
    print(table_compensation_text(spec, compensation))
    return 0


def window_convention_text(tokenizer) -> str:
    """One line saying how every evaluation window starts (Gemma's are scored after its BOS token)."""
    bos = bos_token_id(tokenizer)
    if bos is None:
        return "start with text (this model's tokenizer adds no BOS token)"
    return f"start with {tokenizer.convert_ids_to_tokens(bos)!s} (the model's BOS token: context only, not scored)"


def task_settings_from(args: argparse.Namespace):
    """The TaskSettings of ``--tasks`` and its options, or None without ``--tasks``."""
    from gap_engine.evaluate.tasks import task_settings

    if args.tasks is None:  # --limit and its siblings without --tasks: refused by the preflight's option rules
        return None
    return task_settings(args.tasks, args.limit, args.num_fewshot, args.batch_size, args.include_path)


def run_eval(args: argparse.Namespace) -> int:
    task_settings = task_settings_from(args)
    prepared = None
    if task_settings is not None:  # every task problem is found before the text is read and the model loads
        from gap_engine.evaluate.tasks import prepare_tasks

        prepared = prepare_tasks(task_settings)
    check_windows_fit(args.model, (windows_from(args), "heldout"))
    read_sources(args.data)
    if args.device_map:
        lm, dense = _dispatched_pair(args)
    else:
        lm = load_model(args.model, device_from(args))
        dense = None if args.no_dense else dense_reference(lm, device_from(args))
    settings = EvalSettings(windows=windows_from(args), throughput=not args.no_throughput, generations=args.generations)
    report = evaluate_model(lm, dense, settings, prepared, Hooks(message=lambda msg: print(f"eval: {msg}", file=sys.stderr)))
    if args.json:
        print(json_text(report.to_dict(), "evaluation report"))
        return 0
    print(f"model: {report.model}  params: {report.params:,}  size: {report.size_bytes / 2**20:.1f} MiB")
    print(f"windows: {window_convention_text(lm.tokenizer)}")
    for source, ppl in report.perplexity.items():
        line = f"perplexity[{source}]: {ppl:.3f}"
        if report.dense:
            line += (
                f"  (dense {report.dense['perplexity'][source]:.3f}, KL {report.kl_to_dense[source]:.4f}, "
                f"top-1 agree {report.top1_agreement[source]:.3f})"
            )
        print(line)
    for name, score in report.task_accuracy.items():
        print(task_line(name, score, report.dense_task_accuracy.get(name)))
    if report.throughput:
        print("throughput: " + ", ".join(f"{k}={v:.2f}" for k, v in report.throughput.items() if isinstance(v, float)))
    for g in report.generations:
        print(f"> {g['prompt']}\n  model: {g['model']!r}" + (f"\n  dense: {g['dense']!r}" if "dense" in g else ""))
    return 0


def task_line(name: str, score: dict, dense: dict | None) -> str:
    """``task[name]: acc 0.620 ± 0.049, acc_norm ... (n=100; dense acc ...)`` for the text output."""

    def numbers(row: dict) -> str:
        text = f"acc {row['acc']:.3f} ± {row['acc_stderr'] or 0:.3f}"
        if row.get("acc_norm") is not None:
            text += f", acc_norm {row['acc_norm']:.3f} ± {row['acc_norm_stderr'] or 0:.3f}"
        return text

    line = f"task[{name}]: {numbers(score)}  (n={score['n']}, {score['num_fewshot']}-shot"
    return line + (f"; dense {numbers(dense)})" if dense else ")")


def _dispatched_pair(args: argparse.Namespace):
    """The model (and its dense original) spread over the devices by ``--device-map``."""
    if args.stream or args.device != "auto":
        raise DeviceError("--device-map places the model itself: leave out --device and --stream")
    max_memory = parse_max_memory(args.max_memory)

    def load(name: str, folder: str, hub: bool):
        offload = args.offload_dir / folder if args.offload_dir else None  # one offload index per model
        return load_dispatched(name, args.dtype, args.device_map, max_memory, offload, hub=hub)

    lm = load(args.model, "model", hub=True)
    # The dense model's name comes from the checkpoint's files: local files only, never the network.
    dense = None if args.no_dense else dense_reference(lm, loader=lambda name: load(name, "dense", hub=False))
    return lm, dense
