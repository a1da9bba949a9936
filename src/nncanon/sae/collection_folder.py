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
import socket
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load as load_bytes
from safetensors.torch import save as save_bytes

from ..errors import InvalidCollection

MANIFEST = "manifest.json"
LOCK = ".lock"
#: The format this module writes; ``/1`` (no digests) is still read.
FORMAT = "nncanon-activations/2"
FORMATS = ("nncanon-activations/1", FORMAT)
TEMPORARY_PREFIX = ".nncanon-tmp-"

_OPEN_FLAGS = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)


def shard_name(index: int) -> str:
    """The file name of shard ``index``: ``activations-00003.safetensors``."""
    return f"activations-{index:05d}.safetensors"


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISLNK, "a symbolic link"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISDIR, "a folder"),
                       (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device")):
        if test(mode):
            return name
    return "not a regular file"


def read_regular(path: Path, what: str) -> bytes:
    """The bytes of ``path``, refused (`InvalidCollection`) unless it is a regular file: never through a link,
    never blocking on a FIFO."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        raise InvalidCollection(f"{path} is missing: the {what} of the collection") from None
    except OSError as error:
        raise InvalidCollection(f"{path} cannot be read ({error.strerror}): the {what} of the collection") from None
    if not stat.S_ISREG(mode):
        raise InvalidCollection(f"{path} is {_kind(mode)}, not a regular file: the {what} of a collection is a file "
                                "nncanon wrote; move it away")
    try:
        descriptor = os.open(path, _OPEN_FLAGS)
    except OSError as error:
        raise InvalidCollection(f"{path} cannot be opened ({error.strerror}): the {what} of the collection") from None
    try:
        if not stat.S_ISREG(os.fstat(descriptor).st_mode):  # replaced between the lstat and the open
            raise InvalidCollection(f"{path} is not a regular file: the {what} of a collection is a file nncanon wrote")
        with os.fdopen(descriptor, "rb", closefd=False) as handle:
            return handle.read()
    except OSError as error:
        raise InvalidCollection(f"{path} cannot be read ({error.strerror}): the {what} of the collection") from None
    finally:
        os.close(descriptor)


def write_new(folder: Path, name: str, data: bytes) -> None:
    """Write ``data`` as ``folder/name``: to a temporary file created exclusively in ``folder``, synced, then
    renamed over ``name`` (whatever was at ``name``, a planted link included, is replaced, never written through)."""
    target = folder / name
    try:
        existing = os.lstat(target).st_mode
    except FileNotFoundError:
        existing = None
    except OSError as error:
        raise InvalidCollection(f"{target} cannot be written ({error.strerror})") from None
    if existing is not None and not (stat.S_ISREG(existing) or stat.S_ISLNK(existing)):
        raise InvalidCollection(f"{target} is {_kind(existing)}, not a regular file: move it away")
    try:
        descriptor, temporary = tempfile.mkstemp(prefix=TEMPORARY_PREFIX, dir=folder)
    except OSError as error:
        raise InvalidCollection(f"{folder} is not writable ({error.strerror}): the collection cannot write "
                                f"{name} there") from None
    try:
        with os.fdopen(descriptor, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, target)
    except OSError as error:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise InvalidCollection(f"{target} cannot be written ({error.strerror})") from None


def remove_temporaries(folder: Path) -> None:
    """Remove temporary files an interrupted collector left (only regular files this module names so)."""
    for entry in os.scandir(folder):
        if entry.name.startswith(TEMPORARY_PREFIX) and entry.is_file(follow_symlinks=False):
            with contextlib.suppress(OSError):
                os.unlink(entry.path)


@contextlib.contextmanager
def locked(folder: Path) -> Iterator[None]:
    """Hold the folder's lock while the block runs; a folder another collector holds is `InvalidCollection` naming
    the holder (its pid and host)."""
    import fcntl

    path = folder / LOCK
    flags = os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
    try:
        descriptor = os.open(path, flags, 0o644)
    except OSError as error:
        raise InvalidCollection(f"{path} cannot be created ({error.strerror}): the folder is not writable, or its "
                                "lock is not a regular file") from None
    try:
        if not stat.S_ISREG(os.fstat(descriptor).st_mode):
            raise InvalidCollection(f"{path} is not a regular file: the collection's lock is; move it away")
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(descriptor, 200, 0).decode("utf-8", "replace").strip() or "another process"
            raise InvalidCollection(f"{folder} is being written by another collector ({holder}): two collectors in "
                                    "one folder would mix their rows. Wait for it to finish, or collect into "
                                    "another folder") from None
        os.ftruncate(descriptor, 0)
        os.pwrite(descriptor, f"pid {os.getpid()} on {socket.gethostname()}".encode(), 0)
        yield
    finally:
        os.close(descriptor)  # (drops the lock)


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
