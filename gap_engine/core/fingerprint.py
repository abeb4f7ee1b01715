"""Content fingerprints: what plans, tables, checkpoints and every cache key call a model.

A model is identified by *everything* that decides what it computes: every value of every
tensor, the configuration fields that shape the forward pass, and the tokenizer that turns
text into its inputs. A sample of each tensor is not enough: an edit in place (a fine-tune,
a patch that scales every other value of a matrix) leaves a strided sample unchanged, and a
cache keyed by it would serve a table measured on other weights.

It sits below ``model.checkpoint`` and ``model.loading`` because both compute it: loading for
every model it loads, the checkpoint for the weights as a folder stores them (see
``model.storage.stored_fingerprint``). Hashing every byte costs about half a second for a
135M-parameter model on two cores (``bench/results/tables.md``); ``model.identity`` remembers
the result against the files' stamps, so a model loaded again unchanged is not hashed again.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch is imported where tensors are hashed: the no-load lookup reads FINGERPRINT_FORMAT without it
    import torch

FINGERPRINT_FORMAT = 2  # 1: a strided sample of ~4k values per tensor (checkpoints before content identities)
_HASH_THREADS = 4  # sha256 releases the GIL on large buffers: tensors hash side by side on every core


def _tensor_digest(tensor: torch.Tensor) -> bytes:
    """sha256 of every value: floating tensors as float32 (a bf16 model read in bf16 or upcast
    has one fingerprint), others as stored."""
    import torch

    values = tensor.detach().to(device="cpu", dtype=torch.float32 if tensor.is_floating_point() else tensor.dtype)
    array = values.contiguous().reshape(-1).numpy()
    return hashlib.sha256(array.view("uint8").data).digest()  # the bytes in place, no copy


def _storage_key(tensor: torch.Tensor) -> tuple[object, ...] | None:
    """Same memory and same view (tied embeddings): hashed once. None for a meta or empty tensor."""
    if tensor.device.type == "meta" or not tensor.numel():
        return None
    return (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape), tensor.stride(), tensor.dtype)


def state_fingerprint(state: Mapping[str, torch.Tensor]) -> str:
    """A hash of a state dict: every tensor's name, shape, kind and every value.

    Args:
        state: tensor name -> tensor (a module's ``state_dict()``).
    Returns:
        16 hex digits.
    """
    import torch

    names = sorted(state)
    unique: dict[tuple[object, ...], torch.Tensor] = {}
    keys: list[tuple[object, ...] | None] = []
    for name in names:
        key = _storage_key(state[name])
        keys.append(key)
        if key is not None:
            unique.setdefault(key, state[name])
    threads = max(1, min(_HASH_THREADS, os.cpu_count() or 1, len(unique)))
    with ThreadPoolExecutor(max_workers=threads) as pool:
        digests = dict(zip(unique, pool.map(_tensor_digest, unique.values())))
    digest = hashlib.sha256()
    for name, key in zip(names, keys):
        tensor = state[name]
        kind = torch.float32 if tensor.is_floating_point() else tensor.dtype
        digest.update(f"{name}:{tuple(tensor.shape)}:{kind}".encode())
        digest.update(digests[key] if key is not None else _tensor_digest(tensor))
    return digest.hexdigest()[:16]


def sampled_state_fingerprint(state: Mapping[str, torch.Tensor]) -> str:
    """The fingerprint checkpoints recorded before content identities (format 1): names, shapes
    and a strided sample of ~4k values per tensor. Only read to verify such an old checkpoint."""
    import torch

    digest = hashlib.sha256()
    for name, tensor in sorted(state.items()):
        flat = tensor.detach().reshape(-1)
        stride = max(1, flat.numel() // 4096)
        sample = flat[::stride].to(device="cpu", dtype=torch.float32).contiguous()
        kind = torch.float32 if tensor.is_floating_point() else tensor.dtype
        digest.update(f"{name}:{tuple(tensor.shape)}:{kind}".encode())
        digest.update(sample.numpy().tobytes())
    return digest.hexdigest()[:16]


def json_digest(value: Any) -> str:
    """sha256 (hex) of a JSON value written canonically (sorted keys, no spaces)."""
    text = json.dumps(value, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def combined_fingerprint(weights: str, config_digest: str, tokenizer_digest: str) -> str:
    """A model's identity: its weights' fingerprint, its configuration's and its tokenizer's, in one 16-hex hash."""
    digest = hashlib.sha256(f"gap-model-identity-{FINGERPRINT_FORMAT}\0{weights}\0{config_digest}\0{tokenizer_digest}".encode())
    return digest.hexdigest()[:16]
