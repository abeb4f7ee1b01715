"""The cost model: it counts the work the builders do, prices it, and answers `gap table --dry-run`."""

from __future__ import annotations

import dataclasses
import json
import os

import psutil
import pytest
import torch

from gap_engine.cli import main
from gap_engine.core.device import resolve
from gap_engine.tables import costmodel
from gap_engine.tables.artefact import TableSpec
from gap_engine.tables.build import measure_table
from gap_engine.tables.costmodel import (
    SHAPES,
    SPEC_PROFILES,
    ModelShape,
    distinct_cuts_per_layer,
    estimate_build,
    measured_profile,
)

GRID = (0.0, 0.125, 0.25, 0.375, 0.5, 0.625, 0.75, 0.875)


def spec_of(**fields) -> TableSpec:
    return TableSpec.from_dict(dict(n_samples=4, seq_len=32, rate_grid=GRID, batch_size=2) | fields)


@pytest.mark.parametrize("mode", ["split", "block"])
def test_cell_count_is_the_builders_own(make_tiny, mode):
    lm = make_tiny("llama", initializer_range=0.2)
    shape = ModelShape.from_config(lm.model.config)
    spec = spec_of(mode=mode, n_samples=2, seq_len=16)
    table = measure_table(lm, spec, torch.randint(0, 49152, (2, 16)))
    assert table.extras["distinct_cells"] == shape.layers * distinct_cuts_per_layer(shape, GRID, mode, 8)
    assert shape.total_params == lm.param_count()


def test_shapes_of_the_planned_models_match_their_published_sizes():
    assert 7.9e9 < SHAPES["llama-3.1-8b"].total_params < 8.1e9
    assert 70.0e9 < SHAPES["llama-3.1-70b"].total_params < 71.0e9


def test_estimates_move_the_right_way():
    shape, profile = SHAPES["llama-3.1-70b"], SPEC_PROFILES["h200"]
    spec = spec_of(n_samples=32, seq_len=2048, rate_grid=tuple(i / 16 for i in range(16)))
    one = estimate_build(shape, spec, profile, dtype_bytes=2)
    streamed = estimate_build(shape, spec, profile, dtype_bytes=2, stream=True)
    eight = estimate_build(shape, spec, profile, dtype_bytes=2, stream=True, workers=8)
    fisher = estimate_build(shape, TableSpec.from_dict(spec.to_dict() | {"estimator": "fisher"}), profile, dtype_bytes=2)
    assert one.fits is False and streamed.fits is True  # 141 GB of weights alone fill one H200
    assert streamed.device_bytes < profile.memory < one.device_bytes
    assert streamed.parts["transfers"] > 0 and "transfers" not in one.parts
    assert eight.workers == 8 and eight.parts["cells"] < streamed.parts["cells"] / 6
    assert fisher.seconds < one.seconds / 100 and fisher.cells == 0
    assert one.cells == 80 * distinct_cuts_per_layer(shape, spec.rate_grid, "split", 8)
    assert any("does not fit" in line for line in one.lines())
    json.dumps(one.to_dict())  # JSON-ready


