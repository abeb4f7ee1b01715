"""The weights fingerprint: plans, tables and checkpoints are keyed by it.

It sits below ``model.checkpoint`` and ``model.loading`` because both compute it: loading for
every model it loads, the checkpoint for the weights as a folder stores them (see
``model.storage.stored_fingerprint``).
"""

from __future__ import annotations

import hashlib

import torch


def state_fingerprint(state: dict[str, torch.Tensor]) -> str:
    """A stable hash of a state dict: names, shapes and a strided sample of every tensor.

    Hashing all 500 MB of a model's bytes costs seconds; a sample of ~4k values per tensor plus
    its shape tells any two real checkpoints apart and takes milliseconds. Floating tensors are
    hashed as their float32 values, so a bf16 checkpoint read in bf16 or upcast to float32 has
    one fingerprint (and every float32 fingerprint is what it always was).

    Args:
        state: tensor name -> tensor (a module's ``state_dict()``).
    Returns:
        16 hex digits.
    """
    digest = hashlib.sha256()
    for name, tensor in sorted(state.items()):
        flat = tensor.detach().reshape(-1)
        stride = max(1, flat.numel() // 4096)
        sample = flat[::stride].to(device="cpu", dtype=torch.float32).contiguous()
        kind = torch.float32 if tensor.is_floating_point() else tensor.dtype
        digest.update(f"{name}:{tuple(tensor.shape)}:{kind}".encode())
        digest.update(sample.numpy().tobytes())
    return digest.hexdigest()[:16]
