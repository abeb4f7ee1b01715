"""Strict JSON out: every JSON text the tool writes (files, history columns, ``--json`` output)
goes through `json_text`, so no reader ever meets a bare ``NaN`` or ``Infinity``.

Python's ``json`` writes non-finite floats as ``NaN``/``Infinity`` by default, which is not
JSON: strict readers (browsers, ``jq``, other languages) refuse the file. In our files a
non-finite number always means "no number" (a step whose loss diverged, a probe candidate
that blew up), so it is written as ``null`` and said in the log; readers take null where a
number may be missing and refuse it where one is required. Anything else ``json`` cannot
encode still raises (``allow_nan=False`` backs the conversion up).
"""

from __future__ import annotations

import json
import logging
import math
from typing import Any

log = logging.getLogger(__name__)


def finite_or_null(value: Any) -> tuple[Any, int]:
    """``value`` with every non-finite float inside it replaced by None, and how many were."""
    if isinstance(value, float):
        return (value, 0) if math.isfinite(value) else (None, 1)
    if isinstance(value, dict):
        pairs = [(key, finite_or_null(item)) for key, item in value.items()]
        return {key: item for key, (item, _) in pairs}, sum(n for _, (_, n) in pairs)
    if isinstance(value, (list, tuple)):
        items = [finite_or_null(item) for item in value]
        return [item for item, _ in items], sum(n for _, n in items)
    return value, 0


def json_text(value: Any, what: str = "JSON", **kwargs: Any) -> str:
    """``json.dumps(value, **kwargs)`` with non-finite floats written as null (and logged as such).

    Args:
        value: what to encode (dicts, lists, numbers, text; ``default`` in kwargs for the rest).
        what: what is written, for the log line.
    """
    clean, replaced = finite_or_null(value)
    if replaced:
        log.info("%s: %d non-finite number(s) written as null (no number)", what, replaced)
    return json.dumps(clean, allow_nan=False, **kwargs)
