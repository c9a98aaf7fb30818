"""The whole torch model with every Triton kernel (Triton's interpreter on the CPU, the GPU kernels on
CUDA) against the same model with the plain-torch reference ops: a prefill then decode steps through
the paged KV pool. The interpreter runs each kernel program as numpy work, so the model is tiny."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (pip install 'oxibonsai[torch]')")
pytest.importorskip("triton", reason="triton is not installed")

from oxibonsai.torch_backend.batch import StepBatch  # noqa: E402
from oxibonsai.torch_backend.model import TorchQwen3  # noqa: E402
from oxibonsai.torch_backend.ops import ref_torch  # noqa: E402
from oxibonsai.torch_backend.ops.dispatch import ops_for  # noqa: E402

from models import tiny_config, write_tiny  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# The Q1 matmuls run the CPU engine's exact arithmetic (int16 activations per 128), so the interpreter
# gets the CPU engine's bound against float weights and activations (tests/test_massive_activations.py,
# REL_L2_MAX = 6e-3). On CUDA attention's dots are also tf32, so the bound is looser there; not yet
# measured on a GPU.
# That bound is a typical case, not a ceiling: one CI run (session 35) drew a model and prompt at
# 6.3e-3, so the exact form is held to 8e-3. The float kernels (OXIBONSAI_Q1_ARITHMETIC=float) hold
# 2e-3 in the interpreter.
BOUNDS = {"exact": (8e-3, 2e-2), "float": (2e-3, 1e-2)}
CUDA_BOUNDS = (1e-2, 5e-2)


@pytest.fixture(scope="module")
def small_model(tmp_path_factory: pytest.TempPathFactory, model_seed: int) -> Path:
    cfg = tiny_config(hidden_size=128, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=64, ffn_size=128)
    return write_tiny(tmp_path_factory.mktemp("models") / "small.gguf", model_seed + 7, cfg=cfg)


def steps(
    model: TorchQwen3, prompt: list[int], decodes: list[int], pool: Any = None, done: int = 0
) -> list[np.ndarray]:
    """Logits of a prefill's last row, then of each single-token decode, over blocks [3, 1] of
    ``pool`` (a fresh one by default); with ``done`` the prompt is already in ``pool``."""
    pool = model.new_kv_pool(4) if pool is None else pool
    table, out = [3, 1], []
    for tokens in [prompt[done:], *([t] for t in decodes)]:
        if not tokens:
            continue
        batch = StepBatch.for_sequences([(table, done, tokens, "last")])
        out.append(model.forward(batch.to_device(DEVICE), pool).cpu().numpy()[0])
        done += len(tokens)
    return out


@pytest.mark.parametrize("arithmetic", ["exact", "float"])
def test_triton_kernels_run_the_model_as_the_reference_ops_do(small_model, monkeypatch, rng, arithmetic):
    rel_l2, gap = CUDA_BOUNDS if DEVICE == "cuda" else BOUNDS[arithmetic]
    monkeypatch.setenv("OXIBONSAI_TORCH_OPS", "triton")
    monkeypatch.setenv("OXIBONSAI_Q1_ARITHMETIC", arithmetic)
    triton_model = TorchQwen3.from_gguf(small_model, DEVICE, ops=ops_for(DEVICE))
    ref_model = TorchQwen3.from_gguf(small_model, DEVICE, ops=ref_torch)
    vocab = ref_model.config.vocab
    prompt = [int(t) for t in rng.integers(0, vocab, 5)]
    decodes = [int(t) for t in rng.integers(0, vocab, 2)]
    ours, want = steps(triton_model, prompt, decodes), steps(ref_model, prompt, decodes)
    for got, ref in zip(ours, want, strict=True):
        assert np.linalg.norm(got - ref) / np.linalg.norm(ref) < rel_l2
        assert int(got.argmax()) == int(ref.argmax()) or np.sort(ref)[-1] - np.sort(ref)[-2] < gap


def test_a_sequences_logits_do_not_depend_on_the_rest_of_the_step(small_model, monkeypatch, rng):
    """Exact Q1 matmuls plus attention that routes one-row sequences to the decode kernel: each
    sequence's logits are the same bits alone and in a step with 8 others (prefills of 1 to 20 tokens,
    then a step mixing one-token decodes with 3-token extends; 9 rows go through the GEMM, 1 through
    the GEMV)."""
    monkeypatch.setenv("OXIBONSAI_TORCH_OPS", "triton")
    monkeypatch.setenv("OXIBONSAI_Q1_ARITHMETIC", "exact")
    model = TorchQwen3.from_gguf(small_model, DEVICE, ops=ops_for(DEVICE))
    vocab, n = model.config.vocab, 9
    prompts = [[int(t) for t in rng.integers(0, vocab, int(rng.integers(1, 21)))] for _ in range(n)]
    second = [[int(t) for t in rng.integers(0, vocab, 1 if i < 4 else 3)] for i in range(n)]
    tables = [[2 * i, 2 * i + 1] for i in range(n)]
    steps = [[(tables[i], 0, prompts[i], "last") for i in range(n)],
             [(tables[i], len(prompts[i]), second[i], "last") for i in range(n)]]  # fmt: skip

    def run(pool, seqs):
        return model.forward(StepBatch.for_sequences(seqs).to_device(DEVICE), pool).cpu()

    alone_pool, batched_pool = model.new_kv_pool(2 * n), model.new_kv_pool(2 * n)
    for step in steps:
        alone = torch.cat([run(alone_pool, [seq]) for seq in step])
        assert torch.equal(run(batched_pool, step), alone)


def first_logprobs(llm, prompt: list[int]) -> tuple[list[int], list[float]]:
    import oxibonsai as ob

    params = ob.SamplingParams(max_tokens=3, temperature=0.0, logprobs=0, ignore_eos=True)
    out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0].outputs[0]
    return out.token_ids, [entry[t].logprob for entry, t in zip(out.logprobs, out.token_ids, strict=True)]


def test_cached_and_chunked_prompts_give_the_uncached_bits(small_model, monkeypatch, rng):
    """Every prompt row takes the prefill kernel however the prompt was cut: a 33-token prompt (2
    blocks + 1) run again on its cached prefix (2 blocks reused: a one-row rest), and run in chunks of
    16 + 16 + 1 by a small token budget, gives the logprobs of a whole uncached run bit for bit."""
    import oxibonsai as ob

    monkeypatch.setenv("OXIBONSAI_TORCH_OPS", "triton")
    monkeypatch.setenv("OXIBONSAI_Q1_ARITHMETIC", "exact")
    args = {
        "device": DEVICE,
        "runner": "torch",
        "max_model_len": 64,
        "max_num_seqs": 2,
        "kv_cache_dtype": "f32",
    }
    vocab = TorchQwen3.from_gguf(small_model, "cpu", ops=ref_torch).config.vocab
    prompt = [int(t) for t in rng.integers(0, vocab, 33)]
    whole = first_logprobs(ob.LLM(small_model, **args, enable_prefix_caching=False), prompt)
    cached_llm = ob.LLM(small_model, **args, enable_prefix_caching=True)
    assert first_logprobs(cached_llm, prompt) == whole
    assert first_logprobs(cached_llm, prompt) == whole  # on the cached prefix now
    assert cached_llm.cache_stats()["hit_tokens"] == 32
    chunked = ob.LLM(small_model, **args, enable_prefix_caching=False, max_num_batched_tokens=16)
    assert first_logprobs(chunked, prompt) == whole


def test_a_one_token_budget_runs_a_prompt_row_by_row_with_the_same_bits(small_model, monkeypatch, rng):
    """Five one-row prompt pieces, each through the prefill kernel: the bits of the whole prompt."""
    import oxibonsai as ob

    monkeypatch.setenv("OXIBONSAI_TORCH_OPS", "triton")
    args = {"device": DEVICE, "runner": "torch", "max_model_len": 32, "max_num_seqs": 1}
    prompt = [int(t) for t in rng.integers(0, 500, 5)]
    whole = first_logprobs(ob.LLM(small_model, **args), prompt)
    assert first_logprobs(ob.LLM(small_model, **args, max_num_batched_tokens=1), prompt) == whole


def test_sampled_rows_recomputed_in_one_piece_get_their_decode_step_logits(small_model, monkeypatch, rng):
    """A 40-token prompt then 8 one-token decode steps, against the same 48 tokens recomputed in one
    piece with ``decode_from`` 40 (as after a preemption): every row's logits, bit for bit. (From 33
    positions on the interpreter's two decode splits round differently from the prefill kernel: with
    ``decode_from`` 48 most of rows 40-47 differ.)"""
    monkeypatch.setenv("OXIBONSAI_TORCH_OPS", "triton")
    monkeypatch.setenv("OXIBONSAI_Q1_ARITHMETIC", "exact")
    model = TorchQwen3.from_gguf(small_model, DEVICE, ops=ops_for(DEVICE))
    tokens = [int(t) for t in rng.integers(0, model.config.vocab, 48)]

    def run(pool, start, new, decode_from):
        batch = StepBatch.for_sequences([([0, 1, 2], start, new, "all", decode_from)])
        return model.forward(batch.to_device(DEVICE), pool).cpu()

    pool = model.new_kv_pool(3)
    stepwise = [run(pool, 0, tokens[:40], 40)]
    stepwise += [run(pool, pos, [tokens[pos]], 40) for pos in range(40, 48)]
    assert torch.equal(run(model.new_kv_pool(3), 0, tokens, 40), torch.cat(stepwise))


@pytest.fixture(scope="module")
def two_layer_model(tmp_path_factory: pytest.TempPathFactory, model_seed: int) -> Path:
    cfg = tiny_config(hidden_size=128, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=64, ffn_size=128)
    return write_tiny(tmp_path_factory.mktemp("models") / "two_layers.gguf", model_seed + 8, cfg=cfg)


def test_a_preempted_request_recomputes_to_its_unpreempted_bits(two_layer_model, monkeypatch, rng):
    """A 20-token and a 40-token request fill a 5-block pool (2 + 3 blocks); at position 48 the second
    preempts itself, and once the first finished it recomputes its prompt and 9 sampled tokens in one
    piece: its tokens and logprobs are those of a run alone, bit for bit. (Two layers: the last row's
    logits then depend on the attention of every recomputed row, which the test above shows differs
    in the prefill kernel.)"""
    import oxibonsai as ob

    monkeypatch.setenv("OXIBONSAI_TORCH_OPS", "triton")
    monkeypatch.setenv("OXIBONSAI_Q1_ARITHMETIC", "exact")
    args = {"device": DEVICE, "runner": "torch", "max_model_len": 64, "kv_cache_dtype": "f32",
            "enable_prefix_caching": False}  # fmt: skip
    vocab = TorchQwen3.from_gguf(two_layer_model, "cpu", ops=ref_torch).config.vocab
    prompts = [{"prompt_token_ids": [int(t) for t in rng.integers(0, vocab, n)]} for n in (20, 40)]
    params = [ob.SamplingParams(max_tokens=n, temperature=0.0, logprobs=0, ignore_eos=True) for n in (12, 10)]
    tight = ob.LLM(two_layer_model, **args, max_num_seqs=2, kv_cache_blocks=5)
    batched = bits(tight.generate(prompts, params, use_tqdm=False))
    assert tight.metrics()["scheduler"]["preemptions"] == 1
    alone = ob.LLM(two_layer_model, **args, max_num_seqs=1)
    assert batched[1] == bits(alone.generate(prompts[1], params[1], use_tqdm=False))[0]


def bits(outs) -> list[tuple[list[int], list[float]]]:
    """Each request's tokens and their logprobs."""
    return [(o.token_ids, [e[t].logprob for e, t in zip(o.logprobs, o.token_ids, strict=True)])
            for o in (out.outputs[0] for out in outs)]  # fmt: skip


