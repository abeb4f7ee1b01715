"""The ``gap`` command line (also ``python -m gap_engine``).

``parser`` defines every subcommand; each names its handler in one of the command modules
(``model_commands``, ``table_commands``, ``plan_commands``), imported only when that
command runs, so ``gap --help`` answers before torch is loaded. Handlers print results on
stdout (``--json`` prints exactly one JSON object) and progress on stderr. User errors are
one line on stderr and exit status 2 (sizes, text sources and ``--out`` are checked by
``preflight`` before a handler is imported); an interrupt exits 130.
"""

from __future__ import annotations

import importlib
import logging
import sys

from gap_engine.cli.parser import build_parser
from gap_engine.cli.preflight import preflight
from gap_engine.core.errors import GapError, one_line


def _quiet_transformers() -> None:
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()


def main(argv: list[str] | None = None) -> int:
    """Run one ``gap`` command; returns its exit status."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr
    )
    module_name, function_name = args.handler.split(":")
    try:
        preflight(args)  # sizes, sources and --out, before torch loads
        handler = getattr(importlib.import_module(f"gap_engine.cli.{module_name}"), function_name)
        _quiet_transformers()
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
