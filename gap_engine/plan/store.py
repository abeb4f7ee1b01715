"""Released plans kept by identity, so a link can name a plan and a reload gets that plan back.

The explorer's planner releases one plan; the other pages, a reload and a shared link must
prune and export that very plan, not one re-derived from a budget (a re-solve at the same
budget can pick another optimum, and the constraints behind the front are not in the link).
The plan is stored under its content hash (`RatePlan.content_hash`) with the planner
constraints it was chosen under; the link carries the hash. The folder layout is the schema::

    <cache root>/plans/<hash>.json    {"plan": RatePlan dict, "constraints": dict or null}

A stored file is checked on every read: it must parse as a plan and hash to its name, so a
changed or truncated file is reported, never used as another plan.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from gap_engine.core.errors import CacheError, GapError, PlanError, first_line
from gap_engine.core.fsutil import atomic_write_json, cache_root
from gap_engine.core.limits import LIMITS
from gap_engine.core.validate import check_keys, read_json_file
from gap_engine.model.rateplan import PLAN_HASH_DIGITS, RatePlan

_HASH_PATTERN = re.compile(rf"^[0-9a-f]{{{PLAN_HASH_DIGITS}}}$")


def plans_root() -> Path:
    return cache_root() / "plans"


def plan_path(plan_hash: str) -> Path:
    """The file of one stored plan; CacheError for a text that is not a plan hash."""
    if not isinstance(plan_hash, str) or not _HASH_PATTERN.match(plan_hash):
        raise CacheError(f"'{str(plan_hash)[:40]}' is not a plan hash ({PLAN_HASH_DIGITS} hex digits)")
    return plans_root() / f"{plan_hash}.json"


def put_plan(plan: RatePlan, constraints: dict[str, Any] | None = None) -> str:
    """Store ``plan`` (and the constraints it was chosen under) by its hash; returns the hash.

    Writing the same plan again leaves the file as it is (same identity, same content).
    """
    digest = plan.content_hash()
    path = plan_path(digest)
    if not path.is_file():
        atomic_write_json(path, {"plan": plan.to_dict(), "constraints": constraints})
    return digest


def get_plan(plan_hash: str) -> tuple[RatePlan, dict[str, Any] | None] | None:
    """The stored plan of ``plan_hash`` and its constraints; None when no plan has that hash.

    Raises:
        CacheError: the hash is malformed, or the stored file is damaged or holds another plan.
    """
    path = plan_path(plan_hash)
    if not path.is_file():
        return None
    try:
        data = read_json_file(path, LIMITS.plan_bytes, f"stored plan {plan_hash}", PlanError)
        check_keys(data, f"stored plan {plan_hash}", PlanError)
        plan = RatePlan.from_dict(data.get("plan"))
    except GapError as exc:
        raise CacheError(f"the stored plan {plan_hash} is damaged: {first_line(exc)}") from exc
    if plan.content_hash() != plan_hash:
        raise CacheError(f"the stored plan {plan_hash} was changed: its content hashes to {plan.content_hash()}")
    constraints = data.get("constraints")
    return plan, constraints if isinstance(constraints, dict) else None
