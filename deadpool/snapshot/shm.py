"""Same-host snapshot slots in shared memory: files a buddy maps instead of receiving over TCP.

When a seat's buddy runs on the same host, streaming every snapshot through
ZeroMQ over loopback costs a copy into the kernel, a copy out, and the CPU of
two ZeroMQ I/O threads, every step.  Instead the ward allocates its two
snapshot arenas as files in a tmpfs directory (``Config.shm_dir``, by default
``/dev/shm``), and its ``SnapshotHeader`` names the file; the buddy maps it
read-only and holds the copy as a view of the mapping (no copy at all).  A
mapping keeps the pages alive after the ward dies (SIGKILL) and after its file
is unlinked, which is exactly when the copy is needed.

This module is the file side of that: naming, creating (writer), validating
and mapping (reader), the head block, and removing a worker's files (its host
agent, after the worker exits).  Why a buddy may hold the ward's slot without
copying it is argued in ``docs/design/snapshots.md`` (same-host copies).

Head block.  A slot file starts with ``HEAD_BYTES`` holding the encoded,
authenticated ``SnapshotHeader`` of the snapshot the slot holds, under a
sequence lock: the ward makes the count odd before it rewrites the slot and
even again once the header is written, after the copy completed.  A buddy that
maps the file reads the head when it must know what the slot holds (a view
change asks, a restore asks) instead of being sent a header and acking it at
every step.  The arena follows at offset ``HEAD_BYTES``.
"""

from __future__ import annotations

import contextlib
import glob
import mmap
import os
import re
import stat
import struct
from dataclasses import dataclass

PREFIX = "deadpool-"
HEAD_BYTES = 1 << 20  # a slot file's head block: the largest control frame fits (transport's frame limit)
_HEAD = struct.Struct("<QQ")  # sequence count (odd: being rewritten), length of the header frame that follows


def _sanitized(member: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.]", "_", member)


def slot_path(shm_dir: str, member: str, pid: int, index: int) -> str:
    """The file of one snapshot slot: ``{shm_dir}/deadpool-{member}-{pid}-slot{index}``."""
    return os.path.join(os.path.normpath(shm_dir), f"{PREFIX}{_sanitized(member)}-{pid}-slot{index}")


MEMORY_FILESYSTEMS = ("tmpfs", "hugetlbfs")


def in_memory_filesystem(directory: str, mounts: str | None = None) -> bool:
    """Whether `directory` lies on a memory filesystem (the deepest mount holding it, /proc/self/mounts).

    Only pages of such files can be page-locked for a GPU's copies: Linux refuses long-term
    writable pins of file-backed pages elsewhere.  False when the mount table cannot be read.
    """
    if mounts is None:
        try:
            with open("/proc/self/mounts") as table:
                mounts = table.read()
        except OSError:
            return False
    target = os.path.realpath(directory)
    best, kind = "", ""
    for line in mounts.splitlines():
        fields = line.split()
        if len(fields) < 3:
            continue
        point = fields[1].replace("\\040", " ")
        inside = target == point or target.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= len(best):
            best, kind = point, fields[2]
    return kind in MEMORY_FILESYSTEMS


def create(path: str, nbytes: int) -> mmap.mmap:
    """Create `path` (0600, never an existing file or a symlink), reserve `nbytes`, map it shared.

    The whole size is reserved up front, so a full tmpfs fails here (ENOSPC)
    instead of with SIGBUS when a page is first written.  The file is removed
    again if anything fails.

    Raises:
        OSError: the file exists, the directory is missing or not writable, or the space is not there.
    """
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        os.posix_fallocate(fd, 0, nbytes)
        return mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    except BaseException:
        unlink(path)
        raise
    finally:
        os.close(fd)


