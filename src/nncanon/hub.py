"""Fail fast, with the ways in, when a hub id cannot be reached.

Offline, transformers retries the hub for tens of seconds before it gives up with a message that
does not say what to do. `check_reachable` answers in a few seconds: a local folder, a checkpoint in
the local cache or ``HF_HUB_OFFLINE=1`` go on as before; otherwise one connection attempt to the hub
decides, and an unreachable hub raises `ModelUnavailable` naming the alternatives.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path
from urllib.parse import urlparse

from .errors import ModelUnavailable

#: Seconds to wait for the hub before declaring it unreachable.
CONNECT_TIMEOUT = 3.0

_PROXY_VARIABLES = ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy")


def alternatives(model: str) -> str:
    """The one-line hint: the ways to load a model without reaching the hub."""
    why = "HF_HUB_OFFLINE is set" if _offline() else "the Hugging Face hub is unreachable"
    return (
        f"cannot load {model!r}: {why} and it is not in the local cache. "
        "Pass a local folder (StandardizedTransformer('path/to/checkpoint')), set HF_HUB_OFFLINE=1 to load a "
        "checkpoint already cached, or try a demo model offline: nncanon.demo_model('gpt2' | 'llama' | 'hybrid') "
        "(CLI: --model llama)."
    )


def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").upper() in ("1", "ON", "YES", "TRUE")


def _cached(model: str, options: dict) -> bool:
    from transformers import AutoConfig

    try:
        AutoConfig.from_pretrained(model, local_files_only=True, **options)
    except (OSError, ValueError):
        return False
    return True


def hub_reachable(timeout: float = CONNECT_TIMEOUT) -> bool:
    """Whether a TCP connection to the hub (``HF_ENDPOINT``, default huggingface.co) opens within ``timeout``.

    Behind a proxy the answer is ``True`` (the proxy decides, transformers goes through it).
    """
    if any(os.environ.get(name) for name in _PROXY_VARIABLES):
        return True
    endpoint = urlparse(os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
    port = endpoint.port or (80 if endpoint.scheme == "http" else 443)
    try:
        socket.create_connection((endpoint.hostname, port), timeout=timeout).close()
    except OSError:
        return False
    return True


def looks_like_hub_id(model: str) -> bool:
    """Whether ``model`` names a hub repository (``name`` or ``namespace/name``), not a local path."""
    path = Path(model).expanduser()
    return not (path.is_dir() or path.is_absolute() or model.startswith((".", "~")) or model.count("/") > 1)


def check_reachable(model: str, options: dict | None = None) -> None:
    """Raise `ModelUnavailable` in a few seconds if ``model`` cannot be loaded from here (a missing path at once).

    Args:
        model: What the user passed: a hub id or a local folder.
        options: ``revision``, ``token``, ``trust_remote_code``, as for ``from_pretrained``.
    """
    if not looks_like_hub_id(model):
        if not Path(model).expanduser().exists():
            raise ModelUnavailable(
                f"cannot load {model!r}: no such folder. Pass an existing checkpoint folder, a hub id "
                "(namespace/name), or a demo model: nncanon.demo_model('gpt2' | 'llama' | 'hybrid')."
            )
        return
    if _offline() or _cached(model, options or {}):
        return
    if not hub_reachable():
        raise ModelUnavailable(alternatives(model))
