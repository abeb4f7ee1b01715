"""Prune & evaluate: prune a copy of the model with the chosen plan, measure it, keep the run."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import streamlit as st

from explorer import budget_chart, ownership, run_story
from explorer.confirm import ask_first, confirmation
from explorer.glossary import GLOSSARY
from explorer.job_panel import job_controls
from explorer.job_text import expected_caption
from explorer.messages import clear_message, set_message, show_message
from explorer.page_paths import PLANNER_PAGE
from explorer.plan_state import constraints_from_state, constraints_json, plan_compensation, release_current_plan
from explorer.session_jobs import remember_job, session_job
from explorer.session_keys import PLAN_OWN
from explorer.table_state import table_page
from explorer.task_picker import checked_task_settings, task_defaults, task_examples, task_picker
from gap_engine.core.config import APP_EVAL_WINDOWS, OBS_WINDOW_CAP, OBS_WINDOW_FACTOR, WindowSpec, obs_window_count
from gap_engine.core.errors import GapError, one_line
from gap_engine.core.limits import LIMITS, check_windows
from gap_engine.data.windows import HELDOUT_SOURCES
from gap_engine.evaluate import history, runcompare
from gap_engine.evaluate.metrics import EvalSettings
from gap_engine.evaluate.tasks import score_text, task_table_rows
from gap_engine.model.adapters import has_output_norms
from gap_engine.model.rateplan import RatePlan
from gap_engine.pipeline.cost_model import Prediction, run_prediction
from gap_engine.pipeline.jobs import manager, model_loaded, prune_eval_task
from gap_engine.pipeline.runs import prune_eval_stages
from gap_engine.plan.allocator_registry import ALLOCATORS
from gap_engine.plan.step import plan_criterion as allocator_step
from gap_engine.plan.step import table_model_type
from gap_engine.prune.compensations import (
    COMPENSATIONS,
    CompensationSettings,
    family_weighting,
    fit_name,
    fit_window_count,
    fitted_after_cut,
)
from gap_engine.prune.criteria import CRITERIA, is_sequential
from gap_engine.views import figures

UPLOADED = "uploaded plan"
ALLOCATOR_HELP = {name: ALLOCATORS.describe(name) for name in ALLOCATORS} | {UPLOADED: "the plan uploaded on the Export page"}
DEFAULTS = {
    "eval_allocator": "dp",
    "eval_criterion": PLAN_OWN,
    "eval_obs_samples": None,  # None: the default count (stages.obs_windows)
    "eval_fit_samples": None,  # None: the compensation is fitted on the table's windows
    # True: fitted through the norms after o_proj/down_proj (weighting output-norm); None: as the model family's fits are
    "eval_fit_through_norms": None,
    "eval_sources": [APP_EVAL_WINDOWS.data],
    "eval_samples": APP_EVAL_WINDOWS.n_samples,
    "eval_seq_len": APP_EVAL_WINDOWS.seq_len,
    "eval_throughput": True,
    "eval_generations": 3,
    "eval_max_new_tokens": 24,
    "eval_save_checkpoint": True,
    "eval_metric": None,
    "eval_compare": [],
    "eval_history_columns": [],
} | task_defaults("eval_")
table = table_page("eval_", DEFAULTS, "Prune & evaluate")
ss = st.session_state
released = ss.get("app_plan")
if (
    ss["eval_allocator"] == "dp"
    and not ss.get("app_plan_missing")
    and (not released or released.get("compensation") != plan_compensation(table))
):
    # The planner was not opened in this session, or the compensation changed here since it
    # released its plan: the planner's plan for this budget, counted for the compensation the run applies.
    try:
        release_current_plan(table)
    except GapError as exc:
        st.error(f"Cannot make the planner's plan: {one_line(exc)}")
budget = float(ss["app_budget"])
uploaded = ss.get("app_uploaded_plan")
allocators = list(ALLOCATORS) + ([UPLOADED] if uploaded else [])
if ss["eval_allocator"] not in allocators:
    ss["eval_allocator"] = "dp"


def eval_settings() -> EvalSettings:
    """The evaluation the form describes."""
    windows = WindowSpec(
        data=",".join(ss["eval_sources"]) or APP_EVAL_WINDOWS.data,
        n_samples=int(ss["eval_samples"]),
        seq_len=int(ss["eval_seq_len"]),
        # The batch never changes a number; long windows go fewer at a time to stay within memory.
        batch_size=max(1, min(APP_EVAL_WINDOWS.batch_size, LIMITS.batch_tokens // int(ss["eval_seq_len"]))),
    )
    return EvalSettings(
        windows=windows,
        throughput=bool(ss["eval_throughput"]),
        generations=int(ss["eval_generations"]),
        max_new_tokens=int(ss["eval_max_new_tokens"]),
    )


def expected_run(settings: EvalSettings) -> Prediction | None:
    """What the run the form describes is predicted to take here, stage by stage (the cost model;
    loading costs nothing when the model is in memory); None when nothing honest can be said."""
    allocator = ss["eval_allocator"] if ss["eval_allocator"] in ALLOCATORS else "manual"
    compensated = run_compensation() != "none"
    stages = prune_eval_stages(settings, bool(ss["eval_save_checkpoint"]), bool(ss["eval_tasks_on"]), compensated)
    try:
        examples = task_examples("eval_")
        return run_prediction(
            table.model, table.spec.windows, settings, stages, allocator, examples,
            loaded=model_loaded(table.model), sequential=is_sequential(run_criterion()), obs_samples=asked_obs_samples(),
            fit_samples=fit_window_count(table_model_type(table), table.spec.windows.n_samples, asked_fit_samples()),
        )  # fmt: skip
    except Exception:  # an unreadable config: the run itself says what is wrong
        return None


def start_run(shown_plan: dict | None = None) -> None:
    """Callback of Prune and evaluate: a background job for the form, pruning the plan the page showed.

    Args:
        shown_plan: the planner's plan (a RatePlan dict) drawn beside the button, bound to it when
            the page was drawn: a release that lands between that drawing and the click (a page
            run interrupted after the release was applied, say) changes the session's plan, never
            the plan pruned, so the run's hash is the hash that was on screen.
    """
    clear_message("eval")
    settings = eval_settings()
    windows = settings.windows
    try:
        check_windows(windows.n_samples, windows.seq_len, windows.batch_size, ("Held-out samples", "Tokens per sample", "Batch size"))
    except GapError as exc:
        set_message("eval", "error", one_line(exc))
        return
    expected = expected_run(settings)
    allocator = ss["eval_allocator"]
    plan = None
    if allocator == "dp":  # prune exactly what the planner released and this page showed
        try:
            plan = RatePlan.from_dict(dict(shown_plan)) if shown_plan else None
        except GapError as exc:
            set_message("eval", "error", one_line(exc))
            return
        if plan is None:  # never a re-derived plan in its place
            set_message("eval", "error", missing_plan_text())
            return
        if changed_under_the_click(plan):
            return
    run_budget = float(plan.budget) if allocator == "dp" and plan is not None and plan.budget is not None else budget
    if allocator == UPLOADED:
        try:
            plan = RatePlan.from_dict(dict(uploaded))
        except GapError as exc:
            set_message("eval", "error", one_line(exc))
            return
    tasks_ok, task_settings = checked_task_settings("eval_", "eval")  # the engine's check, as for gap eval --tasks
    if not tasks_ok:
        return
    checkpoint_dir = None
    if ss["eval_save_checkpoint"]:
        checkpoint_dir = history.new_checkpoint_dir(plan.allocator if plan else allocator, plan.budget if plan else run_budget)
    criterion = None if ss["eval_criterion"] == PLAN_OWN else ss["eval_criterion"]
    obs_samples, fit_samples, weighting = asked_obs_samples(), asked_fit_samples(), asked_fit_weighting()
    task = prune_eval_task(
        table.model,
        settings,
        expected,
        task_settings,
        table=table,
        budget=run_budget,
        allocator=allocator if plan is None else plan.allocator,
        constraints=constraints_from_state(),
        plan=plan,
        checkpoint_dir=checkpoint_dir,
        compensation=CompensationSettings(mode=run_compensation(), samples=fit_samples, weighting=weighting),
        maker=ownership.owner(),
        criterion=criterion,
        obs_samples=obs_samples,
    )
    plan_id = plan.content_hash() if plan is not None else ""
    compensation = run_compensation()
    key = f"{table.key}|{allocator}|{run_budget:.4f}|{plan_id}|{compensation}|{criterion}|{obs_samples}|{fit_samples}|{weighting}|{constraints_json(ss['app_constraints'])}|{settings}|{task_settings}"
    params = {"model": table.model, "table": table.key, "allocator": allocator, "budget": run_budget, "plan_hash": plan_id or None}
    params |= {"compensation": compensation, "criterion": run_criterion(), "obs_samples": obs_samples, "fit_samples": fit_samples}
    params |= {"fit_weighting": weighting} if weighting != "tokens" else {}
    label = f"{allocator} at {run_budget:.2%} of {table.model}" + (f", plan {plan_id}" if plan_id else "")
    label += f", criterion {criterion}" if criterion else ""
    label += f", compensation {fit_name(compensation, weighting)}" if compensation != "none" else ""
    job = manager().submit("prune_eval", task, key=key, label=label, params=params, owner=ownership.owner())
    remember_job("prune_eval", job)


def changed_under_the_click(shown) -> bool:
    """Whether the budget the slider showed reached the session after this page was drawn (the page
    still shows the plan before it); if so nothing starts, the page says why and then shows the
    new plan, so the next press prunes that one. Never prunes a plan the slider has left."""
    arriving = budget_chart.unsent_release()  # handed over with this very click
    if arriving is not None and arriving.get("budget") != shown.budget:
        set_message(
            "eval",
            "warning",
            f"The budget the planner showed ({float(arriving['budget']):.2%}) was still reaching this page when "
            "Prune and evaluate was pressed: nothing was started. Its plan is shown above now; press again to prune it.",
        )
        return True
    try:
        now = RatePlan.from_dict(dict(ss["app_plan"])) if ss.get("app_plan") else None
    except GapError:
        now = None
    if now is not None and now.content_hash() != shown.content_hash():
        set_message(
            "eval",
            "warning",
            f"The planner's plan changed to `{now.content_hash()}` ({(now.budget or 0):.2%}) after this page showed "
            f"`{shown.content_hash()}`: nothing was started. The new plan is shown above now; press again to prune it.",
        )
        return True
    return False


def planner_plan():
    """The plan the planner released (or the link restored) when it belongs to this table and budget."""
    stored = ss.get("app_plan")
    if not stored or stored.get("table_key") != table.key or stored.get("budget") != budget:
        return None
    if stored.get("compensation") != plan_compensation(table):
        return None  # counted for another compensation than the run applies
    try:
        return RatePlan.from_dict(dict(stored))
    except GapError:
        return None


def plan_criterion() -> str:
    """The criterion the chosen plan names: the uploaded plan's, else its allocator's step (`plan.step`: its own, DP's family step, or the table's)."""
    if ss["eval_allocator"] == UPLOADED:
        return str(dict(uploaded).get("criterion") or table.spec.criterion)
    return allocator_step(ss["eval_allocator"], table, ss["app_compensation"])


def run_criterion() -> str:
    """The criterion that chooses the run's units: the one picked, else the plan's own."""
    return plan_criterion() if ss["eval_criterion"] == PLAN_OWN else str(ss["eval_criterion"])


def asked_obs_samples() -> int | None:
    """The calibration windows a sequential criterion (``obs``) reads; None: the default count (or no such criterion)."""
    return int(ss["eval_obs_samples"]) if is_sequential(run_criterion()) and ss["eval_obs_samples"] else None


def asked_fit_samples() -> int | None:
    """The calibration windows the run's compensation is fitted on; None: the table's (or nothing is fitted)."""
    return int(ss["eval_fit_samples"]) if fitted_after_cut(run_criterion(), run_compensation()) and ss["eval_fit_samples"] else None


def asked_fit_weighting() -> str:
    """How the run's compensation counts its tokens: through the norms after o_proj and down_proj where asked and the
    model's family has them (``CompensationSettings.weighting``), else alike."""
    fitted = fitted_after_cut(run_criterion(), run_compensation())
    on = ss["eval_fit_through_norms"]
    on = fits_through_norms_by_default() if on is None else on
    return "output-norm" if fitted and on and has_output_norms(table_model_type(table)) else "tokens"


