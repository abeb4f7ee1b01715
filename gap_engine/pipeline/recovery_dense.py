"""The dense model beside a recovery run: the teacher it distils from and the reference it is measured against.

``resolve_objective`` decides what a run minimises (``recover.distill``): ``kd`` by default when
the dense model the checkpoint was pruned from loads here with the recorded weights (or the
teacher named in the settings loads), else ``lm``, with one line saying which and why; an
explicit ``kd`` without a reachable teacher, or a teacher with another vocabulary, is refused.
``evaluate_heldout`` is the before/after evaluation on every task's held-out text, with the
dense reference loaded once as the teacher when there is one.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from contextlib import nullcontext

from gap_engine.core.config import WindowSpec
from gap_engine.core.device import DeviceSpec, placement_of
from gap_engine.core.errors import ModelLoadError, one_line
from gap_engine.core.interrupt import cancel_checks
from gap_engine.core.memory import release_free_memory
from gap_engine.core.progress import Hooks
from gap_engine.evaluate.metrics import EvalSettings, evaluate
from gap_engine.evaluate.tasks import PreparedTasks, dense_task_scores, run_tasks
from gap_engine.model.loaded import LoadedModel
from gap_engine.model.loading import load_model
from gap_engine.pipeline.stages import dense_reference
from gap_engine.recover.distill import Objective, TeacherMismatch, check_compatible
from gap_engine.recover.files import RecoveryError

log = logging.getLogger(__name__)


def resolve_objective(
    lm: LoadedModel, settings, teacher: LoadedModel | None, say: Callable[[str], None], device
) -> tuple[Objective, LoadedModel | None, str]:
    """(objective, teacher or None, a line saying which and why).

    The default is ``kd`` when the dense model the checkpoint was pruned from is reachable, else
    ``lm``; an explicit ``kd``/``kd+lm`` without a reachable teacher is refused (RecoveryError),
    and so is teacher-written text (the teacher writes it, whatever the objective), or a teacher
    whose vocabulary differs from the student's.
    """
    wanted, text = settings.objective, settings.teacher_source
    if wanted == "lm" and text is None:
        return Objective("lm", bf16=settings.bf16), None, "objective lm (next-token loss), as asked"
    base = (lm.pruned_from or {}).get("model")
    if teacher is None and (settings.teacher or base):
        say(f"loading the teacher {settings.teacher or base}")
        teacher, why_not = load_teacher(lm, settings.teacher)
        if teacher is None and settings.teacher:  # a teacher asked for by name is never swapped for the lm objective
            raise RecoveryError(f"cannot distil: {why_not}")
    else:
        why_not = "the model is not a pruned gap checkpoint, so no dense base model is recorded"
    if teacher is None:
        if text is not None:
            raise RecoveryError(f"teacher-written text ({text}) needs the dense model to write it, but {why_not}; pass --teacher MODEL")
        if wanted is not None:
            raise RecoveryError(
                f"objective {wanted} needs the dense model to distil from, but {why_not}; pass --teacher MODEL or use --objective lm"
            )
        return Objective("lm", bf16=settings.bf16), None, f"objective lm (next-token loss): {why_not}"
    try:
        check_compatible(lm, teacher)
    except TeacherMismatch as exc:
        raise RecoveryError(f"cannot {'distil' if wanted != 'lm' else 'train on the teacher-written text'}: {exc}") from None
    teacher.model.to(device).eval()
    for p in teacher.model.parameters():
        p.requires_grad_(False)
    name = wanted or "kd"
    if name == "lm":
        return Objective("lm", bf16=settings.bf16), teacher, f"objective lm (next-token loss), as asked, on text written by {teacher.name}"
    objective = Objective(name, settings.temperature, settings.kd_weight, teacher.model, settings.bf16)
    how = f"temperature {settings.temperature:g}" + (f", kd weight {settings.kd_weight:g}" if name == "kd+lm" else "")
    default = "" if wanted else " (the default: the dense base model is reachable)"
    return objective, teacher, f"objective {name}{default}: distilling from {teacher.name}, {how}"


def load_teacher(lm: LoadedModel, name: str | None) -> tuple[LoadedModel | None, str]:
    """(the teacher on the student's device and dtype, or None and why it is not reachable)."""
    spec = None
    if lm.placement is not None:
        spec = DeviceSpec(device=str(lm.placement.device), dtype=str(lm.placement.dtype).removeprefix("torch."))
    if name is None:
        teacher = dense_reference(lm, spec, warn=False)  # the objective's note says why not, in one line
        base = (lm.pruned_from or {}).get("model")
        return teacher, f"the dense base model '{base}' is not reachable here (or has other weights than the ones pruned)"
    try:
        return load_model(name, spec), ""
    except ModelLoadError as exc:
        return None, f"the teacher '{name}' cannot be loaded ({one_line(exc)})"


def dense_reference_of(lm: LoadedModel, start_fingerprint: str) -> LoadedModel | None:
    """The dense model to compare with: a checkpoint's base model, or a dense model as it was."""
    if lm.pruned_from is not None:
        return dense_reference(lm)
    try:
        reference = load_model(lm.name)
    except ModelLoadError:
        return None
    return reference if reference.fingerprint == start_fingerprint else None


def task_accuracy(lm: LoadedModel, dense: LoadedModel | None, prepared: PreparedTasks, start_fingerprint: str) -> dict:
    """``task_accuracy`` of ``lm`` and ``dense_task_accuracy`` of the dense model it came from (cached
    per model + task + limit; measured with ``dense`` when it is loaded and the cache lacks them).

    The dense key is the checkpoint's recorded base model, or for a dense model being recovered the
    weights it started from: its trained weights never pass for dense.
    """
    scores = run_tasks(lm, prepared)
    fingerprint = (lm.pruned_from or {}).get("fingerprint") or start_fingerprint
    dtype = str(placement_of(lm).dtype).removeprefix("torch.")
    measure = (lambda names: run_tasks(dense, prepared, names)) if dense is not None else None
    dense_scores = dense_task_scores(fingerprint, dtype, prepared, measure)
    return {
        "task_accuracy": {name: score.to_dict() for name, score in scores.items()},
        "dense_task_accuracy": {name: score.to_dict() for name, score in dense_scores.items()},
    }


def evaluate_heldout(
    lm: LoadedModel,
    settings,
    label: str,
    hooks: Hooks,
    start_fingerprint: str,
    dense: LoadedModel | None = None,
    lm_eval_tasks: PreparedTasks | None = None,
    calibration: Callable[[LoadedModel], list[float]] | None = None,
) -> dict:
    """evaluate.evaluate on every task's held-out text (on the CPU, where evaluate's windows are).

    ``dense``: the dense reference already loaded as the teacher (reused; else loaded here).
    ``lm_eval_tasks``: also their accuracy (`task_accuracy`) and dense's (`dense_task_accuracy`).
    ``calibration``: the calibration loss per task of a model; given, dense's is kept as
    ``dense_calib_loss`` (the number the pruned model's calibration loss is read against).
    ``hooks``: each step said as a message; its cancel polled at every step (and every block while tasks are scored)."""

    def say(message: str) -> None:
        hooks.check_cancelled(f"recovery cancelled while evaluating {label} training")
        hooks.say(f"evaluating {label} training: {message}")

    shared = dense is not None and settings.compare_dense
    if not shared:
        say("loading the dense reference")
        dense = dense_reference_of(lm, start_fingerprint) if settings.compare_dense else None
    device = next(lm.model.parameters()).device
    dense_device = next(dense.model.parameters()).device if dense is not None else None
    lm.model.to("cpu")
    if dense is not None:
        dense.model.to("cpu")
    try:
        eval_settings = EvalSettings(
            windows=WindowSpec(data=",".join(settings.heldout_texts), n_samples=settings.eval_samples, seq_len=settings.eval_seq_len),
            throughput=False,
            generations=settings.eval_generations,
        )
        report = evaluate(lm, dense, eval_settings, Hooks(message=say)).to_dict()
        if dense is not None and calibration is not None:
            say("the dense model's calibration loss")
            report["dense_calib_loss"] = calibration(dense)
        if lm_eval_tasks is not None:
            say(f"task accuracy on {', '.join(lm_eval_tasks.tasks)} (lm-eval)")
            stopped = f"recovery cancelled while scoring tasks {label} training"
            with (
                cancel_checks(lm, hooks, stopped),
                cancel_checks(dense, hooks, stopped) if dense is not None else nullcontext(),
            ):  # lm-eval's passes poll it too
                report |= task_accuracy(lm, dense, lm_eval_tasks, start_fingerprint)
        return report
    finally:
        lm.model.to(device)
        if shared and dense is not None:
            dense.model.to(dense_device)
        elif dense is not None:
            del dense
            release_free_memory()