def test_requests_batched_by_the_engine_get_their_alone_bits(small_model, monkeypatch, rng):
    """Three requests run together (a small token budget mixes their prompt chunks with the others'
    decodes) get the tokens and logprobs each gets alone, bit for bit."""
    import oxibonsai as ob

    monkeypatch.setenv("OXIBONSAI_TORCH_OPS", "triton")
    monkeypatch.setenv("OXIBONSAI_Q1_ARITHMETIC", "exact")
    args = {"device": DEVICE, "runner": "torch", "max_model_len": 64, "kv_cache_dtype": "f32"}
    vocab = TorchQwen3.from_gguf(small_model, "cpu", ops=ref_torch).config.vocab
    prompts = [[int(t) for t in rng.integers(0, vocab, n)] for n in (5, 17, 30)]
    params = ob.SamplingParams(max_tokens=4, temperature=0.0, logprobs=0, ignore_eos=True)

    together = ob.LLM(small_model, **args, max_num_seqs=3, max_num_batched_tokens=12)
    batched = bits(together.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False))
    alone = ob.LLM(small_model, **args, max_num_seqs=1)
    assert batched == [
        bits(alone.generate([{"prompt_token_ids": p}], params, use_tqdm=False))[0] for p in prompts
    ]


@pytest.fixture(scope="module")
def two_group_model(tmp_path_factory: pytest.TempPathFactory, model_seed: int) -> Path:
    """Two layers whose every matrix has two 128-weight groups a row: K splits over programs."""
    cfg = tiny_config(hidden_size=256, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=128, ffn_size=256)
    return write_tiny(tmp_path_factory.mktemp("models") / "two_groups.gguf", model_seed + 9, cfg=cfg)


