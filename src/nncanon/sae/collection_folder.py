"""An activation collection's folder on disk: its lock, its manifest and its shards, each verified as it is read.

What a collection folder holds (`nncanon.sae.collection` writes it):

- ``manifest.json``: the settings the rows were collected with, the shards in order, each with its ``rows``, the
  ``texts`` ``[first, end)`` it covers, its ``bytes`` and ``sha256``; ``pending``: a shard renamed into place
  whose manifest entry was not yet written (an interruption at that moment), adopted on resume if it is whole.
- ``activations-00000.safetensors``...: the shards.
- ``.lock``: held (``flock``) by the one collector writing the folder, with its pid and host in it. The kernel
  drops the lock when the process ends, ``kill -9`` included: a lock left by a dead collector holds nothing.

Every file is opened without following a link and without blocking (``O_NOFOLLOW | O_NONBLOCK``), and refused
unless it is a regular file: a FIFO or a device at a manifest or shard name is named, never waited on. New files
are written to a temporary file made exclusively in the folder (`tempfile.mkstemp`, ``O_EXCL``) and renamed over
their name: a link planted at a shard's or the manifest's name is replaced, never written through. Every failure
is `InvalidCollection` naming the file.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load as load_bytes
from safetensors.torch import save as save_bytes

from .. import files
from ..errors import InvalidCollection

MANIFEST = "manifest.json"
LOCK = ".lock"
#: The format this module writes; ``/1`` (no digests) is still read.
FORMAT = "nncanon-activations/2"
FORMATS = ("nncanon-activations/1", FORMAT)
TEMPORARY_PREFIX = files.TEMPORARY_PREFIX


def shard_name(index: int) -> str:
    """The file name of shard ``index``: ``activations-00003.safetensors``."""
    return f"activations-{index:05d}.safetensors"


def read_regular(path: Path, what: str) -> bytes:
    """The bytes of ``path``, refused (`InvalidCollection`) unless it is a regular file: never through a link,
    never blocking on a FIFO (`nncanon.files.read_regular`)."""
    return files.read_regular(path, f"the {what} of the collection", InvalidCollection)


def write_new(folder: Path, name: str, data: bytes) -> None:
    """Write ``data`` as ``folder/name``: to a temporary file created exclusively in ``folder``, synced, then
    renamed over ``name`` (whatever was at ``name``, a planted link included, is replaced, never written through)."""
    files.write_new(folder, name, data, InvalidCollection, owner="the collection")


def remove_temporaries(folder: Path) -> None:
    """Remove temporary files an interrupted collector left (only regular files this module names so)."""
    files.remove_temporaries(folder)


def locked(folder: Path) -> contextlib.AbstractContextManager[None]:
    """Hold the folder's lock while the block runs; a folder another collector holds is `InvalidCollection` naming
    the holder (its pid and host)."""
    return files.locked(folder, LOCK, InvalidCollection, "two collectors in one folder would mix their rows (another "
                        "collector holds it). Wait for it to finish, or collect into another folder")


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def encode_shard(tensors: dict[str, torch.Tensor]) -> bytes:
    """A shard's bytes (safetensors)."""
    return save_bytes(tensors)


def read_manifest(folder: Path) -> dict | None:
    """The folder's manifest, its structure checked; ``None`` where it has none."""
    path = folder / MANIFEST
    try:
        os.lstat(path)
    except FileNotFoundError:
        return None
    except OSError as error:
        raise InvalidCollection(f"{path} cannot be read ({error.strerror})") from None
    data = read_regular(path, "manifest")
    try:
        manifest = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as error:
        raise InvalidCollection(f"{path} is not a manifest nncanon wrote: it is not valid JSON ({error}); it was cut "
                                "or edited. Collect again into an empty folder") from None
    _check_structure(manifest, path)
    return manifest


