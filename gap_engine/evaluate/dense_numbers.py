"""The dense model's held-out numbers, measured once per (model, text, windows) and reused.

Prune & evaluate and Recover each measure the dense model beside the model they evaluate.
Left to themselves they give the same quantity two values (a dense perplexity of 29.06 on one
page and 30.118 on the other) whenever anything about the measurement differs: the batch, the
dtype the reference was loaded in, the order of a float sum. A reader cannot tell which to
believe. The first measurement of a dense model on given windows is therefore stored, keyed by
the dense weights' fingerprint and a hash of the exact token windows (so the text, the window
count and length, the seed and the BOS choice are all in the key), and every later evaluation
of that dense model on those windows reports the stored value. The dtype the dense model runs in
is part of the key: float32 and bfloat16 passes over the same weights are two measurements, and
a bf16 run must not be compared with a float32 dense number.

The dense model's full next-token log-probabilities on held-out windows (what a KL to dense is
measured against, hundreds of MB per text) are kept the same way, under the same key: one file
per model fingerprint, exact token windows and dtype (:func:`dense_logprobs`).
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from gap_engine.core.device import placement_of
from gap_engine.core.errors import CacheError, InvariantError
from gap_engine.core.fsutil import atomic_write_json, cache_root
from gap_engine.data.bos import text_start
from gap_engine.model.layerwise import logits_batches
from gap_engine.model.loaded import LoadedModel

log = logging.getLogger(__name__)


def dense_key(fingerprint: str, windows: torch.Tensor, dtype: str = "") -> str:
    """The cache key of a dense model's numbers on ``windows`` (token ids, (N, T)) in ``dtype``."""
    digest = hashlib.sha256()
    digest.update(fingerprint.encode())
    digest.update(dtype.encode())
    digest.update(str(tuple(windows.shape)).encode())
    digest.update(windows.detach().to("cpu", torch.int64).contiguous().numpy().tobytes())
    return digest.hexdigest()[:32]


def dense_perplexity(fingerprint: str, windows: torch.Tensor, measured: float, dtype: str = "") -> float:
    """The stored dense perplexity on ``windows``; else ``measured``, stored and returned.

    Args:
        fingerprint: the dense weights' fingerprint (``LoadedModel.fingerprint``; a bf16 checkpoint
            and its float32 upcast share one, hence ``dtype``).
        windows: the held-out token windows the perplexity is over.
        measured: this evaluation's own measurement (used, and kept, only when none is stored; the
            dense logits are computed anyway for the KL, so measuring costs nothing extra).
        dtype: the dtype the dense model ran in ("float32", "bfloat16", ...).
    """
    path = cache_root() / "dense" / f"{dense_key(fingerprint, windows, dtype)}.json"
    try:
        stored = json.loads(path.read_text(encoding="utf-8"))
        value = float(stored["perplexity"])
        if value > 0:
            return value
    except (OSError, ValueError, TypeError, KeyError):
        pass  # not measured yet (or an unreadable entry: measured again and rewritten)
    value = float(measured)
    try:
        atomic_write_json(path, {"perplexity": value, "windows": list(windows.shape)})
    except (OSError, CacheError) as exc:  # a read-only cache: the number is still right, just not shared
        log.warning("could not store the dense perplexity: %s", exc)
    return value


def dense_logprobs_path(fingerprint: str, windows: torch.Tensor, dtype: str) -> Path:
    """Where the dense log-probabilities of ``windows`` are kept: keyed like the dense perplexity,
    by the weights' fingerprint, the exact token windows (text, seed, count, length and BOS rule
    all change them) and the dtype the dense model ran in."""
    return cache_root() / "dense" / "logprobs" / f"{dense_key(fingerprint, windows, dtype)}.npy"


def dense_logprobs(lm: LoadedModel, windows: torch.Tensor, batch_size: int) -> np.ndarray:
    """The dense model's next-token log-probabilities on ``windows`` at the counted positions,
    computed once per (weights, windows, dtype) and kept on disk (memory-mapped when read).

    Args:
        lm: the dense model (its ``fingerprint`` and the dtype it runs in are the key's model part).
        windows: (N, T) held-out token ids.
        batch_size: windows per forward pass (memory only).
    Returns:
        (N, T-1-start, V) float32, ``start`` the windows' leading non-text positions
        (``data.bos.text_start``): position ``t`` is the distribution of token ``start + t + 1``.
    """
    dtype = str(placement_of(lm).dtype).removeprefix("torch.")
    path = dense_logprobs_path(lm.fingerprint, windows, dtype)
    if not path.exists():
        _write_logprobs(lm, windows, batch_size, path)
    stored: np.ndarray = np.load(path, mmap_mode="r")
    return stored


def _write_logprobs(lm: LoadedModel, windows: torch.Tensor, batch_size: int, path: Path) -> None:
    """Compute the log-probabilities into a temporary file, then rename it to ``path``."""
    start = text_start(lm.tokenizer, windows)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.stem + ".partial.npy")
    out: np.memmap | None = None
    done = 0
    with torch.inference_mode():
        for batch, logits in logits_batches(lm, windows, batch_size):
            logp = F.log_softmax(logits[:, start:-1].float(), -1)  # (B, T-1-start, V)
            if out is None:
                shape = (windows.shape[0], logp.shape[1], logp.shape[2])
                out = np.lib.format.open_memmap(partial, mode="w+", dtype=np.float32, shape=shape)
            out[done : done + batch.shape[0]] = logp.cpu().numpy()
            done += batch.shape[0]
    if out is None:
        raise InvariantError("no windows to compute dense log-probabilities on")
    out.flush()
    del out
    partial.rename(path)
