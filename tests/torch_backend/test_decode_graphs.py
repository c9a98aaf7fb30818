"""Decode steps padded into CUDA-graph buckets (``graphs.DecodeGraphs``). On the CPU the padded
buffers run eagerly (``capture=False``), which checks everything but the capture itself: the bucket
sizes, the padding rules of the module doc, that padding rows never write the KV pool, and that padded
steps give the logits and the greedy tokens of plain eager steps. With CUDA, the captured graphs give
the tokens of eager steps."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (pip install 'oxibonsai[torch]')")

import oxibonsai as ob  # noqa: E402
from oxibonsai.torch_backend.batch import StepBatch  # noqa: E402
from oxibonsai.torch_backend.graphs import DecodeGraphs, _Layout, decode_buckets, is_plain_decode  # noqa: E402
from oxibonsai.torch_backend.model import TorchQwen3  # noqa: E402
from oxibonsai.torch_backend.ops import ref_torch  # noqa: E402
from oxibonsai.torch_backend.ops.dispatch import ops_for  # noqa: E402

from models import tiny_config, write_tiny  # noqa: E402

CUDA = torch.cuda.is_available()
SPLIT_ATOL = 1e-4  # BLAS sums a different number of rows in another order (test_torch_model's bound)
GREEDY = ob.SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
ARGS: dict[str, object] = {
    "runner": "torch", "max_model_len": 256, "max_num_seqs": 6, "kv_cache_dtype": "f32"
}  # fmt: skip


def test_every_batch_size_has_the_smallest_bucket_that_holds_it():
    assert decode_buckets(1) == (1,)
    assert decode_buckets(6) == (1, 2, 4, 6)
    assert decode_buckets(64) == (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64)
    assert decode_buckets(70)[-2:] == (64, 70)
    with pytest.raises(ValueError, match="max_num_seqs"):
        decode_buckets(0)


def test_a_padded_step_runs_the_matmul_tiles_of_its_eager_twin():
    """Graph and eager steps give the same tokens because a step padded to its bucket picks the same
    Q1 kernel and tile height as the unpadded step: the f16x2 GEMV (1-2 rows), the GEMV's power-of-two
    BLOCK_M (3-8) or the GEMM's tile height (9+)."""
    triton = pytest.importorskip("triton", reason="triton is not installed")
    from oxibonsai.torch_backend.ops import q1_fast, q1_triton

    def tiles(m: int) -> tuple[str, int]:
        if m <= q1_fast.MAX_M:
            return "f16x2", m
        if m <= q1_triton.GEMV_MAX_M:
            return "gemv", int(triton.next_power_of_2(m))
        return "gemm", q1_triton.gemm_block_m(m)

    for max_num_seqs in (6, 64, 100, 256):
        buckets = decode_buckets(max_num_seqs)
        for n in range(1, max_num_seqs + 1):
            bucket = next(b for b in buckets if b >= n)
            assert tiles(bucket) == tiles(n), (max_num_seqs, n, bucket)


def random_decode_step(
    rng: np.random.Generator, n: int, vocab: int, max_blocks: int, num_blocks: int
) -> StepBatch:
    """``n`` sequences with random contexts and distinct random blocks, one new token each."""
    blocks = rng.permutation(num_blocks)
    seqs, used = [], 0
    for _ in range(n):
        context = int(rng.integers(1, 16 * max_blocks))  # a sampled token follows at least its prompt
        count = context // 16 + 1
        seqs.append((blocks[used : used + count].tolist(), context, [int(rng.integers(0, vocab))], "last"))
        used += count
    return StepBatch.for_sequences(seqs)


def test_padding_rows_follow_the_rules(rng):
    max_blocks, n = 5, int(rng.integers(1, 8))
    layout = _Layout(8, max_blocks)
    step = random_decode_step(rng, n, 100, max_blocks, 64)
    bucket = 8
    buffer = np.full(layout.words, 7, dtype=np.int32)  # stale values from an earlier step
    layout.constants(buffer)
    layout.fill(buffer, step, bucket)
    inputs = layout.device_batch(torch.from_numpy(buffer), bucket)
    assert inputs.slot_mapping.dtype == torch.int64
    assert inputs.slot_mapping[:n].tolist() == step.slot_mapping.tolist()
    assert (inputs.slot_mapping[n:] == -1).all()
    assert inputs.input_ids[:n].tolist() == step.input_ids.tolist() and (inputs.input_ids[n:] == 0).all()
    assert inputs.positions[:n].tolist() == step.positions.tolist() and (inputs.positions[n:] == 0).all()
    assert inputs.seq_lens[:n].tolist() == step.seq_lens.tolist() and (inputs.seq_lens[n:] == 1).all()
    width = step.block_tables.shape[1]
    assert inputs.block_tables.shape == (bucket, max_blocks)
    assert (inputs.block_tables[:n, :width].numpy() == step.block_tables).all()
    assert (inputs.block_tables[:n, width:] == 0).all() and (inputs.block_tables[n:] == 0).all()
    assert inputs.query_start_loc.tolist() == list(range(bucket + 1))
    assert inputs.logits_indices.tolist() == list(range(bucket))


