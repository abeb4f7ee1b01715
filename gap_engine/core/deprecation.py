"""Old names that still work, each with the release that removes it (as transformers does).

One function words every such warning, so the CLI's old flags and the old file fields say the
same thing: what replaced the name and when the old one stops working.
"""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)

# The gap-engine release that stops accepting the names deprecated in 0.1 (--approx, --method,
# --methods; the "method" field of version-1 plans and of table specs).
REMOVED_IN = "0.3.0"


def deprecation_text(old: str, new: str, removed_in: str = REMOVED_IN) -> str:
    """One line: ``old`` is deprecated, ``new`` replaces it, and the release that removes it."""
    return f"{old} is deprecated and will be removed in gap-engine {removed_in}; use {new}"


def warn_deprecated(old: str, new: str, removed_in: str = REMOVED_IN) -> None:
    log.warning(deprecation_text(old, new, removed_in))
