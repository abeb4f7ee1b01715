"""Build a loss table: the measurement stage of GAP (EMNLP 2025).

For every component (a block's attention, or its MLP; or the whole block in ``block``
mode) and every rate on a grid, the table holds how much the model's *global* objective
grows when only that component is pruned at that rate and everything else stays dense.
One row is one layer's sensitivity curve; the planner then picks one rate per row under a
global parameter budget.

Which heads and channels a rate removes comes from ``surgery.layer_selection`` on
importance scores computed once per table, so a table measures exactly what surgery will
later cut. Two ways to fill the table:

``exact`` (measured). A dense pass over the calibration windows stores, for every block,
the hidden states entering it and the positional arguments it received (rotary
embeddings, attention masks: Gemma 3 alternates sliding and full attention, so each
block keeps its own). A cell for block ``i`` then runs only blocks ``i..L-1`` and the LM
head on the stored input, with the removed units masked: the removed heads' input columns
of ``o_proj`` and the removed channels' input columns of ``down_proj`` are zeroed in place
and restored afterwards, which gives the same output as slicing them away. Rates that
round to the same kept units are measured once, and every cell sees the same windows, so
differences between cells are paired.

``taylor`` / ``fisher`` (approximated, one forward and backward pass). A multiplicative
mask m (all ones) sits on every head and channel, one mask per window. With g_n the
gradient of window n's mean objective with respect to the masks:

* first order (``taylor``): removing a set S changes the loss by about
  ``-sum_{u in S} G_u``, with ``G = mean_n g_n`` (gradient with the real next tokens);
* second order (``fisher``): adds ``0.5 * sum_{u in S} F_u``, the diagonal of the Fisher
  information as a Hessian estimate. F is the *true* Fisher, computed from labels sampled
  from the dense model's own next-token distribution: per-position score vectors then
  have zero mean given the context, so the cross terms between positions vanish and
  ``F_u = T * mean_n (g'_nu)^2`` (T predicted positions per window; g' the gradient of
  window n's mean sampled-label NLL) is an unbiased estimate of the Fisher of the mean
  per-token objective: the Hessian of the KL objective at the dense model, and the
  Gauss-Newton approximation of the NLL's Hessian. For the ``kl`` objective the
  first-order term is exactly zero (the dense model is KL's minimum), so only ``fisher``
  is defined there. Units are chosen by the same ``layer_selection`` as the exact path.

Each cell's value is its objective minus the dense objective (``delta``: raw, can be
negative from noise) and an isotonic, non-negative version of each row (``smoothed``).
``bench/results/tables.md`` measures the speed of each path and how noisy the tables are.

An exact build masks the model's own weights cell by cell (restoring them exactly), so
the same model must not be used from another thread while a table is being built.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import re
import time
from dataclasses import asdict, dataclass, field, fields
from typing import Callable, Iterator, Protocol

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from .errors import CancelledError, TableError
from .importance import CRITERIA, ImportanceScores, compute_importance
from .surgery import _unit_rows, layer_selection, prune_attention_, prune_mlp_
from .units import block_geometries

log = logging.getLogger(__name__)

DEFAULT_RATE_GRID = tuple(i / 16 for i in range(16))  # 0, 1/16, ..., 15/16
TABLE_FORMAT_VERSION = 1
OBJECTIVES = ("nll", "kl")
MODES = ("split", "block")
METHODS = ("exact", "taylor", "fisher")

# Dense next-token log-probabilities for the KL objective are kept in memory up to this
# size; above it they are recomputed from the stored final hidden states for every cell
# (one more LM-head product per cell instead of N*T*V floats held).
MAX_STORED_LOGPROB_BYTES = 2 << 30
# A resumable build writes its measured cells at least this often.
PARTIAL_SAVE_SECONDS = 10.0
PARTIAL_SAVE_CELLS = 16

ProgressFn = Callable[[int, int, "float | None"], None]


class CancelToken(Protocol):
    def is_set(self) -> bool: ...


@dataclass(frozen=True)
class TableSpec:
    """How to measure a loss table (everything that changes its numbers, plus batch size)."""

    data: str = "wiki-sample"  # text source for the calibration windows (see data.load_corpus)
    n_samples: int = 16  # calibration windows
    seq_len: int = 256  # tokens per window
    seed: int = 0  # which windows are drawn
    criterion: str = "wanda"  # within-layer importance: which heads/channels a rate removes
    rate_grid: tuple[float, ...] = DEFAULT_RATE_GRID  # candidate rates, ascending, starting at 0
    objective: str = "nll"  # "nll": mean next-token NLL; "kl": mean KL(dense || pruned) per position
    mode: str = "split"  # "split": attention and MLP are separate components; "block": one per layer, same rate
    method: str = "exact"  # "exact" (measured) | "taylor" (first order) | "fisher" (second order, diagonal Fisher)
    channel_multiple: int = 8  # MLP widths are kept in multiples of this
    batch_size: int = 4  # windows per forward pass (memory only; not part of the cache key)

    def validate(self) -> "TableSpec":
        """Raise TableError (one line) for any value the builder cannot use."""
        if not isinstance(self.data, str) or not self.data.strip():
            raise TableError("table data source must be a non-empty string")
        for name, low in (("n_samples", 1), ("seq_len", 2), ("batch_size", 1), ("channel_multiple", 1)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise TableError(f"table {name} must be an integer >= {low}, got {value!r}")
        if not isinstance(self.seed, int) or isinstance(self.seed, bool):
            raise TableError(f"table seed must be an integer, got {self.seed!r}")
        if self.criterion not in CRITERIA:
            raise TableError(f"unknown criterion '{self.criterion}'; choose one of {', '.join(CRITERIA)}")
        for name, allowed in (("objective", OBJECTIVES), ("mode", MODES), ("method", METHODS)):
            if getattr(self, name) not in allowed:
                raise TableError(f"unknown table {name} '{getattr(self, name)}'; choose one of {', '.join(allowed)}")
        if self.method == "taylor" and self.objective == "kl":
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
        return self

    def summary(self) -> dict:
        """The fields that identify a table, for listings and cache metadata."""
        out = asdict(self)
        out["rate_grid"] = list(self.rate_grid)
        del out["batch_size"]
        return out

    @classmethod
    def from_dict(cls, data: dict) -> "TableSpec":
        if not isinstance(data, dict):
            raise TableError("table spec must be an object")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise TableError(f"table spec has unknown field(s): {', '.join(unknown)}")
        values = dict(data)
        if "rate_grid" in values:
            if not isinstance(values["rate_grid"], (list, tuple)):
                raise TableError("table spec rate_grid must be a list of rates")
            values["rate_grid"] = tuple(values["rate_grid"])
        return cls(**values).validate()


def parse_rate_grid(text: str) -> tuple[float, ...]:
    """'0,0.25,0.5' -> (0.0, 0.25, 0.5); TableError on anything else."""
    try:
        rates = tuple(float(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise TableError(f"rates must be comma-separated numbers like 0,0.25,0.5, got '{text}'") from None
    if any(not math.isfinite(r) for r in rates):
        raise TableError(f"rates must be finite numbers, got '{text}'")
    return rates


# ---- the artefact ----------------------------------------------------------------------
@dataclass
class LossTable:
    """Measured (or estimated) objective increase per component and rate."""

    model: str  # model name the table was built for
    model_fingerprint: str  # weights fingerprint of that model
    num_layers: int  # blocks in the model
    spec: TableSpec  # how the table was measured
    data_fingerprint: str  # content hash of the text source
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
    extras: dict = field(default_factory=dict)  # build statistics (cells measured, reused, ...)

    def losses(self, smoothed: bool = True) -> np.ndarray:
        """(C, R) losses for the planner: the smoothed table when there is one."""
        if smoothed and self.smoothed is not None:
            return self.smoothed
        return self.delta

    def check_model(self, lm) -> None:
        """TableError unless this table was built for ``lm``."""
        if self.num_layers != lm.num_layers:
            raise TableError(f"loss table is for a model with {self.num_layers} layers, but {lm.name} has {lm.num_layers}")
        if self.model_fingerprint != lm.fingerprint:
            raise TableError(
                f"loss table was built for '{self.model}' (fingerprint {self.model_fingerprint}), "
                f"not for '{lm.name}' (fingerprint {lm.fingerprint})"
            )

    # ---- serialisation ---------------------------------------------------------------
    def to_dict(self) -> dict:
        return {
            "format_version": TABLE_FORMAT_VERSION,
            "key": self.key,
            "model": self.model,
            "model_fingerprint": self.model_fingerprint,
            "num_layers": self.num_layers,
            "spec": self.spec.summary() | {"batch_size": self.spec.batch_size},
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
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), separators=(",", ":")) + "\n"

    @classmethod
    def from_json(cls, text: str) -> "LossTable":
        """Parse and check a table; TableError (one line) on anything malformed."""
        try:
            data = json.loads(text)
        except (json.JSONDecodeError, UnicodeDecodeError, TypeError) as exc:
            raise TableError(f"loss table is not valid JSON: {str(exc).splitlines()[0]}") from None
        try:
            return cls._from_dict(data)
        except TableError:
            raise
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            detail = f"missing field {exc}" if isinstance(exc, KeyError) else str(exc).splitlines()[0]
            raise TableError(f"malformed loss table: {detail}") from None

    @classmethod
    def _from_dict(cls, data) -> "LossTable":
        if not isinstance(data, dict):
            raise TableError("malformed loss table: expected a JSON object")
        version = data.get("format_version")
        if version != TABLE_FORMAT_VERSION:
            raise TableError(f"loss table format version {version!r} is not supported (expected {TABLE_FORMAT_VERSION})")
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

        def matrix(name: str, dtype) -> np.ndarray:
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
        )

    def to_csv(self) -> str:
        """Long format, one line per cell: layer, component, rate, delta, smoothed, removed."""
        smoothed = self.smoothed if self.smoothed is not None else np.full_like(self.delta, np.nan)
        lines = ["layer,component,rate,delta,smoothed,removed"]
        for c, (layer, kind) in enumerate(self.components):
            for r, rate in enumerate(self.rate_grid):
                lines.append(
                    f"{layer},{kind},{rate:.6g},{self.delta[c, r]:.9g},{smoothed[c, r]:.9g},{int(self.removed[c, r])}"
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


def table_key(lm, spec: TableSpec) -> str:
    """Cache key: a readable prefix and a hash of everything that changes the numbers."""
    from .data import load_corpus

    spec.validate()
    return _key_for(lm, spec, load_corpus(spec.data).fingerprint)


def _key_for(lm, spec: TableSpec, data_fingerprint: str) -> str:
    content = {
        "format_version": TABLE_FORMAT_VERSION,
        "model_fingerprint": lm.fingerprint,
        "data_fingerprint": data_fingerprint,
        **spec.summary(),
    }
    digest = hashlib.sha256(json.dumps(content, sort_keys=True).encode()).hexdigest()[:20]
    slug = re.sub(r"[^A-Za-z0-9._-]+", "_", str(lm.name))[-40:].strip("._-") or "model"
    return f"{slug}-{spec.objective}-{spec.mode}-{spec.method}-{digest}"


def _components(num_layers: int, mode: str) -> list[tuple[int, str]]:
    kinds = ("attn", "mlp") if mode == "split" else ("block",)
    return [(layer, kind) for layer in range(num_layers) for kind in kinds]


def _removed_table(lm, components, rate_grid, channel_multiple) -> tuple[np.ndarray, int]:
    """(C, R) parameters removed per cell and the dense prunable count, from units."""
    geoms = block_geometries(lm)
    removed = np.zeros((len(components), len(rate_grid)), dtype=np.int64)
    for c, (layer, kind) in enumerate(components):
        parts = ("attn", "mlp") if kind == "block" else (kind,)
        for r, rate in enumerate(rate_grid):
            removed[c, r] = sum(geoms[layer].removed_at(p, rate, channel_multiple) for p in parts)
    dense = sum(g.params_at("attn", 0.0) + g.params_at("mlp", 0.0, channel_multiple) for g in geoms)
    return removed, int(dense)


@dataclass(frozen=True)
class _Cut:
    """Units one cell removes from one block (heads and MLP channels, ascending)."""

    layer: int
    heads: tuple[int, ...]
    channels: tuple[int, ...]

    @property
    def empty(self) -> bool:
        return not self.heads and not self.channels


def _cuts(lm, scores: ImportanceScores, components, rate_grid, channel_multiple) -> list[list[_Cut]]:
    """[component][rate] the units removed, chosen exactly as surgery chooses them."""
    layers = lm.adapter.layers(lm.model)
    out = []
    for layer_index, kind in components:
        layer = layers[layer_index]
        geom = lm.adapter.geometry(layer)
        row = []
        for rate in rate_grid:
            attn_rate = rate if kind in ("attn", "block") else 0.0
            mlp_rate = rate if kind in ("mlp", "block") else 0.0
            _, kept_heads, kept_channels = layer_selection(
                lm.adapter, layer, scores.layers[layer_index], attn_rate, mlp_rate, channel_multiple
            )
            heads = tuple(sorted(set(range(geom.n_heads)) - set(kept_heads)))
            channels = tuple(sorted(set(range(geom.intermediate_size)) - set(kept_channels)))
            row.append(_Cut(layer_index, heads, channels))
        out.append(row)
    return out


def _batches(windows: torch.Tensor, batch_size: int) -> list[torch.Tensor]:
    return [windows[s : s + batch_size] for s in range(0, windows.shape[0], batch_size)]


def _objective_per_window(
    logits: torch.Tensor, input_ids: torch.Tensor, objective: str, dense_logprobs: torch.Tensor | None
) -> torch.Tensor:
    """Objective summed over each window's positions: (B,) float64.

    nll: next-token cross entropy over the T-1 predicted positions of each window.
    kl: KL(dense || pruned) of the next-token distributions at all T positions.
    """
    batch, vocab = logits.shape[0], logits.shape[-1]
    if objective == "nll":
        per_token = F.cross_entropy(
            logits[:, :-1].reshape(-1, vocab), input_ids[:, 1:].reshape(-1), reduction="none"
        )  # (B*(T-1),)
        return per_token.view(batch, -1).double().sum(1)
    logq = F.log_softmax(logits, dim=-1)  # (B, T, V)
    per_token = F.kl_div(logq, dense_logprobs, log_target=True, reduction="none").sum(-1)  # (B, T)
    return per_token.double().sum(1)


def _objective_sum(logits: torch.Tensor, input_ids: torch.Tensor, objective: str, dense_logprobs) -> float:
    """Objective summed over all positions of a batch (see _objective_per_window)."""
    return float(_objective_per_window(logits, input_ids, objective, dense_logprobs).sum())


def _positions(windows: torch.Tensor, objective: str) -> int:
    n, t = windows.shape
    return n * (t - 1) if objective == "nll" else n * t


# ---- the dense pass ------------------------------------------------------------------------
@dataclass
class _DenseState:
    """What one dense pass leaves behind for the cells (per batch, per block)."""

    batches: list[torch.Tensor]  # [b] (B, T) token ids
    block_inputs: list[list[torch.Tensor]]  # [b][i] (B, T, d) hidden states entering block i
    block_calls: list[list[tuple[tuple, dict]]]  # [b][i] the other positional args and kwargs block i got
    final_hidden: list[torch.Tensor]  # [b] (B, T, d) output of the last block
    dense_logprobs: list[torch.Tensor] | None  # [b] (B, T, V) for the KL objective, when stored
    dense_nll: list[torch.Tensor]  # [b] (B,) float64 dense NLL summed over each window's positions

    @property
    def objective_sum(self) -> float:
        """Dense NLL summed over all positions (the dense KL is 0)."""
        return float(sum(float(part.sum()) for part in self.dense_nll))


def _layer_output(out):
    return out[0] if isinstance(out, tuple) else out


def _dense_pass(lm, windows: torch.Tensor, batch_size: int, objectives: tuple[str, ...]) -> _DenseState:
    model, adapter = lm.model, lm.adapter
    layers = list(adapter.layers(model))
    batches = _batches(windows, batch_size)
    state = _DenseState(batches, [], [], [], None, [])
    vocab = adapter.lm_head(model).out_features
    store_logprobs = "kl" in objectives and windows.numel() * vocab * 4 <= MAX_STORED_LOGPROB_BYTES
    if store_logprobs:
        state.dense_logprobs = []
    current: dict = {}

    def capture(index):
        def hook(module, args, kwargs):
            kwargs = dict(kwargs)
            hidden = args[0] if args else kwargs.pop("hidden_states")
            current["inputs"][index] = hidden
            current["calls"][index] = (tuple(args[1:]), kwargs)

        return hook

    def capture_last(module, args, kwargs, output):
        current["final"] = _layer_output(output)

    handles = [layer.register_forward_pre_hook(capture(i), with_kwargs=True) for i, layer in enumerate(layers)]
    handles.append(layers[-1].register_forward_hook(capture_last, with_kwargs=True))
    try:
        with torch.inference_mode():
            for batch in batches:
                current.update(inputs=[None] * len(layers), calls=[None] * len(layers), final=None)
                adapter.decoder(model)(input_ids=batch, use_cache=False)
                state.block_inputs.append(current["inputs"])
                state.block_calls.append(current["calls"])
                state.final_hidden.append(current["final"])
                logits = adapter.logits_from_hidden(model, current["final"])  # (B, T, V)
                if store_logprobs:
                    state.dense_logprobs.append(F.log_softmax(logits, dim=-1))
                state.dense_nll.append(_objective_per_window(logits, batch, "nll", None))
    finally:
        for handle in handles:
            handle.remove()
    return state


def _dense_logprobs(lm, state: _DenseState, b: int) -> torch.Tensor:
    if state.dense_logprobs is not None:
        return state.dense_logprobs[b]
    return F.log_softmax(lm.adapter.logits_from_hidden(lm.model, state.final_hidden[b]), dim=-1)


@contextlib.contextmanager
def masked_units(adapter, layer: nn.Module, heads: tuple[int, ...], channels: tuple[int, ...]) -> Iterator[None]:
    """Temporarily zero the removed units' input columns of o_proj and down_proj.

    A head contributes to the block's output only through its columns of ``o_proj``, and an
    MLP channel only through its column of ``down_proj``, so zeroing them gives the output
    of the sliced layer (biases of o_proj/down_proj stay in both). The weights are restored
    exactly on exit, whatever happens inside.
    """
    geom = adapter.geometry(layer)
    _, _, _, o_proj = adapter.attention_projections(layer)
    _, _, down_proj = adapter.mlp_projections(layer)
    saved = []
    with torch.no_grad():
        try:
            for weight, cols in (
                (o_proj.weight, _unit_rows(torch.tensor(heads, dtype=torch.long), geom.head_dim) if heads else None),
                (down_proj.weight, torch.tensor(channels, dtype=torch.long) if channels else None),
            ):
                if cols is None:
                    continue
                saved.append((weight, cols, weight[:, cols].clone()))  # (d, removed)
                weight[:, cols] = 0.0
            yield
        finally:
            for weight, cols, values in saved:
                weight[:, cols] = values


def _cell_per_window(lm, state: _DenseState, cut: _Cut, objectives: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """Objective of the model with ``cut`` applied, per window: {objective: (N,) float64 sums}.

    Runs only blocks cut.layer..L-1 and the LM head, from the stored input of the cut block.
    """
    layers = lm.adapter.layers(lm.model)
    sums: dict[str, list[torch.Tensor]] = {name: [] for name in objectives}
    with masked_units(lm.adapter, layers[cut.layer], cut.heads, cut.channels), torch.inference_mode():
        for b, batch in enumerate(state.batches):
            hidden = state.block_inputs[b][cut.layer]  # (B, T, d)
            for j in range(cut.layer, len(layers)):
                args, kwargs = state.block_calls[b][j]
                hidden = _layer_output(layers[j](hidden, *args, **kwargs))
            logits = lm.adapter.logits_from_hidden(lm.model, hidden)  # (B, T, V)
            for name in objectives:
                dense = _dense_logprobs(lm, state, b) if name == "kl" else None
                sums[name].append(_objective_per_window(logits, batch, name, dense))
    return {name: torch.cat(parts) for name, parts in sums.items()}


def _run_cell(lm, state: _DenseState, cut: _Cut, objective: str) -> float:
    """Objective of the model with ``cut`` applied, summed over all positions."""
    return float(_cell_per_window(lm, state, cut, (objective,))[objective].sum())


# ---- partial results -------------------------------------------------------------------------
class PartialStore(Protocol):
    """Where a resumable build keeps its measured cells (see cache.PartialCells)."""

    def load(self) -> dict[tuple[int, int], float]: ...

    def save(self, cells: dict[tuple[int, int], float]) -> None: ...


def _cell_costs(lm, jobs: list[tuple[int, int, _Cut]]) -> list[float]:
    """Relative cost of each cell, in blocks: the blocks it runs plus the LM head's share."""
    model, adapter = lm.model, lm.adapter
    layers = adapter.layers(model)
    block_params = sum(p.numel() for p in layers[0].parameters())
    head = adapter.lm_head(model)
    head_blocks = head.in_features * head.out_features / max(block_params, 1)
    return [len(layers) - cut.layer + head_blocks for _, _, cut in jobs]


