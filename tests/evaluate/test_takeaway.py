"""The takeaway sentence and the measured frontier, from run records as the history stores them.

Records are made the way a run makes them (`RunRecord.from_report` of an evaluation report with
its per-window numbers) and read back from a real SQLite history; the numbers per window are
chosen so that the margin is a clear win, a tie or a loss.
"""

from __future__ import annotations

import math

import pytest

from gap_engine.core.errors import HistoryError
from gap_engine.evaluate import history
from gap_engine.evaluate.history import RunRecord
from gap_engine.evaluate.measured import dense_interval, measured_frontier
from gap_engine.evaluate.takeaway import compensation_takeaway, run_story, takeaway
from gap_engine.views.figures import measured_frontier_figure

SOURCE = "wiki-sample"
WINDOWS = {"data": SOURCE, "n_samples": 8, "seq_len": 128, "seed": 0, "batch_size": 4}
DENSE_NLL = [2.9, 3.1, 3.0, 2.8, 3.2, 3.0, 2.95, 3.05]
DP_NLL = [3.7, 3.8, 3.75, 3.6, 3.9, 3.72, 3.68, 3.85]
UNIFORM_NLL = [v + 0.76 for v in DP_NLL]  # exp(0.76) = 2.14x the perplexity on every window
TIE_NLL = [v + d for v, d in zip(DP_NLL, (0.05, -0.05, 0.04, -0.04, 0.03, -0.03, 0.02, -0.02))]  # mean difference 0


def record(
    allocator: str, nll: list[float] | None, budget: float = 0.2, compensation: str = "none", windows: dict = WINDOWS, weighting: str = ""
) -> RunRecord:
    """A run as prune_and_evaluate records it (``nll`` None: recorded before per-window numbers were kept; ``weighting``:
    how its fit counted tokens where not alike, as ``CompensationSettings.to_dict`` records it)."""
    numbers = nll if nll is not None else DP_NLL
    report = {
        "model": "smollm2-135m",
        "params": 100_000_000,
        "perplexity": {SOURCE: math.exp(sum(numbers) / len(numbers))},
        "dense": {"params": 134_515_008, "perplexity": {SOURCE: math.exp(sum(DENSE_NLL) / len(DENSE_NLL))}},
        "kl_to_dense": {SOURCE: sum(numbers) / len(numbers) - 2.95},
        "top1_agreement": {SOURCE: 0.6},
    }
    if nll is not None:
        kl = [v - d for v, d in zip(nll, DENSE_NLL)]
        report["per_window"] = {SOURCE: {"nll": nll, "dense_nll": DENSE_NLL, "kl": kl, "top1": [0.6] * len(nll)}}
    plan = {"model": "smollm2-135m", "num_layers": 2, "attention_rates": [0.0, 0.25], "mlp_rates": [0.125, 0.5], "allocator": allocator}
    params = {"eval": {"windows": windows, "heldout_split": "report"}, "compensation": {"mode": compensation, "bias_params": 0}}
    if weighting:
        params["compensation"]["weighting"] = weighting
    return RunRecord.from_report(plan, report, allocator=allocator, budget=budget, params=params)


def stored(tmp_path, *records: RunRecord) -> list[RunRecord]:
    """The records written to a real history and read back (what the pages read)."""
    path = tmp_path / "history.sqlite"
    for r in records:
        history.record_run(r, path)
    return history.runs(path)


def test_a_clear_win_reads_both_perplexities_and_the_ratio_with_their_intervals(tmp_path):
    runs = stored(tmp_path, record("dp", DP_NLL), record("uniform", UNIFORM_NLL))
    said = takeaway(runs, 1)
    assert said.other_id == 2 and said.verdict == "met"
    assert said.ratio is not None and said.ratio.estimate == pytest.approx(math.exp(0.76))
    assert said.ratio.low == pytest.approx(said.ratio.high)  # the same margin on every window: nothing to resample
    text = said.text
    assert text.startswith("At 20.00% of prunable parameters removed, GAP's plan (run 1) keeps perplexity 42.5 [")
    assert "on wiki-sample (the unpruned model: 20.1) where uniform pruning (run 2) gives 90.9 [" in text
    assert text.endswith(": 2.14x lower [2.14, 2.14].")