def fits_through_norms_by_default() -> bool:
    """Whether the table's model family fits through its output norms when nobody says (``family_weighting``)."""
    return family_weighting(table_model_type(table)) == "output-norm"


def window_count_input(label: str, key: str, placeholder: str, help: str) -> None:
    """A number of calibration windows a step reads, empty for its default."""
    st.number_input(label, min_value=1, max_value=LIMITS.samples, step=1, key=key, placeholder=placeholder, help=help)


def run_compensation() -> str:
    """The compensation the run applies: the one chosen, or none for a criterion that updates the
    kept columns itself (SlimGPT's ``obs``: its OBS update is its compensation)."""
    return "none" if is_sequential(run_criterion()) else ss["app_compensation"]


def missing_plan_text() -> str:
    """Why there is no planner plan to prune, and what to do (a dp run is refused, not re-planned)."""
    why = ss.get("app_plan_missing") or "No plan has been released on the Budget planner for this table and budget yet."
    return f"{why} Open the Budget planner and release a budget: Prune & evaluate prunes the plan the planner shows, never another one."


def removable_checkpoint(checkpoint: str | None) -> bool:
    """Whether deleting a run removes this checkpoint folder too: the history removes a folder
    only under the app's own checkpoints folder (`history.delete_run`)."""
    if not checkpoint:
        return False
    folder = Path(checkpoint).resolve()
    return folder.is_dir() and history.checkpoints_root().resolve() in folder.parents