def _measure_exact(lm, spec, windows, scores, components, progress, cancel, partial) -> tuple[np.ndarray, float, dict]:
    """(C, R) measured objectives, the dense objective and build statistics."""
    grid = spec.rate_grid
    cuts = _cuts(lm, scores, components, grid, spec.channel_multiple)
    # One job per distinct cut of each component; cells with the same cut copy its value.
    jobs: list[tuple[int, int, _Cut]] = []
    owner: dict[tuple[int, int], tuple[int, int] | None] = {}
    for c, row in enumerate(cuts):
        first: dict[_Cut, int] = {}
        for r, cut in enumerate(row):
            if cut.empty:
                owner[c, r] = None  # the dense model itself
            elif cut in first:
                owner[c, r] = (c, first[cut])
            else:
                first[cut] = r
                owner[c, r] = (c, r)
                jobs.append((c, r, cut))
    job_cells = {(c, r) for c, r, _ in jobs}
    stored = partial.load() if partial is not None else {}
    measured = {cell: value for cell, value in stored.items() if cell in job_cells}
    resumed = len(measured)
    if resumed:
        log.info("resuming a loss table build: %d of %d cells already measured", resumed, len(jobs))

    state = _dense_pass(lm, windows, spec.batch_size, (spec.objective,))
    positions = _positions(windows, spec.objective)
    dense_objective = state.objective_sum / positions if spec.objective == "nll" else 0.0
    costs = _cell_costs(lm, jobs)
    todo = [k for k, (c, r, _) in enumerate(jobs) if (c, r) not in measured]
    work_left = sum(costs[k] for k in todo)
    work_done, started = 0.0, time.perf_counter()
    last_save, unsaved = started, 0
    if progress:
        progress(len(measured), len(jobs), None)
    try:
        for k in todo:
            if cancel is not None and cancel.is_set():
                raise CancelledError(f"loss table build cancelled after {len(measured)} of {len(jobs)} cells")
            c, r, cut = jobs[k]
            measured[c, r] = _run_cell(lm, state, cut, spec.objective) / positions
            unsaved += 1
            work_done += costs[k]
            work_left -= costs[k]
            now = time.perf_counter()
            if partial is not None and (unsaved >= PARTIAL_SAVE_CELLS or now - last_save >= PARTIAL_SAVE_SECONDS):
                partial.save(measured)
                last_save, unsaved = now, 0
            if progress:
                progress(len(measured), len(jobs), (now - started) / work_done * work_left)
    finally:
        if partial is not None and unsaved:
            partial.save(measured)

    objective = np.empty((len(components), len(grid)), dtype=np.float64)
    for (c, r), source in owner.items():
        objective[c, r] = dense_objective if source is None else measured[source]
    stats = {"cells_measured": len(jobs) - resumed, "cells_resumed": resumed, "distinct_cells": len(jobs)}
    return objective, dense_objective, stats