def test_matmuls_that_quantize_ahead_give_the_plain_forward_bits(two_group_model, monkeypatch, rng):
    """The exact set's matmuls quantize their outputs for the next matmul (``ops.ahead``: at one row
    in the split GEMV, forced here as on a GPU, in each form ``OXIBONSAI_ONE_ROW_GEMV`` picks; a
    launch of its own elsewhere): a prefill and a one-row decode give the logits of the forward pass
    without those ops bit for bit, whichever the form, and at one row the first layer's QKV is the
    only matmul that quantizes in a launch of its own. (The plain pass runs once, in the default
    form: every form gives its bits, ``test_q1_exact.py``.)"""
    from types import SimpleNamespace

    from oxibonsai.torch_backend.ops import ahead, q1_exact

    monkeypatch.setenv("OXIBONSAI_TORCH_OPS", "triton")
    monkeypatch.setenv("OXIBONSAI_Q1_ARITHMETIC", "exact")
    monkeypatch.setattr(q1_exact, "_default_split_k", lambda tiles, groups, device: 2)  # as on a GPU
    ops = ops_for(DEVICE)
    plain_ops = SimpleNamespace(**{k: v for k, v in vars(ops).items() if k not in ahead.OPS})
    plain = TorchQwen3.from_gguf(two_group_model, DEVICE, ops=plain_ops)
    assert not plain.quantizes_ahead
    vocab = plain.config.vocab
    # One decode step: the interpreter takes ~13 s a step at these shapes, and a second one adds no path.
    prompt, decodes = [int(t) for t in rng.integers(0, vocab, 6)], [int(rng.integers(0, vocab))]
    launches = []
    real_quantize = q1_exact.quantize
    monkeypatch.setattr(q1_exact, "quantize", lambda *a, **kw: launches.append(1) or real_quantize(*a, **kw))
    want = steps(plain, prompt, decodes)
    per_step = 3 * plain.config.n_layers + 1  # before QKV, gate|up and down in each layer; the LM head
    assert len(launches) == per_step * (1 + len(decodes))
    prefilled = None  # the first form's prefill and its KV, which the other forms decode from
    for one_row in ("gemv_split", "gemv_fixup", "gemv"):
        monkeypatch.setenv(q1_exact.ONE_ROW_ENV_VAR, one_row)
        fused = TorchQwen3.from_gguf(two_group_model, DEVICE, ops=ops)
        assert fused.quantizes_ahead
        launches.clear()
        if prefilled is None:
            pool = fused.new_kv_pool(4)
            prefilled = (steps(fused, prompt, [], pool)[0], pool.data.clone())
        else:
            pool = fused.new_kv_pool(4)
            pool.data.copy_(prefilled[1])
        got = [prefilled[0], *steps(fused, prompt, decodes, pool, done=len(prompt))]
        assert all(np.array_equal(a, b) for a, b in zip(got, want, strict=True)), one_row
        # The prefill quantizes ahead of every matmul but the first; a decode before its first QKV only.
        prefill_launches = per_step if one_row == "gemv_split" else 0
        assert len(launches) == prefill_launches + len(decodes), (one_row, len(launches))