def delete_question(run_id: int, checkpoint: str | None) -> str:
    """What deleting a run deletes, said before it is done."""
    if removable_checkpoint(checkpoint):
        what = f"its row in the run history and its pruned checkpoint `{checkpoint}`"
    elif checkpoint:
        what = f"its row in the run history; its checkpoint `{checkpoint}` lies outside the app's cache and is kept"
    else:
        what = "its row in the run history (it saved no checkpoint)"
    return f"Delete run {run_id}? This deletes {what}. It cannot be undone."


def delete_run(run_id: int, checkpoint: str | None) -> None:
    """Callback of the confirmed Delete: the run goes, and so does every view of it in this session."""
    removes_checkpoint = removable_checkpoint(checkpoint)
    try:
        history.delete_run(int(run_id), remove_checkpoint=True)
    except GapError as exc:
        set_message("eval_history", "error", one_line(exc))
        return
    # The page that follows must not show what is gone (its panel, its place in a comparison, the URL).
    last = ss.get("app_last_run")
    if last is not None and last.run_id == run_id:
        ss["app_last_run"] = None
    recovery = ss.get("app_last_recovery")
    if recovery is not None and recovery.run_id == run_id:
        ss["app_last_recovery"] = None
    ss["eval_compare"] = [i for i in ss["eval_compare"] if i != run_id]
    set_message("eval_history", "success", f"Deleted run {run_id}" + (" and its checkpoint." if removes_checkpoint else "."))


