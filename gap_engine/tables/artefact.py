"""The loss table: GAP's measurement artefact, its settings and its file format.

For every component (a block's attention, or its MLP; or the whole block in ``block``
mode) and every rate on a grid, a loss table holds how much the model's *global* objective
grows when only that component is pruned at that rate and everything else stays dense
(GAP, EMNLP 2025). One row is one layer's sensitivity curve; the planner picks one rate
per row under a global parameter budget.

This module defines what a table *is* (``TableSpec``: how it is measured; ``LossTable``:
the values, JSON and CSV forms, the isotonic smoothing and the cache key); filling one is
the job of ``tables.exact`` (measured cells), ``tables.estimate`` (gradient estimates) and
``tables.refine`` (an estimate with exactly measured cells where the plans go). Every table
records, per cell, whether its value was measured or estimated and on how many token
positions, and how its calibration windows started (with the model's BOS token or with text).
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

import numpy as np

from gap_engine.core.config import (
    ATTENTION_TIE_RULE,
    DEFAULT_CHANNEL_MULTIPLE,
    DEFAULT_CRITERION,
    MODES,
    REFERENCE_TABLE,
    REFINE_ATTENTION,
    REFINE_BUDGETS,
    StoredWindowSpec,
    WindowSpec,
)
from gap_engine.core.deprecation import warn_deprecated
from gap_engine.core.device import SHORT_DTYPE_NAMES, dtype_name, placement_of
from gap_engine.core.errors import DataError, TableError, first_line
from gap_engine.core.jsontext import json_text
from gap_engine.core.validate import check_int, check_table_document, parse_json
from gap_engine.core.validate_meaning import check_removed_matches, check_table_cells
from gap_engine.data.bos import WINDOW_STARTS, window_start
from gap_engine.data.sources import mix_refusal
from gap_engine.prune.compensations import COMPENSATIONS
from gap_engine.prune.criteria import CRITERIA, SCORING_CRITERIA
from gap_engine.tables.estimators import ESTIMATORS
from gap_engine.tables.objectives import OBJECTIVES

if TYPE_CHECKING:
    from collections.abc import Iterable, Sequence

    import numpy.typing as npt

    from gap_engine.model.loaded import LoadedModel

# 2: windows start as the model expects (its BOS token, never counted), and every cell
# records whether it was measured and on how many positions. Tables of version 1 were
# measured on Gemma windows without BOS and are never read back.
TABLE_FORMAT_VERSION = 2
# Spec fields that are not the windows' own, in their summary order.
_WINDOW_FIELDS = ("data", "n_samples", "seq_len", "seed")
# Spec fields that only a refined table has (left out of other tables' summaries and keys).
_REFINE_FIELDS = ("refine_budgets", "refine_attention", "refine_neighbours")


@dataclass(frozen=True)
class TableSpec:
    """How to measure a loss table (everything that changes its numbers, plus batch size)."""

    windows: WindowSpec = REFERENCE_TABLE.windows  # calibration windows (text source or sources, count, length, seed, batch size)
    criterion: str = DEFAULT_CRITERION  # within-layer importance: which heads/channels a rate removes
    rate_grid: tuple[float, ...] = REFERENCE_TABLE.rate_grid  # candidate rates, ascending, starting at 0
    objective: str = REFERENCE_TABLE.objective  # "nll": mean next-token NLL; "kl": mean KL(dense || pruned) per position
    mode: str = "split"  # "split": attention and MLP are separate components; "block": one per layer, same rate
    estimator: str = REFERENCE_TABLE.estimator  # "exact" (measured) | "taylor" (first order) | "fisher" (second order, diagonal Fisher) | "refine" (fisher, then exact cells where plans go)
    channel_multiple: int = DEFAULT_CHANNEL_MULTIPLE  # MLP widths are kept in multiples of this
    refine_budgets: tuple[float, ...] = REFINE_BUDGETS  # refine: budgets whose DP plans' cells are measured exactly
    refine_attention: str = "chosen"  # refine: "chosen" attention cells only, or "all" attention cells from the start
    refine_neighbours: int = 1  # refine: grid steps measured on each side of a chosen rate
    # Measured cells include this compensation of the cut block (prune.compensations): the
    # cell's loss is then that of what surgery with it ships. Estimators measure no cell, so
    # only "none" fits them. Left out of the summary (and the key) when "none".
    compensation: str = "none"

    def validate(self) -> TableSpec:
        """Raise TableError (one line) for any value the builder cannot use."""
        if not isinstance(self.windows, WindowSpec):
            raise TableError("table windows must be a WindowSpec")
        try:
            self.windows.validate()
        except DataError as exc:
            raise TableError(f"table {exc}") from None
        refusal = mix_refusal(self.windows.sources(), self.windows.n_samples)
        if refusal is not None:
            raise TableError(refusal)
        check_int(self.channel_multiple, "table channel_multiple", TableError, low=1)
        if self.criterion in CRITERIA and self.criterion not in SCORING_CRITERIA:
            raise TableError(
                f"criterion '{self.criterion}' chooses units while pruning; a table needs one of {', '.join(SCORING_CRITERIA)}"
            )
        choices = (
            ("criterion", SCORING_CRITERIA), ("objective", OBJECTIVES), ("mode", MODES), ("estimator", ESTIMATORS), ("compensation", COMPENSATIONS),
        )  # fmt: skip
        for name, registry in choices:
            if getattr(self, name) not in registry:
                what = "criterion" if name == "criterion" else f"table {name}"
                raise TableError(f"unknown {what} '{getattr(self, name)}'; choose one of {', '.join(registry)}")
        if self.compensation != "none" and not ESTIMATORS[self.estimator].measures_cells:
            raise TableError(
                f"the {self.estimator} estimate measures no cell, so its cells cannot include compensation "
                f"('{self.compensation}'); use the exact or refine estimator, or compensation none"
            )
        if self.estimator == "taylor" and self.objective == "kl":
            raise TableError("the first-order (taylor) estimate of the KL objective is identically zero; use fisher or nll")
        grid = self.rate_grid
        if not isinstance(grid, tuple) or len(grid) < 2:
            raise TableError(f"rate grid must hold at least two rates, got {grid!r}")
        for rate in grid:
            if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not (0.0 <= rate < 1.0):
                raise TableError(f"rate {rate!r} is outside [0, 1)")
        if any(b <= a for a, b in zip(grid, grid[1:])):
            raise TableError(f"rate grid must be strictly increasing (sorted, no duplicates), got {list(grid)}")
        if grid[0] != 0:
            raise TableError(f"rate grid must start at 0 (the dense option), got {list(grid)}")
        if self.estimator == "refine":
            self._validate_refine()
        return self

    def _validate_refine(self) -> None:
        budgets = self.refine_budgets
        if not isinstance(budgets, tuple) or not budgets:
            raise TableError(f"refine budgets must be a non-empty list of fractions, got {budgets!r}")
        for budget in budgets:
            if isinstance(budget, bool) or not isinstance(budget, (int, float)) or not (0.0 < budget < 1.0):
                raise TableError(f"refine budget {budget!r} is outside (0, 1)")
        if self.refine_attention not in REFINE_ATTENTION:
            raise TableError(f"unknown refine_attention '{self.refine_attention}'; choose one of {', '.join(REFINE_ATTENTION)}")
        check_int(self.refine_neighbours, "refine_neighbours", TableError, low=0, high=3)

    def summary(self) -> dict[str, Any]:
        """The fields that identify a table, flat, for listings, cache metadata and the key."""
        out = {name: getattr(self.windows, name) for name in _WINDOW_FIELDS}
        skipped = {"windows"} | (set() if self.estimator == "refine" else set(_REFINE_FIELDS))
        skipped |= {"compensation"} if self.compensation == "none" else set()  # keys of uncompensated tables stay as they were
        out.update({f.name: getattr(self, f.name) for f in fields(self) if f.name not in skipped})
        out["rate_grid"] = list(self.rate_grid)
        if self.estimator == "refine":
            out["refine_budgets"] = list(self.refine_budgets)
        return out

    def to_dict(self) -> dict[str, Any]:
        """The summary plus the batch size: what a table file records."""
        return self.summary() | {"batch_size": self.windows.batch_size}

    @classmethod
    def from_dict(cls, data: object) -> TableSpec:
        """The spec of a table file (flat fields; the old name "method" is read as "estimator")."""
        if not isinstance(data, dict):
            raise TableError("table spec must be an object")
        if "method" in data:
            warn_deprecated('the table spec field "method"', '"estimator"')
        values = {("estimator" if k == "method" else k): v for k, v in data.items()}
        window_names = set(_WINDOW_FIELDS) | {"batch_size"}
        known = {f.name for f in fields(cls) if f.name != "windows"} | window_names
        unknown = sorted(set(values) - known)
        if unknown:
            raise TableError(f"table spec has unknown field(s): {', '.join(unknown)}")
        windows = StoredWindowSpec(**{k: v for k, v in values.items() if k in window_names})  # names from a file: local only
        rest = {k: v for k, v in values.items() if k not in window_names}
        for name in ("rate_grid", "refine_budgets"):
            if name in rest:
                if not isinstance(rest[name], (list, tuple)):
                    raise TableError(f"table spec {name} must be a list of numbers")
                rest[name] = tuple(rest[name])
        return cls(windows=windows, **rest).validate()


def parse_rate_grid(text: str, what: str = "rates") -> tuple[float, ...]:
    """'0,0.25,0.5' -> (0.0, 0.25, 0.5); TableError (naming ``what``) on anything else."""
    try:
        rates = tuple(float(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise TableError(f"{what} must be comma-separated numbers like 0,0.25,0.5, got '{text}'") from None
    if any(not math.isfinite(r) for r in rates):
        raise TableError(f"{what} must be finite numbers, got '{text}'")
    return rates


# ---- the artefact ----------------------------------------------------------------------
@dataclass
class LossTable:
    """Measured (or estimated) objective increase per component and rate."""

    model: str  # model name the table was built for
    model_fingerprint: str  # weights fingerprint of that model
    num_layers: int  # blocks in the model
    spec: TableSpec  # how the table was measured
    data_fingerprint: str  # content hash of the calibration text (of its sources, in order, when it mixes several)
    components: list[tuple[int, str]]  # (layer index, "attn" | "mlp" | "block"), in row order
    rate_grid: np.ndarray  # (R,) rates
    delta: np.ndarray  # (C, R) objective increase over dense; raw, may be negative from noise; column 0 == 0
    removed: np.ndarray  # (C, R) int64 parameters that cell removes
    dense_objective: float  # objective of the dense model on the same windows
    cell_objective: np.ndarray  # (C, R) raw objective of each cell
    smoothed: np.ndarray | None  # (C, R) isotonic (non-decreasing in rate), >= 0 version of delta
    dense_prunable: int  # prunable parameters of the dense model (all attention + MLP projections)
    build_seconds: float  # wall time of the build (0 for a resumed build's reused part)
    key: str  # cache key (see table_key)
    extras: dict[str, Any] = field(default_factory=dict)  # build statistics (cells measured, reused, ...)
    window_start: str = "text"  # how every calibration window started: "bos" (the model's BOS token, never counted) or "text"
    measured: np.ndarray | None = (
        None  # (C, R) bool: True where the value was measured (or the cell removes nothing), False where estimated
    )
    cell_tokens: np.ndarray | None = None  # (C, R) int64: token positions the cell's value was measured or estimated on
    estimate: np.ndarray | None = None  # (C, R) the gradient estimate of delta a refined table started from (None otherwise)

    def losses(self, smoothed: bool = True) -> np.ndarray:
        """(C, R) losses for the planner: the smoothed table when there is one."""
        if smoothed and self.smoothed is not None:
            return self.smoothed
        return self.delta

    def measured_cells(self) -> np.ndarray:
        """(C, R) bool: which cells hold a measured value (every cell of an exact table)."""
        if self.measured is not None:
            return self.measured
        cells: np.ndarray = np.full(self.delta.shape, self.spec.estimator == "exact") | (self.removed == 0)
        return cells

    def basis(self, cells: Iterable[tuple[int, int]]) -> str:
        """What a prediction summed over ``cells`` ((component, rate index) pairs) rests on.

        Returns:
            "measured" when every cell was measured, "estimated" when none was (cells that
            remove nothing are ignored), "mixed" otherwise.
        """
        measured = self.measured_cells()
        flags = [bool(measured[c, r]) for c, r in cells if self.removed[c, r] > 0]
        if all(flags):
            return "measured"
        return "estimated" if not any(flags) else "mixed"

    def cells_for(self, attention_rates: Sequence[float], mlp_rates: Sequence[float]) -> list[tuple[int, int]]:
        """The cells a plan's predicted loss reads: its grid rate, or the two grid rates around an off-grid one.

        Args:
            attention_rates, mlp_rates: per-layer rates of a plan (a block row reads the attention rate).
        """
        cells: list[tuple[int, int]] = []
        grid = np.asarray(self.rate_grid, dtype=np.float64)
        for c, (layer, kind) in enumerate(self.components):
            rate = float((mlp_rates if kind == "mlp" else attention_rates)[layer])
            upper = min(int(np.searchsorted(grid, rate - 1e-9)), len(grid) - 1)
            cells.append((c, upper))
            if abs(grid[upper] - rate) > 1e-9 and upper > 0:
                cells.append((c, upper - 1))
        return cells

    def check_model(self, lm: LoadedModel) -> None:
        """TableError unless this table was built for ``lm``: its layer count, its weights'
        fingerprint, and the parameters each cell removes at its rate in ``lm``'s geometry."""
        self.check_identity(lm.name, lm.num_layers, lm.fingerprint)
        expected, prunable = removed_table(lm, self.components, self.rate_grid, self.spec.channel_multiple)
        check_removed_matches(self.removed, expected, self.dense_prunable, prunable, self.row_names(), self.rate_grid, lm.name, TableError)

    def row_names(self) -> list[str]:
        """A name per row for messages: "layer 3 attn"."""
        return [f"layer {layer} {kind}" for layer, kind in self.components]

    def check_meaning(self) -> LossTable:
        """TableError unless the cells are what a build produces (``validate_meaning.check_table_cells``):
        nothing removed at rate 0, removals that grow with the rate and leave part of every
        layer, deltas that are their cells' objective over dense, the smoothing of the raw rows."""
        check_table_cells(
            rate_grid=self.rate_grid,
            removed=self.removed,
            delta=self.delta,
            cell_objective=self.cell_objective,
            dense_objective=self.dense_objective,
            dense_prunable=self.dense_prunable,
            measured=self.measured_cells(),
            rows=self.row_names(),
            smoothed=self.smoothed,
            expected_smoothed=None if self.smoothed is None else isotonic_smooth(self.delta),
            error=TableError,
        )
        return self

    def check_identity(self, name: str, num_layers: int | None, fingerprint: str | None) -> None:
        """TableError unless a model of ``num_layers`` blocks and weights ``fingerprint`` is
        the one this table was built for; None skips that part (not known before a load)."""
        if num_layers is not None and self.num_layers != num_layers:
            raise TableError(f"loss table is for a model with {self.num_layers} layers, but {name} has {num_layers}")
        if fingerprint is not None and self.model_fingerprint != fingerprint:
            raise TableError(
                f"loss table was built for '{self.model}' (fingerprint {self.model_fingerprint}), "
                f"not for '{name}' (fingerprint {fingerprint})"
            )

    # ---- serialisation ---------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {
            "format_version": TABLE_FORMAT_VERSION,
            "key": self.key,
            "model": self.model,
            "model_fingerprint": self.model_fingerprint,
            "num_layers": self.num_layers,
            "spec": self.spec.to_dict(),
            "data_fingerprint": self.data_fingerprint,
            "components": [[layer, kind] for layer, kind in self.components],
            "rate_grid": [float(r) for r in self.rate_grid],
            "dense_objective": float(self.dense_objective),
            "dense_prunable": int(self.dense_prunable),
            "build_seconds": float(self.build_seconds),
            "delta": self.delta.tolist(),
            "smoothed": None if self.smoothed is None else self.smoothed.tolist(),
            "cell_objective": self.cell_objective.tolist(),
            "removed": self.removed.tolist(),
            "extras": self.extras,
            "window_start": self.window_start,
            "measured": self.measured_cells().tolist(),
            "cell_tokens": None if self.cell_tokens is None else self.cell_tokens.tolist(),
            "estimate": None if self.estimate is None else self.estimate.tolist(),
        }

    def to_json(self) -> str:
        return json_text(self.to_dict(), "loss table", separators=(",", ":")) + "\n"

    @classmethod
    def from_json(cls, text: str) -> LossTable:
        """Parse and check a table; TableError (one line) on anything malformed."""
        data = parse_json(text, "loss table", TableError)
        check_table_document(data)  # types, ranges, sizes: refuses tables no build can produce
        try:
            table = cls._from_dict(data)
        except TableError:
            raise
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            detail = f"missing field {exc}" if isinstance(exc, KeyError) else first_line(exc)
            raise TableError(f"malformed loss table: {detail}") from None
        return table.check_meaning()  # the numbers agree with each other (validate_meaning)

    @classmethod
    def _from_dict(cls, data: object) -> LossTable:
        if not isinstance(data, dict):
            raise TableError("malformed loss table: expected a JSON object")
        version = data.get("format_version")
        if version != TABLE_FORMAT_VERSION:
            raise TableError(
                f"loss table format version {version!r} is not supported (expected {TABLE_FORMAT_VERSION}); rebuild it with `gap table`"
            )
        spec = TableSpec.from_dict(data["spec"])
        components = [(int(layer), str(kind)) for layer, kind in data["components"]]
        num_layers = int(data["num_layers"])
        kinds = ("attn", "mlp") if spec.mode == "split" else ("block",)
        for layer, kind in components:
            if kind not in kinds or not (0 <= layer < num_layers):
                raise TableError(f"malformed loss table: component ({layer}, {kind}) does not fit a {spec.mode} table")
        rate_grid = np.asarray(data["rate_grid"], dtype=np.float64)
        if rate_grid.shape != (len(spec.rate_grid),) or not np.allclose(rate_grid, spec.rate_grid):
            raise TableError("malformed loss table: rate_grid differs from the spec's grid")
        shape = (len(components), len(rate_grid))

        def matrix(name: str, dtype: npt.DTypeLike) -> np.ndarray:
            arr = np.asarray(data[name], dtype=dtype)
            if arr.shape != shape:
                raise TableError(f"malformed loss table: {name} has shape {arr.shape}, expected {shape}")
            if arr.dtype.kind == "f" and not np.all(np.isfinite(arr)):
                raise TableError(f"malformed loss table: {name} holds non-finite values")
            return arr

        delta = matrix("delta", np.float64)
        smoothed = None if data.get("smoothed") is None else matrix("smoothed", np.float64)
        removed = matrix("removed", np.float64)
        if np.any(removed != np.round(removed)) or np.any(removed < 0):
            raise TableError("malformed loss table: removed must hold whole, non-negative parameter counts")
        extras = data.get("extras", {})
        window_start = data.get("window_start")
        if window_start not in WINDOW_STARTS:
            raise TableError(f"malformed loss table: window_start {window_start!r} is not one of {', '.join(WINDOW_STARTS)}")
        measured = matrix("measured", np.float64)
        if not np.all((measured == 0) | (measured == 1)):
            raise TableError("malformed loss table: measured must hold true/false per cell")
        tokens = None if data.get("cell_tokens") is None else matrix("cell_tokens", np.float64)
        if tokens is not None and (np.any(tokens != np.round(tokens)) or np.any(tokens < 0)):
            raise TableError("malformed loss table: cell_tokens must hold whole, non-negative counts")
        return cls(
            model=str(data["model"]),
            model_fingerprint=str(data["model_fingerprint"]),
            num_layers=num_layers,
            spec=spec,
            data_fingerprint=str(data["data_fingerprint"]),
            components=components,
            rate_grid=rate_grid,
            delta=delta,
            removed=removed.astype(np.int64),
            dense_objective=float(data["dense_objective"]),
            cell_objective=matrix("cell_objective", np.float64),
            smoothed=smoothed,
            dense_prunable=int(data["dense_prunable"]),
            build_seconds=float(data["build_seconds"]),
            key=str(data["key"]),
            extras=extras if isinstance(extras, dict) else {},
            window_start=window_start,
            measured=measured.astype(bool),
            cell_tokens=None if tokens is None else tokens.astype(np.int64),
            estimate=None if data.get("estimate") is None else matrix("estimate", np.float64),
        )

    def to_csv(self) -> str:
        """Long format, one line per cell: layer, component, rate, delta, smoothed, removed,
        measured (1: measured, 0: estimated) and tokens (positions it rests on, empty if unknown)."""
        smoothed = self.smoothed if self.smoothed is not None else np.full_like(self.delta, np.nan)
        measured = self.measured_cells()
        lines = ["layer,component,rate,delta,smoothed,removed,measured,tokens"]
        for c, (layer, kind) in enumerate(self.components):
            for r, rate in enumerate(self.rate_grid):
                tokens = "" if self.cell_tokens is None else int(self.cell_tokens[c, r])
                lines.append(
                    f"{layer},{kind},{rate:.6g},{self.delta[c, r]:.9g},{smoothed[c, r]:.9g},{int(self.removed[c, r])},"
                    f"{int(measured[c, r])},{tokens}"
                )
        return "\n".join(lines) + "\n"


