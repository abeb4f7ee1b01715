"""bench/bench_quality.py and bench/quality_report.py without a model: the argument parser, the menu,
the choice on the selection part, resuming, and the report's verdicts on hand-made per-window numbers."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import bench_quality
import quality_report
from bench_quality import Progress, Results, command_argv, compensations_for, default_compensation, parse_args
from quality_report import Group, best_on_selection, report_text

SOURCES = ("wiki-sample", "news-sample")


def _row(budget, allocator, compensation, selection_kl, report_kl, seed=0, windows=24):
    """A measured row whose windows' KL scatter around the given means (NLL = 3 + KL)."""
    rng = np.random.default_rng(seed)
    numbers = {}
    for split, kl, count in (("selection", selection_kl, 16), ("report", report_kl, windows)):
        for source in SOURCES:
            scatter = rng.lognormal(0.0, 0.05, size=count)
            values = (kl * scatter / scatter.mean()).tolist()
            numbers[f"{split}/{source}"] = {"kl": values, "nll": [3.0 + v for v in values], "top1": [0.5] * count}
    return {
        "kind": "row",
        "budget": budget,
        "allocator": allocator,
        "criterion": "obs" if allocator == "slimgpt" else "wanda",
        "compensation": compensation,
        "removed_fraction": budget,
        "params_after": 1000,
        "bias_params": 0,
        "windows": numbers,
        "prune_s": 1.0,
        "eval_s": 2.0,
        "load_start": 1.0,
        "load_end": 1.0,
    }


def test_defaults_give_every_method_the_whole_menu():
    args = parse_args([])
    assert args.allocators == "dp,uniform,flap,slimgpt" and args.compensations == "none,bias,refit,bias+refit"
    assert args.report_windows >= 24 and args.selection_windows >= 16 and args.task_limit == 0
    assert compensations_for(False, ["none", "bias", "refit", "bias+refit"]) == ["none", "bias", "refit", "bias+refit"]
    assert compensations_for(True, ["none", "bias", "refit", "bias+refit"]) == ["none", "bias"]  # obs: its update, bias on top
    # each family's default after a step that leaves the kept columns as they were (Gemma 3's fitted through its
    # output norms); none after OBS
    assert [default_compensation(c, t) for c, t in [("wanda", "llama"), ("wanda", "gemma3_text"), ("obs", "gemma3_text")]] == [
        "bias",
        "bias+refit:norm",
        "none",
    ]


def test_a_menu_entry_may_be_fitted_through_the_output_norms():
    menu = ["none", "bias", "refit", "bias+refit", "bias:norm", "refit:norm", "bias+refit:norm"]
    assert parse_args(["--compensations", ",".join(menu)]).compensations == ",".join(menu)
    assert compensations_for(True, menu) == ["none", "bias", "bias:norm"]  # OBS's bias may be weighted; no refit follows OBS
    settings = bench_quality.menu_settings("bias+refit:norm", 64)
    assert (settings.mode, settings.samples, settings.weighting) == ("bias+refit", 64, "output-norm")
    assert bench_quality.menu_settings("bias", None).weighting == "tokens"
    assert [bench_quality.menu_name(bench_quality.menu_settings(c, None)) for c in menu] == menu