def speed_spread(throughput: dict) -> str | None:
    """'prefill 1.31-1.55x, decode 1.02-1.20x over 5 repeats' when the repeats were kept."""
    parts = [
        f"{kind} {low:.2f}–{high:.2f}x" for kind in ("prefill", "decode") if (span := throughput.get(f"{kind}_speedup_range")) for low, high in [span]
    ]  # fmt: skip
    repeats = len(throughput.get("prefill_speedup_repeats") or [])
    return f"Median of {repeats} interleaved repeats; range {', '.join(parts)}." if parts else None


def prefill_range(throughput: dict) -> str:
    """'range 0.95–1.31x' (the prefill speed-up's spread over its repeats), or 'no spread
    recorded': short enough for a metric's one line."""
    span = throughput.get("prefill_speedup_range")
    return f"range {span[0]:.2f}–{span[1]:.2f}x" if span else "no spread recorded"


def speed_delta(throughput: dict) -> str:
    """'range 1.02–1.54x, within noise · decode 1.10x': the spread beside the median, and whether
    dense speed (1.00x) lies inside it."""
    parts = []
    for kind in ("prefill", "decode"):
        span, median = throughput.get(f"{kind}_speedup_range"), throughput.get(f"{kind}_speedup", float("nan"))
        text = f"{median:.2f}x" if kind == "decode" else ""
        if span:
            low, high = span
            noise = ", within noise" if low <= 1.0 <= high else ""
            text = f"{text} ({low:.2f}–{high:.2f}x{noise})" if text else f"range {low:.2f}–{high:.2f}x{noise}"
        parts.append(f"decode {text}" if kind == "decode" else text)
    return " · ".join(p for p in parts if p)


def compare_runs(run_ids: list[int]) -> None:
    """Picked runs side by side with their changes against dense and against the first picked,
    and their per-layer rates overlaid."""
    ss["eval_compare"] = [i for i in ss["eval_compare"] if i in run_ids]
    st.markdown("**Compare runs**")
    st.multiselect(
        "Runs to compare (the first one picked is the reference)", run_ids[::-1], key="eval_compare", format_func=lambda i: f"run {i}"
    )
    if not ss["eval_compare"]:
        st.caption("Pick two or more runs to see them side by side.")
        return
    try:
        by_id = {record.id: record for record in history.runs()}
    except GapError as exc:
        st.error(one_line(exc))
        return
    records = [by_id[i] for i in ss["eval_compare"] if i in by_id]
    with st.container(key="eval_compare_table"):  # a static table wraps its cells: every picked run stays on screen
        st.table(runcompare.comparison_frame(records), hide_index=True)
    rates = [
        (runcompare.run_label(r), r.plan.get("attention_rates") or [], r.plan.get("mlp_rates") or []) for r in records if isinstance(r.plan, dict)
    ]  # fmt: skip
    st.plotly_chart(figures.runs_rates_figure(rates), key="eval_compare_rates", width="stretch", theme=None)


