"""The Hugging Face Hub out of reach, found in seconds: the Hub's loaders then read the cache only.

``huggingface_hub`` retries an unreachable Hub for ~25 s per file; :func:`offline_unless_reachable`
asks once, with a short timeout, and otherwise sets ``HF_HUB_OFFLINE`` for this process.
"""

from __future__ import annotations

import os
import sys
import threading
import urllib.error
import urllib.request

#: How long the Hub may take to answer the probe.
PROBE_SECONDS = 3.0
TRUE = ("1", "true", "yes", "on")


def endpoint() -> str:
    """The Hub's address, as ``huggingface_hub`` reads it (``HF_ENDPOINT``)."""
    return os.environ.get("HF_ENDPOINT", "https://huggingface.co").rstrip("/")


def offline_set() -> bool:
    """Whether the environment already keeps the Hub's loaders offline."""
    return any(
        os.environ.get(var, "").strip().lower() in TRUE
        for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
    )


def unreachable(timeout: float = PROBE_SECONDS) -> str | None:
    """Why the Hub cannot be reached (no answer within ``timeout`` seconds), or ``None``; any
    HTTP answer means it is there. Asked in a daemon thread (a lookup may never return)."""
    url = endpoint()
    why = [f"the Hub at {url} did not answer within {timeout:g} s"]

    def probe() -> None:
        try:
            urllib.request.urlopen(urllib.request.Request(url, method="HEAD"), timeout=timeout)
        except urllib.error.HTTPError:
            pass  # it answered
        except (OSError, ValueError) as err:
            why[0] = f"the Hub at {url} could not be reached ({err})"
            return
        why.clear()

    thread = threading.Thread(target=probe, daemon=True)
    thread.start()
    thread.join(timeout)
    return why[0] if why else None


def go_offline() -> None:
    """Turn on the Hub's offline mode for this process (also if ``huggingface_hub`` is loaded)."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    constants = sys.modules.get("huggingface_hub.constants")
    if constants is not None:
        constants.HF_HUB_OFFLINE = True  # type: ignore[attr-defined]


def offline_unless_reachable(timeout: float = PROBE_SECONDS) -> str | None:
    """Go offline when the Hub does not answer; why it is offline (``None``: online)."""
    if offline_set():
        return "HF_HUB_OFFLINE is set"
    why = unreachable(timeout)
    if why is not None:
        go_offline()
    return why
