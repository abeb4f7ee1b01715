"""A cached loss table found before anything is loaded: no model, no tokenizer, no text.

A table's cache key (``artefact.key_for``) is made of the model's weights fingerprint and
window start, the compute dtype, the text's content hash and the settings. Loading the model
and reading the text to compute it took 15-30 s for a table that was already cached. Here the
key comes from what the last load and the last read recorded against the stamps of their
files (``model.identity``, ``data.sources``): while those files are unchanged, the table is
found in milliseconds; any change to them, or a model or text never loaded here, is a miss,
and the caller takes the ordinary path (load, read, ``pipeline.stages.loss_table``), which
records them for next time.

A hit passes the cache's own checks (``cache.get_table``: meta.json, checksum, a well-formed
table under its key), and then must be the table those inputs would give: the model
fingerprint, block count, window start, text hash and settings the entry records are the
ones recorded for the inputs, so an entry put under this key for another model is not served.
torch is not imported on this path where the dtype can be told without it (the CPU).
"""

from __future__ import annotations

import logging

from gap_engine.core.device import DeviceSpec, dtype_name, dtype_without_torch, resolve
from gap_engine.data.sources import recorded_fingerprint
from gap_engine.model.identity import ModelIdentity, recorded_model
from gap_engine.model.names import recorded_name
from gap_engine.tables.artefact import LossTable, TableSpec, key_for
from gap_engine.tables.cache import get_table, lock

log = logging.getLogger(__name__)


def compute_dtype(device: DeviceSpec | None) -> str:
    """The dtype name a model would compute in on ``device`` (torch only when the CPU alone cannot tell)."""
    return dtype_without_torch(device) or dtype_name(resolve(device).dtype)


def find_table(model: str, spec: TableSpec, device: DeviceSpec | None = None) -> LossTable | None:
    """The table `pipeline.stages.loss_table` would read from the cache for ``model`` loaded on
    ``device`` under ``spec``, found without loading the model or reading the text.

    Args:
        model: what ``load_model`` would be given (a built-in name, a folder, a .gguf file).
        spec: the table's settings (validated here).
        device: where the model would run (None: CPU float32); its dtype is part of the key.
    Returns:
        The cached table, or None: not cached, or the model or text not known unchanged here.
    Raises:
        TableError: a bad spec. DeviceError: a device this machine lacks (as loading would).
    """
    spec.validate()
    identity = recorded_model(model)
    if identity is None:
        return None
    data_fingerprint = recorded_fingerprint(spec.windows.data)
    if data_fingerprint is None:
        return None
    key = key_for(
        recorded_name(model),
        identity.fingerprint,
        identity.window_start,
        compute_dtype(device),
        spec,
        data_fingerprint,
        identity.attention_ties,
    )
    with lock(key):  # a build of this key in another process finishes first
        table = get_table(key)
    if table is None:
        return None
    problem = identity_problem(table, identity, spec, data_fingerprint)
    if problem:
        log.warning("the cached table %s is not for these inputs (%s); not using it", key, problem)
        return None
    log.info("loss table %s read from the cache (found without loading the model)", key)
    return table


def identity_problem(table: LossTable, identity: ModelIdentity, spec: TableSpec, data_fingerprint: str) -> str | None:
    """What in ``table`` contradicts the inputs it is looked up for, or None."""
    checks = (
        ("model fingerprint", table.model_fingerprint, identity.fingerprint),
        ("blocks", table.num_layers, identity.num_layers),
        ("window start", table.window_start, identity.window_start),
        ("text hash", table.data_fingerprint, data_fingerprint),
        ("settings", table.spec.summary(), spec.summary()),
    )
    for what, recorded, expected in checks:
        if recorded != expected:
            return f"its {what} is {recorded!r}, not {expected!r}" if what != "settings" else "its settings differ"
    return None
