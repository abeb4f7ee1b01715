"""The handle every stage passes around: a loaded causal LM with its tokenizer, family
adapter, weights fingerprint and placement.

It lives apart from ``loading`` (which builds one) so that the modules ``loading`` itself
uses (checkpoint, units, layerwise, the plan file) can name the type they are given.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from gap_engine.core.device import Placement
from gap_engine.core.errors import SharedModelError
from gap_engine.core.fingerprint import state_fingerprint
from gap_engine.data.bos import Tokenizer
from gap_engine.model.adapters import ArchitectureAdapter, adapter_for


@dataclass
class LoadedModel:
    """A model ready for the pipeline: eval mode, with its tokenizer, adapter and placement."""

    name: str  # what the user asked for (built-in name, path or hub id)
    model: nn.Module  # a transformers *ForCausalLM (typed as a Module: transformers types PreTrainedModel.to badly)
    tokenizer: Tokenizer  # its tokenizer
    adapter: ArchitectureAdapter  # family-specific names
    fingerprint: str  # hash of the weights as loaded; plans and tables are keyed by it
    source: str  # where the weights were read from
    pruned_from: dict[str, Any] | None = None  # for a gap checkpoint: its base model and plan
    extras: dict[str, Any] = field(default_factory=dict)
    placement: Placement | None = None  # device, dtype, streaming; None: as built (CPU float32)
    device_map: dict[str, str | int] | None = None  # module -> device when accelerate dispatched it (model.dispatch)
    shared: bool = False  # several threads run it at once (the explorer's pool): never hooked, masked or pruned in place

    @property
    def num_layers(self) -> int:
        return len(self.adapter.layers(self.model))

    def param_count(self) -> int:
        """Unique parameters (tied embeddings counted once)."""
        return sum(p.numel() for p in {id(p): p for p in self.model.parameters()}.values())

    def size_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in {id(p): p for p in self.model.parameters()}.values())

    @classmethod
    def from_transformers(
        cls, model: nn.Module, tokenizer: Tokenizer, name: str, source: str, pruned_from: dict[str, Any] | None = None
    ) -> LoadedModel:
        """Wrap a transformers *ForCausalLM and its tokenizer: eval mode, no gradients, a pad
        token, the family adapter and the weights fingerprint.

        Raises:
            UnsupportedArchitectureError: a model family without an adapter.
        """
        adapter = adapter_for(model)
        model.eval()
        for p in model.parameters():
            p.requires_grad_(False)
        if tokenizer.pad_token_id is None and tokenizer.eos_token_id is not None:
            tokenizer.pad_token = tokenizer.eos_token
        return cls(
            name=name,
            model=model,
            tokenizer=tokenizer,
            adapter=adapter,
            fingerprint=weights_fingerprint(model),
            source=source,
            pruned_from=pruned_from,
        )

    def refresh_fingerprint(self) -> None:
        """Recompute the fingerprint after the weights changed (surgery, recovery)."""
        self.fingerprint = weights_fingerprint(self.model)

    def copy(self) -> LoadedModel:
        """A LoadedModel with its own copy of the weights (safe to hook, mask or prune), same tokenizer."""
        out = copy.copy(self)
        out.model = copy.deepcopy(self.model)
        out.extras = dict(self.extras)
        out.shared = False
        return out

    def private(self) -> LoadedModel:
        """This model, or a copy when it is ``shared``: what an engine operation that hooks or
        masks the weights works on, so a model other threads run is never changed under them."""
        return self.copy() if self.shared else self

    def refuse_shared(self, operation: str) -> None:
        """SharedModelError when this model is ``shared``: ``operation`` would change it in place."""
        if self.shared:
            raise SharedModelError(f"{operation} would change {self.name} in place, and other threads run it; use a private() copy")


def weights_fingerprint(model: nn.Module) -> str:
    """A stable hash of the weights (``fingerprint.state_fingerprint`` of the state dict)."""
    return state_fingerprint(model.state_dict())
