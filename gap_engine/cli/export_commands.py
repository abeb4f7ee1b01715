"""``gap export``: a checkpoint in the formats people deploy.

    gap export CHECKPOINT --format gguf --outtype f16|q8_0 --out OUT.gguf
    gap export CHECKPOINT --format hf --dtype bfloat16|float16|float32 --out OUT_DIR

``gguf`` writes a llama.cpp file (``export.gguf``); CHECKPOINT may also be a dense model
(a built-in name or a model folder), the unpruned reference. ``hf`` re-saves a gap
checkpoint in another storage precision (``export.resave``). Bad input ends in one
``gap: error:`` line and leaves no output behind.
"""

from __future__ import annotations

import argparse
import json

PER_LAYER_KEYS = ("head_count", "head_count_kv", "feed_forward_length")  # long lists: --json only


def run_export(args: argparse.Namespace) -> int:
    if args.format == "gguf":
        from gap_engine.export.gguf import export_gguf

        summary = export_gguf(args.checkpoint, args.out, args.outtype, args.tokenizer_pre).to_dict()
    else:
        from gap_engine.export.resave import resave_checkpoint

        out = resave_checkpoint(args.checkpoint, args.out, args.dtype)
        size = sum(p.stat().st_size for p in out.glob("*.safetensors"))
        summary = {"path": str(out), "dtype": args.dtype, "weights_bytes": size}
    if args.json:
        print(json.dumps(summary))
    else:
        print("\n".join(f"{k}: {v}" for k, v in summary.items() if k not in PER_LAYER_KEYS))
    return 0
