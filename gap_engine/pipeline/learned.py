"""What finished jobs taught the cost model (``pipeline.cost_model``) about this machine: one factor per kind of job.

A job that finishes (a table build, prune and evaluate, a recovery, baseline plans, a GGUF file) is recorded with its
predicted and actual seconds, the load average when it started and when it ended, and torch's threads, in a small
JSON file in the cache (``costmodel/finished-jobs.json``: the newest MAX_RECORDS, written atomically under a lock).
The next prediction of that kind is multiplied by the median of the last RECENT runs' actual / predicted, each
divided by the contention it ran under and multiplied by the contention now, where contention = max(1, (load
average + torch threads) / cores): how many times over the job's threads share the cores with the runnable threads
already there. A finished job ran under the mean of the load at its start and at its end, less its own threads at the
end (the load average counts them by then): a job that started quiet and ended beside a test run was slowed by it. Only runs priced the same way (the same prices and torch threads) count. An unreadable or oversized
file is ignored with a log line, and one that cannot be written costs the record, never the job.
"""

from __future__ import annotations

import logging
import os
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from gap_engine.core.errors import CacheError, GapError, one_line
from gap_engine.core.fsutil import atomic_write_json, cache_root, lock_for
from gap_engine.core.validate import check_number, check_text, read_json_file

log = logging.getLogger(__name__)

MAX_RECORDS = 200  # every kind's together; the oldest go first
MAX_BYTES = 256 * 1024  # 200 records take about 50 kB
RECENT = 9  # runs of one kind the factor is the median of
RATIO_BOUNDS = (0.1, 10.0)  # a run further off its prediction (a machine suspended mid-job) counts as this far
_NUMBERS = ("predicted_s", "actual_s", "load_start", "load_end", "threads", "finished")


def load_average() -> float:
    """The 1-minute load average (0 where the platform has none)."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return 0.0


def contention(load: float, threads: int) -> float:
    """How many times over ``threads`` share the cores with ``load`` runnable threads (at least 1)."""
    return max(1.0, (load + threads) / (os.cpu_count() or 1))


@dataclass(frozen=True)
class Pending:
    """A job that has started, whose time is recorded (`record`) when it finishes."""

    kind: str  # "table", "table read", "prune_eval", "recover", "baselines", "gguf"
    predicted_s: float  # the cost model's seconds, before any learned factor
    prices: str  # what priced it (the device profile's basis): runs priced otherwise teach it nothing
    load_start: float = field(default_factory=load_average)
    threads: int = field(default_factory=torch.get_num_threads)


@dataclass(frozen=True)
class Learned:
    """The factor the next prediction of one kind is multiplied by, and how many runs it comes from."""

    factor: float
    runs: int

    @property
    def text(self) -> str:
        return f"learned from {self.runs} run{'s' if self.runs != 1 else ''} on this machine"


def history_path() -> Path:
    return cache_root() / "costmodel" / "finished-jobs.json"


def _read(path: Path) -> list[dict]:
    """The records of ``path``; none when it is missing, and none, with a log line, when it is unreadable."""
    if not path.exists():
        return []
    try:
        records = read_json_file(path, MAX_BYTES, f"the job-time history {path}", CacheError)["finished"]
        if not isinstance(records, list):
            raise CacheError("its 'finished' is not a list")
        for r in records:
            for name in ("kind", "prices"):
                check_text(r[name], name, CacheError)
            for name in _NUMBERS:
                check_number(r[name], name, CacheError, low=0.0)
        return records
    except (GapError, KeyError, TypeError) as exc:
        log.warning("ignoring the job-time history %s (%s): predictions are not corrected by it", path, one_line(exc))
        return []


def record(pending: Pending, actual_s: float, path: Path | None = None) -> None:
    """Add a finished job to the history (replacing an unreadable one); a cache that cannot be written is logged."""
    path = path or history_path()
    entry = asdict(pending) | {"actual_s": float(actual_s), "load_end": load_average(), "finished": time.time()}
    try:
        with lock_for(path):
            atomic_write_json(path, {"finished": (_read(path) + [entry])[-MAX_RECORDS:]})
    except (OSError, GapError) as exc:
        log.warning("a finished job's time was not recorded in %s: %s", path, one_line(exc))


def lived_load(run: dict) -> float:
    """The load a finished ``run`` shared the cores with: the mean of its start's and its end's, its own threads taken
    out of the end's, but the end's never counted below the lower of the two readings (a short job's threads had not
    yet raised the 1-minute average, so a steady load stays itself)."""
    others_at_end = max(0.0, run["load_end"] - run["threads"])
    return (run["load_start"] + max(others_at_end, min(run["load_end"], run["load_start"]))) / 2


def factor_for(kind: str, prices: str, path: Path | None = None) -> Learned | None:
    """The factor for the next ``kind`` job priced by ``prices`` under the load now; None before any such run."""
    threads, low, high = torch.get_num_threads(), *RATIO_BOUNDS
    runs = [r for r in _read(path or history_path()) if (r["kind"], r["prices"], r["threads"]) == (kind, prices, threads)]
    if not runs:
        return None
    ratios = [
        min(high, max(low, r["actual_s"] / r["predicted_s"])) / contention(lived_load(r), threads)
        for r in runs[-RECENT:]
        if r["predicted_s"] > 0
    ]
    if not ratios:
        return None
    return Learned(statistics.median(ratios) * contention(load_average(), threads), len(ratios))
