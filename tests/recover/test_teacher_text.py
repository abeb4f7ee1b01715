"""Teacher-written training text and snapshots judged during training.

Generation runs on a tiny Llama (two blocks, hidden 64, the real SmolLM2 tokenizer) in batches
of two short sequences, so that resuming has batches to resume from; recovery runs on the tiny
checkpoint of ``test_recover_kd`` whose dense base model loads (the teacher that writes the text).
"""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest
import torch
from test_recover import (
    _cli,
    assert_same_tensors,
    checkpoint_tensors,
    text_file,  # the shared calibration text fixture  # noqa: F401
    tiny_settings,
)
from test_recover_kd import dense_and_pruned  # the tiny dense model and its checkpoint  # noqa: F401

from gap_engine.core.errors import CancelledError, DataError, SizeLimitError
from gap_engine.core.limits import LIMITS
from gap_engine.core.progress import Hooks
from gap_engine.model.loading import load_model
from gap_engine.pipeline.recovery import recover
from gap_engine.recover import judge as recover_judge
from gap_engine.recover import teacher_text as tt
from gap_engine.recover.files import partial_dir


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("GAP_CACHE_DIR", str(tmp_path / "cache"))


@pytest.fixture
def teacher(make_tiny):
    return make_tiny("llama", initializer_range=0.1)


SPEC = tt.TeacherTextSpec(tokens=5 * 12, seq_len=12, seed=3, batch=2)  # 5 sequences: batches of 2, 2 and 1


class Counting:
    """Hooks whose cancel is set once ``after`` batches were written (counted by their messages)."""

    def __init__(self, after: int | None = None):
        self.after, self.batches, self.flag = after, 0, False

    def is_set(self) -> bool:
        return self.flag

    def say(self, message: str) -> None:
        if message.startswith("teacher text: writing"):
            self.batches += 1
            self.flag = self.after is not None and self.batches > self.after

    def hooks(self) -> Hooks:
        return Hooks(message=self.say, cancel=self)


# ---- generation and its cache ---------------------------------------------------------------------
@pytest.mark.slow
def test_generation_is_deterministic_for_a_seed_cached_and_shaped_like_calibration_windows(teacher, tmp_path, monkeypatch):
    first = tt.teacher_text(teacher, SPEC, Hooks())
    assert first.shape == (5, 12) and first.dtype == torch.int64  # SmolLM2 reads no BOS: seq_len text tokens
    assert set(first[:, 0].tolist()) <= set(tt.opening_tokens(teacher.tokenizer))
    assert len({tuple(row) for row in first.tolist()}) == 5
    monkeypatch.setattr(tt, "generate_batch", lambda *a, **k: pytest.fail("a cached text was generated again"))
    assert torch.equal(tt.teacher_text(teacher, SPEC, Hooks()), first)
    monkeypatch.undo()
    monkeypatch.setenv("GAP_CACHE_DIR", str(tmp_path / "another-cache"))
    assert torch.equal(tt.teacher_text(teacher, SPEC, Hooks()), first)  # written again, from the seed alone
    other = tt.teacher_text(teacher, tt.TeacherTextSpec(tokens=60, seq_len=12, seed=4, batch=2), Hooks())
    assert not torch.equal(other, first)


@pytest.mark.slow
def test_a_cancelled_generation_resumes_to_the_uninterrupted_text(teacher, tmp_path, monkeypatch):
    reference = tt.teacher_text(teacher, SPEC, Hooks())
    monkeypatch.setenv("GAP_CACHE_DIR", str(tmp_path / "resumed"))
    cancel = Counting(after=1)
    with pytest.raises(CancelledError):
        tt.teacher_text(teacher, SPEC, cancel.hooks())
    key = tt.cache_key(SPEC, teacher.fingerprint, "float32")
    partial = tt.entry_dir(key).with_name(key + ".partial")
    assert sorted(p.name for p in partial.glob("batch-*.npy")) == ["batch-00000.npy"]  # the batch in flight is not kept
    resumed = Counting()
    text = tt.teacher_text(teacher, SPEC, resumed.hooks())
    assert resumed.batches == 2  # batches 1 and 2 only
    assert torch.equal(text, reference) and not partial.exists()


