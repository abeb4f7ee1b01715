"""bench/bench_calibration.py without a model: its configurations, and the report's ratios against
the first configuration on hand-made per-window numbers of the selection part."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from bench_calibration import Config, build_parser, command_argv, parse_configs, report_lines, row_place

SOURCES = ("wiki-sample", "news-sample")


def test_configurations_name_mixed_sources_with_plus():
    assert parse_configs("wiki-sample:16,wiki-sample+news-sample:32") == [Config("wiki-sample", 16), Config("wiki-sample,news-sample", 32)]
    # A configuration may prune DP's plan by OBS on its own window count, and cap every rate, in either order.
    assert parse_configs("wiki-sample:16:obs16,wiki-sample:16:obs64") == [Config("wiki-sample", 16, 16), Config("wiki-sample", 16, 64)]
    assert parse_configs("wiki-sample:16,wiki-sample:16:cap0.75,wiki-sample:16:obs64:cap0.5,wiki-sample:16:cap0.5:obs64") == [
        Config("wiki-sample", 16),
        Config("wiki-sample", 16, None, 0.75),
        Config("wiki-sample", 16, 64, 0.5),
        Config("wiki-sample", 16, 64, 0.5),
    ]
    # ... and fit the compensation through the norms after the projections (Gemma 3), on its own window count or not
    assert parse_configs("wiki-sample:16:fit64,wiki-sample:16:fit64:norm,wiki-sample:16:norm:fit64") == [
        Config("wiki-sample", 16, fit=64),
        Config("wiki-sample", 16, fit=64, weighting="output-norm"),
        Config("wiki-sample", 16, fit=64, weighting="output-norm"),
    ]
    for bad in ("a:4,a:4:obs8:norm", "a:4,a:4:norm:norm"):
        with pytest.raises(ValueError, match="--configs"):
            parse_configs(bad)
    bad_ones = ("wiki-sample", "wiki-sample:0,news-sample:4", "wiki-sample:16", "wiki-sample:16,news-sample:4:obs0", "a:4,b:obs4")
    for bad in (*bad_ones, "a:4,a:4:cap1", "a:4,a:4:cap0", "a:4,a:4:capx", "a:4,a:4:cap0.5:cap0.6"):
        with pytest.raises(ValueError, match="--configs"):
            parse_configs(bad)


def _row(data, samples, budget, kl, seed):
    rng = np.random.default_rng(seed)
    windows = {}
    for source in SOURCES:
        scatter = rng.lognormal(0.0, 0.05, size=16)
        values = (kl[source] * scatter / scatter.mean()).tolist()
        windows[f"selection/{source}"] = {"kl": values, "nll": [3.0 + v for v in values]}
    return {
        "kind": "row", "data": data, "samples": samples, "budget": budget, "windows": windows, "table_key": "k", "table_s": 1.0,
        "attention_rates": [0.0], "mlp_rates": [0.2], "net_removed_fraction": budget,
    }  # fmt: skip


def test_ratios_are_against_the_first_configuration_with_verdicts():
    args = build_parser().parse_args(
        ["--configs", "wiki-sample:16,wiki-sample+news-sample:16,news-sample:16", "--budgets", "0.2", "--eval-data", ",".join(SOURCES)]
    )
    dense = {"kind": "dense", "windows": {f"selection/{s}": {"nll": [3.0] * 16} for s in SOURCES}}
    records = [
        dense,
        _row("wiki-sample", 16, 0.2, {"wiki-sample": 0.5, "news-sample": 0.5}, 0),
        _row("wiki-sample,news-sample", 16, 0.2, {"wiki-sample": 0.4, "news-sample": 0.4}, 1),  # better everywhere
        _row("news-sample", 16, 0.2, {"wiki-sample": 0.5, "news-sample": 0.5}, 0),  # the same windows as (a)
    ]
    lines = report_lines(args, records, (0.0, 0.0, 0.0), time.perf_counter())
    assert [row_place(r, parse_configs(args.configs)) for r in records[1:]] == [(0, 0.2), (1, 0.2), (2, 0.2)]
    mean = [line for line in lines if line.startswith("| 0.2 | (")][:2]
    assert mean[0].startswith("| 0.2 | (b) wiki-sample + news-sample, 16 x 256 | 1.25") and mean[0].count(" met ") == 2
    assert mean[1].startswith("| 0.2 | (c) news-sample, 16 x 256 | 1.000 [1.000, 1.000] tie")
    assert f"`python bench/bench_calibration.py {' '.join(command_argv(args))}`" in lines


def test_a_capped_configuration_is_its_own_row():
    """A row planned under a rate cap records it and is placed only where the cap is asked for (older rows say none)."""
    configs = parse_configs("wiki-sample:16,wiki-sample:16:cap0.75")
    plain = _row("wiki-sample", 16, 0.4, {"wiki-sample": 0.5, "news-sample": 0.5}, 0)
    capped = plain | {"max_rate": 0.75}
    assert row_place(plain, configs) == (0, 0.4)
    assert row_place(capped, configs) == (1, 0.4)
    assert row_place(capped | {"max_rate": 0.5}, configs) == (-1, 0.4)
    args = build_parser().parse_args(
        ["--configs", "wiki-sample:16,wiki-sample:16:cap0.75", "--budgets", "0.4", "--eval-data", ",".join(SOURCES)]
    )
    dense = {"kind": "dense", "windows": {f"selection/{s}": {"nll": [3.0] * 16} for s in SOURCES}}
    lines = report_lines(args, [dense, plain, capped], (0.0, 0.0, 0.0), time.perf_counter())
    assert any(line.startswith("| 0.4 | (b) wiki-sample, 16 x 256; rates at most 0.75 | 1.000") for line in lines)


def test_a_configuration_may_fit_its_compensation_on_more_windows():
    """``:fitN``: the table and its units the configuration's own, the compensation fitted on N windows; a row
    records it and is placed only there (older rows fitted on the table's); beside ``:obsN`` it is refused."""
    configs = parse_configs("wiki-sample:16,wiki-sample:16:fit64,wiki-sample:16:cap0.5:fit64")
    assert configs == [Config("wiki-sample", 16), Config("wiki-sample", 16, fit=64), Config("wiki-sample", 16, None, 0.5, 64)]
    for bad in ("a:4,a:4:fit0", "a:4,a:4:fitx", "a:4,a:4:obs16:fit64"):
        with pytest.raises(ValueError, match="--configs"):
            parse_configs(bad)
    plain = _row("wiki-sample", 16, 0.2, {"wiki-sample": 0.5, "news-sample": 0.5}, 0)
    fitted = _row("wiki-sample", 16, 0.2, {"wiki-sample": 0.4, "news-sample": 0.4}, 1) | {"fit_samples": 64}
    assert [row_place(r, configs) for r in (plain, fitted, fitted | {"fit_samples": 32})] == [(0, 0.2), (1, 0.2), (-1, 0.2)]
    args = build_parser().parse_args(
        ["--configs", "wiki-sample:16,wiki-sample:16:fit64", "--budgets", "0.2", "--eval-data", ",".join(SOURCES)]
    )
    dense = {"kind": "dense", "windows": {f"selection/{s}": {"nll": [3.0] * 16} for s in SOURCES}}
    lines = report_lines(args, [dense, plain, fitted], (0.0, 0.0, 0.0), time.perf_counter())
    assert any(line.startswith("| 0.2 | (b) wiki-sample, 16 x 256; compensation fitted on 64 x 256 | 1.25") for line in lines)
    assert any("only the compensation's fit reads that many windows" in line for line in lines)


def test_a_configuration_may_plan_on_cells_plus_their_standard_errors():
    """``:ucbK``: DP plans on every cell plus K standard errors; a row records K and is placed only there (older rows
    planned on the cells as they are); a negative or unreadable K is refused."""
    configs = parse_configs("wiki-sample:16:obs64,wiki-sample:16:obs64:ucb1,wiki-sample:16:ucb0.5:obs64")
    assert configs == [Config("wiki-sample", 16, 64), Config("wiki-sample", 16, 64, ucb=1.0), Config("wiki-sample", 16, 64, ucb=0.5)]
    for bad in ("a:4,a:4:ucb-1", "a:4,a:4:ucbx", "a:4,a:4:ucbnan"):
        with pytest.raises(ValueError, match="--configs"):
            parse_configs(bad)
    plain = _row("wiki-sample", 16, 0.2, {"wiki-sample": 0.5, "news-sample": 0.5}, 0) | {"obs_samples": 64}
    hedged = _row("wiki-sample", 16, 0.2, {"wiki-sample": 0.4, "news-sample": 0.4}, 1) | {"obs_samples": 64, "ucb": 1.0}
    assert [row_place(r, configs) for r in (plain, hedged, hedged | {"ucb": 2.0})] == [(0, 0.2), (1, 0.2), (-1, 0.2)]
    args = build_parser().parse_args(
        ["--configs", "wiki-sample:16:obs64,wiki-sample:16:obs64:ucb1", "--budgets", "0.2", "--eval-data", ",".join(SOURCES)]
    )
    dense = {"kind": "dense", "windows": {f"selection/{s}": {"nll": [3.0] * 16} for s in SOURCES}}
    lines = report_lines(args, [dense, plain, hedged], (0.0, 0.0, 0.0), time.perf_counter())
    assert any(line.startswith("| 0.2 | (b) wiki-sample, 16 x 256; OBS on 64 x 256; cells + 1 standard errors | 1.25") for line in lines)
    assert any("plus K times its standard error" in line for line in lines)
