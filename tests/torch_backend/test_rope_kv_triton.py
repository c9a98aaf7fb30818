"""The fused QK-norm + RoPE + KV-write kernel (``rope_kv_triton``, in Triton's interpreter here) against
``ref_torch.qk_norm_rope_write_kv`` run on the CPU, with fresh random inputs.

Caches start filled with random values and are compared whole after the call, so a store outside the
given slots, or into a padding row's slot, shows up. Positions go up to 32767.

Bounds: q and float32 k are float32 work from the same inputs and the same cos/sin table
(``ref_torch.rope_cos_sin``), so only the order of the RMSNorm sums differs. ``ATOL`` = ``RTOL`` = 1e-5
against outputs of size up to about 6 (norm weights in [0.5, 1.5]); measured at most 9.5e-7 absolute for
q and for float32 k over 120 random cases at positions up to 32767. fp16 k rounds the other way where the
float32 values differ in their last bit: at most one fp16 ulp, hence ``FP16_RTOL`` = 2^-10. v is stored
exactly."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from types import ModuleType

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (pip install 'oxibonsai[torch]')")
pytest.importorskip("triton", reason="triton is not installed")

from oxibonsai.torch_backend.ops import ref_torch  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # where the Triton kernel runs
ATOL = RTOL = 1e-5
FP16_RTOL = 2.0**-10
PAGE = 16
BLOCKS = 3
EPS = 1e-6
MAX_POSITION = 32767
TABLE = ref_torch.rope_cos_sin(16, 64, 1e6, DEVICE)  # for calls that launch nothing (errors, T = 0)


def kernels() -> ModuleType:
    """The kernel module, imported after conftest set TRITON_INTERPRET."""
    return importlib.import_module("oxibonsai.torch_backend.ops.rope_kv_triton")


def make_args(
    rng: np.random.Generator,
    tokens: int,
    heads: tuple[int, int],
    head_dim: int,
    dtype: torch.dtype,
    *,
    padding: int = 0,
    strided: bool = False,
) -> dict[str, torch.Tensor]:
    """Random CPU arguments: distinct slots with ``padding`` rows at -1, random cache contents. With
    ``strided``, qkv is a column slice of a wider tensor and the caches' head rows are padded."""
    q_heads, kv_heads = heads
    width = (q_heads + 2 * kv_heads) * head_dim
    wide = rng.standard_normal((tokens, width + 7 if strided else width)).astype(np.float32) * 3
    qkv = torch.from_numpy(wide)[:, 3 : 3 + width] if strided else torch.from_numpy(wide)
    slots = rng.permutation(BLOCKS * PAGE)[:tokens]
    slots[rng.choice(tokens, size=padding, replace=False)] = -1
    positions = rng.integers(0, MAX_POSITION + 1, size=tokens)
    if tokens:
        positions[rng.integers(tokens)] = MAX_POSITION

    def cache() -> torch.Tensor:
        padded = head_dim + 8 if strided else head_dim  # strided: each head row padded, [..., :D] of it
        values = rng.standard_normal((BLOCKS, PAGE, kv_heads, padded))
        return torch.from_numpy(values).to(dtype)[..., :head_dim]

    def norm() -> torch.Tensor:
        return torch.from_numpy(rng.uniform(0.5, 1.5, head_dim).astype(np.float32))

    return {
        "qkv": qkv,
        "q_norm": norm(),
        "k_norm": norm(),
        "positions": torch.from_numpy(positions.astype(np.int32)),
        "k_cache": cache(),
        "v_cache": cache(),
        "slot_mapping": torch.from_numpy(slots.astype(np.int64)),
    }