@pytest.mark.slow
def test_a_damaged_or_foreign_cache_entry_is_written_again_never_used(teacher, caplog):
    reference = tt.teacher_text(teacher, SPEC, Hooks())
    folder = tt.entry_dir(tt.cache_key(SPEC, teacher.fingerprint, "float32"))
    tokens = folder / "tokens.npy"
    damaged = bytearray(tokens.read_bytes())
    damaged[-1] ^= 0x01  # one token id off by one: the array still loads
    tokens.write_bytes(bytes(damaged))
    with caplog.at_level(logging.WARNING):
        assert torch.equal(tt.teacher_text(teacher, SPEC, Hooks()), reference)
    assert "do not match their checksum" in caplog.text
    meta = json.loads((folder / "meta.json").read_text())
    (folder / "meta.json").write_text(json.dumps(meta | {"model_fingerprint": "another-model"}))
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        assert torch.equal(tt.teacher_text(teacher, SPEC, Hooks()), reference)
    assert "written for another model fingerprint" in caplog.text
    assert json.loads((folder / "meta.json").read_text())["model_fingerprint"] == teacher.fingerprint


def _forge(folder, tokens: np.ndarray) -> None:
    """Replace an entry's tokens, with its checksum and recorded shape made to match (a whole but foreign entry)."""
    import hashlib
    import io

    buffer = io.BytesIO()
    np.save(buffer, tokens, allow_pickle=False)
    (folder / "tokens.npy").write_bytes(buffer.getvalue())
    meta = json.loads((folder / "meta.json").read_text())
    meta |= {"shape": list(tokens.shape), "tokens_sha256": hashlib.sha256(buffer.getvalue()).hexdigest()}
    (folder / "meta.json").write_text(json.dumps(meta))


@pytest.mark.parametrize("cut", ["one of five sequences", "a token short", "a column more"])
@pytest.mark.slow
def test_a_whole_entry_that_is_not_the_text_asked_for_is_written_again(teacher, caplog, cut):
    reference = tt.teacher_text(teacher, SPEC, Hooks())
    folder = tt.entry_dir(tt.cache_key(SPEC, teacher.fingerprint, "float32"))
    tokens = reference.numpy().astype(np.int32)
    forged = {"one of five sequences": tokens[:1], "a token short": tokens[:, :-1], "a column more": np.hstack([tokens, tokens[:, :1]])}
    _forge(folder, np.ascontiguousarray(forged[cut]))
    with caplog.at_level(logging.WARNING):
        assert torch.equal(tt.teacher_text(teacher, SPEC, Hooks()), reference)
    assert "the request is 5 of 12" in caplog.text and "writing it again" in caplog.text
    assert json.loads((folder / "meta.json").read_text())["shape"] == [5, 12]


@pytest.mark.parametrize("where", ["entry", "partial"])
@pytest.mark.slow
def test_a_file_where_an_entry_folder_belongs_is_replaced(teacher, caplog, where):
    key = tt.cache_key(SPEC, teacher.fingerprint, "float32")
    folder = tt.entry_dir(key)
    blocker = folder if where == "entry" else folder.with_name(key + ".partial")
    blocker.parent.mkdir(parents=True, exist_ok=True)
    blocker.write_text("x")
    with caplog.at_level(logging.WARNING):
        text = tt.teacher_text(teacher, SPEC, Hooks())
    assert text.shape == (5, 12) and "is not a folder; removing it" in caplog.text
    assert folder.is_dir() and (folder / "meta.json").is_file() and not blocker.with_name(key + ".partial").exists()


