"""Giving freed heap memory back to the operating system after large temporary buffers.

fp32 copies of bf16 weights are packed from a widened temporary of each weight. glibc raises its mmap threshold
after the first large free, so the later temporaries come from the heap, and the heap keeps what they freed: without
a trim, a bf16 model's process held about a third of its fp32 copies' size more than the copies themselves.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable


@functools.lru_cache(maxsize=1)
def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's malloc_trim, or None where the C library has none (musl, macOS, Windows)."""
    try:
        libc = ctypes.CDLL(None)
    except OSError:  # pragma: no cover - no C library to open
        return None
    return getattr(libc, "malloc_trim", None)


def release_free_memory() -> None:
    """Return the heap's free memory to the OS where the C library can (glibc); a no-op elsewhere."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)
