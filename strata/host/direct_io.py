"""Reads that bypass the page cache, and the process's memory high-water mark.

The third tier is the SSD: expert blobs and PLE rows that are not in a RAM tier are read from the GGUF with
O_DIRECT, so what comes in lands in the engine's own (budgeted) memory and nothing is left to the page cache.
O_DIRECT wants the file offset, the length and the buffer address aligned to the device's logical block: every
read here covers the ALIGN-aligned span around the bytes it needs (4096 covers 512-byte and 4K-native devices),
into an ALIGN-aligned buffer, and the bytes wanted are a view into it.

A filesystem that refuses O_DIRECT (tmpfs, some FUSE and network filesystems: EINVAL at open or at the first read)
gets buffered preads instead; `open_file` says so once per process in a logged note and in `DataFile.mode`, which
the engine's open line prints. `direct=False` asks for buffered reads outright (the page cache then holds what was
read: a warm-cache measurement, or the fallback path under test).
"""

from __future__ import annotations

import errno
import logging
import os
import resource
from dataclasses import dataclass

import numpy as np

ALIGN = 4096
log = logging.getLogger("strata.io")
_noted: set[str] = set()          # fallback reasons already logged (one note per reason per process)


def align_down(x: int) -> int:
    return x - x % ALIGN


def align_up(x: int) -> int:
    return -(-x // ALIGN) * ALIGN


def aligned_empty(nbytes: int) -> np.ndarray:
    """uint8 (nbytes,) whose first byte is ALIGN-aligned (over-allocated by ALIGN; the base keeps it alive)."""
    raw = np.empty(nbytes + ALIGN, np.uint8)
    at = -raw.ctypes.data % ALIGN
    return raw[at:at + nbytes]


def spans(parts: list[tuple[int, int]]) -> tuple[list[tuple[int, int, int]], list[int]]:
    """The aligned reads that cover byte ranges `parts` [(file offset, nbytes)], ranges that touch merged into one
    read: ([(file offset, length, buffer offset)], buffer offset of each part); the reads lie back to back in one
    buffer of sum(lengths) bytes, each at an aligned buffer offset."""
    order = sorted(range(len(parts)), key=lambda i: parts[i][0])
    reads: list[list[int]] = []               # [file start, file end, buffer offset]
    at = [0] * len(parts)
    for i in order:
        off, n = parts[i]
        lo, hi = align_down(off), align_up(off + n)
        if reads and lo <= reads[-1][1]:       # touches the previous read: extend it
            reads[-1][1] = max(reads[-1][1], hi)
        else:
            reads.append([lo, hi, reads[-1][2] + reads[-1][1] - reads[-1][0] if reads else 0])
        r = reads[-1]
        at[i] = r[2] + off - r[0]
    return [(lo, hi - lo, b) for lo, hi, b in reads], at


@dataclass
class DataFile:
    """One open file to read from: `fd` (O_DIRECT when `direct`), and `mode`, how its reads go, in words."""
    path: str
    fd: int
    direct: bool
    mode: str

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


REFUSED = (errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP)      # a filesystem's answers to O_DIRECT it does not do


def _open_direct(path: str) -> int:
    """An O_DIRECT descriptor of path; OSError where the filesystem refuses (probed with one aligned read)."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        os.preadv(fd, [memoryview(aligned_empty(ALIGN))], 0)
    except OSError as e:
        os.close(fd)
        if e.errno in REFUSED:
            raise
        raise OSError(e.errno, f"{path}: reading its first block: {e.strerror}") from e     # the file's own error
    return fd


def open_file(path: str, direct: bool = True) -> DataFile:
    """path for reading, with O_DIRECT unless `direct` is False or the filesystem refuses it (then buffered
    preads, with a note logged once)."""
    if direct:
        try:
            return DataFile(path, _open_direct(path), True, "O_DIRECT (page cache bypassed)")
        except OSError as e:
            if e.errno not in REFUSED:
                raise
            why = f"the filesystem refused O_DIRECT ({errno.errorcode.get(e.errno, e.errno)})"
            if why not in _noted:
                _noted.add(why)
                log.info("strata: %s: %s; reading with buffered pread, the page cache holds what is read", path, why)
            return DataFile(path, os.open(path, os.O_RDONLY), False, f"buffered pread: {why}")
    return DataFile(path, os.open(path, os.O_RDONLY), False, "buffered pread (direct I/O off)")


def pread_into(fd: int, buf: np.ndarray, offset: int, path: str, what: str, need: int | None = None) -> None:
    """Fill buf (contiguous uint8) from the file at offset, at least its first `need` bytes (default: all: an
    aligned read may run past the file's end); OSError naming the file and the read on an error or a short read."""
    view = memoryview(buf).cast("B")
    need = len(view) if need is None else need
    done = 0
    while done < need:
        try:
            n = os.preadv(fd, [view[done:]], offset + done)
        except OSError as e:
            raise OSError(e.errno, f"{path}: {what} (byte {offset + done}): {e.strerror}") from e
        if n == 0:
            raise OSError(f"{path}: {what}: the file ends at byte {offset + done}, {need - done} bytes short")
        done += n


def ram_bytes() -> int:
    """The machine's physical memory."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def peak_rss_bytes() -> int:
    """The process's peak resident set: VmHWM (anonymous memory and the mapped file pages it touched; ~20 us to
    read). Not getrusage's ru_maxrss where /proc has it: Linux carries that across exec, so a process started by
    a larger one (subprocess's vfork) reports its parent's peak."""
    try:
        with open("/proc/self/status", "rb") as f:
            for line in f:
                if line.startswith(b"VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024        # KiB on Linux


def rss_bytes() -> dict[str, int]:
    """Resident memory now, from /proc/self/status: {"rss", "anon", "file", "peak"} in bytes (peak only off
    Linux)."""
    out = {"peak": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}      # replaced by VmHWM below
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                key, _, val = line.partition(":")
                name = {"VmRSS": "rss", "RssAnon": "anon", "RssFile": "file", "VmHWM": "peak"}.get(key)
                if name is not None:
                    out[name] = int(val.split()[0]) * 1024
    except OSError:
        pass
    return out
