"""Files nncanon writes and reads on the user's behalf, safely: one copy of the rules every writer follows.

- Reading: `read_regular` refuses anything but a regular file (a FIFO, a device, a folder, a link: named, never
  opened, so never waited on) and reads it without following a link (``O_NOFOLLOW | O_NONBLOCK``).
- Writing: `write_new` and `write_all` write each file to a temporary file created exclusively in the target
  folder (`tempfile.mkstemp`, ``O_EXCL``), synced, then renamed over its name: a reader sees the old file or the
  whole new one, never a part; a link planted at the name is replaced, never written through; `write_all` renames
  nothing until every file of the set is written whole (a full disk leaves the old set, and no temporary).
- `locked`: one writer of a folder at a time (``flock`` on a lock file holding the writer's pid and host; the kernel
  drops it when the process ends, ``kill -9`` included), waiting up to ``wait`` seconds for another writer.
- `unwritable` and `folder_problem`: why files cannot be written into a folder, found before any work.

Every failure is the caller's named error (``error``: an `nncanon.errors.NncanonError` class) naming the file.
"""

from __future__ import annotations

import contextlib
import os
import socket
import stat
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import IO

#: The prefix of the temporary files `write_new` and `write_all` make (removed by `remove_temporaries`).
TEMPORARY_PREFIX = ".nncanon-tmp-"

_OPEN_FLAGS = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)

#: What `write_all` writes per name: the bytes, or a function writing them to an open binary file.
Content = bytes | Callable[[IO[bytes]], None]


def kind(mode: int) -> str:
    """What a file of ``mode`` (``os.lstat``'s ``st_mode``) is, in words: ``"a FIFO"``, ``"a symbolic link"``..."""
    for test, name in ((stat.S_ISLNK, "a symbolic link"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISDIR, "a folder"),
                       (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISREG, "a regular file")):
        if test(mode):
            return name
    return "not a regular file"


