"""Times that learn this machine, as a page shows them: a finished job's time feeds the next caption."""

from __future__ import annotations

import pytest
from app_fixtures import fresh_cache, job_of, start, texts  # noqa: F401

from gap_engine.core.progress import LOAD_MODEL
from gap_engine.pipeline.jobs import DONE

pytestmark = pytest.mark.slow  # the real built-in model


def predicted_caption(at) -> str:
    return next(t for t in texts(at.caption) if t.startswith("Predicted time"))


def test_a_finished_build_feeds_the_next_builds_predicted_time(fresh_cache):
    at = start()
    at.selectbox(key="setup_builtin_data").set_value("news-sample")
    at.radio(key="setup_estimator").set_value("taylor")
    at.number_input(key="setup_samples").set_value(2)
    at.number_input(key="setup_seq_len").set_value(16)
    at.text_input(key="setup_rate_grid").set_value("0, 0.25, 0.5, 0.75").run()
    assert predicted_caption(at).startswith("Predicted time (not yet measured here): about")
    at.button(key="setup_build").click().run()
    job = job_of(at, "table")
    assert job.wait(300) and job.status == DONE, job.snapshot()
    assert job.snapshot()["stage_seconds"][LOAD_MODEL] >= 0.0
    at.run()
    at.text_input(key="setup_rate_grid").set_value("0, 0.5").run()  # another table: a build again, not a cache hit
    caption = predicted_caption(at)
    assert caption.startswith("Predicted time (learned from 1 run on this machine): about"), caption
    assert "for this machine's speed and load now" in caption and "nominal CPU speed" in caption, caption
