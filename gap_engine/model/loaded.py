"""The handle every stage passes around: a loaded causal LM with its tokenizer, family
adapter, content fingerprint and placement.

It lives apart from ``loading`` (which builds one) so that the modules ``loading`` itself
uses (checkpoint, units, layerwise, the plan file) can name the type they are given.
"""

from __future__ import annotations

import copy
import json
import weakref
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from gap_engine.core.device import Placement
from gap_engine.core.errors import SharedModelError
from gap_engine.core.fingerprint import combined_fingerprint, json_digest, state_fingerprint
from gap_engine.data.bos import Tokenizer
from gap_engine.model.adapters import ArchitectureAdapter, adapter_for
from gap_engine.model.finite import check_model_finite


@dataclass
class LoadedModel:
    """A model ready for the pipeline: eval mode, with its tokenizer, adapter and placement."""

    name: str  # what the user asked for (built-in name, path or hub id)
    model: nn.Module  # a transformers *ForCausalLM (typed as a Module: transformers types PreTrainedModel.to badly)
    tokenizer: Tokenizer  # its tokenizer
    adapter: ArchitectureAdapter  # family-specific names
    fingerprint: str  # hash of the weights, config and tokenizer as loaded (`model_fingerprint`); plans and tables are keyed by it
    source: str  # where the weights were read from
    pruned_from: dict[str, Any] | None = None  # for a gap checkpoint: its base model and plan
    extras: dict[str, Any] = field(default_factory=dict)
    placement: Placement | None = None  # device, dtype, streaming; None: as built (CPU float32)
    device_map: dict[str, str | int] | None = None  # module -> device when accelerate dispatched it (model.dispatch)
    shared: bool = False  # several threads run it at once (the explorer's pool): never hooked, masked or pruned in place

    @property
    def num_layers(self) -> int:
        return len(self.adapter.layers(self.model))

    @property
    def model_type(self) -> str | None:
        """Its ``config.model_type`` (the family facts are keyed by it: ``adapters.model_type_facts``)."""
        found = getattr(getattr(self.model, "config", None), "model_type", None)
        return found if isinstance(found, str) else None

    def param_count(self) -> int:
        """Unique parameters (tied embeddings counted once)."""
        return sum(p.numel() for p in {id(p): p for p in self.model.parameters()}.values())

    def size_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in {id(p): p for p in self.model.parameters()}.values())

    @classmethod
    def from_transformers(
        cls,
        model: nn.Module,
        tokenizer: Tokenizer,
        name: str,
        source: str,
        pruned_from: dict[str, Any] | None = None,
        fingerprint: str | None = None,
    ) -> LoadedModel:
        """Wrap a transformers *ForCausalLM and its tokenizer: eval mode, no gradients, a pad
        token, the family adapter and the content fingerprint.

        Args:
            fingerprint: the `model_fingerprint` these files were found to have by an earlier
                load, while none of them changed (``model.identity``); None computes it.

        Raises:
            UnsupportedArchitectureError: a model family without an adapter.
            ModelLoadError: weights that hold a non-finite value, or a normalisation epsilon
                that is not a small positive number (``finite.check_model_finite``).
        """
        adapter = adapter_for(model)
        check_model_finite(model, name)  # one NaN weight would make every measurement NaN
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
            fingerprint=fingerprint or model_fingerprint(model, tokenizer),
            source=source,
            pruned_from=pruned_from,
        )

    def refresh_fingerprint(self) -> None:
        """Recompute the fingerprint after the weights changed (surgery, recovery)."""
        self.fingerprint = model_fingerprint(self.model, self.tokenizer)

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
    """A hash of every weight value (``fingerprint.state_fingerprint`` of the state dict)."""
    return state_fingerprint(model.state_dict())


def model_fingerprint(model: nn.Module, tokenizer: Tokenizer) -> str:
    """What plans, tables and caches call this model: its weights, config and tokenizer in one hash."""
    return combined_fingerprint(weights_fingerprint(model), config_digest(model.config), tokenizer_digest(tokenizer))


# Config entries that do not change what the model computes: where it was read from, the library
# version, the dtype it was stored in (values are hashed as float32), generation and output
# switches, labels, and the entries a gap checkpoint adds (its widths are the tensors' shapes).
_CONFIG_NOT_FUNCTION = frozenset(
    {
        "transformers_version",
        "dtype",
        "torch_dtype",
        "architectures",
        "auto_map",
        "use_cache",
        "output_attentions",
        "output_hidden_states",
        "return_dict",
        "id2label",
        "label2id",
        "problem_type",
        "initializer_range",
        "chunk_size_feed_forward",
        "tokenizer_class",
        "pad_token_id",
        "per_layer_config",
        "allow_global_per_layer_attribute_access",
        "gap_output_bias",
    }
)


def config_digest(config: Any) -> str:
    """sha256 of a transformers config as its forward pass reads it: ``to_dict()`` without
    private entries (``_name_or_path``, ...) and ``_CONFIG_NOT_FUNCTION``. Round-trips through
    ``save_pretrained`` and a GGUF conversion; any change of ``rms_norm_eps``, ``hidden_act``,
    ``rope_parameters``, ... changes it."""
    values = config.to_dict() if hasattr(config, "to_dict") else dict(config)
    return json_digest({k: v for k, v in values.items() if not k.startswith("_") and k not in _CONFIG_NOT_FUNCTION})


_TOKENIZER_DIGESTS: weakref.WeakKeyDictionary[Any, tuple[int, str]] = weakref.WeakKeyDictionary()


def tokenizer_digest(tokenizer: Tokenizer) -> str:
    """sha256 of what a tokenizer turns text into: its whole pipeline (normalizer, pre-tokenizer,
    model with vocabulary and merges, post-processor, added tokens; not the padding and
    truncation switches a call sets) and its special tokens. The python-side ``add_bos_token`` of a
    fast tokenizer is not read: a Gemma tokenizer converted from GGUF says True and the same one
    read back from its folder False, and both add the BOS their post-processor adds. Remembered per
    tokenizer object and vocabulary size (reading the pipeline of a 49k vocabulary costs ~30 ms)."""
    if tokenizer is None:  # a bare model (a Ray worker's): the tokenizer stays with the caller
        return "none"
    size = len(tokenizer)
    try:
        cached = _TOKENIZER_DIGESTS.get(tokenizer)
    except TypeError:  # not weak-referenceable: computed each time
        cached = None
    if cached is not None and cached[0] == size:
        return cached[1]
    backend = getattr(tokenizer, "backend_tokenizer", None)
    switches: tuple[str, ...] = ()
    if backend is not None:  # its post-processor says whether BOS/EOS are added
        pipeline: Any = json.loads(backend.to_str())
        pipeline.pop("truncation", None)
        pipeline.pop("padding", None)
    else:  # a slow (python) tokenizer: its vocabulary, and its own BOS/EOS switches
        pipeline = sorted(tokenizer.get_vocab().items())
        switches = ("add_bos_token", "add_eos_token")
    specials = {name: str(getattr(tokenizer, name, None)) for name in ("bos_token", "eos_token", "unk_token", *switches)}
    value = json_digest({"pipeline": pipeline, "specials": specials})
    try:
        _TOKENIZER_DIGESTS[tokenizer] = (size, value)
    except TypeError:
        pass
    return value
