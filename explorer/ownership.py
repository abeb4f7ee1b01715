"""Which browser started a job or made a run, so that a shared link shows the state read-only.

A link carries the view (explorer/url_state.py), the running jobs included, so that a reload
attaches to them again. Whoever opens a shared link sees the same state, but the Cancel of a
job and the Delete of a run go only to the browser that started or made them. That browser
proves it by a random token (256 bits) it keeps in a cookie (`COOKIE`, SameSite=Strict),
never in the URL: the server reads it from the request that opened the session
(``st.context.cookies``), so a reload is recognised from its first run; a session whose
browser sent none makes a token and a tiny component writes it into the cookie. Jobs record
the token's digest as their owner (``Job.owner``) and runs as their maker
(``history.set_run_maker``); the token itself is kept only in the browser and this session.

Something no browser started (a job of a script, a run of the CLI) has no owner and can be
controlled from any browser.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
from functools import lru_cache

import streamlit as st

COOKIE = "gap_browser"
TOKEN_KEY = "app_browser_token"  # this session's token (the browser's cookie, or a new one it is given)
EARLIER_KEY = "app_browser_earlier"  # digests of tokens this session used before it adopted its browser's
_COOKIE_KEY = "app_browser_cookie"  # the component that keeps the cookie
TOKEN = re.compile(r"[A-Za-z0-9_-]{43}")  # secrets.token_urlsafe(32)
MAX_AGE_S = 400 * 24 * 3600  # the longest a browser keeps a cookie

# The cookie is written only when the browser has none (or one of another form), so two tabs
# opened at once in a new browser agree on the first one written: the second reports it back and
# adopts it.
_COOKIE_JS = """
export default function ({ data, setStateValue }) {
  const prefix = data.cookie + "=";
  const found = document.cookie.split("; ").find((part) => part.startsWith(prefix));
  const kept = found ? found.slice(prefix.length) : null;
  if (kept === null || !/^[A-Za-z0-9_-]{43}$/.test(kept)) { // none yet, or not one of ours: this one
    document.cookie = `${prefix}${data.token}; path=/; max-age=${data.max_age}; SameSite=Strict`;
  } else if (kept !== data.token) {
    setStateValue("token", kept);
  }
}
"""


def owner_of(token: str) -> str:
    """The id jobs and runs record for a browser's token: a digest, so a listing never shows a token."""
    return hashlib.sha256(f"gap-browser:{token}".encode()).hexdigest()[:32]


def _valid(token) -> bool:
    return isinstance(token, str) and TOKEN.fullmatch(token) is not None


def token() -> str:
    """This browser's token: the cookie it sent when the session opened, else a new one."""
    ss = st.session_state
    if not _valid(ss.get(TOKEN_KEY)):
        sent = st.context.cookies.get(COOKIE)
        ss[TOKEN_KEY] = sent if _valid(sent) else secrets.token_urlsafe(32)
    return str(ss[TOKEN_KEY])


def owner() -> str:
    """The id this browser's jobs and runs record (a digest of its token, never the token)."""
    return owner_of(token())


def may_control(recorded: str | None) -> bool:
    """Whether this browser started the job or made the run that recorded ``recorded``
    (None: nothing started it from a browser, so any browser may)."""
    if recorded is None:
        return True
    mine = [owner(), *st.session_state.get(EARLIER_KEY, ())]
    return any(hmac.compare_digest(str(recorded), digest) for digest in mine)


@lru_cache(maxsize=1)
def _cookie_component():
    return st.components.v2.component("gap_browser_cookie", js=_COOKIE_JS)


def _adopt_browsers_token() -> None:
    """Callback: the browser already had a token (another tab wrote it first): use that one from
    now on, and keep the control of what this session started with its own."""
    ss = st.session_state
    sent = (ss.get(_COOKIE_KEY) or {}).get("token")
    if _valid(sent) and sent != ss.get(TOKEN_KEY):
        ss.setdefault(EARLIER_KEY, []).append(owner())
        ss[TOKEN_KEY] = sent


def keep_cookie() -> None:
    """Mount the component that writes this session's token into the browser's cookie (every run)."""
    with st.sidebar:
        _cookie_component()(
            key=_COOKIE_KEY,
            data={"cookie": COOKIE, "token": token(), "max_age": MAX_AGE_S},
            on_token_change=_adopt_browsers_token,
        )
