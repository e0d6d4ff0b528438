"""Small files the stack keeps for its owner: written whole or not at all, and an error
that names the file.

``iserve up`` writes its record, the embedded Redis's password, config and port, and
the stack's tokens. A full disk failed those writes with only "[Errno 28] No space left
on device" (a write's OSError carries no file name, unlike an open's), and left a
partial file behind.
"""

from __future__ import annotations

import contextlib
import os
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
