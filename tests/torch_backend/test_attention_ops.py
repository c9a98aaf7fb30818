"""Paged attention of the torch path: ``ref_torch.paged_attention`` against a float64 oracle that
attends over each sequence's positions directly, and the Triton decode and prefill/extend kernels
(``attn_triton``, in Triton's interpreter here) against ``ref_torch``.

Every case has ragged sequences, random non-contiguous block ids and padding entries in the block
table that point at other blocks. Every cache slot that holds no position of a sequence is NaN, so a
kernel that reads past a sequence's length or through a padding entry returns NaN. One query row past
the last sequence belongs to no sequence and must come back as zeros.

Bounds: the paths compute in float32 from the same cache values (fp16 caches are read exactly), so
``ATOL`` = 1e-5 against outputs of size about 1 (measured 2e-7..7e-7), for the Triton kernels with
"ieee" dots; their CUDA default, tf32 dots, gets ``TF32_ATOL``."""

from __future__ import annotations

import math
from dataclasses import dataclass
from types import ModuleType

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (pip install 'oxibonsai[torch]')")

from oxibonsai.torch_backend.batch import decode_rows  # noqa: E402
from oxibonsai.torch_backend.ops import ref_torch  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # where the Triton kernels run
ATOL = 1e-5
TF32_ATOL = 5e-3
PAGE = 16
DECODE = ([1, 5, 16, 17, 40], [1, 1, 1, 0, 1])  # (KV lengths, query lengths): a q_len 0 sequence too
EXTEND = ([5, 16, 17, 40, 33], [5, 3, 0, 40, 1])  # whole prompts, cached contexts, q_len 0 and 1


@dataclass
class PagedCase:
    q: torch.Tensor  # [T + 1, Hq, D]: the last row is owned by no sequence
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    keys: list[np.ndarray]  # per sequence, float64 [kv_len, Hkv, D] as stored in the cache
    values: list[np.ndarray]

    def args(self, device: torch.device | str = "cpu") -> tuple[torch.Tensor, ...]:
        tensors = (self.q, self.k_cache, self.v_cache, self.block_tables, self.seq_lens, self.query_start_loc)
        return tuple(t.to(device) for t in tensors)


