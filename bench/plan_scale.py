"""Plan, on paper, loss tables for Llama-architecture 8B and 70B models on one H200 and on eight.

Nothing is loaded or measured: the cost model (gap_engine/pipeline/cost_model.py) counts the work of
each build and prices it with the H200 spec-sheet profile. ``refine`` is priced as a fisher
pass plus ``cost_model.REFINE_CELLS`` measured cells per component (the refine estimator
measures where the DP's plans go; bench/results/refine.md counts how many for SmolLM2). Prints a markdown table.

    python bench/plan_scale.py [--samples 32 --seq-len 2048]
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from report import script_argv

from gap_engine.core.config import FULL_RATE_GRID, WindowSpec
from gap_engine.pipeline.cost_model import REFINE_CELLS, SHAPES, SPEC_PROFILES, estimate_build
from gap_engine.tables.artefact import TableSpec


def rows(args) -> list[str]:
    profile = SPEC_PROFILES["h200"]
    windows = WindowSpec("wiki-sample", args.samples, args.seq_len, 0, args.batch_size)
    exact = TableSpec(windows=windows, rate_grid=FULL_RATE_GRID)
    refine = replace(exact, estimator="refine")
    out = [
        "| model | table | GPUs | placement | predicted time | device memory (busiest) | host memory (driver) | fits one H200 |",
        "|---|---|---:|---|---:|---:|---:|---|",
    ]
    for name in ("llama-3.1-8b", "llama-3.1-70b"):
        shape = SHAPES[name]
        for label, spec in (("exact", exact), (f"refine ({REFINE_CELLS}/component)", refine)):
            for gpus in (1, 8):
                for stream in (False, True):
                    e = estimate_build(shape, spec, profile, dtype_bytes=2, stream=stream, workers=gpus)
                    where = ("streamed" if stream else "resident") + (f", Ray x{gpus}" if gpus > 1 else "")
                    out.append(
                        f"| {name} | {label} | {gpus} | {where} | {e.seconds / 3600:.2f} h | {e.device_bytes / 1e9:.0f} GB | "
                        f"{e.host_bytes / 1e9:.0f} GB | {'yes' if e.fits else 'no'} |"
                    )
    return out


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=32)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--batch-size", type=int, default=4)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = script_argv(argv)
    args = build_parser().parse_args(argv)
    print(f"Calibration: {args.samples} x {args.seq_len} tokens, 16-rate grid (0, 1/16, ..., 15/16), split, nll, wanda, bf16.\n")
    print("\n".join(rows(args)))
    print("\n" + SPEC_PROFILES["h200"].basis)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
