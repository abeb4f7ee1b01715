"""What the model benchmarks share: held-out options, the machine line, the result header and writing a result.

Every file in ``bench/results/`` is regenerated, whole, by the command written at its top. A
markdown result therefore starts with one machine-readable line,

    <!-- gap-bench: {"script": "bench/bench_x.py", "argv": ["--budgets", "0.2"], "files": ["x.csv"]} -->

(the script, relative to the repository root; its arguments; the other files in
``bench/results/`` the same command writes, such as a CSV of the rows), and states the same
command for a reader in its text. ``tests/test_bench_results.py`` runs each script's parser
(``build_parser()``) on the recorded arguments, so a result whose command the script no longer
accepts fails there. The machine line reads the machine (cores, torch threads, accelerator,
torch, platform) and the load average before and after the run, since the cores may be shared
with other work and wall times swing with its load.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shlex
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from gap_engine.core.fsutil import atomic_write_text

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
HEADER_PREFIX = "<!-- gap-bench: "
HEADER_SUFFIX = " -->"
_HEADER = re.compile(r"^<!-- gap-bench: (\{.*\}) -->$")


def add_eval_args(parser: argparse.ArgumentParser, samples: int = 8, seq_len: int = 256) -> None:
    """--eval-data, --eval-samples, --eval-seq-len: the held-out windows every plan is measured on."""
    parser.add_argument("--eval-data", default="wiki-sample,news-sample", help="held-out sources, comma-separated")
    parser.add_argument("--eval-samples", type=int, default=samples)
    parser.add_argument("--eval-seq-len", type=int, default=seq_len)


# ---- the machine ---------------------------------------------------------------------------------
def usable_cores() -> int:
    """The cores this process may run on (its affinity where the OS says; else every core)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def accelerator() -> str:
    """The accelerator torch sees: 'none', or the CUDA devices' names (e.g. '1 x NVIDIA H100')."""
    import torch

    if not torch.cuda.is_available():
        return "none"
    names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return ", ".join(f"{names.count(name)} x {name}" for name in dict.fromkeys(names))


def machine_description() -> str:
    """The machine as read now: cores, torch threads, accelerator, torch, Python and platform."""
    import torch

    cores, logical = usable_cores(), os.cpu_count() or 1
    cores_text = f"{cores} CPU cores" + (f" of {logical}" if logical != cores else "")
    return (
        f"Machine: {cores_text} usable, {torch.get_num_threads()} torch threads, accelerator {accelerator()}; "
        f"torch {torch.__version__}, Python {platform.python_version()}, {platform.platform()}"
    )


def load_text(load: Sequence[float]) -> str:
    return " / ".join(f"{x:.1f}" for x in load)


def machine_line(load_start: Sequence[float], started: float) -> str:
    """The machine as read now, the load average at the start and now, and the run's wall time.

    Args:
        load_start: ``os.getloadavg()`` when the run started.
        started: ``time.perf_counter()`` when the run started.
    """
    return (
        f"{machine_description()}. Load average (1 / 5 / 15 min) at the start {load_text(load_start)}, at the end "
        f"{load_text(os.getloadavg())}; the run took {time.perf_counter() - started:.0f} s."
    )


# ---- the header: the command that regenerates a result ---------------------------------------------
def script_argv(argv: Sequence[str] | None) -> list[str]:
    """The arguments a benchmark ran with: ``argv`` when main() was given them, else the command line's."""
    return list(sys.argv[1:] if argv is None else argv)


def command_line(script: str, argv: Sequence[str]) -> str:
    """The command as a reader types it from the repository root: ``python bench/x.py ARGS``."""
    return shlex.join(["python", script, *argv])


def header_line(script: str, argv: Sequence[str], files: Sequence[str] = ()) -> str:
    """The first line of a markdown result: the command that writes it, machine-readable.

    Args:
        script: the benchmark, relative to the repository root (``bench/bench_x.py``).
        argv: its arguments, exactly as run.
        files: other files in ``bench/results/`` the same command writes (names, not paths).
    """
    record: dict[str, object] = {"script": script, "argv": [str(a) for a in argv]}
    if files:
        record["files"] = [str(f) for f in files]
    text = json.dumps(record, ensure_ascii=True)
    # ``--`` cannot appear inside an HTML comment; JSON escapes keep the record's meaning.
    return HEADER_PREFIX + text.replace("--", "-\\u002d") + HEADER_SUFFIX


def read_header(path: Path) -> dict | None:
    """The record of ``path``'s first line (script, argv, files), or None when it has none."""
    with open(path, encoding="utf-8") as handle:
        first = handle.readline().rstrip("\n")
    match = _HEADER.match(first)
    if match is None:
        return None
    record = json.loads(match.group(1))
    if not isinstance(record.get("script"), str) or not isinstance(record.get("argv"), list):
        raise ValueError(f"{path}: the gap-bench header needs a script and an argv list")
    return record


def with_header(text: str, script: str, argv: Sequence[str], files: Sequence[str] = ()) -> str:
    """``text`` (a markdown report) with the header line in front."""
    return header_line(script, argv, files) + "\n" + text.rstrip("\n") + "\n"


def write_result(path: Path, lines: Sequence[str], script: str, argv: Sequence[str], files: Sequence[str] = ()) -> Path:
    """Write a markdown result at ``path`` atomically, the header first, and echo it on stdout."""
    path.parent.mkdir(parents=True, exist_ok=True)
    text = with_header("\n".join(lines), script, argv, files)
    atomic_write_text(path, text)
    print(text, end="")
    return path


def write_report(name: str, lines: Sequence[str], script: str, argv: Sequence[str], files: Sequence[str] = ()) -> Path:
    """Write ``bench/results/<name>.md`` (the header first) and echo it on stdout."""
    return write_result(RESULTS / f"{name}.md", lines, script, argv, files)
