"""The explorer's server: `streamlit run serve.py` (`make run` does) serves app.py.

It is `streamlit run app.py` plus one route per page (explorer/serving.py), so a page opened at
its own address (a reload, a shared link) asks nothing that fails. Every `--server.*` flag and
.streamlit/config.toml setting applies as to app.py.
"""

from pathlib import Path

import streamlit as st

from explorer import serving

app = st.App(Path(__file__).resolve().with_name("app.py"), routes=serving.page_routes())
