"""Setup: pick the model and the calibration text, then build (or load) a loss table."""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import re

import pandas as pd
import streamlit as st

from explorer import ownership
from explorer.confirm import ask_first, confirmation
from explorer.glossary import GLOSSARY
from explorer.job_panel import job_controls
from explorer.job_text import duration_text, expected_caption
from explorer.messages import clear_message, set_message
from explorer.session_jobs import remember_job
from explorer.session_keys import init_page
from explorer.table_state import current_table, set_table
from gap_engine.core.config import (
    APP_TABLE,
    DEFAULT_CHANNEL_MULTIPLE,
    DEFAULT_CRITERION,
    DEFAULT_MODEL,
    WindowSpec,
)
from gap_engine.core.device import DTYPE_CHOICES, DeviceSpec, available_devices, dtype_name, resolve
from gap_engine.core.errors import DataError, GapError, one_line
from gap_engine.core.fsutil import atomic_write_bytes, cache_root
from gap_engine.core.limits import LIMITS, check_at_most, check_file_size, check_windows
from gap_engine.data.windows import BUILTIN_SOURCES, load_corpus
from gap_engine.model.loading import BUILTIN_MODELS
from gap_engine.model.names import recorded_name
from gap_engine.pipeline.cost_model import Prediction, predict_build, table_prediction
from gap_engine.pipeline.jobs import manager, model_loaded, table_task
from gap_engine.prune.criteria import SCORING_CRITERIA
from gap_engine.tables import cache, lookup
from gap_engine.tables.artefact import TableSpec, key_prefix, parse_rate_grid
from gap_engine.tables.estimators import ESTIMATORS
from gap_engine.tables.objectives import OBJECTIVES
from gap_engine.views.estimate_text import estimate_lines

MODEL_KINDS = ("Built-in", "Local folder", "Hub id")
DATA_KINDS = ("Built-in sample", "Uploaded file")
DEFAULTS = {
    "setup_model_kind": "Built-in",
    "setup_builtin": DEFAULT_MODEL,
    "setup_local_path": "",
    "setup_hub_id": "",
    "setup_data_kind": "Built-in sample",
    "setup_builtin_data": "wiki-sample",
    "setup_mixed_data": [],  # more built-in samples whose windows the calibration shares, in order
    "setup_uploaded_path": "",
    "setup_criterion": DEFAULT_CRITERION,
    "setup_objective": APP_TABLE.objective,
    "setup_mode": "split",
    "setup_estimator": APP_TABLE.estimator,
    "setup_rate_grid": ", ".join(f"{r:g}" for r in APP_TABLE.rate_grid),
    "setup_samples": APP_TABLE.windows.n_samples,
    "setup_seq_len": APP_TABLE.windows.seq_len,
    "setup_seed": APP_TABLE.windows.seed,
    "setup_batch": APP_TABLE.windows.batch_size,
    "setup_channel_multiple": DEFAULT_CHANNEL_MULTIPLE,
    "setup_device": "auto",
    "setup_dtype": "auto",
    "setup_stream": False,
    "setup_ray": False,
}
RAY_ADDRESS_ENV = "GAP_RAY_ADDRESS"  # a configured Ray cluster ("local" for one on this machine) offers --ray here
init_page("setup_", DEFAULTS)
ss = st.session_state


def model_name() -> str:
    kind = ss["setup_model_kind"]
    if kind == "Built-in":
        return ss["setup_builtin"]
    return (ss["setup_local_path"] if kind == "Local folder" else ss["setup_hub_id"]).strip()


def data_source() -> str:
    if ss["setup_data_kind"] == "Built-in sample":
        first = ss["setup_builtin_data"]
        return ",".join([first, *(name for name in ss["setup_mixed_data"] if name != first)])
    return ss["setup_uploaded_path"]


def save_upload(uploaded) -> str:
    """Store an uploaded text file under the cache (named by content) and return its path."""
    check_file_size(uploaded.size, LIMITS.upload_bytes, uploaded.name, DataError)  # before reading it
    data = uploaded.getvalue()
    suffix = ".jsonl" if uploaded.name.lower().endswith(".jsonl") else ".txt"
    stem = re.sub(r"[^A-Za-z0-9._-]+", "_", uploaded.name.rsplit(".", 1)[0])[:40] or "upload"
    path = cache_root() / "uploads" / f"{hashlib.sha256(data).hexdigest()[:12]}-{stem}{suffix}"
    if not path.is_file():
        atomic_write_bytes(path, data)
    return str(path)


