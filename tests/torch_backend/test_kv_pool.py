"""``KvPool`` and ``copy_blocks``: vLLM's three transfer assertions over random block mappings (the
source is unchanged, every mapped destination equals its source in every layer for K and V, every
unmapped destination keeps its old content), refusal of bad move lists with nothing copied, the layer
views and the size arithmetic. Both pools are CPU tensors here; the device <-> pinned case runs where a
GPU exists."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (pip install 'oxibonsai[torch]')")

from oxibonsai.torch_backend.kv_pool import KvPool, copy_blocks  # noqa: E402

DTYPES = [torch.float32, torch.float16]


def random_pool(
    num_blocks: int,
    dtype: torch.dtype,
    device: str = "cpu",
    *,
    pin: bool = False,
    block_major: bool = False,
    **dims: int,
):
    layers, heads, head_dim = dims.get("layers", 3), dims.get("heads", 2), dims.get("head_dim", 8)
    pool = KvPool(layers, num_blocks, heads, head_dim, dtype, device, pin=pin, block_major=block_major)
    pool.data.copy_(torch.randn(pool.data.shape, dtype=torch.float32).to(dtype))
    return pool


def random_moves(rng: np.random.Generator, src_blocks: int, dst_blocks: int) -> np.ndarray:
    """Up to min(src, dst) moves: sources drawn with repeats, destinations distinct."""
    n = int(rng.integers(1, min(src_blocks, dst_blocks) + 1))
    src = rng.integers(0, src_blocks, n)
    dst = rng.choice(dst_blocks, n, replace=False)
    return np.stack([src, dst], axis=1).astype(np.int32)


def layer_major(pool: KvPool) -> torch.Tensor:
    """A CPU copy of the pool's bytes as ``[layers, 2, blocks, ...]``, whatever its layout."""
    return pool.blocks(torch.arange(pool.num_blocks, device=pool.device)).cpu()


def assert_transfer(src_before: torch.Tensor, dst_before: torch.Tensor, src: KvPool, dst: KvPool, moves):
    """vLLM tests/v1/kv_offload/test_cpu_gpu.py's three assertions (on layer-major copies)."""
    assert torch.equal(layer_major(src), src_before)
    after = layer_major(dst)
    for s, d in moves:
        assert torch.equal(after[:, :, d], src_before[:, :, s])  # every layer, K and V
    unmapped = np.setdiff1d(np.arange(dst.num_blocks), moves[:, 1])
    assert torch.equal(after[:, :, unmapped], dst_before[:, :, unmapped])


LAYOUTS = [(False, False), (False, True), (True, False), (True, True)]  # (src, dst) block-major


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("src_major", "dst_major"), LAYOUTS)
def test_random_block_moves_between_two_pools(rng, dtype, src_major, dst_major):
    for _ in range(5):
        src = random_pool(int(rng.integers(1, 20)), dtype, block_major=src_major)
        dst = random_pool(int(rng.integers(1, 20)), dtype, block_major=dst_major)
        moves = random_moves(rng, src.num_blocks, dst.num_blocks)
        src_before, dst_before = layer_major(src), layer_major(dst)
        copy_blocks(src, dst, moves)
        assert_transfer(src_before, dst_before, src, dst, moves)


def test_consecutive_blocks_are_grouped_into_runs():
    from oxibonsai.torch_backend.kv_pool import _runs

    assert _runs(np.array([4, 5, 6, 9, 2, 3, 3])) == [(4, 3, 0), (9, 1, 3), (2, 2, 4), (3, 1, 6)]
    assert _runs(np.array([7])) == [(7, 1, 0)]


