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

from gap_engine.cli.output import TerminalSafe, printable
from gap_engine.cli.parser import build_parser, explicit_options
from gap_engine.cli.preflight import preflight
from gap_engine.core.errors import GapError, one_line

# What _quiet_transformers sets, as the libraries read it when they are imported: a command
# that finds its table in the cache never imports them (seconds), one that loads a model does.
_QUIET_ENVIRONMENT = {"TRANSFORMERS_VERBOSITY": "error", "HF_HUB_VERBOSITY": "error", "HF_HUB_DISABLE_PROGRESS_BARS": "1"}


def _quiet_transformers() -> None:
    for name, value in _QUIET_ENVIRONMENT.items():
        os.environ.setdefault(name, value)
    # huggingface_hub and datasets log through their own handlers (retries, one line each).
    logging.getLogger("datasets").setLevel(logging.ERROR)
    if "transformers" in sys.modules:  # imported before main ran (an embedding application, tests)
        import transformers
        from huggingface_hub.utils import logging as hub_logging

        transformers.logging.set_verbosity_error()
        transformers.logging.disable_progress_bar()
        hub_logging.set_verbosity_error()


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
        return printable(super().format(record))


def write_crash_file(argv: list[str] | None, exc: BaseException) -> Path | None:
    """The traceback of an unexpected exception, in a new file under ``<cache>/crashes/``."""
    from gap_engine.core.fsutil import atomic_write_text, cache_root

    text = (
        f"gap {' '.join(map(str, argv if argv is not None else sys.argv[1:]))}\n"
        f"python {sys.version.split()[0]}, pid {os.getpid()}, {time.strftime('%Y-%m-%dT%H:%M:%S%z')}\n\n"
        + "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    )
    # An argument or message may hold bytes that are not UTF-8 (a file name as the system gave it):
    # shown escaped, so the report of one failure cannot fail itself.
    text = text.encode("utf-8", "backslashreplace").decode("utf-8")
    name = f"crash-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.txt"
    for folder in (lambda: cache_root() / "crashes", lambda: Path(tempfile.gettempdir()) / "gap-crashes"):
        try:
            return atomic_write_text(folder() / name, text)
        except Exception:
            continue
    return None


def _internal_error(argv: list[str] | None, exc: BaseException) -> int:
    try:
        crash = write_crash_file(argv, exc)
    except Exception:  # the last line of defence never raises itself
        crash = None
    where = f"details in {crash}" if crash else "the traceback could not be written"
    say(f"gap: internal error: {one_line(exc)[:300]}; {where}")
    return INTERNAL_ERROR


def say(line: str) -> None:
    """One line on stderr. A stderr that cannot take it (``2>/dev/full``, a closed pipe) loses the
    line, not the exit status: stderr is then pointed at the null device, so neither this write
    nor the interpreter's last flush turns a refusal (2) into a failure of another kind."""
    try:
        print(line, file=sys.stderr, flush=True)
    except (OSError, ValueError):
        _drop_stream("stderr")


def _drop_stream(name: str) -> None:
    """Point sys.<name> (and its file descriptor) at the null device, dropping what it still buffers."""
    stream = getattr(sys, name)
    null = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(null, stream.fileno())  # what is still buffered goes nowhere, without an error
    except (OSError, ValueError):
        pass
    finally:
        os.close(null)
    setattr(sys, name, open(os.devnull, "w"))  # lives as long as the process


def _working_folder_problem() -> str | None:
    """Why the process has no usable working folder (it was deleted), or None. Checked before torch
    loads: its libraries would otherwise abort the process with a fatal error of their own."""
    try:
        os.getcwd()
    except OSError as exc:
        return f"the working folder is gone ({exc.strerror}): it was deleted or moved; cd into an existing folder and run gap again"
    return None


def check_model_folders(args) -> None:
    """Every local model folder (or .gguf file) the command reads (``--model``, ``gap export``'s
    checkpoint), its small files checked before the handler reads any text or prints a line: a damaged
    checkpoint is one line, not a text read and half a model load. (Here, not in the
    preflight: the checks build the config and the tokenizer, which needs transformers.)"""
    folders = [getattr(args, dest) for dest in ("model", "checkpoint") if getattr(args, dest, None) and _maybe_folder(getattr(args, dest))]
    if not folders:
        return  # nothing to check: the loader (and torch) is not imported for a built-in name
    from gap_engine.model.loading import check_model_files

    for folder in folders:
        check_model_files(folder)


def _maybe_folder(value: str) -> bool:
    """A local model folder, or a .gguf file (its metadata says whether transformers can read it)."""
    try:
        path = Path(value).expanduser()
        return path.is_dir() or (path.suffix == ".gguf" and path.is_file())
    except (OSError, RuntimeError, ValueError):  # an unknown ~user, a link loop: check_model_files says it
        return True


def main(argv: list[str] | None = None) -> int:
    """Run one ``gap`` command; returns its exit status. What it prints goes through
    ``TerminalSafe`` (control characters in names read from disk shown as escapes)."""
    saved = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = TerminalSafe(sys.stdout), TerminalSafe(sys.stderr, progress=True)
    try:
        return _run(argv)
    finally:
        sys.stdout, sys.stderr = saved


def _run(argv: list[str] | None) -> int:
    problem = _working_folder_problem()
    if problem:
        say(f"gap: error: {problem}")
        return 2
    try:
        parser = build_parser()  # its choices read the registries, plugins (GAP_PLUGINS) included
    except GapError as exc:
        say(f"gap: error: {one_line(exc)}")
        return 2
    args = parser.parse_args(argv)
    args.given_options = explicit_options(argv)  # the option rules of the preflight judge only what was typed
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
        say(f"gap: error: {one_line(exc)}")
        return 2
    except OSError as exc:  # the file system said no somewhere no GapError names it
        say(f"gap: error: {one_line(exc)}")
        return 2
    except MemoryError:
        say("gap: error: out of memory; lower the sizes (--samples, --seq-len, --batch-size)")
        return 2
    except KeyboardInterrupt:
        say("gap: interrupted")
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
