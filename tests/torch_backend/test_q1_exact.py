"""The exact-integer Q1 linear (``ops/q1_exact``), the CUDA op set's default: its activation
quantization equals the Rust core's bit for bit, its matmul equals ``Q1Matrix.matmul`` (the CPU
engine) bit for bit through the GEMV, its split-K forms (over programs, and inside one program for a
single row) and the int8 GEMM, and a row's result never
depends on the other rows of the batch. Here the GEMV runs its plain-Triton ``dp4a`` twin in the
interpreter; where CUDA exists the PTX must equal the twin.

Bound against float64 (the fused norm, SwiGLU and residual): ``EXACT_TOL`` = 5e-3 of the largest output.
It is the CPU engine's own error, since these are its bits: int16 activations whose block L1 norm is
at most 32639 (about 255 per value) round each value by up to 1/500 of a typical one; measured at most
2.3e-3 over 30 random cases, the gated ones the worst."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (pip install 'oxibonsai[torch]')")
pytest.importorskip("triton", reason="triton is not installed")

import oxibonsai as ob  # noqa: E402
from oxibonsai import _core  # noqa: E402
from oxibonsai.torch_backend.ops.q1_weight import Q1Weight  # noqa: E402

from q1_reference import fused_linear as reference_fused_linear  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
EXACT_TOL = 5e-3
EPS = 1e-6


def q1_exact():
    from oxibonsai.torch_backend.ops import q1_exact

    return q1_exact


def random_matrix(rng: np.random.Generator, rows: int, k: int) -> tuple[ob.Q1Matrix, Q1Weight]:
    matrix = ob.Q1Matrix.quantize(rng.standard_normal((rows, k)).astype(np.float32))
    return matrix, Q1Weight.from_gguf(np.frombuffer(matrix.to_bytes(), dtype=np.uint8), rows, k, DEVICE)


def activations(rng: np.random.Generator, m: int, k: int) -> np.ndarray:
    """Rows at scales from 1e-3 to 1e3, with rare 50x outliers (massive activation channels)."""
    x = rng.standard_normal((m, k)) * 10.0 ** rng.uniform(-3, 3, (m, 1))
    x[rng.random((m, k)) < 0.01] *= 50
    return x.astype(np.float32)


def on_device(a):
    return None if a is None else torch.from_numpy(a).to(DEVICE)


def test_quantization_equals_the_rust_cores_bit_for_bit(rng):
    m, k = int(rng.integers(1, 12)), 128 * int(rng.integers(1, 5))
    x = activations(rng, m, k)
    x[0, :128] = 0.0  # a zero block: scale 0
    x[-1, -128:] = rng.standard_normal(128) * 1e-30  # below 2^-96: scale 0 as well
    got = q1_exact().quantize(on_device(x))
    q, scales = _core.quantize_activations(x)
    assert np.array_equal(got.values().cpu().numpy(), q.reshape(m, k))
    assert np.array_equal(got.scales.cpu().numpy(), scales.reshape(m, k // 128))
    sums = q.reshape(m, k // 128, 128).astype(np.int64).sum(axis=2)
    assert np.array_equal(got.sums.cpu().numpy(), sums)
    assert got.scales[0, 0] == 0 and got.scales[-1, -1] == 0


@pytest.mark.filterwarnings("ignore:invalid value encountered in cast:RuntimeWarning")
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_a_non_finite_value_gives_a_nan_scale_and_a_nan_row(rng, bad):
    _, w = random_matrix(rng, 48, 256)
    x = activations(rng, 3, 256)
    x[1, 200] = bad
    acts = q1_exact().quantize(on_device(x))
    assert torch.isnan(acts.scales[1, 1]) and not torch.isnan(acts.scales[1, 0])
    for kernel in ("gemv", "gemm"):
        out = q1_exact().linear_quantized(acts, w, kernel=kernel, asm=False).cpu()
        assert torch.isnan(out[1]).all() and torch.isfinite(out[[0, 2]]).all()


@pytest.mark.parametrize("kernel", ["gemv", "gemv_fixup", "gemv_split", "gemm", "gemm_expanded"])
def test_the_matmul_equals_the_cpu_engine_bit_for_bit(rng, kernel):
    gemm = kernel.startswith("gemm")
    most = 19 if gemm else q1_exact().FIXUP_MAX_M if kernel == "gemv_fixup" else 8
    for first in (True, False, False):  # one row always: the GEMVs' loads take another form there
        m = 1 if first else int(rng.integers(1, most + 1))
        rows, k = int(rng.choice([40, 96, 136])), 128 * int(rng.integers(1, 9))
        matrix, w = random_matrix(rng, rows, k)
        x = activations(rng, m, k)
        acts = q1_exact().quantize(on_device(x))
        split_k = int(rng.choice([1, 2, 4, 8, 16])) if kernel == "gemv_split" else int(rng.integers(1, 4))
        tile = {"split_k": split_k}
        if gemm:  # any width, depth and split over programs
            tile = {"block_n": int(rng.choice([64, 32, 16])), "split_k": int(rng.integers(1, 5))}
            tile |= {"group_dot": bool(rng.integers(2))} if kernel == "gemm" else {}
        got = q1_exact().linear_quantized(acts, w, kernel=kernel, asm=False, **tile)
        assert np.array_equal(got.cpu().numpy(), matrix.matmul(x).reshape(m, rows)), (m, rows, k, tile)


def test_the_in_program_split_takes_long_splits_a_chunk_at_a_time(rng):
    """Splits of 10 and 19 groups: more than one ``GROUP_CHUNK`` of straight code, the last one short."""
    matrix, w = random_matrix(rng, 40, 128 * 19)
    for splits in (1, 2):
        m = 1 if splits == 1 else int(rng.integers(1, 9))
        x = activations(rng, m, 128 * 19)
        acts = q1_exact().quantize(on_device(x))
        got = q1_exact().linear_quantized(acts, w, kernel="gemv_split", split_k=splits, asm=False)
        assert np.array_equal(got.cpu().numpy(), matrix.matmul(x).reshape(m, 40)), (m, splits)


def test_the_op_set_linear_is_the_cpu_engines_matmul(rng):
    matrix, w = random_matrix(rng, 64, 384)
    for m in (1, 5, 11):
        x = activations(rng, m, 384)
        assert np.array_equal(
            q1_exact().q1_linear(on_device(x), w).cpu().numpy(), matrix.matmul(x).reshape(m, 64)
        )


@pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")
def test_the_fused_linear_matches_float64_and_every_kernel_gives_its_bits(rng):
    for first in (True, False, False):
        m = 1 if first else int(rng.integers(1, 12))
        rows, k = int(rng.choice([48, 96])), 128 * int(rng.integers(1, 4))
        matrix, w = random_matrix(rng, rows, k)
        x = rng.standard_normal((m, k)).astype(np.float32)
        gated, normed = bool(rng.integers(2)), bool(rng.integers(2))
        norm = (1 + 0.2 * rng.standard_normal(k)).astype(np.float32) if normed else None
        out_rows = rows // 2 if gated else rows
        residual = rng.standard_normal((m, out_rows)).astype(np.float32) if rng.random() < 0.5 else None
        fused = {"norm": on_device(norm), "eps": EPS, "residual": on_device(residual), "gated": gated}
        got = q1_exact().fused_linear(on_device(x), w, **fused)
        want = reference_fused_linear(x, matrix.dequantize().astype(np.float64), norm, residual, gated, EPS)
        assert got.shape == want.shape and got.dtype == torch.float32
        assert np.abs(got.cpu().numpy() - want).max() <= EXACT_TOL * np.abs(want).max()
        acts = q1_exact().quantize(on_device(x), on_device(norm), EPS)
        args = {"residual": on_device(residual), "gated": gated, "asm": False}
        gemvs = [("gemv", 1), ("gemv", 3), ("gemv_split", 1), ("gemv_split", 4)] if m <= 8 else []
        for kernel, split_k in [("gemm", None), *gemvs]:
            again = q1_exact().linear_quantized(acts, w, kernel=kernel, split_k=split_k, **args)
            assert torch.equal(again, got), (kernel, split_k)
        for block_n in q1_exact().gemm_block_ns(gated):
            for group_dot, split_k in ((True, 1), (False, 1), (True, 3)):
                tile = {"block_n": block_n, "group_dot": group_dot, "split_k": split_k}
                again = q1_exact().linear_quantized(acts, w, kernel="gemm", **tile, **args)
                assert torch.equal(again, got), ("gemm", tile)
            again = q1_exact().linear_quantized(acts, w, kernel="gemm_expanded", block_n=block_n, **args)
            assert torch.equal(again, got), ("gemm_expanded", block_n)
        for block_n in q1_exact().gemv_block_ns(m, gated) if m <= 8 else ():
            for split_k in (1, 2):
                again = q1_exact().linear_quantized(
                    acts, w, kernel="gemv", block_n=block_n, split_k=split_k, **args
                )
                assert torch.equal(again, got), ("gemv", block_n, split_k)


@pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")
def test_a_rows_bits_do_not_depend_on_the_rest_of_the_batch(rng):
    _, w = random_matrix(rng, 64, 256)
    norm = on_device((1 + 0.2 * rng.standard_normal(256)).astype(np.float32))
    x = on_device(activations(rng, 12, 256))
    residual = on_device(rng.standard_normal((12, 32)).astype(np.float32))
    batched = q1_exact().fused_linear(x, w, norm=norm, eps=EPS, residual=residual, gated=True)
    for lo, hi in ((0, 1), (3, 5), (4, 12), (11, 12)):  # 1, 2 and 8 rows through the GEMV; 12 the GEMM
        part = q1_exact().fused_linear(x[lo:hi], w, norm=norm, eps=EPS, residual=residual[lo:hi], gated=True)
        assert torch.equal(part, batched[lo:hi]), (lo, hi)


def test_kernel_choices_are_checked(rng):
    _, w = random_matrix(rng, 32, 256)
    acts = q1_exact().quantize(on_device(activations(rng, 2, 256)))
    with pytest.raises(ValueError, match="one of"):
        q1_exact().linear_quantized(acts, w, kernel="gemv2")
    with pytest.raises(ValueError, match="power of 2"):
        q1_exact().linear_quantized(acts, w, kernel="gemv_split", split_k=3)
    nine = q1_exact().quantize(on_device(activations(rng, 9, 256)))
    for kernel in ("gemv", "gemv_split"):
        with pytest.raises(ValueError, match="up to 8 activation rows"):
            q1_exact().linear_quantized(nine, w, kernel=kernel)
    five = q1_exact().quantize(on_device(activations(rng, 5, 256)))
    with pytest.raises(ValueError, match="up to 4 activation rows"):
        q1_exact().linear_quantized(five, w, kernel="gemv_fixup")
    with pytest.raises(ValueError, match="tile's width"):
        q1_exact().linear_quantized(nine, w, kernel="gemv", block_n=32)
    with pytest.raises(ValueError, match="tile's width"):
        q1_exact().linear_quantized(nine, w, kernel="gemm", block_n=64, gated=True)
    with pytest.raises(ValueError, match="tile's width"):
        q1_exact().linear_quantized(acts, w, kernel="gemv_split", block_n=128)
    with pytest.raises(ValueError, match="tile's width"):
        q1_exact().linear_quantized(acts, w, kernel="gemv", block_n=256)  # two rows: one weight row a thread
    with pytest.raises(ValueError, match="'gemm' kernel's choice"):
        q1_exact().linear_quantized(acts, w, kernel="gemv", group_dot=True)


def test_the_gemm_tile_narrows_only_while_the_launch_still_fits_one_program_per_sm(rng):
    exact = q1_exact()
    for _ in range(200):
        m, out_rows = int(rng.integers(9, 700)), int(rng.integers(1, 20000))
        gated, sms = bool(rng.integers(2)), int(rng.integers(1, 200))
        widest = exact.gemm_block_ns(gated)[0]
        assert exact.gemm_block_n(m, out_rows, gated, None) == widest  # not a GPU
        got = exact.gemm_block_n(m, out_rows, gated, sms)
        block_m = exact.gemm_block_m(m)
        narrowest = 32 if block_m == 16 else 16
        assert got in exact.gemm_block_ns(gated) and got >= narrowest
        programs = -(-m // block_m) * -(-out_rows // got)
        assert got == widest or programs <= sms, (m, out_rows, gated, sms, got)
        assert got == narrowest or -(-m // block_m) * -(-out_rows // (got // 2)) > sms


def test_the_gemm_splits_k_only_for_launches_that_leave_sms_idle(rng):
    exact = q1_exact()
    per_sm, least = exact.GEMM_PROGRAMS_PER_SM, exact.GEMM_MIN_SPLIT_GROUPS
    for _ in range(200):
        tiles, groups, sms = int(rng.integers(1, 600)), int(rng.integers(1, 100)), int(rng.integers(1, 200))
        scratch = int(rng.integers(1, 2 * exact.GEMM_MAX_SCRATCH))
        assert exact.gemm_split_k(tiles, groups, None, scratch) == 1  # not a GPU
        got = exact.gemm_split_k(tiles, groups, sms, scratch)
        if scratch > exact.GEMM_MAX_SCRATCH:
            assert got == 1, "a scratch too large for L2"
            continue
        assert got >= 1 and (got == 1 or got * least <= groups), (tiles, groups, sms, got)
        assert tiles * (got - 1) < per_sm * sms, "no split beyond filling the SMs"
        assert got * least > groups - least or tiles * got >= per_sm * sms, "a short launch splits as it can"


def test_k_splits_inside_programs_at_one_row_and_over_them_at_more(rng, monkeypatch):
    """The default kernels where a matrix is too small to fill the GPU (its K splits), and where it is
    not: the in-program split only at one row (on the H200 the split over programs was 2.2x faster at
    4 rows), the GEMM above ``GEMV_MAX_M``."""
    exact = q1_exact()
    cpu = torch.device("cpu")
    for splits, m in ((int(rng.integers(2, 64)), int(rng.integers(1, 40))) for _ in range(50)):
        monkeypatch.setattr(exact, "_default_split_k", lambda tiles, groups, device, s=splits: s)
        want = "gemm" if m > exact.GEMV_MAX_M else "gemv_split" if m == 1 else "gemv"
        assert exact._default_kernel(m, 2048, 16, cpu) == want, (m, splits)
    monkeypatch.setattr(exact, "_default_split_k", lambda tiles, groups, device: 1)
    assert exact._default_kernel(1, 2048, 16, cpu) == "gemv", "K unsplit: the plain GEMV"


def test_the_one_row_split_form_is_chosen_by_its_environment_variable(monkeypatch):
    """``OXIBONSAI_ONE_ROW_GEMV`` picks the form of a one-row GEMV whose K splits (for the GPU bench),
    nothing else; a name that is not one of them is refused."""
    exact = q1_exact()
    cpu = torch.device("cpu")
    monkeypatch.setattr(exact, "_default_split_k", lambda tiles, groups, device: 4)
    for kernel in exact.ONE_ROW_KERNELS:
        monkeypatch.setenv(exact.ONE_ROW_ENV_VAR, kernel)
        assert exact._default_kernel(1, 2048, 16, cpu) == kernel
        assert [exact._default_kernel(m, 2048, 16, cpu) for m in (2, 8, 9)] == ["gemv", "gemv", "gemm"]
    monkeypatch.setenv(exact.ONE_ROW_ENV_VAR, "gemm")
    with pytest.raises(ValueError, match="OXIBONSAI_ONE_ROW_GEMV"):
        exact._default_kernel(1, 2048, 16, cpu)


def test_arithmetic_choice_in_the_triton_op_set(monkeypatch):
    from oxibonsai.torch_backend.ops import dispatch, q1_exact, q1_fast

    assert dispatch.triton_op_set().q1_fused_linear is q1_exact.fused_linear
    assert dispatch.triton_op_set("float").q1_fused_linear is q1_fast.fused_linear
    monkeypatch.setenv(dispatch.Q1_ENV_VAR, "float")
    assert dispatch.q1_arithmetic() == "float"
    monkeypatch.setenv(dispatch.Q1_ENV_VAR, "fp8")
    with pytest.raises(ValueError, match="OXIBONSAI_Q1_ARITHMETIC"):
        dispatch.q1_arithmetic()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the PTX runs on CUDA only")
def test_the_dp4a_ptx_equals_its_twin_and_the_cpu_engine(rng):
    assert q1_exact().asm_matches_twin(torch.cuda.current_device())
    matrix, w = random_matrix(rng, 4096, 2048)
    forms = ((1, "gemv"), (1, "gemv_split"), (1, "gemv_fixup"), (2, "gemv"), (3, "gemv_split"),
             (4, "gemv_fixup"), (8, "gemv_split"))  # fmt: skip
    for m, kernel in forms:
        x = activations(rng, m, 2048)
        acts = q1_exact().quantize(on_device(x))
        got = q1_exact().linear_quantized(acts, w, asm=True, kernel=kernel)
        assert torch.equal(got, q1_exact().linear_quantized(acts, w, asm=False, kernel=kernel))
        assert np.array_equal(got.cpu().numpy(), matrix.matmul(x).reshape(m, 4096))


@pytest.mark.parametrize("fuse", ["1", "0"])
def test_the_split_gemv_quantizes_its_output_for_the_next_matmul_bit_for_bit(rng, monkeypatch, fuse):
    """``linear_then_quantize``: the output and its quantization equal ``linear_quantized`` then
    ``quantize`` bit for bit, whether the split GEMV's (or a split "gemv"'s combine's, or a
    "gemv_fixup"'s combining programs') last program of each unit quantizes it (units of 256 columns
    here, so a launch has several: 4 and 2 programs a unit, or the whole row with a norm) or a launch
    of its own does (``OXIBONSAI_FUSE_QUANTIZE=0``, an unsplit "gemv", "gemv_fixup" at 4 rows, the
    GEMM); the arrival and tile counts are back at zero after each launch."""
    exact = q1_exact()
    exact_quantize, launches = exact.quantize, []
    monkeypatch.setattr(exact, "QUANTIZE_UNIT", 256)
    monkeypatch.setenv(exact.FUSE_ENV_VAR, fuse)
    monkeypatch.setattr(exact, "quantize", lambda *a, **kw: launches.append(a) or exact_quantize(*a, **kw))
    cases = ((512, 256, False, False, 1, "gemv_split", 4), (768, 384, True, True, 2, "gemv_split", 2),
             (256, 384, False, True, 1, "gemv_split", 16), (512, 128, True, False, 1, "gemv_split", 1),
             (256, 256, False, True, 3, "gemv", None), (512, 256, True, False, 4, "gemv", 2),
             (256, 256, False, True, 5, "gemv", 2),
             (512, 256, False, True, 1, "gemv_fixup", 2), (512, 384, True, False, 1, "gemv_fixup", 3),
             (768, 256, True, False, 2, "gemv_fixup", 2), (512, 256, False, False, 4, "gemv_fixup", 2),
             (256, 256, False, False, 9, "gemm", None))  # fmt: skip
    for rows, k, gated, normed, m, kernel, split_k in cases:
        _, w = random_matrix(rng, rows, k)
        acts = exact_quantize(on_device(activations(rng, m, k)))
        out_rows = rows // 2 if gated else rows
        norm = on_device((1 + 0.2 * rng.standard_normal(out_rows)).astype(np.float32)) if normed else None
        residual = on_device(rng.standard_normal((m, out_rows)).astype(np.float32)) if not gated else None
        args = {"residual": residual, "gated": gated, "asm": False, "kernel": kernel, "split_k": split_k}
        launches.clear()  # the quantization's own launches
        out, ahead = exact.linear_then_quantize(acts, w, exact.QuantizeNext(norm, EPS), **args)
        combined = kernel == "gemv" and split_k and m <= exact.FUSED_COMBINE_MAX_M  # in the combine launch
        fixed = kernel == "gemv_fixup" and m <= exact.FIXUP_QUANTIZE_MAX_M  # by each tile's last program
        fused = fuse == "1" and (kernel == "gemv_split" or combined or fixed)
        assert len(launches) == (0 if fused else 1), (rows, k, kernel)
        want = exact.linear_quantized(acts, w, **args)
        assert torch.equal(out, want), (rows, k, kernel)
        again = exact_quantize(want, norm, EPS)
        assert all(torch.equal(getattr(ahead, f), getattr(again, f)) for f in ("planes", "scales", "sums"))
        assert not exact.arrival_counts(out.device).any() and not exact.tile_counts(out.device).any()


@pytest.mark.parametrize("kernel", ["gemv_split", "gemv_fixup"])
def test_fused_quantization_holds_over_repeated_launches_and_graph_replays(rng, kernel):
    """The split GEMV's programs finish in any order on a GPU: a gate|up matrix (SwiGLU, quantized
    in units) then a down matrix (residual, RMS-normalized over the whole row), on CUDA at
    Bonsai-1.7B's shapes (384 and 128 programs in the in-program split; "gemv_fixup" at its default
    split over programs, 4 here), launched 5 times (twice under the interpreter) and, on CUDA,
    replayed 10 times from one CUDA graph: the unfused bits every time, the arrival and tile counts
    back at zero."""
    exact = q1_exact()
    hidden, ffn = (2048, 6144) if DEVICE.type == "cuda" else (256, 1024)
    gen = torch.Generator().manual_seed(int(rng.integers(2**31)))

    def matrix(rows: int, cols: int) -> Q1Weight:
        signs = torch.randint(-(2**31), 2**31, (rows, cols // 32), dtype=torch.int32, generator=gen)
        scales = (torch.rand(rows, cols // 128, generator=gen) + 0.5).to(torch.float16)
        return Q1Weight(signs=signs.to(DEVICE), scales=scales.to(DEVICE), rows=rows, cols=cols)

    gate_up, down = matrix(2 * ffn, hidden), matrix(hidden, ffn)
    norm = (1 + 0.2 * torch.randn(hidden, generator=gen)).to(DEVICE)
    residual = torch.randn(1, hidden, generator=gen).to(DEVICE)
    acts = exact.quantize((torch.randn(1, hidden, generator=gen) * 3).to(DEVICE))
    cuda = DEVICE.type == "cuda"
    split_k = None if cuda or kernel == "gemv_split" else 4  # here the default would not split
    split = {"kernel": kernel, "asm": None if cuda else False, "split_k": split_k}

    def layer() -> tuple[torch.Tensor, torch.Tensor, Any, Any]:
        h, h_acts = exact.linear_then_quantize(acts, gate_up, exact.QuantizeNext(), gated=True, **split)
        x, x_acts = exact.linear_then_quantize(h_acts, down, exact.QuantizeNext(norm, EPS), residual=residual,
                                               **split)  # fmt: skip
        return h, x, h_acts, x_acts

    h_want = exact.linear_quantized(acts, gate_up, gated=True, **split)
    x_want = exact.linear_quantized(exact.quantize(h_want), down, residual=residual, **split)
    want = (h_want, x_want, exact.quantize(h_want), exact.quantize(x_want, norm, EPS))

    def check(got: tuple[torch.Tensor, torch.Tensor, Any, Any]) -> None:
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        for rows, rows_want in zip(got[2:], want[2:], strict=True):
            assert all(
                torch.equal(getattr(rows, f), getattr(rows_want, f)) for f in ("planes", "scales", "sums")
            )
        assert not exact.arrival_counts(DEVICE).any() and not exact.tile_counts(DEVICE).any()

    # Under the interpreter programs run one after another in one order: a second launch shows the
    # counters came back to zero, and more would repeat it.
    for _ in range(5 if cuda else 2):
        check(layer())
    if DEVICE.type == "cuda":
        layer()  # the kernels compiled before the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = layer()
        for _ in range(10):
            graph.replay()
            torch.cuda.synchronize()
            check(captured)


def test_activations_quantized_ahead_must_be_the_inputs(rng):
    """``fused_linear_ahead`` takes ``acts`` as ``x``'s quantization: other rows or widths are refused."""
    exact = q1_exact()
    _, w = random_matrix(rng, 32, 256)
    x = on_device(activations(rng, 2, 256))
    for wrong in (exact.quantize(x[:1]), exact.quantize(on_device(activations(rng, 2, 128)))):
        with pytest.raises(ValueError, match="acts hold"):
            exact.fused_linear_ahead(x, w, acts=wrong)
    out, ahead = exact.fused_linear_ahead(x, w, acts=exact.quantize(x))
    assert ahead is None and torch.equal(out, exact.fused_linear(x, w))
