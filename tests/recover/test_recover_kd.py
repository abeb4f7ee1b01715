"""Recovery by distillation from the dense model: the objective's maths, training, resume, the saved checkpoint.

A tiny Llama (two blocks, hidden 64) is saved as a plain model folder and pruned from there, so
the checkpoint records a dense base model that really loads: the default objective is then kd,
as it is for a checkpoint of a built-in model. Text: the real news-sample plus a small local file.
"""

from __future__ import annotations

import json
import logging
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from test_recover import (
    _cli,
    _crash_at,
    assert_same_tensors,
    checkpoint_tensors,
    text_file,  # the shared calibration text fixture  # noqa: F401
    tiny_settings,
)

from gap_engine.core.errors import GapError
from gap_engine.core.progress import Hooks
from gap_engine.model.loading import load_model
from gap_engine.pipeline.recovery import recover
from gap_engine.recover import guard
from gap_engine.recover import zo as recover_zo
from gap_engine.recover.distill import Objective, distillation_loss
from gap_engine.recover.files import RecoveryError, partial_dir
from gap_engine.recover.train import PROBE_FACTORS, TaskData, ZORun


@pytest.fixture(scope="module")
def dense_and_pruned(smol_tokenizer, text_file, tmp_path_factory) -> tuple[Path, Path]:
    """(a tiny dense model folder, a checkpoint pruned from it that records it as its base model)."""
    from conftest import tiny_lm

    from gap_engine.core.config import WindowSpec
    from gap_engine.model.checkpoint import save_pruned
    from gap_engine.model.rateplan import make_plan
    from gap_engine.pipeline.stages import prune_with_plan

    dense_dir = tmp_path_factory.mktemp("dense") / "tiny-dense"
    # Weights 5x the default init scale: peaked next-token distributions, so pruning opens a KL gap to close.
    tiny_lm("llama", smol_tokenizer, initializer_range=0.1).model.save_pretrained(dense_dir)
    smol_tokenizer.save_pretrained(dense_dir)
    dense = load_model(str(dense_dir))
    plan = make_plan(dense, [0.5, 0.25], [0.5, 0.5], "wanda")
    result = prune_with_plan(dense, plan, WindowSpec(data=text_file, n_samples=2, seq_len=32, batch_size=2))
    folder = tmp_path_factory.mktemp("pruned") / "tiny"
    save_pruned(dense, plan, result.kept_indices(), folder)  # bfloat16, the default
    return dense_dir, folder


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("GAP_CACHE_DIR", str(tmp_path / "cache"))


# ---- the objective ---------------------------------------------------------------------------
@pytest.mark.slow
def test_kd_of_the_student_against_itself_is_exactly_zero(make_tiny):
    lm = make_tiny("llama")
    batch = torch.randint(5, 5000, (4, 24), generator=torch.Generator().manual_seed(0))
    for temperature in (1.0, 2.5):
        objective = Objective("kd", temperature, teacher=lm.model)
        loss = objective.per_task(lm.model, batch, 2, objective.teacher_log_probs(batch))
        assert loss.shape == (2,) and torch.equal(loss, torch.zeros(2)), loss
    other = make_tiny("llama", seed=1).model
    objective = Objective("kd", 1.0, teacher=other)
    assert (objective.per_task(lm.model, batch, 2, objective.teacher_log_probs(batch)) > 1e-4).all()


