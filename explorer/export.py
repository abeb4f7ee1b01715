"""Export: the plan, the table, the run history, pruned checkpoints and charts; import a plan."""

from __future__ import annotations

import json
from pathlib import Path

import streamlit as st

from explorer import report_export
from explorer.glossary import GLOSSARY
from explorer.job_text import duration_text
from explorer.png_export import render_png
from explorer.session_keys import init_page
from explorer.table_state import current_table, reference_model
from gap_engine.core.config import GGUF_OUTTYPES
from gap_engine.core.errors import GapError, PlanError, one_line
from gap_engine.core.limits import LIMITS, check_file_size
from gap_engine.core.validate import decode_text
from gap_engine.evaluate import history
from gap_engine.evaluate.takeaway import run_story, takeaway
from gap_engine.export import gguf
from gap_engine.model.rateplan import RatePlan, predicted_params
from gap_engine.model.remote_code import MODELING_FILE
from gap_engine.pipeline.cost_gguf import gguf_file, gguf_prediction
from gap_engine.views import figures

DEFAULTS = {
    "export_plan_source": "planner",
    "export_checkpoint_run": None,
    "export_gguf_outtype": "q8_0",
    "export_png": {},
    "export_png_error": "",
    "export_png_view": "",
}
CHART_LABELS = {"pred_vs_actual": "predicted vs actual", "history": "run history", "frontier": "measured frontier"}
CHART_COLUMNS = 3
# What trust_remote_code=True runs when transformers loads a checkpoint of this app: said where the
# load line is given, so nobody has to trust code they were not told about.
REMOTE_CODE_NOTE = (
    f"**What `trust_remote_code=True` runs.** The one Python file it lets transformers import is gap's own "
    f"`{MODELING_FILE}`, copied into the checkpoint beside `config.json` (whose `auto_map` names its classes). "
    "It imports only torch and transformers, subclasses the model family's own transformers classes, and "
    "replaces each block's q/k/v/o and gate/up/down projections with narrower linears of the widths "
    "`config.json` records per layer (with the output biases bias compensation added); attention, rotary "
    "embeddings, the KV cache and generation stay transformers' own code. It reads no other file, starts no "
    "process and opens no network connection, and nothing else in the folder is code. gap itself never runs "
    "it: gap loads its checkpoints with its own classes and trust_remote_code=False."
)
init_page("export_", DEFAULTS)
ss = st.session_state
table = current_table()


def chart_figures() -> dict:
    """Name -> figure of every chart the app draws for the current table and history."""
    out = {}
    if table is not None:
        out["sensitivity"] = figures.sensitivity_figure(table)
        out["heatmap"] = figures.heatmap_figure(table)
        try:
            out["planner"] = report_export.planner_export_figure(table)
        except GapError:
            pass  # the planner page says why; the other charts still export
    runs = history.list_runs()
    perplexities = [c for c in runs.columns if c.startswith("ppl:")]
    if not runs.empty and perplexities:
        out["history"] = figures.history_figure(runs, perplexities[0])
    if not runs.empty:
        out["pred_vs_actual"] = figures.predicted_vs_actual_figure(runs)
        try:
            story = run_story(history.runs(), int(runs["id"].iloc[-1]))  # the latest run's windows
        except GapError:
            story = None
        if story is not None and story.frontier:
            out["frontier"] = figures.measured_frontier_figure(story.frontier, story.dense)
    return out


def chart_view() -> str:
    """What the charts show (table, released budget and plan): PNGs rendered for another view are dropped."""
    return f"{table.key if table is not None else ''}|{float(ss.get('app_budget') or 0):.6f}|{ss.get('app_plan_hash')}"


def render_pngs(names_and_figs: dict) -> None:
    """Render every chart to PNG with kaleido (headless Chromium); keep the bytes for download."""
    ss["export_png"], ss["export_png_error"], ss["export_png_view"] = {}, "", chart_view()
    try:
        ss["export_png"] = render_png(names_and_figs)
    except Exception as exc:  # kaleido raises many kinds when no browser can start
        ss["export_png"] = {}
        ss["export_png_error"] = one_line(exc)


