"""Task accuracy through lm-eval (``gap eval --tasks``): the offline task, equality with lm-eval's
own HF backend on the real built-in model, the dense cache, and the refusals."""

from __future__ import annotations

import json
import re

import pytest
import torch

from gap_engine.cli import main
from gap_engine.core.errors import HistoryError
from gap_engine.core.fsutil import cache_root
from gap_engine.data.next_sentence import OFFLINE_TASK, build_examples, offline_task_dir
from gap_engine.data.windows import load_corpus
from gap_engine.evaluate.tasks import TaskSettings, dense_task_scores, hub_reachable, prepare_tasks

LIMIT = 4  # examples: 16 likelihood requests per model, about 8 CPU seconds each side
EVAL_TINY = ["--samples", "1", "--seq-len", "32", "--no-throughput", "--generations", "0"]


@pytest.mark.slow
def test_offline_task_is_deterministic_and_its_distractors_come_from_other_articles():
    heldout = load_corpus("wiki-sample").heldout
    examples = build_examples(heldout)
    assert examples == build_examples(heldout)
    assert len(examples) == 500 and len({e["article"] for e in examples}) >= 10
    assert {e["label"] for e in examples} == {0, 1, 2, 3}
    for example in examples[:50]:
        choices, label = example["choices"], example["label"]
        assert len(set(choices)) == 4
        article = " ".join(heldout[example["article"]].split())
        assert example["passage"] + " " + choices[label] in article  # the true next sentence, in place
        for index, distractor in enumerate(choices):
            if index != label:
                assert distractor not in article
                assert any(distractor in " ".join(doc.split()) for doc in heldout)  # held-out text only


@pytest.mark.slow
def test_offline_task_files_are_written_once_and_read_by_lm_eval(tmp_path, monkeypatch):
    monkeypatch.setenv("GAP_CACHE_DIR", str(tmp_path))
    folder = offline_task_dir()
    yaml_text = (folder / f"{OFFLINE_TASK}.yaml").read_text()
    rows = [json.loads(line) for line in (folder / f"{OFFLINE_TASK}.jsonl").read_text().splitlines()]
    assert "dataset_path: json" in yaml_text and "output_type: multiple_choice" in yaml_text
    assert len(rows) == 500 and not [p for p in folder.parent.iterdir() if p.name.startswith(".")]
    mtime = (folder / f"{OFFLINE_TASK}.jsonl").stat().st_mtime_ns
    assert offline_task_dir() == folder and (folder / f"{OFFLINE_TASK}.jsonl").stat().st_mtime_ns == mtime
    prepared = prepare_tasks(TaskSettings(limit=3))
    task = prepared.tasks[OFFLINE_TASK]
    doc = task.test_docs()[0]
    assert task.doc_to_text(doc) == rows[0]["passage"] and task.doc_to_choice(doc) == rows[0]["choices"]


@pytest.mark.slow
def test_dense_accuracy_equals_lm_eval_hf_backend_on_the_saved_folder(smol, capsys):
    """gap eval --tasks on the loaded model == lm-eval's own ``--model hf --model_args pretrained=FOLDER``."""
    from lm_eval.evaluator import simple_evaluate
    from lm_eval.tasks import TaskManager

    argv = ["eval", "--model", "smollm2-135m", "--tasks", OFFLINE_TASK, "--limit", str(LIMIT), "--json", *EVAL_TINY]
    assert main(argv) == 0
    ours = json.loads(capsys.readouterr().out)["task_accuracy"][OFFLINE_TASK]
    folder = cache_root() / "models" / "smollm2-135m"
    reference = simple_evaluate(
        model="hf",
        model_args=f"pretrained={folder},dtype=float32,device=cpu",
        tasks=[OFFLINE_TASK],
        task_manager=TaskManager(include_path=str(offline_task_dir()), include_defaults=False),
        limit=LIMIT,
        batch_size=4,  # `gap eval`'s default --batch-size: the same padding, the same logits
        log_samples=False,
    )
    theirs = reference["results"][OFFLINE_TASK]
    assert ours["n"] == reference["n-samples"][OFFLINE_TASK]["effective"] == LIMIT
    for metric in ("acc", "acc_stderr", "acc_norm", "acc_norm_stderr"):
        assert ours[metric] == theirs[f"{metric},none"], metric
    # The dense model's own run recorded its numbers: a pruned checkpoint of it reads them back.
    prepared = prepare_tasks(TaskSettings(limit=LIMIT, batch_size=4))
    cached = dense_task_scores(smol.fingerprint, "float32", prepared, measure=None)
    assert cached[OFFLINE_TASK].acc == ours["acc"] and cached[OFFLINE_TASK].n == LIMIT


