"""lm-eval imported in the background, so the first task check after a server start does not block.

lm-eval's first import takes 5-8 s on two cores, which a Start pressed right after a server start
would otherwise spend with no sign of life. A page that offers task accuracy starts the import when it
draws; by the time the user presses Start it is done, and a page that finds it still running
says so while it waits.
"""

from __future__ import annotations

import importlib
import logging
import sys
import threading

from gap_engine.core.errors import first_line

log = logging.getLogger(__name__)

LM_EVAL_MODULES = ("lm_eval.tasks", "lm_eval.evaluator", "lm_eval.models.huggingface")  # what checking and running tasks import
_warm_up: threading.Thread | None = None
_warm_up_lock = threading.Lock()


def import_in_background() -> threading.Thread:
    """Start importing lm-eval in a daemon thread, once per process, and return that thread.

    An import that fails here fails again, with its message, where it is used.
    """
    global _warm_up
    with _warm_up_lock:
        if _warm_up is None:

            def load() -> None:
                for name in LM_EVAL_MODULES:
                    try:
                        importlib.import_module(name)
                    except Exception as exc:
                        log.info("lm-eval import in the background failed: %s", first_line(exc))
                        return

            _warm_up = threading.Thread(target=load, name="gap-import-lm-eval", daemon=True)
            _warm_up.start()
        return _warm_up


def lm_eval_imported() -> bool:
    """Whether lm-eval's modules are loaded in this process (a check is then quick)."""
    return all(name in sys.modules for name in LM_EVAL_MODULES)
