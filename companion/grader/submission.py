"""A submission's bytes, read as data: the one way the grader opens a learner's file.

A submission folder is the learners' to fill: a file there may be a FIFO (which blocks whoever opens
it for reading until a writer comes), a device, a socket, or a symlink to `/dev/zero` or to a file
only the grader's user may read. `read_submission` opens nothing but a regular file, follows no
symlink, never blocks, and reads at most `cap` bytes: the path is checked with lstat first, then
opened with O_NOFOLLOW | O_NONBLOCK (so a file swapped for a symlink or a FIFO in between is refused
too, not followed or waited on) and the open descriptor is checked again with fstat. What it
refuses raises `Unreadable`, whose message says why and never shows the target's content.
(open(2): O_NOFOLLOW fails with ELOOP on a symlink; fifo(7): O_NONBLOCK opens a FIFO for reading
without waiting for a writer.)
"""
from __future__ import annotations

import errno
import hashlib
import os
import stat

__all__ = ["MAX_NOTEBOOK", "Unreadable", "read_submission", "digest"]

MAX_NOTEBOOK = 50 * 2**20      # the largest notebook the grader reads (job.py's earlier limit)

_KINDS = {stat.S_IFIFO: "a FIFO (named pipe)", stat.S_IFCHR: "a character device",
          stat.S_IFBLK: "a block device", stat.S_IFSOCK: "a socket", stat.S_IFDIR: "a folder",
          stat.S_IFLNK: "a symbolic link"}


class Unreadable(ValueError):
    """A submission the grader will not read; the message says why."""


def _kind(mode: int) -> str:
    return _KINDS.get(stat.S_IFMT(mode), "not a regular file")


def read_submission(path, cap: int = MAX_NOTEBOOK) -> bytes:
    """The bytes of the regular file at `path` (at most `cap`), or Unreadable saying why not."""
    try:
        before = os.lstat(path)
    except OSError as e:
        raise Unreadable(f"cannot read it: {e.strerror}") from None
    if not stat.S_ISREG(before.st_mode):
        raise Unreadable(f"not a notebook file: it is {_kind(before.st_mode)}, which the grader "
                         "does not open (submit the .ipynb file itself)")
    if before.st_size > cap:
        raise Unreadable(_too_big(before.st_size, cap))
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
                     | getattr(os, "O_NOCTTY", 0))
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise Unreadable("not a notebook file: it became a symbolic link while the grader "
                             "looked at it") from None
        raise Unreadable(f"cannot read it: {e.strerror}") from None
    try:
        now = os.fstat(fd)
        if not stat.S_ISREG(now.st_mode):
            raise Unreadable(f"not a notebook file: it became {_kind(now.st_mode)} while the "
                             "grader looked at it")
        chunks, left = [], cap + 1
        while left > 0:
            chunk = os.read(fd, min(left, 1 << 20))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
    except OSError as e:
        raise Unreadable(f"cannot read it: {e.strerror}") from None
    finally:
        os.close(fd)
    data = b"".join(chunks)
    if len(data) > cap:
        raise Unreadable(_too_big(len(data), cap, grew=True))
    return data


def _too_big(size: int, cap: int, *, grew: bool = False) -> str:
    got = "it grew past" if grew else f"the file is {size / 2**20:.1f} MiB, over"
    return f"{got} the {cap / 2**20:g} MiB a notebook may have"


def digest(path, cap: int = MAX_NOTEBOOK) -> str | None:
    """SHA-256 of the submission as `read_submission` reads it; None where it refuses it."""
    try:
        return hashlib.sha256(read_submission(path, cap)).hexdigest()
    except Unreadable:
        return None
