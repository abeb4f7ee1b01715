"""The weights fingerprint: plans, tables and checkpoints are keyed by it.

It sits below ``checkpoint`` and ``models`` because both compute it: ``models`` for every
model it loads, ``checkpoint`` for the weights as a folder stores them (see
``deploy.dtypes.stored_fingerprint``).
"""

from __future__ import annotations

import hashlib

import torch


def state_fingerprint(state: dict[str, torch.Tensor]) -> str:
    """A stable hash of a state dict: names, shapes, dtypes and a strided sample of every tensor.

    Hashing all 500 MB of a model's bytes costs seconds; a sample of ~4k values per tensor plus
    its shape tells any two real checkpoints apart and takes milliseconds.

    Args:
        state: tensor name -> tensor (a module's ``state_dict()``).
    Returns:
        16 hex digits.
    """
    digest = hashlib.sha256()
    for name, tensor in sorted(state.items()):
        flat = tensor.detach().reshape(-1)
        stride = max(1, flat.numel() // 4096)
        sample = flat[::stride].to(torch.float32).contiguous()
        digest.update(f"{name}:{tuple(tensor.shape)}:{tensor.dtype}".encode())
        digest.update(sample.numpy().tobytes())
    return digest.hexdigest()[:16]