def read_regular(path: Path, what: str, error: type[Exception]) -> bytes:
    """The bytes of ``path`` (``what``: the file's role, for the messages), refused (``error``) unless it is a regular
    file: never through a link, never blocking on a FIFO."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        raise error(f"{path} is missing: {what}") from None
    except OSError as problem:
        raise error(f"{path} cannot be read ({problem.strerror}): {what}") from None
    if not stat.S_ISREG(mode):
        raise error(f"{path} is {kind(mode)}, not a regular file: {what} is a file nncanon wrote; move it away")
    try:
        descriptor = os.open(path, _OPEN_FLAGS)
    except OSError as problem:
        raise error(f"{path} cannot be opened ({problem.strerror}): {what}") from None
    try:
        if not stat.S_ISREG(os.fstat(descriptor).st_mode):  # replaced between the lstat and the open
            raise error(f"{path} is not a regular file: {what} is a file nncanon wrote")
        with os.fdopen(descriptor, "rb", closefd=False) as handle:
            return handle.read()
    except OSError as problem:
        raise error(f"{path} cannot be read ({problem.strerror}): {what}") from None
    finally:
        os.close(descriptor)


def check_replaceable(target: Path, error: type[Exception]) -> None:
    """Refuse (``error``) a name held by anything a rename must not replace: a folder, a FIFO, a device."""
    try:
        existing = os.lstat(target).st_mode
    except FileNotFoundError:
        return
    except OSError as problem:
        raise error(f"{target} cannot be written ({problem.strerror})") from None
    if not (stat.S_ISREG(existing) or stat.S_ISLNK(existing)):
        raise error(f"{target} is {kind(existing)}, not a regular file: move it away")


def write_all(folder: Path, contents: Mapping[str, Content], error: type[Exception], owner: str = "nncanon") -> None:
    """Write every ``folder/name`` of ``contents`` (bytes, or a writer of an open binary file) at once: each to an
    exclusive temporary file in ``folder``, synced; then, all written, each renamed over its name. A failure
    (a full disk, a folder made read-only) renames nothing and removes the temporaries: ``error`` naming the file.
    ``owner``: who writes, for the messages (``"the collection"``, ``"nncanon graph"``)."""
    for name in contents:
        check_replaceable(folder / name, error)
    staged: list[tuple[str, str]] = []
    try:
        for name, content in contents.items():
            try:
                descriptor, temporary = tempfile.mkstemp(prefix=TEMPORARY_PREFIX, dir=folder)
            except OSError as problem:
                raise error(f"{folder} is not writable ({problem.strerror}): {owner} cannot write {name} there"
                            ) from None
            staged.append((temporary, name))
            try:
                with os.fdopen(descriptor, "wb") as handle:
                    if isinstance(content, bytes):
                        handle.write(content)
                    else:
                        content(handle)
                    handle.flush()
                    os.fsync(handle.fileno())
            except OSError as problem:
                raise error(f"{folder / name} cannot be written ({problem.strerror}); nothing was replaced") from None
        for temporary, name in staged:
            try:
                os.replace(temporary, folder / name)
            except OSError as problem:
                raise error(f"{folder / name} cannot be written ({problem.strerror})") from None
        staged = []
    finally:
        for temporary, _ in staged:
            with contextlib.suppress(OSError):
                os.unlink(temporary)


def write_new(folder: Path, name: str, data: bytes, error: type[Exception], owner: str = "nncanon") -> None:
    """Write ``data`` as ``folder/name`` (`write_all` of one file)."""
    write_all(folder, {name: data}, error, owner)


def remove_temporaries(folder: Path) -> None:
    """Remove temporary files an interrupted writer left (only regular files this module names so)."""
    for entry in os.scandir(folder):
        if entry.name.startswith(TEMPORARY_PREFIX) and entry.is_file(follow_symlinks=False):
            with contextlib.suppress(OSError):
                os.unlink(entry.path)


@contextlib.contextmanager
def locked(folder: Path, name: str, error: type[Exception], busy: str, wait: float = 0.0) -> Iterator[None]:
    """Hold ``folder/name``'s lock while the block runs, waiting up to ``wait`` seconds for another holder; then
    ``error`` with ``busy`` (what to do) and the holder (its pid and host)."""
    import fcntl

    path = folder / name
    flags = os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
    try:
        descriptor = os.open(path, flags, 0o644)
    except OSError as problem:
        raise error(f"{path} cannot be created ({problem.strerror}): the folder is not writable, or its lock is not "
                    "a regular file") from None
    try:
        if not stat.S_ISREG(os.fstat(descriptor).st_mode):
            raise error(f"{path} is not a regular file: the folder's lock is; move it away")
        deadline = time.monotonic() + wait
        while True:
            try:
                fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    holder = os.pread(descriptor, 200, 0).decode("utf-8", "replace").strip() or "another process"
                    raise error(f"{folder} is being written by {holder}{f' (waited {wait:g} s)' if wait else ''}: "
                                f"{busy}") from None
                time.sleep(0.05)
        os.ftruncate(descriptor, 0)
        os.pwrite(descriptor, f"pid {os.getpid()} on {socket.gethostname()}".encode(), 0)
        yield
    finally:
        os.close(descriptor)  # (drops the lock)


def unwritable(folder: Path) -> str | None:
    """Why files cannot be written into ``folder``, or ``None`` if they can (nothing is created to find out)."""
    existing = folder.absolute()
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        return f"cannot create the folder: {existing} is a file"
    if not os.access(existing, os.W_OK | os.X_OK):
        return f"cannot write into {existing}"
    return None


def folder_problem(folder: Path) -> str | None:
    """Why ``folder`` cannot be the folder files are written into (a phrase to follow its name: ``"it is a FIFO, not
    a folder"``), or ``None``: the name itself a symbolic link (a link may point anywhere: give the folder it names),
    a FIFO, a file or a device; or `unwritable`."""
    try:
        mode = os.lstat(folder).st_mode
    except (FileNotFoundError, NotADirectoryError):
        return unwritable(folder)
    except OSError as problem:
        return f"it cannot be read ({problem.strerror})"
    if stat.S_ISLNK(mode):
        try:
            points = os.readlink(folder)
        except OSError:
            points = "?"
        return f"it is a symbolic link (to {points}): give the folder itself, not a link to it"
    if not stat.S_ISDIR(mode):
        return f"it is {kind(mode)}, not a folder"
    return unwritable(folder)
