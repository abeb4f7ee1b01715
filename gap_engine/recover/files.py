"""What a recovery run writes: snapshots to resume from, the recovered checkpoint, the history row.

A run works in ``<out>.partial/`` beside its output folder. Every ``save_every`` steps (and on
cancel, and when training ends) ``state/`` in there is replaced atomically
(``fsutil.atomic_directory``) by a new snapshot:

* ``state.json``: the step reached, the training time so far, the loss curve, the evaluation
  before training, the measured memory, the fingerprint of the weights the run started from,
  and the settings that decide the trajectory (a resumed run must share them);
* ``tensors.safetensors``: what training changed (LoRA adapters; the masked values and mask of
  MaZO; the projections of MeZO);
* ``optimizer.pt``: the optimizer's state, where there is one (LoRA's AdamW).

Nothing else is needed to continue exactly: every random draw of step ``t`` is derived from
``(seed, t)``. A kill loses at most the steps since the last snapshot.

At the end, :func:`write_checkpoint` writes the recovered model as an ordinary pruned
checkpoint (``checkpoint.save_pruned``) with ``recovery.json``, ``losses.csv`` and LoRA's
unmerged ``adapter/`` beside it, all renamed into place together; :func:`record_in_history`
adds the run to the run history, and :func:`read_result` reads ``recovery.json`` back (the
explorer's Recover page shows a finished run again after a reload from it).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import shutil
import tempfile
from dataclasses import MISSING, asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import torch

from gap_engine.core.fsutil import atomic_directory, refuse_special_files
from gap_engine.core.jsontext import json_text
from gap_engine.core.limits import LIMITS
from gap_engine.core.validate import check_evaluation_report, check_int, check_keys, check_number, check_text, read_json_file
from gap_engine.model.loaded import LoadedModel
from gap_engine.model.rateplan import RatePlan

# RecoveryError is raised and caught under this module's name too (callers import it from here).
from gap_engine.recover.settings import CurveRow, JudgeRow, ProbeRow, RecoveryResult, RollbackRow
from gap_engine.recover.settings import RecoveryError as RecoveryError

log = logging.getLogger(__name__)

STATE_VERSION = 1
PARTIAL_SUFFIX = ".partial"
_STATE = "state"
_JSON = "state.json"
_TENSORS = "tensors.safetensors"
_OPTIMIZER = "optimizer.pt"
_BEST = "best"  # the best snapshot by the judge (recover.judge): tensors.safetensors and its step in best.json
RESULT_FILE = "recovery.json"  # in the recovered checkpoint: RecoveryResult.to_dict()


@dataclass
class RunState:
    """Everything about a run's progress except its tensors."""

    trajectory: dict[str, Any]  # the settings a resumed run must share (RecoverySettings.trajectory())
    start_fingerprint: str  # weights fingerprint of the model the run started from
    step: int = 0  # steps finished
    train_seconds: float = 0.0  # training wall time so far, over every segment
    train_cpu_seconds: float = 0.0  # CPU time of the process (all its threads) while training, over every segment
    curve: list[CurveRow] = field(default_factory=list)  # one row per step: step, seconds, loss, lr
    before: dict[str, Any] | None = None  # EvalReport.to_dict() of the model before training
    calib_before: list[float] = field(default_factory=list)  # per task: NLL on its fixed calibration windows
    inference_rss: int = 0  # bytes: peak resident memory of one forward pass at the training batch
    peak_rss: int = 0  # bytes: peak resident memory while training, highest over segments
    rss_method: str = ""  # how memory was measured (memory.PeakRSS.method)
    lr: float | None = None  # the peak learning rate the probe chose (ZO without --lr); None: the settings'
    lr_probe: list[ProbeRow] = field(default_factory=list)  # the probe's candidates: lr, loss before, loss after
    guard_lowest: float | None = None  # the divergence guard's lowest calibration objective over kept snapshots
    lr_scale: float = 1.0  # the guard's cuts of the learning rate so far (1: none)
    rollbacks: list[RollbackRow] = field(default_factory=list)  # the guard's rollbacks: step, back_to, loss, lowest, lr_scale, action
    judge_curve: list[JudgeRow] = field(default_factory=list)  # the judge's scores of the snapshots: step, score, best
    best_step: int | None = None  # the snapshot the judge rates best so far (its tensors are in best/)
    judge_seconds: float = 0.0  # wall time spent judging (not training time)
    version: int = STATE_VERSION


