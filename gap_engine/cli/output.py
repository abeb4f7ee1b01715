"""What the ``gap`` subcommands print: progress on stderr, tables and CSV for results."""

from __future__ import annotations

import csv
import io
import sys
import time
from typing import Any

from gap_engine.core.progress import Hooks


def printable(text: str, keep: str = "") -> str:
    """``text`` with every character a terminal would act on (ESC, BEL, backspace, a carriage
    return, C1 controls, bidi overrides...) shown as its Python escape, except those in ``keep``.
    A name read from disk (a cache folder called ``ESC[2J``) must not clear the screen or forge a line."""
    return "".join(ch if ch.isprintable() or ch in keep else ch.encode("unicode_escape").decode("ascii") for ch in text)


class TerminalSafe(io.TextIOBase):
    """A text stream that writes through ``printable``: what gap prints, names read from disk
    included, reaches the terminal as text. Newlines and tabs pass; with ``progress``, so does a
    carriage return that starts a write (StderrProgress rewriting its own line). A progress line
    left open (no newline after its counter) is ended before anything else is written, so an
    error or a log line never lands on the end of ``eta 0s``."""

    def __init__(self, stream, progress: bool = False):
        self.stream = stream
        self.progress = progress
        self.progress_open = False  # a progress line was written and no newline ended it yet

    def write(self, text: str) -> int:
        if self.progress and text.startswith("\r"):
            self.stream.write("\r" + printable(text[1:], "\n\t"))
            self.progress_open = not text.endswith("\n")
        elif text:
            if self.progress_open and not text.startswith("\n"):
                self.stream.write("\n")
            self.stream.write(printable(text, "\n\t"))
            self.progress_open = False
        return len(text)

    def flush(self) -> None:
        self.stream.flush()

    def isatty(self) -> bool:
        return bool(getattr(self.stream, "isatty", lambda: False)())

    def fileno(self) -> int:
        return self.stream.fileno()

    @property
    def encoding(self) -> str:  # type: ignore[override]  # TextIOBase declares it read-only
        return getattr(self.stream, "encoding", "utf-8")


def format_seconds(seconds: float | None) -> str:
    """'42s', '3m05s', '1h02m', or '?' when unknown."""
    if seconds is None:
        return "?"
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"


class StderrProgress:
    """The engine's (done, total, eta) callback as ``label: done/total (pct), eta`` on stderr.

    Rewritten in place on a terminal; elsewhere (logs, CI) one line every ``every`` seconds
    and at the end. An ETA the engine does not give is estimated from the steps so far.
    """

    def __init__(self, label: str, stream=None, every: float = 5.0):
        self.label = label
        self.stream = stream or sys.stderr
        self.every = every
        self._started = time.monotonic()
        self._last = 0.0
        self._tty = bool(getattr(self.stream, "isatty", lambda: False)())

    def __call__(self, done: int, total: int, eta: float | None = None) -> None:
        now = time.monotonic()
        if eta is None and done:
            eta = (now - self._started) / done * (total - done)
        final = done >= total
        if not self._tty and not final and now - self._last < self.every:
            return
        self._last = now
        text = f"{self.label}: {done}/{total} ({100 * done / max(total, 1):.0f}%), eta {format_seconds(eta)}"
        self.stream.write(("\r" + text + ("\n" if final else "")) if self._tty else text + "\n")
        self.stream.flush()

    def stage(self, message: str) -> None:
        """A named stage of the work (or a message), one line."""
        self.stream.write(f"{message}\n" if not self._tty else f"\r{message}\n")
        self.stream.flush()

    def hooks(self) -> Hooks:
        """Engine hooks that print here: progress as above, stages and messages on their own line."""
        return Hooks(progress=self, stage=self.stage, message=self.stage)


def csv_text(rows: list[dict]) -> str:
    """Rows of dicts as CSV, columns in order of first appearance, floats to 6 significant digits."""
    columns: list[str] = []
    for row in rows:
        columns.extend(k for k in row if k not in columns)
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=columns, lineterminator="\n")
    writer.writeheader()
    for row in rows:
        writer.writerow({k: (f"{v:.6g}" if isinstance(v, float) else v) for k, v in row.items()})
    return buffer.getvalue()


def table_compensation_text(spec: Any, compensation: Any) -> str:
    """One line on whether the table's cells saw the compensation that follows the cut."""
    if not compensation.active:
        return "compensation: none (the kept weights are the dense model's)"
    named = compensation.name
    if spec.compensation == compensation.mode and not compensation.weighted:
        return f"compensation: {named}; the table's measured cells include it"
    if spec.compensation == compensation.mode:  # a table's compensated cells weigh tokens alike
        return f"compensation: {named}; the table's measured cells include {compensation.mode} with tokens weighed alike"
    return f"compensation: {named}; the {spec.estimator} table estimates the uncompensated model (exact and refine cells include it)"
