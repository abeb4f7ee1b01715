"""Typed errors of the engine.

Every failure a user can cause (a bad model name, a corrupt file, a plan for another
model, a budget the grid cannot reach) raises a subclass of ``GapError`` with a
one-line message. The CLI prints that line and exits non-zero; the app shows it. A broken
engine invariant (a bug) raises ``InvariantError`` instead, which is no GapError.
"""


class GapError(Exception):
    """Base class: a problem the user can fix, described in one line."""


class ModelLoadError(GapError):
    """A model name, path, hub id or weight file could not be loaded."""


class UnsupportedArchitectureError(GapError):
    """The model's architecture has no adapter."""


class DataError(GapError):
    """A text source is unknown, unreadable, empty or too short."""


class PlanError(GapError):
    """A rate plan is malformed, out of range, or made for another model."""


class TableError(GapError):
    """A loss table is malformed or made for another model."""


class BudgetError(GapError):
    """A budget the planner cannot reach, or contradictory constraints."""


class CompensationError(GapError):
    """Compensation cannot be computed: too little calibration text, a singular system, a path that cannot carry it."""


class CacheError(GapError):
    """A cache entry is missing, locked or corrupt."""


class CancelledError(GapError):
    """Long work was cancelled by its caller."""


class HistoryError(GapError):
    """The run history cannot be read or written."""


class ExportError(GapError):
    """A checkpoint or model cannot be written in the requested deployment format."""


class OutputError(GapError):
    """An output path cannot be written (a file where a folder goes, read-only, disk full)."""


class SizeLimitError(GapError):
    """A size past a resource ceiling (see ``limits``): too many tokens, buckets, bytes, levels."""


class OptionError(GapError):
    """An option that cannot apply as the command is given (another option or input fixes what it would set)."""


class InvariantError(RuntimeError):
    """An engine invariant broke: a shape after slicing, a parameter count against the plan's
    prediction, a step that ran out of order. A bug, not a user's mistake, so it is not a
    GapError: surfaces report it as an internal error with its traceback. Raised, never
    asserted, so it still fires under ``python -O``."""


class SharedModelError(InvariantError):
    """An in-place change (surgery, masking) asked of a model that several threads use at once
    (``LoadedModel.shared``, the explorer's dense models): work on ``LoadedModel.private()``."""


def one_line(exc: BaseException) -> str:
    """What a user sees for an exception: a GapError's own text, else its type and first line.

    Every surface (CLI, jobs, pages) shows failures through this one function, so a
    library's multi-line message never reaches a user as a traceback-like block.
    """
    if isinstance(exc, GapError):
        return _single_line(str(exc)) or type(exc).__name__
    first = first_line(exc)
    return f"{type(exc).__name__}: {first}" if first else type(exc).__name__


def _single_line(text: str, limit: int = 1000) -> str:
    """``text`` on one line of printable characters, cut to ``limit``: messages quote user
    input (a name, a path), which must not split a message or drive the terminal."""
    text = "".join(ch if ch.isprintable() else " " for ch in text[: limit + 1]).strip()
    return text if len(text) <= limit else text[: limit - 3] + "..."


def first_line(exc: BaseException, limit: int = 300) -> str:
    """The first non-empty line of an exception's message (cut to ``limit`` characters), or ''."""
    lines = str(exc).strip().splitlines()
    return _single_line(lines[0], limit) if lines else ""
