"""Run history: every prune-and-evaluate run, kept in SQLite across sessions.

One row per run in ``<cache root>/runs/history.sqlite`` (table ``runs``): when it ran, the
model and loss table, the allocator and budget, the plan itself (JSON), the
settings used, the predicted loss increase and the measured one on the calibration
windows, held-out perplexities, KL to the dense model, throughput ratios, greedy
generations and where the pruned checkpoint was saved. Dict-valued fields are stored as
JSON text; :func:`list_runs` flattens them into columns (``ppl:<source>``,
``kl:<source>``, ...) for tables, charts and CSV export.

SQLite serialises writers itself; every call opens its own short-lived connection, so the
module is safe from several threads and processes.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import io
import re
import shutil
import sqlite3
import zipfile
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import pandas as pd

from gap_engine.core.errors import HistoryError, InvariantError
from gap_engine.core.fsutil import cache_root
from gap_engine.core.jsontext import json_text
from gap_engine.core.validate import MAX_PARAMS, check_int, check_number, parse_json
from gap_engine.prune.compensations import fit_name

HISTORY_FILE = "history.sqlite"
# Version 2 renamed the column "method" to "allocator" (migrated in place on open).
SCHEMA_VERSION = 2

_SCHEMA = """
CREATE TABLE IF NOT EXISTS runs (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    created TEXT NOT NULL,
    model TEXT NOT NULL,
    table_key TEXT,
    allocator TEXT NOT NULL,
    budget REAL,
    plan_json TEXT NOT NULL,
    params_json TEXT NOT NULL,
    dense_params INTEGER,
    pruned_params INTEGER,
    predicted_loss REAL,
    actual_loss REAL,
    perplexity_json TEXT NOT NULL,
    dense_perplexity_json TEXT NOT NULL,
    kl_json TEXT NOT NULL,
    top1_json TEXT NOT NULL,
    prefill_speedup REAL,
    decode_speedup REAL,
    generations_json TEXT NOT NULL,
    checkpoint TEXT,
    seconds REAL,
    note TEXT,
    tasks_json TEXT NOT NULL DEFAULT '{}'
);
CREATE TABLE IF NOT EXISTS run_makers (
    run_id INTEGER PRIMARY KEY,
    maker TEXT NOT NULL
);
"""
# run_makers: which browser made a run, as an opaque digest the explorer gives it (runs made by
# the CLI have none); the explorer offers a run's Delete only to its maker. A table of its own,
# so a history written before it opens unchanged and the run rows never carry it into exports.
MAKER = re.compile(r"[0-9a-f]{16,64}")

MAX_RUN_ID = (1 << 63) - 1  # SQLite's largest row id

# Columns of list_runs() before the flattened per-source ones.
BASE_COLUMNS = [
    "id",
    "created",
    "model",
    "table_key",
    "allocator",
    "budget",
    "dense_params",
    "pruned_params",
    "predicted_loss",
    "actual_loss",
    "prefill_speedup",
    "decode_speedup",
    "checkpoint",
    "seconds",
    "note",
]


@dataclass
class RunRecord:
    """One prune-and-evaluate run, as stored."""

    model: str  # dense model name
    allocator: str  # how the budget was spread (dp, uniform, flap, owl, evo, manual)
    plan: dict[str, Any]  # RatePlan.to_dict()
    table_key: str | None = None  # loss table behind the plan, if any
    budget: float | None = None  # requested fraction of prunable parameters removed
    params: dict[str, Any] = field(default_factory=dict)  # calibration and evaluation settings
    dense_params: int | None = None  # parameters before pruning
    pruned_params: int | None = None  # parameters after
    predicted_loss: float | None = None  # the table's predicted objective increase
    actual_loss: float | None = None  # measured objective increase on the calibration windows
    perplexity: dict[str, float] = field(default_factory=dict)  # source -> held-out perplexity of the pruned model
    dense_perplexity: dict[str, float] = field(default_factory=dict)  # source -> the dense model's
    kl: dict[str, float] = field(default_factory=dict)  # source -> mean KL(dense || pruned) per token
    top1: dict[str, float] = field(default_factory=dict)  # source -> top-1 agreement with dense
    prefill_speedup: float | None = None  # pruned / dense prefill tokens per second
    decode_speedup: float | None = None  # pruned / dense decode tokens per second
    generations: list[dict[str, Any]] = field(default_factory=list)  # [{"prompt", "model", "dense"}]
    checkpoint: str | None = None  # folder of the saved pruned checkpoint
    seconds: float | None = None  # wall time of the run
    note: str = ""  # free text
    tasks: dict[str, Any] = field(
        default_factory=dict
    )  # {"model": {task: score}, "dense": {task: score}} from lm-eval (``gap eval --tasks``)
    created: str = field(default_factory=lambda: _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"))
    id: int | None = None  # assigned by the database

    @classmethod
    def from_report(
        cls,
        plan: dict[str, Any],
        report: dict[str, Any],
        *,
        allocator: str,
        table_key: str | None = None,
        budget: float | None = None,
        params: dict[str, Any] | None = None,
        predicted_loss: float | None = None,
        actual_loss: float | None = None,
        checkpoint: str | None = None,
        seconds: float | None = None,
    ) -> RunRecord:
        """A record from a plan dict and an ``EvalReport.to_dict()``."""
        dense = report.get("dense") or {}
        throughput = report.get("throughput") or {}
        plan_params = plan.get("params") or {}
        params = dict(params or {})
        if report.get("per_window"):  # a few numbers per window: two runs on the same windows then compare with an interval
            params.setdefault("per_window", report["per_window"])
        return cls(
            model=str(plan.get("model", report.get("model", "?"))),
            allocator=allocator,
            plan=plan,
            table_key=table_key,
            budget=budget,
            params=params,
            dense_params=dense.get("params", plan_params.get("dense_total")),
            pruned_params=report.get("params"),
            predicted_loss=predicted_loss,
            actual_loss=actual_loss,
            perplexity=dict(report.get("perplexity") or {}),
            dense_perplexity=dict(dense.get("perplexity") or {}),
            kl=dict(report.get("kl_to_dense") or {}),
            top1=dict(report.get("top1_agreement") or {}),
            prefill_speedup=throughput.get("prefill_speedup"),
            decode_speedup=throughput.get("decode_speedup"),
            generations=list(report.get("generations") or []),
            checkpoint=checkpoint,
            seconds=seconds if seconds is not None else report.get("seconds"),
            tasks=task_scores_of(report),
        )


def task_scores_of(report: dict[str, Any]) -> dict[str, Any]:
    """``{"model": ..., "dense": ...}`` task scores of an ``EvalReport.to_dict()`` ({} without tasks)."""
    model, dense = report.get("task_accuracy") or {}, report.get("dense_task_accuracy") or {}
    return {"model": dict(model), "dense": dict(dense)} if model or dense else {}


def history_path() -> Path:
    """Where the history lives: ``<cache root>/runs/history.sqlite``."""
    return cache_root() / "runs" / HISTORY_FILE


@contextlib.contextmanager
def _connect(path: Path | None = None) -> Iterator[sqlite3.Connection]:
    path = Path(path) if path is not None else history_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        conn = sqlite3.connect(str(path), timeout=30)
    except (OSError, sqlite3.Error) as exc:
        raise HistoryError(f"cannot open the run history {path}: {exc}") from None
    try:
        conn.row_factory = sqlite3.Row
        conn.executescript(_SCHEMA)
        _migrate(conn)
        with conn:  # one transaction, committed on success
            yield conn
    except sqlite3.DatabaseError as exc:
        raise HistoryError(f"the run history {path} is unreadable: {exc}") from None
    finally:
        conn.close()


def _migrate(conn: sqlite3.Connection) -> None:
    """Bring a history written by an older version to this schema, in place."""
    columns = {row[1] for row in conn.execute("PRAGMA table_info(runs)")}
    if "method" in columns and "allocator" not in columns:
        conn.execute("ALTER TABLE runs RENAME COLUMN method TO allocator")
    if "tasks_json" not in columns:  # histories written before task accuracy
        conn.execute("ALTER TABLE runs ADD COLUMN tasks_json TEXT NOT NULL DEFAULT '{}'")
    if conn.execute("PRAGMA user_version").fetchone()[0] != SCHEMA_VERSION:  # reading alone writes nothing
        conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")


# RunRecord fields stored as JSON text, in a column named "<field>_json".
_JSON_FIELDS = frozenset({"plan", "params", "perplexity", "dense_perplexity", "kl", "top1", "generations", "tasks"})


def _column(name: str) -> str:
    return f"{name}_json" if name in _JSON_FIELDS else name


def record_run(record: RunRecord, path: Path | None = None) -> int:
    """Store one run; returns its id."""
    values = {
        _column(name): json_text(value, f"run history {name}", sort_keys=True, default=str) if name in _JSON_FIELDS else value
        for name, value in asdict(record).items()
        if name != "id"
    }
    columns = ", ".join(values)
    marks = ", ".join(f":{name}" for name in values)
    with _connect(path) as conn:
        cursor = conn.execute(f"INSERT INTO runs ({columns}) VALUES ({marks})", values)
        run_id = cursor.lastrowid
        if run_id is None:
            raise InvariantError("the INSERT set no row id")
        return run_id


# How each RunRecord field must look when read back (validate.py's rules, like any file).
_DICT_FIELDS = frozenset({"plan", "params", "perplexity", "dense_perplexity", "kl", "top1", "tasks"})
_NUMBER_FIELDS = frozenset({"budget", "predicted_loss", "actual_loss", "prefill_speedup", "decode_speedup", "seconds"})
_COUNT_FIELDS = frozenset({"dense_params", "pruned_params", "id"})
_ROW_BYTES = 16 << 20  # one JSON column of one row


def _field_from_row(name: str, raw: Any, run: str) -> Any:
    """One column's value, checked: HistoryError (one line) for anything a run never stores."""
    what = f"{run} {name}"
    if name in _JSON_FIELDS:
        if not isinstance(raw, str) or len(raw) > _ROW_BYTES:
            raise HistoryError(f"{what} is not stored as JSON text")
        value = parse_json(raw, what, HistoryError)
        if name in _DICT_FIELDS and not isinstance(value, dict):
            raise HistoryError(f"{what} must be an object")
        if name == "generations" and not isinstance(value, list):
            raise HistoryError(f"{what} must be a list")
        if name in ("perplexity", "dense_perplexity", "kl", "top1"):
            for source, number in value.items():
                check_number(number, f"{what}[{str(source)[:40]!r}]", HistoryError)
        return value
    if raw is None:
        return None
    if name in _NUMBER_FIELDS:
        return check_number(raw, what, HistoryError)
    if name in _COUNT_FIELDS:
        return check_int(raw, what, HistoryError, 0, MAX_PARAMS)
    if not isinstance(raw, str):
        raise HistoryError(f"{what} must be a text, got {type(raw).__name__}")
    return raw