def spec_from_widgets() -> TableSpec:
    """The TableSpec the form describes; TableError (one line) when a value is unusable."""
    windows = WindowSpec(
        data=data_source(),
        n_samples=int(ss["setup_samples"]),
        seq_len=int(ss["setup_seq_len"]),
        seed=int(ss["setup_seed"]),
        batch_size=int(ss["setup_batch"]),
    )
    check_windows(windows.n_samples, windows.seq_len, windows.batch_size, ("Calibration samples", "Tokens per sample", "Batch size"))
    rate_grid = parse_rate_grid(ss["setup_rate_grid"])
    check_at_most(len(rate_grid), LIMITS.rates, f"Rates lists {len(rate_grid):,} rates, which")  # each is a column of cells to measure
    return TableSpec(
        windows=windows,
        criterion=ss["setup_criterion"],
        rate_grid=rate_grid,
        objective=ss["setup_objective"],
        mode=ss["setup_mode"],
        estimator=ss["setup_estimator"],
        channel_multiple=int(ss["setup_channel_multiple"]),
    ).validate()


def start_build() -> None:
    """Button callback: validate the form and start (or attach to) the table job."""
    clear_message("setup")
    name = model_name()
    if not name:
        set_message("setup", "error", "Enter a model: a local folder path or a hub id like 'org/name'.")
        return
    if ss["setup_data_kind"] == "Uploaded file" and not ss["setup_uploaded_path"]:
        set_message("setup", "error", "Upload a .txt or .jsonl calibration file first (or pick a built-in sample).")
        return
    try:
        spec = spec_from_widgets()
    except GapError as exc:
        set_message("setup", "error", one_line(exc))
        return
    device = device_from_widgets()
    try:
        cached = lookup.find_table(name, spec, device)  # before any model loads or text is read
    except GapError:
        cached = None  # a device this machine lacks: the job says so
    if cached is not None:
        set_table(cached)
        set_message("setup", "success", f"Loaded the cached table {cached.key} (found without loading the model).")
        return
    cells = None
    if ss["setup_ray"] and os.environ.get(RAY_ADDRESS_ENV):
        if spec.estimator != "exact":
            set_message(
                "setup",
                "error",
                f"Ray workers measure exact cells; the {spec.estimator} estimate is one gradient pass in one process: choose exact, or untick Ray.",
            )
            return
        from gap_engine.tables.distributed import RayCells, RaySettings

        address = os.environ[RAY_ADDRESS_ENV]
        cells = RayCells(RaySettings(address=None if address == "local" else address))
    job_key = name + "|" + json.dumps(spec.summary(), sort_keys=True) + f"|{device}"
    expected = expected_build(name, spec)
    job = manager().submit(
        "table",
        table_task(name, spec, device, cells, expected),
        key=job_key,
        label=f"{spec.estimator} table of {name}",
        params={"model": name, "spec": spec.to_dict(), "device": str(device)},
        owner=ownership.owner(),
    )
    remember_job("table", job)


def device_from_widgets() -> DeviceSpec:
    return DeviceSpec(ss["setup_device"], ss["setup_dtype"], bool(ss["setup_stream"]))


def show_prediction() -> None:
    """What the build will cost, shown before Build: at once when this machine's speed is
    cached, else after one click (nothing when the form is not valid yet)."""
    name = model_name()
    if not name:
        return
    # A callback, not the button's return value: a rerun of the app before this line would drop the click.
    st.button(
        "Estimate time and memory",
        key="setup_estimate",
        help="Measures this machine (a few seconds) and keeps its speed for later estimates; click again to measure again",
        on_click=lambda: ss.update(setup_calibrate=True),
    )
    calibrate = bool(ss.pop("setup_calibrate", False))
    if ss["setup_model_kind"] == "Hub id" and not calibrate:
        return  # reading a hub config may wait on the network: only when asked
    try:
        workers = 2 if ss["setup_ray"] and os.environ.get(RAY_ADDRESS_ENV) else 1
        with st.spinner("Measuring this machine's speed for the estimate (about 15 s) ...") if calibrate else contextlib.nullcontext():
            estimate = predict_build(name, spec_from_widgets(), device_from_widgets(), workers, measure=False, refresh=calibrate)
    except Exception as exc:  # a config the hub cannot give offline, a bad value: one line, never a traceback
        st.caption(f"No estimate: {one_line(exc)}")
        return
    if estimate is not None:
        lines = estimate_lines(estimate)
        st.caption("  \n".join(lines[:2]), help="\n\n".join(lines[2:]))