# ---- first/second-order estimates --------------------------------------------------------------
def _mask_gradients(lm, spec, windows, cancel, progress) -> tuple[list, list, list, list, float]:
    """Per-unit mean gradients G and diagonal Fisher F of the mean objective wrt unit masks.

    Returns:
        (G_heads, G_channels, F_heads, F_channels, dense_objective); lists over blocks of
        float64 tensors (n_heads,) and (intermediate_size,). G is zero for the kl objective
        and F is zero for the taylor method.
    """
    model, adapter = lm.model, lm.adapter
    layers = list(adapter.layers(model))
    geoms = [adapter.geometry(layer) for layer in layers]
    grad_heads = [torch.zeros(g.n_heads, dtype=torch.float64) for g in geoms]
    grad_channels = [torch.zeros(g.intermediate_size, dtype=torch.float64) for g in geoms]
    fisher_heads = [torch.zeros(g.n_heads, dtype=torch.float64) for g in geoms]
    fisher_channels = [torch.zeros(g.intermediate_size, dtype=torch.float64) for g in geoms]
    masks: dict = {}
    want_fisher = spec.method == "fisher"
    want_grad = spec.objective == "nll"
    generator = torch.Generator().manual_seed(spec.seed)

    def head_gate(index):
        def hook(module, args):
            mask = masks["heads"][index]  # (B, H)
            gate = mask.repeat_interleave(geoms[index].head_dim, dim=1)[:, None, :]  # (B, 1, H*D)
            return (args[0] * gate,) + tuple(args[1:])

        return hook

    def channel_gate(index):
        def hook(module, args):
            return (args[0] * masks["channels"][index][:, None, :],) + tuple(args[1:])  # (B, T, I)

        return hook

    handles = []
    for i, layer in enumerate(layers):
        handles.append(adapter.attention_projections(layer)[3].register_forward_pre_hook(head_gate(i)))
        handles.append(adapter.mlp_projections(layer)[2].register_forward_pre_hook(channel_gate(i)))
    batches = _batches(windows, spec.batch_size)
    dense_sum, started = 0.0, time.perf_counter()
    try:
        for b, batch in enumerate(batches):
            if cancel is not None and cancel.is_set():
                raise CancelledError(f"loss table estimate cancelled after {b} of {len(batches)} batches")
            n = batch.shape[0]
            masks["heads"] = [torch.ones(n, g.n_heads, requires_grad=True) for g in geoms]
            masks["channels"] = [torch.ones(n, g.intermediate_size, requires_grad=True) for g in geoms]
            leaves = masks["heads"] + masks["channels"]
            with torch.enable_grad():
                logits = model(input_ids=batch, use_cache=False).logits  # (B, T, V)
                vocab = logits.shape[-1]
                real = F.cross_entropy(
                    logits[:, :-1].reshape(-1, vocab), batch[:, 1:].reshape(-1), reduction="none"
                ).view(n, -1)  # (B, T-1)
                dense_sum += float(real.detach().double().sum())
                if want_grad:
                    # Summing per-window means gives each window's own gradient in its mask row.
                    grads = torch.autograd.grad(real.mean(1).sum(), leaves, retain_graph=want_fisher)
                    for acc, g in zip(grad_heads + grad_channels, grads):
                        acc += g.double().sum(0)
                if want_fisher:
                    used = logits if spec.objective == "kl" else logits[:, :-1]  # (B, T', V)
                    probs = F.softmax(used.detach(), dim=-1).reshape(-1, vocab)  # (B*T', V)
                    sampled = torch.multinomial(probs, 1, generator=generator).view(n, -1)  # (B, T')
                    nll = F.cross_entropy(used.reshape(-1, vocab), sampled.reshape(-1), reduction="none").view(n, -1)
                    grads = torch.autograd.grad(nll.mean(1).sum(), leaves)
                    for acc, g in zip(fisher_heads + fisher_channels, grads):
                        acc += (g.double() ** 2).sum(0)
            del logits
            if progress:
                elapsed = time.perf_counter() - started
                progress(b + 1, len(batches), elapsed / (b + 1) * (len(batches) - b - 1))
    finally:
        for handle in handles:
            handle.remove()
    n_windows = windows.shape[0]
    t_fisher = windows.shape[1] if spec.objective == "kl" else windows.shape[1] - 1
    for acc in grad_heads + grad_channels:
        acc /= n_windows
    for acc in fisher_heads + fisher_channels:
        acc *= t_fisher / n_windows
    dense = dense_sum / _positions(windows, "nll") if spec.objective == "nll" else 0.0
    return grad_heads, grad_channels, fisher_heads, fisher_channels, dense


