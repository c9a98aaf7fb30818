"""``ops/q1_tuned``: a GPU's measured Q1 matmul forms. Which choice a matmul takes (the swept row
count below it on its side of the GEMV/GEMM line, a form that takes its rows, the explicit one-row
form and ``OXIBONSAI_Q1_TUNED=0`` first), the table the bench writes from its sweep, and that the
exact linear runs the chosen form with the defaults' bits."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (pip install 'oxibonsai[torch]')")
pytest.importorskip("triton", reason="triton is not installed")

from test_q1_exact import activations, on_device, random_matrix  # noqa: E402

from oxibonsai.torch_backend.ops import q1_exact, q1_tuned  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benches"))
CPU = torch.device("cpu")


def write_table(path: Path, choices: list[dict]) -> Path:
    path.write_text(json.dumps({"device": "test", "choices": choices}))
    return path


def entry(m: int, rows: int, cols: int, gated: bool = False, **options) -> dict:
    return {"rows": rows, "cols": cols, "gated": gated, "m": m, "options": options}


@pytest.fixture
def table(tmp_path, monkeypatch, rng):
    """A table for one random shape, named by ``OXIBONSAI_Q1_TUNED``; returns the shape."""
    rows, cols = 128 * int(rng.integers(1, 64)), 128 * int(rng.integers(1, 64))
    choices = [
        entry(1, rows, cols, kernel="gemv_split", split_k=4),
        entry(4, rows, cols, kernel="gemv_fixup", split_k=2),
        entry(16, rows, cols, kernel="gemm", split_k=1, group_dot=True),
        entry(512, rows, cols, kernel="gemm_expanded"),
    ]
    path = write_table(tmp_path / f"table-{rng.integers(1 << 30)}.json", choices)
    monkeypatch.setenv(q1_tuned.ENV_VAR, str(path))
    monkeypatch.delenv(q1_exact.ONE_ROW_ENV_VAR, raising=False)
    return rows, cols


def test_a_matmul_takes_the_choice_swept_below_it_on_its_side_of_the_gemv_gemm_line(table):
    rows, cols = table
    kernel_at = {m: (q1_tuned.choice(CPU, m, rows, cols, False) or {}).get("kernel") for m in range(1, 1100)}
    assert kernel_at[1] == "gemv_split"
    assert kernel_at[2] is None and kernel_at[3] is None  # "gemv_split" takes one row only
    assert all(kernel_at[m] == "gemv_fixup" for m in range(4, q1_exact.FIXUP_MAX_M + 1))
    assert all(kernel_at[m] is None for m in range(q1_exact.FIXUP_MAX_M + 1, q1_exact.GEMV_MAX_M + 1))
    assert all(kernel_at[m] is None for m in range(q1_exact.GEMV_MAX_M + 1, 16))  # no GEMV choice above 8
    assert all(kernel_at[m] == "gemm" for m in range(16, 512))
    assert all(kernel_at[m] == "gemm_expanded" for m in range(512, 1100))
    assert q1_tuned.choice(CPU, 16, rows, cols, True) is None  # another shape: gated
    assert q1_tuned.choice(CPU, 16, rows + 128, cols, False) is None


def test_explicit_forms_and_the_off_switch_come_first(table, monkeypatch, tmp_path):
    rows, cols = table
    monkeypatch.setenv(q1_exact.ONE_ROW_ENV_VAR, "gemv")
    assert q1_tuned.choice(CPU, 1, rows, cols, False) is None
    assert q1_tuned.choice(CPU, 4, rows, cols, False) is not None
    monkeypatch.setenv(q1_tuned.ENV_VAR, "0")
    assert q1_tuned.choice(CPU, 4, rows, cols, False) is None
    monkeypatch.setenv(q1_tuned.ENV_VAR, str(tmp_path / "absent.json"))
    assert q1_tuned.choice(CPU, 4, rows, cols, False) is None
    monkeypatch.delenv(q1_tuned.ENV_VAR)
    assert q1_tuned.choice(CPU, 4, rows, cols, False) is None  # no GPU: no shipped table


def test_forms_are_checked_against_the_rows_and_tile_widths_they_take():
    assert q1_tuned.takes({"kernel": "gemv", "split_k": 4}, q1_exact.GEMV_MAX_M, False)
    assert not q1_tuned.takes({"kernel": "gemv", "split_k": 4}, q1_exact.GEMV_MAX_M + 1, False)
    assert not q1_tuned.takes({"kernel": "gemv_split", "block_n": 64}, 1, False)
    assert not q1_tuned.takes({"kernel": "gemm", "block_n": 3}, 64, False)
    narrow = q1_exact.gemv_block_ns(4, False)[0]
    assert q1_tuned.takes({"kernel": "gemv", "block_n": narrow}, 4, False)
    assert not q1_tuned.takes({"kernel": "unknown"}, 1, False)


def test_a_device_table_is_named_after_the_device():
    assert q1_tuned.table_file("NVIDIA H200").name == "NVIDIA_H200.json"
    assert q1_tuned.table_file("NVIDIA H100 80GB HBM3").name == "NVIDIA_H100_80GB_HBM3.json"


def test_the_bench_keeps_the_forms_that_beat_the_defaults(rng, tmp_path, monkeypatch):
    from gpu.q1 import write_tuned_table

    rows, cols = 128 * int(rng.integers(1, 64)), 128 * int(rng.integers(1, 64))
    m = int(rng.integers(1, q1_exact.FIXUP_MAX_M + 1))  # where the "gemv_fixup" choice applies
    default = float(rng.uniform(5, 50))
    forms = {"gemv/4": {"kernel": "gemv", "split_k": 4}, "gemv_fixup/auto": {"kernel": "gemv_fixup"}}

    def case(gated: bool, fastest: float) -> dict:
        times = {"quantize": 1.0, "default": default, "gemv/4": default * 2, "gemv_fixup/auto": fastest}
        return {"rows": rows, "cols": cols, "gated": gated, "m": m, "sweep_ms": times, "sweep_options": forms}

    near = default / (q1_tuned.MIN_GAIN * 0.999)  # within the noise margin: not kept
    cases = [case(True, default / 2), case(False, near), {"rows": rows, "m": 1}]
    path = write_tuned_table({"rows": cases}, tmp_path / "t.json", CPU)
    (kept,) = json.loads(path.read_text())["choices"]
    assert (kept["rows"], kept["cols"], kept["gated"], kept["m"]) == (rows // 2, cols, True, m)
    assert kept["options"] == {"kernel": "gemv_fixup"} and kept["ms"] == default / 2
    assert write_tuned_table({"rows": cases[1:]}, tmp_path / "none.json", CPU) is None
    monkeypatch.setenv(q1_tuned.ENV_VAR, str(path))
    assert q1_tuned.choice(CPU, m, rows // 2, cols, True) == {"kernel": "gemv_fixup"}


@pytest.mark.parametrize("m", [1, 3, 20])
def test_the_linear_runs_the_tables_form_with_the_defaults_bits(rng, tmp_path, monkeypatch, m):
    k, gated = 128 * int(rng.integers(2, 5)), bool(rng.integers(2))
    rows = 32 * int(rng.integers(1, 5)) * (2 if gated else 1)
    _, w = random_matrix(rng, rows, k)
    acts = q1_exact.quantize(on_device(activations(rng, m, k)))
    monkeypatch.setenv(q1_tuned.ENV_VAR, "0")
    default = q1_exact.linear_quantized(acts, w, gated=gated)
    form = {1: {"kernel": "gemv_fixup", "split_k": 2}, 3: {"kernel": "gemv", "split_k": 2},
            20: {"kernel": "gemm", "split_k": 2, "group_dot": not q1_exact.GEMM_GROUP_DOT}}[m]  # fmt: skip
    out_rows = rows // 2 if gated else rows
    path = write_table(tmp_path / f"t{m}.json", [entry(m, out_rows, k, gated, **form)])
    monkeypatch.setenv(q1_tuned.ENV_VAR, str(path))
    launched = []
    for name in ("_gemv", "_gemm", "_gemv_split"):
        original = getattr(q1_exact, name)

        def spy(*args, _name=name, _original=original, **kwargs):
            launched.append((_name, args, kwargs))
            return _original(*args, **kwargs)

        monkeypatch.setattr(q1_exact, name, spy)
    tuned = q1_exact.linear_quantized(acts, w, gated=gated)
    assert torch.equal(tuned, default)
    ((name, args, _),) = launched
    if m == 1:
        assert name == "_gemv" and args[6] == 2 and args[9] is True  # split 2, fixup
    elif m == 3:
        assert name == "_gemv" and args[6] == 2 and args[9] is False
    else:
        assert name == "_gemm" and args[6] == 2 and args[7] == (not q1_exact.GEMM_GROUP_DOT)
    assert np.isfinite(tuned.cpu().numpy()).all()
