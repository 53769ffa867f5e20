"""Host-side byte copies of the gRPC data plane, made cheap: without the GIL and into reused memory.

Profiled on CPU (perf, a 141 MiB state over loopback gRPC): after the socket copies, the time went to
memmove under the GIL (building each message, writing each payload into the receive buffer) and to page
faults on freshly mapped buffers (glibc returns every freed block of >= 128 KiB to the kernel, so each
1 MiB message faulted its pages in again). Here:
  * `keep_freed_host_memory` raises glibc's mmap and trim thresholds once per worker process, so freed
    message buffers are reused instead of unmapped and faulted in again;
  * `copy_bytes` copies through ctypes' memmove, which releases the GIL (several streams then copy in
    parallel instead of one at a time);
  * `new_message` builds a message's `bytes` object with its payload copied in once, without the GIL.
The bytes object is created uninitialized (as CPython's own C code does before filling one) and filled
before any Python code sees it. Where that is not possible (not CPython), it falls back to `b"".join`.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import sys

import numpy as np

logger = logging.getLogger(__name__)

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
MMAP_THRESHOLD_BYTES = 32 << 20  # blocks below this come from the heap (the largest gRPC message is 16 MiB)
TRIM_THRESHOLD_BYTES = 512 << 20  # freed heap memory kept before glibc gives it back


@functools.cache
def keep_freed_host_memory() -> bool:
    """Have glibc keep and reuse freed message-sized blocks (once per process); False where not glibc."""
    name = ctypes.util.find_library("c")
    if sys.platform != "linux" or name is None:
        return False
    try:
        libc = ctypes.CDLL(name)
        ok = bool(libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)) and bool(
            libc.mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES))
    except (OSError, AttributeError):
        return False
    if ok:
        logger.debug("glibc keeps freed blocks below %d MiB for reuse", MMAP_THRESHOLD_BYTES >> 20)
    return ok


def address(buffer: memoryview | bytes | bytearray) -> int:
    """The address of a contiguous buffer's first byte (read-only buffers included)."""
    if isinstance(buffer, bytes):
        return id(buffer) + _BYTES_DATA_OFFSET if _BYTES_DATA_OFFSET is not None else _np_address(buffer)
    return _np_address(buffer)


def _np_address(buffer: memoryview | bytes | bytearray) -> int:
    return int(np.frombuffer(buffer, dtype=np.uint8).ctypes.data) if len(buffer) else 0


def copy_bytes(dst_address: int, src: memoryview | bytes | bytearray) -> None:
    """memcpy of `src` to `dst_address` (caller-checked bounds), the GIL released while it runs."""
    if len(src):
        ctypes.memmove(dst_address, address(src), len(src))


_new_bytes = ctypes.pythonapi.PyBytes_FromStringAndSize
_new_bytes.restype = ctypes.py_object
_new_bytes.argtypes = (ctypes.c_void_p, ctypes.c_ssize_t)


def _bytes_data_offset() -> int | None:
    """Offset of a bytes object's data from its id(), checked on a probe; None: not CPython's layout."""
    if sys.implementation.name != "cpython":
        return None
    offset = sys.getsizeof(b"") - 1  # PyBytesObject header; ob_sval follows it
    probe = _new_bytes(b"hybridserve", 11)
    if ctypes.string_at(id(probe) + offset, 11) != b"hybridserve":
        return None
    return offset


_BYTES_DATA_OFFSET = _bytes_data_offset()


def new_message(head: bytes, payload: memoryview | bytes, tail: bytes) -> bytes:
    """head + payload + tail as one new bytes object; the payload is copied once, without the GIL."""
    if _BYTES_DATA_OFFSET is None or len(payload) < (64 << 10):
        return b"".join((head, payload, tail))
    total = len(head) + len(payload) + len(tail)
    message = _new_bytes(None, total)  # uninitialized: filled below before anything else sees it
    base = id(message) + _BYTES_DATA_OFFSET
    ctypes.memmove(base, head, len(head))
    copy_bytes(base + len(head), payload)
    ctypes.memmove(base + len(head) + len(payload), tail, len(tail))
    return message
