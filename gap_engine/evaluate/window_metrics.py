"""Per-window NLL, KL to the dense model and top-1 agreement, with one dense pass per window ever.

A benchmark that measures many pruned models against one dense model on the same windows needs,
per window, the pruned model's mean NLL per token, its mean KL(dense || pruned) and the share of
positions where its most likely next token is the dense model's. Written directly, the KL needs
the dense distribution over the whole vocabulary at every position: a second forward pass of the
dense model per pruned model, or (Gemma 3's 262,144-token vocabulary) 268 MB of dense
log-probabilities per window of 256 tokens to keep.

When the logits are the LM head's linear map of the final hidden state, ``z = W h`` (no bias, no
soft-capping; checked on every batch), the KL at a position reduces to numbers of the dense model
alone and one dot product:

    KL(p_d || p) = sum_v p_d(v) log p_d(v) - sum_v p_d(v) (z(v) - lse(z))
                 = -H(p_d) - h . (W^T p_d) + lse(z)

so the dense side is its negative entropy and its *expected unembedding* ``m = W^T p_d`` (a
hidden-size vector) per position, computed once per window set, kept on disk and reused by every
pruned model whose head weight ``W`` is the same (all pruned copies of one model stored in one
dtype share it). The pruned side is its own forward pass, the log-sum-exp of its logits, the
target's logit and the argmax. The numbers are the quantities the direct formula gives, to
float rounding (the dense side in float64; ``tests/evaluate/test_window_metrics.py``).

The dense numbers are stored under ``cache/dense_windows/``, keyed by the dense weights'
fingerprint, its dtype and the exact window tokens (``dense_numbers.dense_key``: text, seed,
window count and length and the BOS rule are all in the tokens), the expected unembedding also by
a hash of the head weight it was computed with.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt
import torch
import torch.nn.functional as F
from torch import nn

from gap_engine.core.device import dtype_name
from gap_engine.core.errors import InvariantError, OutputError
from gap_engine.core.fsutil import atomic_file, cache_root
from gap_engine.data.bos import text_start
from gap_engine.data.windows import batches
from gap_engine.evaluate.dense_numbers import dense_key
from gap_engine.model.loaded import LoadedModel

log = logging.getLogger(__name__)

_VOCAB_CHUNK = 16384  # vocabulary rows per float64 product when the expected unembedding is built
_FORMAT = 1  # of the files under cache/dense_windows/


@dataclass(frozen=True)
class WindowNumbers:
    """A model's numbers on each window of one set (lists, one entry per window, in window order)."""

    nll: list[float]  # mean NLL per counted token
    kl: list[float]  # mean KL(dense || model) per counted token
    top1: list[float]  # share of counted positions where the model's argmax is the dense model's


@dataclass
class DenseWindows:
    """The dense model's side of the comparison on one window set."""

    key: str  # dense_key of the dense weights, dtype and windows
    nll: npt.NDArray[np.float64]  # (N,) dense mean NLL per counted token of each window
    neg_entropy: npt.NDArray[np.float64]  # (N, P) sum_v p_d log p_d at each counted position
    top1: npt.NDArray[np.int64]  # (N, P) the dense argmax at each counted position
    head_key: str  # hash of the head weight ``expected`` was computed with
    expected: npt.NDArray[np.float64]  # (N, P, d) W^T p_d at each counted position


_MEMO: dict[tuple[str, str], DenseWindows] = {}


def head_weight(lm: LoadedModel) -> torch.Tensor:
    """The LM head weight ``W`` (V, d) of a model whose logits are ``W h``; InvariantError otherwise."""
    head = lm.adapter.lm_head(lm.model)
    if not isinstance(head, nn.Linear) or head.bias is not None:
        raise InvariantError(f"{lm.name}: the LM head is not a bias-free linear map; per-window KL needs logits = W h")
    if getattr(lm.model.config, "final_logit_softcapping", None) is not None:
        raise InvariantError(f"{lm.name}: its logits are soft-capped; per-window KL needs logits = W h")
    return head.weight


