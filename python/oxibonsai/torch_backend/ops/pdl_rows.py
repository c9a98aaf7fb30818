"""Which steps launch their kernels with programmatic dependent launch (``pdl``): the model's forward
pass declares its token rows (``step_rows``) and ``pdl.launch`` asks ``allowed``. No Triton here, so
the model imports it on any device.

PDL goes to steps of at most ``MAX_ROWS`` rows, the GEMV steps. On the H200 (session 25, 1.7B
shapes, CUDA graphs, one run each) it gained 1.08x at one row and lost at 16 and 64 rows, where the
GEMM runs: 3,579 against 4,144 tok/s without it (0.86x), 5,427 against 6,378 (0.85x).
``OXIBONSAI_PDL=all`` gives it to every step (for comparisons), ``=0`` to none."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

MAX_ROWS = 8  # q1_exact.GEMV_MAX_M
ENV_VAR = "OXIBONSAI_PDL"
_allowed: ContextVar[bool] = ContextVar("pdl_rows_allowed", default=True)


@contextmanager
def step_rows(rows: int) -> Iterator[None]:
    """Inside, kernels launch with PDL (where ``pdl.enabled``) only if the step has at most
    ``MAX_ROWS`` token rows, or with ``OXIBONSAI_PDL=all``."""
    token = _allowed.set(rows <= MAX_ROWS or os.environ.get(ENV_VAR, "").strip().lower() == "all")
    try:
        yield
    finally:
        _allowed.reset(token)


def allowed() -> bool:
    """Whether the current step may use PDL (True outside any step: a kernel launched alone)."""
    return _allowed.get()