# ---- what to run ---------------------------------------------------------------------------------
chosen = planner_plan() if ss["eval_allocator"] == "dp" else None  # the plan shown below, and the one Start prunes
left, right = st.columns([1, 1], gap="large")
with left:
    st.subheader("Plan")
    st.selectbox(
        "Allocator",
        allocators,
        key="eval_allocator",
        format_func=lambda m: f"{m} — {ALLOCATOR_HELP[m]}",
        help="How the budget is spread over the layers. " + GLOSSARY["DP front"],
    )
    if ss["eval_allocator"] == UPLOADED:
        up_budget = uploaded.get("budget")
        st.caption(
            f"Uploaded plan `{RatePlan.from_dict(dict(uploaded)).content_hash()}` for {uploaded['model']}: allocator {uploaded.get('allocator')}, "
            f"budget {'not stated' if up_budget is None else f'{up_budget:.2%}'} of prunable parameters."
        )
    else:
        st.metric("Budget from the planner (of prunable parameters)", f"{budget:.2%}", help=GLOSSARY["prunable"])
        if chosen is not None:
            biases = int(chosen.params.get("bias_params", 0))
            left = int(chosen.params.get("pruned_total_with_biases", chosen.params["pruned_total"]))
            st.caption(
                f"The planner's DP plan `{chosen.content_hash()}`: removes {chosen.params['removed']:,} parameters"
                + (f", adds {biases:,} bias parameters" if biases else "")
                + f", leaves {left:,}; predicted {figures.loss_label(table.spec.objective)} {chosen.predicted_loss:+.4f}.",
                help=GLOSSARY["plan hash"],
            )
        elif ss["eval_allocator"] == "dp":
            st.warning(missing_plan_text())
        locked = ss["app_constraints"].get("locked") or {}
        if locked:
            st.caption(f"Locked layers: {', '.join(sorted(locked, key=int))}")
        st.page_link(PLANNER_PAGE, label="Change the budget on the planner", icon=":material/tune:")
    st.selectbox(
        "Compensation after the cut",
        list(COMPENSATIONS),
        key="app_compensation",
        disabled=run_compensation() != ss["app_compensation"],
        help=GLOSSARY["compensation"]
        + "\n\n"
        + COMPENSATIONS.help()
        + " The run, its checkpoint and its model card say which."
        + ("" if table.spec.compensation != "none" else " This table's cells do not include its effect on the loss."),
    )
    if run_compensation() != ss["app_compensation"]:
        st.caption("This plan's criterion updates the kept columns itself (SlimGPT's OBS update): the run adds no compensation.")
    own_label = f"{PLAN_OWN} ({plan_criterion()})"  # bound now: a widget's format_func may be called after the script run
    st.selectbox(
        "Criterion (which heads and channels go)",
        [PLAN_OWN, *CRITERIA],
        key="eval_criterion",
        format_func=lambda c: own_label if c == PLAN_OWN else CRITERIA.label(c),
        help="The plan's rates say how many heads and channels each layer loses; the criterion says which. "
        "obs prunes any plan's rates with SlimGPT's structured OBS: block by block on the pruned model, "
        "the kept columns of o_proj/down_proj updated (its own compensation).",
    )
    if is_sequential(run_criterion()):
        window_count_input(
            "OBS calibration windows",
            "eval_obs_samples",
            f"{obs_window_count(table.spec.windows.n_samples, None)} (the default)",
            "Windows of the table's calibration text and length that OBS chooses units and updates weights on "
            "(one Gram matrix per projection per block, so more than the table's are affordable); empty: the default, "
            f"{OBS_WINDOW_FACTOR}x the table's, at most {OBS_WINDOW_CAP} (chosen on held-out selection text).",
        )
    elif fitted_after_cut(run_criterion(), run_compensation()):
        window_count_input(
            "Compensation calibration windows",
            "eval_fit_samples",
            f"{fit_window_count(table_model_type(table), table.spec.windows.n_samples)} (the default)",
            "Windows of the table's calibration text and length that the compensation after the cut is fitted on "
            "(the units are still chosen on the table's); a refit solves for every kept input of a projection, so more "
            "tokens steady it. Empty: the default, the table's own windows (on Gemma 3 at least 64, chosen on "
            "held-out selection text).",
        )
        if has_output_norms(table_model_type(table)):
            if ss["eval_fit_through_norms"] is None:  # shown the family's default until the user sets it
                ss["eval_fit_through_norms"] = fits_through_norms_by_default()
            st.toggle(
                "Fit through the output norms",
                key="eval_fit_through_norms",
                help="This model normalises the outputs of o_proj and down_proj again before the residual (Gemma 3's "
                "post-norms), so an error there reaches the model divided by the size of the token's own output. On: the "
                "fit counts each token, BOS included, by the inverse mean square of its dense output there; off: every "
                "token alike. On by default for Gemma 3 (chosen on held-out selection text). The run, its checkpoint "
                "and its model card say which.",
            )
