"""Judging the weights during training, so that the snapshot kept is the best one by what users measure.

Recovery lowers its training objective steadily while task accuracy may peak early and drift
(docs/recovery.md: 15 minutes of LoRA took DP's wiki perplexity from 1.86x to 1.28x of
dense and moved its task accuracy by at most 2 points). With ``--eval-tasks T --eval-every K``
every K-th saved snapshot (and the starting weights, and the last) is scored on a *selection
slice* of task T, its last ``eval_task_examples`` examples, and the best is kept: the recovered
checkpoint holds those weights, the curve of scores goes into ``recovery.json``, the history and
the model card. Without tasks, ``--eval-every K`` judges by the mean KL to the dense model on
windows of the selection part of the evaluation texts' held-out text, which shares no document
with the report part the evaluation reads.

The selection slice is part of the task: an accuracy reported on the whole task afterwards
includes the examples the snapshot was chosen on, so a benchmark that compares selected
checkpoints reports the other examples (``bench/bench_recovery_tasks.py``).
"""

from __future__ import annotations

import logging
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from gap_engine.core.config import WindowSpec
from gap_engine.data.bos import text_start
from gap_engine.data.windows import heldout_windows
from gap_engine.evaluate.tasks import PreparedTasks, run_tasks
from gap_engine.model.loaded import LoadedModel

log = logging.getLogger(__name__)

SELECTION_SEED_OFFSET = 7919  # the KL judge's windows: the run's seed plus this, never the evaluation's seed


class Judge(Protocol):
    """Scores the weights as they are now; higher is better."""

    description: str  # what the score is, for the output and recovery.json

    def __call__(self) -> float: ...


def selection_slice(task: Any, examples: int) -> list[int]:
    """Indices of the last ``examples`` examples of an lm-eval task (all of them when it has fewer).

    ``task``: an lm-eval Task (typed Any: lm-eval ships no type information)."""
    count = len(task.eval_docs)
    return list(range(max(0, count - examples), count))


class TaskJudge:
    """Mean accuracy over the tasks' selection slices."""

    def __init__(self, lm: LoadedModel, prepared: PreparedTasks, examples: int):
        self.lm, self.prepared = lm, prepared
        self.slices = {name: selection_slice(task, examples) for name, task in prepared.tasks.items()}
        sizes = ", ".join(f"{name} (last {len(rows)} examples)" for name, rows in self.slices.items())
        self.description = f"task accuracy on {sizes}"

    def __call__(self) -> float:
        scores = run_tasks(self.lm, self.prepared, examples=self.slices)
        return sum(score.acc for score in scores.values()) / len(scores)


class KLJudge:
    """Minus the mean KL(dense || model) per token on held-out windows (higher is better)."""

    def __init__(
        self, model: nn.Module, lm: LoadedModel, teacher: nn.Module, texts: tuple[str, ...], samples: int, seq_len: int, seed: int
    ):
        self.model, self.teacher = model, teacher
        device = next(model.parameters()).device
        self.windows = torch.cat(
            [
                heldout_windows(
                    lm.tokenizer, WindowSpec(data=text, n_samples=samples, seq_len=seq_len, seed=seed + SELECTION_SEED_OFFSET), "selection"
                )
                for text in texts
            ]
        ).to(device)  # (texts * samples, start + T)
        self.start = text_start(lm.tokenizer, self.windows)
        self.description = (
            f"held-out KL to dense on {samples} windows of {', '.join(texts)} (their selection part; the evaluation reads the report part)"
        )

    @torch.no_grad()
    def __call__(self) -> float:
        total = 0.0
        for window in self.windows.split(1):  # one at a time: (1, T, vocab) logits, as the guard's check
            student = F.log_softmax(self.model(input_ids=window, use_cache=False).logits[:, self.start : -1].float(), dim=-1)
            dense = F.log_softmax(self.teacher(input_ids=window, use_cache=False).logits[:, self.start : -1].float(), dim=-1)
            total += float(F.kl_div(student, dense, reduction="none", log_target=True).sum(-1).mean())
        return -total / self.windows.shape[0]
