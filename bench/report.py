"""What the model benchmarks share: held-out options, the machine line and writing a result.

Every benchmark records the command that made it, the machine and the load average (the
two cores are shared with other sessions, so wall times swing with their load), and
writes its markdown report under ``bench/results/`` atomically.
"""

from __future__ import annotations

import argparse
import os
import platform
import time
from pathlib import Path

import torch

from gap_engine.core.fsutil import atomic_write_text

RESULTS = Path(__file__).resolve().parent / "results"


def add_eval_args(parser: argparse.ArgumentParser, samples: int = 8, seq_len: int = 256) -> None:
    """--eval-data, --eval-samples, --eval-seq-len: the held-out windows every plan is measured on."""
    parser.add_argument("--eval-data", default="wiki-sample,news-sample", help="held-out sources, comma-separated")
    parser.add_argument("--eval-samples", type=int, default=samples)
    parser.add_argument("--eval-seq-len", type=int, default=seq_len)


def machine_line(load_start: tuple[float, float, float], started: float) -> str:
    """The machine, torch, the load average at the start and now, and the run's wall time."""
    load_end = os.getloadavg()
    return (
        f"Machine: {platform.machine()}, {torch.get_num_threads()} torch threads, 2 CPU cores shared with other "
        f"sessions, no GPU; torch {torch.__version__}. Load average at the start {load_start[0]:.1f} / "
        f"{load_start[1]:.1f} / {load_start[2]:.1f}, at the end {load_end[0]:.1f} / {load_end[1]:.1f} / "
        f"{load_end[2]:.1f}; the run took {time.perf_counter() - started:.0f} s."
    )


def write_report(name: str, lines: list[str]) -> Path:
    """Write ``bench/results/<name>.md`` and echo it on stdout."""
    RESULTS.mkdir(exist_ok=True)
    path = atomic_write_text(RESULTS / f"{name}.md", "\n".join(lines).rstrip("\n") + "\n")
    print("\n".join(lines))
    return path