def expected_build(name: str, spec: TableSpec) -> Prediction | None:
    """What building ``spec`` for ``name`` is predicted to take here, stage by stage
    (``pipeline.cost_model.table_prediction``: this machine's measured prices, else nominal ones); a
    table the cache holds is priced as the cache hit it is; the running job's own rates replace it.
    None when nothing honest can be said (a hub id, an accelerator nobody measured)."""
    if ss["setup_model_kind"] == "Hub id":
        return None  # its config may wait on the network
    try:
        device = device_from_widgets()
        recorded = recorded_name(name)  # tables record a local folder by its absolute path
        prefix = key_prefix(recorded, dtype_name(resolve(device).dtype), spec)
        summary, rows = spec.summary(), cache.list_tables()
        cached = any(r.get("model") == recorded and r.get("spec") == summary and str(r.get("key", "")).startswith(prefix) for r in rows)
        return table_prediction(name, spec, device, loaded=model_loaded(name, device), cached=cached)
    except Exception:  # a device this machine lacks, an unreadable config: Build says what is wrong
        return None


def show_expected_time() -> None:
    """The expected time of the build the form describes, shown before Build is pressed."""
    name = model_name()
    try:
        spec = spec_from_widgets()
    except GapError:
        return  # the Build button says what is wrong
    if not name:
        return
    expected_caption(expected_build(name, spec), "build")


def load_cached(key: str) -> None:
    """Callback: make a cached table the current one."""
    clear_message("setup")
    try:
        table = cache.get_table(key)
    except GapError as exc:
        set_message("setup", "error", one_line(exc))
        return
    if table is None:
        set_message("setup", "error", f"The cached table {key} is gone or was corrupt; build it again.")
        return
    set_table(table)
    set_message("setup", "success", f"Loaded cached table {key}.")


def delete_cached(key: str) -> None:
    clear_message("setup")
    try:
        cache.remove_table(key)
    except GapError as exc:
        set_message("setup", "error", one_line(exc))
        return
    current = current_table()
    if current is not None and current.key == key:
        set_message("setup", "warning", f"Deleted {key} from the cache; it stays loaded in this session.")
    else:
        set_message("setup", "success", f"Deleted {key} from the cache.")


def cached_frame(rows: list[dict]) -> pd.DataFrame:
    """The cached tables, one row each, in few columns: the whole of it fits a 1366 px screen."""
    records = []
    for row in rows:
        spec = row.get("spec") or {}
        grid = spec.get("rate_grid") or []
        seconds = row.get("build_seconds")
        records.append(
            {
                "key": row["key"],
                "model": row.get("model") or "—",
                "table": " · ".join(str(spec.get(name) or "?") for name in ("estimator", "objective", "mode", "criterion")),
                "calibration": f"{spec.get('n_samples')} x {spec.get('seq_len')} tokens of {spec.get('data')}",
                "rates": f"{len(grid)}, up to {max(grid):g}" if grid else "—",
                "built": (row.get("created") or "")[:16].replace("T", " ")
                + ("" if not isinstance(seconds, (int, float)) else f" in {duration_text(seconds)}"),
            }
        )
    return pd.DataFrame(records)


# ---- page ----------------------------------------------------------------------------------
st.title("Setup")
st.caption(
    "Pick a model and calibration text, then measure the per-layer sensitivity table that the budget planner uses. "
    "Tables are cached: a table built once loads instantly afterwards."
)

try:
    cached_rows = cache.list_tables()
except GapError as exc:
    cached_rows = []
    st.error(one_line(exc))