def test_the_same_sentence_from_the_uniform_run_and_a_tie_said_plainly(tmp_path):
    runs = stored(tmp_path, record("dp", DP_NLL), record("uniform", TIE_NLL))
    said = takeaway(runs, 2)  # asked about the uniform run: compared with GAP's plan all the same
    assert said.verdict == "tie" and said.ratio is not None and said.ratio.low < 1 < said.ratio.high
    assert "GAP's plan (run 1) keeps perplexity" in said.text and "uniform pruning (run 2) gives" in said.text
    assert "a tie: the ratio 1.00x [" in said.text and "contains 1, so these 8 windows cannot tell the two apart." in said.text


def test_a_loss_is_said_as_a_loss(tmp_path):
    runs = stored(tmp_path, record("dp", UNIFORM_NLL), record("uniform", DP_NLL))
    said = takeaway(runs, 1)
    assert said.verdict == "loss"
    assert said.text.endswith("GAP's plan loses here: uniform pruning's perplexity is 2.14x lower [2.14, 2.14].")


def test_a_run_without_per_window_numbers_gets_no_interval_and_says_why(tmp_path):
    runs = stored(tmp_path, record("uniform", None), record("dp", DP_NLL))
    said = takeaway(runs, 2)
    assert said.other_id == 1 and said.ratio is None and said.verdict is None
    assert "uniform pruning (run 1) gives 42.5 [" not in said.text  # the old run's number has no interval
    assert "gives 42.5:" in said.text
    assert said.text.endswith("1.00x lower, with no interval (run 1 was recorded before the history kept per-window numbers).")


def test_nothing_comparable_is_said_with_what_would_compare(tmp_path):
    other_windows = dict(WINDOWS, n_samples=16)
    runs = stored(
        tmp_path,
        record("dp", DP_NLL),
        record("uniform", UNIFORM_NLL, budget=0.3),  # another budget
        record("uniform", UNIFORM_NLL, compensation="bias"),  # this budget, its kept units refit
    )
    said = takeaway(runs, 1)
    assert said.other_id is None and said.ratio is None
    assert (
        "No uniform run at this budget on these held-out windows yet: prune with the uniform allocator at 20.00% to compare." in said.text
    )
    assert said.text.endswith("Run 3 (uniform at this budget) was measured with compensation bias, so it is not compared.")
    runs = stored(
        tmp_path / "b",
        record("dp", DP_NLL),
        record("uniform", UNIFORM_NLL, budget=0.3),
        record("uniform", UNIFORM_NLL, windows=other_windows),
    )
    assert takeaway(runs, 1).text.endswith(
        "Run 3 (uniform at this budget) was measured with other held-out windows, so it is not compared."
    )
    runs = stored(tmp_path / "c", record("dp", DP_NLL), record("uniform", UNIFORM_NLL, budget=0.3))
    assert takeaway(runs, 1).text.endswith("The nearest is run 2 at 30.00%.")
    with pytest.raises(HistoryError, match="no run with id 9"):
        takeaway(runs, 9)