# ---- pure helpers ----------------------------------------------------------------------
def _pool_adjacent_violators(values: np.ndarray) -> np.ndarray:
    """Least-squares non-decreasing fit of a 1-D sequence (equal weights)."""
    means: list[float] = []
    counts: list[int] = []
    for v in values:
        means.append(float(v))
        counts.append(1)
        while len(means) > 1 and means[-2] > means[-1]:
            n = counts[-2] + counts[-1]
            merged = (means[-2] * counts[-2] + means[-1] * counts[-1]) / n
            means[-2:] = [merged]
            counts[-2:] = [n]
    return np.repeat(means, counts)


def isotonic_smooth(delta: np.ndarray) -> np.ndarray:
    """Per row: non-decreasing in rate, >= 0, column 0 exactly 0.

    Columns 1.. get the isotonic (pool-adjacent-violators) least-squares fit, clipped at 0;
    clipping an isotonic fit equals the fit constrained to >= 0, so the result is still the
    closest non-decreasing, non-negative curve through the row's measured cells.

    Args:
        delta: (C, R) raw objective increases.
    Returns:
        (C, R) float64 smoothed table.
    """
    delta = np.asarray(delta, dtype=np.float64)
    out = np.zeros_like(delta)
    for c in range(delta.shape[0]):
        if delta.shape[1] > 1:
            out[c, 1:] = np.maximum(_pool_adjacent_violators(delta[c, 1:]), 0.0)
    return out