def _task_folder(root, name: str, output_type: str = "multiple_choice", data: str | None = '{"q": "a", "c": ["x", "y"], "l": 0}\n'):
    folder = root / name
    folder.mkdir()
    (folder / "task.yaml").write_text(
        f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {json.dumps(str(folder / 'data.jsonl'))}\n"
        f"test_split: test\noutput_type: {output_type}\ndoc_to_text: q\ndoc_to_choice: c\ndoc_to_target: l\n"
    )
    if data is not None:
        (folder / "data.jsonl").write_text(data)
    return folder


def _refusal_cases(root):
    empty = root / "empty"
    empty.mkdir()
    big = _task_folder(root, "t_big", data="")
    with open(big / "data.jsonl", "wb") as handle:  # sparse: past the 256 MB text ceiling without writing it
        handle.truncate(257 << 20)
    return {
        "unknown": (["--tasks", "no_such_task_xyz"], "unknown task 'no_such_task_xyz'"),
        "no yaml": (["--tasks", "t", "--include-path", str(empty)], "holds no task YAML"),
        "missing data": (["--tasks", "t_missing", "--include-path", str(_task_folder(root, "t_missing", data=None))], "no such file"),
        "malformed data": (["--tasks", "t_bad", "--include-path", str(_task_folder(root, "t_bad", data='{"q": [\n'))], "not valid JSON"),
        "oversized data": (["--tasks", "t_big", "--include-path", str(big)], "above the limit"),
        "generation": (["--tasks", "t_gen", "--include-path", str(_task_folder(root, "t_gen", "generate_until"))], "not generation"),
        "limit 0": (["--tasks", OFFLINE_TASK, "--limit", "0"], "--limit must be a positive"),
        "negative limit": (["--tasks", OFFLINE_TASK, "--limit", "-2"], "--limit must be a positive"),
        "hub": (["--tasks", "hellaswag"], "task 'hellaswag' needs its data set from the Hugging Face hub"),
    }


