"""LoRA recovery through ``peft``: adapters on the pruned projections, one AdamW step, merging.

LoRA (Hu et al. 2022) learns a low-rank update ``(α / r) · B A`` beside each frozen projection;
after structured pruning it is the usual recovery step (LLM-Pruner, Ma et al. 2023). ``peft``
builds each adapter from the layer it wraps, so projections pruned to different widths in
different blocks get adapters of their own shapes. For the saved checkpoint the adapters are
merged into the weights (the result is an ordinary pruned checkpoint); the unmerged adapter is
saved beside it in peft's own format.

Every random draw of a step (LoRA dropout) comes from a generator seeded by the step, inside
``torch.random.fork_rng`` so the process's global generator is left alone; with the optimizer
state saved, a resumed run continues exactly where an uninterrupted one would be.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:
    from peft import PeftModel

log = logging.getLogger(__name__)


def attach(model: nn.Module, target_names: list[str], rank: int, alpha: float, dropout: float, seed: int) -> PeftModel:
    """Wrap ``model`` (in place) with LoRA adapters on every module named in ``target_names``.

    Args:
        model: a transformers causal LM with frozen weights.
        target_names: module names (the last path component), e.g. ["q_proj", "down_proj"].
        rank, alpha, dropout: LoRA's r, lora_alpha and lora_dropout.
        seed: seeds the adapters' initialisation (A random, B zero), so runs repeat.
    Returns:
        The peft model; its only trainable parameters are the adapters.
    """
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(
        r=rank,
        lora_alpha=alpha,  # type: ignore[arg-type]  # peft declares int, but scales by alpha / r: a fractional alpha is valid
        lora_dropout=dropout,
        target_modules=list(target_names),
        bias="none",
        task_type="CAUSAL_LM",
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        peft_model = get_peft_model(model, config)
    peft_model.eval()
    return peft_model


def trainable(peft_model: PeftModel) -> list[torch.nn.Parameter]:
    return [p for p in peft_model.parameters() if p.requires_grad]


def make_optimizer(peft_model: PeftModel, lr: float) -> torch.optim.Optimizer:
    """AdamW on the adapters (no weight decay: the run is short and B starts at zero)."""
    return torch.optim.AdamW(trainable(peft_model), lr=lr, betas=(0.9, 0.999), weight_decay=0.0)


def train_step(
    peft_model: PeftModel,
    optimizer: torch.optim.Optimizer,
    loss_fn: Callable[[], torch.Tensor],
    lr: float,
    seed_of_step: int,
    grad_clip: float,
) -> float:
    """One AdamW step at learning rate ``lr``; returns the loss before the update.

    Args:
        loss_fn: runs the forward pass and returns the scalar loss (with its graph).
        seed_of_step: seeds the dropout masks of this step.
        grad_clip: clip the adapters' global gradient norm to this (0: no clipping).
    """
    device = next(peft_model.parameters()).device
    for group in optimizer.param_groups:
        group["lr"] = lr
    devices = [device] if device.type == "cuda" else []
    peft_model.train()
    try:
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(seed_of_step)
            loss = loss_fn()
            loss.backward()
        if grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(trainable(peft_model), grad_clip)
        optimizer.step()
    finally:
        optimizer.zero_grad(set_to_none=True)
        peft_model.eval()
    return float(loss.detach())


def adapter_tensors(peft_model: PeftModel) -> dict[str, torch.Tensor]:
    """The adapters' weights (peft's own state-dict names), copied to the CPU."""
    from peft import get_peft_model_state_dict

    # Embeddings are never adapted here; "auto" would read the base model's config.json, which
    # transformers cannot parse for a checkpoint with per-layer widths.
    state = get_peft_model_state_dict(peft_model, save_embedding_layers=False)
    return {name: t.detach().to("cpu").clone() for name, t in state.items()}


def load_adapter_tensors(peft_model: PeftModel, tensors: dict[str, torch.Tensor]) -> None:
    """Put weights saved by :func:`adapter_tensors` back (every adapter must be matched)."""
    from peft import set_peft_model_state_dict

    result: Any = set_peft_model_state_dict(peft_model, tensors)  # torch's load_state_dict result (missing_keys, unexpected_keys)
    missing = [k for k in result.missing_keys if "lora_" in k]
    if missing or result.unexpected_keys:
        raise ValueError(f"saved adapters do not fit the model: missing {missing[:3]}, unexpected {result.unexpected_keys[:3]}")


def save_adapter(peft_model: PeftModel, folder: str | Path) -> None:
    """The unmerged adapter in peft's format (``PeftModel.from_pretrained`` reads it)."""
    peft_model.save_pretrained(str(folder), save_embedding_layers=False)


def merge(peft_model: PeftModel) -> nn.Module:
    """Fold every adapter into its projection and return the plain transformers model."""
    merged: nn.Module = peft_model.merge_and_unload()
    return merged