def partial_dir(out_dir: Path) -> Path:
    """The working folder of the run that writes ``out_dir``."""
    return out_dir.with_name(out_dir.name + PARTIAL_SUFFIX)


def save_state(work_dir: Path, state: RunState, tensors: dict[str, torch.Tensor], optimizer_state: dict[str, Any] | None) -> None:
    """Replace the snapshot in ``work_dir`` atomically."""
    from safetensors.torch import save_file

    try:
        with atomic_directory(work_dir / _STATE) as tmp:
            save_file({k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}, str(tmp / _TENSORS))
            if optimizer_state is not None:
                torch.save(optimizer_state, tmp / _OPTIMIZER)
            (tmp / _JSON).write_text(json_text(asdict(state), "recovery state") + "\n")
    except BaseException:
        with contextlib.suppress(OSError):
            work_dir.rmdir()  # only when empty: a first snapshot that failed leaves no empty OUT.partial
        raise
    log.debug("saved recovery state at step %d", state.step)


def load_state(work_dir: Path) -> tuple[RunState, dict[str, torch.Tensor], dict[str, Any] | None] | None:
    """The snapshot in ``work_dir``, or None when there is none.

    Raises:
        RecoveryError: the snapshot is unreadable or of another format version.
    """
    from safetensors.torch import load_file

    folder = work_dir / _STATE
    if not (folder / _JSON).exists():
        return None
    refuse_special_files(folder, RecoveryError, f"the saved recovery state in {folder}")
    try:
        data = read_json_file(folder / _JSON, LIMITS.metadata_bytes * 16, f"{folder}/{_JSON}", RecoveryError)
        state = _checked_state(data, folder, work_dir)
        tensors = load_file(str(folder / _TENSORS))
        optimizer_state = torch.load(folder / _OPTIMIZER, weights_only=True) if (folder / _OPTIMIZER).is_file() else None
    except RecoveryError:
        raise
    except Exception as exc:  # a truncated or foreign file: any reader error means "cannot resume"
        raise RecoveryError(f"cannot read the saved recovery state in {folder}: {type(exc).__name__}; remove {work_dir}") from None
    return state, tensors, optimizer_state