def test_measured_profile_is_cached_and_reused(tmp_path, monkeypatch):
    monkeypatch.setenv("GAP_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(psutil, "cpu_percent", lambda interval=None: 5.0)  # a quiet machine, whatever else runs beside the test
    placement, shape = resolve(None), SHAPES["llama-3.1-8b"]
    assert measured_profile(placement, shape, seq_len=16, batch=1, measure=False) is None
    profile = measured_profile(placement, shape, seq_len=16, batch=1)
    assert profile.block_flops > 1e6 and profile.head_flops > 1e6 and profile.basis.startswith("measured on this machine")
    assert "1024-wide" in profile.basis  # an 8B layer is narrowed before it is measured here
    monkeypatch.setattr(costmodel, "_measure", lambda *a: pytest.fail("measured twice"))
    assert measured_profile(placement, shape, seq_len=16, batch=1) == profile
    assert len(list((tmp_path / "costmodel").glob("profile-*.json"))) == 1


def test_a_profile_measured_on_a_busy_machine_prices_this_estimate_and_is_not_kept(tmp_path, monkeypatch):
    """A reading taken while other work holds the cores is this moment's speed, not the
    machine's: kept, it priced every later estimate (a 2-minute recovery at 14 minutes). Busy is
    sampled just before measuring: the 1-minute load average also counted the app's own model
    load that had just ended, so an Estimate right after it was never kept."""
    monkeypatch.setenv("GAP_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(psutil, "cpu_count", lambda logical=True: 2)
    monkeypatch.setattr(os, "getloadavg", lambda: (3.5, 2.0, 1.0))  # a busy minute that is over: not read
    sampled = []
    monkeypatch.setattr(psutil, "cpu_percent", lambda interval=None: sampled.append(interval) or 90.0)
    placement, shape = resolve(None), SHAPES["smollm2-135m"]
    busy = measured_profile(placement, shape, seq_len=16, batch=1)
    assert sampled == [0.5]  # a half-second sample, taken before the measurement's own threads start
    assert busy is not None and busy.block_flops > 1e6 and busy.basis.endswith("not kept: this machine was busy (1.8 of 2 cores in use)")
    assert not list(tmp_path.glob("costmodel/profile-*.json"))
    assert measured_profile(placement, shape, seq_len=16, batch=1, measure=False) is None  # later estimates: nominal, not the busy reading
    monkeypatch.setattr(psutil, "cpu_percent", lambda interval=None: 20.0)  # quiet again: less than one core in use
    quiet = measured_profile(placement, shape, seq_len=16, batch=1)
    assert quiet is not None and "not kept" not in quiet.basis
    assert measured_profile(placement, shape, seq_len=16, batch=1, measure=False) == quiet
    assert costmodel.busy_cpu(dataclasses.replace(placement, device=torch.device("meta"))) is None  # not sampled off the CPU


def test_cli_dry_run_prints_a_prediction_and_builds_nothing(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("GAP_CACHE_DIR", str(tmp_path))
    argv = [
        "table",
        "--model",
        "llama-3.1-70b",
        "--dry-run",
        "--profile",
        "h200",
        "--estimator",
        "exact",
        "--samples",
        "32",
        "--seq-len",
        "2048",
        "--batch-size",
        "2",
    ]
    assert main([*argv, "--stream", "--ray", "--ray-workers", "8"]) == 0
    out = capsys.readouterr().out
    assert "predicted exact table of llama-3.1-70b" in out and "8 Ray workers" in out and "basis: spec sheet" in out
    assert not (tmp_path / "tables").exists()


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--dry-run", "--profile", "tpu9"], "unknown --profile 'tpu9'"),
        (["--ray", "--estimator", "fisher", "--out", "t.json"], "--ray spreads measured cells"),
        ([], "--out is required"),
    ],
)
def test_cli_table_scale_options_refuse_bad_input_in_one_line(capsys, extra, message):
    assert main(["table", "--model", "llama-3.1-8b", *extra]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0]


@pytest.mark.parametrize("estimator", ["fisher", "exact"])
def test_a_build_no_earlier_job_measured_gets_the_cost_models_time_labelled_predicted(estimator):
    """Time-left from the first stage (issue 22, finding 3): unknown stages take the prediction, and say so."""
    from gap_engine.core.buildtime import PREDICTION_WORD, Expectation, with_prediction
    from gap_engine.core.progress import LOAD_MODEL, READ_TEXT
    from gap_engine.pipeline.stages import table_stages

    spec = spec_of(estimator=estimator)
    stages = table_stages(spec)
    predicted = costmodel.stage_seconds(estimate_build(SHAPES["llama-3.1-8b"], spec, SPEC_PROFILES["h200"], 2))
    assert set(predicted) == set(stages) - {LOAD_MODEL, READ_TEXT} and all(s >= 0 for s in predicted.values())
    fresh = Expectation(
        {stage: (3.0 if stage in (LOAD_MODEL, READ_TEXT) else None) for stage in stages},
        0,
        "no earlier build of this model on this machine",
    )
    filled = with_prediction(fresh, predicted)
    assert filled.total == pytest.approx(6.0 + sum(predicted.values()))
    assert filled.basis.startswith(PREDICTION_WORD) and "no earlier build" in filled.basis
    measured = Expectation({stage: 1.0 for stage in stages}, 2, "from 2 earlier builds on this machine")
    assert with_prediction(measured, predicted) is measured  # measured stages are never replaced by a prediction


def test_the_preflight_knows_the_shapes_the_dry_run_prices():
    # The preflight refuses unknown model names before torch loads, so it keeps its own list of
    # the cost model's planning shapes; the two must agree.
    from gap_engine.cli.preflight import BUILTIN_NAMES, PLANNING_SHAPES
    from gap_engine.tables.costmodel import SHAPES

    assert set(SHAPES) == set(BUILTIN_NAMES) | set(PLANNING_SHAPES)


def test_the_recovery_estimate_prices_task_scoring_as_prune_and_evaluate_does():
    """Issue 22: Recover said "about 21 s" for a run that took 116 s scoring tasks before and
    after training. With tasks on, the estimate grows by lm-eval's import plus three scoring
    passes (the checkpoint and dense before, the recovered model after), each priced as Prune &
    evaluate prices one (``expected.forward_seconds`` of the model over the task's tokens)."""
    from dataclasses import replace

    from gap_engine.core.device import DeviceSpec
    from gap_engine.evaluate.tasks import TASK_CHOICES, TASK_IMPORT_S, TASK_TOKENS
    from gap_engine.pipeline import expected
    from gap_engine.recover.cost import estimate_recovery
    from gap_engine.recover.settings import RecoverySettings

    dense = SHAPES["smollm2-135m"]
    config = {
        "model_type": "llama", "num_hidden_layers": dense.layers, "hidden_size": dense.hidden, "num_attention_heads": dense.heads,
        "num_key_value_heads": dense.kv_heads, "head_dim": dense.head_dim, "intermediate_size": dense.intermediate,
        "vocab_size": dense.vocab, "tie_word_embeddings": dense.tied_embeddings,
        "per_layer_config": {str(i): {"intermediate_size": dense.intermediate // 2} for i in range(dense.layers)},
    }  # fmt: skip
    pruned = replace(dense, intermediate=dense.intermediate // 2)
    profile, placement = expected.nominal_profile(2), resolve(DeviceSpec("cpu", "float32"))
    settings = RecoverySettings(steps=2, tasks=("wiki-sample", "news-sample"), eval_samples=2, eval_seq_len=64).validate()
    without = estimate_recovery(config, settings, placement, distils=False, profile=profile)
    examples = 20
    with_tasks = estimate_recovery(config, settings, placement, distils=False, task_examples=examples, profile=profile)
    assert without is not None and with_tasks is not None and without.tasks_s == 0.0

    def one_pass(shape: ModelShape) -> float:  # Prune & evaluate's price of scoring one model
        return examples * expected.forward_seconds(shape, profile, TASK_CHOICES * TASK_TOKENS, TASK_TOKENS, 1)

    scoring = TASK_IMPORT_S + 2 * one_pass(pruned) + one_pass(dense)
    assert with_tasks.total_s - without.total_s == pytest.approx(scoring, rel=0.02)
    assert with_tasks.tasks_s == pytest.approx(scoring, rel=0.02)
    assert with_tasks.prepare_s - without.prepare_s == pytest.approx(TASK_IMPORT_S + one_pass(pruned) + one_pass(dense), rel=0.02)
    assert with_tasks.step_s == without.step_s
    assert with_tasks.total_s > 3 * without.total_s  # at these settings scoring is most of the run, as in the issue


def test_the_gguf_build_time_prices_the_imports_only_a_fresh_process_pays(smol, tmp_path, monkeypatch):
    """The Export page's GGUF time: a CI run predicted 7.9 s for a 3.3 s build in the app (whose
    process had imported transformers' model code long before), because the nominal q8_0 price
    carried the cold imports of a first build. The imports are now their own price, paid only
    where ``transformers.modeling_utils`` is not imported yet (bench/bench_gguf_time.py measures
    both cases against real builds)."""
    import sys

    from gap_engine.pipeline import expected

    (tmp_path / "config.json").write_text(smol.model.config.to_json_string(), encoding="utf-8")
    warm = {outtype: expected.gguf_seconds(tmp_path, outtype) for outtype in ("f16", "q8_0")}
    monkeypatch.delitem(sys.modules, "transformers.modeling_utils")
    cold = {outtype: expected.gguf_seconds(tmp_path, outtype) for outtype in ("f16", "q8_0")}
    assert cold == {outtype: pytest.approx(seconds + expected.GGUF_IMPORT_S) for outtype, seconds in warm.items()}
    params = sum(p.numel() for p in smol.model.parameters())  # the tied head counted once, as layer_shapes does
    assert warm["q8_0"] - warm["f16"] == pytest.approx(
        params * (expected.GGUF_SECONDS_PER_PARAM["q8_0"] - expected.GGUF_SECONDS_PER_PARAM["f16"]), rel=0.05
    )
    assert expected.gguf_seconds(tmp_path / "missing", "f16") is None
