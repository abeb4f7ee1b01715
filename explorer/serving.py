"""The explorer's pages served at their own paths with no failed request (`serve.py` mounts these routes).

Streamlit's browser code does not know where its server is: opened at ``/evaluate`` (a reload, a
shared link) it asks ``/evaluate/_stcore/health`` and ``/evaluate/_stcore/host-config`` first,
gets two 404s (two errors in the console, and a retry's wait before the page draws), and only
then tries ``/``. It reads the server's address from ``window.__streamlit.BACKEND_BASE_URL``
when a host page sets it, before its own script runs. So each page's path is answered here with
Streamlit's own index.html and one line that sets that address: the server's origin and
``server.baseUrlPath``. The root path needs nothing (there is no shorter path to try), and
every other path is Streamlit's as before.
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

import streamlit as st
from starlette.requests import Request
from starlette.responses import HTMLResponse
from starlette.routing import Route

# The pages' ``st.Page(url_path=...)`` in app.py (a test reads them from there).
PAGE_URL_PATHS = ("setup", "sensitivity", "planner", "evaluate", "recover", "export")
INDEX_HTML = Path(st.__file__).parent / "static" / "index.html"


def base_path() -> str:
    """``server.baseUrlPath`` as a path prefix: "" or "/name"."""
    base = str(st.get_option("server.baseUrlPath") or "").strip("/")
    return f"/{base}" if base else ""


def pinned_index(base: str) -> str:
    """Streamlit's index.html with the server's address set before its script runs."""
    html = INDEX_HTML.read_text(encoding="utf-8")
    if "<head>" not in html:
        raise RuntimeError(f"{INDEX_HTML} has no <head>: this Streamlit's page cannot be served with its address")
    # A host page's own settings win; the origin is the browser's, so a proxy's name stays.
    pin = (
        "<script>window.__streamlit = Object.assign("
        f"{{BACKEND_BASE_URL: window.location.origin + {json.dumps(base + '/')}}}, window.__streamlit || {{}});</script>"
    )
    return html.replace("<head>", "<head>\n    " + pin, 1)


@lru_cache(maxsize=4)
def _page_html(base: str) -> str:
    return pinned_index(base)


async def page(request: Request) -> HTMLResponse:
    """A page's document: what Streamlit serves there, with its server's address pinned."""
    return HTMLResponse(_page_html(base_path()), headers={"Cache-Control": "no-cache"})


def page_routes() -> list[Route]:
    """One route per page path (under ``server.baseUrlPath``), ahead of Streamlit's own."""
    base = base_path()
    return [Route(f"{base}/{path}", page, methods=["GET", "HEAD"]) for path in PAGE_URL_PATHS]