with right:
    st.subheader("Evaluation")
    extra_sources = [source for source in table.spec.windows.sources() if source not in HELDOUT_SOURCES]
    st.multiselect("Held-out text", list(HELDOUT_SOURCES) + extra_sources, key="eval_sources")
    c1, c2 = st.columns(2)
    c1.number_input("Held-out samples", min_value=1, max_value=256, step=1, key="eval_samples")
    c2.number_input("Tokens per sample", min_value=8, max_value=2048, step=8, key="eval_seq_len")
    c1, c2 = st.columns(2)
    c1.number_input("Generations", min_value=0, max_value=3, step=1, key="eval_generations")
    c2.number_input("New tokens per generation", min_value=1, max_value=128, step=1, key="eval_max_new_tokens")
    c1, c2 = st.columns(2)
    c1.toggle("Time throughput", key="eval_throughput")
    c2.toggle(
        "Save checkpoint",
        key="eval_save_checkpoint",
        help="Saves the pruned model under the cache; needed to download it on the Export page",
    )
    task_picker("eval_")

expected_caption(expected_run(eval_settings()), "run")
job_controls(
    "prune_eval", "Prune and evaluate", "eval_run", start_run, ":material/play_arrow:", "Prune & evaluate", "eval",
    type="primary", args=(chosen.to_dict() if chosen is not None else None,),
)  # fmt: skip


# ---- the latest run ------------------------------------------------------------------------------
def run_title(result) -> str:
    """'Run 3: dp at 40.00% · plan abc · compensation bias': the run a result panel shows."""
    return (
        f"Run {result.run_id}: {result.plan['allocator']} at {(result.plan.get('budget') or 0):.2%}"
        + (f" · plan `{result.plan_hash}`" if result.plan_hash else "")
        + f" · criterion {result.plan.get('criterion')}"
        + f" · compensation {fit_name((result.compensation or {}).get('mode', 'none'), (result.compensation or {}).get('weighting'))}"
    )


def params_delta(report: dict, dense: dict, biases: int) -> str:
    """'-42,432,768 vs dense · 34,560 biases added': the change, and what compensation added back."""
    change = report["params"] - dense.get("params", report["params"])
    return f"{change:+,} vs dense" + (f" · {biases:,} biases added" if biases else "")


