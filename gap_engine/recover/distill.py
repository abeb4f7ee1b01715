"""The training objective of recovery: next-token loss, distillation from the dense model, or both.

Fine-tuning a pruned model on a few thousand tokens of next-token loss pulls it toward those
texts; matching the dense model's output distribution keeps what the dense model could do
(Minitron, Muralidharan et al. 2024: width-pruned models recovered by logit distillation on a
small fraction of the original tokens beat plain LM-loss fine-tuning). Here the dense model a
checkpoint was pruned from is always at hand, so its next-token distribution is free
supervision.

* ``lm``: the mean next-token NLL of each task's windows (what recovery trained on before);
* ``kd``: ``τ² · KL(p_dense^τ || p_pruned^τ)`` per position, where ``p^τ = softmax(logits / τ)``,
  averaged like the NLL (per window, per task, then over tasks). ``τ²`` keeps the gradient's
  scale independent of the temperature (Hinton et al. 2015). With the student equal to the
  teacher it is exactly zero;
* ``kd+lm``: ``w · kd + (1 - w) · lm``.

The teacher's log-probabilities are computed on the fly, once per step and batch (a ZO step's
two perturbed passes share them), by the dense model loaded once, frozen, in inference mode.
Not cached to disk: exact full-vocabulary KL instead of a top-k truncation, and a run draws
each pool window about ``steps · batch / pool`` times, fewer than once for runs shorter than
the pool, so a cache of the whole pool would cost more teacher passes than it saves (see the
docs/recovery.md and bench/results/zo_step.md for the measured cost).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from gap_engine.core.errors import InvariantError
from gap_engine.model.loaded import LoadedModel

log = logging.getLogger(__name__)

MAX_TEMPERATURE = 100.0


class TeacherMismatch(ValueError):
    """The teacher cannot supervise the student (another tokenizer or vocabulary)."""


def check_compatible(student: LoadedModel, teacher: LoadedModel) -> None:
    """TeacherMismatch unless ``teacher`` (a LoadedModel) reads and writes the student's tokens.

    Both the tokenizers' vocabularies and the LM heads' output widths must agree: KL between two
    distributions is only defined over one shared set of tokens.
    """
    s_width, t_width = _output_width(student), _output_width(teacher)
    if s_width != t_width:
        raise TeacherMismatch(f"the teacher {teacher.name} predicts {t_width} tokens, the student {s_width}")
    if student.tokenizer.get_vocab() != teacher.tokenizer.get_vocab():
        raise TeacherMismatch(f"the teacher {teacher.name} has another tokenizer vocabulary than the student")


def _output_width(lm: LoadedModel) -> int:
    """Tokens the LM head predicts (``get_output_embeddings`` is the transformers model's own
    method; LoadedModel types the model as a Module)."""
    head = cast(nn.Linear, cast(Any, lm.model).get_output_embeddings())
    return int(head.weight.shape[0])


def _forward_logits(model: nn.Module, batch: torch.Tensor, bf16: bool) -> torch.Tensor:
    """(B, T-1, V) float32 logits of the positions that predict a next token."""
    with torch.autocast(device_type=batch.device.type, dtype=torch.bfloat16, enabled=bf16):
        logits: torch.Tensor = model(input_ids=batch, use_cache=False).logits  # (B, T, V)
    return logits[:, :-1].float()


def _per_task(per_position: torch.Tensor, n_tasks: int) -> torch.Tensor:
    """(B, T-1) -> (n_tasks,): mean over positions, then over each task's windows."""
    return per_position.mean(1).view(n_tasks, -1).mean(1)


@dataclass
class Objective:
    """One recovery objective, with its teacher when it distils."""

    name: str = "lm"  # one of recover.methods.RECOVERY_OBJECTIVES
    temperature: float = 1.0  # τ of the distillation
    kd_weight: float = 0.5  # w of kd+lm: w · kd + (1 - w) · lm
    teacher: torch.nn.Module | None = None  # the dense model (frozen, eval mode), for kd and kd+lm
    bf16: bool = False  # bf16 autocast for the forward passes

    @property
    def distils(self) -> bool:
        return self.name in ("kd", "kd+lm")

    @torch.no_grad()
    def teacher_log_probs(self, batch: torch.Tensor) -> torch.Tensor | None:
        """(B, T-1, V) the teacher's log-probabilities at temperature τ, or None for ``lm``."""
        if not self.distils:
            return None
        if self.teacher is None:
            raise ValueError(f"objective {self.name} needs a teacher")
        return F.log_softmax(_forward_logits(self.teacher, batch, self.bf16) / self.temperature, dim=-1)

    def per_task(self, model: nn.Module, batch: torch.Tensor, n_tasks: int, teacher_log_probs: torch.Tensor | None) -> torch.Tensor:
        """Per-task loss of a task-major batch (with the graph when grads are on).

        Args:
            batch: (n_tasks * b, T) token ids, task i's windows in rows i*b .. (i+1)*b - 1.
            teacher_log_probs: :meth:`teacher_log_probs` of the same batch (None for ``lm``).
        Returns:
            (n_tasks,) losses.
        """
        logits = _forward_logits(model, batch, self.bf16)  # (B, T-1, V)
        loss = None
        if self.name in ("lm", "kd+lm"):
            vocab = logits.shape[-1]
            nll = F.cross_entropy(logits.reshape(-1, vocab), batch[:, 1:].reshape(-1), reduction="none")
            loss = _per_task(nll.view(batch.shape[0], -1), n_tasks)
            if self.name == "kd+lm":
                loss = (1.0 - self.kd_weight) * loss
        if self.distils:
            if teacher_log_probs is None:
                raise InvariantError("a distilling objective was given no teacher log-probabilities")
            kd = distillation_loss(logits, teacher_log_probs, self.temperature)  # (B, T-1)
            kd = _per_task(kd, n_tasks)
            loss = kd if loss is None else loss + self.kd_weight * kd
        if loss is None:
            raise InvariantError("the objective has neither an lm nor a kd part")
        return loss


def distillation_loss(student_logits: torch.Tensor, teacher_log_probs: torch.Tensor, temperature: float) -> torch.Tensor:
    """``τ² · KL(teacher || student)`` per position.

    Args:
        student_logits: (B, T, V) float32.
        teacher_log_probs: (B, T, V) log-softmax of the teacher's logits / τ.
    Returns:
        (B, T) non-negative (up to rounding) divergences, exactly 0 where the logits agree.
    """
    student_log_probs = F.log_softmax(student_logits / temperature, dim=-1)
    # kl_div(input=log q, target=log p, log_target=True) = Σ p (log p - log q) = KL(p || q)
    kl = F.kl_div(student_log_probs, teacher_log_probs, reduction="none", log_target=True).sum(-1)  # (B, T)
    return kl * (temperature * temperature)


def check_temperature(value: object) -> str | None:
    """None when ``value`` is a usable temperature, else why not (one line)."""
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and 0.0 < value <= MAX_TEMPERATURE:
        return None
    return f"temperature must be a number in (0, {MAX_TEMPERATURE:g}], got {value!r}"
