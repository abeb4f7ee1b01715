"""The pages' own addresses are answered with Streamlit's page and the server's address pinned
(explorer/serving.py, mounted by serve.py); the browser side is in tests/browser/test_browser_layout.py."""

from __future__ import annotations

import ast
import asyncio
from pathlib import Path

from starlette.requests import Request

from explorer import serving

ROOT = Path(__file__).resolve().parents[2]


def test_every_page_of_the_app_has_a_route():
    tree = ast.parse((ROOT / "app.py").read_text())
    paths = [
        kw.value.value
        for node in ast.walk(tree)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "Page"
        for kw in node.keywords
        if kw.arg == "url_path"
    ]
    assert tuple(paths) == serving.PAGE_URL_PATHS
    assert [route.path for route in serving.page_routes()] == [f"/{path}" for path in serving.PAGE_URL_PATHS]


def test_a_page_is_streamlits_index_with_the_server_address_set_before_its_script():
    scope = {"type": "http", "method": "GET", "path": "/evaluate", "headers": [], "query_string": b""}
    response = asyncio.run(serving.page(Request(scope)))
    html = response.body.decode()
    assert response.status_code == 200 and response.headers["cache-control"] == "no-cache"
    pin = html.index('BACKEND_BASE_URL: window.location.origin + "/"')
    assert pin < html.index('<script type="module"')  # set before Streamlit's bundle reads it
    assert html.replace(html[html.index("<script>window.__streamlit") : html.index("</script>") + len("</script>")], "") == (
        serving.INDEX_HTML.read_text(encoding="utf-8").replace("<head>", "<head>\n    ", 1)
    )  # nothing else changed
    assert 'origin + "/gap/"' in serving.pinned_index("/gap")  # under server.baseUrlPath