def _record_from_row(row: sqlite3.Row) -> RunRecord:
    run = f"history run {row['id']}"
    values = {spec.name: _field_from_row(spec.name, row[_column(spec.name)], run) for spec in fields(RunRecord)}
    values["note"] = values["note"] or ""
    if not isinstance(values["model"], str) or not isinstance(values["allocator"], str):
        raise HistoryError(f"{run} has no model or allocator")
    return RunRecord(**values)


def get_run(run_id: int, path: Path | None = None) -> RunRecord:
    """One stored run; HistoryError when there is none with this id."""
    if hasattr(run_id, "__index__") and not isinstance(run_id, bool):
        run_id = run_id.__index__()  # numpy integers from a table of runs
    check_int(run_id, "run id", HistoryError, 1, MAX_RUN_ID)
    with _connect(path) as conn:
        row = conn.execute("SELECT * FROM runs WHERE id = ?", (int(run_id),)).fetchone()
    if row is None:
        raise HistoryError(f"no run with id {run_id} in the history")
    return _record_from_row(row)


def runs(path: Path | None = None) -> list[RunRecord]:
    """Every stored run, oldest first."""
    with _connect(path) as conn:
        rows = conn.execute("SELECT * FROM runs ORDER BY id").fetchall()
    return [_record_from_row(r) for r in rows]


