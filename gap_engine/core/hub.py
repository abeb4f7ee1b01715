"""Questions to the Hugging Face hub that must not hang: does its host name resolve, does it
accept a connection. Each is asked in a daemon thread and given up after a timeout, so a DNS
resolver or a firewall that never answers costs seconds, not the libraries' minute of retries.

The CLI's preflight asks the cheaper question (a name that does not resolve means no network
path at all); the task runner asks for a connection, because lm-eval must reach the hub's
datasets, not just know its address.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import urllib.parse
from collections.abc import Callable, Iterator
from pathlib import Path

DEFAULT_ENDPOINT = "https://huggingface.co"
OFFLINE_FLAGS = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE")
_ON = ("1", "true", "yes", "on")


def switched_off() -> bool:
    """Whether the user switched the hub off (any of ``OFFLINE_FLAGS`` set to a true value).

    Read from the environment on every call: huggingface_hub reads its flag once, at import,
    so a flag set later in the process (a test, a notebook) is seen here and not there.
    """
    return any(os.environ.get(name, "").strip().lower() in _ON for name in OFFLINE_FLAGS)


def endpoint() -> tuple[str, int]:
    """(host, port) of the hub the libraries would use ($HF_ENDPOINT, else huggingface.co)."""
    url = urllib.parse.urlparse(os.environ.get("HF_ENDPOINT") or DEFAULT_ENDPOINT)
    return url.hostname or "huggingface.co", url.port or 443


def answered_within(question: Callable[[], object], timeout: float) -> bool:
    """True when ``question()`` returns within ``timeout`` seconds; False when it raises OSError
    or is still running then (it is left to finish in its daemon thread)."""
    outcome: list[bool] = []

    def ask() -> None:
        try:
            question()
            outcome.append(True)
        except OSError:
            outcome.append(False)

    asker = threading.Thread(target=ask, daemon=True)
    asker.start()
    asker.join(timeout)
    return bool(outcome and outcome[0])


def host_resolves(timeout: float) -> bool:
    """Whether the hub's host name resolves within ``timeout`` seconds."""
    host, port = endpoint()
    return answered_within(lambda: socket.getaddrinfo(host, port), timeout)


def accepts_connection(timeout: float) -> bool:
    """Whether the hub accepts a TCP connection within ``timeout`` seconds."""
    host, port = endpoint()

    def connect() -> None:
        socket.create_connection((host, port), timeout=timeout).close()

    return answered_within(connect, timeout)


@contextlib.contextmanager
def offline(switch_off: bool = True) -> Iterator[None]:
    """Within the block, datasets and huggingface_hub read only their caches (when ``switch_off``).

    Both libraries read the flags once at import, so their module constants are set too, and
    everything is restored afterwards: the caller's own settings outside the block stay.
    """
    if not switch_off:
        yield
        return
    import datasets.config as datasets_config
    import huggingface_hub.constants as hub_constants

    saved_env = {flag: os.environ.get(flag) for flag in OFFLINE_FLAGS}
    flags = ((hub_constants, "HF_HUB_OFFLINE"), (datasets_config, "HF_HUB_OFFLINE"), (datasets_config, "HF_DATASETS_OFFLINE"))
    saved = [(module, name, getattr(module, name)) for module, name in flags if hasattr(module, name)]
    os.environ.update({flag: "1" for flag in OFFLINE_FLAGS})
    for module, name, _ in saved:
        setattr(module, name, True)
    try:
        yield
    finally:
        for module, name, value in saved:
            setattr(module, name, value)
        for flag, value in saved_env.items():
            if value is None:
                os.environ.pop(flag, None)
            else:
                os.environ[flag] = value


def dataset_cached(dataset: str) -> bool:
    """Whether the datasets or hub cache has a folder for this hub data set (then loading may work offline)."""
    import datasets.config
    import huggingface_hub.constants

    return (Path(datasets.config.HF_DATASETS_CACHE) / dataset.replace("/", "___")).exists() or (
        Path(huggingface_hub.constants.HF_HUB_CACHE) / f"datasets--{dataset.replace('/', '--')}"
    ).exists()