def _checked_state(data: object, folder: Path, work_dir: Path) -> RunState:
    """A RunState from state.json's object, every field type- and range-checked (validate.py)."""
    what = f"{folder}/{_JSON}"
    data = check_keys(data, what, RecoveryError)
    if data.get("version") != STATE_VERSION:
        raise RecoveryError(f"{folder}: saved state format {str(data.get('version'))[:20]} is not supported; remove {work_dir}")
    known = {f.name for f in fields(RunState)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise RecoveryError(f"{what} holds an unknown field {unknown[0][:40]!r}; remove {work_dir}")
    if not isinstance(data.get("trajectory"), dict):
        raise RecoveryError(f"{what} trajectory must be an object; remove {work_dir}")
    steps = data["trajectory"].get("steps")
    check_int(steps, f"{what} trajectory steps", RecoveryError, 1, 10**9)
    check_int(data.get("step", 0), f"{what} step", RecoveryError, 0, steps)
    check_text(data.get("start_fingerprint"), f"{what} start_fingerprint", RecoveryError)
    check_number(data.get("train_seconds", 0.0), f"{what} train_seconds", RecoveryError, low=0.0)
    check_number(data.get("train_cpu_seconds", 0.0), f"{what} train_cpu_seconds", RecoveryError, low=0.0)
    for name in ("inference_rss", "peak_rss"):
        check_int(data.get(name, 0), f"{what} {name}", RecoveryError, 0, 1 << 50)
    curve = data.get("curve", [])
    if not isinstance(curve, list) or len(curve) > steps or not all(isinstance(row, dict) for row in curve):
        raise RecoveryError(f"{what} curve must list at most {steps} rows; remove {work_dir}")
    _check_state_rows(data, steps, what)
    calib = data.get("calib_before", [])
    if not isinstance(calib, list):
        raise RecoveryError(f"{what} calib_before must be a list; remove {work_dir}")
    for value in calib:
        check_number(value, f"{what} calib_before entry", RecoveryError)
    if data.get("guard_lowest") is not None:
        check_number(data["guard_lowest"], f"{what} guard_lowest", RecoveryError, low=0.0)
    check_number(data.get("lr_scale", 1.0), f"{what} lr_scale", RecoveryError, low=1e-12, high=1.0)
    rollbacks = data.get("rollbacks", [])
    if not isinstance(rollbacks, list) or len(rollbacks) > 64 or not all(isinstance(row, dict) for row in rollbacks):
        raise RecoveryError(f"{what} rollbacks must list at most 64 objects; remove {work_dir}")
    judged = data.get("judge_curve", [])
    if not isinstance(judged, list) or len(judged) > steps + 2 or not all(isinstance(row, dict) for row in judged):
        raise RecoveryError(f"{what} judge_curve must list at most {steps + 2} objects; remove {work_dir}")
    if data.get("best_step") is not None:
        check_int(data["best_step"], f"{what} best_step", RecoveryError, 0, steps)
    check_number(data.get("judge_seconds", 0.0), f"{what} judge_seconds", RecoveryError, low=0.0)
    if data.get("before") is not None:
        check_evaluation_report(data["before"], f"{what} before", RecoveryError)
    return RunState(**data)


def _optional_number(value: object, name: str, low: float | None = None, high: float | None = None) -> None:
    """A finite number in [low, high], or None: a step whose loss was not finite is saved as null."""
    if value is not None:
        check_number(value, name, RecoveryError, low, high)


def _check_state_rows(data: dict[str, Any], steps: int, what: str) -> None:
    """The saved learning rate and the rows of the curve, the probe and the guard, for meaning:
    a rate in (0, 1] (the settings' own range), steps within the run, losses finite or null."""
    _optional_number(data.get("lr"), f"{what} lr", 1e-12, 1.0)
    for i, row in enumerate(data.get("curve", [])):
        check_int(row.get("step"), f"{what} curve[{i}] step", RecoveryError, 1, steps)
        check_number(row.get("seconds"), f"{what} curve[{i}] seconds", RecoveryError, low=0.0)
        _optional_number(row.get("loss"), f"{what} curve[{i}] loss", 0.0)
        check_number(row.get("lr"), f"{what} curve[{i}] lr", RecoveryError, 0.0, 1.0)
    probe = data.get("lr_probe", [])
    if not isinstance(probe, list) or len(probe) > 64 or not all(isinstance(row, dict) for row in probe):
        raise RecoveryError(f"{what} lr_probe must list at most 64 objects")
    for i, row in enumerate(probe):
        check_number(row.get("lr"), f"{what} lr_probe[{i}] lr", RecoveryError, 1e-12, 1.0)
        for name in ("loss_before", "loss_after"):
            _optional_number(row.get(name), f"{what} lr_probe[{i}] {name}", 0.0)
    for i, row in enumerate(data.get("rollbacks", [])):
        for name in ("step", "back_to"):
            check_int(row.get(name), f"{what} rollbacks[{i}] {name}", RecoveryError, 0, steps)
        _optional_number(row.get("loss"), f"{what} rollbacks[{i}] loss", 0.0)
        _optional_number(row.get("lowest"), f"{what} rollbacks[{i}] lowest", 0.0)
        check_number(row.get("lr_scale"), f"{what} rollbacks[{i}] lr_scale", RecoveryError, 1e-12, 1.0)


def save_best(work_dir: Path, step: int, tensors: dict[str, torch.Tensor]) -> None:
    """Replace the judge's best snapshot (the trained tensors at ``step``) atomically."""
    from safetensors.torch import save_file

    with atomic_directory(work_dir / _BEST) as tmp:
        save_file({k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}, str(tmp / _TENSORS))
        (tmp / "best.json").write_text(json.dumps({"step": step}) + "\n")


def load_best(work_dir: Path, step: int) -> dict[str, torch.Tensor]:
    """The judge's best snapshot, which must be the one of ``step``.

    Raises:
        RecoveryError: it is missing, unreadable, or of another step.
    """
    from safetensors.torch import load_file

    folder = work_dir / _BEST
    try:
        saved = read_json_file(folder / "best.json", LIMITS.metadata_bytes, f"{folder}/best.json", RecoveryError)
        if not isinstance(saved, dict) or saved.get("step") != step:
            raise RecoveryError(
                f"{folder} holds the snapshot of step {str(saved.get('step') if isinstance(saved, dict) else '?')[:20]}, not {step}"
            )
        return load_file(str(folder / _TENSORS))
    except RecoveryError as exc:
        raise RecoveryError(f"the best snapshot of the run in {work_dir} cannot be read ({exc}); remove {work_dir}") from None
    except Exception as exc:  # a truncated or foreign file
        raise RecoveryError(f"cannot read the best snapshot in {folder}: {type(exc).__name__}; remove {work_dir}") from None


def check_saved_state(work_dir: Path) -> None:
    """RecoveryError now, before any model loads, when ``work_dir`` holds a state.json that
    cannot be resumed (the tensors are read, and checked, when the run continues)."""
    folder = work_dir / _STATE
    if not (folder / _JSON).exists() and not (folder / _JSON).is_symlink():
        return
    refuse_special_files(folder, RecoveryError, f"the saved recovery state in {folder}")
    _checked_state(read_json_file(folder / _JSON, LIMITS.metadata_bytes * 16, f"{folder}/{_JSON}", RecoveryError), folder, work_dir)


def saved_step(out_dir: str | Path) -> int | None:
    """The step a cancelled or killed run that writes ``out_dir`` reached, or None when none is saved."""
    state_file = partial_dir(Path(out_dir)) / _STATE / _JSON
    try:
        step = read_json_file(state_file, LIMITS.metadata_bytes * 16, str(state_file), RecoveryError).get("step")
    except (RecoveryError, AttributeError):
        return None
    return step if isinstance(step, int) and not isinstance(step, bool) and step >= 0 else None


def check_resumable(state: RunState, trajectory: dict[str, Any], start_fingerprint: str, work_dir: Path) -> None:
    """RecoveryError unless the saved run can continue with these settings and this model."""
    if state.start_fingerprint != start_fingerprint:
        raise RecoveryError(
            f"the run saved in {work_dir} started from other weights (fingerprint {state.start_fingerprint}, "
            f"this model has {start_fingerprint}); start over without resume"
        )
    saved_objective = state.trajectory.get("objective") or "lm"  # runs saved before objectives existed trained on lm
    if saved_objective != trajectory.get("objective"):
        raise RecoveryError(
            f"the run saved in {work_dir} trained with objective {saved_objective}, not {trajectory.get('objective')}; "
            f"resume with --objective {saved_objective}, or start over without resume"
        )
    state.trajectory.setdefault("objective", saved_objective)
    for key in ("temperature", "kd_weight", "teacher", "teacher_fingerprint"):  # absent from older runs
        state.trajectory.setdefault(key, trajectory.get(key) if saved_objective == "lm" else None)
    changed = sorted(k for k in set(trajectory) | set(state.trajectory) if trajectory.get(k) != state.trajectory.get(k))
    if changed:
        first = changed[0]
        raise RecoveryError(
            f"the run saved in {work_dir} used other settings ({first}: {state.trajectory.get(first)!r}, "
            f"now {trajectory.get(first)!r}); start over without resume"
        )


def discard(work_dir: Path) -> None:
    shutil.rmtree(work_dir, ignore_errors=True)


# ---- output --------------------------------------------------------------------------------
def check_output_dir(out_dir: str | Path, model_source: str | None = None) -> None:
    """RecoveryError unless ``out_dir`` can be written and is not the model's own folder, and its
    work folder ``OUT.partial`` is absent or a real folder (never a link to somewhere else).

    Args:
        model_source: the folder the model is read from (``LoadedModel.source``), if any.
    """
    out_dir = Path(out_dir).expanduser()
    if out_dir.exists() and not out_dir.is_dir():
        raise RecoveryError(f"output {out_dir} exists and is not a folder")
    work = partial_dir(out_dir)
    if work.is_symlink() or (work.exists() and not work.is_dir()):
        # a link would have the run state written into (and removed from) a folder that is not the run's
        raise RecoveryError(f"the work folder {work} is {'a symbolic link' if work.is_symlink() else 'not a folder'}; remove it")
    source = Path(model_source).expanduser() if model_source else None
    if source is not None and source.is_dir() and out_dir.resolve() == source.resolve():
        raise RecoveryError(f"output {out_dir} is the folder the model is read from; choose another --out")
    ancestor = out_dir.absolute().parent
    while not ancestor.exists():
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise RecoveryError(f"cannot write {out_dir}: {ancestor} is not a folder")
    try:
        fd, probe = tempfile.mkstemp(prefix=".gap-write-test-", dir=ancestor)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise RecoveryError(f"cannot write {out_dir}: {exc.strerror or exc}") from None


def checkpoint_plan(lm: LoadedModel) -> tuple[RatePlan, dict[str, list[list[int]]]]:
    """(plan, kept indices) to write with the recovered weights: the checkpoint's own, or for a
    dense model a plan with every rate 0 (so ``gap eval`` compares it with the original)."""
    from gap_engine.model.rateplan import make_plan

    if lm.pruned_from is None:
        plan = make_plan(lm, [0.0] * lm.num_layers, [0.0] * lm.num_layers, "magnitude", allocator="dense")
        geometries = [lm.adapter.geometry(layer) for layer in lm.adapter.layers(lm.model)]
        kept = {
            "kept_kv_heads": [list(range(g.n_kv_heads)) for g in geometries],
            "kept_heads": [list(range(g.n_heads)) for g in geometries],
            "kept_channels": [list(range(g.intermediate_size)) for g in geometries],
        }
        return plan, kept
    if not lm.pruned_from.get("plan"):
        raise RecoveryError(f"{lm.source} is a gap checkpoint without its plan.json; cannot write a recovered checkpoint")
    plan = RatePlan.from_dict(dict(lm.pruned_from["plan"]))
    kept_file = Path(lm.source) / "kept_indices.json"
    if kept_file.exists():
        from gap_engine.core.validate import read_kept_indices

        kept = read_kept_indices(lm.source, RecoveryError)
    else:
        log.warning("%s has no kept_indices.json; the recovered checkpoint records none", lm.source)
        kept = {"kept_kv_heads": [], "kept_heads": [], "kept_channels": []}
    return plan, kept


def _curve_csv(curve: list[CurveRow]) -> str:
    """losses.csv; a step whose loss was not finite (null in the saved state) has an empty loss."""
    lines = ["step,seconds,loss,lr"]
    lines += [
        f"{row['step']},{row['seconds']:.3f},{'' if not _finite(row['loss']) else format(row['loss'], '.6f')},{row['lr']:.6g}"
        for row in curve
    ]
    return "\n".join(lines) + "\n"


def _finite(value: object) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)


