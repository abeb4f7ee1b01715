"""Recovery after pruning: the ZO maths, LoRA and MaZO training, resume, checkpoints, the CLI.

The maths and the training run on a tiny Llama (two blocks, hidden 64) pruned to different
widths per block and saved as a real checkpoint; the text is the real news-sample plus a
small local file (two tasks). The real model runs once, a handful of steps at small settings.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from gap_engine.cli import main
from gap_engine.core.errors import CancelledError, DataError, GapError
from gap_engine.core.progress import Hooks
from gap_engine.model.loading import load_model
from gap_engine.pipeline.recovery import RecoverySettings, recover
from gap_engine.recover import guard
from gap_engine.recover import zo as recover_zo
from gap_engine.recover.files import RecoveryError, partial_dir
from gap_engine.recover.loop import lr_at
from gap_engine.recover.train import TaskData, ZORun, multitask_loss

WORDS = (
    "the of and to in is was for on that with as by at from his an were are which this be or has had it not first "
    "their after one new also been two its who but they her she more time into all may when other".split()
)


@pytest.fixture(scope="module")
def text_file(tmp_path_factory) -> str:
    rng = np.random.default_rng(0)
    paragraphs = [" ".join(rng.choice(WORDS, size=120)) + "." for _ in range(40)]
    path = tmp_path_factory.mktemp("text") / "calib.txt"
    path.write_text("\n\n".join(paragraphs))
    return str(path)


@pytest.fixture(scope="module")
def pruned_dir(smol_tokenizer, text_file, tmp_path_factory) -> Path:
    """A tiny Llama pruned to other widths in each block (heads and channels), saved by save_pruned."""
    from conftest import tiny_lm

    from gap_engine.core.config import WindowSpec
    from gap_engine.model.checkpoint import save_pruned
    from gap_engine.model.rateplan import make_plan
    from gap_engine.pipeline.stages import prune_with_plan

    lm = tiny_lm("llama", smol_tokenizer)
    plan = make_plan(lm, [0.5, 0.0], [0.25, 0.5], "wanda")
    result = prune_with_plan(lm, plan, WindowSpec(data=text_file, n_samples=2, seq_len=32, batch_size=2))
    folder = tmp_path_factory.mktemp("pruned") / "tiny"
    save_pruned(lm, plan, result.kept_indices(), folder)
    return folder


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    """The run history and any cache writes go to a temporary folder."""
    monkeypatch.setenv("GAP_CACHE_DIR", str(tmp_path / "cache"))


def tiny_settings(text_file, **overrides) -> RecoverySettings:
    base = RecoverySettings(
        tasks=("news-sample", text_file),
        steps=6,
        seq_len=32,
        batch_size=2,
        pool_windows=32,
        importance_windows=4,
        calib_eval_windows=4,
        save_every=2,
        eval_samples=1,
        eval_seq_len=32,
        eval_generations=0,
        evaluate_before=False,
        compare_dense=False,
        record_history=False,
    )
    return replace(base, **overrides)


def widths(lm) -> set[tuple[int, int]]:
    return {tuple(lin.weight.shape) for _, lin in lm.model.named_modules() if isinstance(lin, torch.nn.Linear)}


def checkpoint_tensors(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(folder / "model.safetensors"))


def assert_same_tensors(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    different = [k for k in a if not torch.equal(a[k], b[k])]
    assert not different, different[:5]


# ---- the zeroth-order maths --------------------------------------------------------------------
@pytest.fixture
def zo_run(pruned_dir, text_file):
    lm = load_model(str(pruned_dir))
    settings = tiny_settings(text_file, method="mazo", mask_fraction=0.25).validate()
    data = TaskData(lm, settings)
    run = ZORun(lm, settings)
    run.prepare(data, Hooks())
    return lm, settings, data, run


@pytest.mark.slow
def test_the_checkpoint_has_heterogeneous_widths(pruned_dir):
    lm = load_model(str(pruned_dir))
    geometries = [lm.adapter.geometry(layer) for layer in lm.adapter.layers(lm.model)]
    assert len({(g.n_heads, g.intermediate_size) for g in geometries}) == 2


@pytest.mark.slow
def test_zo_step_with_zero_update_restores_every_weight_bit_for_bit(zo_run):
    lm, settings, data, run = zo_run
    for masked in (True, False):
        if not masked:
            for target in run.targets:
                target.columns = None
        before = {k: v.clone() for k, v in lm.model.state_dict().items()}
        batch = data.batch(0)
        result = recover_zo.zo_step(
            lm.model, run.targets, lambda: float(multitask_loss(lm.model, batch, 2).mean()), recover_zo.step_seed(0, 0), 1e-2, 0.0
        )
        assert result.loss_plus != result.loss_minus  # the perturbation did reach the forward pass
        assert_same_tensors(before, lm.model.state_dict())


@pytest.mark.slow
def test_the_forward_pass_sees_exactly_w_plus_eps_z(zo_run):
    lm, settings, data, run = zo_run
    batch, seed, eps = data.batch(1), recover_zo.step_seed(3, 7), 1e-2
    with torch.no_grad(), recover_zo.perturbed(lm.model, run.targets, seed, eps):
        hooked = multitask_loss(lm.model, batch, 2)
    with torch.no_grad():
        for index, target in enumerate(run.targets):
            z = recover_zo.direction(index, target, seed)
            columns = target.columns.long()
            weight = target.linear.weight
            weight.scatter_(1, columns, weight.gather(1, columns) + eps * z)
        explicit = multitask_loss(lm.model, batch, 2)
    assert torch.equal(hooked, explicit)


@pytest.mark.slow
def test_directions_regenerate_exactly_and_differ_between_steps_and_matrices(zo_run):
    _, _, _, run = zo_run
    target = run.targets[0]
    first = recover_zo.direction(0, target, recover_zo.step_seed(0, 5))
    assert torch.equal(first, recover_zo.direction(0, target, recover_zo.step_seed(0, 5)))
    assert not torch.equal(first, recover_zo.direction(0, target, recover_zo.step_seed(0, 6)))
    assert not torch.equal(first, recover_zo.direction(0, target, recover_zo.step_seed(1, 5)))
    second = recover_zo.direction(1, run.targets[1], recover_zo.step_seed(0, 5))
    assert first.flatten()[:8].tolist() != second.flatten()[:8].tolist()


def test_a_direction_of_many_pieces_is_the_same_on_one_thread_or_two_and_its_pieces_are_independent():
    linear = torch.nn.Linear(1000, 300, bias=False)  # 300,000 values: five pieces
    target = recover_zo.ZOTarget("wide", linear)
    seed = recover_zo.step_seed(4, 9)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        serial = recover_zo.direction(2, target, seed)
        torch.set_num_threads(2)
        parallel = recover_zo.direction(2, target, seed, out=torch.empty(300, 1000))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(serial, parallel)
    flat, size = serial.flatten(), recover_zo.DIRECTION_PIECE
    pieces = [flat[i * size : (i + 1) * size] for i in range(4)]
    for a, b in zip(pieces, pieces[1:]):  # a seed reused between pieces would repeat the values
        assert abs(float(torch.corrcoef(torch.stack([a, b]))[0, 1])) < 0.02
    assert abs(float(flat.mean())) < 0.01 and abs(float(flat.std()) - 1.0) < 0.01  # N(0, 1)


@pytest.mark.slow
def test_the_update_is_lr_g_z_on_masked_entries_and_nothing_elsewhere(zo_run):
    lm, settings, data, run = zo_run
    before = [t.linear.weight.detach().clone() for t in run.targets]
    others = {k: v.clone() for k, v in lm.model.state_dict().items() if not k.endswith("proj.weight")}
    batch, seed, lr = data.batch(2), recover_zo.step_seed(0, 2), 0.5
    result = recover_zo.zo_step(lm.model, run.targets, lambda: float(multitask_loss(lm.model, batch, 2).mean()), seed, 1e-2, lr)
    assert result.projected_grad != 0
    for index, (target, old) in enumerate(zip(run.targets, before)):
        new = target.linear.weight.detach()
        columns = target.columns.long()
        mask = torch.zeros_like(old, dtype=torch.bool).scatter_(1, columns, True)
        assert torch.equal(new[~mask], old[~mask])  # unmasked weights: bit-identical
        z = recover_zo.direction(index, target, seed)
        expected = old.gather(1, columns) + (-lr * result.projected_grad) * z
        assert torch.equal(new.gather(1, columns), expected)
    after_others = {k: v for k, v in lm.model.state_dict().items() if k in others}
    assert_same_tensors(others, after_others)  # embeddings, norms, LM head untouched


def test_mask_keeps_k_per_row_and_weighs_tasks_equally():
    weight = torch.ones(3, 6)
    loud = torch.tensor([1000.0, 0, 0, 0, 0, 0], dtype=torch.float64)  # task A: feature 0, huge activations
    quiet = torch.tensor([0, 0, 0, 0, 0, 1.0], dtype=torch.float64)  # task B: feature 5, tiny activations
    columns = recover_zo.mask_columns(weight, [loud, quiet], fraction=2 / 6, magnitude_weight=0.0)
    assert columns.dtype == torch.int16 and columns.shape == (3, 2)
    # Row normalisation: the quiet task's feature is kept as surely as the loud one's.
    assert columns.tolist() == [[0, 5]] * 3
    # Magnitude alone (no activation preference) keeps the largest weights of each row.
    weight = torch.tensor([[0.1, -5.0, 0.2, 3.0], [4.0, 0.0, -0.1, 0.3]])
    flat = torch.ones(4, dtype=torch.float64)
    assert recover_zo.mask_columns(weight, [flat], 0.5, 1.0).tolist() == [[1, 3], [0, 3]]


@pytest.mark.slow
def test_mazo_masks_a_fraction_of_every_projection(zo_run):
    _, settings, _, run = zo_run
    for target in run.targets:
        rows, width = target.linear.weight.shape
        k = round(settings.mask_fraction * width)
        assert target.columns.shape == (rows, k)
        assert (target.columns.long().diff(dim=1) > 0).all()  # distinct, ascending
    assert run.trainable_params == sum(t.columns.numel() for t in run.targets)


# ---- training --------------------------------------------------------------------------------
@pytest.mark.parametrize("method, lr", [("lora", 1e-2), ("mazo", 0.1)])
@pytest.mark.slow
def test_lora_and_mazo_lower_the_calibration_loss(pruned_dir, text_file, tmp_path, method, lr):
    lm = load_model(str(pruned_dir))
    settings = tiny_settings(text_file, method=method, lr=lr, steps=10, mask_fraction=0.1, schedule="constant")
    result = recover(lm, settings, out_dir=tmp_path / "out")
    assert result.steps_done == 10 and len(result.curve) == 10
    before, after = result.calib_loss_before, result.calib_loss_after
    # ZO descends the mean over tasks along one random direction per step: in ten steps one
    # task may rise while the mean falls; gradient steps (LoRA) lower every task here.
    assert sum(after) < sum(before) - 2e-3, (before, after)
    if method == "lora":
        assert all(a < b - 1e-3 for a, b in zip(after, before)), (before, after)
    assert result.trainable_params > 0
    assert result.peak_rss > 0 and result.inference_rss > 0
    assert 0 < result.train_cpu_seconds and 0 < result.train_seconds  # CPU time: what a shared machine's wall time hides
    assert not partial_dir(tmp_path / "out").exists()  # the work folder goes once the checkpoint is in place


@pytest.mark.slow
def test_lora_checkpoint_reloads_with_the_adapter_models_logits(pruned_dir, text_file, tmp_path):
    from peft import PeftModel

    out = tmp_path / "lora"
    settings = tiny_settings(text_file, method="lora", lr=1e-2, steps=3, save_dtype="float32")  # the merged weights exactly
    result = recover(load_model(str(pruned_dir)), settings, out_dir=out)
    assert result.adapter == str(out / "adapter")
    merged = load_model(str(out))  # a normal pruned checkpoint: load_model rebuilds the widths
    assert widths(merged) == widths(load_model(str(pruned_dir)))
    with_adapter = PeftModel.from_pretrained(load_model(str(pruned_dir)).model, str(out / "adapter")).eval()
    ids = torch.randint(5, 5000, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = with_adapter(input_ids=ids).logits
        got = merged.model(input_ids=ids).logits
        unrecovered = load_model(str(pruned_dir)).model(input_ids=ids).logits
    assert not torch.allclose(expected, unrecovered, atol=1e-4)  # the adapter learned something
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    saved = json.loads((out / "recovery.json").read_text())
    assert saved["method"] == "lora" and saved["steps_done"] == 3
    assert (out / "losses.csv").read_text().count("\n") == 4


@pytest.mark.parametrize("method", ["lora", "mazo"])
@pytest.mark.slow
def test_resume_after_a_failure_ends_identical_to_an_uninterrupted_run(pruned_dir, text_file, tmp_path, method):
    settings = tiny_settings(text_file, method=method, lr=1e-2 if method == "lora" else 0.1, steps=6, save_every=2)
    reference = recover(load_model(str(pruned_dir)), settings, out_dir=tmp_path / "reference")

    def crash_at_step_3(done, total, eta):
        if eta is not None and done == 3:
            raise RuntimeError("simulated crash")

    out = tmp_path / "interrupted"
    with pytest.raises(RuntimeError, match="simulated crash"):
        recover(load_model(str(pruned_dir)), settings, Hooks(progress=crash_at_step_3), out_dir=out)
    assert not out.exists() and partial_dir(out).is_dir()
    resumed = recover(load_model(str(pruned_dir)), settings, out_dir=out, resume=True)
    assert resumed.resumed_from == 2  # step 3 was not saved: it is redone
    assert [row["loss"] for row in resumed.curve] == [row["loss"] for row in reference.curve]
    assert_same_tensors(checkpoint_tensors(out), checkpoint_tensors(tmp_path / "reference"))


@pytest.mark.slow
def test_resume_after_sigkill_continues_from_the_saved_step(pruned_dir, text_file, tmp_path):
    settings = tiny_settings(text_file, method="mezo", lr=0.1, steps=5, save_every=2)
    out = tmp_path / "killed"
    script = textwrap.dedent(
        f"""
        import os, signal
        from gap_engine.core.progress import Hooks
        from gap_engine.model.loading import load_model
        from gap_engine.pipeline.recovery import RecoverySettings, recover
        settings = RecoverySettings(**{_json_settings(settings)!r})

        def progress(done, total, eta):
            if eta is not None and done == 3:
                os.kill(os.getpid(), signal.SIGKILL)

        recover(load_model({str(pruned_dir)!r}), settings, Hooks(progress=progress), out_dir={str(out)!r})
        """
    )
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    assert not out.exists()
    resumed = recover(load_model(str(pruned_dir)), settings, out_dir=out, resume=True)
    assert resumed.resumed_from == 2 and resumed.steps_done == 5
    reference = recover(load_model(str(pruned_dir)), settings, out_dir=tmp_path / "reference")
    assert [row["loss"] for row in resumed.curve] == [row["loss"] for row in reference.curve]
    assert_same_tensors(checkpoint_tensors(out), checkpoint_tensors(tmp_path / "reference"))


def _json_settings(settings: RecoverySettings) -> dict:
    from dataclasses import asdict

    return asdict(settings)


@pytest.mark.slow
def test_cancel_saves_the_step_reached_and_resume_finishes(pruned_dir, text_file, tmp_path):
    import threading

    cancel = threading.Event()

    def progress(done, total, eta):
        if eta is not None and done == 3:
            cancel.set()

    settings = tiny_settings(text_file, method="mazo", lr=0.1, steps=5, save_every=100)
    out = tmp_path / "out"
    with pytest.raises(CancelledError, match="after step 3"):
        recover(load_model(str(pruned_dir)), settings, Hooks(progress=progress, cancel=cancel), out_dir=out)
    resumed = recover(load_model(str(pruned_dir)), settings, out_dir=out, resume=True)
    assert resumed.resumed_from == 3 and resumed.steps_done == 5


@pytest.mark.slow
def test_resume_refuses_other_settings_and_starts_over_without_resume(pruned_dir, text_file, tmp_path):
    settings = tiny_settings(text_file, method="mazo", lr=0.1, steps=4)
    out = tmp_path / "out"
    with pytest.raises(RuntimeError):
        recover(load_model(str(pruned_dir)), settings, Hooks(progress=_crash_at(3)), out_dir=out)
    with pytest.raises(RecoveryError, match="other settings"):
        recover(load_model(str(pruned_dir)), replace(settings, lr=0.2), out_dir=out, resume=True)
    fresh = recover(load_model(str(pruned_dir)), replace(settings, lr=0.2), out_dir=out, resume=False)
    assert fresh.resumed_from == 0 and fresh.steps_done == 4


def _crash_at(step: int):
    def progress(done, total, eta):
        if eta is not None and done == step:
            raise RuntimeError("simulated crash")

    return progress


@pytest.mark.slow
def test_time_budget_stops_early_and_the_run_is_recorded(pruned_dir, text_file, tmp_path):
    from gap_engine.evaluate import history

    settings = tiny_settings(text_file, method="mezo", lr=0.1, steps=1000, time_budget_s=1e-6, record_history=True, evaluate_before=True)
    result = recover(load_model(str(pruned_dir)), settings, out_dir=tmp_path / "out")
    assert result.stopped == "time budget" and result.steps_done == 1
    record = history.get_run(result.run_id)
    assert record.allocator == "manual+mezo" and record.checkpoint == str(tmp_path / "out")
    assert record.params["recovery"]["steps_done"] == 1 and record.params["recovery"]["peak_rss"] > 0
    assert set(record.perplexity) == {"news-sample", settings.tasks[1]}
    assert set(result.before["perplexity"]) == set(record.perplexity)


@pytest.mark.slow
def test_a_dense_model_is_recovered_and_saved_as_a_checkpoint(make_tiny, text_file, tmp_path):
    lm = make_tiny("qwen3")
    original = {k: v.clone() for k, v in lm.model.state_dict().items()}
    settings = tiny_settings(text_file, method="mazo", lr=0.1, steps=2, save_dtype="float32")  # bf16 would round every weight
    result = recover(lm, settings, out_dir=tmp_path / "dense")
    assert result.dense_input
    reloaded = load_model(str(tmp_path / "dense"))
    assert reloaded.pruned_from["plan"]["allocator"] == "dense"
    changed = [k for k in original if not torch.equal(original[k], reloaded.model.state_dict()[k])]
    assert changed and all(k.endswith("proj.weight") for k in changed)


# ---- bad input ---------------------------------------------------------------------------------
def test_the_heldout_split_cannot_be_trained_on(text_file):
    with pytest.raises(DataError, match="calibration split only"):
        tiny_settings(text_file, split="heldout").validate()
    with pytest.raises(DataError, match="calibration split only"):
        tiny_settings(text_file, tasks=("news-sample@heldout",)).validate()
    assert tiny_settings(text_file, tasks=("news-sample@calibration",)).validate().tasks == ("news-sample",)


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"steps": 0}, "steps must be an integer"),
        ({"lr": -1e-3}, "learning rate"),
        ({"lr": 2.0}, "learning rate"),
        ({"rank": 0}, "rank must be"),
        ({"method": "sgd"}, "unknown recovery method"),
        ({"mask_fraction": 0.0}, "mask_fraction"),
        ({"targets": ("q", "w")}, "targets must be"),
        ({"warmup_steps": 6}, "warmup_steps"),
    ],
)
def test_settings_out_of_range_are_refused(text_file, overrides, message):
    with pytest.raises(GapError, match=message):
        tiny_settings(text_file, **overrides).validate()


def test_lr_schedules():
    settings = RecoverySettings(steps=10, lr=1.0, warmup_steps=1, schedule="cosine")
    assert lr_at(settings, 0) == pytest.approx(0.5)
    assert lr_at(settings, 1) == pytest.approx(1.0)
    assert lr_at(settings, 9) < 0.05
    assert lr_at(replace(settings, schedule="constant"), 9) == 1.0
    assert lr_at(replace(settings, schedule="linear", warmup_steps=0), 5) == pytest.approx(0.5)
    # Bounded by time: the decay follows the time spent when that horizon comes first.
    timed = replace(settings, steps=1000, time_budget_s=100.0, warmup_steps=0)
    assert lr_at(timed, 10, train_seconds=50.0) == pytest.approx(0.5)  # half the time, 1% of the steps
    assert lr_at(timed, 10, train_seconds=100.0) == pytest.approx(0.0, abs=1e-12)
    assert lr_at(timed, 900, train_seconds=1.0) == lr_at(replace(timed, time_budget_s=None), 900)  # steps first
    assert lr_at(replace(timed, schedule="constant"), 10, train_seconds=99.0) == 1.0


def test_the_guard_keeps_a_snapshot_within_tolerance_and_rolls_back_a_rise_then_stops():
    assert guard.judge(1.0, 1.0, 0).action == guard.KEEP
    assert guard.judge(1.0 * (1 + guard.TOLERANCE) - 1e-6, 1.0, 0).action == guard.KEEP  # a little above the lowest
    assert guard.judge(0.0 + guard.ABSOLUTE_TOLERANCE / 2, 0.0, 0).action == guard.KEEP  # rounding at a zero objective
    rise = 1.0 * (1 + guard.TOLERANCE) + 1e-3
    assert guard.judge(rise, 1.0, 0).action == guard.ROLL_BACK
    assert guard.judge(float("nan"), 1.0, 0).action == guard.ROLL_BACK
    assert guard.judge(float("inf"), 1.0, guard.MAX_ROLLBACKS - 1).action == guard.ROLL_BACK
    stop = guard.judge(rise, 1.0, guard.MAX_ROLLBACKS)
    assert stop.action == guard.STOP and "last good snapshot" in stop.reason


def _cli(argv, capsys) -> tuple[int, str, str]:
    code = main(argv)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.fixture
def short_text(tmp_path) -> str:
    path = tmp_path / "short.txt"
    path.write_text("Only a few words here.\n\nAnd a second short document.")
    return str(path)


@pytest.mark.slow
def test_cli_bad_inputs_exit_2_with_one_line_and_write_nothing(pruned_dir, text_file, short_text, tmp_path, capsys):
    out = tmp_path / "out"
    base = [
        "recover",
        "--model",
        str(pruned_dir),
        "--method",
        "lora",
        "--data",
        f"news-sample,{text_file}",
        "--seq-len",
        "32",
        "--out",
        str(out),
    ]
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    cases = [
        (["--steps", "0"], "steps must be"),
        (["--steps", "3", "--lr", "-1"], "learning rate"),
        (["--steps", "3", "--rank", "0"], "rank must be"),
        (["--steps", "3", "--rank", "1000"], "exceeds the narrowest"),
        (["--steps", "3", "--split", "heldout"], "calibration split only"),
        (["--steps", "3", "--data", "news-sample@heldout"], "calibration split only"),
        (["--steps", "3", "--data", short_text], "too short for one batch"),
        (["--steps", "3", "--out", str(blocker / "out")], "is a file, not a folder"),  # the CLI's --out check
        (["--steps", "3", "--stream"], "--stream is not available"),
    ]
    for extra, message in cases:
        code, stdout, stderr = _cli(base + extra, capsys)
        assert code == 2, (extra, stderr)
        assert stderr.strip().splitlines()[-1].startswith("gap: error: ") and message in stderr, (extra, stderr)
        assert len([line for line in stderr.splitlines() if line.startswith("gap: error")]) == 1
        assert not out.exists() and not partial_dir(out).exists(), extra


@pytest.mark.slow
def test_cli_recovers_and_says_when_the_model_is_dense(smol_tokenizer, text_file, tmp_path, capsys):
    from conftest import tiny_lm

    dense_dir = tmp_path / "dense-model"
    lm = tiny_lm("llama", smol_tokenizer)
    lm.model.save_pretrained(dense_dir)
    smol_tokenizer.save_pretrained(dense_dir)
    out = tmp_path / "out"
    argv = [
        "recover",
        "--model",
        str(dense_dir),
        "--method",
        "mazo",
        "--data",
        f"news-sample,{text_file}",
        "--steps",
        "2",
        "--lr",
        "0.1",
        "--seq-len",
        "32",
        "--eval-samples",
        "1",
        "--eval-seq-len",
        "32",
        "--generations",
        "0",
        "--no-history",
        "--out",
        str(out),
        "--json",
        "--device",
        "cpu",
        "--dtype",
        "bfloat16",
    ]
    code, stdout, stderr = _cli(argv, capsys)
    assert code == 0, stderr
    assert "is a dense model" in stderr
    result = json.loads(stdout)
    assert result["dense_input"] and result["steps_done"] == 2 and result["method"] == "mazo"
    assert set(result["before"]["perplexity"]) == {"news-sample", text_file}
    assert load_model(str(out)).pruned_from is not None


# ---- the real model ------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.heavy
def test_real_model_mazo_and_lora_a_few_steps(tmp_path, capsys):
    pruned = tmp_path / "u20"
    assert main(["prune", "--model", "smollm2-135m", "--uniform", "0.2", "--out", str(pruned), "--samples", "2", "--seq-len", "64"]) == 0
    for method in ("mazo", "lora"):
        out = tmp_path / method
        argv = [
            "recover",
            "--model",
            str(pruned),
            "--method",
            method,
            "--data",
            "news-sample",
            "--steps",
            "2",
            "--batch-size",
            "1",
            "--seq-len",
            "64",
            "--pool-windows",
            "8",
            "--eval-samples",
            "1",
            "--eval-seq-len",
            "64",
            "--generations",
            "1",
            "--no-history",
            "--out",
            str(out),
            "--json",
        ]
        capsys.readouterr()
        assert main(argv) == 0
        result = json.loads(capsys.readouterr().out)
        assert result["steps_done"] == 2 and not result["dense_input"]
        assert result["after"]["kl_to_dense"]["news-sample"] > 0  # compared with the dense smollm2-135m
        assert result["peak_rss"] > result["inference_rss"] * 0.9
        reloaded = load_model(str(out))
        assert reloaded.param_count() == load_model(str(pruned)).param_count()
