"""Every Triton kernel a decode step and a prefill launch compiles for an H100 (sm_90) without
spilling registers, checked on a machine with no GPU: ``benches/gpu/sass.py --check`` records the
launches of the torch model on the ``meta`` device and compiles each through Triton's compiler and
the ptxas it ships. (The interpreter, which the rest of these tests use, runs kernels without
compiling them, so a kernel can pass every interpreted test and still not compile for a GPU.) Both Q1
arithmetics, at Bonsai-1.7B's shapes: tiny shapes hid a spill of the f16x2 GEMV at two rows."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch", reason="torch is not installed (pip install 'oxibonsai[torch]')")
triton = pytest.importorskip("triton", reason="triton is not installed")

SCRIPT = Path(__file__).resolve().parents[2] / "benches" / "gpu" / "sass.py"
PTXAS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"


@pytest.mark.skipif(not PTXAS.exists(), reason="this Triton has no NVIDIA backend (ptxas)")
def test_every_model_kernel_compiles_for_sm90_without_spills():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    args = ["--model", "1.7b", "--batches", "1", "2", "5", "--prefill", "40", "--check"]
    done = subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, env=env, timeout=600
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert "0 failed, spilled or touched memory before the PDL wait" in done.stdout


@pytest.mark.skipif(not PTXAS.exists(), reason="this Triton has no NVIDIA backend (ptxas)")
def test_the_gemms_forms_compile_for_sm90_without_spills():
    """``sass.py --gemm-forms``: the exact GEMM unsplit, with whole-group dots, on expanded bytes."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--model", "1.7b", "--gemm-forms", "64", "--check"],
        capture_output=True, text=True, env=env, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert "_expand_kernel" in done.stdout and "'EXPANDED': True" in done.stdout


@pytest.mark.skipif(not PTXAS.exists(), reason="this Triton has no NVIDIA backend (ptxas)")
@pytest.mark.parametrize("kernel", ["gemv", "gemv_fixup"])
def test_the_other_one_row_gemv_forms_compile_for_sm90_without_spills(kernel):
    """The one-row decode step with ``OXIBONSAI_ONE_ROW_GEMV`` naming another split GEMV form, as the
    GPU bench's decode section times it."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env |= {"TRITON_DEFAULT_FP_FUSION": "1", "OXIBONSAI_ONE_ROW_GEMV": kernel}
    args = ["--model", "1.7b", "--batches", "1", "--prefill", "40", "--q1", "exact", "--check"]
    done = subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, env=env, timeout=600
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert f"'FIXUP': {kernel == 'gemv_fixup'}" in done.stdout and "'SPLIT': True" in done.stdout