@pytest.mark.slow
def test_kd_is_the_temperature_scaled_kl_and_kd_lm_the_weighted_sum(make_tiny):
    student, teacher = make_tiny("llama").model, make_tiny("llama", seed=1).model
    batch = torch.randint(5, 5000, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        s_logits, t_logits = (m(input_ids=batch).logits[:, :-1].float() for m in (student, teacher))
    tau = 2.0
    p = torch.softmax(t_logits / tau, -1)
    explicit = (p * (torch.log_softmax(t_logits / tau, -1) - torch.log_softmax(s_logits / tau, -1))).sum(-1) * tau**2
    got = distillation_loss(s_logits, torch.log_softmax(t_logits / tau, -1), tau)
    torch.testing.assert_close(got, explicit, rtol=1e-5, atol=1e-6)
    parts = {}
    for name in ("kd", "lm", "kd+lm"):
        objective = Objective(name, tau, kd_weight=0.25, teacher=teacher)
        with torch.no_grad():
            parts[name] = objective.per_task(student, batch, 1, objective.teacher_log_probs(batch))
    torch.testing.assert_close(parts["kd+lm"], 0.25 * parts["kd"] + 0.75 * parts["lm"])


@pytest.mark.slow
def test_zo_step_with_zero_update_restores_every_weight_under_kd(dense_and_pruned, text_file):
    dense_dir, pruned = dense_and_pruned
    lm, teacher = load_model(str(pruned)), load_model(str(dense_dir))
    settings = tiny_settings(text_file, method="mazo", mask_fraction=0.25).validate()
    data = TaskData(lm, settings)
    objective = Objective("kd", 2.0, teacher=teacher.model)
    run = ZORun(lm, settings, objective)
    run.prepare(data, Hooks())
    batch = data.batch(0)
    log_p = objective.teacher_log_probs(batch)
    for masked in (True, False):
        if not masked:
            for target in run.targets:
                target.columns = None
        before = {k: v.clone() for k, v in lm.model.state_dict().items()}
        result = recover_zo.zo_step(
            lm.model,
            run.targets,
            lambda: float(objective.per_task(lm.model, batch, 2, log_p).mean()),
            recover_zo.step_seed(0, 0),
            1e-2,
            0.0,
        )
        assert result.loss_plus != result.loss_minus  # the perturbation reached the kd loss
        assert_same_tensors(before, lm.model.state_dict())


# ---- training ----------------------------------------------------------------------------------
@pytest.mark.slow
def test_kd_is_the_default_and_lowers_the_heldout_kl(dense_and_pruned, text_file, tmp_path):
    dense_dir, pruned = dense_and_pruned
    settings = tiny_settings(
        text_file, method="lora", lr=1e-2, steps=8, schedule="constant", evaluate_before=True, compare_dense=True, eval_samples=2
    )
    result = recover(load_model(str(pruned)), settings, out_dir=tmp_path / "out")
    assert result.objective == "kd" and "default" in result.objective_note and result.teacher == str(dense_dir)
    for task in settings.tasks:
        before, after = result.before["kl_to_dense"][task], result.after["kl_to_dense"][task]
        assert after < 0.95 * before, (task, before, after)
    # Dense's calibration loss on the same fixed windows: the number the pruned one is read against.
    dense_loss = result.after["dense_calib_loss"]
    assert len(dense_loss) == len(settings.tasks) and all(0 < d != b for d, b in zip(dense_loss, result.calib_loss_before)), dense_loss


@pytest.mark.slow
def test_recovered_checkpoint_keeps_bf16_and_its_card_says_what_ran(dense_and_pruned, text_file, tmp_path):
    from safetensors import safe_open

    _, pruned = dense_and_pruned
    out = tmp_path / "out"
    settings = tiny_settings(text_file, tasks=(text_file,), method="mezo", lr=0.05, steps=2)
    result = recover(load_model(str(pruned)), settings, out_dir=out)
    assert result.save_dtype == "bfloat16"
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}
    assert json.loads((out / "gap_pruned.json").read_text())["dtype"] == "bfloat16"
    card = (out / "README.md").read_text()
    assert "## Recovery" in card and "| method | mezo |" in card and "| steps | 2 |" in card
    assert "Recovered by the short fine-tune above" in card and "without any retraining" not in card
    reloaded = load_model(str(out))  # what was evaluated after training is what was saved
    assert reloaded.fingerprint == json.loads((out / "gap_pruned.json").read_text())["fingerprint"]
    as_float = recover(load_model(str(pruned)), replace(settings, steps=1, objective="lm", save_dtype="float32"), out_dir=tmp_path / "f32")
    assert as_float.save_dtype == "float32"
    assert checkpoint_tensors(tmp_path / "f32")["lm_head.weight"].dtype == torch.float32


def test_card_escapes_names_from_the_user():
    from gap_engine.model.model_card import _recovery_section, md_text

    text = md_text("a|b <script>*x*</script>\nnext")
    assert "<script>" not in text and "\n" not in text and text.startswith("a\\|b ") and "\\*x\\*" in text
    lines = _recovery_section({
        "method": "lora", "objective": "kd", "teacher": "evil|`x`", "temperature": 1.0, "tasks": ["<b>|bad"],
        "steps": 3, "tokens": 10, "train_seconds": 1.0, "lr": 1e-3,
        "before": {"perplexity": {"<b>|bad": 10.0}}, "after": {"perplexity": {"<b>|bad": 9.0}},
    })  # fmt: skip
    cells = [line.count("|") - line.count("\\|") for line in lines if line.startswith("|")]
    assert set(cells) == {3, 5}  # every row keeps its two or four cells: no name opened a new one
    assert "<b>" not in "\n".join(lines) and "&lt;b&gt;\\|bad" in "\n".join(lines)
    assert "| 10.000 → 9.000 |" in "\n".join(lines)


