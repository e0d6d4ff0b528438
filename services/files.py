"""Files written whole or not at all, and files read only when they are what they seem.

``iserve up`` writes its record, the embedded Redis's password, config and port, and
the stack's tokens (:func:`write_private`). A full disk failed those writes with only
"[Errno 28] No space left on device" (a write's OSError carries no file name, unlike an
open's), and left a partial file behind.

A file someone else names (a checkpoint's, a profile to import) is read by
:func:`read_regular_file`: a named pipe blocked its reader for ever, and /dev/zero or a
huge file was read into memory before anything said it was too large.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from pathlib import Path


def write_private(path: Path, text: str, *, exclusive: bool = False, sync: bool = False) -> None:
    """Write ``text`` to ``path``, readable by its owner only (mode 0600, also where an
    older file was wider), whole or not at all: a temporary file beside it renamed into
    place. ``exclusive``: refuse (FileExistsError) where ``path`` exists. ``sync``: on
    the disk before the rename (a secret a crash must not leave empty).

    An OSError names ``path``, and nothing of the attempt is left behind."""
    # Exclusive: the file itself, made by this open (O_EXCL) and removed on failure.
    target = path if exclusive else path.with_name(path.name + ".partial")
    made = False
    try:
        flags = os.O_WRONLY | os.O_CREAT | (os.O_EXCL if exclusive else os.O_TRUNC)
        fd = os.open(target, flags, 0o600)
        made = True
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            os.fchmod(fd, 0o600)  # a partial left by an older iserve may be wider
            out.write(text)
            out.flush()
            if sync:
                os.fsync(out.fileno())
        if not exclusive:
            os.replace(target, path)
    except OSError as exc:
        if made:
            with contextlib.suppress(OSError):  # a disk that refuses writes may refuse this
                target.unlink()
        if exc.filename is not None:  # an open's, a rename's: the file is named
            raise
        raise type(exc)(exc.errno, exc.strerror or str(exc), str(path)) from None


class NotRegularFile(ValueError):
    """The path names no regular file (a named pipe, a device)."""


class FileTooLarge(ValueError):
    """The file holds more than it may: ``size`` bytes."""

    def __init__(self, size: int) -> None:
        super().__init__(f"{size} bytes")
        self.size = size


def read_regular_file(path: str | Path, limit: int) -> bytes:
    """The bytes of the regular file ``path``, opened without blocking (a named pipe's
    open waits for a writer) and read only when it holds at most ``limit`` bytes:
    NotRegularFile, FileTooLarge otherwise; OSError as opening or reading raises it (no
    such file, a directory).
    Read as large as the file: ``read(limit + 1)`` takes that much memory at once."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        status = os.fstat(fd)
        if stat.S_ISDIR(status.st_mode):  # as reading one says
            raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), str(path))
        if not stat.S_ISREG(status.st_mode):
            raise NotRegularFile(str(path))
        if status.st_size > limit:
            raise FileTooLarge(status.st_size)
    except BaseException:
        os.close(fd)
        raise
    with os.fdopen(fd, "rb") as file:
        data = file.read(status.st_size + 1)
    if len(data) > limit:  # grown since
        raise FileTooLarge(len(data))
    return data