def _estimate(lm, spec, windows, scores, components, progress, cancel) -> tuple[np.ndarray, float, dict]:
    grad_h, grad_c, fisher_h, fisher_c, dense = _mask_gradients(lm, spec, windows, cancel, progress)
    cuts = _cuts(lm, scores, components, spec.rate_grid, spec.channel_multiple)
    objective = np.empty((len(components), len(spec.rate_grid)), dtype=np.float64)
    for c, row in enumerate(cuts):
        for r, cut in enumerate(row):
            heads, channels = list(cut.heads), list(cut.channels)
            first = -(float(grad_h[cut.layer][heads].sum()) + float(grad_c[cut.layer][channels].sum()))
            second = 0.5 * (float(fisher_h[cut.layer][heads].sum()) + float(fisher_c[cut.layer][channels].sum()))
            objective[c, r] = dense + first + (second if spec.method == "fisher" else 0.0)
    return objective, dense, {"batches": len(_batches(windows, spec.batch_size))}


# ---- per-window measurements (noise studies) ------------------------------------------------------
@dataclass
class WindowCells:
    """Exact cell values per calibration window, for both objectives at once.

    Averaging the last axis over any subset of windows gives the table those windows would
    measure, so one build answers how much two disjoint sets of windows disagree.
    """

    components: list[tuple[int, str]]  # (layer, kind) per row
    rate_grid: np.ndarray  # (R,)
    removed: np.ndarray  # (C, R) int64 parameters removed
    distinct: np.ndarray  # (C, R) bool: the cell removes something and is the first with its cut
    nll: np.ndarray  # (C, R, N) per-window mean NLL increase over dense
    kl: np.ndarray  # (C, R, N) per-window mean KL(dense || pruned)
    dense_nll: np.ndarray  # (N,) per-window mean dense NLL