def unlink(path: str) -> None:
    """Remove a slot file if it is still there (a buddy's mapping of it stays valid)."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def remove_files(shm_dir: str, member: str, pid: int) -> list[str]:
    """Remove every slot file of one worker (its host agent does this after the worker exits)."""
    if not shm_dir:
        return []
    name = f"{PREFIX}{glob.escape(_sanitized(member))}-{pid}-slot*"
    pattern = os.path.join(glob.escape(os.path.normpath(shm_dir)), name)
    removed = []
    for path in glob.glob(pattern):
        unlink(path)
        removed.append(path)
    return removed


_SLOT_NAME = re.compile(rf"^{PREFIX}.+-(\d+)-slot\d+$")


def sweep_stale(shm_dir: str) -> list[str]:
    """Remove slot files of this user whose writer process no longer exists.

    They are what an agent that was itself SIGKILLed (or whose host rebooted
    its namespace) leaves behind.  Removing a file that is in fact still used
    (a writer in another PID namespace sharing this directory) breaks no copy:
    mappings outlive the name, and a new buddy that cannot open the file falls
    back to TCP.
    """
    if not shm_dir or not os.path.isdir(shm_dir):
        return []
    removed = []
    for entry in os.scandir(shm_dir):
        match = _SLOT_NAME.match(entry.name)
        if match is None or not entry.is_file(follow_symlinks=False):
            continue
        try:
            if entry.stat(follow_symlinks=False).st_uid != os.geteuid():
                continue
            os.kill(int(match.group(1)), 0)
        except ProcessLookupError:
            unlink(entry.path)
            removed.append(entry.path)
        except OSError:
            continue  # another user's process, or the file went meanwhile: not ours to judge
    return removed


def invalidate_head(head: memoryview) -> None:
    """Mark the slot as being rewritten (count odd) before its arena is written; the writer calls this."""
    count, length = _HEAD.unpack_from(head)
    if count % 2 == 0:
        _HEAD.pack_into(head, 0, count + 1, length)


def write_head(head: memoryview, frame: bytes) -> bool:
    """Publish the header of the snapshot the slot now holds (count even); False if it does not fit."""
    if _HEAD.size + len(frame) > len(head):
        return False
    invalidate_head(head)
    count, _ = _HEAD.unpack_from(head)
    head[_HEAD.size : _HEAD.size + len(frame)] = frame
    _HEAD.pack_into(head, 0, count, len(frame))  # the length first, under the odd count
    _HEAD.pack_into(head, 0, count + 1, len(frame))
    return True


def read_head(head: memoryview) -> bytes | None:
    """The header frame of a slot, or None while it is rewritten, never written, or torn by a concurrent write."""
    if len(head) < _HEAD.size:
        return None
    count, length = _HEAD.unpack_from(head)
    if count % 2 or length == 0 or _HEAD.size + length > len(head):
        return None
    frame = bytes(head[_HEAD.size : _HEAD.size + length])
    return frame if _HEAD.unpack_from(head) == (count, length) else None


@dataclass(frozen=True, slots=True)
class Mapping:
    """A read-only mapping of one slot file, with the identity of the file it maps."""

    path: str
    device: int
    inode: int
    size: int
    view: memoryview  # read-only view of the whole mapping


class ShmRefused(Exception):
    """A peer named a file that may not be mapped; the message says why."""


def map_readonly(path: str, shm_dir: str, offset: int, nbytes: int, cached: Mapping | None) -> Mapping:
    """Map a ward's slot file for reading, after checking that it may be trusted.

    The header naming it is authenticated, but a file is not a frame: it must
    lie directly in this process's own `shm_dir`, be named like a slot file, be
    a regular file (not a symlink) owned by this user, and hold `offset +
    nbytes` bytes.  `cached` is reused when it still maps the same file.

    Raises:
        ShmRefused: any check failed (the reason is the message).
    """
    if not shm_dir:
        raise ShmRefused("shared-memory copies are turned off here (shm_dir is empty)")
    if os.path.dirname(path) != os.path.normpath(shm_dir) or os.path.normpath(path) != path:
        raise ShmRefused(f"{path!r} is not a file directly in {shm_dir!r}")
    if not os.path.basename(path).startswith(PREFIX):
        raise ShmRefused(f"{path!r} is not named like a snapshot slot ({PREFIX}*)")
    if offset < 0 or nbytes < 0:
        raise ShmRefused(f"negative offset or size ({offset}, {nbytes})")
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as err:
        raise ShmRefused(f"cannot open {path!r}: {err.strerror}") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise ShmRefused(f"{path!r} is not a regular file")
        if info.st_uid != os.geteuid():
            raise ShmRefused(f"{path!r} belongs to uid {info.st_uid}, not to this user")
        if info.st_size < offset + nbytes:
            raise ShmRefused(f"{path!r} holds {info.st_size} bytes, the header needs {offset + nbytes}")
        if cached is not None and (cached.device, cached.inode) == (info.st_dev, info.st_ino) \
                and cached.size >= offset + nbytes:
            return cached
        if info.st_size == 0:
            raise ShmRefused(f"{path!r} is empty")
        try:
            mapping = mmap.mmap(fd, info.st_size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
        except OSError as err:
            raise ShmRefused(f"cannot map {path!r}: {err.strerror}") from None
        return Mapping(path, info.st_dev, info.st_ino, info.st_size, memoryview(mapping))
    finally:
        os.close(fd)
