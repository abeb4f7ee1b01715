"""What writing a checkpoint as GGUF will take (``export.gguf``), before it starts; the cost model's other parts are
in ``pipeline.cost_model``."""

from __future__ import annotations

import sys
import time
from pathlib import Path

from gap_engine.export.gguf import gguf_bytes
from gap_engine.pipeline import learned
from gap_engine.pipeline.cost_model import LOAD_BYTES_PER_S, PREDICTED, Prediction, checkpoint_shapes, with_learned_factor

# q8_0 (numpy) or f16 per parameter, the rest, the first import of transformers' model code (fit to two quiet runs)
GGUF_S_PER_PARAM, GGUF_FIXED_S, GGUF_IMPORT_S = {"q8_0": 1.0e-8, "f16": 5e-9}, 0.8, 4.0


def gguf_seconds(checkpoint: str | Path, outtype: str) -> float | None:
    """Building the GGUF file of ``checkpoint`` (``export.gguf.gguf_bytes``): loading it, converting every matrix, writing
    the file, and importing transformers' model code where this process has not yet; None without a readable config.json."""
    shapes = checkpoint_shapes(checkpoint)
    if shapes is None:
        return None
    dense, blocks = shapes
    params = dense.total_params - dense.layers * dense.block_params + sum(b.block_params for b in blocks)
    size = sum(f.stat().st_size for f in Path(checkpoint).expanduser().glob("*.safetensors")) or 4 * params
    convert = params * GGUF_S_PER_PARAM.get(outtype, GGUF_S_PER_PARAM["q8_0"])
    return GGUF_FIXED_S + (0.0 if "transformers.modeling_utils" in sys.modules else GGUF_IMPORT_S) + size / (2 * LOAD_BYTES_PER_S) + convert


def gguf_prediction(checkpoint: str | Path, outtype: str) -> Prediction | None:
    """``gguf_seconds`` as a one-stage Prediction, corrected by the GGUF files built here before."""
    seconds = gguf_seconds(checkpoint, outtype)
    basis = f"{PREDICTED} from the checkpoint's size"
    return None if seconds is None else with_learned_factor(Prediction({"gguf": seconds}, basis, kind="gguf", prices="nominal"))


def gguf_file(checkpoint: str | Path, outtype: str) -> bytes:
    """The GGUF file of ``checkpoint`` (``export.gguf.gguf_bytes``), its time recorded against its prediction."""
    predicted, started = gguf_prediction(checkpoint, outtype), time.perf_counter()
    pending = predicted.pending() if predicted is not None else None
    data = gguf_bytes(checkpoint, outtype)
    if pending is not None:
        learned.record(pending, time.perf_counter() - started)
    return data