@pytest.mark.slow
def test_a_damaged_partial_batch_is_generated_again(teacher, tmp_path, monkeypatch):
    reference = tt.teacher_text(teacher, SPEC, Hooks())
    monkeypatch.setenv("GAP_CACHE_DIR", str(tmp_path / "resumed"))
    with pytest.raises(CancelledError):
        tt.teacher_text(teacher, SPEC, Counting(after=2).hooks())
    key = tt.cache_key(SPEC, teacher.fingerprint, "float32")
    batch = tt.entry_dir(key).with_name(key + ".partial") / "batch-00001.npy"
    np.save(batch, np.zeros((2, 12), dtype=np.int32))  # loads, but fails its recorded checksum
    resumed = Counting()
    assert torch.equal(tt.teacher_text(teacher, SPEC, resumed.hooks()), reference)
    assert resumed.batches == 2  # batch 1 again, and batch 2


def test_teacher_text_the_cost_model_says_takes_too_long_is_refused_before_a_token(teacher, monkeypatch):
    from gap_engine.core.limits import SizeLimits
    from gap_engine.pipeline import recovery

    monkeypatch.setattr(recovery, "LIMITS", SizeLimits(teacher_seconds=1))
    monkeypatch.setattr(tt, "generate_batch", lambda *a, **k: pytest.fail("a token was written"))
    spec = tt.TeacherTextSpec(tokens=4096, seq_len=16, seed=0)
    with pytest.raises(SizeLimitError) as info:
        recovery.check_teacher_text_time(teacher, spec, "teacher:4096")
    message = str(info.value)
    assert message.startswith("teacher:4096 would take about ") and "predicted by the cost model" in message
    assert "past the limit of 1 s for teacher text" in message and "ask for at most teacher:" in message
    assert "--force-size" in message and "GAP_FORCE_SIZE=1" in message
    recovery.check_teacher_text_time(teacher, spec, "teacher:4096", force=True)  # asked for knowingly
    monkeypatch.setenv("GAP_FORCE_SIZE", "1")
    recovery.check_teacher_text_time(teacher, spec, "teacher:4096")


@pytest.mark.slow
def test_teacher_text_in_the_cache_costs_nothing_and_passes(teacher, monkeypatch):
    from gap_engine.core.limits import SizeLimits
    from gap_engine.pipeline import recovery

    tt.teacher_text(teacher, SPEC, Hooks())
    monkeypatch.setattr(recovery, "LIMITS", SizeLimits(teacher_seconds=0))
    recovery.check_teacher_text_time(teacher, SPEC, "teacher:60")  # cached: nothing to write
    with pytest.raises(SizeLimitError):
        recovery.check_teacher_text_time(teacher, tt.TeacherTextSpec(tokens=60, seq_len=12, seed=4, batch=2), "teacher:60")


def test_token_counts_are_parsed_and_bounded():
    assert tt.parse_tokens("teacher") == tt.DEFAULT_TOKENS and tt.normalise("teacher:1_000") == "teacher:1000"
    for bad in ("teacher:0", "teacher:-5", "teacher:many", "teacher:"):
        with pytest.raises(DataError, match="positive whole number"):
            tt.parse_tokens(bad)
    with pytest.raises(SizeLimitError, match="above the limit"):
        tt.parse_tokens(f"teacher:{LIMITS.teacher_tokens + 1}")
    with pytest.raises(DataError, match="listed twice"):
        tiny_settings("news-sample", tasks=("teacher", "teacher:64")).validate()


def test_nucleus_keeps_the_smallest_set_reaching_top_p():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]] * 2000))
    drawn = tt.nucleus_sample(logits, 1.0, 0.8, torch.Generator().manual_seed(0))
    assert set(drawn.tolist()) == {0, 1}  # 0.5 + 0.3 reach 0.8: the rest is never drawn
    share = (drawn == 0).float().mean().item()
    assert abs(share - 0.5 / 0.8) < 0.05
    wide = torch.zeros(3, tt.NUCLEUS_CANDIDATES * 4)  # a flat row: its nucleus reaches past the candidates
    drawn = tt.nucleus_sample(wide, 1.0, 0.95, torch.Generator().manual_seed(0))
    assert drawn.shape == (3,) and bool((drawn >= 0).all())