def checkpoint_dtype(folder: str) -> str:
    """The storage precision a checkpoint records (float32 for folders saved before it did)."""
    try:
        return json.loads((Path(folder) / "gap_pruned.json").read_text()).get("dtype", "float32")
    except (OSError, ValueError):
        return "an unknown precision"


def render_gguf_download(folder: str) -> None:
    """The checkpoint as a llama.cpp GGUF file (built when clicked), or why it cannot be one."""
    problem = gguf.gguf_problem(folder)
    c1, c2 = st.columns([3, 1], vertical_alignment="bottom")
    c1.selectbox("GGUF weight type", GGUF_OUTTYPES, key="export_gguf_outtype", disabled=problem is not None)
    outtype = ss["export_gguf_outtype"]
    c2.download_button(
        "Checkpoint (GGUF)",
        data=lambda: gguf_file(folder, outtype),  # built only when clicked (seconds); its time teaches the next prediction
        file_name=f"{Path(folder).name}-{outtype}.gguf",
        mime="application/octet-stream",
        key="export_checkpoint_gguf",
        on_click="ignore",  # a rerun while the file is being built would drop it
        icon=":material/memory:",
        disabled=problem is not None,
        help=problem or "llama.cpp's deci architecture with per-layer widths; run it with flash attention on",
    )
    predicted = None if problem is not None else gguf_prediction(folder, outtype)
    if predicted is not None:
        st.caption(
            f"Building the {outtype} GGUF file takes about {duration_text(predicted.total)} ({predicted.basis}; "
            f"{predicted.where}): the download starts once it is built."
        )


def check_uploaded_plan(uploaded) -> None:
    try:
        check_file_size(uploaded.size, LIMITS.plan_bytes, uploaded.name, PlanError)  # before reading it
        text = decode_text(uploaded.getvalue(), uploaded.name, PlanError)
        plan = RatePlan.from_text(text, hint=uploaded.name)  # the CLI's checks: no aliases, bounded depth, typed fields
    except GapError as exc:
        st.error(f"Cannot read the plan: {one_line(exc)}")
        return
    model = table.model if table is not None else ss.get("app_model")
    if model is None:
        st.warning("Load a loss table on Setup first, so the plan can be checked against its model.")
        return
    try:
        reference = reference_model(model)
        plan.check_model(reference)
    except GapError as exc:
        ss["app_uploaded_plan"] = None
        st.error(f"This plan does not fit the current model: {one_line(exc)}")
        return
    ss["app_uploaded_plan"] = plan.to_dict()
    # Counted from the model's geometry, not read from the file: a plan's own counts may be stale or made up.
    counts = predicted_params(reference, plan.attention_rates, plan.mlp_rates, plan.channel_multiple)
    st.success(
        f"Plan for {plan.model} accepted ({plan.allocator}, removes {counts['removed_fraction_of_prunable']:.2%} of prunable "
        "parameters). Pick 'uploaded plan' on Prune & evaluate to run it."
    )


st.title("Export")

# ---- plan ----------------------------------------------------------------------------------------
st.subheader("Rate plan")
try:
    runs = history.runs()
except GapError as exc:
    st.error(one_line(exc))
    runs = []
sources = {}
if ss.get("app_plan"):
    plan = ss["app_plan"]
    sources["planner"] = f"Planner selection: dp at {plan.get('budget', 0):.2%}, plan {ss.get('app_plan_hash')}"
for record in runs[::-1]:
    run_hash = (record.params or {}).get("plan_hash")
    sources[f"run-{record.id}"] = (
        f"Run {record.id}: {record.allocator} at {(record.budget or 0):.2%}"
        + (f", plan {run_hash}" if run_hash else "")
        + f" ({record.created})"
    )
if ss.get("app_plan_missing"):
    st.warning(ss["app_plan_missing"])
if not sources:
    st.caption("No plan yet: choose a budget on the Budget planner, or run Prune & evaluate.")