def window_cells(lm, spec: TableSpec, windows: torch.Tensor, progress: ProgressFn | None = None) -> WindowCells:
    """Measure every distinct cell of an exact table per window, NLL and KL together.

    Args:
        lm, spec: as for ``measure_table`` (spec.objective and spec.method are ignored).
        windows: (N, T) token ids.
    Returns:
        WindowCells; cells sharing a cut share values, as in the table.
    """
    spec.validate()
    components = _components(lm.num_layers, spec.mode)
    scores = compute_importance(lm, windows, spec.criterion, batch_size=spec.batch_size)
    cuts = _cuts(lm, scores, components, spec.rate_grid, spec.channel_multiple)
    state = _dense_pass(lm, windows, spec.batch_size, ("nll", "kl"))
    n, t = windows.shape
    dense_nll = torch.cat(state.dense_nll).numpy() / (t - 1)  # (N,)
    nll = np.zeros((len(components), len(spec.rate_grid), n))
    kl = np.zeros_like(nll)
    distinct = np.zeros((len(components), len(spec.rate_grid)), dtype=bool)
    todo = [(c, r) for c, row in enumerate(cuts) for r, cut in enumerate(row) if not cut.empty and cut not in row[:r]]
    started = time.perf_counter()
    for k, (c, r) in enumerate(todo):
        sums = _cell_per_window(lm, state, cuts[c][r], ("nll", "kl"))
        distinct[c, r] = True
        for r2, cut in enumerate(cuts[c]):
            if cut == cuts[c][r]:
                nll[c, r2] = sums["nll"].numpy() / (t - 1) - dense_nll
                kl[c, r2] = sums["kl"].numpy() / t
        if progress:
            elapsed = time.perf_counter() - started
            progress(k + 1, len(todo), elapsed / (k + 1) * (len(todo) - k - 1))
    removed, _ = _removed_table(lm, components, spec.rate_grid, spec.channel_multiple)
    return WindowCells(components, np.asarray(spec.rate_grid), removed, distinct, nll, kl, dense_nll)