def show_result(result) -> None:
    """One finished run's takeaway, compensation comparison, numbers, generations and checkpoint."""
    run_story.show_story(result.run_id, table)
    report = result.report
    dense = report.get("dense") or {}
    biases = int((result.compensation or {}).get("bias_params") or 0)
    c = st.columns(3)
    c[0].metric(
        "Parameters after pruning",
        f"{report['params']:,}",
        params_delta(report, dense, biases),
        delta_color="off",
        delta_arrow="off",
        help="The pruned model's parameters, the biases its compensation added included: the planner's parameters left "
        "for this plan, and the number the report and the checkpoint's model card show.",
    )
    source = next(iter(report["perplexity"]), None)
    if source:
        c[1].metric(
            f"Perplexity ({source})",
            f"{report['perplexity'][source]:.2f}",
            f"dense {dense.get('perplexity', {}).get(source, float('nan')):.2f}",
            delta_color="off",
            delta_arrow="off",
        )
        c[2].metric(
            f"Held-out KL to dense ({source})",
            f"{report.get('kl_to_dense', {}).get(source, float('nan')):.4f}",
            help=GLOSSARY["held-out KL"],
        )
    c = st.columns(3)
    predicted, actual = result.predicted_loss, result.actual_loss
    objective = result.objective
    basis = result.predicted_basis
    c[0].metric(
        f"Predicted {objective} increase ({'estimate' if basis != 'measured' else 'table'})",
        "—" if predicted is None else f"{predicted:.4f}",
        figures.BASIS_TEXT.get(basis, "table cells, summed"),
        delta_color="off",
        delta_arrow="off",
        help="The loss table's single-component increases added up: an estimate of the plan's loss, never a measurement of it.",
    )
    c[1].metric(
        "Calibration KL to dense (measured)" if objective == "kl" else f"Measured {objective} increase (calibration)",
        "—" if actual is None else f"{actual:.4f}",
        None if actual is None or predicted is None else f"{actual - predicted:+.4f} vs predicted",
        delta_color="off",
        delta_arrow="off",
        help=GLOSSARY["calibration KL"]
        if objective == "kl"
        else "Measured on the calibration windows the table was built from: "
        "the measured counterpart of the predicted increase (held-out numbers are above).",
    )
    throughput = report.get("throughput") or {}
    if throughput:
        c[2].metric(
            "Prefill speed vs dense",
            f"{throughput.get('prefill_speedup', float('nan')):.2f}x",
            prefill_range(throughput),  # a median is never shown without its spread
            help=" ".join(filter(None, [speed_spread(throughput), GLOSSARY["speed-up spread"]])),
            delta_color="off",
            delta_arrow="off",
        )
    else:
        c[2].metric("Throughput", "not timed")
    if throughput and speed_delta(throughput):
        # The spread is a sentence: under the numbers, where it wraps, not in a metric's one line.
        st.caption(f"Speed against dense: prefill {speed_delta(throughput)}.", help=GLOSSARY["speed-up spread"])
    if len(report["perplexity"]) > 1:
        st.dataframe(
            pd.DataFrame(
                {
                    "source": list(report["perplexity"]),
                    "pruned perplexity": list(report["perplexity"].values()),
                    "dense perplexity": [dense.get("perplexity", {}).get(s) for s in report["perplexity"]],
                    "held-out KL to dense": [report.get("kl_to_dense", {}).get(s) for s in report["perplexity"]],
                    "top-1 agreement": [report.get("top1_agreement", {}).get(s) for s in report["perplexity"]],
                }
            ),
            hide_index=True,
            key="eval_sources_table",
            placeholder="—",
        )
    if result.task_accuracy:
        st.markdown("**Task accuracy** (lm-eval)", help=GLOSSARY["task accuracy"])
        c = st.columns(3)
        for i, (task, score) in enumerate(result.task_accuracy.items()):
            dense_text = score_text(result.dense_task_accuracy.get(task))
            c[i % 3].metric(
                f"Accuracy ({task}, {score['n']} examples)", score_text(score), f"dense {dense_text or 'not measured'}",
                delta_color="off", delta_arrow="off", help=GLOSSARY["task accuracy"],
            )  # fmt: skip
        rows = task_table_rows([("dense", result.dense_task_accuracy), ("pruned", result.task_accuracy)])
        st.dataframe(pd.DataFrame(rows), hide_index=True, key="eval_tasks_table", placeholder="—")
    if report.get("generations"):
        st.markdown("**Greedy generations**")
        st.table(  # a static table wraps long text (a dataframe cuts it off)
            pd.DataFrame([{"prompt": g["prompt"], "dense": g.get("dense", ""), "pruned": g["model"]} for g in report["generations"]]),
            hide_index=True,
        )
    if result.checkpoint:
        st.caption(f"Checkpoint saved to `{result.checkpoint}`")


result = ss.get("app_last_run")
running = session_job("prune_eval")
if running is not None and running.active:
    # The panel names the run on screen: while a run is pruned, that one; the last finished run
    # stays one click away, under its own name.
    st.subheader(f"Running: {running.label}")
    st.caption("Its numbers appear here when it finishes; the runs before it are in the history below.")
    if result:
        with st.expander(f"Previous result: {run_title(result)}"):
            show_result(result)
elif result:
    st.subheader(run_title(result))
    show_result(result)

# ---- history -------------------------------------------------------------------------------------
# What a reader compares first, narrow enough to fit a 1366 px screen beside the sidebar; the other
# columns are one pick away (the CSV on Export has them all).
HISTORY_COLUMNS = ("id", "allocator", "budget", "compensation", "pruned_params", "accuracy (", "ppl:", "kl:", "actual_loss")
HISTORY_WIDTHS = {"id": 45, "allocator": 80, "budget": 90, "compensation": 100, "pruned_params": 115, "actual_loss": 125}


