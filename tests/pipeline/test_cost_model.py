"""The cost model: it counts the work the builders do, prices it, and answers `gap table --dry-run`
and the pages' times before Start (how close they come to real jobs: bench/bench_expected.py)."""

from __future__ import annotations

import json
import sys
from dataclasses import replace

import pytest
import torch

from gap_engine.cli import main
from gap_engine.core.device import DeviceSpec, Placement, resolve
from gap_engine.core.progress import LOAD_MODEL, READ_TEXT, RECOVERY_STAGES
from gap_engine.data.next_sentence import offline_task_dir
from gap_engine.model.adapters import supported_model_types
from gap_engine.pipeline import cost_model
from gap_engine.pipeline.cost_model import (
    NOMINAL_BASIS,
    SHAPES,
    SPEC_PROFILES,
    ModelShape,
    distinct_cuts_per_layer,
    estimate_build,
    measured_profile,
)
from gap_engine.pipeline.stages import table_stages
from gap_engine.recover.settings import RecoverySettings
from gap_engine.tables.artefact import TableSpec
from gap_engine.tables.build import measure_table
from gap_engine.tables.estimators import ESTIMATORS
from gap_engine.views.estimate_text import estimate_lines

GRID = (0.0, 0.125, 0.25, 0.375, 0.5, 0.625, 0.75, 0.875)


def spec_of(**fields) -> TableSpec:
    return TableSpec.from_dict(dict(n_samples=4, seq_len=32, rate_grid=GRID, batch_size=2) | fields)


@pytest.mark.parametrize("mode", ["split", "block"])
@pytest.mark.slow
def test_cell_count_is_the_builders_own(make_tiny, mode):
    lm = make_tiny("llama", initializer_range=0.2)
    shape = ModelShape.from_config(lm.model.config)
    spec = spec_of(mode=mode, n_samples=2, seq_len=16)
    table = measure_table(lm, spec, torch.randint(0, 49152, (2, 16)))
    assert table.extras["distinct_cells"] == shape.layers * distinct_cuts_per_layer(shape, GRID, mode, 8)
    assert shape.total_params == lm.param_count()
    assert ModelShape.from_config(json.loads(lm.model.config.to_json_string()), shape.name) == shape  # a config.json's dict alike


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
    assert streamed.device_bytes < profile.memory < one.device_bytes and streamed.host_bytes > 140e9
    assert eight.workers == 8 and eight.seconds < streamed.seconds / 6
    assert fisher.seconds < one.seconds / 100 and fisher.cells == 0
    assert one.cells == 80 * distinct_cuts_per_layer(shape, spec.rate_grid, "split", 8)
    assert any("does not fit" in line for line in estimate_lines(one))


@pytest.mark.parametrize("mode, components", [("split", 2), ("block", 1)])
def test_a_builds_price_has_a_part_no_token_buys(mode, components):
    """Choosing each cell's units costs the same for 2 x 64 tokens as for 4 x 128 (bench_expected: SmolLM2's small
    build once taught the learned factor 1.5-1.9x too much for the larger): a build's price is one part per token and
    one per cell of the grid, every cell of every layer, whatever the estimator."""
    shape, profile = SHAPES["smollm2-135m"], cost_model.nominal_profile(2)

    def seconds(n_samples: int, seq_len: int) -> float:
        return estimate_build(shape, spec_of(n_samples=n_samples, seq_len=seq_len, estimator="fisher", mode=mode), profile, 4).seconds

    small, large = seconds(2, 32), seconds(8, 32)  # the same windows' length: the token part is exactly 4x
    fixed = (4 * small - large) / 3
    assert fixed == pytest.approx(shape.layers * len(GRID) * components * cost_model.CELL_BOOKKEEPING_S)
    assert large / small < 3.5  # a build's time is not its tokens' alone


