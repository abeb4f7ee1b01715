"""The stakeholder view of a run on Prune & evaluate: its takeaway, what compensation did to its
plan, and the measured frontier, with the buttons that measure what a comparison still lacks
(the same plan with the other compensation; uniform pruning at the run's budget).

What is said comes from the engine (`takeaway.run_story`); the runs a button starts are the
page's own prune-and-evaluate jobs, on the run's own held-out windows, so they pair with it.
"""

from __future__ import annotations

import streamlit as st

from explorer import ownership
from explorer.glossary import GLOSSARY
from explorer.messages import clear_message, set_message
from explorer.session_jobs import remember_job, session_job
from gap_engine.core.config import WindowSpec
from gap_engine.core.errors import GapError, one_line
from gap_engine.evaluate import history
from gap_engine.evaluate.metrics import EvalSettings
from gap_engine.evaluate.takeaway import DEFAULT_OPPONENT, GAP_ALLOCATOR, RunStory, compensation_words, run_story
from gap_engine.model.identity import model_type_of
from gap_engine.model.rateplan import RatePlan
from gap_engine.pipeline.cost_model import run_prediction
from gap_engine.pipeline.jobs import manager, model_loaded, prune_eval_task
from gap_engine.pipeline.runs import prune_eval_stages
from gap_engine.plan.problem import Constraints
from gap_engine.prune.compensations import CompensationSettings, family_default, fitted_after_cut
from gap_engine.prune.criteria import CRITERIA, is_sequential
from gap_engine.views import figures

SAME_PLAN = "same plan"  # measure the run's plan with the other compensation
UNIFORM = "uniform"  # measure uniform pruning at the run's budget, with the run's compensation


def story_of(run_id: int) -> RunStory | None:
    """The run's takeaway and measured frontier from the history (None: the history cannot be read, or lost the run)."""
    try:
        return run_story(history.runs(), int(run_id))
    except GapError:
        return None


def show_takeaway(story: RunStory | None) -> None:
    """The takeaway sentence."""
    if story is not None:
        st.info(story.takeaway.text, icon=":material/campaign:")


def other_compensation(record: history.RunRecord) -> str:
    """The compensation a run's plan is measured with for the comparison: none after a compensated
    run, its model family's default after a run without."""
    return "none" if history.compensation_of(record) != "none" else family_default(model_type_of(record.model))


def run_settings(record: history.RunRecord) -> EvalSettings:
    """The run's own held-out evaluation (its windows, its generations), without throughput: a
    comparison is about quality, and timing both models would double its time.

    Raises:
        DataError: windows no run can read.
    """
    settings = (record.params or {}).get("eval") or {}
    windows = {k: v for k, v in (settings.get("windows") or {}).items() if k in WindowSpec.__dataclass_fields__}
    return EvalSettings(
        windows=WindowSpec(**windows).validate(),
        throughput=False,
        generations=int(settings.get("generations") or 0),
        max_new_tokens=int(settings.get("max_new_tokens") or EvalSettings.max_new_tokens),
    )