def storage_dtype(lm: LoadedModel) -> str:
    """The storage dtype of the folder ``lm`` was read from: a gap checkpoint's recorded dtype,
    else its config.json's, else the default (bfloat16)."""
    from gap_engine.core.config import DEFAULT_SAVE_DTYPE, SAVE_DTYPES
    from gap_engine.model.checkpoint import PRUNED_MARKER

    folder = Path(lm.source).expanduser() if lm.source else None
    for name, key in ((PRUNED_MARKER, "dtype"), ("config.json", "dtype"), ("config.json", "torch_dtype")):
        try:
            value = json.loads((folder / name).read_text()).get(key) if folder is not None else None
        except (OSError, ValueError, AttributeError):
            continue
        if value in SAVE_DTYPES:
            return str(value)
    return DEFAULT_SAVE_DTYPE


@torch.no_grad()
def write_checkpoint(
    lm: LoadedModel, plan: RatePlan, kept: dict[str, list[list[int]]], out_dir: Path, result: RecoveryResult, adapter_dir: Path | None
) -> None:
    """The recovered model as a pruned checkpoint (``checkpoint.save_pruned``) in ``result.save_dtype``,
    its model card saying what recovery ran, plus ``recovery.json``, ``losses.csv`` and the unmerged
    ``adapter/``, all renamed into place together."""
    from gap_engine.model.checkpoint import save_pruned

    with atomic_directory(out_dir) as tmp:
        save_pruned(lm, plan, kept, tmp, dtype=result.save_dtype, eval_report=result.after, recovery=card_summary(result))
        (tmp / RESULT_FILE).write_text(json_text(result.to_dict(), RESULT_FILE, indent=2, default=str) + "\n")
        (tmp / "losses.csv").write_text(_curve_csv(result.curve))
        if adapter_dir is not None:
            shutil.copytree(adapter_dir, tmp / "adapter")


