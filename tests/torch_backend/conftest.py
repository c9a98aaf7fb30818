"""Torch-path tests. Every module here starts with ``torch = pytest.importorskip("torch", ...)``, so it
is skipped with a reason where torch is absent. Without CUDA, Triton kernels run in Triton's
interpreter, which is chosen when ``@triton.jit`` decorates: the variable is set here, before any
kernel module is imported."""

from __future__ import annotations

import importlib.util
import os

TORCH_MISSING = "torch is not installed (pip install 'oxibonsai[torch]')"

if importlib.util.find_spec("torch") is not None:
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
