"""The takeaway: one sentence a stakeholder reads, written from measured runs and their intervals.

For a run of GAP's plan (allocator ``dp``), the latest run of uniform pruning at the same budget,
with the same compensation, evaluated on the same held-out windows (`measured.comparable_runs`);
for a run of any other allocator, the latest such run of GAP's plan. The sentence gives both
perplexities with their bootstrap intervals and their ratio with its paired interval
(`intervals.perplexity_ratio`), and says a tie when that interval contains 1 and a loss when it
lies below. A run recorded before the history kept per-window numbers gets its numbers without
an interval, and the sentence says why; when nothing compares, it says what run would.

Pure: history records in, text out.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from gap_engine.core.errors import HistoryError
from gap_engine.evaluate.history import RunRecord, fitted_as
from gap_engine.evaluate.intervals import Interval, perplexity_interval, perplexity_ratio
from gap_engine.evaluate.measured import (
    MeasuredPoint,
    comparable_runs,
    dense_interval,
    measured_frontier,
    same_budget,
    window_series,
    windows_key,
)
from gap_engine.prune.compensations import THROUGH_NORMS

GAP_ALLOCATOR = "dp"
DEFAULT_OPPONENT = "uniform"
_NAMES = {
    "dp": "GAP's plan",
    "uniform": "uniform pruning",
    "flap": "FLAP's allocation",
    "owl": "OWL's allocation",
    "evo": "the evolutionary search's plan",
    "manual": "the uploaded plan",
}


@dataclass(frozen=True)
class Takeaway:
    """The sentence and what it rests on."""

    text: str  # one or two plain sentences, no markup
    run_id: int  # the run it speaks of
    other_id: int | None  # the run it compares with; None: nothing compares yet
    ratio: Interval | None  # the other's perplexity over GAP's plan's (above 1: GAP's plan is better); None: no interval
    verdict: str | None  # Interval.verdict of ``ratio`` ("met", "tie", "loss"); None without an interval


def allocator_name(allocator: str) -> str:
    """'GAP's plan', 'uniform pruning', ... (an allocator without a plain name: 'the <name> plan')."""
    return _NAMES.get(allocator, f"the {allocator} plan")


def _ppl(value: float) -> str:
    return f"{value:.1f}" if value >= 10 else f"{value:.2f}"


def _with_interval(value: float, interval: Interval | None) -> str:
    return _ppl(value) if interval is None else f"{_ppl(value)} [{_ppl(interval.low)}, {_ppl(interval.high)}]"


def _latest(records: Sequence[RunRecord], allocator: str, budget: float | None, compensation: str, criterion: object) -> RunRecord | None:
    """The latest run of ``allocator`` at ``budget`` pruned the same way (criterion and compensation, its weighting
    included: ``fitted_as``): only the allocator differs."""
    found = [
        r
        for r in records
        if r.allocator == allocator and same_budget(r.budget, budget) and fitted_as(r) == compensation and _criterion(r) == criterion
    ]
    return max(found, key=lambda r: r.id or 0) if found else None


def _criterion(record: RunRecord) -> object:
    return (record.plan or {}).get("criterion")


def _first_shared_source(first: RunRecord, second: RunRecord) -> str | None:
    return next((s for s in first.perplexity if s in second.perplexity), None)


def takeaway(records: Sequence[RunRecord], run_id: int) -> Takeaway:
    """The takeaway of run ``run_id``, from the runs in ``records`` (the history, oldest first).

    Raises:
        HistoryError: no run ``run_id`` among ``records``.
    """
    focus = next((r for r in records if r.id == run_id), None)
    if focus is None:
        raise HistoryError(f"no run with id {run_id} in the history")
    source = next(iter(focus.perplexity), None)
    if focus.budget is None or source is None:
        return Takeaway(f"Run {run_id} has no budget or no held-out perplexity: there is nothing to compare.", run_id, None, None, None)
    compensation = fitted_as(focus)
    peers = [r for r in comparable_runs(records, focus) if r.id != focus.id]
    method: RunRecord | None
    other: RunRecord | None
    if focus.allocator == GAP_ALLOCATOR:
        method, other = focus, _latest(peers, DEFAULT_OPPONENT, focus.budget, compensation, _criterion(focus))
        missing = DEFAULT_OPPONENT
    else:
        method, other = _latest(peers, GAP_ALLOCATOR, focus.budget, compensation, _criterion(focus)), focus
        missing = GAP_ALLOCATOR
    lead = f"At {focus.budget:.2%} of prunable parameters removed" + (
        f" ({compensation_words(compensation)})" if compensation != "none" else ""
    )
    shared = _first_shared_source(method, other) if method is not None and other is not None else None
    if method is None or other is None or shared is None:
        return Takeaway(_alone(records, focus, source, lead, missing, compensation), run_id, None, None, None)
    return _compared(method, other, shared, lead, run_id)