left, right = st.columns(2, gap="large")
with left:
    st.subheader("Model")
    st.radio("Model source", MODEL_KINDS, key="setup_model_kind", horizontal=True)
    if ss["setup_model_kind"] == "Built-in":
        st.selectbox(
            "Built-in model",
            list(BUILTIN_MODELS),
            key="setup_builtin",
            format_func=lambda n: f"{n} — {BUILTIN_MODELS[n].description.split('(')[0].strip()}",
        )
        st.caption(BUILTIN_MODELS[ss["setup_builtin"]].description)
    elif ss["setup_model_kind"] == "Local folder":
        st.text_input("Model folder (with config.json, or a gap checkpoint)", key="setup_local_path", placeholder="/path/to/model")
    else:
        st.text_input("Hugging Face hub id", key="setup_hub_id", placeholder="HuggingFaceTB/SmolLM2-135M")
        st.caption("Hub ids need the model in the local Hugging Face cache or network access.")

    st.subheader("Calibration text")
    st.radio("Source", DATA_KINDS, key="setup_data_kind", horizontal=True)
    if ss["setup_data_kind"] == "Built-in sample":
        st.selectbox("Sample", list(BUILTIN_SOURCES), key="setup_builtin_data", format_func=lambda n: n)
        st.caption(BUILTIN_SOURCES[ss["setup_builtin_data"]])
        st.multiselect(
            "Mixed with",
            list(BUILTIN_SOURCES),
            key="setup_mixed_data",
            help="More samples to calibrate on: the calibration windows are divided among the samples in the order "
            "named (the one above first; a sample named twice counts once).",
        )
    else:
        uploaded = st.file_uploader(
            'A .txt file (documents separated by blank lines) or .jsonl (one {"text": ...} per line)',
            type=["txt", "jsonl"],
            key="setup_upload",
        )
        if uploaded is not None:
            try:
                path = save_upload(uploaded)
                corpus = load_corpus(path)
            except GapError as exc:
                ss["setup_uploaded_path"] = ""
                st.error(one_line(exc))
            else:
                ss["setup_uploaded_path"] = path
                st.success(f"{uploaded.name}: {len(corpus.calibration)} calibration and {len(corpus.heldout)} held-out documents.")
        elif ss["setup_uploaded_path"]:
            st.caption(f"Using the earlier upload {ss['setup_uploaded_path']}")


def _objective_for_estimator() -> None:
    # The first-order (taylor) estimate of KL is identically zero: taylor tables measure NLL.
    if ss["setup_estimator"] == "taylor" and ss["setup_objective"] == "kl":
        ss["setup_objective"] = "nll"


with right:
    st.subheader("Loss table")
    st.radio(
        "Estimator (how the table is filled)",
        ESTIMATORS.names,
        key="setup_estimator",
        format_func=ESTIMATORS.label,
        on_change=_objective_for_estimator,
        help=f"{GLOSSARY['fisher']}\n\n{GLOSSARY['taylor']} Choosing taylor sets the objective to nll (its KL estimate is zero).",
    )
    c1, c2, c3 = st.columns(3)
    c1.selectbox(
        "Criterion (which units go)",
        SCORING_CRITERIA.names,
        key="setup_criterion",
        help=f"{GLOSSARY['criterion']}\n\n{GLOSSARY['wanda']}\n\n{SCORING_CRITERIA.help()}",
    )
    # Again on every run, not only in the radio's callback: a widget changed right after the radio sends the objective's
    # stale "kl" with its rerun, which would undo the callback's nll.
    _objective_for_estimator()
    c2.selectbox("Objective", OBJECTIVES.names, key="setup_objective", help=f"{OBJECTIVES.help()}\n\nBoth in {GLOSSARY['nats/token']}")
    c3.selectbox("Components", ("split", "block"), key="setup_mode", help=GLOSSARY["split"])
    st.text_input("Rate grid (comma-separated, starting at 0)", key="setup_rate_grid")
    c1, c2, c3 = st.columns(3)
    c1.number_input("Calibration samples", min_value=1, max_value=512, step=1, key="setup_samples")
    c2.number_input("Tokens per sample", min_value=8, max_value=4096, step=8, key="setup_seq_len")
    c3.number_input("Seed", min_value=0, max_value=2**31 - 1, step=1, key="setup_seed")
    with st.expander("Advanced"):
        c1, c2 = st.columns(2)
        c1.number_input("Batch size (memory only)", min_value=1, max_value=64, step=1, key="setup_batch")
        c2.number_input("MLP channels kept in multiples of", min_value=1, max_value=256, step=1, key="setup_channel_multiple")
        c1, c2, c3 = st.columns(3)
        c1.selectbox("Device", available_devices(), key="setup_device", help="auto: the accelerator when there is one, else the CPU")
        c2.selectbox("Precision", DTYPE_CHOICES, key="setup_dtype", help="auto: bfloat16 on an accelerator, float32 on the CPU")
        c3.checkbox(
            "Stream blocks",
            key="setup_stream",
            help="keep the model on the host, one block at a time on the device (models larger than the accelerator)",
        )
        if os.environ.get(RAY_ADDRESS_ENV):
            st.checkbox(
                f"Measure cells on Ray ({os.environ[RAY_ADDRESS_ENV]})",
                key="setup_ray",
                help="exact tables only: each worker measures the cells of a range of layers",
            )

    show_prediction()

    show_expected_time()
    job_controls(
        "table",
        "Build table",
        "setup_build",
        start_build,
        ":material/play_arrow:",
        "Building the loss table",
        "setup",
        type="primary",
        help="Reads the cache first: an identical table loads at once.",
    )