def start_beside(run_id: int, what: str, table) -> None:
    """Callback of a comparison button: ``SAME_PLAN`` prunes run ``run_id``'s plan again with the
    other compensation; ``UNIFORM`` prunes uniformly at its budget with its compensation; both on
    its held-out windows (no tasks, no checkpoint)."""
    clear_message("eval")
    try:
        record = history.get_run(run_id)
        plan = RatePlan.from_dict(dict(record.plan))
        settings = run_settings(record)
    except (GapError, TypeError) as exc:
        set_message("eval", "error", f"Cannot measure beside run {run_id}: {one_line(exc)}")
        return
    params = record.params or {}
    if what == SAME_PLAN:
        mode, allocator, chosen, criterion = other_compensation(record), plan.allocator, plan, None
        label = f"run {run_id}'s plan {plan.content_hash()} {compensation_words(mode)}"
    else:  # pruned as the run was (its criterion, its compensation): only the allocator differs
        mode, allocator, chosen, criterion = history.compensation_of(record), DEFAULT_OPPONENT, None, plan.criterion
        label = f"{DEFAULT_OPPONENT} at {(record.budget or 0):.2%} of {table.model} beside run {run_id}, criterion {criterion}"
    stages = prune_eval_stages(settings, False, False, mode != "none")
    obs_samples = (params.get("obs_windows") or {}).get("n_samples")  # the run's own, so both read as many
    recorded = params.get("compensation") if isinstance(params.get("compensation"), dict) else {}
    step = chosen.criterion if chosen is not None else criterion
    fitted = step in CRITERIA and fitted_after_cut(step, mode)
    # the run's compensation windows, so both fit on as many (a run recorded before a family's floor: its windows)
    fit_samples = (recorded.get("samples") or (recorded.get("windows") or {}).get("n_samples")) if fitted else None
    # the run's own weighting where the same compensation is fitted again (a run recorded without one weighed tokens alike)
    weighting = str(recorded.get("weighting") or "tokens") if mode != "none" and mode == recorded.get("mode") else "tokens"
    try:
        sequential = is_sequential(step)
        expected = run_prediction(
            table.model, table.spec.windows, settings, stages, allocator, 0, loaded=model_loaded(table.model),
            sequential=sequential, obs_samples=obs_samples, fit_samples=fit_samples,
        )  # fmt: skip
    except Exception:  # an unreadable config: the run itself says what is wrong
        expected = None
    task = prune_eval_task(
        table.model, settings, expected, None, table=table, budget=record.budget, allocator=allocator, plan=chosen,
        constraints=Constraints.from_dict(params.get("constraints")), compensation=CompensationSettings(mode=mode, samples=fit_samples, weighting=weighting),
        maker=ownership.owner(), obs_samples=obs_samples, criterion=criterion,
    )  # fmt: skip
    job_params = {"model": table.model, "table": table.key, "allocator": allocator, "budget": record.budget, "compensation": mode}
    job_params |= {"plan_hash": plan.content_hash() if chosen is not None else None, "beside_run": run_id}
    key = f"{table.key}|beside|{run_id}|{what}|{mode}|{weighting}|{settings}"
    job = manager().submit("prune_eval", task, key=key, label=label, params=job_params, owner=ownership.owner())
    remember_job("prune_eval", job)


def show_story(run_id: int, table) -> None:
    """The run's takeaway and what compensation did to its plan, each with the button that measures
    what it still lacks (a run on another loss table gets none: its calibration text is not this one's)."""
    story = story_of(run_id)
    if story is None:
        return
    show_takeaway(story)
    if story.compensation is not None:
        st.info(story.compensation.text, icon=":material/compare_arrows:")
    try:
        record = history.get_run(run_id)
    except GapError:
        return
    if record.table_key != table.key:
        st.caption(f"Run {run_id} was planned on another loss table: load it on Setup to measure beside it.")
        return
    running = session_job("prune_eval")
    busy = running is not None and running.active
    buttons = []
    if story.takeaway.other_id is None and record.allocator == GAP_ALLOCATOR:
        buttons.append((UNIFORM, f"Prune uniformly at {(record.budget or 0):.2%} to compare", ":material/balance:",
                        f"Prunes every layer at the same rate, at run {run_id}'s budget and compensation, on its held-out windows "
                        "(no throughput, tasks or checkpoint): the takeaway then compares the two, with an interval."))  # fmt: skip
    if story.compensation is None:
        mode = other_compensation(record)
        buttons.append((SAME_PLAN, f"Measure this plan {compensation_words(mode)}", ":material/compare_arrows:",
                        f"Prunes run {run_id}'s plan again, {compensation_words(mode)}, on the same held-out windows (no "
                        "throughput, tasks or checkpoint): what compensation does to this plan, with an interval. "
                        + GLOSSARY["compensation"]))  # fmt: skip
    for column, (what, label, icon, help_text) in zip(st.columns(max(1, len(buttons))), buttons):
        column.button(label, key=f"eval_beside_{what.replace(' ', '_')}_{run_id}", on_click=start_beside, args=(run_id, what, table),
                      disabled=busy, icon=icon, help=help_text)  # fmt: skip


def show_frontier(run_ids: list[int], shown: int | None) -> None:
    """The measured frontier of the run on screen ``shown`` (else the latest run): every run on its
    held-out windows, perplexity and KL against budget, with their intervals."""
    reference = shown if shown in run_ids else run_ids[-1]
    story = story_of(reference)
    if story is None or not story.frontier:
        return
    st.markdown(
        f"**Measured frontier** (the runs evaluated on run {reference}'s held-out windows)",
        help="Each point is a finished run; the bars are 95% bootstrap intervals over the held-out windows "
        "(a run recorded before per-window numbers were kept has none). Lower is better on both panels.",
    )
    if shown != reference:  # the result panel says it already
        show_takeaway(story)
    st.plotly_chart(figures.measured_frontier_figure(story.frontier, story.dense), key="eval_frontier_chart", width="stretch", theme=None)
