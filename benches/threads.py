"""Thread counts for everything the benchmarks measure: oxibonsai's pool and numpy's OpenBLAS.

A baseline that silently uses more cores than our kernel is not a comparison, so `limit_threads(n)` sets
both and restores both. OpenBLAS is reached through the library that numpy's wheel bundles
(`numpy.libs/*openblas*`); where that is not found (a distro numpy, Accelerate) BLAS keeps its own
default and `blas_threads()` says None, which the results record.

OpenBLAS workers busy-wait for a while (2^28 cycles by default, ~0.1 s) after each call; on a 2-core
machine they can take a core from whatever runs next. `settle_blas()` waits that out after each BLAS
benchmark (a precaution: the machine was too busy to measure the effect cleanly when this was written).
"""

from __future__ import annotations

import contextlib
import ctypes
import time
from collections.abc import Iterator
from functools import cache
from pathlib import Path

import numpy as np

from oxibonsai import get_num_threads, set_num_threads

_SYMBOLS = (  # (set, get) as exported by scipy-openblas (numpy >= 2 wheels) and by plain OpenBLAS
    ("scipy_openblas_set_num_threads64_", "scipy_openblas_get_num_threads64_"),
    ("openblas_set_num_threads64_", "openblas_get_num_threads64_"),
    ("openblas_set_num_threads", "openblas_get_num_threads"),
)


@cache
def _openblas() -> tuple[ctypes._CFuncPtr, ctypes._CFuncPtr] | None:
    libs = Path(np.__file__).resolve().parent.parent / "numpy.libs"
    for path in sorted(libs.glob("*openblas*.so*")):
        lib = ctypes.CDLL(str(path))  # already loaded by numpy: dlopen hands back the same library
        for set_name, get_name in _SYMBOLS:
            if hasattr(lib, set_name) and hasattr(lib, get_name):
                return getattr(lib, set_name), getattr(lib, get_name)
    return None


def blas_threads() -> int | None:
    funcs = _openblas()
    return None if funcs is None else int(funcs[1]())


def set_blas_threads(n: int) -> None:
    funcs = _openblas()
    if funcs is not None:
        funcs[0](ctypes.c_int(n))


def settle_blas(seconds: float = 0.3) -> None:
    """Sleep until OpenBLAS's spinning workers have gone to sleep, so the next benchmark has the cores."""
    time.sleep(seconds)


@contextlib.contextmanager
def limit_threads(n: int) -> Iterator[None]:
    """Run oxibonsai and OpenBLAS with `n` threads each, then put both back."""
    ours, blas = get_num_threads(), blas_threads()
    set_num_threads(n)
    set_blas_threads(n)
    try:
        yield
    finally:
        set_num_threads(ours)
        if blas is not None:
            set_blas_threads(blas)