@pytest.mark.parametrize("estimator", list(ESTIMATORS))
def test_a_table_jobs_predicted_stages_are_the_jobs_own(estimator, tmp_path, monkeypatch):
    """Every stage a table job declares gets a time (refine's cells once fell outside its stages and
    out of its ETA), a cache hit is priced as loading and reading, and a model in memory loads for free."""
    monkeypatch.setenv("GAP_CACHE_DIR", str(tmp_path))
    spec = spec_of(estimator=estimator, objective="nll")
    built = cost_model.table_prediction("smollm2-135m", spec)
    assert built is not None and list(built.seconds) == list(table_stages(spec)) and all(s > 0 for s in built.seconds.values())
    assert built.basis == f"{cost_model.PREDICTED}: {NOMINAL_BASIS}"  # never measured on a page view
    hit = cost_model.table_prediction("smollm2-135m", spec, cached=True)
    assert list(hit.seconds) == [LOAD_MODEL, READ_TEXT] and hit.total < built.total and "cached here" in hit.basis
    assert cost_model.table_prediction("smollm2-135m", spec, loaded=True).seconds[LOAD_MODEL] == 0.0
    assert cost_model.table_prediction("org/not-on-disk", spec) is None  # its shape would need the network
    assert not list(tmp_path.glob("costmodel/*"))


@pytest.mark.slow
def test_measured_profile_is_cached_reused_and_refreshed(tmp_path, monkeypatch):
    monkeypatch.setenv("GAP_CACHE_DIR", str(tmp_path))
    placement, shape = resolve(None), SHAPES["llama-3.1-8b"]
    assert measured_profile(placement, shape, seq_len=16, batch=1, measure=False) is None
    profile = measured_profile(placement, shape, seq_len=16, batch=1)
    assert profile.block_flops > 1e6 and profile.head_flops > 1e6 and profile.basis.startswith("measured on this machine")
    assert "1024-wide" in profile.basis  # an 8B layer is narrowed before it is measured here
    measured = []
    monkeypatch.setattr(cost_model, "_measure", lambda *a: measured.append(a) or profile)
    assert measured_profile(placement, shape, seq_len=16, batch=1) == profile and measured == []
    assert len(list((tmp_path / "costmodel").glob("profile-*.json"))) == 1
    measured_profile(placement, shape, seq_len=16, batch=1, refresh=True, measure=False)  # Setup's Estimate: measure again
    assert len(measured) == 1


def test_cli_dry_run_prints_a_prediction_and_builds_nothing(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("GAP_CACHE_DIR", str(tmp_path))
    argv = ["table", "--model", "llama-3.1-70b", "--dry-run", "--profile", "h200", "--estimator", "exact"]
    argv += ["--samples", "32", "--seq-len", "2048", "--batch-size", "2"]
    assert main([*argv, "--stream", "--ray", "--ray-workers", "8"]) == 0
    out = capsys.readouterr().out
    assert "predicted exact table of llama-3.1-70b" in out and "8 Ray workers" in out and "basis: spec sheet" in out
    assert not (tmp_path / "tables").exists()


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--dry-run", "--profile", "tpu9"], "unknown --profile 'tpu9'"),
        (["--dry-run", "--ray", "--ray-workers", "0"], "--ray-workers must be at least 1"),
        (["--ray", "--estimator", "fisher", "--out", "t.json"], "--ray spreads measured cells"),
        ([], "--out is required"),
    ],
)
def test_cli_table_scale_options_refuse_bad_input_in_one_line(capsys, extra, message):
    assert main(["table", "--model", "llama-3.1-8b", *extra]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0]


def test_the_preflight_knows_the_shapes_the_dry_run_prices():
    # The preflight refuses unknown model names before torch loads, so it keeps its own list of
    # the cost model's planning shapes; the two must agree.
    from gap_engine.cli.preflight import BUILTIN_NAMES, PLANNING_SHAPES

    assert set(SHAPES) == set(BUILTIN_NAMES) | set(PLANNING_SHAPES)


def test_the_scoring_price_uses_the_offline_tasks_real_requests(smol_tokenizer):
    """Task scoring is priced by the offline task's own tokens per request (passage and choice under the
    model's tokenizer), not a guess: a guess once predicted 7 minutes for a run that took about 2."""
    docs = [json.loads(line) for line in next(offline_task_dir().glob("*.jsonl")).read_text().splitlines()[:100]]
    lengths = [len(smol_tokenizer(d["passage"] + " " + c)["input_ids"]) for d in docs for c in d["choices"]]
    assert len(lengths) == cost_model.TASK_CHOICES * len(docs)
    assert abs(sum(lengths) / len(lengths) / cost_model.TASK_TOKENS - 1) < 0.15, sum(lengths) / len(lengths)


