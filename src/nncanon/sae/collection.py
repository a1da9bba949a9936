"""Collecting activations for training dictionaries: any point's value over a corpus, to sharded safetensors.

``collect_activations(model, "blocks.2.hook_resid_post", texts, folder)`` runs the texts in batches (no gradients,
left-padded, truncated to ``max_length``), keeps every real token's value (padding dropped) and writes them to
``folder`` as shards, ``activations-00000.safetensors``..., each a safetensors file with

- ``activations`` ``[rows, *shape]`` (the value per token: ``[d]``, ``[heads, head_dim]`` for a per-head value),
- ``text`` ``[rows]`` (int64: the text's index in the corpus) and ``position`` ``[rows]`` (int64: the token's
  position in its text, 0 for the first),

readable by ``safetensors.torch.load_file`` (or `iterate_activations`, `load_activations`), and a
``manifest.json`` saying what they are: the model (its name, type, dtype and a digest of its weights), the point
(its hook name and nncanon label), dtype, shape, ``max_length``, ``batch_size``, the tokenizer, a digest of the
corpus, the shards with their rows, texts, sizes and SHA-256 digests, the token count and how many texts are done.

A shard is written at a batch boundary once it holds ``shard_rows`` rows or more, to a temporary file renamed into
place, and the manifest is replaced the same way after it: an interruption at any moment (``kill -9`` included)
leaves the shards the manifest names, which hold exactly the tokens of its first ``texts_done`` texts. Collecting
again into the same folder with the same model, point, settings and corpus continues after them: no row is written
twice and none is lost. Anything else is refused (`InvalidCollection`, naming what differs): another checkpoint
(told by its weights, not its type), dtype, point, ``max_length``, ``batch_size`` or corpus. One collector writes a
folder at a time (a lock; a second is refused with the holder's pid and host). Every shard is verified against the
manifest (size, digest, rows, dtype, shape, texts) when it is read and before a resume
(`nncanon.sae.collection_folder`).
Memory holds one batch and at most one shard.
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
from tqdm.auto import tqdm

from ..errors import InvalidArgument, InvalidCollection
from ..mounted import MountedModel
from . import collection_folder as files
from .collection_folder import FORMAT, MANIFEST, shard_name
from .names import Point, resolve
from .sites import value_at

__all__ = ["FORMAT", "MANIFEST", "Collection", "collect_activations", "iterate_activations", "load_activations"]

#: The settings a resume must share with the folder's collection (besides the corpus and the weights' digest).
RESUMED_WITH = ("format", "model", "model_type", "model_sha256", "model_dtype", "tokenizer", "point", "head",
                "dtype_requested", "max_length", "batch_size", "texts_total", "corpus_sha256")

#: Elements of each weight read into the model's digest (evenly spaced over it, its shape and dtype with them).
SAMPLED = 4096


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
        state.update(text.encode("utf-8", "surrogatepass"))
        state.update(b"\x00")
    return state


def _write_manifest(path: Path, manifest: dict) -> None:
    files.write_new(path, MANIFEST, json.dumps(manifest, indent=2).encode("utf-8"))


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
            path; or a `Point` (`resolve`). A value per token (not ``attention_probabilities``).
        texts: The corpus: a list of non-empty strings (not one string).
        folder: Where the shards and ``manifest.json`` go (created).
        batch_size: Texts per forward (at least 1).
        max_length: Tokens per text at most (at least 1; longer texts are truncated).
        shard_rows: Rows per shard (at least 1; a shard ends at a batch boundary).
        dtype: Store in this floating dtype (default: the model's).
        progress: Show a progress bar (tqdm).
        resume: Continue a collection the folder holds (the same model, point, settings and corpus; else
            `InvalidCollection`). ``False``: refuse a folder that already has a manifest.

    Returns:
        A `Collection`.

    Raises:
        InvalidArgument: before any work: a corpus that is one string, empty or holds a non-string or empty text;
            a size that is not a positive int; a ``dtype`` that is not a floating torch dtype; the point of
            ``attention_probabilities`` (``[b, H, q, k]``, not a value per token).
        InvalidCollection: the folder cannot be created or written, another collector holds it, or it holds a
            collection that is not this one or whose manifest or shards are damaged (naming the file or setting).
    """
    texts = _checked_arguments(model, texts, batch_size, max_length, shard_rows, dtype, progress, resume)
    point = hook_name if isinstance(hook_name, Point) else resolve(model, hook_name)
    if point.value == "attention_probabilities":
        raise InvalidArgument(f"{point.name or point.label} is {point.label} [b, H, q, k], not a value per token: "
                              "collect_activations keeps one row per token (a residual stream, a sublayer's output, "
                              "a head's output)")
    path = _folder(folder)
    settings = {"format": FORMAT, "model": _model_name(model), "model_type": model._text_config.model_type,
                "model_dtype": str(_model_dtype(model)).removeprefix("torch."), "tokenizer": _tokenizer(model),
                "hook_name": point.name or point.label, "point": point.label, "layer": point.layer,
                "value": point.value, "head": point.head,
                "dtype_requested": None if dtype is None else str(dtype).removeprefix("torch."),
                "max_length": max_length, "batch_size": batch_size, "texts_total": len(texts),
                "corpus_sha256": _hash_texts(texts).hexdigest()}
    with files.locked(path):
        files.remove_temporaries(path)
        manifest = _start(path, settings, texts, resume, _model_digest(model))
        return _collect(model, point, texts, path, manifest, batch_size, max_length, shard_rows, dtype, progress)


