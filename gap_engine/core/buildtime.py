"""What a job will take on this machine, from what the same stages took before.

Table builds record each stage's wall seconds in their cache entry (``cache.put_table``:
meta.json's ``stage_seconds``), and prune-and-evaluate runs in the run history (the run's
settings, ``stage_seconds``). A new job's stage is expected to take what the same stage of
earlier jobs of the same model took per unit of its work, times its own work: tokens read
for the forward and backward passes, tokens x rates for exact cells, prompts x new tokens
for generations, one for a stage whose cost does not grow with the settings. The median
over earlier jobs keeps one slow run (a busy machine) from setting the estimate. Entries
written before stage times were recorded give their whole ``build_seconds`` to the main
measurement stage.

Loading the model is not in either record: the job layer knows whether the model is in
memory (``jobs.model_load_seconds``) and passes that in.

A cost model that prices the work from the model's shape and a measured device profile
answers where no earlier job did; until one is wired in (the app's Setup page has the
hook), an expectation with no earlier job leaves stages unknown and says so.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any

from gap_engine.core.progress import (
    CELLS,
    DENSE_PASS,
    GENERATE,
    GRADIENT_PASS,
    HELD_OUT,
    LOAD_MODEL,
    MEASURE,
    PLAN,
    PRUNE,
    READ_TEXT,
    SCORE_UNITS,
)


@dataclass
class Expectation:
    """Expected seconds per stage of one job, and what they rest on."""

    seconds: dict[str, float | None] = field(default_factory=dict)  # stage -> expected seconds, or None when unknown
    jobs: int = 0  # earlier jobs the numbers come from
    basis: str = ""  # where the numbers come from, in a few words

    @property
    def total(self) -> float | None:
        """The whole job's expected seconds; None while any stage is unknown."""
        if not self.seconds or any(v is None for v in self.seconds.values()):
            return None
        return float(sum(v for v in self.seconds.values() if v is not None))

    @property
    def known(self) -> dict[str, float]:
        """The stages with an expectation (what a job's ETA can use)."""
        return {stage: s for stage, s in self.seconds.items() if s is not None}

    def unknown(self) -> list[str]:
        return [stage for stage, s in self.seconds.items() if s is None]


def _median_rate(samples: list[tuple[float, float]]) -> float | None:
    """Median seconds per unit of work over (seconds, work) samples with work > 0."""
    rates = [seconds / work for seconds, work in samples if work > 0 and seconds is not None and seconds >= 0]
    return statistics.median(rates) if rates else None


# ---- loss tables ------------------------------------------------------------------------------
def _table_work(spec: dict[str, Any], stage: str) -> float:
    """The work of one table stage under a spec summary (see the module docstring)."""
    tokens = float(spec.get("n_samples") or 0) * float(spec.get("seq_len") or 0)
    if stage == READ_TEXT:
        return 1.0
    if stage == CELLS:
        return tokens * max(len(spec.get("rate_grid") or ()) - 1, 0)
    return tokens


def _table_matches(row_spec: dict[str, Any], spec: dict[str, Any], stage: str) -> bool:
    """Whether an earlier build's stage is comparable with this one's."""
    same = {
        READ_TEXT: ("data",),
        SCORE_UNITS: ("criterion",),
        DENSE_PASS: ("estimator",),
        GRADIENT_PASS: ("estimator", "objective"),
        CELLS: ("estimator", "mode", "objective"),
    }[stage]
    return all(row_spec.get(name) == spec.get(name) for name in same)


def table_expectation(
    model: str, spec: dict[str, Any], rows: list[dict[str, Any]], stages: tuple[str, ...], load_seconds: float | None
) -> Expectation:
    """Expected seconds of each stage of a table job, from earlier builds of the same model.

    Args:
        model: the model name the job loads.
        spec: the table's ``TableSpec.summary()``.
        rows: ``cache.list_tables()``: earlier builds on this machine.
        stages: the job's stages (``pipeline.table_stages``).
        load_seconds: what loading the model costs now (0: in memory; None: unknown).
    Returns:
        An Expectation (stages without a comparable earlier build are None).
    """
    mine = [row for row in rows if row.get("model") == model and isinstance(row.get("spec"), dict)]
    seconds: dict[str, float | None] = {}
    used: set[str] = set()
    for stage in stages:
        if stage == LOAD_MODEL:
            seconds[stage] = load_seconds
            continue
        samples = [
            (row["stage_seconds"][stage], _table_work(row["spec"], stage), row["key"])
            for row in mine
            if stage in (row.get("stage_seconds") or {}) and _table_matches(row["spec"], spec, stage)
        ]
        rate = _median_rate([(s, w) for s, w, _ in samples])
        seconds[stage] = None if rate is None else rate * _table_work(spec, stage)
        used.update(key for _, _, key in samples)
    _older_builds(mine, spec, stages, seconds, used)
    return Expectation(seconds, len(used), _basis(len(used), "build"))


def _older_builds(
    rows: list[dict[str, Any]], spec: dict[str, Any], stages: tuple[str, ...], seconds: dict[str, float | None], used: set[str]
) -> None:
    """Entries without stage times (older ones): their build_seconds covers scoring and the
    measurement; give it to the main stage when nothing better is known."""
    main = stages[-1]
    if seconds.get(main) is not None:
        return
    comparable = [
        row for row in rows
        if not row.get("stage_seconds") and row.get("build_seconds") and _table_matches(row["spec"], spec, main)
    ]  # fmt: skip

    def work(summary: dict[str, Any]) -> float:
        return _table_work(summary, main) + (_table_work(summary, SCORE_UNITS) if main == CELLS else 0.0)

    rate = _median_rate([(row["build_seconds"], work(row["spec"])) for row in comparable])
    if rate is None:
        return
    seconds[main] = rate * work(spec)
    for stage in stages:
        if stage not in (LOAD_MODEL, READ_TEXT, main) and seconds.get(stage) is None:
            seconds[stage] = 0.0  # inside the build time given to the main stage
    used.update(row["key"] for row in comparable)