_RESULT_TEXTS = ("method", "stopped", "rss_method", "objective", "objective_note", "save_dtype")
_RESULT_COUNTS = ("steps_requested", "steps_done", "resumed_from", "trainable_params", "peak_rss", "inference_rss")
_RESULT_SECONDS = ("lr", "train_seconds", "train_cpu_seconds", "total_seconds", "lr_scale")


def read_result(folder: str | Path) -> RecoveryResult:
    """The RecoveryResult a finished run wrote into its recovered checkpoint (``recovery.json``),
    every field the explorer shows type-checked first.

    Raises:
        RecoveryError: (one line) no such file, or one that is not a recovery result.
    """
    what = f"{Path(folder)}/{RESULT_FILE}"
    data = check_keys(read_json_file(Path(folder).expanduser() / RESULT_FILE, LIMITS.metadata_bytes * 16, what, RecoveryError),
                      what, RecoveryError)  # fmt: skip
    missing = [f.name for f in fields(RecoveryResult) if f.name not in data and f.default is MISSING and f.default_factory is MISSING]
    if missing:
        raise RecoveryError(f"{what} is not a recovery result: it has no '{missing[0]}'")
    for name in _RESULT_TEXTS:
        check_text(data.get(name, ""), f"{what} {name}", RecoveryError, max_len=4 * LIMITS.text_field)
    for name in ("checkpoint", "adapter", "teacher"):
        check_text(data.get(name), f"{what} {name}", RecoveryError, optional=name != "checkpoint", max_len=8 * LIMITS.text_field)
    steps = check_int(data["steps_requested"], f"{what} steps_requested", RecoveryError, 1, 10**9)
    for name in _RESULT_COUNTS:
        check_int(data[name], f"{what} {name}", RecoveryError, 0, max(steps, 1 << 50))
    for name in _RESULT_SECONDS:
        check_number(data.get(name, 1.0), f"{what} {name}", RecoveryError, low=0.0)
    if not isinstance(data["tasks"], list) or not data["tasks"]:
        raise RecoveryError(f"{what} tasks must be a non-empty list")
    for task in data["tasks"]:
        check_text(task, f"{what} tasks entry", RecoveryError, max_len=8 * LIMITS.text_field)
    for name in ("calib_loss_before", "calib_loss_after"):
        if not isinstance(data[name], list) or len(data[name]) > len(data["tasks"]):
            raise RecoveryError(f"{what} {name} must list at most one loss per task")
        for value in data[name]:
            check_number(value, f"{what} {name} entry", RecoveryError, low=0.0)
    check_evaluation_report(data["after"], f"{what} after", RecoveryError)
    if data["before"] is not None:
        check_evaluation_report(data["before"], f"{what} before", RecoveryError)
    for name, most in (("curve", steps), ("rollbacks", 64), ("lr_probe", 64), ("judge_curve", steps + 2)):
        rows = data.get(name, [])
        if not isinstance(rows, list) or len(rows) > most or not all(isinstance(row, dict) for row in rows):
            raise RecoveryError(f"{what} {name} must list at most {most} objects")
    for row in data.get("curve", []):
        check_int(row.get("step"), f"{what} curve step", RecoveryError, 0, steps)
        _optional_number(row.get("loss"), f"{what} curve loss")  # null: a step whose loss was not finite
    if not isinstance(data.get("settings", {}), dict):
        raise RecoveryError(f"{what} settings must be an object")
    return RecoveryResult.from_dict(data)