def test_report_lists_only_the_rows_of_its_own_menu():
    # A results file resumed with a longer menu holds rows the shorter command never asked for.
    groups = [Group(0.2, "dp", ("bias",), "bias"), Group(0.2, "uniform", ("bias",), "bias")]
    rows = [_row(0.2, "dp", "bias", 0.5, 0.5, seed=1), _row(0.2, "uniform", "bias", 0.7, 0.7, seed=2)]
    longer = rows + [_row(0.2, "dp", "bias:norm", 0.4, 0.4, seed=3)]
    args = parse_args(["--budgets", "0.2", "--compensations", "bias", "--allocators", "dp,uniform", "--resamples", "200"])
    assert report_text(args, "cmd", "m", longer, groups, None, []) == report_text(args, "cmd", "m", rows, groups, None, [])
    weighted = [Group(0.2, "dp", ("bias", "bias:norm"), "bias"), Group(0.2, "uniform", ("bias",), "bias")]
    text = report_text(args, "cmd", "m", longer, weighted, None, [])
    assert "| 20% | dp | bias:norm |" in text and "NAME:norm: NAME fitted through the norms after o_proj and down_proj" in text


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--task-limit", "100"], "at least 500"),
        (["--compensations", "bias,none:norm"], "unknown 'none:norm'"),
        (["--compensations", "bias,bias:scaled"], "unknown 'bias:scaled'"),
        (["--report-windows", "16"], "at least 24"),
        (["--allocators", "uniform,dp"], "start with dp"),
        (["--compensations", "bias,stretch"], "unknown 'stretch'"),
    ],
)
def test_claims_on_too_little_are_refused(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_args(argv)
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_the_recorded_command_parses_back_to_the_same_settings():
    args = parse_args(["--budgets", "0.2", "--eval-data", "news-sample", "--task-limit", "500"])
    again = parse_args(command_argv(args))
    assert bench_quality.settings_of(again) == bench_quality.settings_of(args)
    assert "--fresh" not in command_argv(args)


def test_the_best_is_chosen_on_selection_never_on_report():
    group = Group(0.2, "dp", ("none", "bias", "refit"), "bias")
    rows = [
        _row(0.2, "dp", "none", selection_kl=0.9, report_kl=0.5),
        _row(0.2, "dp", "bias", selection_kl=0.6, report_kl=0.7),  # best on selection, not on report
        _row(0.2, "dp", "refit", selection_kl=0.7, report_kl=0.4),
        _row(0.3, "dp", "none", selection_kl=0.1, report_kl=0.1),  # another budget: not a candidate
    ]
    assert best_on_selection(group, rows, SOURCES)["compensation"] == "bias"
    assert best_on_selection(group, rows[:2], SOURCES) is None  # refit not measured yet: no choice


def test_report_states_met_tie_and_loss_from_the_intervals():
    groups = [Group(0.2, "dp", ("none", "bias"), "bias"), Group(0.2, "uniform", ("none", "bias"), "bias")]
    groups += [Group(0.2, "flap", ("none", "bias"), "bias"), Group(0.2, "slimgpt", ("none", "bias"), "none")]
    rows = [
        _row(0.2, "dp", "none", 0.8, 0.8, seed=1),
        _row(0.2, "dp", "bias", 0.5, 0.5, seed=2),
        _row(0.2, "uniform", "none", 2.0, 2.0, seed=3),  # far worse than DP: met
        _row(0.2, "uniform", "bias", 2.5, 2.5, seed=4),
        _row(0.2, "flap", "none", 0.9, 0.9, seed=5),
        _row(0.2, "flap", "bias", 0.5, 0.5, seed=2),  # DP's own windows: a ratio of exactly 1, a tie
        _row(0.2, "slimgpt", "none", 0.3, 0.3, seed=6),  # far better than DP: a loss
        _row(0.2, "slimgpt", "bias", 0.35, 0.35, seed=7),
    ]
    args = parse_args(["--budgets", "0.2", "--resamples", "500", "--name", "unit"])
    text = report_text(args, "python bench/bench_quality.py --budgets 0.2", "Machine: test.", rows, groups, None, [])
    assert text.splitlines()[0] == "python bench/bench_quality.py --budgets 0.2"
    lines = {line.split(" | ")[2]: line for line in text.splitlines() if line.startswith("| 20% | bias | ")}
    assert lines["uniform (none)"].count("met") == 6 and "tie" not in lines["uniform (none)"]
    assert lines["flap (bias)"].count("tie") == 6 and "1.000 [1.000, 1.000]" in lines["flap (bias)"]
    assert lines["slimgpt (none)"].count("loss") == 6
    assert "DP at its default: 6 met, 6 ties, 6 losses" in text  # DP's best on selection is its default here


def test_a_killed_run_resumes_and_other_settings_are_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(bench_quality, "RESULTS", tmp_path)
    path = tmp_path / "unit.jsonl"
    args = parse_args(["--name", "unit"])
    results = Results(path, args)
    results.append(_row(0.2, "dp", "bias", 0.5, 0.5))
    with path.open("a") as f:
        f.write('{"kind": "row", "budg')  # a kill in the middle of a line
    resumed = Results(path, args)
    assert [r["compensation"] for r in resumed.rows()] == ["bias"]
    assert len(path.read_text().splitlines()) == 2 and json.loads(path.read_text().splitlines()[-1])["kind"] == "row"
    assert resumed.row(0.2, "dp", "bias") is not None and resumed.row(0.2, "dp", "none") is None
    with pytest.raises(SystemExit, match="other settings \\(report_windows\\)"):
        Results(path, parse_args(["--name", "unit", "--report-windows", "26"]))
    assert len(Results(path, parse_args(["--name", "unit", "--budgets", "0.3"])).rows()) == 1  # more budgets: same measurements
    assert Results(path, parse_args(["--name", "unit", "--fresh"])).rows() == []


def test_rows_pruned_by_obs_are_of_their_window_count(tmp_path, monkeypatch):
    monkeypatch.setattr(bench_quality, "RESULTS", tmp_path)
    path = tmp_path / "unit.jsonl"
    args = parse_args(["--name", "unit", "--samples", "16"])
    assert args.obs_samples == 64  # OBS reads what the tool ships unless told otherwise: 4x the calibration's
    results = Results(path, args)
    results.append(_row(0.2, "slimgpt", "none", 0.5, 0.5))  # measured before rows said their OBS windows: 16
    results.append(_row(0.2, "slimgpt", "none", 0.4, 0.4) | {"obs_samples": 64})
    results.append(_row(0.2, "flap", "bias", 0.6, 0.6))
    labels = {(0.2, "slimgpt", "obs"): "slimgpt", (0.2, "flap", "wanda"): "flap"}

    def kept(*argv):
        resumed = Results(path, parse_args(["--name", "unit", *argv]))
        resumed.adopt(labels, resumed_args(*argv).obs_samples, 16)
        return sorted((r["allocator"], r.get("obs_samples")) for r in resumed.rows())

    def resumed_args(*argv):
        return parse_args(["--name", "unit", *argv])

    assert kept("--obs-samples", "16") == [("flap", None), ("slimgpt", None)]
    assert kept() == [("flap", None), ("slimgpt", 64)]  # the others' rows are kept: same measurements
    assert kept("--obs-samples", "128") == [("flap", None)]
    assert "--obs-samples" in command_argv(args)


def test_a_report_without_its_criterion_is_of_the_row_it_followed(tmp_path, monkeypatch):
    # A bare dp measured by wanda before OBS was its step, then by OBS: two rows under one name.
    monkeypatch.setattr(bench_quality, "RESULTS", tmp_path)
    path = tmp_path / "unit.jsonl"
    results = Results(path, parse_args(["--name", "unit"]))
    wanda = _row(0.2, "dp", "bias", 0.5, 0.5, seed=1)
    obs = _row(0.2, "dp", "bias", 0.4, 0.4, seed=2) | {"criterion": "obs", "obs_samples": 16}
    for row in (wanda, obs):
        report = {k: v for k, v in row.items() if k not in ("criterion", "obs_samples")} | {"kind": "report"}
        report["windows"] = {k: v for k, v in row["windows"].items() if k.startswith("report/")}
        results.append({**row, "windows": {k: v for k, v in row["windows"].items() if k.startswith("selection/")}})
        results.append(report | ({"obs_samples": 16} if row is obs else {}))
    results.append({"kind": "report", "budget": 0.2, "allocator": "dp:wanda", "compensation": "bias", "windows": {}})
    resumed = Results(path, parse_args(["--name", "unit"]))
    resumed.adopt({(0.2, "dp", "wanda"): "dp:wanda", (0.2, "dp", "obs"): "dp"}, 16, 16)
    labels = [(r["kind"], r["allocator"]) for r in resumed.records if r.get("kind") in ("row", "report")]
    assert labels == [("row", "dp:wanda"), ("report", "dp:wanda"), ("row", "dp"), ("report", "dp"), ("report", "dp:wanda")]
    by_label = {r["allocator"]: r for r in resumed.rows()}
    assert by_label["dp"]["windows"]["report/wiki-sample"] == obs["windows"]["report/wiki-sample"]


def test_report_is_regenerated_from_its_records_alone(tmp_path):
    # The report reads nothing but its arguments: two calls give the same text.
    groups = [Group(0.2, "dp", ("bias",), "bias"), Group(0.2, "uniform", ("bias",), "bias")]
    rows = [_row(0.2, "dp", "bias", 0.5, 0.5, seed=1), _row(0.2, "uniform", "bias", 0.7, 0.7, seed=2)]
    args = parse_args(["--budgets", "0.2", "--compensations", "bias", "--allocators", "dp,uniform", "--resamples", "200"])
    first = report_text(args, "cmd", "m", rows, groups, None, [])
    assert first == report_text(args, "cmd", "m", list(reversed(rows)), groups, None, [])
    assert quality_report.MIN_TASK_EXAMPLES == 500 and "Task accuracy was not measured" in first


class _Bench:
    """The measuring side of bench_quality.Run, with made-up numbers: what measure_group asks of it."""

    def __init__(self, args, selection_kl):
        self.args, self.sources, self.selection_kl = args, list(SOURCES), selection_kl
        self.pruned_count: dict[str, int] = {}

    def pruned(self, budget, allocator, compensation):
        self.pruned_count[compensation] = self.pruned_count.get(compensation, 0) + 1
        return f"model {compensation}", None

    def measure_selection(self, budget, allocator, compensation):
        model, _ = self.pruned(budget, allocator, compensation)
        row = _row(budget, allocator, compensation, self.selection_kl[compensation], 0.5)
        row["windows"] = {k: v for k, v in row["windows"].items() if k.startswith("selection/")}
        return model, row

    def measure_report(self, model, budget, allocator, compensation):
        assert model == f"model {compensation}"
        windows = _row(budget, allocator, compensation, 0.5, 0.5)["windows"]
        report = {k: v for k, v in windows.items() if k.startswith("report/")}
        return {
            "kind": "report",
            "budget": budget,
            "allocator": allocator,
            "compensation": compensation,
            "windows": report,
            "report_s": 1.0,
        }


@pytest.mark.slow
def test_a_group_reports_its_default_and_its_best_and_prunes_each_model_once(tmp_path, monkeypatch):
    monkeypatch.setattr(bench_quality, "RESULTS", tmp_path)
    args = parse_args(["--name", "unit"])
    results = Results(tmp_path / "unit.jsonl", args)
    group = Group(0.2, "dp", ("none", "bias", "refit", "bias+refit"), "bias")
    bench = _Bench(args, {"none": 0.9, "bias": 0.6, "refit": 0.4, "bias+refit": 0.5})
    bench_quality.measure_group(bench, results, group, bench_quality.Progress(6, 0))
    reported = sorted(r["compensation"] for r in results.records if r["kind"] == "report")
    assert reported == ["bias", "refit"]  # the default and the best on selection, nothing else
    assert bench.pruned_count == {"none": 1, "bias": 1, "refit": 1, "bias+refit": 1}  # kept in memory, never pruned twice
    assert quality_report.chosen_rows([group], results.rows(), SOURCES)[(0.2, "dp")]["best"]["compensation"] == "refit"
    # A run killed before its reports: the rows stay, the reports come, the best pruned once more.
    for record in [r for r in results.records if r["kind"] == "report"]:
        results.records.remove(record)
    again = _Bench(args, bench.selection_kl)
    bench_quality.measure_group(again, results, group, bench_quality.Progress(2, 0))
    assert again.pruned_count == {"bias": 1, "refit": 1}
    assert sorted(r["compensation"] for r in results.records if r["kind"] == "report") == ["bias", "refit"]


def test_task_accuracy_is_shown_only_on_enough_examples():
    groups = [Group(0.2, "dp", ("bias",), "bias"), Group(0.2, "uniform", ("bias",), "bias")]
    rows = [_row(0.2, "dp", "bias", 0.5, 0.5, seed=1), _row(0.2, "uniform", "bias", 0.7, 0.7, seed=2)]
    args = parse_args(["--budgets", "0.2", "--compensations", "bias", "--allocators", "dp,uniform", "--resamples", "200"])
    task = {"kind": "task", "budget": 0.2, "allocator": "dp", "compensation": "bias", "acc": 0.61, "stderr": 0.02, "n": 500}
    dense = {"kind": "task", "budget": 0.0, "allocator": "dense", "compensation": "none", "acc": 0.63, "stderr": None, "n": 500}
    text = report_text(args, "cmd", "m", rows, groups, None, [task, dense])
    assert "0.610 ± 0.020" in text and "(dense 0.630)" in text and "on 500 examples" in text
    few = report_text(args, "cmd", "m", rows, groups, None, [task | {"n": 100}])
    assert "0.610" not in few and "Task accuracy was not measured" in few


def test_dp_pruned_by_another_criterion_gets_margins_of_its_own():
    """``dp:obs`` is a DP variant: its own tables and tallies against the baselines, not a baseline."""
    groups = [Group(0.2, "dp", ("none", "bias"), "bias"), Group(0.2, "flap", ("none", "bias"), "bias")]
    groups += [Group(0.2, "dp:obs", ("none", "bias"), "none")]
    rows = [
        _row(0.2, "dp", "none", 0.8, 0.8, seed=1),
        _row(0.2, "dp", "bias", 0.5, 0.5, seed=2),
        _row(0.2, "flap", "none", 0.9, 0.9, seed=5),
        _row(0.2, "flap", "bias", 0.6, 0.6, seed=3),
        _row(0.2, "dp:obs", "none", 0.2, 0.2, seed=6),  # far better than FLAP: met
        _row(0.2, "dp:obs", "bias", 0.25, 0.25, seed=7),
    ]
    args = parse_args(["--budgets", "0.2", "--allocators", "dp,flap,dp:obs", "--resamples", "500", "--name", "unit"])
    text = report_text(args, "python bench/bench_quality.py", "Machine: test.", rows, groups, None, [])
    assert "### DP pruned by obs at its default compensation against every baseline at its best" in text
    assert "DP pruned by obs at its default: 6 met, 0 ties, 0 losses" in text
    assert "dp:obs (" not in text.split("## Each method")[0].split("### DP pruned")[0]  # never a baseline of DP
    with pytest.raises(SystemExit):
        parse_args(["--allocators", "dp,flap:stretch"])


def test_a_resumed_run_says_how_much_was_read_back_and_what_every_measurement_took():
    records = [
        {"kind": "settings", "settings": {}},
        {"kind": "row", "prune_s": 100.0, "eval_s": 20.0},
        {"kind": "report", "report_s": 30.0},
        {"kind": "row", "prune_s": 5.0, "eval_s": 10.0},
    ]
    assert bench_quality.resumed_text(records, 3) == ""  # a run that measured everything itself: its own time is the file's
    text = bench_quality.resumed_text(records, 1)  # read back counts what the report holds, never records set aside
    assert "2 of the 3 measurements were made by earlier runs" in text and "took 165 s" in text
    assert "3 of the 3 measurements" in bench_quality.resumed_text(records, 0)


def test_progress_never_counts_more_done_than_planned():
    """Reports read back for another default than today's can pass the planned count: the estimate stays at zero left."""
    progress = Progress(2, 2)
    assert progress.step(10.0) == "[3/3, about 0 min left]"


def test_rows_fitted_on_other_windows_are_not_resumed_and_the_report_says_what_the_fit_read(tmp_path, monkeypatch):
    """--fit-samples changes every compensated measurement: a file made without it is not resumed with it (and
    one made before the option existed, whose settings do not name it, is resumed without it); the settings say it."""
    monkeypatch.setattr(bench_quality, "RESULTS", tmp_path)
    path = tmp_path / "unit.jsonl"
    Results(path, parse_args(["--name", "unit"])).append(_row(0.2, "dp", "bias", 0.5, 0.5))
    with pytest.raises(SystemExit, match="other settings \\(fit_samples\\)"):
        Results(path, parse_args(["--name", "unit", "--fit-samples", "64"]))
    older = [json.loads(line) for line in path.read_text().splitlines()]
    del older[0]["settings"]["fit_samples"]
    path.write_text("".join(json.dumps(record) + "\n" for record in older))
    assert len(Results(path, parse_args(["--name", "unit"])).rows()) == 1
    with pytest.raises(SystemExit):
        parse_args(["--fit-samples", "0"])
    args = parse_args(["--fit-samples", "64", "--obs-samples", "64"])
    settings = "\n".join(quality_report.settings_lines(args, [], list(SOURCES), None))
    assert "every compensation after a cut is fitted on 64 windows of the same text" in settings
    assert "--fit-samples" in command_argv(args)


def test_dp_against_dense_pairs_each_window_with_the_dense_models_and_judges_the_bounds():
    """DP's default over dense on the same windows: NLL = 3 + KL and dense NLL = 3, so the ratio is exp(mean KL); a
    mean of 0.40 is 1.49x, met against 1.6 at 20%, and 1.45 at 40% is 4.26x on every source, missed against 4x."""
    groups = [Group(b, "dp", ("bias",), "bias") for b in (0.2, 0.4)]
    rows = [_row(0.2, "dp", "bias", 0.4, 0.4, seed=1), _row(0.4, "dp", "bias", 1.45, 1.45, seed=2)]
    dense = {
        "kind": "dense",
        "windows": {f"{split}/{s}": {"nll": [3.0] * n} for split, n in (("selection", 16), ("report", 24)) for s in SOURCES},
    }
    args = parse_args(["--budgets", "0.2,0.4", "--compensations", "bias", "--allocators", "dp", "--resamples", "500"])
    text = report_text(args, "cmd", "m", rows, groups, dense, [])
    assert "| 20% | DP (bias) | 1.49 [" in text and "| 40% | DP (bias) | 4.26 [" in text
    assert "- DP at its default, 20%, within 1.6x of dense on the mean of sources: **met** (mean 1.49x [" in text
    assert "- DP at its default, 40%, within 4x of dense on every source: **missed** (wiki-sample 4.26x [" in text
    assert "within" not in report_text(args, "cmd", "m", rows, groups, None, []).split("## Each method")[0].split("## Against dense")[1]
