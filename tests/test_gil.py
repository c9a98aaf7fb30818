"""Long native calls release the GIL: Python threads keep running while a matmul is in Rust."""

from __future__ import annotations

import threading

import numpy as np

from oxibonsai import Q1Matrix


def test_matmul_releases_the_gil(rng: np.random.Generator) -> None:
    m = Q1Matrix.quantize(rng.standard_normal((2048, 2048)).astype(np.float32))
    x = rng.standard_normal((4, 2048)).astype(np.float32)
    started = threading.Event()

    def work() -> None:
        started.set()
        for _ in range(3):
            m.matmul(x, kernel="reference")  # ~0.1 s or more each, in Rust

    worker = threading.Thread(target=work)
    worker.start()
    started.wait()
    ticks = 0
    while worker.is_alive():
        ticks += 1
    worker.join()
    # Holding the GIL for the whole call would leave this thread a handful of ticks at most.
    assert ticks > 1000