# ---- entry points ----------------------------------------------------------------------------
def _assemble(lm, spec, key, data_fingerprint, components, objective, dense, started, stats) -> LossTable:
    removed, dense_prunable = _removed_table(lm, components, spec.rate_grid, spec.channel_multiple)
    delta = objective - dense
    delta[:, 0] = 0.0
    objective[:, 0] = dense
    return LossTable(
        model=lm.name,
        model_fingerprint=lm.fingerprint,
        num_layers=lm.num_layers,
        spec=spec,
        data_fingerprint=data_fingerprint,
        components=components,
        rate_grid=np.asarray(spec.rate_grid, dtype=np.float64),
        delta=delta,
        removed=removed,
        dense_objective=float(dense),
        cell_objective=objective,
        smoothed=isotonic_smooth(delta),
        dense_prunable=dense_prunable,
        build_seconds=time.perf_counter() - started,
        key=key,
        extras=stats,
    )


def measure_table(
    lm,
    spec: TableSpec,
    windows: torch.Tensor,
    progress: ProgressFn | None = None,
    cancel: CancelToken | None = None,
    partial: PartialStore | None = None,
    key: str = "",
    data_fingerprint: str = "",
) -> LossTable:
    """Build a table on given windows, with no cache (``build_table`` wraps this).

    Args:
        lm: the dense LoadedModel (its weights are masked cell by cell and restored).
        spec: validated here.
        windows: (N, T) token ids; N and T should match the spec.
        progress: called as (done, total, eta_seconds): cells for ``exact``, calibration
            batches for the estimates; eta is None before the first timed step.
        cancel: polled before every cell; when set, measured cells are saved and
            CancelledError is raised.
        partial: where measured cells are saved every few cells and read back on resume.
        key, data_fingerprint: recorded in the table.
    """
    spec.validate()
    started = time.perf_counter()
    components = _components(lm.num_layers, spec.mode)
    scores = compute_importance(lm, windows, spec.criterion, batch_size=spec.batch_size)
    if spec.method == "exact":
        objective, dense, stats = _measure_exact(lm, spec, windows, scores, components, progress, cancel, partial)
    else:
        objective, dense, stats = _estimate(lm, spec, windows, scores, components, progress, cancel)
    table = _assemble(lm, spec, key, data_fingerprint, components, objective, dense, started, stats)
    log.info("loss table %s: %d x %d cells in %.1f s", key or "(uncached)", *table.delta.shape, table.build_seconds)
    return table