# ---- recovery on teacher text ----------------------------------------------------------------------
@pytest.mark.slow
def test_recovery_trains_on_teacher_text_mixed_with_a_named_text(dense_and_pruned, text_file, tmp_path):
    _, pruned = dense_and_pruned
    settings = tiny_settings(text_file, tasks=("teacher:128", "news-sample"), steps=2, compare_dense=True)
    result = recover(load_model(str(pruned)), settings, out_dir=tmp_path / "out")
    assert result.tasks == ["teacher:128", "news-sample"] and len(result.calib_loss_after) == 2
    assert set(result.after["perplexity"]) == {"news-sample"}  # evaluated on the named text's held-out part
    assert result.objective == "kd" and "teacher_text" not in result.settings  # the key is in the run's trajectory only
    cached = list((tmp_path / "cache" / "teacher-text").glob("*/tokens.npy"))
    assert len(cached) == 1 and np.load(cached[0]).shape == (4, 32)  # 128 tokens: 4 windows of seq_len 32


@pytest.mark.slow
def test_cli_refuses_bad_teacher_text_in_one_line(dense_and_pruned, text_file, smol_tokenizer, tmp_path, capsys):
    from conftest import tiny_lm

    _, pruned = dense_and_pruned
    other_vocab = tmp_path / "other-vocab"
    tiny_lm("llama", smol_tokenizer, vocab_size=50000).model.save_pretrained(other_vocab)
    smol_tokenizer.save_pretrained(other_vocab)
    out = tmp_path / "out"
    base = ["recover", "--model", str(pruned), "--method", "lora", "--steps", "2", "--seq-len", "32", "--out", str(out)]
    cases = [
        (["--data", "teacher:0"], "positive whole number of tokens"),
        (["--data", f"teacher:{LIMITS.teacher_tokens + 1},news-sample"], "above the limit"),
        (["--data", "teacher", "--objective", "lm", "--teacher", str(other_vocab)], "predicts 50000 tokens"),
        (["--data", "teacher", "--eval-data", "teacher"], "unknown text source 'teacher'"),
        (["--data", "news-sample", "--eval-tasks", "gap_wiki_next"], "give --eval-every K too"),
        (["--data", "news-sample", "--eval-every", "3", "--save-every", "2"], "must be a multiple of --save-every"),
    ]
    for extra, message in cases:
        code, _, stderr = _cli(base + extra, capsys)
        errors = [line for line in stderr.splitlines() if line.startswith("gap: error")]
        assert code == 2 and len(errors) == 1 and message in errors[0], (extra, stderr)
        assert not out.exists() and not partial_dir(out).exists(), extra


# ---- snapshots judged during training --------------------------------------------------------------
@pytest.mark.slow
def test_the_best_judged_snapshot_is_the_one_saved(dense_and_pruned, text_file, tmp_path, monkeypatch):
    """Scripted scores (steps 0, 2, 4, 6 of a KL-judged run): the best is step 2, not the last,
    and the checkpoint then holds exactly the weights of a 2-step run."""
    _, pruned = dense_and_pruned
    scores = iter([-3.0, -1.0, -2.0, -1.0])  # a tie later keeps the earlier snapshot
    real = recover_judge.KLJudge.__call__
    measured: list[float] = []

    def scripted(self):
        measured.append(real(self))  # the real KL is computed, then the script decides
        return next(scores)

    monkeypatch.setattr(recover_judge.KLJudge, "__call__", scripted)
    settings = tiny_settings(text_file, steps=6, save_every=2, eval_every=2, compare_dense=True, lr=3e-2, schedule="constant")
    result = recover(load_model(str(pruned)), settings, out_dir=tmp_path / "judged")
    assert [(row["step"], row["best"]) for row in result.judge_curve] == [(0, True), (2, True), (4, False), (6, False)]
    assert result.best_step == 2 and result.steps_done == 6 and "held-out KL" in result.judge
    assert len(measured) == 4 and all(value < 0 for value in measured)
    monkeypatch.undo()
    two = tiny_settings(text_file, steps=2, save_every=2, compare_dense=True, lr=3e-2, schedule="constant")
    recover(load_model(str(pruned)), two, out_dir=tmp_path / "two-steps")
    assert_same_tensors(checkpoint_tensors(tmp_path / "judged"), checkpoint_tensors(tmp_path / "two-steps"))
    saved = json.loads((tmp_path / "judged" / "recovery.json").read_text())
    assert saved["best_step"] == 2 and [row["step"] for row in saved["judge_curve"]] == [0, 2, 4, 6]
    assert "step 2, the best by held-out KL" in (tmp_path / "judged" / "README.md").read_text()


