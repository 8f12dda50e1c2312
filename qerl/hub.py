"""The Hugging Face hub, asked only when it can answer: before a model or dataset id is looked up, one
connection to the hub's host (2 s at most) says whether it is reachable. Where it is not (no network, no
DNS), qerl turns on the hub libraries' offline mode (HF_HUB_OFFLINE) for the process: what is in the local
cache still loads, anything else fails at once with qerl's error naming the id, instead of a minute of
retries and their log lines. HF_HUB_OFFLINE=1 set by you skips the check; so does a proxy (HTTPS_PROXY),
which a direct connection cannot stand for.
"""

from __future__ import annotations

import functools
import os
import socket
import sys
from urllib.parse import urlparse

CONNECT_TIMEOUT_S = 2.0


@functools.lru_cache(maxsize=None)
def _reachable(endpoint: str) -> bool:
    url = urlparse(endpoint)
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        socket.create_connection((url.hostname, port), timeout=CONNECT_TIMEOUT_S).close()
        return True
    except OSError:
        return False


def online() -> bool:
    """Whether the hub may be asked. False when offline mode is on, or when the hub's host does not answer
    (then offline mode is turned on for this process, and one line says so)."""
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        return False
    if any(os.environ.get(v) for v in ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY")):
        return True
    if _reachable(constants.ENDPOINT):
        return True
    os.environ["HF_HUB_OFFLINE"] = "1"  # datasets and transformers imported later read it
    constants.HF_HUB_OFFLINE = True
    ds_config = sys.modules.get("datasets.config")
    if ds_config is not None:
        ds_config.HF_HUB_OFFLINE = ds_config.HF_DATASETS_OFFLINE = True
    print(f"[qerl] the Hugging Face hub ({urlparse(constants.ENDPOINT).hostname}) does not answer: offline mode, "
          f"the local cache only", file=sys.stderr)
    return False