def build_table(
    lm,
    spec: TableSpec,
    progress: ProgressFn | None = None,
    cancel: CancelToken | None = None,
    use_cache: bool = True,
) -> LossTable:
    """The loss table of ``lm`` under ``spec``, from the cache when it is there.

    A build holds the cache entry's inter-process lock, so a second process asking for the
    same table waits and then reads the finished one. Measured cells are saved as the build
    goes; a cancelled or killed build resumes from them.

    Args:
        lm: the dense model (LoadedModel).
        spec: what to measure.
        progress: (done, total, eta_seconds) after every cell; never called on a cache hit.
        cancel: an object with ``is_set()`` (e.g. threading.Event), polled between cells.
        use_cache: False neither reads nor writes the cache (nor partial cells).
    Raises:
        TableError: a bad spec. CancelledError: cancelled. DataError: unusable text source.
    """
    from . import cache
    from .data import calibration_windows, load_corpus

    spec.validate()
    data_fingerprint = load_corpus(spec.data).fingerprint
    key = _key_for(lm, spec, data_fingerprint)

    def measure(partial):
        windows = calibration_windows(lm.tokenizer, spec.data, spec.n_samples, spec.seq_len, spec.seed)
        return measure_table(lm, spec, windows, progress, cancel, partial, key, data_fingerprint)

    if not use_cache:
        return measure(None)
    with cache.lock(key):
        cached = cache.get_table(key)
        if cached is not None:
            log.info("loss table %s read from the cache", key)
            return cached
        table = measure(cache.PartialCells(key))
        cache.put_table(table)
        return table