st.divider()
st.subheader("Current table")
table = current_table()
if table is None:
    st.info("No table loaded yet. Build one above, or load a cached one below.")
else:
    spec = table.spec
    c1, c2, c3, c4 = st.columns([2, 1, 1, 1])
    c1.metric("Model", table.model)
    c2.metric("Components x rates", f"{table.delta.shape[0]} x {table.delta.shape[1]}")
    if spec.objective == "nll":
        c3.metric(
            "Dense perplexity",
            f"{math.exp(table.dense_objective):.2f}",
            f"NLL {table.dense_objective:.4f} nats/token",
            delta_color="off",
            delta_arrow="off",
            help=GLOSSARY["dense objective"],  # it says "on the calibration windows"
        )
    else:  # KL of the dense model to itself is 0: no headline, the objective said in words
        c3.metric("Objective", "KL to dense", help=GLOSSARY["dense objective"])
    job_seconds = ss.get("app_table_job_seconds", {}).get(table.key)
    if job_seconds is not None:  # built by this session: the job's own time, as its message says
        c4.metric(
            "Build time",
            duration_text(job_seconds),
            help=f"The whole job; measuring the table took {duration_text(table.build_seconds)} of it.",
        )
    else:
        c4.metric(
            "Build time",
            duration_text(table.build_seconds),
            help="Measuring the table when it was built (loading the model and reading the text not included).",
        )
    st.caption(
        f"`{table.key}` · {spec.estimator} · {spec.objective} · {spec.mode} · criterion {spec.criterion} · "
        f"{spec.windows.data} · {spec.windows.n_samples} x {spec.windows.seq_len} tokens · rates {', '.join(f'{r:g}' for r in table.rate_grid)}"
    )

st.subheader("Cached tables")
if not cached_rows:
    st.caption("The cache holds no finished table yet.")
else:
    frame = cached_frame(cached_rows)
    with st.container(key="setup_cached_table"):  # a static table wraps its cells: no column runs off the screen
        st.table(frame, hide_index=True)
    keys = list(frame["key"])
    if ss.get("setup_cached_key") not in keys:
        ss["setup_cached_key"] = keys[-1]
    c1, c2, c3 = st.columns([4, 1, 1], vertical_alignment="bottom")
    c1.selectbox("Cached table", keys, key="setup_cached_key")
    c2.button("Load", key="setup_load", on_click=load_cached, args=(ss["setup_cached_key"],), icon=":material/upload:")
    doomed = ss["setup_cached_key"]
    ask_first(c3, "Delete…", "setup_delete", doomed, icon=":material/delete:")
    current = current_table()
    confirmation(
        "setup_delete",
        doomed,
        f"Delete the loss table `{doomed}` from the cache? Building it again takes the build's time."
        + (" It stays loaded in this session until another table is." if current is not None and current.key == doomed else ""),
        "Delete this table",
        delete_cached,
        (doomed,),
    )
