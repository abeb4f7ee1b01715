"""The `gap` command on the real built-in models (integration, small settings)."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch

from gap_engine.cli import main
from gap_engine.model.loading import load_model

SMALL = ["--samples", "4", "--seq-len", "64"]
# A prune's calibration windows per model: Gemma 3's default compensation, bias+refit, refits down_proj's
# 2,048 inputs, so it needs at least as many calibration tokens.
CALIBRATION = {"smollm2-135m": (4, 64), "gemma3-270m": (8, 288)}
EVAL_SMALL = ["--samples", "2", "--seq-len", "64", "--generations", "1"]


def _run_json(capsys, argv):
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.slow
def test_gap_models_lists_both_builtins():
    out = subprocess.run([sys.executable, "-m", "gap_engine", "models"], capture_output=True, text=True, check=True).stdout
    assert "smollm2-135m" in out and "gemma3-270m" in out and "qwen3" in out


@pytest.mark.slow
@pytest.mark.parametrize("model_name", ["smollm2-135m", pytest.param("gemma3-270m", marks=pytest.mark.heavy)])
def test_prune_uniform_then_eval_and_reload(model_name, tmp_path, capsys):
    out_dir = tmp_path / "pruned"
    samples, seq_len = CALIBRATION[model_name]
    windows = ["--samples", str(samples), "--seq-len", str(seq_len)]
    summary = _run_json(
        capsys, ["prune", "--model", model_name, "--uniform", "0.2", "--out", str(out_dir), "--save-dtype", "float32", "--json", *windows]
    )
    removed = summary["removed_fraction_of_prunable"]
    assert 0.17 < removed < 0.25, removed
    assert summary["params_after"] < summary["params_before"]
    for name in ("model.safetensors", "config.json", "plan.json", "plan.yaml", "kept_indices.json", "gap_pruned.json"):
        assert (out_dir / name).is_file(), name
    config = json.loads((out_dir / "config.json").read_text())
    in_memory = load_model(model_name)  # loaded once: its layer count here, its pruned logits below
    assert len(config["per_layer_config"]) == in_memory.num_layers

    report = _run_json(capsys, ["eval", "--model", str(out_dir), "--data", "wiki-sample", "--json", *EVAL_SMALL])
    ppl, dense_ppl = report["perplexity"]["wiki-sample"], report["dense"]["perplexity"]["wiki-sample"]
    assert math.isfinite(ppl) and ppl > dense_ppl > 1
    assert report["params"] == summary["params_after"]
    assert report["kl_to_dense"]["wiki-sample"] > 0
    assert 0 < report["top1_agreement"]["wiki-sample"] < 1
    assert report["throughput"]["prefill_speedup"] > 0
    assert report["generations"][0]["model"] and report["generations"][0]["dense"]

    # The reloaded checkpoint gives exactly the in-memory pruned model's logits, compensated as the
    # checkpoint says (the family's default, bias or bias+refit: every o_proj and down_proj carries a bias).
    from gap_engine.core.config import WindowSpec
    from gap_engine.model.rateplan import RatePlan
    from gap_engine.pipeline.stages import prune_with_plan
    from gap_engine.prune.compensations import CompensationSettings, family_default

    reloaded = load_model(str(out_dir))
    recorded = reloaded.pruned_from["compensation"]
    expected = family_default(in_memory.model.config.model_type)
    assert recorded["mode"] == summary["compensation"] == expected and config["gap_output_bias"] is True
    compensation = CompensationSettings(mode=recorded["mode"], damping=recorded["damping"], target=recorded["target"])
    prune_with_plan(
        in_memory, RatePlan.load(out_dir / "plan.json"), WindowSpec(n_samples=samples, seq_len=seq_len), compensation=compensation
    )
    ids = in_memory.tokenizer("Structured pruning keeps the model dense but smaller.", return_tensors="pt").input_ids
    with torch.no_grad():
        torch.testing.assert_close(reloaded.model(ids).logits, in_memory.model(ids).logits, rtol=0, atol=0)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["prune", "--model", "no-such-model", "--uniform", "0.2"], "unknown model 'no-such-model'"),
        (["prune", "--model", "smollm2-135m"], "exactly one of --plan"),
        (["eval", "--model", "/nonexistent/folder.gguf"], "does not exist"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(argv, message, tmp_path, capsys):
    out_dir = tmp_path / "never"
    if argv[0] == "prune":
        argv = argv + ["--out", str(out_dir)]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("gap: error: ") and message in err[-1]
    assert not out_dir.exists() and list(tmp_path.iterdir()) == []


def test_rate_outside_range_is_refused_by_the_parser(tmp_path, capsys):
    with pytest.raises(SystemExit) as info:
        main(["prune", "--model", "smollm2-135m", "--uniform", "1.5", "--out", str(tmp_path / "x")])
    assert info.value.code == 2
    assert "rate 1.5 is outside [0, 1)" in capsys.readouterr().err


@pytest.mark.slow  # loads the real built-in model
def test_plan_for_another_model_is_refused(make_tiny, tmp_path, capsys):
    from gap_engine.model.rateplan import make_plan

    plan_path = tmp_path / "tiny-plan.json"
    make_plan(make_tiny("llama"), [0.1, 0.1], [0.1, 0.1], "wanda").save(plan_path)
    out_dir = tmp_path / "out"
    assert main(["prune", "--model", "smollm2-135m", "--plan", str(plan_path), "--out", str(out_dir), *SMALL]) == 2
    assert "plan is for a model with 2 layers, but smollm2-135m has 30" in capsys.readouterr().err
    assert not out_dir.exists()


@pytest.mark.slow  # loads the real built-in model
def test_too_short_text_file_is_refused(tmp_path, capsys):
    short = tmp_path / "short.txt"
    short.write_text("Too short.\n")
    out_dir = tmp_path / "out"
    argv = [
        "prune",
        "--model",
        "smollm2-135m",
        "--uniform",
        "0.2",
        "--out",
        str(out_dir),
        "--data",
        str(short),
        "--samples",
        "2",
        "--seq-len",
        "64",
    ]
    assert main(argv) == 2
    assert "gap: error:" in capsys.readouterr().err
    assert not out_dir.exists()


@pytest.mark.slow
def test_prune_budget_honours_device_dtype_stream_and_save_dtype(tmp_path, capsys, monkeypatch):
    # `gap prune --budget` builds its table spec and loads the model through the shared builders, so
    # --device/--dtype/--stream and --save-dtype reach it as they reach every other command.
    from safetensors import safe_open

    from gap_engine.cli import model_commands

    asked = []
    real_load = model_commands.load_model

    def spy_load(name, device=None):
        asked.append(device)
        return real_load(name, device)

    monkeypatch.setattr(model_commands, "load_model", spy_load)
    out_dir = tmp_path / "dp"
    argv = [
        "prune",
        "--model",
        "smollm2-135m",
        "--budget",
        "0.1",
        "--estimator",
        "fisher",
        "--rates",
        "0,0.25,0.5",
        "--samples",
        "2",
        "--seq-len",
        "32",
        "--device",
        "cpu",
        "--dtype",
        "bfloat16",
        "--stream",
        "--save-dtype",
        "float32",
        "--out",
        str(out_dir),
        "--json",
    ]
    summary = _run_json(capsys, argv)
    assert [(spec.device, spec.dtype, spec.stream) for spec in asked] == [("cpu", "bfloat16", True)]
    assert summary["params_after"] < summary["params_before"]
    with safe_open(str(out_dir / "model.safetensors"), "pt") as weights:
        dtypes = {weights.get_slice(name).get_dtype() for name in weights.keys()}
    assert dtypes == {"F32"}, dtypes


def test_a_missing_optional_package_is_one_line_naming_its_extra(tmp_path, monkeypatch, capsys):
    """The core install leaves out what one feature imports (pyproject extras): asking for the
    feature says which extra installs it, in one line, exit 2, not an internal error."""
    table = tmp_path / "table.json"
    table.write_text("{}")
    for name in [m for m in sys.modules if m.startswith(("gap_engine.views", "gap_engine.cli.report_commands"))]:
        monkeypatch.delitem(sys.modules, name)  # imported again by the handler, as in a fresh process
    monkeypatch.setitem(sys.modules, "plotly", None)  # as if it were not installed
    assert main(["report", "--table", str(table), "--out", str(tmp_path / "report.html")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["gap: error: this command needs plotly, which is not installed: pip install 'gap-engine[report]'"]