def history_columns(table: pd.DataFrame) -> list[str]:
    """The history's columns shown by default: `HISTORY_COLUMNS`, the first task's accuracy and the
    first held-out text's perplexity and KL."""
    shown = []
    for wanted in HISTORY_COLUMNS:
        found = [c for c in table.columns if c == wanted or (wanted.endswith((":", "(")) and str(c).startswith(wanted))]
        shown += found[:1]
    return shown


def show_history(frame: pd.DataFrame) -> None:
    """The run history as a table that fits the page: the key columns, and any other the reader picks."""
    table = runcompare.history_table(frame).sort_values("id", ascending=False)
    everything = list(table.columns)
    defaults = history_columns(table)
    if not ss.get("eval_history_columns") or not set(ss["eval_history_columns"]) <= set(everything):
        ss["eval_history_columns"] = defaults
    shown = [c for c in everything if c in ss["eval_history_columns"]]
    config = {figures.column_label(c): st.column_config.Column(width=w) for c, w in HISTORY_WIDTHS.items() if c in shown}
    if "budget" in shown:
        config[figures.column_label("budget")] = st.column_config.NumberColumn(format="percent", width=HISTORY_WIDTHS["budget"])
    if "pruned_params" in shown:
        config[figures.column_label("pruned_params")] = st.column_config.NumberColumn(
            format="localized", width=HISTORY_WIDTHS["pruned_params"]
        )
    st.dataframe(
        table[shown].rename(columns=figures.column_label),
        hide_index=True,
        width="stretch",
        key="eval_history_table",
        placeholder="—",
        column_config=config,
    )
    st.multiselect(
        "Columns",
        everything,
        key="eval_history_columns",
        format_func=figures.column_label,
        help="The table starts with what runs are compared by; every other recorded column can be added here "
        "(Export's run history CSV holds them all).",
    )


st.divider()
st.subheader("Run history")
try:
    frame = history.list_runs()
except GapError as exc:
    st.error(one_line(exc))
    frame = pd.DataFrame()
show_message("eval_history")
if frame.empty:
    st.caption("No runs yet: every prune-and-evaluate run is recorded here, across sessions.")
else:
    show_history(frame)
    run_ids = [int(i) for i in frame["id"]]
    shown = ss.get("app_last_run")
    run_story.show_frontier(run_ids, shown.run_id if shown is not None else None)
    metrics = [c for c in frame.columns if c.startswith(("ppl:", "kl:", "top1:", "acc:"))] + [
        "actual_loss",
        "prefill_speedup",
        "decode_speedup",
    ]
    metrics = [m for m in metrics if m in frame.columns and frame[m].notna().any()]
    if metrics:
        if ss["eval_metric"] not in metrics:
            ss["eval_metric"] = metrics[0]
        c1, c2 = st.columns(2)
        with c1:
            st.selectbox("Compare runs by", metrics, key="eval_metric", format_func=figures.column_label)
            st.plotly_chart(figures.history_figure(frame, ss["eval_metric"]), key="eval_history_chart", width="stretch", theme=None)
        with c2:
            st.markdown("**Predicted vs actual loss increase**")
            st.plotly_chart(figures.predicted_vs_actual_figure(frame), key="eval_pva_chart", width="stretch", theme=None)
    compare_runs(run_ids)
    try:
        makers = history.run_makers()
    except GapError:
        makers = {i: "" for i in run_ids}  # an unreadable history: nobody is shown as a run's maker
    deletable = [i for i in run_ids if ownership.may_control(makers.get(i))]  # a shared link deletes nothing of its sender's
    if deletable:
        c1, c2 = st.columns([3, 1], vertical_alignment="bottom")
        if ss.get("eval_delete_id") not in deletable:
            ss["eval_delete_id"] = deletable[-1]
        c1.selectbox("Run to delete", deletable[::-1], key="eval_delete_id", format_func=lambda i: f"run {i}")
        doomed = int(ss["eval_delete_id"])
        checkpoint = frame.loc[frame["id"] == doomed, "checkpoint"].iloc[0] if "checkpoint" in frame else None
        checkpoint = checkpoint if isinstance(checkpoint, str) and checkpoint else None
        ask_first(c2, "Delete run…", "eval_delete", doomed, icon=":material/delete:")
        confirmation(
            "eval_delete",
            doomed,
            delete_question(doomed, checkpoint),
            f"Delete run {doomed}" + (" and its checkpoint" if removable_checkpoint(checkpoint) else ""),
            delete_run,
            (doomed, checkpoint),
        )
    if len(deletable) < len(run_ids):
        st.caption(f"{len(run_ids) - len(deletable)} of these runs were made in another browser: only that browser can delete them.")