def test_a_bucket_reads_only_the_words_its_step_copies(rng):
    max_blocks, max_batch = int(rng.integers(1, 9)), 16
    layout = _Layout(max_batch, max_blocks)
    for bucket in decode_buckets(max_batch):
        n = int(rng.integers(1, bucket + 1))
        buffer = rng.integers(-(2**31), 2**31, layout.words, dtype=np.int64).astype(np.int32)
        layout.constants(buffer)
        layout.fill(buffer, random_decode_step(rng, n, 200, max_blocks, max_batch * (max_blocks + 1)), bucket)
        stale = buffer.copy()
        stale[layout.used_words(bucket) :] = 12345  # what a copy of the used words leaves on the device
        want, got = (layout.device_batch(torch.from_numpy(b), bucket) for b in (buffer, stale))
        for field in ("input_ids", "positions", "slot_mapping", "query_start_loc", "seq_lens",
                      "block_tables", "logits_indices", "decode_from", "decode_rows"):  # fmt: skip
            assert torch.equal(getattr(got, field), getattr(want, field)), (bucket, field)


def test_only_plain_decode_steps_fit(tiny_model, rng):
    model = TorchQwen3.from_gguf(tiny_model, "cpu", ops=ref_torch)
    pool = model.new_kv_pool(64)
    graphs = DecodeGraphs(model, pool, max_num_seqs=4, max_model_len=64, capture=False)
    vocab = model.config.vocab
    assert graphs.fits(random_decode_step(rng, 4, vocab, 4, 64))
    assert not graphs.fits(random_decode_step(rng, 5, vocab, 4, 64)), "more sequences than a bucket"
    too_long = StepBatch.for_sequences([([0, 1, 2, 3, 4], 70, [1], "last")])
    assert not graphs.fits(too_long), "past max_model_len"
    prefill = StepBatch.for_sequences([([0], 0, [1, 2, 3], "last")])
    assert not is_plain_decode(prefill) and not graphs.fits(prefill)
    no_logits = StepBatch.for_sequences([([0], 3, [1], "none")])
    assert not graphs.fits(no_logits)
    one_token_prompt = StepBatch.for_sequences([([0], 0, [1], "last")])
    assert not graphs.fits(one_token_prompt), "a prompt row runs eagerly, through the prefill kernel"
    assert not graphs.fits(StepBatch.for_sequences([([0], 3, [1], "last", 4)])), "a last prompt row"
    with pytest.raises(ValueError, match="CUDA"):
        DecodeGraphs(model, pool, max_num_seqs=4, max_model_len=64, capture=True)


def test_padded_steps_give_the_logits_of_eager_steps_and_write_only_real_slots(tiny_model, rng):
    model = TorchQwen3.from_gguf(tiny_model, "cpu", ops=ref_torch)
    num_blocks, max_blocks = 96, 6
    eager_pool, padded_pool = model.new_kv_pool(num_blocks), model.new_kv_pool(num_blocks)
    fill = torch.from_numpy(rng.standard_normal(eager_pool.data.shape).astype(np.float32))
    graphs = DecodeGraphs(model, padded_pool, max_num_seqs=12, max_model_len=16 * max_blocks, capture=False)
    for n in (1, 3, 5, 8, 9, 12):
        eager_pool.data.copy_(fill)
        padded_pool.data.copy_(fill)
        step = random_decode_step(rng, n, model.config.vocab, max_blocks, num_blocks)
        want = model.forward(step.to_device("cpu"), eager_pool)
        got = graphs.run(step)
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=1e-3, atol=SPLIT_ATOL)
        # [layers, 2, slots, heads, dim]: the step's slots hold its K/V, every other slot is untouched
        slots = torch.from_numpy(step.slot_mapping)
        padded, eager = padded_pool.data.flatten(2, 3), eager_pool.data.flatten(2, 3)
        torch.testing.assert_close(padded[:, :, slots], eager[:, :, slots], rtol=1e-3, atol=SPLIT_ATOL)
        untouched = torch.ones(padded.shape[2], dtype=torch.bool)
        untouched[slots] = False
        assert torch.equal(padded[:, :, untouched], fill.flatten(2, 3)[:, :, untouched]), (
            f"{n} rows padded to {graphs.bucket_for(n)} wrote outside their slots"
        )