def table_key(lm: LoadedModel, spec: TableSpec, data_fingerprint: str) -> str:
    """Cache key: a readable prefix and a hash of everything that changes the numbers.

    Args:
        lm: the model (its name gives the prefix; its fingerprint, whether its windows start
            with a BOS token, the dtype it computes in when that is not float32 (``name.bf16-...``)
            and, when two of its attention shapes tie in size, the rule that picks one enter the hash).
        spec: the table's settings.
        data_fingerprint: the content hash of the calibration text (``data.windows.calibration_fingerprint``).
    """
    start, dtype = window_start(lm.tokenizer), dtype_name(placement_of(lm).dtype)
    from gap_engine.model.units import has_attention_ties  # torch: the key found without a model must not load it

    return key_for(str(lm.name), lm.fingerprint, start, dtype, spec, data_fingerprint, has_attention_ties(lm))


def key_for(
    model_name: str, model_fingerprint: str, start: str, dtype: str, spec: TableSpec, data_fingerprint: str, attention_ties: bool
) -> str:
    """`table_key` from what identifies its inputs, so a key can be computed without loading them
    (``tables.lookup``): the model's name, weights fingerprint, window start ("bos" or "text")
    and compute dtype name ("float32", "bfloat16", ...), the settings, the text's hash and
    whether two attention shapes of a block tie in size."""
    content = {
        "format_version": TABLE_FORMAT_VERSION,
        "model_fingerprint": model_fingerprint,
        "data_fingerprint": data_fingerprint,
        "window_start": start,
        **spec.summary(),
    }
    if attention_ties:
        # Cells at a tie measure the shape the rule picks; the rule changed once (it kept more KV groups).
        content["attention_ties"] = ATTENTION_TIE_RULE
    if dtype != "float32":  # float32 keys stay what they always were
        content["dtype"] = dtype
    digest = hashlib.sha256(json.dumps(content, sort_keys=True).encode()).hexdigest()[:20]
    return key_prefix(model_name, dtype, spec) + digest