def test_the_frontier_has_one_line_per_allocator_and_compensation_with_error_bars(tmp_path):
    runs = stored(
        tmp_path,
        record("dp", DP_NLL),
        record("uniform", UNIFORM_NLL),
        record("dp", TIE_NLL, budget=0.3),
        record("dp", DP_NLL, compensation="bias"),
        record("uniform", None, budget=0.3),
        record("dp", DP_NLL, windows=dict(WINDOWS, seed=1)),  # other windows: not on this frontier
    )
    points = measured_frontier(runs, runs[0])
    assert [(p.series, p.budget, p.run_id) for p in points] == [
        ("dp", 0.2, 1), ("dp", 0.3, 3), ("dp + bias", 0.2, 4), ("uniform", 0.2, 2), ("uniform", 0.3, 5),
    ]  # fmt: skip
    assert (
        points[0].perplexity_interval is not None
        and points[0].perplexity_interval.low < points[0].perplexity < points[0].perplexity_interval.high
    )
    assert points[-1].perplexity_interval is None and points[-1].kl_interval is None
    dense = dense_interval(runs, SOURCE)
    assert dense is not None and dense.estimate == pytest.approx(math.exp(sum(DENSE_NLL) / 8))
    fig = measured_frontier_figure(points, dense)
    ppl_traces = [t for t in fig.data if t.xaxis == "x" and t.error_y.array is not None]
    assert [t.name for t in ppl_traces] == ["dp", "dp + bias", "uniform"]
    [dense_line] = [t for t in fig.data if str(t.name).startswith("dense ")]
    assert (
        dense_line.name == f"dense {dense.estimate:.2f} [{dense.low:.2f}, {dense.high:.2f}]" and list(dense_line.y) == [dense.estimate] * 2
    )
    assert [a.text for a in fig.layout.annotations] == [
        "perplexity on wiki-sample (lower is better)", "KL to the dense model on wiki-sample (lower is better)",
    ]  # fmt: skip  # the subplot titles alone: an annotation on the log axis would stretch it to 10^60
    uniform = ppl_traces[2]
    assert uniform.error_y.array[1] == 0.0 and uniform.error_y.array[0] > 0  # run 5 kept no windows: no bar
    assert "no interval" in uniform.customdata[1] and "no interval" not in uniform.customdata[0]


def test_the_same_plan_with_and_without_compensation_is_compared_once_both_were_measured(tmp_path):
    compensated = [v - 0.1 for v in DP_NLL]
    runs = stored(tmp_path, record("dp", DP_NLL), record("dp", DP_NLL, windows=dict(WINDOWS, seed=1), compensation="bias"))
    assert compensation_takeaway(runs, 1) is None  # measured on other windows: no twin
    runs = stored(tmp_path / "b", record("dp", DP_NLL), record("dp", compensated, compensation="bias"))
    for asked in (1, 2):  # either run of the pair tells the same story, the compensated one first
        said = compensation_takeaway(runs, asked)
        assert said is not None and said.verdict == "met" and said.ratio is not None
        assert said.text.startswith("The same plan with bias compensation (run 2) keeps perplexity 38.5 [")
        assert "where without compensation (run 1) gives 42.5 [" in said.text and said.text.endswith(": 1.11x lower [1.11, 1.11].")
    assert run_story(runs, 1).compensation == compensation_takeaway(runs, 1)


def test_a_fit_through_the_output_norms_is_another_compensation_to_compare(tmp_path):
    """Gemma 3's default fit counts tokens through its output norms: a run so fitted is compared only with runs fitted
    the same way, and set beside the same plan fitted with tokens alike as its compensation twin."""
    weighted = [v - 0.1 for v in DP_NLL]
    runs = stored(
        tmp_path,
        record("dp", weighted, compensation="bias", weighting="output-norm"),
        record("uniform", UNIFORM_NLL, compensation="bias"),  # tokens alike: not the same compensation
        record("dp", DP_NLL, compensation="bias"),
    )
    said = takeaway(runs, 1)
    assert said.other_id is None and said.text.startswith(
        "At 20.00% of prunable parameters removed (with bias compensation fitted through the output norms), GAP's plan (run 1)"
    )
    assert said.text.endswith("Run 2 (uniform at this budget) was measured with compensation bias, so it is not compared.")
    twin = compensation_takeaway(runs, 1)
    assert twin is not None and twin.other_id == 3 and twin.verdict == "met"
    assert twin.text.startswith("The same plan with bias compensation fitted through the output norms (run 1) keeps perplexity")
    assert "where with bias compensation (run 3) gives" in twin.text
    runs = stored(tmp_path / "b", *runs, record("uniform", UNIFORM_NLL, compensation="bias", weighting="output-norm"))
    assert takeaway(runs, 1).other_id == 4