def on_device(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t`` on ``DEVICE`` with the same strides (a column slice stays one)."""
    out = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=DEVICE)
    return out.copy_(t)


def run_both(
    args: dict[str, torch.Tensor], q_heads: int, rope_base: float
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(kernel q, reference q, kernel caches, reference caches), all on the CPU. Each side writes into
    its own copy of the caches."""
    ref_args = {name: t.clone() for name, t in args.items()}
    dev_args = {name: on_device(t) for name, t in args.items()}
    table = ref_torch.rope_cos_sin(MAX_POSITION + 1, args["q_norm"].shape[0], rope_base, "cpu")
    options = {"q_heads": q_heads, "eps": EPS}
    q = kernels().qk_norm_rope_write_kv(**dev_args, **options, cos_sin=on_device(table)).cpu()
    expected = ref_torch.qk_norm_rope_write_kv(**ref_args, **options, cos_sin=table)
    caches = {name: dev_args[name].cpu() for name in ("k_cache", "v_cache")}
    ref_caches = {name: ref_args[name] for name in ("k_cache", "v_cache")}
    return q, expected, caches, ref_caches


def assert_matches(
    q: torch.Tensor,
    expected: torch.Tensor,
    caches: dict[str, torch.Tensor],
    ref_caches: dict[str, torch.Tensor],
) -> None:
    assert q.dtype == torch.float32 and q.shape == expected.shape
    torch.testing.assert_close(q, expected, atol=ATOL, rtol=RTOL)
    k, ref_k = caches["k_cache"], ref_caches["k_cache"]
    rtol = FP16_RTOL if k.dtype == torch.float16 else RTOL
    torch.testing.assert_close(k.to(torch.float32), ref_k.to(torch.float32), atol=ATOL, rtol=rtol)
    assert torch.equal(caches["v_cache"], ref_caches["v_cache"])


def changed_slots(before: torch.Tensor, after: torch.Tensor) -> set[int]:
    """The cache slots whose contents differ."""
    diff = (before != after).reshape(BLOCKS * PAGE, -1).any(dim=1)
    return set(torch.nonzero(diff).flatten().tolist())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("heads", [(4, 2), (2, 1), (16, 8)], ids=lambda h: f"hq{h[0]}-hkv{h[1]}")
@pytest.mark.parametrize("head_dim, rope_base", [(64, 1e4), (128, 1e6)], ids=["d64", "d128"])
def test_matches_reference(
    rng: np.random.Generator, head_dim: int, rope_base: float, heads: tuple[int, int], dtype: torch.dtype
) -> None:
    args = make_args(rng, 5, heads, head_dim, dtype)
    before = args["k_cache"].clone()
    q, expected, caches, ref_caches = run_both(args, heads[0], rope_base)
    assert_matches(q, expected, caches, ref_caches)
    assert changed_slots(before, caches["k_cache"]) == set(args["slot_mapping"].tolist())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("heads, head_dim", [((4, 2), 64), ((3, 1), 96)], ids=["d64", "d96-hq3"])
def test_strided_qkv_caches_and_padding_rows(
    rng: np.random.Generator, heads: tuple[int, int], head_dim: int, dtype: torch.dtype
) -> None:
    """qkv is a column slice (row stride > width), the caches have padded head rows, and two of six rows
    are padding: their slots store nothing, their q still comes back. (D=96 has masked half-columns,
    Hq=3 masked heads.)"""
    args = make_args(rng, 6, heads, head_dim, dtype, padding=2, strided=True)
    assert on_device(args["qkv"]).stride(0) > head_dim * (heads[0] + 2 * heads[1])
    assert not on_device(args["k_cache"]).is_contiguous()
    before = {name: args[name].clone() for name in ("k_cache", "v_cache")}
    q, expected, caches, ref_caches = run_both(args, heads[0], 1e6)
    assert_matches(q, expected, caches, ref_caches)
    stored = {s for s in args["slot_mapping"].tolist() if s >= 0}
    assert len(stored) == 4
    for name in ("k_cache", "v_cache"):  # every stored slot changed (random data), nothing else did
        assert changed_slots(before[name], caches[name]) == stored
    padding = args["slot_mapping"] < 0
    assert q[padding].abs().amax() > 0


def test_all_padding_stores_nothing(rng: np.random.Generator) -> None:
    args = make_args(rng, 3, (2, 1), 64, torch.float16, padding=3)
    q, expected, caches, _ = run_both(args, 2, 1e6)
    torch.testing.assert_close(q, expected, atol=ATOL, rtol=RTOL)
    assert torch.equal(caches["k_cache"], args["k_cache"]) and torch.equal(caches["v_cache"], args["v_cache"])


def test_empty_batch(rng: np.random.Generator) -> None:
    args = {name: on_device(t) for name, t in make_args(rng, 0, (4, 2), 64, torch.float32).items()}
    before = args["k_cache"].clone()
    q = kernels().qk_norm_rope_write_kv(**args, q_heads=4, cos_sin=TABLE, eps=EPS)
    assert q.shape == (0, 4, 64) and q.dtype == torch.float32
    assert torch.equal(args["k_cache"], before)


def _bad_width(a: dict[str, torch.Tensor]) -> None:
    a["qkv"] = a["qkv"][:, :-64]


def _odd_head_dim(a: dict[str, torch.Tensor]) -> None:
    a["q_norm"], a["k_norm"] = a["q_norm"][:63], a["k_norm"][:63]


def _bad_k_norm(a: dict[str, torch.Tensor]) -> None:
    a["k_norm"] = a["k_norm"][:32]


def _bad_positions(a: dict[str, torch.Tensor]) -> None:
    a["positions"] = a["positions"][:-1]


def _bad_slots(a: dict[str, torch.Tensor]) -> None:
    a["slot_mapping"] = torch.cat([a["slot_mapping"], a["slot_mapping"]])


def _mismatched_caches(a: dict[str, torch.Tensor]) -> None:
    a["v_cache"] = a["v_cache"][:, :, :1]


def _strided_cache_rows(a: dict[str, torch.Tensor]) -> None:
    a["k_cache"] = torch.zeros(*a["k_cache"].shape, 2)[..., 0]


def _flat_qkv(a: dict[str, torch.Tensor]) -> None:
    a["qkv"] = a["qkv"].flatten()


@pytest.mark.parametrize(
    "mutate, message",
    [
        (_bad_width, "qkv width"),
        (_odd_head_dim, "even"),
        (_bad_k_norm, "k_norm"),
        (_bad_positions, "^positions"),
        (_bad_slots, "^slot_mapping"),
        (_mismatched_caches, "caches"),
        (_strided_cache_rows, "contiguous"),
        (_flat_qkv, "need qkv"),
    ],
    ids=lambda v: v.__name__.strip("_") if callable(v) else None,
)
def test_errors(
    rng: np.random.Generator, mutate: Callable[[dict[str, torch.Tensor]], None], message: str
) -> None:
    args = make_args(rng, 2, (4, 2), 64, torch.float32)
    mutate(args)
    with pytest.raises(ValueError, match=message):
        kernels().qk_norm_rope_write_kv(**args, q_heads=4, cos_sin=TABLE, eps=EPS)


@pytest.mark.parametrize("table", [TABLE[:, :32], TABLE.double()], ids=["narrow", "float64"])
def test_a_cos_sin_table_of_another_shape_or_dtype_is_refused(rng: np.random.Generator, table) -> None:
    args = make_args(rng, 2, (4, 2), 64, torch.float32)
    with pytest.raises(ValueError, match="cos_sin must be float32"):
        kernels().qk_norm_rope_write_kv(**args, q_heads=4, cos_sin=table, eps=EPS)


def test_the_reference_op_is_norm_rope_and_write_kv(rng: np.random.Generator) -> None:
    """``ref_torch.qk_norm_rope_write_kv`` (a table lookup) against the separate ops it fuses."""
    args = make_args(rng, 6, (4, 2), 128, torch.float32, padding=1)
    table = ref_torch.rope_cos_sin(MAX_POSITION + 1, 128, 1e6, "cpu")
    caches = {name: args[name].clone() for name in ("k_cache", "v_cache")}
    q = ref_torch.qk_norm_rope_write_kv(**args, q_heads=4, cos_sin=table, eps=EPS)
    qkv, pos = args["qkv"], args["positions"]
    parts = qkv.split([4 * 128, 2 * 128, 2 * 128], dim=1)
    q_heads, k_heads, v_heads = (part.reshape(6, -1, 128) for part in parts)
    want_q = ref_torch.rope_neox(ref_torch.rms_norm(q_heads, args["q_norm"], EPS), pos, 1e6)
    want_k = ref_torch.rope_neox(ref_torch.rms_norm(k_heads, args["k_norm"], EPS), pos, 1e6)
    ref_torch.write_kv(want_k, v_heads, caches["k_cache"], caches["v_cache"], args["slot_mapping"])
    torch.testing.assert_close(q, want_q, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(args["k_cache"], caches["k_cache"], atol=1e-6, rtol=1e-6)
    assert torch.equal(args["v_cache"], caches["v_cache"])