def naive_build_table(
    lm, spec: TableSpec, progress: ProgressFn | None = None, windows: torch.Tensor | None = None
) -> LossTable:
    """Reference build: one full forward of the whole model per cell, on a sliced copy.

    Every cell (rate > 0) deep-copies its block, slices it with surgery's own functions,
    swaps it into the model and runs the model's ordinary forward; no stored states, no
    masking, no sharing between cells with the same cut. Only for benchmarks and tests.
    """
    from .data import calibration_windows, load_corpus

    spec.validate()
    if spec.method != "exact":
        raise TableError("the naive build measures exact tables only")
    started = time.perf_counter()
    data_fingerprint = load_corpus(spec.data).fingerprint
    if windows is None:
        windows = calibration_windows(lm.tokenizer, spec.data, spec.n_samples, spec.seq_len, spec.seed)
    components = _components(lm.num_layers, spec.mode)
    scores = compute_importance(lm, windows, spec.criterion, batch_size=spec.batch_size)
    batches = _batches(windows, spec.batch_size)
    positions = _positions(windows, spec.objective)
    layers = lm.adapter.layers(lm.model)

    def objective_of_model(dense_logprobs) -> tuple[float, list]:
        total, kept = 0.0, []
        with torch.inference_mode():
            for b, batch in enumerate(batches):
                logits = lm.model(input_ids=batch, use_cache=False).logits  # (B, T, V)
                if spec.objective == "kl" and dense_logprobs is None:
                    kept.append(F.log_softmax(logits, dim=-1))
                    continue
                total += _objective_sum(logits, batch, spec.objective, dense_logprobs[b] if dense_logprobs else None)
        return total / positions, kept

    dense, dense_logprobs = objective_of_model(None)
    objective = np.full((len(components), len(spec.rate_grid)), dense, dtype=np.float64)
    total = len(components) * (len(spec.rate_grid) - 1)
    done = 0
    for c, (layer_index, kind) in enumerate(components):
        original = layers[layer_index]
        for r, rate in enumerate(spec.rate_grid):
            if r == 0:
                continue
            pruned = copy_layer(original)
            kept_kv, kept_heads, kept_channels = layer_selection(
                lm.adapter,
                original,
                scores.layers[layer_index],
                rate if kind in ("attn", "block") else 0.0,
                rate if kind in ("mlp", "block") else 0.0,
                spec.channel_multiple,
            )
            geom = lm.adapter.geometry(original)
            if len(kept_heads) < geom.n_heads:
                prune_attention_(lm.adapter, pruned, kept_kv, kept_heads)
            if len(kept_channels) < geom.intermediate_size:
                prune_mlp_(lm.adapter, pruned, kept_channels)
            layers[layer_index] = pruned
            try:
                objective[c, r], _ = objective_of_model(dense_logprobs or None)
            finally:
                layers[layer_index] = original
            done += 1
            if progress:
                elapsed = time.perf_counter() - started
                progress(done, total, elapsed / done * (total - done))
    key = _key_for(lm, spec, data_fingerprint)
    return _assemble(lm, spec, key, data_fingerprint, components, objective, dense, started, {"cells_measured": total})


def copy_layer(layer: nn.Module) -> nn.Module:
    """A deep copy of one block (its weights included), for slicing without touching the model."""
    import copy

    return copy.deepcopy(layer)