def _compared(method: RunRecord, other: RunRecord, source: str, lead: str, run_id: int) -> Takeaway:
    """The sentence for two comparable runs: GAP's plan's perplexity against the other's, and their ratio."""
    text, interval = _margin_text(
        method,
        other,
        source,
        f"{lead}, {allocator_name(method.allocator)}",
        f"{allocator_name(other.allocator)}",
        allocator_name(method.allocator),
    )
    return Takeaway(text, run_id, other.id, interval, interval.verdict() if interval else None)


def _margin_text(
    method: RunRecord, other: RunRecord, source: str, method_words: str, other_words: str, winner: str
) -> tuple[str, Interval | None]:
    """'<method_words> (run m) keeps perplexity A [..] on <source> where <other_words> (run o) gives B [..]: the ratio [..]',
    and the paired interval of B / A (None: a run without per-window numbers)."""
    method_nll, other_nll = window_series(method, source, "nll"), window_series(other, source, "nll")
    paired = method_nll is not None and other_nll is not None and len(method_nll) == len(other_nll)
    method_ppl, other_ppl = method.perplexity[source], other.perplexity[source]
    head = (
        f"{method_words} (run {method.id}) keeps perplexity "
        f"{_with_interval(method_ppl, perplexity_interval([method_nll]) if method_nll else None)} on {source}"
        f"{_dense_text(method, source)} where {other_words} (run {other.id}) gives "
        f"{_with_interval(other_ppl, perplexity_interval([other_nll]) if other_nll else None)}"
    )
    if not paired:
        without = [r.id for r, nll in ((method, method_nll), (other, other_nll)) if nll is None]
        why = (
            f"run{'s' if len(without) > 1 else ''} {' and '.join(map(str, without))} "
            f"{'were' if len(without) > 1 else 'was'} recorded before the history kept per-window numbers"
            if without
            else "the two runs kept different numbers of windows"
        )
        return f"{head}: {_ratio_words(other_ppl / method_ppl)}, with no interval ({why}).", None
    interval = perplexity_ratio([other_nll], [method_nll])  # type: ignore[list-item]  # both checked above
    verdict = interval.verdict()
    if verdict == "met":
        tail = f"{interval.estimate:.2f}x lower [{interval.low:.2f}, {interval.high:.2f}]."
    elif verdict == "loss":
        tail = (
            f"{winner} loses here: {other_words}'s perplexity is "
            f"{1 / interval.estimate:.2f}x lower [{1 / interval.high:.2f}, {1 / interval.low:.2f}]."
        )
    else:
        tail = (
            f"a tie: the ratio {interval.estimate:.2f}x [{interval.low:.2f}, {interval.high:.2f}] contains 1, "
            f"so these {len(method_nll)} windows cannot tell the two apart."  # type: ignore[arg-type]
        )
    return f"{head}: {tail}", interval


def compensation_words(fitted: str) -> str:
    """'without compensation', 'with bias compensation', 'with bias compensation fitted through the output norms'
    (``fitted``: a ``fitted_as``)."""
    mode, _, _ = fitted.partition(THROUGH_NORMS)
    return "without compensation" if mode == "none" else f"with {mode} compensation{fitted[len(mode) :]}"


def compensation_twin(records: Sequence[RunRecord], run_id: int) -> RunRecord | None:
    """The latest run that pruned run ``run_id``'s plan (its rates and criterion) with another
    compensation, on the same held-out windows (None: there is none yet)."""
    focus = next((r for r in records if r.id == run_id), None)
    if focus is None:
        return None
    rates = _rates_of(focus)
    twins = [
        r for r in comparable_runs(records, focus)
        if r.id != focus.id and _rates_of(r) == rates and fitted_as(r) != fitted_as(focus)
    ]  # fmt: skip
    return max(twins, key=lambda r: r.id or 0) if twins else None