# ---- prune and evaluate ----------------------------------------------------------------------
def run_settings(calibration: dict[str, Any], evaluation: dict[str, Any], allocator: str) -> dict[str, Any]:
    """The settings a prune-and-evaluate run's stage times depend on (flat)."""
    windows = evaluation.get("windows") or {}
    return {
        "allocator": allocator,
        "calib_tokens": float(calibration.get("n_samples") or 0) * float(calibration.get("seq_len") or 0),
        "eval_tokens": float(windows.get("n_samples") or 0)
        * float(windows.get("seq_len") or 0)
        * max(len(str(windows.get("data") or "").split(",")), 1),
        "generated": float(evaluation.get("generations") or 0) * float(evaluation.get("max_new_tokens") or 0),
    }


def _run_work(settings: dict[str, Any], stage: str) -> float:
    work: dict[str, float] = {
        PRUNE: settings["calib_tokens"],
        MEASURE: settings["calib_tokens"],
        HELD_OUT: settings["eval_tokens"],
        GENERATE: settings["generated"],
    }
    return work.get(stage, 1.0)


def run_expectation(
    model: str, settings: dict[str, Any], records: list[Any], stages: tuple[str, ...], load_seconds: float | None
) -> Expectation:
    """Expected seconds of each stage of a prune-and-evaluate job, from earlier runs.

    Args:
        model: the dense model's name.
        settings: `run_settings` of the new run.
        records: ``history.runs()``: earlier runs (those with stage times are used).
        stages: the job's stages (``pipeline.prune_eval_stages``).
        load_seconds: what loading the dense model costs now (0: in memory; None: unknown).
    """
    earlier = []
    for record in records:
        params = record.params or {}
        if record.model == model and params.get("stage_seconds"):
            earlier.append(
                (params["stage_seconds"], run_settings(params.get("calibration") or {}, params.get("eval") or {}, record.allocator))
            )
    seconds: dict[str, float | None] = {}
    used = 0
    for stage in stages:
        if stage == LOAD_MODEL:
            seconds[stage] = load_seconds
            continue
        samples = [
            (times[stage], _run_work(theirs, stage))
            for times, theirs in earlier
            if stage in times and (stage != PLAN or theirs["allocator"] == settings["allocator"])
        ]
        rate = _median_rate(samples)
        seconds[stage] = None if rate is None else rate * _run_work(settings, stage)
        used = max(used, len(samples))
    return Expectation(seconds, used, _basis(used, "run"))


def with_prediction(expected: Expectation, predicted: dict[str, float] | None, source: str = "the cost model") -> Expectation:
    """``expected`` with the stages no earlier job measured filled in from a prediction.

    Args:
        expected: from `table_expectation` or `run_expectation`.
        predicted: stage -> predicted seconds (``costmodel.stage_seconds``); None: none.
        source: what predicted them, named in the basis.
    Returns:
        A new Expectation whose basis says which stages are predicted, not measured; the
        job's own rates replace them once its stages run (``jobs.JobProgress``).
    """
    predicted = predicted or {}
    filled = [stage for stage, s in expected.seconds.items() if s is None and predicted.get(stage) is not None]
    if not filled:
        return expected
    seconds = {stage: (predicted[stage] if stage in filled else s) for stage, s in expected.seconds.items()}
    basis = f"{PREDICTION_WORD} by {source} for {', '.join(filled)}; {expected.basis}"
    return Expectation(seconds, expected.jobs, basis)


PREDICTION_WORD = "predicted"  # how a basis marks seconds that no job on this machine measured


CACHED_BASIS = "a table with these settings is cached here: Build reads it instead of building"


def cached_table_expectation(
    model: str, spec: dict[str, Any], key_prefix: str, rows: list[dict[str, Any]], load_seconds: float | None
) -> Expectation | None:
    """What Build costs when the cache already holds its table, or None when it does not.

    A hit still loads the model and reads the text (both enter the key: the weights'
    fingerprint and the text's), then reads the table instead of building it; pricing it as a
    build said 16 s for a click that took 2.4 s.

    Args:
        model: the model name the job loads.
        spec: the table's ``TableSpec.summary()``.
        key_prefix: ``tables.artefact.key_prefix`` of the model, dtype and spec (the dtype is in the
            key's readable prefix, not in the entry's summary).
        rows: ``cache.list_tables()``.
        load_seconds: what loading the model costs now (0: in memory; None: unknown).
    """
    hits = [row for row in rows if row.get("model") == model and row.get("spec") == spec and str(row.get("key", "")).startswith(key_prefix)]
    if not hits:
        return None
    reads = [row["stage_seconds"][READ_TEXT] for row in hits if READ_TEXT in (row.get("stage_seconds") or {})]
    return Expectation({LOAD_MODEL: load_seconds, READ_TEXT: statistics.median(reads) if reads else None}, len(hits), CACHED_BASIS)


def _basis(count: int, what: str) -> str:
    if not count:
        return f"no earlier {what} of this model on this machine"
    return f"from {count} earlier {what}{'s' if count > 1 else ''} on this machine"