@pytest.mark.slow
def test_resume_is_exact_under_kd_and_refuses_another_objective(dense_and_pruned, text_file, tmp_path):
    _, pruned = dense_and_pruned
    settings = tiny_settings(text_file, tasks=(text_file,), method="mazo", lr=0.1, steps=4, save_every=2, objective="kd", temperature=2.0)
    reference = recover(load_model(str(pruned)), settings, out_dir=tmp_path / "reference")
    out = tmp_path / "interrupted"
    with pytest.raises(RuntimeError, match="simulated crash"):
        recover(load_model(str(pruned)), settings, Hooks(progress=_crash_at(3)), out_dir=out)
    with pytest.raises(RecoveryError, match="objective kd, not lm"):
        recover(load_model(str(pruned)), replace(settings, objective="lm"), out_dir=out, resume=True)
    resumed = recover(load_model(str(pruned)), replace(settings, objective=None), out_dir=out, resume=True)  # default: kd
    assert resumed.resumed_from == 2 and resumed.objective == "kd"
    assert [row["loss"] for row in resumed.curve] == [row["loss"] for row in reference.curve]
    assert_same_tensors(checkpoint_tensors(out), checkpoint_tensors(tmp_path / "reference"))


# ---- bad input -----------------------------------------------------------------------------------
@pytest.mark.slow
def test_cli_refuses_bad_distillation_input_in_one_line(dense_and_pruned, text_file, smol_tokenizer, tmp_path, capsys):
    from conftest import tiny_lm

    _, pruned = dense_and_pruned
    other_vocab = tmp_path / "other-vocab"
    tiny_lm("llama", smol_tokenizer, vocab_size=50000).model.save_pretrained(other_vocab)
    smol_tokenizer.save_pretrained(other_vocab)
    orphan = tmp_path / "orphan"  # a checkpoint whose dense base model has gone
    import shutil

    shutil.copytree(pruned, orphan)
    marker = json.loads((orphan / "gap_pruned.json").read_text())
    (orphan / "gap_pruned.json").write_text(json.dumps(marker | {"base_model": str(tmp_path / "gone")}))
    out = tmp_path / "out"
    base = ["recover", "--method", "mezo", "--data", f"news-sample,{text_file}", "--steps", "2", "--seq-len", "32", "--out", str(out)]
    cases = [
        (["--model", str(pruned), "--temperature", "0"], "temperature must be a number in (0, 100]"),
        (["--model", str(pruned), "--temperature", "101"], "temperature must be"),
        (["--model", str(pruned), "--temperature", "nan"], "temperature must be"),
        (["--model", str(pruned), "--teacher", str(other_vocab)], "predicts 50000 tokens"),
        (["--model", str(orphan), "--objective", "kd"], "needs the dense model to distil from"),
        (
            ["--model", str(pruned), "--objective", "kd", "--teacher", str(tmp_path / "nowhere")],
            "--teacher: unknown model",
        ),  # before any load
    ]
    for extra, message in cases:
        code, stdout, stderr = _cli(base + extra, capsys)
        assert code == 2, (extra, stderr)
        errors = [line for line in stderr.splitlines() if line.startswith("gap: error")]
        assert len(errors) == 1 and message in errors[0], (extra, stderr)
        assert not out.exists() and not partial_dir(out).exists(), extra
    with pytest.raises(GapError, match="unknown objective"):
        tiny_settings(text_file, objective="kl").validate()


