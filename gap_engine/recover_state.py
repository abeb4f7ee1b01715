"""Saved progress of a recovery run, so a cancelled or killed run resumes where it was saved.

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
"""

from __future__ import annotations

import json
import logging
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from .errors import GapError
from .fsutil import atomic_directory

log = logging.getLogger(__name__)

STATE_VERSION = 1
PARTIAL_SUFFIX = ".partial"
_STATE = "state"
_JSON = "state.json"
_TENSORS = "tensors.safetensors"
_OPTIMIZER = "optimizer.pt"


class RecoveryError(GapError):
    """Bad recovery settings, an unusable output folder, or a saved run that does not fit."""


@dataclass
class RunState:
    """Everything about a run's progress except its tensors."""

    trajectory: dict  # the settings a resumed run must share (RecoverySettings.trajectory())
    start_fingerprint: str  # weights fingerprint of the model the run started from
    step: int = 0  # steps finished
    train_seconds: float = 0.0  # training wall time so far, over every segment
    curve: list[dict] = field(default_factory=list)  # one row per step: step, seconds, loss, lr
    before: dict | None = None  # EvalReport.to_dict() of the model before training
    calib_before: list[float] = field(default_factory=list)  # per task: NLL on its fixed calibration windows
    inference_rss: int = 0  # bytes: peak resident memory of one forward pass at the training batch
    peak_rss: int = 0  # bytes: peak resident memory while training, highest over segments
    rss_method: str = ""  # how memory was measured (memory.PeakRSS.method)
    version: int = STATE_VERSION


def partial_dir(out_dir: Path) -> Path:
    """The working folder of the run that writes ``out_dir``."""
    return out_dir.with_name(out_dir.name + PARTIAL_SUFFIX)


def save_state(work_dir: Path, state: RunState, tensors: dict[str, torch.Tensor], optimizer_state: dict | None) -> None:
    """Replace the snapshot in ``work_dir`` atomically."""
    from safetensors.torch import save_file

    with atomic_directory(work_dir / _STATE) as tmp:
        save_file({k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}, str(tmp / _TENSORS))
        if optimizer_state is not None:
            torch.save(optimizer_state, tmp / _OPTIMIZER)
        (tmp / _JSON).write_text(json.dumps(asdict(state)) + "\n")
    log.debug("saved recovery state at step %d", state.step)


def load_state(work_dir: Path) -> tuple[RunState, dict[str, torch.Tensor], dict | None] | None:
    """The snapshot in ``work_dir``, or None when there is none.

    Raises:
        RecoveryError: the snapshot is unreadable or of another format version.
    """
    from safetensors.torch import load_file

    folder = work_dir / _STATE
    if not (folder / _JSON).is_file():
        return None
    try:
        data = json.loads((folder / _JSON).read_text())
        if data.get("version") != STATE_VERSION:
            raise RecoveryError(f"{folder}: saved state format {data.get('version')} is not supported; remove {work_dir}")
        state = RunState(**data)
        tensors = load_file(str(folder / _TENSORS))
        optimizer_state = torch.load(folder / _OPTIMIZER, weights_only=True) if (folder / _OPTIMIZER).is_file() else None
    except RecoveryError:
        raise
    except Exception as exc:  # a truncated or foreign file: any reader error means "cannot resume"
        raise RecoveryError(f"cannot read the saved recovery state in {folder}: {type(exc).__name__}; remove {work_dir}") from None
    return state, tensors, optimizer_state


def check_resumable(state: RunState, trajectory: dict, start_fingerprint: str, work_dir: Path) -> None:
    """RecoveryError unless the saved run can continue with these settings and this model."""
    if state.start_fingerprint != start_fingerprint:
        raise RecoveryError(
            f"the run saved in {work_dir} started from other weights (fingerprint {state.start_fingerprint}, "
            f"this model has {start_fingerprint}); start over without resume"
        )
    changed = sorted(k for k in set(trajectory) | set(state.trajectory) if trajectory.get(k) != state.trajectory.get(k))
    if changed:
        first = changed[0]
        raise RecoveryError(
            f"the run saved in {work_dir} used other settings ({first}: {state.trajectory.get(first)!r}, "
            f"now {trajectory.get(first)!r}); start over without resume"
        )


def discard(work_dir: Path) -> None:
    shutil.rmtree(work_dir, ignore_errors=True)