def _checked_arguments(model: Any, texts: Any, batch_size: Any, max_length: Any, shard_rows: Any, dtype: Any,
                       progress: Any, resume: Any) -> list[str]:
    """The corpus as a list, after every argument is checked (`InvalidArgument`, before any work)."""
    if not isinstance(model, MountedModel):
        raise InvalidArgument(f"collect_activations takes a StandardizedTransformer, not a {type(model).__name__}")
    if isinstance(texts, (str, bytes)):
        raise InvalidArgument("collect_activations takes a list of texts, not one string (it would be collected "
                              "character by character): pass [text]")
    try:
        texts = list(texts)
    except TypeError:
        raise InvalidArgument(f"collect_activations takes a list of texts, not a {type(texts).__name__}") from None
    if not texts:
        raise InvalidArgument("collect_activations takes a non-empty list of texts (it was given none)")
    for index, text in enumerate(texts):
        if not isinstance(text, str) or not text:
            raise InvalidArgument(f"collect_activations takes non-empty strings: text {index} is {text!r}")
    for name, value in (("batch_size", batch_size), ("max_length", max_length), ("shard_rows", shard_rows)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise InvalidArgument(f"collect_activations: {name}={value!r}; it is a positive int")
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise InvalidArgument(f"collect_activations: dtype={dtype!r}; it is a floating torch dtype (torch.float16, "
                              "torch.bfloat16, torch.float32...) or None (the model's)")
    for name, value in (("progress", progress), ("resume", resume)):
        if not isinstance(value, bool):
            raise InvalidArgument(f"collect_activations: {name}={value!r}; it is True or False")
    return texts


def _folder(folder: Any) -> Path:
    try:
        path = Path(os.path.expanduser(os.fspath(folder)))
    except TypeError:
        raise InvalidArgument(f"collect_activations: folder={folder!r}; it is a path") from None
    try:
        path.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise InvalidCollection(f"{path} is not a folder: a collection is written to a folder") from None
    except OSError as error:
        raise InvalidCollection(f"{path} cannot be created ({error.strerror})") from None
    if not path.is_dir():
        raise InvalidCollection(f"{path} is not a folder: a collection is written to a folder")
    return path


def _model_name(model: Any) -> str:
    name = getattr(model._module.config, "_name_or_path", "") or ""
    return str(name)


def _model_dtype(model: Any) -> torch.dtype:
    return getattr(model._module, "dtype", None) or torch.float32


def _tokenizer(model: Any) -> str:
    tokenizer = model.tokenizer
    return (f"{getattr(tokenizer, 'name_or_path', '') or type(tokenizer).__name__}, {len(tokenizer)} tokens, "
            f"padding {getattr(tokenizer, 'padding_side', '?')}")


def _model_digest(model: Any) -> str:
    """A SHA-256 over every weight and buffer of the model: its name, shape, dtype and ``SAMPLED`` evenly spaced
    elements (another checkpoint of the same type and width differs in them; reading every byte of a large model
    would cost a pass over its weights at every start)."""
    if not getattr(model, "dispatched", True):
        model.dispatch()  # a model built on meta loads its weights at its first trace: here, first
    state = hashlib.sha256()
    module = model._module
    for name, tensor in [*module.named_parameters(), *module.named_buffers()]:
        state.update(f"{name} {tuple(tensor.shape)} {tensor.dtype}\n".encode())
        if tensor.device.type == "meta" or tensor.numel() == 0:  # offloaded: its name and shape
            continue
        flat = tensor.detach().reshape(-1)
        if flat.numel() > SAMPLED:
            flat = flat[torch.linspace(0, flat.numel() - 1, SAMPLED, device=flat.device).long()]
        state.update(flat.cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return state.hexdigest()


def _start(path: Path, settings: dict, texts: list[str], resume: bool, digest: str) -> dict:
    """The manifest to continue: a new one, or the folder's (verified, its settings those asked)."""
    settings = {**settings, "model_sha256": digest}
    manifest = files.read_manifest(path)
    unnamed = files.unnamed_shards(path, manifest)
    if unnamed:
        raise InvalidCollection(f"{path} holds shards its manifest does not name ({', '.join(unnamed[:4])}"
                                f"{'...' if len(unnamed) > 4 else ''}): they are not part of this collection and "
                                "would be overwritten. Move them away, or collect into another folder")
    if manifest is None:
        return {**settings, "dtype": None, "shape": None, "shards": [], "pending": None, "rows": 0, "texts_done": 0,
                "texts_sha256": hashlib.sha256().hexdigest(), "created": time.strftime("%Y-%m-%dT%H:%M:%S")}
    if not resume:
        raise InvalidCollection(f"{path} already holds a collection ({manifest.get('rows')} rows); pass resume=True "
                                "to continue it, or another folder")
    changed = [key for key in RESUMED_WITH if manifest.get(key) != settings[key]]
    if changed:
        differences = ", ".join(f"{key}: {_short(manifest.get(key))} there, {_short(settings[key])} now"
                                for key in changed)
        raise InvalidCollection(f"{path} holds a collection made otherwise ({differences}); collect into another "
                                "folder, or with the same model, settings and corpus to continue it")
    done = manifest["texts_done"]
    if _hash_texts(texts[:done]).hexdigest() != manifest.get("texts_sha256"):
        raise InvalidCollection(f"{path} holds a collection of another corpus: its first {done} texts differ "
                                "from these")
    for index in range(len(manifest["shards"])):
        files.read_shard(path, manifest, index)
    _adopt_pending(path, manifest, texts)
    return manifest


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 24 else text[:20] + "...'"


def _adopt_pending(path: Path, manifest: dict, texts: list[str]) -> None:
    """A shard renamed into place whose manifest entry an interruption kept from being written: taken in where it is
    whole (its digest the one recorded), forgotten where it never reached its name."""
    pending = manifest.get("pending")
    if not pending:
        return
    manifest["pending"] = None
    if not os.path.lexists(path / pending["file"]):
        return
    if pending["file"] != shard_name(len(manifest["shards"])) or pending["texts"][0] != manifest["texts_done"]:
        raise InvalidCollection(f"{path / pending['file']}: the manifest's pending shard does not follow its shards; "
                                "the manifest was edited")
    manifest["shards"].append(pending)
    try:
        files.read_shard(path, {**manifest, "shards": manifest["shards"]}, len(manifest["shards"]) - 1)
    except InvalidCollection:
        manifest["shards"].pop()
        raise
    manifest["rows"] += pending["rows"]
    manifest["texts_done"] = pending["texts"][1]
    manifest["texts_sha256"] = _hash_texts(texts[:manifest["texts_done"]]).hexdigest()
    _write_manifest(path, manifest)


def _collect(model: Any, point: Point, texts: list[str], path: Path, manifest: dict, batch_size: int,
             max_length: int, shard_rows: int, dtype: torch.dtype | None, progress: bool) -> Collection:
    done = manifest["texts_done"]
    digest = _hash_texts(texts[:done])
    bar = _bar(len(texts), done, progress)
    buffer: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
    buffered, first = 0, done
    try:
        for start in range(done, len(texts), batch_size):
            chunk = texts[start:start + batch_size]
            rows = _batch(model, point, chunk, start, max_length, dtype)
            _check_rows(path, manifest, rows[0])
            buffer.append(rows)
            buffered += rows[0].shape[0]
            end = start + len(chunk)
            if buffered >= shard_rows or end == len(texts):
                digest = _hash_texts(texts[first:end], digest)
                _flush(path, manifest, buffer, first, end, digest.hexdigest())
                buffer, buffered, first = [], 0, end
            if bar is not None:
                bar.update(len(chunk))
    finally:
        if bar is not None:
            bar.close()
    return Collection(path, manifest)


def _check_rows(path: Path, manifest: dict, rows: torch.Tensor) -> None:
    """A batch's rows have the dtype and shape of the rows written before (the first batch sets them)."""
    kind, shape = str(rows.dtype).removeprefix("torch."), list(rows.shape[1:])
    if manifest.get("dtype") is None:
        manifest["dtype"], manifest["shape"] = kind, shape
    elif (manifest["dtype"], manifest["shape"]) != (kind, shape):
        raise InvalidCollection(f"{path} holds {manifest['dtype']} rows of {manifest['shape']}, but this model gives "
                                f"{kind} rows of {shape} at {manifest['point']}: it is not the same collection")


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
    positions = torch.cumsum(mask.long(), dim=-1) - 1
    text = torch.arange(start, start + len(chunk))[:, None].expand_as(mask)
    return rows.contiguous(), text[mask].contiguous(), positions[mask].contiguous()


def _flush(path: Path, manifest: dict, buffer: list, first: int, end: int, texts_sha256: str) -> None:
    """Write one shard: named as pending in the manifest, renamed into place, then entered in the manifest."""
    activations = torch.cat([rows for rows, _, _ in buffer])
    name = shard_name(len(manifest["shards"]))
    data = files.encode_shard({"activations": activations, "text": torch.cat([t for _, t, _ in buffer]),
                               "position": torch.cat([p for _, _, p in buffer])})
    entry = {"file": name, "rows": activations.shape[0], "texts": [first, end], "bytes": len(data),
             "sha256": files.sha256(data)}
    manifest["pending"] = entry
    _write_manifest(path, manifest)
    files.write_new(path, name, data)
    manifest["shards"].append(entry)
    manifest["pending"] = None
    manifest["rows"] += activations.shape[0]
    manifest["texts_done"] = end
    manifest["texts_sha256"] = texts_sha256
    _write_manifest(path, manifest)


def _bar(total: int, done: int, progress: bool) -> Any:
    if not progress:
        return None
    return tqdm(total=total, initial=done, unit="text", desc="collecting activations")


def _readable(folder: Any) -> tuple[Path, dict]:
    path = Path(os.path.expanduser(os.fspath(folder)))
    if not path.is_dir():
        raise InvalidCollection(f"{path} is not a collection folder: it does not exist or is not a folder")
    manifest = files.read_manifest(path)
    if manifest is None:
        raise InvalidCollection(f"{path / MANIFEST} is missing: {path} holds no collection (collect_activations "
                                "writes one)")
    unnamed = files.unnamed_shards(path, manifest)
    if unnamed:
        raise InvalidCollection(f"{path} holds shards its manifest does not name ({', '.join(unnamed[:4])}): move "
                                "them away (a collection's rows are those its manifest names)")
    return path, manifest


def iterate_activations(folder: str | os.PathLike, batch_rows: int | None = None) -> Iterator[torch.Tensor]:
    """The rows of a collection, shard by shard (``batch_rows``: in batches of that many rows), in corpus order.

    Each shard is verified against the manifest as it is read (size, digest, rows, dtype, shape, texts): a damaged,
    missing, reordered or unnamed shard is `InvalidCollection` naming the file.
    """
    if batch_rows is not None and (isinstance(batch_rows, bool) or not isinstance(batch_rows, int)
                                   or batch_rows < 1):
        raise InvalidArgument(f"iterate_activations: batch_rows={batch_rows!r}; it is a positive int or None")
    path, manifest = _readable(folder)
    for index in range(len(manifest["shards"])):
        activations = files.read_shard(path, manifest, index)["activations"]
        if batch_rows is None:
            yield activations
        else:
            yield from activations.split(batch_rows)


def load_activations(folder: str | os.PathLike) -> torch.Tensor:
    """Every row of a collection, ``[rows, *shape]`` (verified as `iterate_activations` verifies it)."""
    path, _ = _readable(folder)
    parts = list(iterate_activations(path))
    if not parts:
        raise InvalidCollection(f"{path / MANIFEST} names no shard yet: the collection holds no rows")
    return torch.cat(parts)