def _rates_of(record: RunRecord) -> tuple[Any, ...]:
    plan = record.plan or {}
    return (plan.get("attention_rates"), plan.get("mlp_rates"), plan.get("criterion"))


def compensation_takeaway(records: Sequence[RunRecord], run_id: int) -> Takeaway | None:
    """What compensation did to run ``run_id``'s plan: its perplexity with and without (or with
    another), both with intervals, and their paired ratio; None until such a twin run exists
    (`compensation_twin`). The compensated run speaks first."""
    twin = compensation_twin(records, run_id)
    if twin is None:
        return None
    focus = next(r for r in records if r.id == run_id)
    first, second = (twin, focus) if fitted_as(focus) == "none" else (focus, twin)
    source = _first_shared_source(first, second)
    if source is None:
        return None
    text, interval = _margin_text(
        first, second, source, f"The same plan {compensation_words(fitted_as(first))}",
        compensation_words(fitted_as(second)), compensation_words(fitted_as(first)).removeprefix("with "),
    )  # fmt: skip
    return Takeaway(text, run_id, twin.id, interval, interval.verdict() if interval else None)


def _ratio_words(ratio: float) -> str:
    return f"{ratio:.2f}x lower" if ratio >= 1 else f"{1 / ratio:.2f}x higher"


def _dense_text(record: RunRecord, source: str) -> str:
    dense = record.dense_perplexity.get(source)
    return f" (the unpruned model: {_ppl(dense)})" if dense is not None else ""


def _alone(records: Sequence[RunRecord], focus: RunRecord, source: str, lead: str, missing: str, compensation: str) -> str:
    """The sentence for a run nothing compares with: its own numbers, what is missing, and the
    nearest thing there is (a run at another budget, or at this budget on other terms)."""
    nll = window_series(focus, source, "nll")
    own = (
        f"{lead}, {allocator_name(focus.allocator)} (run {focus.id}) gives perplexity "
        f"{_with_interval(focus.perplexity[source], perplexity_interval([nll]) if nll else None)} on {source}{_dense_text(focus, source)}."
    )
    wanted = [r for r in records if r.allocator == missing and r.id != focus.id and r.model == focus.model]
    key = windows_key(focus)
    here = [r for r in wanted if same_budget(r.budget, focus.budget)]
    same_windows = [r for r in wanted if key is not None and windows_key(r) == key and fitted_as(r) == compensation]
    note = ""
    if here:
        other = max(here, key=lambda r: r.id or 0)
        why = "other held-out windows" if windows_key(other) != key else f"compensation {fitted_as(other)}"
        note = f" Run {other.id} ({missing} at this budget) was measured with {why}, so it is not compared."
    elif same_windows:
        nearest = min(same_windows, key=lambda r: (abs((r.budget or 0) - (focus.budget or 0)), -(r.id or 0)))
        note = f" The nearest is run {nearest.id} at {(nearest.budget or 0):.2%}."
    return (
        f"{own} No {missing}{' (GAP)' if missing == GAP_ALLOCATOR else ''} run at this budget on these held-out windows yet: "
        f"prune with the {missing} allocator at {(focus.budget or 0):.2%} to compare.{note}"
    )


@dataclass(frozen=True)
class RunStory:
    """What a stakeholder is shown about one run: its takeaway, and the measured frontier of the
    runs it compares with (same model and held-out windows), the dense model's perplexity beside it."""

    takeaway: Takeaway
    compensation: Takeaway | None  # the same plan with and without compensation (`compensation_takeaway`); None: not measured both ways
    frontier: list[MeasuredPoint]  # `measured.measured_frontier` of the run's comparable runs
    dense: Interval | None  # the dense model's perplexity on the frontier's source; None: no run kept it per window


def run_story(records: Sequence[RunRecord], run_id: int) -> RunStory:
    """The takeaway and measured frontier of run ``run_id`` among ``records`` (the history, oldest first).

    Raises:
        HistoryError: no run ``run_id`` among ``records``.
    """
    said = takeaway(records, run_id)
    focus = next(r for r in records if r.id == run_id)
    points = measured_frontier(records, focus)
    dense = dense_interval(comparable_runs(records, focus), points[0].source) if points else None
    return RunStory(said, compensation_takeaway(records, run_id), points, dense)