def test_a_block_major_pool_keeps_each_block_contiguous_and_has_no_layer_views():
    pool = KvPool(3, 5, 2, 8, torch.float16, "cpu", block_major=True)
    assert pool.data.shape == (5, 3, 2, 16, 2, 8) and pool.num_blocks == 5 and pool.num_layers == 3
    assert pool.data[2].is_contiguous() and pool.nbytes == 5 * pool.block_bytes
    with pytest.raises(ValueError, match="no layer views"):
        pool.layer(0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_moves_within_one_pool_read_every_source_before_writing(rng, dtype):
    pool = random_pool(8, dtype)
    for moves in [np.array([[0, 1], [1, 0], [5, 2]]), *(random_moves(rng, 8, 8) for _ in range(3))]:
        before = pool.data.clone()
        copy_blocks(pool, pool, moves)  # the first list swaps blocks 0 and 1 and copies 5 onto 2
        after = pool.data
        for s, d in moves:
            assert torch.equal(after[:, :, d], before[:, :, s])
        unmapped = np.setdiff1d(np.arange(8), moves[:, 1])
        assert torch.equal(after[:, :, unmapped], before[:, :, unmapped])


@pytest.mark.parametrize(
    "pairs, message",
    [
        (np.array([[0, 4], [9, 5]]), "source block ids \\[9\\]"),
        (np.array([[-1, 4]]), "source block ids \\[-1\\]"),
        (np.array([[0, 6], [1, 2]]), "destination block ids \\[6\\]"),
        (np.array([[0, -2]]), "destination block ids \\[-2\\]"),
        (np.array([[0, 3], [1, 3], [2, 1]]), "destination blocks \\[3\\] appear more than once"),
        (np.array([0, 1]), "shape \\(n, 2\\)"),
        (np.array([[0, 1, 2]]), "shape \\(n, 2\\)"),
        (np.array([[0.0, 1.0]]), "integer array"),
    ],
)
def test_bad_move_lists_raise_and_copy_nothing(pairs, message):
    src, dst = random_pool(9, torch.float16), random_pool(6, torch.float16)
    src_before, dst_before = src.data.clone(), dst.data.clone()
    with pytest.raises(ValueError, match=message):
        copy_blocks(src, dst, pairs)
    assert torch.equal(src.data, src_before) and torch.equal(dst.data, dst_before)


def test_pools_of_different_layouts_are_refused():
    src = random_pool(4, torch.float16)
    for other in (
        random_pool(4, torch.float32),
        random_pool(4, torch.float16, heads=4),
        random_pool(4, torch.float16, layers=2),
        random_pool(4, torch.float16, head_dim=16),
    ):
        before = other.data.clone()
        with pytest.raises(ValueError, match="pools differ"):
            copy_blocks(src, other, np.array([[0, 0]], dtype=np.int32))
        assert torch.equal(other.data, before)


def test_an_empty_move_list_is_a_no_op():
    src, dst = random_pool(3, torch.float32), random_pool(3, torch.float32)
    before = dst.data.clone()
    copy_blocks(src, dst, np.zeros((0, 2), dtype=np.int32))
    assert torch.equal(dst.data, before)


def test_layer_views_share_the_pool_memory():
    pool = KvPool(4, 5, 2, 8, torch.float16, "cpu")
    assert pool.data.shape == (4, 2, 5, 16, 2, 8) and not pool.data.any()
    k, v = pool.layer(2)
    assert k.shape == v.shape == (5, 16, 2, 8) and k.is_contiguous() and v.is_contiguous()
    k[3, 7, 1] = 1.5
    v[0, 15, 0] = -2.0
    assert pool.data[2, 0, 3, 7, 1].eq(1.5).all() and pool.data[2, 1, 0, 15, 0].eq(-2.0).all()
    assert int(pool.data.ne(0).sum()) == 16
    with pytest.raises(IndexError):
        pool.layer(4)


def test_sizes():
    # Bonsai-1.7B's KV: 28 layers x 8 KV heads x 128 x fp16 = 112 KiB per token, 16 tokens per block.
    assert KvPool.bytes_per_block(28, 8, 128, torch.float16) == 112 * 1024 * 16
    assert KvPool.bytes_per_block(2, 2, 64, torch.float32) == 2 * 2 * 16 * 2 * 64 * 4
    pool = KvPool(3, 7, 2, 32, torch.float16, "cpu")
    assert pool.block_bytes == KvPool.bytes_per_block(3, 2, 32, torch.float16) == 3 * 2 * 16 * 2 * 32 * 2
    assert pool.nbytes == 7 * pool.block_bytes == pool.data.numel() * pool.data.element_size()
    good = {"num_layers": 1, "num_blocks": 2, "kv_heads": 1, "head_dim": 8}
    for name, value in (("num_blocks", 0), ("kv_heads", -1), ("head_dim", 2.5), ("num_layers", True)):
        with pytest.raises(ValueError, match=name):
            KvPool(**{**good, name: value}, dtype=torch.float16, device="cpu")


def test_block_bytes_match_the_native_engine():
    from oxibonsai._core import Model
    from oxibonsai.llm import default_model_path

    native = Model(default_model_path(), max_model_len=32, kv_blocks=4, kv_cache_dtype="f16")
    c = native.config
    assert native.block_tokens == 16
    assert (
        KvPool.bytes_per_block(c["n_layers"], c["n_kv_heads"], c["head_dim"], torch.float16)
        == native.block_bytes
    )


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only fallback")
def test_pinning_is_a_no_op_without_cuda():
    pool = KvPool(1, 2, 1, 8, torch.float16, "cpu", pin=True)
    assert not pool.pinned and pool.device.type == "cpu"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("host_major", [True, False])
def test_moves_between_device_and_pinned_host_pools(rng, dtype, host_major):
    host = random_pool(24, dtype, pin=True, block_major=host_major)
    device = random_pool(16, dtype, "cuda")
    assert host.pinned
    for src, dst in ((host, device), (device, host), (device, device)):
        moves = random_moves(rng, src.num_blocks, dst.num_blocks)
        src_before, dst_before = layer_major(src), layer_major(dst)
        copy_blocks(src, dst, moves)
        torch.cuda.synchronize()
        assert_transfer(src_before, dst_before, src, dst, moves)


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_page_aligned_tensor_owns_whole_pages(rng, dtype):
    from oxibonsai.torch_backend.kv_pool import PAGE_BYTES, page_aligned_zeros

    shape = (3, 2, int(rng.integers(1, 40)), 16, 2, 8)
    data, ptr, span = page_aligned_zeros(shape, dtype)
    assert data.shape == shape and data.dtype == dtype and data.is_contiguous()
    assert ptr == data.data_ptr() and ptr % PAGE_BYTES == 0 and span % PAGE_BYTES == 0
    assert span - PAGE_BYTES < data.numel() * data.element_size() <= span
    storage = data.untyped_storage()
    assert storage.data_ptr() + storage.nbytes() >= ptr + span, "the locked pages are the buffer's"
    assert not data.any()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_small_pinned_pools_side_by_side_leave_no_cuda_error(rng):
    """Small host pools, alive together: the pages each registers hold nothing another locked (a
    failed registration leaves an error on the thread that torch's next launch check raises)."""
    sizes = rng.integers(1, 6, 12)
    pools = [random_pool(int(n), torch.float16, pin=True, block_major=True) for n in sizes]
    device = random_pool(8, torch.float16, "cuda")
    for host in pools:
        assert host.pinned and host.data.is_pinned()
        moves = random_moves(rng, host.num_blocks, device.num_blocks)
        src_before, dst_before = layer_major(host), layer_major(device)
        copy_blocks(host, device, moves)
        torch.cuda.synchronize()
        assert_transfer(src_before, dst_before, host, device, moves)


def random_tier_step(rng: np.random.Generator, device_blocks: int, host_blocks: int):
    """One step's copies as the Rust core may record them: demotions of random device blocks, then
    promotions and prefetches into other device blocks (some into just-demoted ones), some of them
    reading a host block demoted to in the same step."""
    n = int(rng.integers(1, 4))
    demoted = rng.choice(device_blocks, n, replace=False)
    slots = rng.choice(host_blocks, n, replace=False)
    demote = np.stack([demoted, slots], axis=1)
    destinations = rng.permutation(device_blocks)[: int(rng.integers(2, 7))]
    sources = np.where(rng.random(destinations.size) < 0.3, rng.choice(slots, destinations.size), 0)
    others = rng.choice(np.setdiff1d(np.arange(host_blocks), slots), destinations.size, replace=False)
    sources = np.where(sources == 0, others, sources)
    split = int(rng.integers(0, destinations.size + 1))
    moves = np.stack([sources, destinations], axis=1)
    return demote, moves[:split], moves[split:]


def test_tier_copies_read_every_block_after_its_last_write(rng):
    """A step's demotions read the device blocks before promotions or prefetches overwrite them, and a
    promotion or prefetch of a host block demoted to in the same step reads the demoted bytes. On a
    CUDA device this runs on the copier's side stream, the prefetches beside a 'forward pass' that
    waits for the promotions, and the next step (no copies) waits for the prefetches."""
    from oxibonsai.torch_backend.kv_pool import TierCopier

    device = "cuda" if torch.cuda.is_available() else "cpu"
    for _ in range(6):
        kv = random_pool(12, torch.float16, device)
        host = random_pool(20, torch.float16, pin=device == "cuda", block_major=True)
        demote, promote, prefetch = random_tier_step(rng, 12, 20)
        kv_before, host_before = layer_major(kv), layer_major(host)
        expected_host = host_before.clone()
        for d, h in demote:
            expected_host[:, :, h] = kv_before[:, :, d]
        copier = TierCopier(kv, host)
        copier.run(demote, promote, prefetch)
        promoted = kv.blocks(torch.from_numpy(promote[:, 1]).to(device)).clone()  # the forward's read
        copier.run(np.zeros((0, 2)), np.zeros((0, 2)))  # the next step, waiting for the prefetches
        prefetched = kv.blocks(torch.from_numpy(prefetch[:, 1]).to(device)).clone()
        if device == "cuda":
            torch.cuda.synchronize()
        assert torch.equal(layer_major(host), expected_host)
        assert torch.equal(promoted.cpu(), expected_host[:, :, promote[:, 0]])
        assert torch.equal(prefetched.cpu(), expected_host[:, :, prefetch[:, 0]])


def test_tier_copies_check_both_lists_before_copying_anything():
    from oxibonsai.torch_backend.kv_pool import TierCopier

    kv, host = random_pool(4, torch.float32), random_pool(4, torch.float32, block_major=True)
    kv_before, host_before = kv.data.clone(), host.data.clone()
    with pytest.raises(ValueError, match="source block ids"):
        TierCopier(kv, host).run(np.array([[0, 1]]), np.array([[9, 0]]))
    with pytest.raises(ValueError, match="destination block ids"):
        TierCopier(kv, host).run(np.array([[0, 1]]), np.array([[1, 0]]), np.array([[2, 7]]))
    assert torch.equal(kv.data, kv_before) and torch.equal(host.data, host_before)
