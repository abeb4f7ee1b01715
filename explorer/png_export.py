"""Charts to PNG files through kaleido, for the Export page's downloads."""

from __future__ import annotations

import os
import threading

# kaleido 1.x drives a headless Chromium through choreographer; point it at Debian's.
if os.path.exists("/usr/bin/chromium"):
    os.environ.setdefault("BROWSER_PATH", "/usr/bin/chromium")

_png_lock = threading.Lock()


def render_png(figures: dict, width: int = 1400) -> dict:
    """Name -> PNG bytes of each figure, through kaleido and one headless Chromium for the batch.

    Raises:
        whatever kaleido raises when no browser can start (the caller shows it).
    """
    import warnings

    import kaleido

    out = {}
    with _png_lock, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # kaleido warns that per-call options are ignored with a server
        kaleido.start_sync_server(silence_warnings=True)
        try:
            for name, fig in figures.items():
                out[name] = fig.to_image(format="png", width=width, height=int(fig.layout.height or 500), scale=1)
        finally:
            kaleido.stop_sync_server(silence_warnings=True)
    return out