def compensation_of(record: RunRecord) -> str:
    """What the run's kept units got after the cut ("none" for runs without, and for runs recorded before there was any)."""
    recorded = (record.params or {}).get("compensation")
    return str(recorded.get("mode") or "none") if isinstance(recorded, dict) else "none"


def fitted_as(record: RunRecord) -> str:
    """The run's compensation as two compared runs must share it: its mode (``compensation_of``), named as fitted
    through the output norms where its fit counted tokens so (Gemma 3's default) rather than alike (``fit_name``)."""
    recorded = (record.params or {}).get("compensation")
    return fit_name(compensation_of(record), recorded.get("weighting") if isinstance(recorded, dict) else None)


def bias_params_of(record: RunRecord) -> int:
    """The parameters the run's compensation added as biases (0 for runs without, and for runs recorded before they were counted)."""
    recorded = (record.params or {}).get("compensation")
    value = recorded.get("bias_params") if isinstance(recorded, dict) else None
    return int(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else 0


def net_removed_of(record: RunRecord) -> int | None:
    """The net change of the parameter count: dense minus pruned, the compensation's biases counted (None: not recorded)."""
    if record.dense_params is None or record.pruned_params is None:
        return None
    return int(record.dense_params) - int(record.pruned_params)


def list_runs(path: Path | None = None) -> pd.DataFrame:
    """All runs as one flat table, oldest first.

    Columns: BASE_COLUMNS, ``plan_hash``, ``compensation``, ``bias_params`` (what its biases added;
    ``pruned_params`` counts them), ``net_removed`` (dense minus pruned), then per held-out source ``ppl:<source>``,
    ``dense_ppl:<source>``, ``kl:<source>``, ``top1:<source>``, then per lm-eval task
    ``acc:<task>``, ``acc_stderr:<task>``, ``acc_norm:<task>`` and the same with ``dense_``. An empty history gives an
    empty frame with the base columns.
    """
    records = runs(path)
    rows = []
    for record in records:
        row = {name: getattr(record, name) for name in BASE_COLUMNS}
        row["plan_hash"] = (record.params or {}).get("plan_hash")  # RatePlan.content_hash of the pruned plan
        row["compensation"] = fitted_as(record)
        row["bias_params"] = bias_params_of(record)
        row["net_removed"] = net_removed_of(record)
        for prefix, values in (
            ("ppl", record.perplexity),
            ("dense_ppl", record.dense_perplexity),
            ("kl", record.kl),
            ("top1", record.top1),
        ):
            for source, value in values.items():
                row[f"{prefix}:{source}"] = value
        for prefix, scores in (("", (record.tasks or {}).get("model") or {}), ("dense_", (record.tasks or {}).get("dense") or {})):
            for task, score in scores.items():
                for metric in ("acc", "acc_stderr", "acc_norm"):
                    if score.get(metric) is not None:
                        row[f"{prefix}{metric}:{task}"] = score[metric]
        rows.append(row)
    frame = pd.DataFrame(rows)
    if frame.empty:
        return pd.DataFrame(columns=BASE_COLUMNS)
    return frame


def to_csv(path: Path | None = None) -> str:
    """The flat run table as CSV text (header only when empty)."""
    text: str = list_runs(path).to_csv(index=False)
    return text


def set_run_maker(run_id: int, maker: str, path: Path | None = None) -> None:
    """Record who made a run: ``maker`` is an opaque digest (16 to 64 lowercase hex digits).

    Raises:
        HistoryError: a maker of another form, or no run with this id.
    """
    if not isinstance(maker, str) or not MAKER.fullmatch(maker):
        raise HistoryError("a run's maker must be 16 to 64 lowercase hex digits")
    get_run(run_id, path)
    with _connect(path) as conn:
        conn.execute("INSERT OR REPLACE INTO run_makers (run_id, maker) VALUES (?, ?)", (int(run_id), maker))


def run_makers(path: Path | None = None) -> dict[int, str]:
    """Run id -> its maker, for the runs that have one (a row of another form is left out)."""
    with _connect(path) as conn:
        rows = conn.execute("SELECT run_id, maker FROM run_makers").fetchall()
    return {int(r[0]): str(r[1]) for r in rows if isinstance(r[0], int) and isinstance(r[1], str) and MAKER.fullmatch(r[1])}


def delete_run(run_id: int, path: Path | None = None, remove_checkpoint: bool = False) -> None:
    """Remove one run; HistoryError when there is none with this id.

    Args:
        remove_checkpoint: also delete its checkpoint folder, when that folder lies under
            ``checkpoints_root()`` (a folder elsewhere is never touched).
    """
    record = get_run(run_id, path)
    with _connect(path) as conn:
        conn.execute("DELETE FROM runs WHERE id = ?", (int(run_id),))
        conn.execute("DELETE FROM run_makers WHERE run_id = ?", (int(run_id),))
    if remove_checkpoint and record.checkpoint:
        folder = Path(record.checkpoint).resolve()
        root = checkpoints_root().resolve()
        if folder.is_dir() and root in folder.parents:
            shutil.rmtree(folder, ignore_errors=True)


def checkpoints_root() -> Path:
    """Where the app saves the pruned checkpoints of its runs: ``<cache root>/runs/checkpoints``."""
    return cache_root() / "runs" / "checkpoints"


def new_checkpoint_dir(allocator: str, budget: float | None) -> Path:
    """A fresh, not yet existing folder under `checkpoints_root` for one run's checkpoint."""
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    tag = f"{allocator}-{budget:.3f}" if budget is not None else allocator
    base = checkpoints_root() / f"run-{stamp}-{tag}"
    candidate, n = base, 1
    while candidate.exists():
        n += 1
        candidate = base.with_name(f"{base.name}-{n}")
    return candidate


def checkpoint_zip(folder: str | Path) -> bytes:
    """A saved checkpoint folder as zip bytes (stored, not compressed: safetensors barely shrink).

    Raises:
        HistoryError: the folder is gone.
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise HistoryError(f"checkpoint folder {folder} does not exist (deleted, or saved on another machine)")
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", compression=zipfile.ZIP_STORED) as archive:
        for file in sorted(p for p in folder.rglob("*") if p.is_file()):
            archive.write(file, arcname=f"{folder.name}/{file.relative_to(folder)}")
    return buffer.getvalue()


def clear(path: Path | None = None) -> int:
    """Remove every run; returns how many there were."""
    with _connect(path) as conn:
        conn.execute("DELETE FROM run_makers")
        return int(conn.execute("DELETE FROM runs").rowcount)
