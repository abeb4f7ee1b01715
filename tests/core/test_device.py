"""Devices and precision: names resolve or fail in one line; bf16 tables, scores and surgery.

There is no accelerator here, so CUDA/MPS are checked for their one-line refusals and the
arithmetic of half precision runs in bfloat16 on the CPU: exact tables agree with the naive
build and with float32 within a stated tolerance, objectives and importance statistics are
accumulated in float64 whatever the model's dtype, and surgery copies weights exactly.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import as_loaded
from reference import naive_build_table
from scipy.stats import spearmanr

from gap_engine.cli import main
from gap_engine.core.device import DeviceError, DeviceSpec, Placement, resolve
from gap_engine.model.loaded import weights_fingerprint
from gap_engine.model.loading import load_model, place_model
from gap_engine.model.rateplan import RatePlan
from gap_engine.prune.importance import compute_importance
from gap_engine.prune.surgery import apply_plan
from gap_engine.tables.artefact import TableSpec, table_key
from gap_engine.tables.build import measure_table
from gap_engine.tables.cells import objective_per_window

BF16 = Placement(device=torch.device("cpu"), dtype=torch.bfloat16)
GRID4 = (0.0, 0.25, 0.5, 0.75)
# bf16 keeps 8 bits of mantissa: a block's output moves by ~0.4% per rounding, and a cell's
# objective (mean NLL, ~10 nats on these random tiny models) by a few hundredths.
BF16_ATOL = 0.05


def windows_of(n: int, t: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 49152, (n, t), generator=torch.Generator().manual_seed(seed))  # (N, T)


def spec_of(**fields) -> TableSpec:
    return TableSpec.from_dict(dict(n_samples=3, seq_len=24, rate_grid=GRID4, batch_size=2) | fields)


# ---- names ------------------------------------------------------------------------------------
def test_auto_is_cpu_float32_without_an_accelerator():
    placement = resolve(DeviceSpec())
    assert placement.device == torch.device("cpu") and placement.dtype == torch.float32 and not placement.stream
    assert resolve(None) == placement
    assert resolve(DeviceSpec("cpu", "bf16")).dtype == torch.bfloat16
    assert resolve(DeviceSpec("cpu", "half")).dtype == torch.float16
    assert resolve(DeviceSpec("cpu", "bfloat16", stream=True)).describe() == "cpu bf16 (streamed)"


@pytest.mark.parametrize(
    "spec, message",
    [
        (DeviceSpec("tpu"), "unknown device 'tpu'"),
        (DeviceSpec("cuda:x"), "unknown device"),
        (DeviceSpec("cpu", "float8"), "unknown dtype 'float8'"),
        (DeviceSpec("cuda"), "--device cuda:"),
        (DeviceSpec("cuda:1"), "--device cuda:1:"),
        (DeviceSpec("mps"), "--device mps: the MPS backend is not available"),
    ],
)
def test_unavailable_or_unknown_devices_are_one_line_errors(spec, message):
    if spec.device.startswith("cuda") and torch.cuda.is_available():
        index = int(spec.device.split(":")[1]) if ":" in spec.device else 0
        if index < torch.cuda.device_count():  # present on this machine: the same spec resolves to it
            assert resolve(spec).device.type == "cuda"
            return
    with pytest.raises(DeviceError) as info:
        resolve(spec)
    assert message in str(info.value) and "\n" not in str(info.value)


def test_cli_refuses_bad_devices_in_one_line(capsys, tmp_path):
    with pytest.raises(SystemExit) as info:
        main(["table", "--model", "x", "--device", "tpu", "--out", str(tmp_path / "t.json")])
    assert info.value.code == 2 and "unknown device 'tpu'" in capsys.readouterr().err
    if not torch.cuda.is_available():
        assert main(["eval", "--model", "smollm2-135m", "--device", "cuda"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("gap: error: --device cuda: ")
    for command in (
        ["prune", "--model", "m", "--uniform", "0.1", "--out", "o"],
        ["eval", "--model", "m"],
        ["compare", "--model", "m", "--out", "o"],
        ["plan", "--table", "t", "--budget", "0.1", "--out", "o"],
    ):
        from gap_engine.cli.parser import build_parser

        args = build_parser().parse_args([*command, "--device", "cpu", "--dtype", "bf16", "--stream"])
        assert (args.device, args.dtype, args.stream) == ("cpu", "bfloat16", True)


# ---- loading in a dtype -----------------------------------------------------------------------
@pytest.mark.slow
def test_a_model_has_one_fingerprint_in_every_dtype(make_tiny, tmp_path):
    lm = make_tiny("qwen3", initializer_range=0.2)
    folder = tmp_path / "tiny"
    lm.model.save_pretrained(folder)
    lm.tokenizer.save_pretrained(folder)
    fp32 = load_model(str(folder))
    bf16 = load_model(str(folder), DeviceSpec("cpu", "bfloat16"))
    assert fp32.fingerprint == bf16.fingerprint == lm.fingerprint
    assert next(bf16.model.parameters()).dtype == torch.bfloat16 and bf16.placement.dtype == torch.bfloat16
    spec = spec_of()
    assert table_key(bf16, spec, "d") != table_key(fp32, spec, "d")
    assert "tiny.bf16-nll-split-exact-" in table_key(bf16, spec, "d")
    digest = lambda key: key.rsplit("-", 1)[1]  # noqa: E731 (the names differ: a path and "tiny-qwen3")
    assert digest(table_key(fp32, spec, "d")) == digest(table_key(lm, spec, "d"))  # float32 keys are what they were


# ---- arithmetic in bf16 ----------------------------------------------------------------------------
def test_objectives_are_summed_in_float64_from_float32_logits():
    logits = torch.randn(2, 8, 50, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    ids = torch.randint(0, 50, (2, 8), generator=torch.Generator().manual_seed(1))
    got = objective_per_window(logits, ids, "nll", None)
    want = objective_per_window(logits.float(), ids, "nll", None)
    assert got.dtype == torch.float64 and torch.equal(got, want)
    dense = torch.log_softmax(logits.float() * 0.9, dim=-1)
    assert objective_per_window(logits, ids, "kl", dense).dtype == torch.float64


@pytest.mark.parametrize("family", ["llama", "gemma3_text"])
@pytest.mark.slow
def test_bf16_exact_table_agrees_with_the_naive_build_and_float32(make_tiny, family):
    fp32 = make_tiny(family, initializer_range=0.2)
    bf16 = place_model(fp32.copy(), BF16)
    windows = windows_of(3, 24)
    spec = spec_of()
    fast = measure_table(bf16, spec, windows)
    naive = naive_build_table(bf16, spec, windows=windows)
    reference = measure_table(fp32, spec, windows)
    assert fast.extras["placement"] == "cpu bf16"
    np.testing.assert_allclose(fast.cell_objective, naive.cell_objective, atol=BF16_ATOL, rtol=0)
    np.testing.assert_allclose(fast.cell_objective, reference.cell_objective, atol=BF16_ATOL, rtol=0)
    assert np.abs(fast.cell_objective - reference.cell_objective).max() > 0  # it really ran in bf16
    np.testing.assert_array_equal(fast.removed, reference.removed)
    assert weights_fingerprint(bf16.model) == weights_fingerprint(fp32.copy().model.to(torch.bfloat16))  # restored


@pytest.mark.slow
def test_bf16_gradient_estimate_runs_and_ranks_like_float32(make_tiny):
    fp32 = make_tiny("llama", initializer_range=0.2)
    bf16 = place_model(fp32.copy(), BF16)
    windows = windows_of(4, 24, seed=2)
    a = measure_table(fp32, spec_of(estimator="fisher", n_samples=4), windows)
    b = measure_table(bf16, spec_of(estimator="fisher", n_samples=4), windows)
    assert np.isfinite(b.delta).all()
    assert np.corrcoef(a.delta[:, 1:].ravel(), b.delta[:, 1:].ravel())[0, 1] > 0.9


@pytest.mark.parametrize("criterion", ["magnitude", "wanda", "taylor"])
@pytest.mark.slow
def test_bf16_importance_scores_are_float64_and_close_to_float32(make_tiny, criterion):
    fp32 = make_tiny("llama", initializer_range=0.2)
    bf16 = place_model(fp32.copy(), BF16)
    windows = windows_of(4, 24, seed=3)
    a = compute_importance(fp32, windows, criterion)
    b = compute_importance(bf16, windows, criterion)
    for x, y in zip(a.layers, b.layers):
        assert y.head.dtype == y.channel.dtype == torch.float64
        if criterion == "taylor":  # |sum W * dL/dW| cancels: in bf16 only its ranking survives well
            assert spearmanr(x.channel.numpy(), y.channel.numpy())[0] > 0.7
        else:
            assert torch.allclose(x.channel, y.channel, rtol=0.05, atol=1e-3 * float(x.channel.abs().max()))


@pytest.mark.slow
def test_surgery_is_exact_in_bf16(make_tiny, tmp_path):
    fp32 = as_loaded(make_tiny("qwen2", initializer_range=0.2), tmp_path / "dense")
    bf16 = place_model(fp32.copy(), BF16)
    windows = windows_of(4, 24, seed=4)
    scores = compute_importance(fp32, windows, "magnitude")
    plan = RatePlan.from_dict(
        {
            "model": fp32.name,
            "model_fingerprint": fp32.fingerprint,
            "num_layers": 2,
            "criterion": "magnitude",
            "attention_rates": [0.5, 0.0],
            "mlp_rates": [0.25, 0.5],
        }
    )
    pruned_fp32, pruned_bf16 = fp32.copy(), bf16
    result = apply_plan(pruned_fp32, plan, scores)
    apply_plan(pruned_bf16, plan, scores)
    # Slicing copies values: the bf16 pruned model is the fp32 pruned model rounded, bit for bit.
    for (name, a), (_, b) in zip(pruned_fp32.model.state_dict().items(), pruned_bf16.model.state_dict().items()):
        assert b.dtype == torch.bfloat16 and torch.equal(a.to(torch.bfloat16), b), name
    assert pruned_bf16.param_count() == result.params_after
    from gap_engine.model.checkpoint import save_pruned

    save_pruned(pruned_bf16, plan, result.kept_indices(), tmp_path / "pruned")
    reloaded = load_model(str(tmp_path / "pruned"), DeviceSpec("cpu", "bfloat16"))
    assert reloaded.fingerprint == pruned_bf16.fingerprint
    ids = windows_of(1, 12, seed=5)
    with torch.inference_mode():
        assert torch.equal(reloaded.model(input_ids=ids).logits, pruned_bf16.model(input_ids=ids).logits)
