"""What the pages say about a job's time: durations, a progress line, its predicted total."""

from __future__ import annotations

import streamlit as st


def duration_text(seconds: float) -> str:
    """'42 s', '2 min 05 s' or '1 h 02 min'."""
    seconds = int(round(max(0.0, seconds)))
    if seconds >= 3600:
        return f"{seconds // 3600} h {seconds % 3600 // 60:02d} min"
    return f"{seconds // 60} min {seconds % 60:02d} s" if seconds >= 60 else f"{seconds} s"


def progress_text(snap: dict, title: str) -> str:
    """One line for a running job: its stage, the stage's steps, the time left and the time so far."""
    if snap["status"] == "queued":
        return f"{title}: waiting for another job to finish"
    where = snap["message"] or "starting"
    if snap["stages"] and snap["stage_index"] >= 0:
        stage = snap["stage"]
        detail = f": {snap['message']}" if snap["message"] and snap["message"] != stage else ""
        where = f"stage {snap['stage_index'] + 1} of {len(snap['stages'])}, {stage}{detail}"
    parts = [f"{title}: {where}"]
    if snap["cancelling"]:
        parts.append("cancelling…")
    elif snap["seconds_left"] is not None:
        # Until the stage times its own steps, the time left is the prediction's; past it, revised from the time so far.
        how = "" if snap["eta"] is not None else " (revised: past its predicted time)" if snap.get("overrun") else " (predicted)"
        parts.append(f"about {duration_text(snap['seconds_left'])} left{how}")
    elif snap["eta"] is not None:
        parts.append(f"this stage about {duration_text(snap['eta'])} left")
    parts.append(f"{duration_text(snap['elapsed'])} elapsed")
    return " · ".join(parts)


def expected_text(snap: dict) -> str | None:
    """What the whole job was predicted to take, when every stage has a prediction."""
    total = snap.get("expected_total")
    if total is None:
        return None
    return f"Expected about {duration_text(total)} in all ({snap['expected_basis']})."


def expected_caption(predicted, what: str) -> None:
    """What a job the form describes is predicted to take, before it is started.

    Args:
        predicted: a ``pipeline.cost_model.Prediction``, or None when nothing honest can be said.
        what: the job in one word ("build", "run").
    """
    if predicted is not None:
        stages = ", ".join(f"{name} {duration_text(seconds)}" for name, seconds in predicted.seconds.items())
        st.caption(f"Predicted time ({predicted.where}): about {duration_text(predicted.total)} ({stages}; {predicted.basis}).")
    else:
        st.caption(
            f"Expected time: not known yet (a model whose shape needs the network, or a device not measured yet: Estimate "
            f"measures it); the time left shows as the {what} measures its stages."
        )


def stage_times_text(snap: dict) -> str:
    """'load model 3 s, read text 1 s, ...' of a job's finished stages."""
    return ", ".join(f"{name} {duration_text(seconds)}" for name, seconds in snap["stage_seconds"].items())
