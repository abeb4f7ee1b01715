"""A saved recovery state is read for meaning before it is trained on, everything recovery writes
is strict JSON, and a teacher asked for by name is never silently dropped. Tiny
two-layer Llamas with the real tokenizer; nothing is trained."""

from __future__ import annotations

import json
import math

import pytest
import torch

from gap_engine.recover.files import RecoveryError, RunState, check_saved_state, load_state, save_state
from gap_engine.recover.settings import RecoverySettings
from gap_engine.recover.train import LoraRun, ZORun

TRAJECTORY = {"steps": 4}


def saved(tmp_path, **fields):
    """A work folder holding one snapshot whose state.json has ``fields`` written over it (NaN as NaN)."""
    work = tmp_path / "out.partial"
    save_state(work, RunState(trajectory=dict(TRAJECTORY), start_fingerprint="abc", step=2), {"w": torch.zeros(2)}, None)
    path = work / "state" / "state.json"
    path.write_text(json.dumps(json.loads(path.read_text()) | fields))  # json.dumps writes NaN bare, as a tamperer would
    return work


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"lr": 1e308}, r"lr = 1e\+308 is outside"),
        ({"lr": -1.0}, "lr = -1 is outside"),
        ({"curve": [{"step": 1, "seconds": 0.1, "loss": math.nan, "lr": 0.001}]}, r"curve\[0\] loss must be a finite number"),
        ({"curve": [{"step": 9, "seconds": 0.1, "loss": 2.0, "lr": 0.001}]}, r"curve\[0\] step must be between 1 and 4"),
        ({"curve": [{"step": 1, "seconds": 0.1, "loss": 2.0, "lr": 5.0}]}, r"curve\[0\] lr = 5 is outside"),
        ({"lr_probe": [{"lr": 0.0, "loss_before": 1.0, "loss_after": None}]}, r"lr_probe\[0\] lr = 0 is outside"),
        ({"before": {"perplexity": {"news-sample": math.nan}}}, "before perplexity.*must be a finite number"),
    ],
    ids=["lr-1e308", "lr-negative", "curve-nan", "curve-step-past-steps", "curve-lr-5", "probe-lr-0", "before-nan"],
)
def test_a_tampered_state_is_refused_before_any_model_loads(tmp_path, fields, message):
    work = saved(tmp_path, **fields)
    with pytest.raises(RecoveryError, match=message):
        check_saved_state(work)


def test_a_diverged_loss_is_saved_as_null_and_read_back(tmp_path):
    work = tmp_path / "out.partial"
    curve = [{"step": 1, "seconds": 0.1, "loss": 2.5, "lr": 0.001}, {"step": 2, "seconds": 0.2, "loss": math.nan, "lr": 0.001}]
    save_state(work, RunState(trajectory=dict(TRAJECTORY), start_fingerprint="abc", step=2, curve=curve), {"w": torch.zeros(2)}, None)

    def refuse(constant):
        raise AssertionError(f"bare {constant} in state.json")

    text = (work / "state" / "state.json").read_text()
    assert json.loads(text, parse_constant=refuse)["curve"][1]["loss"] is None
    state, _, _ = load_state(work)
    assert [row["loss"] for row in state.curve] == [2.5, None]


@pytest.fixture
def two_models(make_tiny):
    return make_tiny("llama"), make_tiny("llama", hidden_size=32, head_dim=8, num_hidden_layers=3)


def zo_run(lm, method="mezo") -> ZORun:
    return ZORun(lm, RecoverySettings(method=method, tasks=("news-sample",), steps=4, lr=1e-3).validate())


def test_another_models_saved_tensors_are_refused_not_half_loaded(two_models):
    mine, other = two_models
    run = zo_run(mine)
    before = {name: t.clone() for name, t in run.tensors().items()}
    with pytest.raises(RecoveryError, match="is not this model's: tensor model.layers.2"):
        run.restore(zo_run(other).tensors(), None)
    shapes = {name: t for name, t in zo_run(other).tensors().items() if not name.startswith("model.layers.2")}
    with pytest.raises(RecoveryError, match="has shape .* this model's"):
        run.restore(shapes, None)
    nan = {name: torch.full_like(t, math.nan) for name, t in before.items()}
    with pytest.raises(RecoveryError, match="holds non-finite values"):
        run.restore(nan, None)
    assert all(torch.equal(t, before[name]) for name, t in run.tensors().items())  # nothing was written


def test_a_mazo_mask_outside_its_weight_is_refused(two_models):
    mine, _ = two_models
    run = zo_run(mine, "mazo")
    tensors = {}
    for target in run.targets:
        rows, cols = target.linear.weight.shape
        tensors[f"{target.name}::columns"] = torch.full((rows, 2), cols, dtype=torch.long)  # one past the last column
        tensors[f"{target.name}::values"] = torch.zeros(rows, 2)
    with pytest.raises(RecoveryError, match="saved mask of .* does not fit"):
        run.restore(tensors, None)


def test_another_models_lora_adapters_are_refused(two_models):
    mine, other = two_models
    settings = RecoverySettings(method="lora", tasks=("news-sample",), steps=4).validate()
    with pytest.raises(RecoveryError, match="not this model's|has shape"):
        LoraRun(mine, settings).restore(LoraRun(other, settings).tensors(), None)


def test_a_named_teacher_is_never_dropped(make_tiny):
    from gap_engine.pipeline.recovery_dense import resolve_objective

    with pytest.raises(RecoveryError, match="would go unused"):
        RecoverySettings(method="mezo", tasks=("news-sample",), objective="lm", teacher="smollm2-135m").validate()
    settings = RecoverySettings(method="mezo", tasks=("news-sample",), teacher="/no/such/teacher").validate()
    with pytest.raises(RecoveryError, match="cannot distil: the teacher '/no/such/teacher' cannot be loaded"):
        resolve_objective(make_tiny("llama"), settings, None, lambda message: None, "cpu")
