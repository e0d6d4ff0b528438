"""write_private: whole or not at all, the owner's alone, and an error naming the file.
A full disk is /dev/full (every write to it fails with ENOSPC), linked where the
temporary file goes."""

from __future__ import annotations

import errno
import os
import stat

import pytest

from services.files import write_private

pytestmark = pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")


def test_a_full_disk_names_the_file_and_leaves_the_old_one_whole(tmp_path):
    path = tmp_path / "stack.json"
    path.write_text("before")
    (tmp_path / "stack.json.partial").symlink_to("/dev/full")
    with pytest.raises(OSError) as full:
        write_private(path, "after" * 10_000)
    assert full.value.errno == errno.ENOSPC
    assert full.value.filename == str(path)
    assert str(path) in str(full.value)  # it said only "[Errno 28] No space left on device"
    assert path.read_text() == "before"
    assert not os.path.lexists(tmp_path / "stack.json.partial")


def test_an_exclusive_write_never_follows_or_replaces_what_is_there(tmp_path):
    path = tmp_path / "token"
    os.symlink("/dev/full", path)
    with pytest.raises(FileExistsError):
        write_private(path, "x", exclusive=True)
    assert path.is_symlink()  # not removed: this write did not make it


def test_it_writes_the_owner_s_file_replacing_a_wider_one(tmp_path):
    path = tmp_path / "password"
    path.write_text("old")
    path.chmod(0o644)
    partial = tmp_path / "password.partial"
    partial.write_text("left by a start that was killed")
    partial.chmod(0o666)
    write_private(path, "new\n", sync=True)
    assert path.read_text() == "new\n"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert not partial.exists()
    write_private(tmp_path / "token", "t\n", exclusive=True)
    assert stat.S_IMODE((tmp_path / "token").stat().st_mode) == 0o600
    with pytest.raises(FileExistsError, match="token"):
        write_private(tmp_path / "token", "u\n", exclusive=True)
    assert (tmp_path / "token").read_text() == "t\n"


def test_a_file_to_read_is_a_regular_one_within_its_bound(tmp_path):
    """read_regular_file: a named pipe is refused without waiting for a writer (its open
    blocked the reader for ever), a file over the bound before it is read."""
    from services.files import FileTooLarge, NotRegularFile, read_regular_file

    pipe = tmp_path / "pipe"
    os.mkfifo(pipe)
    with pytest.raises(NotRegularFile):
        read_regular_file(pipe, 10)
    with pytest.raises(IsADirectoryError):
        read_regular_file(tmp_path, 10)
    big = tmp_path / "big"
    with big.open("wb") as out:
        out.truncate(11)
    with pytest.raises(FileTooLarge) as too_large:
        read_regular_file(big, 10)
    assert too_large.value.size == 11
    assert read_regular_file(big, 11) == b"\0" * 11
    with pytest.raises(FileNotFoundError):
        read_regular_file(tmp_path / "none", 10)
