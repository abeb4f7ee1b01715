"""The dense model's held-out numbers, measured once per (model, text, windows) and reused.

Prune & evaluate and Recover each measure the dense model beside the model they evaluate.
Left to themselves they give the same quantity two values (issue 22: dense perplexity 29.06 on
one page, 30.118 on the other) whenever anything about the measurement differs: the batch, the
dtype the reference was loaded in, the order of a float sum. A reader cannot tell which to
believe. The first measurement of a dense model on given windows is therefore stored, keyed by
the dense weights' fingerprint and a hash of the exact token windows (so the text, the window
count and length, the seed and the BOS choice are all in the key), and every later evaluation
of that dense model on those windows reports the stored value. The dtype the dense model runs in
is part of the key: float32 and bfloat16 passes over the same weights are two measurements, and
a bf16 run must not be compared with a float32 dense number.
"""

from __future__ import annotations

import hashlib
import json
import logging

import torch

from gap_engine.core.errors import CacheError
from gap_engine.core.fsutil import atomic_write_json, cache_root

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