else:
    if ss["export_plan_source"] not in sources:
        ss["export_plan_source"] = next(iter(sources))
    st.selectbox("Plan", list(sources), key="export_plan_source", format_func=sources.get)
    chosen = ss["export_plan_source"]
    plan_dict = ss["app_plan"] if chosen == "planner" else next(r.plan for r in runs if f"run-{r.id}" == chosen)
    plan = RatePlan.from_dict(dict(plan_dict))
    stem = f"plan-{plan.allocator}-{(plan.budget or 0) * 100:.2f}pct-{plan.content_hash()}"  # the budget and identity the app shows
    st.caption(f"Plan `{plan.content_hash()}` · budget {(plan.budget or 0):.2%} of prunable parameters.", help=GLOSSARY["plan hash"])
    c1, c2, c3 = st.columns(3)
    # Every download on this page ignores the click for reruns: a rerun replaces the files built on
    # click, so the report clicked right after the plan asked for one the rerun had just dropped.
    c1.download_button(
        "Plan (JSON)",
        plan.to_json(),
        file_name=f"{stem}.json",
        mime="application/json",
        key="export_plan_json",
        on_click="ignore",
        icon=":material/download:",
    )
    c2.download_button(
        "Plan (YAML)",
        plan.to_yaml(),
        file_name=f"{stem}.yaml",
        mime="application/x-yaml",
        key="export_plan_yaml",
        on_click="ignore",
        icon=":material/download:",
    )
    problem = report_export.report_problem(table, plan_dict)
    run_id = report_export.run_of_plan(plan_dict) if chosen == "planner" else int(chosen.split("-", 1)[1])
    if run_id is None:
        st.caption("This plan has no measured run yet: Prune & evaluate measures it, and its takeaway appears here and in the report.")
    else:
        try:
            st.info(takeaway(runs, run_id).text, icon=":material/campaign:")
        except GapError as exc:
            st.caption(f"No takeaway: {one_line(exc)}")
    c3.download_button(
        "Download report (HTML)",
        data=lambda: report_export.report_html(table, plan_dict, run_id),  # built only when clicked
        file_name=f"gap-report-{'planner' if chosen == 'planner' else f'run{run_id}'}-{stem}.html",  # two reports never share a name
        mime="text/html",
        key="export_report_html",
        on_click="ignore",  # a rerun while the file is being built would drop it
        icon=":material/summarize:",
        disabled=problem is not None,
        help=problem
        or "One self-contained HTML file: table settings, sensitivity, the plan against the DP front, "
        "and the run's numbers and generations. Opens offline.",
    )

# ---- table and history ---------------------------------------------------------------------------
st.subheader("Loss table and run history")
c1, c2, c3 = st.columns(3)
if table is not None:
    c1.download_button(
        "Loss table (CSV)",
        table.to_csv(),
        file_name=f"{table.key}.csv",
        mime="text/csv",
        key="export_table_csv",
        on_click="ignore",
        icon=":material/table:",
    )
    c2.download_button(
        "Loss table (JSON)",
        table.to_json(),
        file_name=f"{table.key}.json",
        mime="application/json",
        key="export_table_json",
        on_click="ignore",
        icon=":material/data_object:",
    )
else:
    c1.caption("No loss table loaded.")
try:
    history_csv = history.to_csv()
except GapError as exc:
    history_csv = None
    st.error(one_line(exc))
if history_csv is not None:
    c3.download_button(
        "Run history (CSV)",
        history_csv,
        file_name="gap-run-history.csv",
        mime="text/csv",
        key="export_history_csv",
        on_click="ignore",
        icon=":material/history:",
    )

# ---- checkpoints ---------------------------------------------------------------------------------
st.subheader("Pruned checkpoint")
with_checkpoint = [r for r in runs if r.checkpoint and Path(r.checkpoint).is_dir()]
if not with_checkpoint:
    st.caption("No saved checkpoint: run Prune & evaluate with 'Save checkpoint' on.")