def weight_key(weight: torch.Tensor) -> str:
    """A hash of a weight's dtype, shape and values."""
    digest = hashlib.sha256(f"{weight.dtype}{tuple(weight.shape)}".encode())
    digest.update(weight.detach().to("cpu").contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()[:32]


def dense_windows(
    dense: LoadedModel, windows: torch.Tensor, head: torch.Tensor, batch_size: int = 1, head_key: str | None = None
) -> DenseWindows:
    """The dense model's numbers on ``windows``, with the expected unembedding under ``head``.

    Read from memory or ``cache/dense_windows/`` when they were computed before for the same
    dense weights, dtype, window tokens and head weight; else one dense pass computes and stores them.

    Args:
        dense: the dense model.
        windows: (N, T) token ids.
        head: the head weight (V, d) of the models that will be compared (``head_weight``).
        batch_size: windows per dense forward pass (memory only).
        head_key: ``weight_key(head)`` when the caller has it (hashing a large head takes seconds).
    """
    key = dense_key(dense.fingerprint, windows, dtype_name(next(dense.model.parameters()).dtype))
    head_key = head_key or weight_key(head)
    memo = _MEMO.get((key, head_key))
    if memo is not None:
        return memo
    folder = cache_root() / "dense_windows"
    found = _read(folder, key, head_key)
    if found is None:
        found = _measure_dense(dense, windows, head, batch_size, key, head_key)
        _write(folder, found)
    _MEMO[(key, head_key)] = found
    return found


@torch.inference_mode()
def _measure_dense(dense: LoadedModel, windows: torch.Tensor, head: torch.Tensor, batch_size: int, key: str, head_key: str) -> DenseWindows:
    start = text_start(dense.tokenizer, windows)
    weight = head.detach().to("cpu")
    nll, neg_entropy, top1, expected = [], [], [], []
    for batch in batches(windows, batch_size):
        logits = dense.model(input_ids=batch, use_cache=False).logits[:, start:-1].to("cpu", torch.float64)  # (B, P, V)
        logp = F.log_softmax(logits, -1)
        targets = batch[:, start + 1 :].to("cpu")  # (B, P)
        nll.append(-logp.gather(-1, targets[..., None])[..., 0].mean(-1))  # (B,)
        probs = logp.exp()
        neg_entropy.append((probs * logp).sum(-1))  # (B, P)
        top1.append(logits.argmax(-1))
        unembedding = torch.zeros(*probs.shape[:2], weight.shape[1], dtype=torch.float64)  # (B, P, d)
        for row in range(0, weight.shape[0], _VOCAB_CHUNK):
            unembedding += probs[..., row : row + _VOCAB_CHUNK] @ weight[row : row + _VOCAB_CHUNK].double()
        expected.append(unembedding)
    return DenseWindows(
        key=key,
        nll=torch.cat(nll).numpy(),
        neg_entropy=torch.cat(neg_entropy).numpy(),
        top1=torch.cat(top1).numpy(),
        head_key=head_key,
        expected=torch.cat(expected).numpy(),
    )


def _paths(folder: Path, key: str, head_key: str) -> tuple[Path, Path]:
    return folder / f"v{_FORMAT}-{key}.npz", folder / f"v{_FORMAT}-{key}-head-{head_key}.npy"


def _read(folder: Path, key: str, head_key: str) -> DenseWindows | None:
    numbers_path, expected_path = _paths(folder, key, head_key)
    try:
        with np.load(numbers_path) as numbers:
            nll, neg_entropy, top1 = numbers["nll"], numbers["neg_entropy"], numbers["top1"]
        expected = np.load(expected_path)
    except (OSError, KeyError, ValueError):
        return None  # not measured yet, or unreadable: measured again and rewritten
    if expected.shape[:2] != neg_entropy.shape or top1.shape != neg_entropy.shape or nll.shape != neg_entropy.shape[:1]:
        return None
    return DenseWindows(key, nll, neg_entropy, top1, head_key, expected)


def _write(folder: Path, numbers: DenseWindows) -> None:
    numbers_path, expected_path = _paths(folder, numbers.key, numbers.head_key)
    try:
        with atomic_file(numbers_path) as partial, partial.open("wb") as handle:
            np.savez(handle, nll=numbers.nll, neg_entropy=numbers.neg_entropy, top1=numbers.top1)
        with atomic_file(expected_path) as partial, partial.open("wb") as handle:
            np.save(handle, numbers.expected)
    except (OSError, OutputError) as exc:  # a read-only cache: the numbers are still right, just not kept
        log.warning("could not store the dense per-window numbers: %s", exc)


@torch.inference_mode()
def window_numbers(
    lm: LoadedModel, dense: LoadedModel, window_sets: Mapping[str, torch.Tensor], batch_size: int = 1
) -> dict[str, WindowNumbers]:
    """``lm``'s per-window mean NLL, KL(dense || lm) and top-1 agreement on every window set.

    Counts the positions ``metrics.mean_nll`` counts (a leading BOS token is context only).
    One forward pass of ``lm`` per batch; the dense side comes from :func:`dense_windows`.

    Args:
        lm: the model measured (e.g. pruned).
        dense: the dense model it is compared with.
        window_sets: name -> (N, T) token ids.
        batch_size: windows per forward pass (memory only).
    Returns:
        name -> the numbers of each window, in order.
    Raises:
        InvariantError: ``lm``'s logits are not its LM head's linear map of its final hidden state.
    """
    head = head_weight(lm)
    head_key = weight_key(head)
    seen: list[torch.Tensor] = []

    def keep(module: nn.Module, args: tuple[torch.Tensor, ...], output: torch.Tensor) -> None:
        seen[:] = [args[0], output]

    handle = lm.adapter.lm_head(lm.model).register_forward_hook(keep)
    try:
        return {
            name: _numbers(lm, dense_windows(dense, windows, head, batch_size, head_key), windows, batch_size, seen)
            for name, windows in window_sets.items()
        }
    finally:
        handle.remove()


def _numbers(lm: LoadedModel, reference: DenseWindows, windows: torch.Tensor, batch_size: int, seen: list[torch.Tensor]) -> WindowNumbers:
    start = text_start(lm.tokenizer, windows)
    nll, kl, top1 = [], [], []
    first = 0
    for batch in batches(windows, batch_size):
        logits = lm.model(input_ids=batch, use_cache=False).logits  # (B, T, V)
        hidden, head_out = seen
        # Whether anything acts on the logits after the head is the model's code, the same for
        # every batch: checked once per set (a full comparison costs a pass over the logits).
        if first == 0 and (head_out.shape != logits.shape or not torch.equal(head_out, logits)):
            raise InvariantError(f"{lm.name}: its logits are not its LM head's output; per-window KL needs logits = W h")
        logits = logits[:, start:-1].float()  # (B, P, V)
        rows = slice(first, first + batch.shape[0])
        first += batch.shape[0]
        lse = torch.logsumexp(logits, -1)  # (B, P)
        targets = batch[:, start + 1 :]
        nll.append((lse - logits.gather(-1, targets[..., None])[..., 0]).double().mean(-1))
        cross = (hidden[:, start:-1].double().cpu() * torch.from_numpy(reference.expected[rows])).sum(-1)  # (B, P): h . W^T p_d
        kl.append((torch.from_numpy(reference.neg_entropy[rows]) - cross + lse.double().cpu()).mean(-1))
        agree = logits.argmax(-1).cpu() == torch.from_numpy(reference.top1[rows])
        top1.append(agree.double().mean(-1))
    return WindowNumbers(torch.cat(nll).tolist(), torch.cat(kl).tolist(), torch.cat(top1).tolist())