def _checkpoint_config(tmp_path, dense: ModelShape):
    config = {
        "model_type": "llama", "num_hidden_layers": dense.layers, "hidden_size": dense.hidden, "num_attention_heads": dense.heads,
        "num_key_value_heads": dense.kv_heads, "head_dim": dense.head_dim, "intermediate_size": dense.intermediate,
        "vocab_size": dense.vocab, "tie_word_embeddings": dense.tied_embeddings,
        "per_layer_config": {str(i): {"intermediate_size": dense.intermediate // 2} for i in range(dense.layers)},
    }  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


def test_the_recovery_prediction_prices_task_scoring_as_prune_and_evaluate_does(tmp_path, monkeypatch):
    """Task scoring before and after training is priced, not left out (a recovery priced without it was
    predicted at a fifth of its time). With tasks on, the prediction grows by lm-eval's import plus three scoring passes (the
    checkpoint and dense before, the recovered model after), each priced as Prune & evaluate prices one."""
    monkeypatch.setenv("GAP_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delitem(sys.modules, "lm_eval", raising=False)  # a process that has not imported it yet
    dense = SHAPES["smollm2-135m"]
    folder = _checkpoint_config(tmp_path, dense)
    pruned, profile = replace(dense, intermediate=dense.intermediate // 2), cost_model.nominal_profile(torch.get_num_threads())
    settings = RecoverySettings(steps=2, tasks=("wiki-sample", "news-sample"), eval_samples=2, eval_seq_len=64)
    without = cost_model.recovery_prediction(folder, settings)
    with_tasks = cost_model.recovery_prediction(folder, settings, task_examples=20)
    assert list(without.seconds) == list(RECOVERY_STAGES) and without.tasks_s == 0.0 and "nominal CPU speed" in without.basis

    def one_pass(shape: ModelShape) -> float:  # Prune & evaluate's price of scoring one model
        return cost_model.scoring_seconds(20, lambda tokens, seq_len: cost_model.forward_seconds(shape, profile, tokens, seq_len, 1))

    assert with_tasks.total - without.total == pytest.approx(cost_model.TASK_IMPORT_S + 2 * one_pass(pruned) + one_pass(dense), rel=0.02)
    assert with_tasks.tasks_s == pytest.approx(with_tasks.total - without.total)
    assert with_tasks.step_s == without.step_s and with_tasks.tasks_s > with_tasks.total / 2  # scoring is most of this run
    assert cost_model.recovery_prediction(tmp_path / "missing", settings) is None


def test_the_gguf_time_prices_the_imports_only_a_fresh_process_pays(tmp_path, monkeypatch):
    """The Export page's GGUF time: a CI run predicted 7.9 s for a 3.3 s build in the app (whose
    process had imported transformers' model code long before): the import is priced only where
    ``transformers.modeling_utils`` is not imported yet (bench/bench_expected.py measures both)."""
    import transformers.modeling_utils  # noqa: F401 - a warm process

    from gap_engine.pipeline import cost_gguf

    folder = _checkpoint_config(tmp_path, SHAPES["smollm2-135m"])
    warm = {outtype: cost_gguf.gguf_seconds(folder, outtype) for outtype in ("f16", "q8_0")}
    monkeypatch.delitem(sys.modules, "transformers.modeling_utils")
    cold = {outtype: cost_gguf.gguf_seconds(folder, outtype) for outtype in ("f16", "q8_0")}
    assert cold == {outtype: pytest.approx(seconds + cost_gguf.GGUF_IMPORT_S) for outtype, seconds in warm.items()}
    dense, blocks = cost_model.checkpoint_shapes(folder)
    assert [b.intermediate for b in blocks] == [dense.intermediate // 2] * dense.layers  # the checkpoint's own widths
    params = dense.total_params - sum(dense.block_params - b.block_params for b in blocks)
    per_param = cost_gguf.GGUF_S_PER_PARAM
    assert warm["q8_0"] - warm["f16"] == pytest.approx(params * (per_param["q8_0"] - per_param["f16"]))
    assert cost_gguf.gguf_seconds(tmp_path / "missing", "f16") is None


def test_an_accelerator_nobody_measured_gets_no_prediction(tmp_path, monkeypatch):
    """No honest prior exists for a GPU: the pages say the time is not known rather than guess."""
    monkeypatch.setenv("GAP_CACHE_DIR", str(tmp_path))
    accelerator = Placement(torch.device("meta"), torch.bfloat16, False)  # a device type that is not the CPU
    monkeypatch.setattr(cost_model, "resolve", lambda device: accelerator)
    assert cost_model.table_prediction("smollm2-135m", spec_of(), DeviceSpec("cuda")) is None
    assert cost_model.recovery_prediction(_checkpoint_config(tmp_path, SHAPES["smollm2-135m"]), RecoverySettings(), accelerator) is None


def test_teacher_text_is_priced_by_its_decoding_and_its_nucleus():
    from gap_engine.core.limits import LIMITS
    from gap_engine.recover.teacher_text import DEFAULT_TOKENS

    tiny = ModelShape("tiny", 2, 64, 4, 2, 16, 96, 49152)  # 6M parameters, 3M of them the embedding
    one_thread = cost_model.nominal_profile(1)
    million = cost_model.teacher_text_seconds(tiny, one_thread, 1 << 20, 128)
    # A token at a time, each drawn from a sorted row of 49,152: hours even for this model, past the bound.
    assert million > LIMITS.teacher_seconds
    nucleus = (1 << 20) * 49152 * (cost_model.NUCLEUS_TOP_S_PER_VALUE + cost_model.NUCLEUS_SORT_S_PER_VALUE)
    assert nucleus < million < 1.2 * nucleus  # the sort is most of a small model's price
    assert cost_model.teacher_text_seconds(tiny, one_thread, 1 << 19, 128) == pytest.approx(million / 2, rel=0.01)
    # The default text on the larger built-in fits well inside the bound, on one thread.
    assert cost_model.teacher_text_seconds(SHAPES["smollm2-135m"], one_thread, DEFAULT_TOKENS, 128) < LIMITS.teacher_seconds / 4
    # Two threads halve it; an accelerator pays for its forward passes alone.
    assert cost_model.teacher_text_seconds(tiny, cost_model.nominal_profile(2), 1 << 20, 128) == pytest.approx(million / 2, rel=0.01)
    assert cost_model.teacher_text_seconds(tiny, SPEC_PROFILES["h100"], 1 << 20, 128) < million / 100


@pytest.mark.parametrize("family", supported_model_types())
def test_the_shape_read_from_config_json_knows_each_familys_qkv_biases(make_tiny, family):
    # Qwen2's q/k/v carry biases that its config.json never mentions; its adapter says so.
    lm = make_tiny(family)
    q_proj = lm.adapter.attention_projections(lm.adapter.layers(lm.model)[0])[0]
    shape = ModelShape.from_config(json.loads(lm.model.config.to_json_string()))
    assert shape.qkv_bias == (q_proj.bias is not None)


def test_a_compensation_fitted_on_more_windows_is_priced_by_them(tmp_path, monkeypatch):
    """The compensate stage reads its own windows (``--fit-samples``): 4x the windows, 4x its passes; nothing else moves."""
    from gap_engine.core.config import WindowSpec
    from gap_engine.core.progress import COMPENSATE
    from gap_engine.evaluate.metrics import EvalSettings
    from gap_engine.pipeline.runs import prune_eval_stages

    monkeypatch.setenv("GAP_CACHE_DIR", str(tmp_path / "cache"))
    calibration, settings = WindowSpec(n_samples=8, seq_len=64, batch_size=8), EvalSettings()
    stages = prune_eval_stages(settings, False, False, True)

    def seconds(fit_samples: int | None) -> dict[str, float]:
        predicted = cost_model.run_prediction("smollm2-135m", calibration, settings, stages, loaded=True, fit_samples=fit_samples)
        assert predicted is not None
        return predicted.seconds

    own, wider = seconds(None), seconds(32)
    assert seconds(8) == own  # the table's own count, said out loud
    assert wider[COMPENSATE] == pytest.approx(4 * own[COMPENSATE], rel=0.05)
    assert {k: v for k, v in wider.items() if k != COMPENSATE} == {k: v for k, v in own.items() if k != COMPENSATE}