@pytest.mark.parametrize(
    "case", ["unknown", "no yaml", "missing data", "malformed data", "oversized data", "generation", "limit 0", "negative limit", "hub"]
)
def test_bad_task_is_one_line_exit_2_and_nothing_written(case, tmp_path, monkeypatch, capsys):
    cache = tmp_path / "cache"
    monkeypatch.setenv("GAP_CACHE_DIR", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # the hub case must not try the network (none here anyway)
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf"))  # an empty hub cache
    inputs = tmp_path / "inputs"
    inputs.mkdir()
    argv, message = _refusal_cases(inputs)[case]
    assert main(["eval", "--model", "smollm2-135m", *argv, *EVAL_TINY]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("gap: error: ") and message in err[-1], err[-1]
    assert not (cache / "tasks" / "dense").exists() and not (cache / "models").exists()  # refused before any model loaded


@pytest.mark.slow
def test_the_explorers_check_refuses_what_the_cli_refuses_and_passes_a_local_folder(tmp_path, monkeypatch):
    """check_tasks (the explorer's Start) gives the CLI's one-line refusals without loading a data set."""
    from gap_engine.evaluate.tasks import TaskError, check_tasks, task_settings

    monkeypatch.setenv("GAP_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf"))
    local = _task_folder(tmp_path, "t_local")
    assert check_tasks(task_settings(f"{OFFLINE_TASK}, t_local", limit=2, include_path=str(local))) == [OFFLINE_TASK, "t_local"]
    for argv, message in _refusal_cases(tmp_path).values():
        if "--limit" in argv:
            continue  # refused by task_settings itself (the picker's number field cannot go below 1)
        folder = argv[argv.index("--include-path") + 1] if "--include-path" in argv else None
        with pytest.raises(TaskError, match=re.escape(message)):
            check_tasks(task_settings(argv[1], include_path=folder))


def test_hub_probe_honours_offline_flags(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert hub_reachable() is False


def test_task_line_names_dense_beside_the_model():
    from gap_engine.cli.model_commands import task_line

    row = {"acc": 0.5, "acc_stderr": 0.1, "acc_norm": 0.25, "acc_norm_stderr": 0.05, "n": 8, "num_fewshot": 0}
    line = task_line("t", row, dict(row, acc=0.75))
    assert re.search(r"acc 0\.500 ± 0\.100, acc_norm 0\.250 ± 0\.050 .*dense acc 0\.750", line)


SCORE = {"acc": 0.625, "acc_stderr": 0.125, "acc_norm": 0.5, "acc_norm_stderr": 0.13, "n": 16, "num_fewshot": 0}
EVAL_WITH_TASKS = {
    "model": "smollm2-135m (pruned)",
    "params": 120_000_000,
    "perplexity": {"wiki-sample": 21.5},
    "dense": {"model": "smollm2-135m", "params": 134_515_008, "perplexity": {"wiki-sample": 18.0}},
    "task_accuracy": {OFFLINE_TASK: SCORE, "my_task": dict(SCORE, acc=0.25, acc_norm=None, acc_norm_stderr=None)},
    "dense_task_accuracy": {OFFLINE_TASK: dict(SCORE, acc=0.75), "my_task": dict(SCORE, acc=0.5)},
}


def test_task_settings_read_a_picker_and_the_cli_flag_alike():
    from gap_engine.evaluate.tasks import TaskError, task_settings

    typed = task_settings(f" {OFFLINE_TASK}, my_task ,{OFFLINE_TASK}", limit=2, include_path="  ")
    assert typed == task_settings([OFFLINE_TASK, "my_task"], limit=2) == TaskSettings((OFFLINE_TASK, "my_task"), 2)
    for names, limit in ((" , ", None), ([], None), (OFFLINE_TASK, 0)):
        with pytest.raises(TaskError):
            task_settings(names, limit=limit)


def test_history_keeps_task_accuracy_and_migrates_an_older_file(tmp_path):
    import sqlite3

    from gap_engine.evaluate import history

    db = tmp_path / "h.sqlite"
    with sqlite3.connect(db) as conn:  # a history written before task accuracy: no tasks_json column
        conn.executescript(history._SCHEMA.replace(",\n    tasks_json TEXT NOT NULL DEFAULT '{}'", ""))
    plan = {"model": "smollm2-135m", "attention_rates": [0.0], "mlp_rates": [0.5], "params": {}}
    old = history.record_run(history.RunRecord.from_report(plan, {"perplexity": {"wiki-sample": 30.0}}, allocator="uniform"), db)
    new = history.record_run(history.RunRecord.from_report(plan, EVAL_WITH_TASKS, allocator="dp"), db)
    assert history.get_run(old, db).tasks == {}
    assert history.get_run(new, db).tasks["dense"]["my_task"]["acc"] == 0.5
    frame = history.list_runs(db).set_index("id")
    assert frame.loc[new, f"acc:{OFFLINE_TASK}"] == 0.625 and frame.loc[new, f"dense_acc:{OFFLINE_TASK}"] == 0.75
    assert frame.loc[new, "acc_stderr:my_task"] == 0.125 and "acc_norm:my_task" not in frame.columns
    assert frame[f"acc:{OFFLINE_TASK}"].isna()[old]
    # "Compare runs": a row per task, accuracy ± stderr against dense; the run without tasks shows a dash.
    from gap_engine.evaluate.runcompare import comparison_frame, history_table

    compared = comparison_frame([history.get_run(new, db), history.get_run(old, db)]).set_index("measure")
    assert compared.loc[f"accuracy ({OFFLINE_TASK})"].to_dict() == {
        "dense": "0.750 ± 0.125",
        f"run {new}": "0.625 ± 0.125 (-0.1250 vs dense)",
        f"run {old}": "—",
    }
    assert compared.loc["accuracy (my_task)", f"run {new}"].startswith("0.250 ± 0.125")
    assert not any(m.startswith("accuracy") for m in comparison_frame([history.get_run(old, db)])["measure"])
    shown = history_table(history.list_runs(db)).set_index("id")  # the explorer's history table: acc ± stderr, empty where missing
    assert shown.loc[new, f"accuracy ({OFFLINE_TASK})"] == "0.625 ± 0.125" and shown.loc[old, f"dense accuracy ({OFFLINE_TASK})"] == ""
    assert list(shown.columns).index(f"accuracy ({OFFLINE_TASK})") == list(shown.columns).index("budget") + 1
    # The numbers a reader compares come before the long loss-table key (off-screen at 1400 px otherwise).
    assert list(shown.columns).index(f"dense accuracy ({OFFLINE_TASK})") < list(shown.columns).index("table_key")
    columns = list(shown.columns)
    assert (
        columns.index(f"dense accuracy ({OFFLINE_TASK})")
        < columns.index("ppl:wiki-sample")
        < columns.index("dense_params")
        < columns.index("table_key")
    )
    with sqlite3.connect(db) as conn:  # a tasks column that is not an object is refused in one line, not a crash
        conn.execute("UPDATE runs SET tasks_json = '[1]' WHERE id = ?", (old,))
    with pytest.raises(HistoryError, match=f"history run {old} tasks must be an object"):
        history.list_runs(db)


@pytest.mark.slow
def test_report_prints_the_paper_style_task_table(smol, tmp_path, capsys):
    """Tasks as columns, dense / plan / recovered as rows, an average column; bad scores refused."""
    import html

    from gap_engine.core.config import WindowSpec
    from gap_engine.pipeline.stages import loss_table
    from gap_engine.plan.front import dp_front, front_rows
    from gap_engine.plan.front_view import row_plan
    from gap_engine.tables.artefact import TableSpec

    spec = TableSpec(windows=WindowSpec("news-sample", n_samples=2, seq_len=16), estimator="taylor", rate_grid=(0.0, 0.25, 0.5))
    table = loss_table(smol, spec, use_cache=False)
    (tmp_path / "table.json").write_text(table.to_json())
    row_plan(smol, table, next(r for r in front_rows(table, dp_front(table)) if r["budget"] >= 0.2)).save(tmp_path / "plan.json")
    (tmp_path / "eval.json").write_text(json.dumps(EVAL_WITH_TASKS))
    recovered = dict(EVAL_WITH_TASKS, task_accuracy={OFFLINE_TASK: dict(SCORE, acc=0.6875), "my_task": dict(SCORE, acc=0.375)})
    (tmp_path / "recovered.json").write_text(json.dumps(recovered))
    common = ["report", "--table", tmp_path / "table.json", "--plan", tmp_path / "plan.json", "--eval", tmp_path / "eval.json"]
    assert main([*map(str, common), "--recovered-eval", str(tmp_path / "recovered.json"), "--out", str(tmp_path / "r.html")]) == 0
    text = (tmp_path / "r.html").read_text()
    section = text[text.index("<h2>Task accuracy</h2>") :]
    header = re.search(r"<tr><th>model</th>(.*?)</tr>", section).group(1)
    assert header == f"<th>{html.escape(OFFLINE_TASK)} (n=16)</th><th>my_task (n=16)</th><th>average</th>"
    rows = re.findall(r"<tr><td>([^<]*)</td><td>([^<]*)</td><td>([^<]*)</td><td>([^<]*)</td></tr>", section)
    assert rows[:3] == [
        ("dense", "75.0 ± 12.5", "50.0 ± 12.5", "62.5"),
        ("pruned (plan)", "62.5 ± 12.5", "25.0 ± 12.5", "43.8"),
        ("pruned + recovered", "68.8 ± 12.5", "37.5 ± 12.5", "53.1"),
    ]
    (tmp_path / "bad.json").write_text(json.dumps(dict(EVAL_WITH_TASKS, task_accuracy={OFFLINE_TASK: dict(SCORE, acc=1.5)})))
    capsys.readouterr()
    assert main([*map(str, common[:-1]), str(tmp_path / "bad.json"), "--out", str(tmp_path / "never.html")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "acc" in err[0] and err[0].startswith("gap: error: ") and not (tmp_path / "never.html").exists()


@pytest.mark.slow
def test_explorer_run_records_task_accuracy_beside_dense(make_tiny, tmp_path, monkeypatch):
    """prune_and_evaluate with tasks: the pruned copy's scores, dense's (measured once, then
    cached under its fingerprint), both in the report and the history row."""
    from gap_engine.core.config import WindowSpec
    from gap_engine.evaluate import history
    from gap_engine.evaluate.metrics import EvalSettings
    from gap_engine.evaluate.tasks import run_tasks
    from gap_engine.model.rateplan import uniform_plan
    from gap_engine.pipeline.runs import prune_and_evaluate

    monkeypatch.setenv("GAP_CACHE_DIR", str(tmp_path))
    dense = make_tiny("llama")
    prepared = prepare_tasks(TaskSettings(limit=3, batch_size=4))
    settings = EvalSettings(windows=WindowSpec("wiki-sample", n_samples=1, seq_len=16), throughput=False, generations=0)
    plan = uniform_plan(dense, 0.5, "magnitude", 8)
    result = prune_and_evaluate(dense, settings, plan=plan, history_path=tmp_path / "h.sqlite", tasks=prepared)
    report = result.report
    expected_dense = run_tasks(dense, prepared)[OFFLINE_TASK]
    assert report["dense_task_accuracy"][OFFLINE_TASK] == expected_dense.to_dict()
    assert report["task_accuracy"][OFFLINE_TASK]["n"] == 3
    assert len(list((tmp_path / "tasks" / "dense").glob("*.json"))) == 1
    row = history.list_runs(tmp_path / "h.sqlite").iloc[0]
    assert row[f"acc:{OFFLINE_TASK}"] == report["task_accuracy"][OFFLINE_TASK]["acc"]
    assert row[f"dense_acc:{OFFLINE_TASK}"] == expected_dense.acc


def test_compare_task_columns_round_trip_through_its_csv(tmp_path, capsys):
    """`gap compare --tasks` columns: acc/stderr/n per task beside dense_..., read back by Outcome.from_row;
    a bad --limit is refused before anything loads."""
    import csv
    import io

    from gap_engine.cli.output import csv_text
    from gap_engine.evaluate.tasks import TaskScore, score_columns
    from gap_engine.pipeline.compare import Outcome

    score = TaskScore(OFFLINE_TASK, 0.625, 0.125, None, None, 16, 0)
    columns = score_columns({OFFLINE_TASK: score}) | score_columns({OFFLINE_TASK: score}, "dense_")
    assert columns == {
        f"acc_{OFFLINE_TASK}": 0.625,
        f"acc_stderr_{OFFLINE_TASK}": 0.125,
        f"n_{OFFLINE_TASK}": 16,
        f"dense_acc_{OFFLINE_TASK}": 0.625,
        f"dense_acc_stderr_{OFFLINE_TASK}": 0.125,
        f"dense_n_{OFFLINE_TASK}": 16,
    }
    outcome = Outcome("dp", 0.2, 10, 0.2, 100, 0.1, 0.2, {"wiki-sample": 30.0}, {"wiki-sample": 20.0}, 3.0, extras=columns)
    row = next(csv.DictReader(io.StringIO(csv_text([outcome.row()]))))
    assert Outcome.from_row(row).extras == columns
    argv = ["compare", "--model", "smollm2-135m", "--tasks", OFFLINE_TASK, "--limit", "0", "--out", str(tmp_path / "c.csv")]
    assert main(argv) == 2
    assert "--limit must be a positive" in capsys.readouterr().err.strip().splitlines()[-1]
    assert not (tmp_path / "c.csv").exists()


@pytest.mark.slow
def test_recovery_cancel_is_heard_inside_task_scoring(make_tiny, tmp_path, monkeypatch):
    """A cancel pressed while lm-eval scores the tasks of a recovery evaluation stops it at the
    next forward pass, rather than after every request has been scored."""
    import threading

    from gap_engine.core.errors import CancelledError
    from gap_engine.core.progress import Hooks
    from gap_engine.pipeline.recovery import RecoverySettings
    from gap_engine.pipeline.recovery_dense import evaluate_heldout

    monkeypatch.setenv("GAP_CACHE_DIR", str(tmp_path))
    lm = make_tiny("llama")
    prepared = prepare_tasks(TaskSettings(limit=3, batch_size=1))
    settings = RecoverySettings(tasks=("wiki-sample",), eval_samples=1, eval_seq_len=16, eval_generations=0, compare_dense=False).validate()
    cancel, stages = threading.Event(), []

    def stage(message: str) -> None:
        stages.append(message)
        if "task accuracy" in message:
            cancel.set()  # the user presses Cancel as scoring starts

    with pytest.raises(CancelledError, match="while scoring tasks"):
        evaluate_heldout(lm, settings, "after", Hooks(message=stage, cancel=cancel), lm.fingerprint, None, prepared)
    assert any("task accuracy" in message for message in stages)


@pytest.mark.slow
def test_a_saved_runs_numbers_are_its_checkpoints(make_tiny, tmp_path, monkeypatch):
    """prune_and_evaluate with a checkpoint measures the weights as stored (bfloat16 by default),
    so the Recover page and `gap eval`, which read the checkpoint, show the same perplexity."""
    from gap_engine.core.config import WindowSpec
    from gap_engine.evaluate.metrics import EvalSettings, evaluate
    from gap_engine.model.loading import load_model
    from gap_engine.model.rateplan import uniform_plan
    from gap_engine.pipeline.runs import prune_and_evaluate

    monkeypatch.setenv("GAP_CACHE_DIR", str(tmp_path))
    dense = make_tiny("llama", initializer_range=0.2)
    settings = EvalSettings(windows=WindowSpec("wiki-sample", n_samples=2, seq_len=32), throughput=False, generations=0)
    plan = uniform_plan(dense, 0.5, "magnitude", 8)
    saved = prune_and_evaluate(dense, settings, plan=plan, checkpoint_dir=tmp_path / "ckpt", history_path=tmp_path / "h.sqlite")
    reread = evaluate(load_model(str(tmp_path / "ckpt")), dense, settings).to_dict()
    assert saved.report["perplexity"] == reread["perplexity"]  # the float32 copy in memory gave another number


REQUEST_EXAMPLES = 50  # examples of the offline task compared request by request (200 requests)


def _lm_eval_command_line(folder, task_dir, out, batch_size: int, env: dict) -> dict[int, list[float]]:
    """lm-eval's own command line (`python -m lm_eval run --model hf ... --log_samples`) on the saved
    ``folder``: example index -> the log-likelihood of each choice, from its samples file."""
    import subprocess
    import sys

    argv = [
        *(sys.executable, "-m", "lm_eval", "run", "--model", "hf", "--model_args", f"pretrained={folder},dtype=float32"),
        *("--device", "cpu", "--tasks", OFFLINE_TASK, "--include_path", str(task_dir), "--limit", str(REQUEST_EXAMPLES)),
        *("--batch_size", str(batch_size), "--log_samples", "--output_path", str(out)),
    ]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-2000:]
    (samples,) = out.rglob(f"samples_{OFFLINE_TASK}_*.jsonl")
    rows = [json.loads(line) for line in samples.read_text().splitlines() if line.strip()]
    return {int(row["doc_id"]): [float(resp[0][0]) for resp in row["resps"]] for row in rows}


@pytest.mark.slow
def test_every_request_equals_lm_evals_own_command_line_on_a_saved_checkpoint(make_tiny, tmp_path, monkeypatch):
    """`gap eval --tasks`'s scoring (the folder loaded as gap loads it, requests scored through
    ``run_tasks``'s lm-eval wrapper) gives every choice of the first 50 examples the same
    log-likelihood as lm-eval's own command line on the same saved folder.

    The checkpoint is a tiny random Llama saved with the real SmolLM2 tokenizer: the comparison is
    of the two paths (prompt, context/continuation split, tokenisation, padding, the forward and
    the float32 log-softmax), which any weights exercise; random weights with a wide init give
    log-likelihoods that differ by hundreds of nats between choices, so a token more or less in a
    request shows, and a model this small keeps lm-eval's 200 requests to seconds.
    """
    import os

    from gap_engine.evaluate.tasks import request_loglikelihoods, task_settings
    from gap_engine.model.loading import load_model

    monkeypatch.setenv("GAP_CACHE_DIR", str(tmp_path / "cache"))
    folder = tmp_path / "tiny-llama"
    tiny = make_tiny("llama", initializer_range=0.2)
    tiny.model.save_pretrained(folder)
    tiny.tokenizer.save_pretrained(folder)
    settings = task_settings(OFFLINE_TASK, limit=REQUEST_EXAMPLES, batch_size=8)
    ours = request_loglikelihoods(load_model(str(folder)), prepare_tasks(settings), OFFLINE_TASK)
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    env["HF_DATASETS_CACHE"] = str(tmp_path / "hf-datasets")  # the task's local JSON, read by the datasets library
    theirs = _lm_eval_command_line(folder, offline_task_dir(), tmp_path / "lm-eval", settings.batch_size, env)

    assert sorted(ours) == sorted(theirs) == list(range(REQUEST_EXAMPLES))
    assert all(len(ours[i]) == len(theirs[i]) == 4 for i in ours)  # every choice of every example
    spread = max(max(lls) - min(lls) for lls in theirs.values())
    assert spread > 10  # choices far apart: a request scored on other tokens cannot pass as equal
    for i in sorted(ours):
        torch.testing.assert_close(
            torch.tensor(ours[i], dtype=torch.float64), torch.tensor(theirs[i], dtype=torch.float64), rtol=1e-6, atol=1e-4,
            msg=lambda m, i=i: f"example {i}: {m}",
        )  # fmt: skip