@pytest.mark.slow
def test_without_its_dense_model_the_default_objective_is_lm_said_once_without_a_warning(
    dense_and_pruned, text_file, tmp_path, capsys, caplog
):
    """The reason goes in the objective's line; a logged WARNING beside it read as a second,
    alarming message (and made the hostile benchmark's full-disk recover case unclean)."""
    import shutil

    _, pruned = dense_and_pruned
    orphan = tmp_path / "orphan"
    shutil.copytree(pruned, orphan)
    marker = json.loads((orphan / "gap_pruned.json").read_text())
    (orphan / "gap_pruned.json").write_text(json.dumps(marker | {"base_model": str(tmp_path / "gone")}))
    argv = [
        "recover",
        "--model",
        str(orphan),
        "--method",
        "mezo",
        "--lr",
        "0.01",
        "--data",
        text_file,
        "--steps",
        "1",
        "--seq-len",
        "16",
        "--batch-size",
        "1",
        "--pool-windows",
        "2",
        "--no-eval-before",
        "--no-dense",
        "--no-history",
        "--eval-samples",
        "1",
        "--eval-seq-len",
        "16",
        "--generations",
        "0",
        "--out",
        str(tmp_path / "out"),
    ]
    with caplog.at_level(logging.INFO, logger="gap_engine"):
        code, _, stderr = _cli(argv, capsys)
    assert code == 0, stderr
    assert sum("objective lm (next-token loss): the dense base model" in line for line in stderr.splitlines()) == 1, stderr
    assert not [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


@pytest.mark.slow
def test_zo_without_a_rate_probes_and_trains_as_if_the_chosen_rate_were_given(dense_and_pruned, text_file, tmp_path):
    _, pruned = dense_and_pruned
    settings = tiny_settings(text_file, tasks=(text_file,), method="mazo", steps=3, objective="lm")
    probed = recover(load_model(str(pruned)), settings, out_dir=tmp_path / "probed")
    rows = probed.lr_probe
    assert len(rows) == len(PROBE_FACTORS) and probed.lr in [row["lr"] for row in rows]
    best = min(range(len(rows)), key=lambda i: (rows[i]["loss_after"], -rows[i]["lr"]))
    assert rows[best]["best"] and probed.lr == rows[min(best + 1, len(rows) - 1)]["lr"]  # one notch below the best
    assert len({row["loss_after"] for row in rows}) == len(PROBE_FACTORS)  # every candidate really trained
    # The probe put the starting weights back bit for bit: the run equals one given that rate outright.
    given = recover(load_model(str(pruned)), replace(settings, lr=probed.lr), out_dir=tmp_path / "given")
    assert [row["loss"] for row in given.curve] == [row["loss"] for row in probed.curve]
    assert_same_tensors(checkpoint_tensors(tmp_path / "given"), checkpoint_tensors(tmp_path / "probed"))


# ---- the divergence guard ------------------------------------------------------------------------
@pytest.mark.slow
def test_the_guard_rolls_back_a_rising_objective_cuts_the_rate_and_trains_on(dense_and_pruned, text_file, tmp_path):
    """MeZO at rate 0.1 raises the kd objective on this model within two steps: the guard goes back
    to the last good snapshot, divides the rate by 3 until the objective holds, and the run still
    does every step, its curve one row per step."""
    _, pruned = dense_and_pruned
    settings = tiny_settings(text_file, method="mezo", lr=0.1, steps=6, save_every=2, schedule="constant", objective="kd")
    result = recover(load_model(str(pruned)), settings, out_dir=tmp_path / "out")
    assert result.stopped == "steps" and result.steps_done == 6
    assert [row["step"] for row in result.curve] == [1, 2, 3, 4, 5, 6]
    assert result.rollbacks and all(row["action"] == guard.ROLL_BACK for row in result.rollbacks)
    for row in result.rollbacks:  # each one a real rise of the objective on the fixed windows
        assert row["loss"] > row["lowest"] * (1 + guard.TOLERANCE)
    assert result.lr_scale == pytest.approx(guard.LR_CUT ** -len(result.rollbacks))
    assert result.curve[-1]["lr"] == pytest.approx(0.1 * result.lr_scale)
    assert json.loads((tmp_path / "out" / "recovery.json").read_text())["rollbacks"] == result.rollbacks
    assert "rolled back" in result.guard_summary and "trained on at" in result.guard_summary


@pytest.mark.slow
def test_when_no_rate_cut_helps_the_guard_stops_at_the_starting_weights(dense_and_pruned, text_file, tmp_path):
    _, pruned = dense_and_pruned
    settings = tiny_settings(
        text_file, method="mezo", lr=1.0, steps=2, save_every=2, schedule="constant", objective="kd", save_dtype="float32"
    )
    result = recover(load_model(str(pruned)), settings, out_dir=tmp_path / "out")
    assert result.stopped == "diverged" and result.steps_done == 0 and not result.curve
    assert [row["action"] for row in result.rollbacks] == [guard.ROLL_BACK] * guard.MAX_ROLLBACKS + [guard.STOP]
    assert {row["back_to"] for row in result.rollbacks} == {0}
    assert "stopped at the last good snapshot, step 0" in result.guard_summary
    # The last good snapshot is the start: the checkpoint holds the pruned model's weights unchanged.
    assert result.calib_loss_after == result.calib_loss_before
    start = checkpoint_tensors(pruned)
    saved = checkpoint_tensors(tmp_path / "out")
    assert_same_tensors({k: v.float() for k, v in start.items()}, saved)
