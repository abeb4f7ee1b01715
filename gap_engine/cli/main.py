"""The ``gap`` command line (also ``python -m gap_engine``).

``parser`` defines every subcommand; each names its handler in one of the command modules
(``model_commands``, ``table_commands``, ``plan_commands``), imported only when that
command runs, so ``gap --help`` answers before torch is loaded. Handlers print results on
stdout (``--json`` prints exactly one JSON object) and progress on stderr. User errors are
one line on stderr and exit status 2 (sizes, names, text sources and ``--out`` are checked
by ``preflight`` before a handler is imported); an interrupt exits 130. Anything else is a
bug of ours, not the user's, except a missing optional package (``OPTIONAL_MODULES``: one line
naming the pyproject extra that installs it, exit 2): the last line of defence prints one line,
``gap: internal error: ...; details in <crash file>``, exits 70 (EX_SOFTWARE) and writes the
traceback to ``<cache>/crashes/`` (atomically; the system's temporary folder when the cache
cannot be written).

Other libraries' log records below ERROR are not shown (unless ``-v``): their INFO and
WARNING lines (download retries, deprecation notes) would bury the one line that matters.
"""

from __future__ import annotations

import importlib
import logging
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

from gap_engine.cli.parser import build_parser
from gap_engine.cli.preflight import preflight
from gap_engine.core.errors import GapError, one_line


def _quiet_transformers() -> None:
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    # huggingface_hub and datasets log through their own handlers (retries, one line each).
    from huggingface_hub.utils import logging as hub_logging

    hub_logging.set_verbosity_error()
    logging.getLogger("datasets").setLevel(logging.ERROR)


INTERNAL_ERROR = 70  # EX_SOFTWARE: a bug, never the user's input
# Packages one feature imports on first use, and the pyproject extra that installs each (the core
# install leaves them out; tests/test_layout.py checks both lists against pyproject.toml).
OPTIONAL_MODULES = {
    "lm_eval": "tasks",
    "datasets": "tasks",
    "peft": "recovery",
    "ray": "ray",
    "plotly": "report",
    "kaleido": "app",
    "streamlit": "app",
}


class _OursOrSerious(logging.Filter):
    """Pass gap_engine's records, and other libraries' only from ERROR up."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.name.startswith("gap_engine") or record.levelno >= logging.ERROR


class _PrintableFormatter(logging.Formatter):
    """Log lines with control characters shown as escapes: a file name holding a terminal
    escape sequence (or a newline) must not drive the terminal or forge a second line."""

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        return "".join(ch if ch.isprintable() else ch.encode("unicode_escape").decode("ascii") for ch in text)


def write_crash_file(argv: list[str] | None, exc: BaseException) -> Path | None:
    """The traceback of an unexpected exception, in a new file under ``<cache>/crashes/``."""
    from gap_engine.core.fsutil import atomic_write_text, cache_root

    text = (
        f"gap {' '.join(map(str, argv if argv is not None else sys.argv[1:]))}\n"
        f"python {sys.version.split()[0]}, pid {os.getpid()}, {time.strftime('%Y-%m-%dT%H:%M:%S%z')}\n\n"
        + "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    )
    name = f"crash-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.txt"
    for folder in (lambda: cache_root() / "crashes", lambda: Path(tempfile.gettempdir()) / "gap-crashes"):
        try:
            return atomic_write_text(folder() / name, text)
        except Exception:
            continue
    return None


def _internal_error(argv: list[str] | None, exc: BaseException) -> int:
    crash = write_crash_file(argv, exc)
    where = f"details in {crash}" if crash else "the traceback could not be written"
    print(f"gap: internal error: {one_line(exc)[:300]}; {where}", file=sys.stderr)
    return INTERNAL_ERROR


def check_model_folders(args) -> None:
    """Every local model folder the command reads (``--model``, ``gap export``'s checkpoint),
    its small files checked before the handler reads any text or prints a line: a damaged
    checkpoint is one line, not a text read and half a model load. (Here, not in the
    preflight: the checks build the config and the tokenizer, which needs transformers.)"""
    from gap_engine.model.loading import check_model_files

    for dest in ("model", "checkpoint"):
        if getattr(args, dest, None):
            check_model_files(getattr(args, dest))


def main(argv: list[str] | None = None) -> int:
    """Run one ``gap`` command; returns its exit status."""
    args = build_parser().parse_args(argv)
    existing = list(logging.getLogger().handlers)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr
    )
    for handler in logging.getLogger().handlers:
        if handler not in existing:  # ours, not an embedding application's
            handler.setFormatter(_PrintableFormatter("%(levelname)s %(name)s: %(message)s"))
    if not args.verbose:
        for handler in logging.getLogger().handlers:
            if not any(isinstance(f, _OursOrSerious) for f in handler.filters):
                handler.addFilter(_OursOrSerious())
    module_name, function_name = args.handler.split(":")
    try:
        preflight(args)  # sizes, sources and --out, before torch loads
        handler = getattr(importlib.import_module(f"gap_engine.cli.{module_name}"), function_name)
        _quiet_transformers()
        check_model_folders(args)
        return handler(args)
    except GapError as exc:
        print(f"gap: error: {one_line(exc)}", file=sys.stderr)
        return 2
    except OSError as exc:  # the file system said no somewhere no GapError names it
        print(f"gap: error: {one_line(exc)}", file=sys.stderr)
        return 2
    except MemoryError:
        print("gap: error: out of memory; lower the sizes (--samples, --seq-len, --batch-size)", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("gap: interrupted", file=sys.stderr)
        return 130
    except ModuleNotFoundError as exc:
        missing = (exc.name or "").split(".")[0]
        if missing not in OPTIONAL_MODULES:
            return _internal_error(argv, exc)
        print(
            f"gap: error: this command needs {missing}, which is not installed: pip install 'gap-engine[{OPTIONAL_MODULES[missing]}]'",
            file=sys.stderr,
        )
        return 2
    except Exception as exc:
        return _internal_error(argv, exc)
