"""Cancel inside a forward or backward pass, and give up waiting on work that cannot stop.

Both take the work's ``progress.Hooks`` (only its cancel is read), as every long stage does.
``Hooks.check_cancelled`` runs between steps (cells, batches, stages). A step of a
135M-parameter model on a small, shared CPU can take tens of seconds (a calibration batch's
forward and two backward passes), so a cancel polled only between steps is honoured late.
`cancel_checks` polls at every decoder block instead: a forward pre-hook on each block,
and, when the block's input carries gradients, a tensor hook that fires as the backward
pass leaves the block. Whatever runs the model inside the ``with`` (importance scores, the
dense pass, exact cells, perplexity, generation, throughput) then stops within one block.

Hooks sit on the model, which other threads may share (the app keeps one dense model per
process): each hook acts only in the thread that installed it, so one job's cancel never
stops another job's forward pass on the same model.

Some work has no step to poll: ``transformers`` loading a model, a tokenizer reading a
corpus. `run_unless_cancelled` runs it in a helper thread and stops *waiting* at a cancel:
the caller gets CancelledError at once while the work finishes unobserved (a model loaded
that way still lands in whatever cache the work fills).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch

from gap_engine.core.errors import CancelledError
from gap_engine.core.progress import Hooks

T = TypeVar("T")
POLL_SECONDS = 0.05  # how often a waiting caller looks at its cancel token


@contextlib.contextmanager
def cancel_checks(lm: Any, hooks: Hooks, message: str) -> Iterator[None]:
    """Poll ``hooks``' cancel at every decoder block of ``lm`` while the ``with`` body runs.

    Args:
        lm: a LoadedModel (its adapter finds the blocks; typed Any: core sits below the model layer).
        hooks: the work's hooks; without a cancel token nothing is installed.
        message: the CancelledError's text when it is set.
    Raises:
        CancelledError: from inside a forward or backward pass, once the cancel is set.
    """
    cancel = hooks.cancel
    if cancel is None:
        yield
        return
    owner = threading.get_ident()

    def check(_grad: torch.Tensor | None = None) -> None:
        if threading.get_ident() == owner and cancel.is_set():
            raise CancelledError(message)

    def before_block(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if threading.get_ident() != owner:
            return None
        check()
        hidden = args[0] if args else kwargs.get("hidden_states")
        if hidden is not None and hidden.requires_grad:
            hidden.register_hook(check)  # fires when the backward pass has gone through this block
        return None

    def after_last_block(module: torch.nn.Module, args: tuple[Any, ...], output: Any) -> None:
        # The head and the loss run after the last block with no block hook of their own:
        # a check as the backward pass reaches the last block's output ends the wait there.
        hidden = output[0] if isinstance(output, tuple) else output
        if threading.get_ident() == owner and isinstance(hidden, torch.Tensor) and hidden.requires_grad:
            hidden.register_hook(check)
        return None

    layers = list(lm.adapter.layers(lm.model))
    handles = [layer.register_forward_pre_hook(before_block, with_kwargs=True) for layer in layers]
    handles.append(layers[-1].register_forward_hook(after_last_block))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def run_unless_cancelled(work: Callable[[], T], hooks: Hooks, message: str, name: str = "gap-uninterruptible") -> T:
    """``work()`` in a helper thread; return its result, or raise CancelledError as soon as
    ``hooks``' cancel is set (the work then finishes on its own, unobserved).

    Args:
        work: a call with no cancel point of its own (a model load, a corpus read).
        hooks: the work's hooks; its cancel is polled every POLL_SECONDS (without one,
            ``work()`` is simply called here).
        message: the CancelledError's text.
        name: the helper thread's name (shows in a debugger or a stack dump).
    Raises:
        CancelledError: cancelled while waiting. Whatever ``work`` raises, re-raised here.
    """
    if hooks.cancel is None:
        return work()
    hooks.check_cancelled(message)
    finished = threading.Event()
    results: list[T] = []
    errors: list[BaseException] = []

    def run() -> None:
        try:
            results.append(work())
        except BaseException as exc:
            errors.append(exc)
        finally:
            finished.set()

    threading.Thread(target=run, name=name, daemon=True).start()
    while not finished.wait(POLL_SECONDS):
        hooks.check_cancelled(message)
    if errors:
        raise errors[0]
    return results[0]