def make_case(
    rng: np.random.Generator,
    lens: tuple[list[int], list[int]],
    heads: tuple[int, int],
    head_dim: int = 32,
    dtype: torch.dtype = torch.float32,
) -> PagedCase:
    kv_lens, q_lens = lens
    q_heads, kv_heads = heads
    needed = [-(-n // PAGE) for n in kv_lens]
    num_blocks = sum(needed) + 4  # a few blocks nobody owns
    ids = rng.permutation(num_blocks)
    table = rng.integers(0, num_blocks, size=(len(kv_lens), max(needed) + 1))  # padding: any block
    shape = (num_blocks, PAGE, kv_heads, head_dim)
    k_cache, v_cache = torch.full(shape, math.nan, dtype=dtype), torch.full(shape, math.nan, dtype=dtype)
    keys, values = [], []
    for s, n in enumerate(kv_lens):
        table[s, : needed[s]] = ids[sum(needed[:s]) : sum(needed[: s + 1])]
        slots = torch.from_numpy(table[s, np.arange(n) // PAGE] * PAGE + np.arange(n) % PAGE)
        for cache, stored in ((k_cache, keys), (v_cache, values)):
            cache.view(-1, kv_heads, head_dim)[slots] = torch.from_numpy(
                rng.standard_normal((n, kv_heads, head_dim))
            ).to(dtype)
            stored.append(cache.view(-1, kv_heads, head_dim)[slots].double().numpy())
    starts = np.concatenate([[0], np.cumsum(q_lens)])
    return PagedCase(
        q=torch.from_numpy(rng.standard_normal((starts[-1] + 1, q_heads, head_dim)).astype(np.float32)),
        k_cache=k_cache,
        v_cache=v_cache,
        block_tables=torch.from_numpy(table.astype(np.int32)),
        seq_lens=torch.tensor(kv_lens, dtype=torch.int32),
        query_start_loc=torch.from_numpy(starts.astype(np.int32)),
        keys=keys,
        values=values,
    )


def oracle(case: PagedCase, scale: float) -> np.ndarray:
    """float64: query row i of sequence s (position kv_len - q_len + i) over positions 0..=it."""
    q = case.q.double().numpy()
    out = np.zeros(q.shape)
    starts = case.query_start_loc.tolist()
    for s, (k, v) in enumerate(zip(case.keys, case.values, strict=True)):
        group = q.shape[1] // k.shape[1]
        for row in range(starts[s], starts[s + 1]):
            pos = k.shape[0] - (starts[s + 1] - row)
            for h in range(q.shape[1]):
                scores = k[: pos + 1, h // group] @ q[row, h] * scale
                weights = np.exp(scores - scores.max())
                out[row, h] = weights @ v[: pos + 1, h // group] / weights.sum()
    return out


def check(out: torch.Tensor, expected: np.ndarray | torch.Tensor) -> None:
    """``out`` against ``expected`` on the rows sequences own: all but the last (the Triton op leaves a
    row no sequence owns unwritten; the reference zeroes it)."""
    out = out.cpu()
    assert out.dtype == torch.float32 and tuple(out.shape) == tuple(expected.shape)
    owned = out[:-1]
    assert not torch.isnan(owned).any()
    np.testing.assert_allclose(owned.numpy(), np.asarray(expected)[:-1], rtol=0, atol=ATOL)


@pytest.fixture
def attn_triton() -> ModuleType:
    """The Triton kernels' module (interpreted here: conftest set TRITON_INTERPRET before this import)."""
    pytest.importorskip("triton", reason="triton is not installed (it comes with torch on Linux x86_64)")
    from oxibonsai.torch_backend.ops import attn_triton

    return attn_triton


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("heads", [(2, 2), (4, 2)], ids=["gqa1", "gqa2"])
@pytest.mark.parametrize("lens", [DECODE, EXTEND], ids=["decode", "extend"])
def test_ref_matches_float64_oracle(
    rng: np.random.Generator, lens: tuple[list[int], list[int]], heads: tuple[int, int], dtype: torch.dtype
) -> None:
    case = make_case(rng, lens, heads, dtype=dtype)
    scale = 1 / math.sqrt(case.q.shape[-1])
    out = ref_torch.paged_attention(*case.args(), scale)
    check(out, oracle(case, scale))
    assert (out[-1] == 0).all()  # the row no sequence owns


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize(
    ("heads", "max_splits"),
    [((2, 2), 2), ((4, 2), 1), ((8, 2), 8), ((4, 1), 4)],
    ids=["gqa1-splits2", "gqa2-splits1", "gqa4-splits8", "gqa4-1kv-splits4"],
)
def test_triton_decode_matches_ref(
    attn_triton: ModuleType,
    rng: np.random.Generator,
    heads: tuple[int, int],
    max_splits: int,
    dtype: torch.dtype,
) -> None:
    """One split, several, and 8 splits over at most 40 positions (most of them empty)."""
    case = make_case(rng, DECODE, heads, dtype=dtype)
    scale = 1 / math.sqrt(case.q.shape[-1])
    out = attn_triton.paged_attention(*case.args(DEVICE), scale, max_splits=max_splits, precision="ieee")
    check(out, ref_torch.paged_attention(*case.args(), scale))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize(
    "heads", [(2, 2), (4, 2), (6, 2)], ids=["gqa1", "gqa2", "gqa3"]
)  # 3: not a power of 2
def test_triton_extend_matches_ref(
    attn_triton: ModuleType, rng: np.random.Generator, heads: tuple[int, int], dtype: torch.dtype
) -> None:
    """Whole prompts (40 rows: two query tiles at group 1), extends over a cached context, q_len 0/1."""
    case = make_case(rng, EXTEND, heads, dtype=dtype)
    scale = 1 / math.sqrt(case.q.shape[-1])
    out = attn_triton.paged_attention(*case.args(DEVICE), scale, precision="ieee")
    check(out, ref_torch.paged_attention(*case.args(), scale))


@pytest.mark.parametrize("lens", [DECODE, EXTEND], ids=["decode", "extend"])
def test_triton_head_dim_128(
    attn_triton: ModuleType, rng: np.random.Generator, lens: tuple[list[int], list[int]]
) -> None:
    """Bonsai's head size, fp16 cache, GQA 2."""
    case = make_case(rng, lens, (4, 2), head_dim=128, dtype=torch.float16)
    out = attn_triton.paged_attention(*case.args(DEVICE), 128**-0.5, precision="ieee")
    check(out, ref_torch.paged_attention(*case.args(), 128**-0.5))


@pytest.mark.parametrize("lens", [DECODE, EXTEND], ids=["decode", "extend"])
def test_triton_tf32_dots_the_gpu_default(
    attn_triton: ModuleType, rng: np.random.Generator, lens: tuple[list[int], list[int]]
) -> None:
    """The CUDA default: dots on tensor cores from inputs rounded to tf32 (10 mantissa bits, 2^-11
    relative). ``TF32_ATOL`` allows a few such roundings on outputs of size about 1; the interpreter
    computes these dots exactly, so the bound is checked only where a GPU runs this."""
    case = make_case(rng, lens, (4, 2), head_dim=128, dtype=torch.float16)
    out = attn_triton.paged_attention(*case.args(DEVICE), 128**-0.5, precision="tf32")
    expected = ref_torch.paged_attention(*case.args(), 128**-0.5)
    np.testing.assert_allclose(out.cpu().numpy()[:-1], expected.numpy()[:-1], rtol=0, atol=TF32_ATOL)
    with pytest.raises(ValueError, match="precision"):
        attn_triton.paged_attention(*case.args(DEVICE), 0.5, precision="fp8")


def test_no_queries(attn_triton: ModuleType, rng: np.random.Generator) -> None:
    """Every sequence with q_len 0 (the one row is no sequence's): the reference's zeros; the Triton op
    leaves the row unwritten."""
    case = make_case(rng, ([5, 17], [0, 0]), (2, 2))
    ref = ref_torch.paged_attention(*case.args(), 0.5)
    assert ref.shape == case.q.shape and (ref == 0).all()
    assert attn_triton.paged_attention(*case.args(DEVICE), 0.5).shape == case.q.shape


# (KV lengths, query lengths, decode_from): a recompute piece (2 prompt rows, then 10 sampled tokens),
# a whole recompute (20 prompt rows, 13 sampled), a prompt piece, a decode, a one-row prompt piece.
RECOMPUTE = ([40, 33, 20, 36, 18], [12, 33, 5, 1, 1], [30, 20, 25, 7, 18])
BIT_EXACT = {"max_splits": 2, "precision": "ieee"}  # the batched call's and each lone one's


def lone(attn_triton: ModuleType, case: PagedCase, seq: int, rows: slice, decode_from: int) -> torch.Tensor:
    """Rows ``rows`` of sequence ``seq``'s piece run as the only sequence of a step, ending at the last
    of them, with the batched call's settings (``BIT_EXACT``: on a GPU the defaults are 16 splits and
    tf32 dots)."""
    starts = case.query_start_loc.tolist()
    first, end = starts[seq] + rows.start, starts[seq] + rows.stop
    kv_len = int(case.seq_lens[seq]) - (starts[seq + 1] - end)
    lens = torch.tensor([kv_len], dtype=torch.int32)
    args = (case.q[first:end], case.k_cache, case.v_cache, case.block_tables[seq : seq + 1], lens,
            torch.tensor([0, end - first], dtype=torch.int32))  # fmt: skip
    out = attn_triton.paged_attention(
        *(t.to(DEVICE) for t in args),
        0.2,
        decode_from=torch.tensor([decode_from], dtype=torch.int32, device=DEVICE),
        **BIT_EXACT,
    )
    return out.cpu()


@pytest.mark.parametrize("known", [True, False], ids=["host-counts", "no-host-counts"])
def test_decode_from_sends_sampled_rows_to_the_decode_kernel_bit_for_bit(
    attn_triton: ModuleType, rng: np.random.Generator, known: bool
) -> None:
    """Rows at or past ``decode_from`` get the bits they get alone in a decode step, also when a
    piece holds many of them (a preempted request's recompute); the rows before it the bits of the
    prompt rows alone. (Two splits make the decode kernel's sums differ from the prefill kernel's
    from 33 positions on, so routing a sampled row to the prefill kernel fails this.)"""
    kv_lens, q_lens, decode_from = RECOMPUTE
    case = make_case(rng, (kv_lens, q_lens), (4, 2))
    if known:
        starts = case.query_start_loc.numpy()
        rows = torch.from_numpy(decode_rows(starts, np.array(kv_lens), np.array(decode_from))).to(DEVICE)
        assert rows.shape[0] == sum(q_lens) - 28, "28 prompt rows"
    hints = {"max_q_len": max(q_lens), "decode_rows": rows} if known else {}
    out = attn_triton.paged_attention(
        *case.args(DEVICE), 0.2, decode_from=torch.tensor(decode_from, dtype=torch.int32, device=DEVICE),
        **BIT_EXACT, **hints,
    ).cpu()  # fmt: skip
    check(out, ref_torch.paged_attention(*case.args(), 0.2))
    starts = case.query_start_loc.tolist()
    for seq, (kv_len, q_len, boundary) in enumerate(zip(*RECOMPUTE, strict=True)):
        prompt_rows = min(max(boundary - (kv_len - q_len), 0), q_len)
        if prompt_rows:
            want = lone(attn_triton, case, seq, slice(0, prompt_rows), kv_len)
            assert torch.equal(out[starts[seq] : starts[seq] + prompt_rows], want)
        for row in range(prompt_rows, q_len):
            want = lone(attn_triton, case, seq, slice(row, row + 1), 0)
            assert torch.equal(out[starts[seq] + row], want[0]), f"sequence {seq}, row {row}"


DECODE_STEP = ([5, 16, 17, 40, 33], [1, 1, 0, 1, 1])  # every row a sampled token (one sequence idle)


@pytest.mark.parametrize("lens", [DECODE_STEP, DECODE, EXTEND], ids=["decode-step", "decode", "extend"])
def test_quantized_attention_equals_quantizing_the_attention_output(
    attn_triton: ModuleType, rng: np.random.Generator, lens: tuple[list[int], list[int]]
) -> None:
    """The O projection's activations: in a decode step (every row a decode row) quantized by the merge
    kernel, in any other step after the attention; both the bits of ``q1_exact.quantize`` on the float
    output. Then ``attention_linear`` equals the composed exact ops bit for bit, and the reference's
    composition within float error."""
    import oxibonsai as ob
    from oxibonsai.torch_backend.batch import default_decode_from
    from oxibonsai.torch_backend.ops import q1_exact
    from oxibonsai.torch_backend.ops.q1_weight import Q1Weight

    case = make_case(rng, lens, (4, 2), head_dim=128)
    q, *plan = case.args(DEVICE)
    q = q[:-1]  # every row some sequence's, as in a runner's step
    starts, kv_lens = case.query_start_loc.numpy(), case.seq_lens.numpy()
    first_sampled = default_decode_from(starts, kv_lens)
    rows = decode_rows(starts, kv_lens, first_sampled)
    assert (rows.shape[0] == q.shape[0]) == (lens is DECODE_STEP), "a decode step takes the fused merge"
    hints = {
        "decode_from": torch.from_numpy(first_sampled).to(DEVICE),
        "decode_rows": torch.from_numpy(rows).to(DEVICE),
        "max_q_len": int(np.diff(starts).max()),
    }
    got = attn_triton.quantized_attention(q, *plan, 0.3, **hints)
    out = attn_triton.paged_attention(q, *plan, 0.3, **hints)
    want = q1_exact.quantize(out.reshape(q.shape[0], -1))
    assert torch.equal(got.planes, want.planes)
    assert torch.equal(got.scales, want.scales) and torch.equal(got.sums, want.sums)
    cols = q.shape[1] * q.shape[2]
    matrix = ob.Q1Matrix.quantize(rng.standard_normal((96, cols)).astype(np.float32))
    raw = np.frombuffer(matrix.to_bytes(), dtype=np.uint8)
    w, w_cpu = Q1Weight.from_gguf(raw, 96, cols, DEVICE), Q1Weight.from_gguf(raw, 96, cols)
    residual = torch.randn(q.shape[0], 96, device=DEVICE)
    fused = attn_triton.attention_linear(q, *plan, 0.3, w, residual=residual, **hints)
    assert torch.equal(fused, q1_exact.fused_linear(out.reshape(q.shape[0], -1), w, residual=residual))
    reference = ref_torch.attention_linear(q.cpu(), *case.args()[1:], 0.3, w_cpu, residual=residual.cpu())
    scale = float(reference.abs().max())
    np.testing.assert_allclose(fused.cpu().numpy(), reference.numpy(), rtol=0, atol=5e-3 * scale)


@pytest.mark.parametrize("max_splits", [1, 4, 16])
def test_the_decode_kernels_own_merge_gives_the_merge_launchs_bits(
    attn_triton: ModuleType, rng: np.random.Generator, monkeypatch: pytest.MonkeyPatch, max_splits: int
) -> None:
    """The program that stores a (row, KV head)'s last split merges its heads (the default) with the
    bits of the merge launch of its own (``OXIBONSAI_FUSE_MERGE=0``): the float output and the O
    projection's quantized activations, at 1, 4 and 16 splits (most empty), 3 query heads a KV head;
    the counters are back at zero after each launch. (Above ``MERGE_MAX_ROWS`` rows the merge launch
    runs: these equal bits keep a row's independent of its batch's size.)"""
    case = make_case(rng, DECODE_STEP, (6, 2), head_dim=128)
    q, *plan = case.args(DEVICE)
    q = q[:-1]
    starts, kv_lens = case.query_start_loc.numpy(), case.seq_lens.numpy()
    rows = torch.from_numpy(decode_rows(starts, kv_lens, kv_lens - np.diff(starts))).to(DEVICE)
    hints = {"decode_rows": rows, "max_splits": max_splits, "precision": "ieee"}
    outputs = {}
    for fuse in ("1", "0"):
        monkeypatch.setenv(attn_triton.FUSE_MERGE_ENV_VAR, fuse)
        out = attn_triton.paged_attention(q, *plan, 0.3, **hints)
        acts = attn_triton.quantized_attention(q, *plan, 0.3, **hints)
        assert not attn_triton.merge_counts(DEVICE).any()
        outputs[fuse] = (out, acts.planes, acts.scales, acts.sums)
    assert all(torch.equal(a, b) for a, b in zip(outputs["1"], outputs["0"], strict=True))
    want = ref_torch.paged_attention(*case.args(), 0.3)[:-1]  # the rows sequences own
    np.testing.assert_allclose(outputs["1"][0].cpu().numpy(), want.numpy(), rtol=0, atol=ATOL)


@pytest.mark.parametrize("heads", [(4, 2), (6, 2)], ids=["group2", "group3"])
@pytest.mark.parametrize("max_splits", [1, 4, 16])
def test_the_decode_kernel_does_the_qk_norm_rope_and_kv_write_with_their_launchs_bits(
    attn_triton: ModuleType,
    rng: np.random.Generator,
    monkeypatch: pytest.MonkeyPatch,
    heads: tuple[int, int],
    max_splits: int,
) -> None:
    """In a decode step (one decode row a sequence; one sequence idle, one row a padding row whose slot
    is -1) the decode kernel normalizes and rotates its q heads from the QKV rows and the program
    whose split holds a row's new position stores its K and V (``RopeKv``): the O projection's
    activations and both caches are the bits of the QK-norm/RoPE/KV launch followed by the attention
    (``OXIBONSAI_FUSE_ROPE=0``); a step with two rows for a sequence runs that launch first."""
    from oxibonsai.torch_backend.ops import ref_torch as ref

    q_heads, kv_heads = heads
    case = make_case(rng, DECODE_STEP, heads, head_dim=128, dtype=torch.float16)
    _, k_cache, v_cache, tables, seq_lens, starts = case.args(DEVICE)
    kv_lens, q_starts = case.seq_lens.numpy(), case.query_start_loc.numpy()
    tokens = int(q_starts[-1])
    row_seqs = np.repeat(np.arange(len(kv_lens)), np.diff(q_starts))
    positions = kv_lens[row_seqs] - 1
    table = case.block_tables.numpy()
    slots = table[row_seqs, positions // PAGE] * PAGE + positions % PAGE
    slots[-1] = -1  # a padding row: nothing stored, its attention read as it is
    qkv = torch.randn(tokens, (q_heads + 2 * kv_heads) * 128, device=DEVICE) * 3
    norms = [1 + 0.2 * torch.randn(128, device=DEVICE) for _ in range(2)]
    cos_sin = ref.rope_cos_sin(64, 128, 1e6, DEVICE)
    rows = torch.from_numpy(decode_rows(q_starts, kv_lens, kv_lens - np.diff(q_starts))).to(DEVICE)
    hints = {"decode_rows": rows, "max_q_len": 1, "max_splits": max_splits, "precision": "ieee"}
    results = {}
    for fuse in ("1", "0"):
        monkeypatch.setenv(attn_triton.FUSE_ROPE_ENV_VAR, fuse)
        caches = (k_cache.clone(), v_cache.clone())
        rope = attn_triton.RopeKv(
            qkv, *norms, torch.from_numpy(positions.astype(np.int32)).to(DEVICE),
            torch.from_numpy(slots.astype(np.int32)).to(DEVICE), *caches, cos_sin, q_heads, 1e-6,
        )  # fmt: skip
        assert attn_triton.fuses_rope(rope, tokens, 1) == (fuse == "1")
        acts = attn_triton.quantized_attention(rope, *caches, tables, seq_lens, starts, 0.3, **hints)
        results[fuse] = (acts.planes, acts.scales, acts.sums, *(c.view(torch.int16) for c in caches))
    assert all(torch.equal(a, b) for a, b in zip(results["1"], results["0"], strict=True))
    assert not attn_triton.fuses_rope(rope, tokens, 2)  # two rows for a sequence: the launch first


def test_the_decode_kernel_merges_up_to_eight_rows_or_wherever_asked(
    attn_triton: ModuleType, monkeypatch: pytest.MonkeyPatch, rng: np.random.Generator
) -> None:
    """``merges_in_decode``: up to ``MERGE_MAX_ROWS`` rows by default, never with
    ``OXIBONSAI_FUSE_MERGE=0``, wherever ``merge_counts`` holds the (row, KV head) pairs with ``=all``."""
    kv_heads = int(rng.integers(1, 9))
    most = attn_triton.MERGE_COUNTS // kv_heads
    monkeypatch.delenv(attn_triton.FUSE_MERGE_ENV_VAR, raising=False)
    limit = attn_triton.MERGE_MAX_ROWS
    assert [attn_triton.merges_in_decode(r, kv_heads) for r in (1, limit, limit + 1)] == [True, True, False]
    monkeypatch.setenv(attn_triton.FUSE_MERGE_ENV_VAR, "all")
    assert attn_triton.merges_in_decode(most, kv_heads) and not attn_triton.merges_in_decode(
        most + 1, kv_heads
    )
    monkeypatch.setenv(attn_triton.FUSE_MERGE_ENV_VAR, "0")
    assert not attn_triton.merges_in_decode(1, kv_heads)
    monkeypatch.setenv(attn_triton.FUSE_MERGE_ENV_VAR, "yes")
    with pytest.raises(ValueError, match="OXIBONSAI_FUSE_MERGE"):
        attn_triton.merges_in_decode(1, kv_heads)