def card_summary(result: RecoveryResult) -> dict[str, Any]:
    """What the model card says about a recovery run (a recover.RecoveryResult)."""
    before = result.before or {}
    return {
        "method": result.method,
        "objective": result.objective,
        "teacher": result.teacher,
        "temperature": result.settings.get("temperature") if result.objective != "lm" else None,
        "tasks": list(result.tasks),
        "steps": result.steps_done,
        "tokens": result.tokens_seen,
        "train_seconds": result.train_seconds,
        "lr": result.lr,
        "judge": {"by": result.judge, "best_step": result.best_step, "curve": result.judge_curve} if result.judge else None,
        "before": {k: before.get(k) or {} for k in ("perplexity", "kl_to_dense", "top1_agreement")},
        "after": {k: result.after.get(k) or {} for k in ("perplexity", "kl_to_dense", "top1_agreement")},
    }


def record_in_history(lm: LoadedModel, plan: RatePlan, result: RecoveryResult, history_path: Path | None) -> int:
    """Add a finished run (a recover.RecoveryResult) to the run history; returns its id."""
    from gap_engine.evaluate import history

    before = result.before or {}
    recovery = {
        key: getattr(result, key)
        for key in (
            "method",
            "tasks",
            "steps_requested",
            "steps_done",
            "stopped",
            "lr",
            "train_seconds",
            "trainable_params",
            "peak_rss",
            "inference_rss",
            "rss_method",
            "calib_loss_before",
            "calib_loss_after",
            "dense_input",
            "judge",
            "judge_curve",
            "best_step",
        )
    }
    recovery.update(
        rss_ratio=result.rss_ratio,
        source=lm.source,
        before={k: before.get(k) for k in ("perplexity", "kl_to_dense", "top1_agreement", "task_accuracy")},
        settings=result.settings,
    )
    record = history.RunRecord.from_report(
        plan.to_dict(),
        result.after,
        allocator=f"{plan.allocator}+{result.method}",
        table_key=plan.table_key,
        budget=plan.budget,
        params={"recovery": recovery, "eval": result.after.get("settings", {})},
        predicted_loss=plan.predicted_loss,
        checkpoint=result.checkpoint,
        seconds=result.total_seconds,
    )
    kind = "dense model" if result.dense_input else "pruned checkpoint"
    record.note = (
        f"recovered {kind} {lm.source} with {result.method}: {result.steps_done} steps, {result.train_seconds:.0f} s, "
        f"peak RSS {result.peak_rss / 2**20:.0f} MiB ({result.rss_ratio:.2f}x inference)"
    )
    return history.record_run(record, history_path)
