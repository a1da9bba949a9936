"""Collecting activations for training dictionaries: any point's value over a corpus, to sharded safetensors.

``collect_activations(model, "blocks.2.hook_resid_post", texts, folder)`` runs the texts in batches (no gradients,
left-padded, truncated to ``max_length``), keeps every real token's value (padding dropped) and writes them to
``folder`` as shards, ``activations-00000.safetensors``..., each a safetensors file with

- ``activations`` ``[rows, *shape]`` (the value per token: ``[d]``, ``[heads, head_dim]`` for a per-head value),
- ``text`` ``[rows]`` (int64: the text's index in the corpus) and ``position`` ``[rows]`` (int64: the token's
  position in its text, 0 for the first),

readable by ``safetensors.torch.load_file`` (or `iterate_activations`, `load_activations`), and a
``manifest.json`` saying what they are: the model, the point (its hook name and nncanon label), dtype, shape,
``max_length``, the shards with their rows and texts, the token count, how many texts are done and a hash of them.

A shard is written at a batch boundary once it holds ``shard_rows`` rows or more, and the manifest is replaced
(written to a temporary file and renamed) after the shard is complete: an interruption at any moment leaves the
shards the manifest names, which hold exactly the tokens of its first ``texts_done`` texts. Collecting again into
the same folder with the same corpus continues after them (a shard file the manifest does not name is a partial
write and is overwritten): no row is written twice and none is lost. Memory holds one batch and at most one shard.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from tqdm.auto import tqdm

from ..errors import InvalidInput
from .names import Point, resolve
from .sites import value_at

MANIFEST = "manifest.json"
FORMAT = "nncanon-activations/1"


@dataclass
class Collection:
    """What `collect_activations` wrote: ``folder`` and its manifest (``manifest["rows"]``, ``["shards"]``...)."""

    folder: Path
    manifest: dict

    @property
    def rows(self) -> int:
        """Tokens written (one row each)."""
        return self.manifest["rows"]

    def load(self) -> torch.Tensor:
        """Every row, ``[rows, *shape]`` (for a corpus that fits in memory)."""
        return load_activations(self.folder)


def _hash_texts(texts: Sequence[str], state: Any = None) -> Any:
    state = state or hashlib.sha256()
    for text in texts:
        state.update(text.encode("utf-8"))
        state.update(b"\x00")
    return state


def _write_json(path: Path, data: dict) -> None:
    temporary = path.with_suffix(".json.tmp")
    temporary.write_text(json.dumps(data, indent=2))
    os.replace(temporary, path)


def collect_activations(
    model: Any,
    hook_name: str | Point,
    texts: Sequence[str],
    folder: str | os.PathLike,
    batch_size: int = 8,
    max_length: int = 128,
    shard_rows: int = 65536,
    dtype: torch.dtype | None = None,
    progress: bool = True,
    resume: bool = True,
) -> Collection:
    """Write the value at ``hook_name`` for every token of ``texts`` to ``folder`` (see the module's docstring).

    Args:
        model: A `StandardizedTransformer`.
        hook_name: The point: a TransformerLens hook name, an nncanon value (``layers.2.layer_output``) or a module
            path; or a `Point` (`resolve`).
        texts: The corpus (a list of strings).
        folder: Where the shards and ``manifest.json`` go (created).
        batch_size: Texts per forward.
        max_length: Tokens per text at most (longer texts are truncated).
        shard_rows: Rows per shard (at least; a shard ends at a batch boundary).
        dtype: Store in this dtype (default: the model's).
        progress: Show a progress bar (tqdm).
        resume: Continue a collection the folder holds (the same model, point, settings and corpus; else
            `InvalidInput`). ``False``: refuse a folder that already has a manifest.

    Returns:
        A `Collection`.
    """
    texts = list(texts)
    if not texts or not all(isinstance(t, str) and t for t in texts):
        raise InvalidInput("collect_activations takes a non-empty list of non-empty texts")
    point = hook_name if isinstance(hook_name, Point) else resolve(model, hook_name)
    path = Path(folder)
    path.mkdir(parents=True, exist_ok=True)
    settings = {"format": FORMAT, "model": _model_name(model), "model_type": model._text_config.model_type,
                "hook_name": point.name or point.label, "point": point.label, "layer": point.layer,
                "value": point.value, "head": point.head, "max_length": max_length, "batch_size": batch_size,
                "texts_total": len(texts)}
    manifest = _start(path, settings, texts, resume)
    done = manifest["texts_done"]
    digest = _hash_texts(texts[:done])
    bar = _bar(len(texts), done, progress)
    buffer: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
    buffered = 0
    first = done
    try:
        for start in range(done, len(texts), batch_size):
            chunk = texts[start:start + batch_size]
            rows = _batch(model, point, chunk, start, max_length, dtype)
            if manifest.get("dtype") is None:
                manifest["dtype"] = str(rows[0].dtype).removeprefix("torch.")
                manifest["shape"] = list(rows[0].shape[1:])
            buffer.append(rows)
            buffered += rows[0].shape[0]
            end = start + len(chunk)
            if buffered >= shard_rows or end == len(texts):
                _flush(path, manifest, buffer, first, end)
                digest = _hash_texts(texts[first:end], digest)
                manifest["texts_sha256"] = digest.hexdigest()
                _write_json(path / MANIFEST, manifest)
                buffer, buffered, first = [], 0, end
            if bar is not None:
                bar.update(len(chunk))
    finally:
        if bar is not None:
            bar.close()
    return Collection(path, manifest)


def _model_name(model: Any) -> str:
    name = getattr(model._module.config, "_name_or_path", "") or ""
    return str(name)


def _start(path: Path, settings: dict, texts: list[str], resume: bool) -> dict:
    existing = path / MANIFEST
    if not existing.exists():
        return {**settings, "dtype": None, "shape": None, "shards": [], "rows": 0, "texts_done": 0,
                "texts_sha256": hashlib.sha256().hexdigest(), "created": time.strftime("%Y-%m-%dT%H:%M:%S")}
    manifest = json.loads(existing.read_text())
    if not resume:
        raise InvalidInput(f"{path} already holds a collection ({manifest.get('rows')} rows); pass resume=True to "
                           "continue it, or another folder")
    changed = [key for key in ("format", "model_type", "point", "head", "max_length", "batch_size", "texts_total")
               if manifest.get(key) != settings[key]]
    if changed:
        differences = ", ".join(f"{key}: {manifest.get(key)!r} there, {settings[key]!r} now" for key in changed)
        raise InvalidInput(f"{path} holds a collection made otherwise ({differences}); collect into another folder, "
                           "or with the same settings to continue it")
    done = manifest["texts_done"]
    if _hash_texts(texts[:done]).hexdigest() != manifest["texts_sha256"]:
        raise InvalidInput(f"{path} holds a collection of another corpus: its first {done} texts differ from these")
    return manifest


def _batch(model: Any, point: Point, chunk: list[str], start: int, max_length: int,
           dtype: torch.dtype | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(activations [n, ...], text [n], position [n])`` of the real tokens of one batch, on the CPU."""
    encoded = model.tokenizer(chunk, return_tensors="pt", padding=True, truncation=True, max_length=max_length)
    saved: list = []
    with torch.no_grad(), model.trace(encoded["input_ids"], attention_mask=encoded["attention_mask"]):
        saved.append(value_at(model, point).save())
    values = saved[0]
    mask = encoded["attention_mask"].bool()
    rows = values[mask.to(values.device)].detach().to("cpu", dtype=dtype or values.dtype)
    lengths = mask.sum(-1)
    positions = torch.cumsum(mask.long(), dim=-1) - 1
    text = torch.arange(start, start + len(chunk))[:, None].expand_as(mask)
    del lengths
    return rows.contiguous(), text[mask].contiguous(), positions[mask].contiguous()


def _flush(path: Path, manifest: dict, buffer: list, first: int, end: int) -> None:
    activations = torch.cat([rows for rows, _, _ in buffer])
    index = len(manifest["shards"])
    name = f"activations-{index:05d}.safetensors"
    save_file({"activations": activations, "text": torch.cat([t for _, t, _ in buffer]),
               "position": torch.cat([p for _, _, p in buffer])}, str(path / name))
    manifest["shards"].append({"file": name, "rows": activations.shape[0], "texts": [first, end]})
    manifest["rows"] += activations.shape[0]
    manifest["texts_done"] = end


def _bar(total: int, done: int, progress: bool) -> Any:
    if not progress:
        return None
    return tqdm(total=total, initial=done, unit="text", desc="collecting activations")


def iterate_activations(folder: str | os.PathLike, batch_rows: int | None = None) -> Iterator[torch.Tensor]:
    """The rows of a collection, shard by shard (``batch_rows``: in batches of that many rows), in corpus order."""
    path = Path(folder)
    manifest = json.loads((path / MANIFEST).read_text())
    for shard in manifest["shards"]:
        activations = load_file(str(path / shard["file"]))["activations"]
        if batch_rows is None:
            yield activations
        else:
            yield from activations.split(batch_rows)


def load_activations(folder: str | os.PathLike) -> torch.Tensor:
    """Every row of a collection, ``[rows, *shape]``."""
    return torch.cat(list(iterate_activations(folder)))