@pytest.fixture(scope="module")
def small_model(tmp_path_factory: pytest.TempPathFactory, model_seed: int) -> Path:
    cfg = tiny_config(hidden_size=128, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=64, ffn_size=128)
    return write_tiny(tmp_path_factory.mktemp("models") / "small.gguf", model_seed + 11, cfg=cfg)


def test_padded_steps_on_the_triton_kernels_give_the_logits_of_eager_steps(small_model, monkeypatch, rng):
    """The kernels size their tiles as an eager step of n rows would, so the logits are the same bits."""
    pytest.importorskip("triton", reason="triton is not installed")
    monkeypatch.setenv("OXIBONSAI_TORCH_OPS", "triton")
    device = "cuda" if CUDA else "cpu"
    model = TorchQwen3.from_gguf(small_model, device, ops=ops_for(device))
    pool = model.new_kv_pool(48)
    pool.data.copy_(torch.from_numpy(rng.standard_normal(pool.data.shape).astype(np.float32)))
    graphs = DecodeGraphs(model, pool, max_num_seqs=12, max_model_len=64, capture=False)
    for n in (3, 10):
        step = random_decode_step(rng, n, model.config.vocab, 4, 48)
        want = model.forward(step.to_device(device), pool)
        assert torch.equal(graphs.run(step), want), f"{n} rows padded to {graphs.bucket_for(n)}"


def token_lists(outs: list[ob.RequestOutput]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def padded_llm(path: Path, device: str) -> ob.LLM:
    """An engine whose decode steps run through padded buckets without capturing graphs."""
    llm = ob.LLM(path, device=device, enforce_eager=True, **ARGS)  # type: ignore[arg-type]
    runner = llm._runner
    runner.graphs = DecodeGraphs(  # type: ignore[attr-defined]
        runner.model,
        runner.kv,
        max_num_seqs=6,
        max_model_len=256,
        capture=False,  # type: ignore[attr-defined]
    )
    return llm


def test_padded_decode_gives_the_greedy_tokens_of_eager_decode(tiny_model, rng):
    eager = ob.LLM(tiny_model, device="cpu", **ARGS)  # type: ignore[arg-type]
    assert eager._runner.graphs is None, "no graphs off CUDA"  # type: ignore[attr-defined]
    padded = padded_llm(tiny_model, "cpu")
    vocab = eager.config["vocab"]
    prompts = [[int(t) for t in rng.integers(0, vocab, int(rng.integers(1, 40)))] for _ in range(5)]
    lengths = [ob.SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in (3, 12, 7, 20, 1)]
    want = token_lists(eager.generate(prompts, lengths))  # batches shrink from 5 to 1 as requests end
    assert token_lists(padded.generate(prompts, lengths)) == want
    assert padded.cache_stats()["free_blocks"] == eager.cache_stats()["free_blocks"]


@pytest.mark.skipif(not CUDA, reason="CUDA graphs need a CUDA device")
def test_cuda_graphs_give_the_tokens_of_eager_steps(tiny_model, rng):
    graphed = ob.LLM(tiny_model, device="cuda", **ARGS)  # type: ignore[arg-type]
    eager = ob.LLM(tiny_model, device="cuda", enforce_eager=True, **ARGS)  # type: ignore[arg-type]
    vocab = eager.config["vocab"]
    prompts = [[int(t) for t in rng.integers(0, vocab, int(rng.integers(1, 40)))] for _ in range(5)]
    lengths = [ob.SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in (3, 12, 7, 20, 1)]
    assert token_lists(graphed.generate(prompts, lengths)) == token_lists(eager.generate(prompts, lengths))
    graphs = graphed._runner.graphs  # type: ignore[attr-defined]
    assert graphs is not None and graphs.enabled and graphs.replays > 0
