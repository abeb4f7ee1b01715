"""The stakeholder report and ``gap report``: one self-contained HTML file, checked inputs.

A tiny real loss table of SmolLM2-135M, one real prune-and-evaluate run (tiny settings) in a
fresh history, and the CLI in-process. What the file must be: plotly.js inlined exactly
once, no address to fetch anything from, the table's settings, the plan's per-layer rates,
and, for a run or an evaluation file, its numbers and generations.
"""

from __future__ import annotations

import html
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from gap_engine.cli import main
from gap_engine.core.config import WindowSpec
from gap_engine.evaluate import history
from gap_engine.evaluate.metrics import EvalSettings
from gap_engine.pipeline.jobs import manager, prune_eval_task
from gap_engine.pipeline.stages import loss_table as build_table
from gap_engine.pipeline.stages import pruned_by
from gap_engine.plan.front import dp_front, front_rows
from gap_engine.plan.front_view import row_plan
from gap_engine.prune.compensations import CompensationSettings
from gap_engine.tables.artefact import TableSpec

pytestmark = pytest.mark.slow  # the real built-in model

ROOT = Path(__file__).resolve().parents[2]
TINY_SPEC = TableSpec(windows=WindowSpec("news-sample", n_samples=2, seq_len=16), estimator="taylor", rate_grid=(0.0, 0.25, 0.5, 0.75))
BIAS = CompensationSettings(mode="bias")  # FLAP's bias: the run's model has parameters its cut did not remove
PLOTLY_HEADER = re.compile(r"plotly\.js v\d+\.\d+\.\d+")


@pytest.fixture(scope="module")
def table(smol):
    return build_table(smol, TINY_SPEC, use_cache=False)


@pytest.fixture(scope="module")
def files(tmp_path_factory, table):
    folder = tmp_path_factory.mktemp("report")
    (folder / "table.json").write_text(table.to_json())
    return folder


@pytest.fixture(scope="module")
def run(tmp_path_factory, smol, table, files):
    """One real run of the DP plan at about 30% with FLAP's bias compensation (tiny evaluation), recorded in its own history."""
    front = front_rows(table, dp_front(table))
    row = next(r for r in front if r["budget"] >= 0.3)
    plan = pruned_by(row_plan(smol, table, row), "wanda")  # the table's criterion with bias (SmolLM2's DP step is OBS)
    plan.save(files / "plan.json")
    cache_dir = tmp_path_factory.mktemp("cache")
    history_path = cache_dir / "runs" / history.HISTORY_FILE  # where `gap report --run` looks with GAP_CACHE_DIR=cache_dir
    settings = EvalSettings(windows=WindowSpec("news-sample", n_samples=2, seq_len=16), throughput=False, generations=1, max_new_tokens=4)
    job = manager().submit(
        "prune_eval", prune_eval_task(table.model, settings, table=table, plan=plan, history_path=history_path, compensation=BIAS)
    )
    assert job.wait(600), job.snapshot()
    assert job.status == "done", job.error
    (files / "eval.json").write_text(json.dumps(job.result.report))
    return {"row": row, "plan": plan, "result": job.result, "cache": cache_dir}


def report_cli(*args) -> int:
    return main(["report", *map(str, args)])


def assert_self_contained(text: str) -> str:
    """Check the file fetches nothing; returns it without the inlined plotly.js."""
    assert text.startswith("<!DOCTYPE html>")
    assert len(PLOTLY_HEADER.findall(text)) == 1  # plotly.js inlined once
    assert not re.search(r"<(script|link|img|iframe)[^>]+(src|href)\s*=", text)  # nothing to fetch
    start = text.index("<script type='text/javascript'>")
    rest = text[:start] + text[text.index("</script>", start) :]  # all but plotly.js (its geo default names a CDN)
    assert "http://" not in rest and "https://" not in rest
    return rest


def test_report_of_a_table_alone_marks_the_dp_row(files, table, capsys):
    out = files / "table-only.html"
    assert report_cli("--table", files / "table.json", "--budget", "0.25", "--out", out) == 0
    assert str(out) in capsys.readouterr().out
    text = out.read_text()
    rest = assert_self_contained(text)
    front = front_rows(table, dp_front(table))
    row = next(r for r in front if r["budget"] >= 0.25)
    assert f"GAP DP front row at budget {row['budget']:.2%}" in text
    assert f"{row['removed']:,}" in text
    assert html.escape(table.key) in text and "news-sample: 2 windows x 16 tokens" in text
    assert rest.count("Plotly.newPlot(") == 2  # the sensitivity chart, the plan against the front
    rates = re.findall(r"<tr><td>(\d+)</td><td>([\d.]+)</td><td>([\d.]+)</td></tr>", text)
    assert [int(layer) for layer, _, _ in rates] == list(range(table.num_layers))
    assert [float(a) for _, a, _ in rates] == pytest.approx(row["attention_rates"])
    assert "<h2>Evaluation</h2>" not in text


def test_report_of_a_run_carries_its_numbers_and_generations(files, run, table, monkeypatch):
    monkeypatch.setenv("GAP_CACHE_DIR", str(run["cache"]))
    out = files / "run.html"
    assert report_cli("--table", files / "table.json", "--run", run["result"].run_id, "--out", out) == 0
    text = out.read_text()
    assert_self_contained(text)
    report = run["result"].report
    source = next(iter(report["perplexity"]))
    assert f"<td>{report['perplexity'][source]:.2f}</td>" in text
    assert f"<td>{report['dense']['perplexity'][source]:.2f}</td>" in text
    biases = run["result"].compensation["bias_params"]
    assert f"{run['row']['removed']:,}" in text  # what the cut removes
    assert f"{(run['row']['removed'] - biases) / table.dense_prunable:.2%}" in text  # the budget net of the biases, as the planner's
    generation = report["generations"][0]
    assert html.escape(generation["model"]) in text and html.escape(generation["dense"]) in text
    assert f"+{run['result'].actual_loss:.4f}" in text  # measured beside predicted
    assert f"+{run['plan'].predicted_loss:.4f}" in text
    # one number for the parameters left: the pruned model's, the biases its compensation added included
    assert biases > 0  # the default compensation adds a bias on each cut o_proj and down_proj
    card = "<div class='card'><div class='k'>{}</div><div class='v'>{}</div></div>"
    assert card.format("parameters left (biases included)", f"{report['params']:,}") in text
    assert card.format("bias parameters added by compensation", f"{biases:,}") in text