def key_prefix(model_name: str, dtype: str, spec: TableSpec) -> str:
    """The readable start of ``table_key`` (model name, the dtype when not float32, objective,
    mode, estimator and its compensation when there is one: ``exact.bias_refit``): what can be
    known of a key before the model's weights are read."""
    slug = re.sub(r"[^A-Za-z0-9._-]+", "_", model_name)[-40:].strip("._-") or "model"
    slug += "" if dtype == "float32" else f".{SHORT_DTYPE_NAMES.get(dtype, dtype)}"
    estimator = spec.estimator + ("" if spec.compensation == "none" else "." + re.sub(r"[^a-z]+", "_", spec.compensation))
    return f"{slug}-{spec.objective}-{spec.mode}-{estimator}-"


def table_components(num_layers: int, mode: str) -> list[tuple[int, str]]:
    """(layer, kind) of every row, in row order: attn and mlp per layer, or one block."""
    kinds = ("attn", "mlp") if mode == "split" else ("block",)
    return [(layer, kind) for layer in range(num_layers) for kind in kinds]


def removed_table(
    lm: LoadedModel, components: Sequence[tuple[int, str]], rate_grid: Sequence[float] | np.ndarray, channel_multiple: int
) -> tuple[np.ndarray, int]:
    """(C, R) parameters removed per cell and the dense prunable count, from units."""

    from gap_engine.model.units import block_geometries  # torch (see table_key)

    geoms = block_geometries(lm)
    removed = np.zeros((len(components), len(rate_grid)), dtype=np.int64)
    for c, (layer, kind) in enumerate(components):
        parts = ("attn", "mlp") if kind == "block" else (kind,)
        for r, rate in enumerate(rate_grid):
            removed[c, r] = sum(geoms[layer].removed_at(p, rate, channel_multiple) for p in parts)
    dense = sum(g.params_at("attn", 0.0) + g.params_at("mlp", 0.0, channel_multiple) for g in geoms)
    return removed, int(dense)