def _check_structure(manifest: Any, path: Path) -> None:
    def bad(what: str) -> InvalidCollection:
        return InvalidCollection(f"{path} is not a manifest nncanon wrote ({what}); it was edited or comes from "
                                 "elsewhere. Collect again into an empty folder")

    if not isinstance(manifest, dict):
        raise bad(f"it holds a {type(manifest).__name__}, not an object")
    if manifest.get("format") not in FORMATS:
        raise bad(f"format {manifest.get('format')!r}, not one of {', '.join(FORMATS)}")
    for key in ("rows", "texts_done", "texts_total"):
        value = manifest.get(key)
        if type(value) is not int or value < 0:
            raise bad(f"{key} is {value!r}, not a count")
    shards = manifest.get("shards")
    if not isinstance(shards, list):
        raise bad("shards is not a list")
    digests = manifest["format"] == FORMAT
    end, rows = 0, 0
    for index, shard in enumerate(shards):
        if not isinstance(shard, dict):
            raise bad(f"shard {index} is not an object")
        if shard.get("file") != shard_name(index):
            raise bad(f"shard {index} is {shard.get('file')!r}, not {shard_name(index)!r}: the shards were reordered")
        texts = shard.get("texts")
        if not (isinstance(texts, list) and len(texts) == 2 and all(type(t) is int for t in texts)
                and texts[0] == end and texts[1] > texts[0]):
            raise bad(f"shard {index} covers texts {texts!r}, not [{end}, ...): the shards were reordered or edited")
        end = texts[1]
        if type(shard.get("rows")) is not int or shard["rows"] < 0:
            raise bad(f"shard {index} has rows {shard.get('rows')!r}")
        rows += shard["rows"]
        if digests and not (isinstance(shard.get("sha256"), str) and type(shard.get("bytes")) is int):
            raise bad(f"shard {index} has no sha256 and bytes")
    if rows != manifest["rows"] or end != manifest["texts_done"]:
        raise bad(f"its shards hold {rows} rows of {end} texts, but it says {manifest['rows']} rows of "
                  f"{manifest['texts_done']} texts")
    if manifest["texts_done"] > manifest["texts_total"]:
        raise bad(f"texts_done {manifest['texts_done']} exceeds texts_total {manifest['texts_total']}")


def read_shard(folder: Path, manifest: dict, index: int) -> dict[str, torch.Tensor]:
    """Shard ``index``'s tensors, verified against the manifest (size, digest, rows, dtype, shape, texts)."""
    entry = manifest["shards"][index]
    path = folder / entry["file"]
    data = read_regular(path, f"shard {index}")
    if "sha256" in entry and (len(data) != entry["bytes"] or sha256(data) != entry["sha256"]):
        raise InvalidCollection(f"{path} is not the shard the manifest names ({len(data)} bytes, {entry['bytes']} "
                                "written): it was cut, edited or swapped with another shard. Collect again into an "
                                "empty folder")
    try:
        tensors = load_bytes(data)
    except (SafetensorError, ValueError, RuntimeError) as error:
        raise InvalidCollection(f"{path} cannot be read as safetensors ({error}): it was cut or edited") from None
    _check_shard(tensors, entry, manifest, path)
    return tensors


def _check_shard(tensors: dict, entry: dict, manifest: dict, path: Path) -> None:
    missing = sorted({"activations", "text", "position"} - set(tensors))
    if missing:
        raise InvalidCollection(f"{path} has no {', '.join(missing)}: it is not a shard nncanon wrote")
    activations, text = tensors["activations"], tensors["text"]
    rows = entry["rows"]
    if activations.shape[0] != rows or text.shape != (rows,) or tensors["position"].shape != (rows,):
        raise InvalidCollection(f"{path} holds {activations.shape[0]} rows, the manifest says {rows}")
    dtype, shape = manifest.get("dtype"), manifest.get("shape")
    if str(activations.dtype).removeprefix("torch.") != dtype or list(activations.shape[1:]) != shape:
        raise InvalidCollection(f"{path} holds {activations.dtype} {list(activations.shape[1:])} rows, the "
                                f"manifest says {dtype} {shape}: it comes from another collection")
    first, end = entry["texts"]
    if rows and (int(text.min()) < first or int(text.max()) >= end or bool((text.diff() < 0).any())):
        raise InvalidCollection(f"{path} holds rows of texts outside [{first}, {end}) or out of order")


def unnamed_shards(folder: Path, manifest: dict | None) -> list[str]:
    """Shard files in ``folder`` the manifest does not name (the pending one aside)."""
    named = {shard["file"] for shard in (manifest or {}).get("shards", [])}
    pending = ((manifest or {}).get("pending") or {}).get("file")
    return sorted(entry.name for entry in os.scandir(folder)
                  if entry.name.startswith("activations-") and entry.name.endswith(".safetensors")
                  and entry.name not in named and entry.name != pending)