def test_report_of_an_eval_file_with_its_plan(files, run):
    out = files / "eval.html"
    assert report_cli("--table", files / "table.json", "--plan", files / "plan.json", "--eval", files / "eval.json", "--out", out) == 0
    text = out.read_text()
    assert_self_contained(text)
    assert "From eval.json." in text and "<h2>Evaluation</h2>" in text
    assert html.escape(run["result"].report["generations"][0]["model"]) in text
    # the file counts both models, not the biases: the report finds them from the counts and the cut
    card = "<div class='card'><div class='k'>{}</div><div class='v'>{}</div></div>"
    assert card.format("bias parameters added by compensation", f"{run['result'].compensation['bias_params']:,}") in text
    assert card.format("parameters left (biases included)", f"{run['result'].report['params']:,}") in text


def test_bad_inputs_give_one_line_and_write_nothing(files, table, smol, capsys, tmp_path):
    out = tmp_path / "never.html"
    cases = [
        (["--table", tmp_path / "missing.json"], "cannot read loss table"),
        (["--table", files / "table.json", "--eval", files / "table.json", "--plan", files / "plan.json"], "is not an evaluation report"),
        (["--table", files / "table.json", "--eval", files / "table.json"], "--eval needs --plan"),
        (["--table", files / "table.json", "--budget", "1.5"], "outside [0, 1)"),
        (["--table", files / "table.json", "--plan", files / "plan.json", "--budget", "0.2"], "--budget picks a DP front row"),
    ]
    foreign = json.loads((files / "plan.json").read_text()) | {"model": "another-model"}
    (tmp_path / "foreign.json").write_text(json.dumps(foreign))
    cases.append((["--table", files / "table.json", "--plan", tmp_path / "foreign.json"], "the plan is for another-model"))
    for args, message in cases:
        assert report_cli(*args, "--out", out) == 2, args
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("gap: error: ") and message in err[0], (args, err)
        assert not out.exists()


def test_report_and_figures_do_not_import_streamlit():
    code = (
        "import sys, gap_engine.views.report, gap_engine.views.figures, gap_engine.cli.report_commands; print('streamlit' in sys.modules)"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "False"


def test_report_of_a_recovery_shows_the_snapshots_it_judged_and_the_one_kept(table, run):
    from gap_engine.views.report import build_report, evaluation_from_report

    curve = [{"step": 0, "score": 0.5, "best": True}, {"step": 2, "score": 0.625, "best": True}, {"step": 4, "score": 0.5, "best": False}]
    recovery = {"judge": "task accuracy on gap_wiki_next (last 8 examples)", "best_step": 2, "judge_curve": curve}
    evaluation = evaluation_from_report(run["result"].report) | {"recovery": recovery}
    text = build_report(table, run["plan"], evaluation)
    assert "Recovery: snapshots judged during training" in text and "task accuracy on gap_wiki_next (last 8 examples)" in text
    rows = re.findall(r"<tr><td>(\d+)</td><td>([\d.]+)</td><td>(kept)?</td></tr>", text)
    assert rows == [("0", "0.5000", ""), ("2", "0.6250", "kept"), ("4", "0.5000", "")]
    assert "snapshots judged" not in build_report(table, run["plan"], evaluation_from_report(run["result"].report))


def test_report_of_a_run_leads_with_its_takeaway_against_uniform_at_its_budget(files, run, table, monkeypatch):
    """A real uniform run at the DP run's budget, on the same windows and with the same compensation:
    the DP run's report says both perplexities and their ratio with intervals, and draws the frontier."""
    from gap_engine.evaluate.takeaway import takeaway

    monkeypatch.setenv("GAP_CACHE_DIR", str(run["cache"]))
    history_path = run["cache"] / "runs" / history.HISTORY_FILE
    dp_record = history.get_run(run["result"].run_id, history_path)
    per_window = dp_record.params["per_window"]["news-sample"]
    assert len(per_window["nll"]) == len(per_window["kl"]) == len(per_window["dense_nll"]) == 2  # one number per window
    settings = EvalSettings(windows=WindowSpec("news-sample", n_samples=2, seq_len=16), throughput=False, generations=0)
    job = manager().submit(
        "prune_eval",
        prune_eval_task(
            table.model, settings, table=table, budget=dp_record.budget, allocator="uniform", history_path=history_path, compensation=BIAS
        ),
    )
    assert job.wait(600), job.snapshot()
    assert job.status == "done", job.error
    said = takeaway(history.runs(history_path), dp_record.id)
    assert said.other_id == job.result.run_id and said.ratio is not None and said.verdict in ("met", "tie", "loss")
    assert f"GAP's plan (run {dp_record.id}) keeps perplexity {dp_record.perplexity['news-sample']:.1f} [" in said.text
    out = files / "takeaway.html"
    assert report_cli("--table", files / "table.json", "--run", dp_record.id, "--out", out) == 0
    text = out.read_text()
    assert f"<b>Takeaway.</b> {html.escape(said.text)}</p>" in text
    assert "<h2>Measured frontier</h2>" in text