@pytest.mark.slow
def test_cli_judges_snapshots_by_a_task_slice(dense_and_pruned, text_file, tmp_path, capsys):
    """The real offline task through lm-eval: its last 8 examples score the snapshots."""
    _, pruned = dense_and_pruned
    out = tmp_path / "out"
    argv = ["recover", "--model", str(pruned), "--method", "lora", "--data", f"news-sample,{text_file}", "--steps", "4",
            "--seq-len", "32", "--batch-size", "1", "--save-every", "2", "--eval-every", "2", "--eval-tasks", "gap_wiki_next",
            "--eval-task-examples", "8", "--eval-samples", "1", "--eval-seq-len", "32", "--generations", "0",
            "--no-eval-before", "--out", str(out)]  # fmt: skip
    code, stdout, _ = _cli(argv, capsys)
    assert code == 0 and "kept_snapshot: step" in stdout
    saved = json.loads((out / "recovery.json").read_text())
    curve = saved["judge_curve"]
    assert [row["step"] for row in curve] == [0, 2, 4] and all(row["score"] in {k / 8 for k in range(9)} for row in curve)
    best = max(curve, key=lambda row: (row["score"], -row["step"]))
    assert saved["best_step"] == best["step"] and "last 8 examples" in saved["judge"]
    from gap_engine.evaluate import history

    record = history.get_run(history.runs()[-1].id)
    assert record.params["recovery"]["best_step"] == best["step"] and len(record.params["recovery"]["judge_curve"]) == 3


def test_the_task_slice_is_the_last_examples():
    class Task:
        eval_docs = list(range(500))

    assert recover_judge.selection_slice(Task(), 100) == list(range(400, 500))
    assert recover_judge.selection_slice(Task(), 600) == list(range(500))


# ---- the price before Start ---------------------------------------------------------------------------
@pytest.mark.slow
def test_the_estimate_prices_uncached_teacher_text_and_every_judgement(dense_and_pruned, text_file, tmp_path):
    from gap_engine.core.device import DeviceSpec, resolve
    from gap_engine.core.progress import TRAINING
    from gap_engine.pipeline.cost_model import checkpoint_shapes, nominal_profile, recovery_prediction, teacher_text_seconds

    dense_dir, pruned = dense_and_pruned
    plain = tiny_settings(text_file, tasks=("news-sample",), steps=10, save_every=5)
    taught = tiny_settings(text_file, tasks=("teacher:128", "news-sample"), steps=10, save_every=5)
    judged = tiny_settings(text_file, tasks=("news-sample",), steps=10, save_every=5, eval_every=5, compare_dense=True)
    placement = resolve(DeviceSpec("cpu", "float32"))
    before = {name: recovery_prediction(pruned, s, placement) for name, s in (("plain", plain), ("taught", taught))}
    assert before["plain"].text_s == 0.0 and before["taught"].text_s > 0.0
    dense_shape = checkpoint_shapes(pruned)[0]  # the teacher: the dense model, priced as it writes the text
    price = teacher_text_seconds(dense_shape, nominal_profile(torch.get_num_threads()), 128, taught.seq_len)
    assert before["taught"].text_s == pytest.approx(price)
    recover(load_model(str(pruned)), replace_steps(taught, 1), out_dir=tmp_path / "writes-the-text")  # the text is cached now
    assert recovery_prediction(pruned, taught, placement).text_s == 0.0
    with_judge = recovery_prediction(pruned, judged, placement)
    assert with_judge.judgements == 3 and with_judge.judge_s > 0  # steps 0, 5 and 10
    assert with_judge.seconds[TRAINING] == pytest.approx(with_judge.step_s * 10 + with_judge.judge_s)


def replace_steps(settings, steps: int):
    from dataclasses import replace

    return replace(settings, steps=steps, save_every=1)
