"""``gap export``: a checkpoint in the formats people deploy.

    gap export CHECKPOINT --format gguf --outtype f16|q8_0 --out OUT.gguf
    gap export CHECKPOINT --format hf --dtype bfloat16|float16|float32 --out OUT_DIR

``gguf`` writes a llama.cpp file (``gguf_export``); CHECKPOINT may also be a dense model
(a built-in name or a model folder), the unpruned reference. ``hf`` re-saves a gap
checkpoint in another storage precision (``deploy.resave_checkpoint``). Bad input ends in
one ``gap: error:`` line and leaves no output behind.
"""

from __future__ import annotations

import argparse
import json

from .deploy import DEFAULT_SAVE_DTYPE, SAVE_DTYPES
from .gguf_export import OUTTYPES


def cmd_export(args) -> int:
    if args.format == "gguf":
        from .gguf_export import export_gguf

        summary = export_gguf(args.checkpoint, args.out, args.outtype, args.tokenizer_pre).to_dict()
    else:
        from .deploy import resave_checkpoint

        out = resave_checkpoint(args.checkpoint, args.out, args.dtype)
        size = sum(p.stat().st_size for p in out.glob("*.safetensors"))
        summary = {"path": str(out), "dtype": args.dtype, "weights_bytes": size}
    if args.json:
        print(json.dumps(summary))
    else:
        print("\n".join(f"{k}: {v}" for k, v in summary.items() if k not in ("head_count", "head_count_kv", "feed_forward_length")))
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    """Add the ``export`` subcommand to the ``gap`` parser."""
    p = sub.add_parser("export", help="write a checkpoint as GGUF for llama.cpp, or re-save it in another precision")
    p.add_argument("checkpoint", help="a gap checkpoint folder (for gguf also a built-in name or dense model folder)")
    p.add_argument("--format", choices=["gguf", "hf"], default="gguf", help="gguf: llama.cpp file; hf: transformers folder")
    p.add_argument("--outtype", choices=OUTTYPES, default="f16", help="GGUF weight type")
    p.add_argument("--dtype", choices=list(SAVE_DTYPES), default=DEFAULT_SAVE_DTYPE, help="hf: storage precision")
    p.add_argument("--tokenizer-pre", help="GGUF: llama.cpp pre-tokenizer name when it cannot be detected (e.g. llama-bpe)")
    p.add_argument("--out", required=True, help="output .gguf file or folder (written atomically)")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    p.set_defaults(func=cmd_export)
