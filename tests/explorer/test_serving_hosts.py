"""The explorer's server takes its WebSocket only from the loopback names: a web page
that re-points its own host name at 127.0.0.1 (DNS rebinding) reaches the port, but the browser
sends that name as Host, and the committed ``server.allowedHosts`` refuses it (docs/serving.md)."""

from __future__ import annotations

import http.client
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parents[2]
LOOPBACK_NAMES = ["localhost", "127.0.0.1", "::1"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _upgrade_status(port: int, host: str) -> int:
    """The status of a WebSocket upgrade of the app's stream sent with ``Host: host``."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    conn.putrequest("GET", "/_stcore/stream", skip_host=True)
    for name, value in (
        ("Host", host), ("Connection", "Upgrade"), ("Upgrade", "websocket"),
        ("Sec-WebSocket-Version", "13"), ("Sec-WebSocket-Key", "dGhlIHNhbXBsZSBub25jZQ=="),
    ):  # fmt: skip
        conn.putheader(name, value)
    conn.endheaders()
    status = conn.getresponse().status
    conn.close()
    return status


def test_the_committed_config_allows_only_loopback_host_names():
    config = tomllib.loads((ROOT / ".streamlit" / "config.toml").read_text())
    assert config["server"]["allowedHosts"] == LOOPBACK_NAMES


@pytest.mark.slow
def test_a_rebound_host_name_gets_no_websocket(tmp_path):
    port = _free_port()
    env = dict(os.environ, GAP_CACHE_DIR=str(tmp_path / "cache"))
    command = [sys.executable, "-m", "streamlit", "run", "app.py", "--server.port", str(port), "--server.headless", "true"]
    process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 90
        while True:
            try:
                assert _upgrade_status(port, f"127.0.0.1:{port}") == 101  # the app's own name: served
                break
            except OSError:
                assert time.monotonic() < deadline and process.poll() is None, "the server did not start"
                time.sleep(0.3)
        assert _upgrade_status(port, f"localhost:{port}") == 101
        assert _upgrade_status(port, f"evil.example:{port}") == 403
        assert _upgrade_status(port, "127.0.0.1.evil.example") == 403
    finally:
        process.terminate()
        process.wait(30)
