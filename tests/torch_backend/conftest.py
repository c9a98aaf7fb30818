"""Torch-path tests. Every module here starts with ``torch = pytest.importorskip("torch", ...)``, so it
is skipped with a reason where torch is absent. Without CUDA, Triton kernels run in Triton's
interpreter, which is chosen when ``@triton.jit`` decorates: the variable is set here, before any
kernel module is imported.

The interpreter computes ``tl.dot`` with ``np.matmul``, and OpenBLAS's sgemm (numpy 2.4's, measured on
a Zen 4) gives an output row different bits depending on the row's place in the tile: a 32x64 @ 64x32
product with its rows rotated differs from the plain one for every rotation. A GPU's MMA computes each
output element the same way wherever its row sits, which the kernels' batch invariance relies on (a
prompt row's bits must not depend on how its step cut the sequence). Here the interpreter's dot sums
with ``np.einsum``'s loop instead, the same for every element (fp8 operands keep the original)."""

from __future__ import annotations

import importlib.util
import os

TORCH_MISSING = "torch is not installed (pip install 'oxibonsai[torch]')"

if importlib.util.find_spec("torch") is not None:
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")


def _row_invariant_interpreter_dot() -> None:
    """Replaces the interpreter's ``create_dot`` (see the module doc)."""
    import numpy as np
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    original = builder.create_dot

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):  # type: ignore[no-untyped-def]
        if any(t.dtype.primitive_bitwidth == 8 and t.dtype.is_floating() for t in (a, b)):
            return original(self, a, b, d, input_precision, max_num_imprecise_acc)
        product = np.einsum("...mk,...kn->...mn", a.data, b.data, dtype=d.data.dtype)
        return interpreter.TensorHandle(product + d.data, d.dtype.scalar)

    builder.create_dot = create_dot


if os.environ.get("TRITON_INTERPRET") == "1" and importlib.util.find_spec("triton") is not None:
    _row_invariant_interpreter_dot()
