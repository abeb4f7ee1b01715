"""Synthetic loss tables: a model's real removed-parameter counts with smooth made-up losses, so a
planner's answer is known without measuring anything (tests/plan/, tests/core/)."""

import numpy as np

from gap_engine.core.config import WindowSpec
from gap_engine.model.units import block_geometries
from gap_engine.tables.artefact import LossTable, TableSpec

TINY_GRID = (0.0, 0.25, 0.5, 0.75)
SMOL_GRID = tuple(i / 8 for i in range(8))
WORDS = (
    "the model prunes heads and channels of every layer while a budget of parameters is kept "
    "and the loss on held out text grows slowly as long as the sensitive layers stay dense"
).split()


def synthetic_table(lm, grid=TINY_GRID, mode="split", seed=0, fingerprint=None, model=None, data="wiki-sample") -> LossTable:
    """A LossTable with ``lm``'s real removed-parameter counts and convex made-up losses."""
    geoms = block_geometries(lm)
    kinds = ("attn", "mlp") if mode == "split" else ("block",)
    components = [(layer, kind) for layer in range(lm.num_layers) for kind in kinds]
    parts = {"attn": ("attn",), "mlp": ("mlp",), "block": ("attn", "mlp")}
    removed = np.array(
        [[sum(geoms[layer].removed_at(p, rate, 8) for p in parts[kind]) for rate in grid] for layer, kind in components],
        dtype=np.int64,
    )
    rng = np.random.default_rng(seed)
    share = removed / (removed.max(axis=1, keepdims=True) + 1)  # (C, R) in [0, 1)
    delta = rng.uniform(0.1, 2.0, (len(components), 1)) * share**2 + rng.uniform(0.0, 0.5, (len(components), 1)) * share
    dense_prunable = sum(g.params_at("attn", 0.0) + g.params_at("mlp", 0.0, 8) for g in geoms)
    return LossTable(
        model=model or lm.name,
        model_fingerprint=fingerprint or lm.fingerprint,
        num_layers=lm.num_layers,
        spec=TableSpec(windows=WindowSpec(data=data, n_samples=2, seq_len=32, batch_size=2), rate_grid=tuple(grid), mode=mode),
        data_fingerprint="synthetic",
        components=components,
        rate_grid=np.asarray(grid, dtype=np.float64),
        delta=delta,
        removed=removed,
        dense_objective=3.0,
        cell_objective=3.0 + delta,
        smoothed=delta.copy(),
        dense_prunable=int(dense_prunable),
        build_seconds=0.0,
        key=f"synthetic-{mode}-{seed}",
    )


def mlp_unit(lm) -> int:
    """Parameters of one group of 8 MLP channels: the finest unit."""
    return 8 * 3 * block_geometries(lm)[0].hidden
