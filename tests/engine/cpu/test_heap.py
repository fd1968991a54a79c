"""heap.release_free_memory: glibc's malloc_trim where the process has glibc, a no-op elsewhere."""

import platform

import pytest

from rollout.engine.cpu import heap


def test_release_free_memory_finds_glibc_and_runs():
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        pytest.skip("malloc_trim is glibc's")
    assert heap._malloc_trim() is not None
    buffers = [bytearray(4 << 20) for _ in range(8)]  # freed heap memory to hand back
    del buffers
    heap.release_free_memory()


def test_release_free_memory_is_a_no_op_without_malloc_trim(monkeypatch):
    monkeypatch.setattr(heap, "_malloc_trim", lambda: None)
    heap.release_free_memory()
