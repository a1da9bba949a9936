"""The page shell every view shares: one self-contained HTML document, its data embedded as escaped JSON.

A page is a `Page` (its HTML as ``str(page)`` or ``page.html``, written with ``page.write(path)``, shown inline in
Jupyter through ``_repr_html_`` as a sandboxed ``<iframe srcdoc>``). Nothing in a page is fetched: the scripts and
styles are inlined from ``nncanon/views/static``, and a Content-Security-Policy forbids every network request. Text
from the data (tokens, prompts, contexts) reaches the DOM through ``textContent`` only, and the embedded JSON has
``<``, ``>``, ``&`` and the line separators escaped, so a token such as ``</script><script>...`` stays text.
"""

from __future__ import annotations

import html
import json
import math
import os
from importlib import resources
from pathlib import Path
from typing import Any

#: No network at all: inline scripts and styles, images from data: and blob: URLs only.
CSP = ("default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; img-src data: blob:; "
       "connect-src 'none'; font-src 'none'")

_JSON_ESCAPES = {"<": "\\u003c", ">": "\\u003e", "&": "\\u0026", "\u2028": "\\u2028", "\u2029": "\\u2029"}


def static(name: str) -> str:
    """The text of ``nncanon/views/static/<name>`` (shipped in the wheel)."""
    return resources.files("nncanon.views").joinpath("static", name).read_text(encoding="utf-8")


def clean(value: Any) -> Any:
    """``value`` as plain JSON data: tensors and arrays as lists, non-finite floats as ``None``."""
    if hasattr(value, "tolist"):
        value = value.tolist()
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [clean(v) for v in value]
    return value


def script_json(data: Any) -> str:
    """``data`` as JSON safe inside ``<script type="application/json">`` (no ``</script>``, no ``<!--``)."""
    text = json.dumps(clean(data), ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    for char, escape in _JSON_ESCAPES.items():
        text = text.replace(char, escape)
    return text


def rounded(value: float, digits: int = 4) -> float | None:
    """``value`` to ``digits`` significant digits (smaller pages); ``None`` for NaN or infinity."""
    value = float(value)
    if not math.isfinite(value):
        return None
    return float(f"{value:.{digits}g}")


class Page(str):
    """One self-contained HTML page of a view: the document itself (a ``str``), with ``write`` and Jupyter's
    ``_repr_html_``.

    Attributes:
        kind: The view (``"graph"``, ``"attention"``, ``"lens"``, ``"feature"``, ``"study"``).
    """

    kind: str

    def __new__(cls, document: str, kind: str) -> Page:
        page = super().__new__(cls, document)
        page.kind = kind
        return page

    @property
    def html(self) -> str:
        """The whole document, as a plain ``str``."""
        return str.__str__(self)

    @property
    def size(self) -> int:
        """The page's size in bytes (UTF-8)."""
        return len(self.html.encode("utf-8"))

    def write(self, path: str | os.PathLike) -> Path:
        """Write the page to ``path`` (UTF-8); returns the path."""
        out = Path(path)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(self.html, encoding="utf-8")
        return out

    def _repr_html_(self) -> str:
        """The page in a sandboxed iframe (its scripts run; it reaches nothing of the notebook)."""
        return (f'<iframe sandbox="allow-scripts allow-downloads" style="width:100%;height:640px;border:0" '
                f'srcdoc="{html.escape(self.html, quote=True)}"></iframe>')


def render(kind: str, title: str, data: Any, notes: list[str] | None = None) -> Page:
    """The page of view ``kind``: ``static/common.{css,js}`` and ``static/<kind>.js`` inlined, ``data`` embedded.

    ``notes``: lines shown above the view (what is missing, what was estimated), escaped.
    """
    notes_html = "".join(f'<p class="note">{html.escape(note)}</p>' for note in notes or [])
    document = f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<meta http-equiv="Content-Security-Policy" content="{html.escape(CSP)}">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>{html.escape(title)}</title>
<style>{static("common.css")}</style></head>
<body data-view="{html.escape(kind)}">
<header><h1>{html.escape(title)}</h1>{notes_html}</header>
<main id="view"></main>
<div id="tip" hidden></div>
<script type="application/json" id="view-data">{script_json(data)}</script>
<script>{static("common.js")}</script>
<script>{static(kind + ".js")}</script>
</body></html>
"""
    return Page(document, kind)