else:
    ids = [r.id for r in with_checkpoint][::-1]
    if ss["export_checkpoint_run"] not in ids:
        ss["export_checkpoint_run"] = ids[0]
    by_id = {r.id: r for r in with_checkpoint}
    c1, c2 = st.columns([3, 1], vertical_alignment="bottom")
    c1.selectbox(
        "Run",
        ids,
        key="export_checkpoint_run",
        format_func=lambda i: f"Run {i}: {by_id[i].allocator} at {(by_id[i].budget or 0):.2%} — {Path(by_id[i].checkpoint).name}",
    )
    folder = by_id[ss["export_checkpoint_run"]].checkpoint
    size_mb = sum(p.stat().st_size for p in Path(folder).rglob("*") if p.is_file()) / 1e6
    c2.download_button(
        "Checkpoint (zip)",
        data=lambda: history.checkpoint_zip(folder),  # built only when clicked
        file_name=f"{Path(folder).name}.zip",
        mime="application/zip",
        key="export_checkpoint_zip",
        on_click="ignore",
        icon=":material/folder_zip:",
        help=f"{size_mb:.0f} MB: weights in {checkpoint_dtype(folder)}, tokenizer, plan, model card and the modeling file for transformers",
    )
    render_gguf_download(folder)
    st.caption(
        f"`{folder}` ({size_mb:.0f} MB) — gap: `gap_engine.model.loading.load_model`; transformers: "
        "`AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)`; llama.cpp: the GGUF file "
        "(`Llama(path, flash_attn=True)`). The folder's README.md says more."
    )
    st.info(REMOTE_CODE_NOTE, icon=":material/code:")

# ---- charts --------------------------------------------------------------------------------------
st.subheader("Charts")
charts = chart_figures()
if ss["export_png"] and ss["export_png_view"] != chart_view():
    ss["export_png"] = {}  # rendered at another budget or plan: never hand out a stale chart
if not charts:
    st.caption("No charts yet: load a table first.")
else:
    columns = st.columns(CHART_COLUMNS)  # a few per row: labels stay whole on a narrow window
    for i, (name, fig) in enumerate(charts.items()):
        columns[i % CHART_COLUMNS].download_button(
            f"{CHART_LABELS.get(name, name)} (HTML)",
            # plotly.js inlined: opens offline. No auto-play: playing the planner's slider frames on
            # load left the file at another budget than the one it was exported at.
            data=lambda fig=fig: fig.to_html(include_plotlyjs=True, full_html=True, auto_play=False),
            file_name=f"gap-{name}.html",
            mime="text/html",
            key=f"export_html_{name}",
            on_click="ignore",
            icon=":material/code:",
        )
    st.button(
        "Render PNG images",
        key="export_render_png",
        on_click=render_pngs,
        args=(charts,),
        icon=":material/image:",
        help="Runs kaleido with the headless Chromium at /usr/bin/chromium (a few seconds)",
    )
    if ss["export_png_error"]:
        st.warning(
            f"PNG export is not available here ({ss['export_png_error']}). It needs kaleido and a Chromium browser "
            "(set BROWSER_PATH); the HTML files above always work and can be saved as PNG from the browser."
        )
    if ss["export_png"]:
        columns = st.columns(CHART_COLUMNS)
        for i, (name, png) in enumerate(ss["export_png"].items()):
            columns[i % CHART_COLUMNS].download_button(
                f"{CHART_LABELS.get(name, name)} (PNG)",
                png,
                file_name=f"gap-{name}.png",
                mime="image/png",
                key=f"export_png_{name}",
                on_click="ignore",
                icon=":material/image:",
            )

# ---- import --------------------------------------------------------------------------------------
st.subheader("Import a plan")
uploaded = st.file_uploader("A plan file (JSON or YAML) to prune with", type=["json", "yaml", "yml"], key="export_plan_upload")
if uploaded is not None:
    check_uploaded_plan(uploaded)
elif ss.get("app_uploaded_plan"):
    st.caption(f"An uploaded plan for {ss['app_uploaded_plan']['model']} is ready on Prune & evaluate.")
