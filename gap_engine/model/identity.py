"""A model's identity as its last load found it, read back without loading it.

What a loss table's cache key needs of a model (``tables.artefact.key_for``) is known only
once its weights are read: the fingerprint of its weights, config and tokenizer
(``loaded.model_fingerprint``), the number of blocks, and whether its
windows start with a BOS token (the tokenizer's). ``loading.load_model`` records these
against the stamps of every file of the model's folder (``core.filestamps``): a built-in's
converted copy under ``cache/models/<name>/``, a local folder (plain or a gap checkpoint), or
a ``.gguf`` file. The cache's no-load lookup (``tables.lookup``) reads them back while no
file has changed; a rewritten, added or removed file is a miss, and the next load records
again. Hub ids have no folder of their own to stamp here: they are only known once loaded.
Loading itself reads the fingerprint back the same way, so unchanged files are hashed once.

torch-free, like everything the no-load lookup imports.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from gap_engine.core.errors import CacheError
from gap_engine.core.filestamps import Stamps, recall, remember, stamp_files
from gap_engine.core.fingerprint import FINGERPRINT_FORMAT
from gap_engine.core.fsutil import cache_root
from gap_engine.data.bos import WINDOW_STARTS

BUILTIN_MODEL_NAMES = ("smollm2-135m", "gemma3-270m")  # loading.BUILTIN_MODELS, named without importing torch
# their config.model_type, known before the first load converts them (a test checks it against the loaded configs)
BUILTIN_MODEL_TYPES = {"smollm2-135m": "llama", "gemma3-270m": "gemma3_text"}
_KIND = "model"


@dataclass(frozen=True)
class ModelIdentity:
    """What a table's key and its identity checks read of a model."""

    fingerprint: str  # of the weights, config and tokenizer (``loaded.model_fingerprint``)
    num_layers: int  # decoder blocks
    window_start: str  # "bos" or "text" (``data.bos.window_start`` of its tokenizer)
    attention_ties: bool  # two GQA shapes of a block have one size (``units.BlockCounts.has_attention_ties``)

    def to_dict(self) -> dict[str, object]:
        return {
            "fingerprint": self.fingerprint,
            "num_layers": self.num_layers,
            "window_start": self.window_start,
            "attention_ties": self.attention_ties,
            "fingerprint_format": FINGERPRINT_FORMAT,
        }


def model_may_load(name_or_path: str) -> bool:
    """False for a local model (a path) that is gone, a table's model of a deleted folder; a
    built-in or a hub id may load (whether the hub is reachable is the loader's to say)."""
    if name_or_path in BUILTIN_MODEL_NAMES:
        return True
    path = Path(name_or_path).expanduser()
    looks_local = path.is_absolute() or name_or_path.startswith((".", "~")) or name_or_path.count("/") != 1
    return path.exists() or not looks_local


def builtin_folder(name: str) -> Path:
    """Where a built-in model's converted copy lives."""
    return cache_root() / "models" / name


def model_files(name_or_path: str) -> tuple[str, list[Path]] | None:
    """(subject, files) a model loads from: every visible regular file of its folder, or its
    ``.gguf`` file; None for a hub id, a built-in not converted yet, or nothing here."""
    name = str(name_or_path)
    try:
        if name in BUILTIN_MODEL_NAMES:
            folder = builtin_folder(name)
        else:
            path = Path(name).expanduser()
            if path.suffix == ".gguf" and path.is_file():
                return str(path.resolve()), [path.resolve()]
            folder = path.resolve()
        if not folder.is_dir():
            return None
        files = sorted(p for p in folder.iterdir() if not p.name.startswith(".") and p.is_file())
    except (CacheError, OSError, RuntimeError):  # an unusable cache root, an unreadable folder, a link loop
        return None
    return (str(folder), files) if files else None


def model_stamps(name_or_path: str) -> tuple[str, Stamps | None] | None:
    """(subject, stamps of its files) of a model; None where `model_files` finds none."""
    found = model_files(name_or_path)
    return None if found is None else (found[0], stamp_files(found[1]))


def recorded_model(name_or_path: str) -> ModelIdentity | None:
    """The identity the last load of ``name_or_path`` recorded, if none of its files changed since."""
    stamped = model_stamps(name_or_path)
    value = None if stamped is None else recall(_KIND, *stamped)
    if value is None:
        return None
    fingerprint, layers, start = value.get("fingerprint"), value.get("num_layers"), value.get("window_start")
    ties = value.get("attention_ties")  # absent in records made before ties were keyed: a miss
    if not isinstance(fingerprint, str) or isinstance(layers, bool) or not isinstance(layers, int) or start not in WINDOW_STARTS:
        return None
    if not isinstance(ties, bool) or value.get("fingerprint_format") != FINGERPRINT_FORMAT:
        return None  # recorded before content fingerprints: a sample of the weights is no identity
    return ModelIdentity(fingerprint, layers, start, ties)


def record_model(stamped: tuple[str, Stamps | None] | None, identity: ModelIdentity) -> None:
    """Record what a load found, under the stamps `model_stamps` took before the weights were read."""
    if stamped is not None:
        remember(_KIND, stamped[0], stamped[1], identity.to_dict())


def model_type_of(name_or_path: str) -> str | None:
    """A model's ``config.model_type`` read from its folder's config.json (a built-in's known type before
    its first load), without loading it; None for a hub id, a ``.gguf`` file or an unreadable config."""
    found = model_files(name_or_path)
    config = None if found is None else next((path for path in found[1] if path.name == "config.json"), None)
    if config is not None:
        try:
            model_type = json.loads(config.read_text()).get("model_type")
        except (OSError, ValueError, AttributeError):
            model_type = None
        if isinstance(model_type, str):
            return model_type
    return BUILTIN_MODEL_TYPES.get(str(name_or_path))
