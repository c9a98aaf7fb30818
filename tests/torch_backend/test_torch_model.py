"""The torch Qwen3 (``model``, ``weights``, ``batch``) with the plain-torch ops on the CPU, against the
float64 numpy reference (``tests/qwen3_reference.py``) and the native Rust model, and against itself
split differently: chunked prefill and decode across forward calls, ragged batches, block tables with
holes. Models: the session's tiny tied and untied random models and the embedded default model.

Bounds: the torch path is float32 over exactly dequantized weights, so against the float64 reference
the median relative L2 error of a logits row must stay under 1e-5 (measured 3e-7..8e-7) and every
logit within 1e-3 (the bound the native f32 reference kernel meets; measured 2e-5), with identical
top-1 wherever the reference's top-2 gap exceeds 1e-3. Against the native f32 reference kernel: 1e-3
(measured 2e-5); against the native default int8 kernels with an f16 KV cache: ``INT8_LOGIT_TOL`` = 1.0
and top-1 where the gap exceeds 0.5 (the bounds ``tests/test_model.py`` sets; measured 0.16..0.35).
Splitting the same tokens differently changes only the float32 summation order: 1e-4."""

from __future__ import annotations

import subprocess
import sys
import warnings
from dataclasses import replace
from pathlib import Path

import gguf
import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (pip install 'oxibonsai[torch]')")

import oxibonsai as ob  # noqa: E402
from oxibonsai._core import Model  # noqa: E402
from oxibonsai.llm import default_model_path  # noqa: E402
from oxibonsai.torch_backend.batch import StepBatch  # noqa: E402
from oxibonsai.torch_backend.kv_pool import KvPool  # noqa: E402
from oxibonsai.torch_backend.model import TorchQwen3  # noqa: E402
from oxibonsai.torch_backend.ops import ref_torch  # noqa: E402
from oxibonsai.torch_backend.ops.q1_weight import Q1Weight  # noqa: E402
from oxibonsai.torch_backend.weights import DenseWeight, Qwen3Config, load_qwen3  # noqa: E402

from model_factory import Q1_0, add_hparams, add_metadata, norm_weights, quantized_bytes, tensor_specs  # noqa: E402
from models import tiny_config, tokenizer_meta, write_tiny  # noqa: E402
from q1_reference import dequantize  # noqa: E402
from qwen3_reference import ReferenceQwen3  # noqa: E402

MEDIAN_REL_L2 = 1e-5
LOGIT_ATOL = 1e-3
SPLIT_ATOL = 1e-4
INT8_LOGIT_TOL = 1.0
CLEAR_GAP = 0.5
EXACT_NATIVE = {"kernel": "reference", "kv_cache_dtype": "f32"}


@pytest.fixture(scope="module", params=["tied", "untied", "default"])
def model_path(request: pytest.FixtureRequest, tiny_model: Path, tiny_untied_model: Path) -> Path:
    return {"tied": tiny_model, "untied": tiny_untied_model, "default": default_model_path()}[request.param]


@pytest.fixture(scope="module")
def model(model_path: Path) -> TorchQwen3:
    return TorchQwen3.from_gguf(model_path, "cpu", ref_torch)


@pytest.fixture(scope="module")
def reference(model_path: Path) -> ReferenceQwen3:
    return ReferenceQwen3.from_gguf(model_path)


def run(model: TorchQwen3, kv: KvPool, seqs: list) -> np.ndarray:
    """One forward pass over ``(block_table, context_len, new_tokens, want_logits)`` sequences."""
    return model.forward(StepBatch.for_sequences(seqs).to_device("cpu"), kv).numpy()


def garbage_pool(model: TorchQwen3, num_blocks: int) -> KvPool:
    """A pool whose every slot holds noise: a forward that reads a slot it did not write shows it."""
    kv = model.new_kv_pool(num_blocks)
    kv.data.normal_(0, 100)
    return kv


def random_ids(rng: np.random.Generator, model: TorchQwen3, n: int) -> list[int]:
    return [int(t) for t in rng.integers(0, model.config.vocab, n)]


def top2_gap(logits: np.ndarray) -> np.ndarray:
    part = np.sort(logits, axis=1)
    return part[:, -1] - part[:, -2]


def native_logits(path: Path, ids: list[int], **kwargs: object) -> np.ndarray:
    native = Model(path, max_model_len=256, **kwargs)  # type: ignore[arg-type]
    return native.step([(native.add_sequence(), ids, "all")])


# -- against the reference and the native model ---------------------------------------------------


def test_logits_match_the_float64_reference(model, reference, rng):
    ids = random_ids(rng, model, 48)
    ours = run(model, garbage_pool(model, 4), [([2, 0, 3], 0, ids, True)])
    theirs = reference.logits64(ids)
    assert ours.shape == theirs.shape == (48, model.config.vocab) and ours.dtype == np.float32
    rel = np.linalg.norm(ours - theirs, axis=1) / np.linalg.norm(theirs, axis=1)
    assert np.median(rel) < MEDIAN_REL_L2
    assert np.abs(ours - theirs).max() < LOGIT_ATOL
    assert (ours.argmax(1) == theirs.argmax(1))[top2_gap(theirs) > 1e-3].all()


def test_logits_match_the_native_model(model, model_path, reference, rng):
    ids = random_ids(rng, model, 40)
    ours = run(model, model.new_kv_pool(3), [([0, 1, 2], 0, ids, True)])
    assert np.abs(ours - native_logits(model_path, ids, **EXACT_NATIVE)).max() < LOGIT_ATOL
    int8 = native_logits(model_path, ids)
    assert np.abs(ours - int8).max() < INT8_LOGIT_TOL
    clear = top2_gap(reference.logits64(ids)) > CLEAR_GAP
    assert (ours.argmax(1) == int8.argmax(1))[clear].all()


# -- the same tokens split differently ----------------------------------------------------------


def test_chunked_prefill_and_decodes_equal_one_pass(model, rng):
    ids = random_ids(rng, model, 45)
    whole = run(model, garbage_pool(model, 3), [([0, 1, 2], 0, ids, True)])
    kv, table = garbage_pool(model, 12), [9, 4, 7]  # out of order, with holes
    parts = [run(model, kv, [(table, 0, ids[:13], True)]), run(model, kv, [(table, 13, ids[13:33], True)])]
    parts += [run(model, kv, [(table, pos, ids[pos : pos + 1], True)]) for pos in range(33, 45)]
    np.testing.assert_allclose(np.concatenate(parts), whole, atol=SPLIT_ATOL, rtol=0)


def test_a_ragged_batch_equals_each_sequence_alone(model, rng):
    """Three sequences in one step: a fresh prompt, a chunk after a cached prefix, one decode token."""
    prompts = [random_ids(rng, model, n) for n in (21, 30, 34)]
    tables = [[5, 1], [8, 3], [0, 6, 2]]
    prefix = {1: 17, 2: 33}  # tokens already in the pool before the step
    step = [
        (tables[0], 0, prompts[0], "all"),
        (tables[1], 17, prompts[1][17:], "last"),
        (tables[2], 33, prompts[2][33:], True),
    ]

    def with_prefixes() -> KvPool:
        kv = garbage_pool(model, 9)
        for s, n in prefix.items():
            run(model, kv, [(tables[s], 0, prompts[s][:n], False)])
        return kv

    together = run(model, with_prefixes(), step)
    kv = with_prefixes()
    alone = np.concatenate([run(model, kv, [seq]) for seq in step])
    assert together.shape == (21 + 1 + 1, model.config.vocab)
    np.testing.assert_allclose(together, alone, atol=SPLIT_ATOL, rtol=0)


def test_a_block_table_with_holes_gives_the_contiguous_logits(model, rng):
    ids = random_ids(rng, model, 40)
    contiguous = run(model, garbage_pool(model, 3), [([0, 1, 2], 0, ids, True)])
    scattered = run(model, garbage_pool(model, 12), [([11, 3, 8], 0, ids, True)])
    np.testing.assert_allclose(scattered, contiguous, atol=SPLIT_ATOL, rtol=0)


def test_logits_rows_come_back_in_the_requested_order(model, rng):
    ids = random_ids(rng, model, 20)
    full = run(model, model.new_kv_pool(2), [([0, 1], 0, ids, True)])
    batch = StepBatch.for_sequences([([0, 1], 0, ids, True)])
    picked = replace(batch, logits_indices=np.array([19, 0, 7, 7], dtype=np.int32))
    ours = model.forward(picked.to_device("cpu"), model.new_kv_pool(2)).numpy()
    np.testing.assert_allclose(ours, full[[19, 0, 7, 7]], atol=SPLIT_ATOL, rtol=0)


def test_a_step_without_logit_rows_only_fills_the_cache(model, rng):
    ids = random_ids(rng, model, 20)
    kv = model.new_kv_pool(2)
    assert run(model, kv, [([0, 1], 0, ids[:12], False)]).shape == (0, model.config.vocab)
    rest = run(model, kv, [([0, 1], 12, ids[12:], True)])
    whole = run(model, model.new_kv_pool(2), [([0, 1], 0, ids, True)])
    np.testing.assert_allclose(rest, whole[12:], atol=SPLIT_ATOL, rtol=0)


def test_every_matmul_of_a_step_sees_whether_the_step_gets_pdl(model, rng, monkeypatch):
    """The forward pass declares its rows (``pdl_rows.step_rows``): its kernels launch with PDL only in
    steps of at most ``MAX_ROWS`` token rows."""
    from oxibonsai.torch_backend.ops import pdl_rows

    seen = []
    real = ref_torch.q1_fused_linear

    def spy(*args, **kwargs):
        seen.append(pdl_rows.allowed())
        return real(*args, **kwargs)

    monkeypatch.setattr(ref_torch, "q1_fused_linear", spy)
    kv = model.new_kv_pool(4)
    edge = pdl_rows.MAX_ROWS
    for rows in (int(rng.integers(1, edge)), edge, edge + 1, int(rng.integers(edge + 2, 40))):
        seen.clear()
        run(model, kv, [([0, 1, 2], 0, random_ids(rng, model, rows), "last")])
        assert seen and set(seen) == {rows <= pdl_rows.MAX_ROWS}, rows
    assert pdl_rows.allowed(), "outside a step again"


def test_the_default_op_set_on_the_cpu_is_the_torch_reference(model_path, monkeypatch):
    monkeypatch.delenv("OXIBONSAI_TORCH_OPS", raising=False)
    model = TorchQwen3.from_gguf(model_path, "cpu")
    assert (
        model.ops.q1_linear is ref_torch.q1_linear and model.ops.paged_attention is ref_torch.paged_attention
    )


# -- weights and config -------------------------------------------------------------------------


def test_weights_stay_packed_and_dequantize_to_the_file_values(model, model_path, reference):
    w, c = model.weights, model.config
    matrices = [
        w.token_embd,
        *(getattr(layer, f) for layer in w.layers for f in ("wq", "wk", "wo", "w_down")),
    ]
    assert all(isinstance(m, Q1Weight) for m in matrices)
    assert (w.output is None) == ("output.weight" not in reference.w)
    assert w.lm_head is (w.output if w.output is not None else w.token_embd)
    np.testing.assert_array_equal(w.lm_head.dequantize().numpy(), reference.w[reference.lm_head_name])
    layer = w.layers[-1]
    p = f"blk.{c.n_layers - 1}."
    np.testing.assert_array_equal(layer.w_gate.dequantize().numpy(), reference.w[p + "ffn_gate.weight"])
    np.testing.assert_array_equal(layer.k_norm.numpy(), reference.w[p + "attn_k_norm.weight"])
    # Packed Q1_0 holds exactly the file's 18 bytes per 128 weights, F32 norms their 4 bytes each.
    assert w.nbytes == sum(t["nbytes"] for t in ob.GGUFFile(model_path).tensors())


def test_config_matches_the_native_loader(model, model_path):
    native = Model(model_path, max_model_len=32).config
    ours = model.config
    for name in Qwen3Config.__dataclass_fields__.keys() - {"rope_scaling"}:
        assert getattr(ours, name) == pytest.approx(native[name], rel=1e-12), name
    scaling = None if ours.rope_scaling is None else ours.rope_scaling.as_dict()
    assert scaling == native["rope_scaling"] and ours.max_positions == native["max_positions"]
    assert (ours.q_dim, ours.kv_dim, ours.group) == (
        ours.n_heads * ours.head_dim,
        ours.n_kv_heads * ours.head_dim,
        ours.n_heads // ours.n_kv_heads,
    )


DENSE = ("token_embd.weight", "blk.0.attn_q.weight", "blk.1.ffn_down.weight", "blk.0.attn_norm.weight")


def bf16_exact(values: np.ndarray) -> np.ndarray:
    """float32 values rounded (to nearest even) to bfloat16's 8 significant bits: then F32, F16 and BF16
    all hold them exactly."""
    bits = values.astype(np.float32).view(np.uint32).astype(np.uint64)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000).astype(np.uint32).view(np.float32)
    assert np.array_equal(rounded.astype(np.float16).astype(np.float32), rounded)
    return rounded


def dense_array(values: np.ndarray, dense_type: str) -> tuple[np.ndarray, gguf.GGMLQuantizationType | None]:
    """What GGUFWriter stores for a ``dense_type`` tensor, and its raw type (None: from the numpy dtype)."""
    if dense_type == "BF16":
        upper = (values.view(np.uint32) >> 16).astype(np.uint16)
        return upper.view(np.uint8).reshape(*values.shape[:-1], -1), gguf.GGMLQuantizationType.BF16
    return values.astype(np.float16 if dense_type == "F16" else np.float32), None


def planned_arrays(
    seed: int, dense_type: str
) -> list[tuple[str, np.ndarray, gguf.GGMLQuantizationType | None]]:
    rng, out = np.random.default_rng(seed), []
    for spec in tensor_specs(tiny_config()):
        raw = quantized_bytes(spec, rng) if spec.q1 else None
        if spec.name not in DENSE:
            out.append(
                (spec.name, raw, Q1_0) if raw is not None else (spec.name, norm_weights(spec, rng), None)
            )
            continue
        values = dequantize(raw.tobytes(), *spec.shape) if raw is not None else norm_weights(spec, rng)
        out.append((spec.name, *dense_array(bf16_exact(values), dense_type)))
    return out


def write_dense_variant(path: Path, seed: int, dense_type: str) -> Path:
    """A tiny tied model whose DENSE tensors are stored as ``dense_type`` (F32, F16 or BF16); the same
    seed gives the same numbers in every variant."""
    arrays = planned_arrays(seed, dense_type)
    writer = gguf.GGUFWriter(path, "qwen3")
    add_hparams(writer, tiny_config())
    add_metadata(writer, tokenizer_meta())
    for name, data, raw_dtype in arrays:
        writer.add_tensor_info(name, data.shape, data.dtype, data.nbytes, raw_dtype=raw_dtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for _, data, _ in arrays:
        writer.write_tensor_data(data)
    writer.close()
    return path


def test_f32_f16_and_bf16_matrices_load_dense_and_give_the_same_logits(tmp_path, model_seed, rng):
    paths = {t: write_dense_variant(tmp_path / f"{t}.gguf", model_seed, t) for t in ("F32", "F16", "BF16")}
    models = {t: TorchQwen3.from_gguf(p, "cpu", ref_torch) for t, p in paths.items()}
    w = models["BF16"].weights
    assert isinstance(w.token_embd, DenseWeight) and isinstance(w.layers[1].w_down, DenseWeight)
    assert isinstance(w.layers[0].wk, Q1Weight) and w.output is None
    ids = random_ids(rng, models["F32"], 30)
    logits = {t: run(m, m.new_kv_pool(2), [([0, 1], 0, ids, True)]) for t, m in models.items()}
    np.testing.assert_array_equal(logits["F16"], logits["F32"])
    np.testing.assert_array_equal(logits["BF16"], logits["F32"])
    reference = ReferenceQwen3.from_gguf(paths["F32"]).logits64(ids)  # the reference reads F32 only
    assert np.abs(logits["F32"] - reference).max() < LOGIT_ATOL
    for t in ("F16", "BF16"):
        assert np.abs(logits[t] - native_logits(paths[t], ids, **EXACT_NATIVE)).max() < LOGIT_ATOL


@pytest.mark.parametrize(
    "change, message",
    [
        ({"extra_metadata": {"general.architecture": "llama"}}, "unsupported architecture 'llama'"),
        ({"extra_metadata": {"qwen3.block_count": None}}, "missing metadata key 'qwen3.block_count'"),
        ({"extra_metadata": {"qwen3.rope.freq_base": "high"}}, "'qwen3.rope.freq_base' must be a number"),
        ({"extra_metadata": {"qwen3.attention.head_count_kv": 3}}, "multiple of head_count_kv"),
        ({"extra_metadata": {"qwen3.attention.value_length": 64}}, "value_length \\(64\\) differs"),
        ({"omit_tensors": ["blk.1.ffn_up.weight"]}, "missing tensor 'blk.1.ffn_up.weight'"),
        ({"omit_tensors": ["output_norm.weight"]}, "missing tensor 'output_norm.weight'"),
        (
            {"override_shapes": {"blk.0.attn_k.weight": (384, 256)}},
            r"tensor 'blk.0.attn_k.weight' has shape \[256, 384\] \(GGUF ne order\), expected \[256, 256\]",
        ),
        (
            {"override_shapes": {"blk.1.attn_q_norm.weight": (64,)}},
            "tensor 'blk.1.attn_q_norm.weight' has shape \\[64\\], expected \\[128\\]",
        ),
    ],
)
def test_files_the_native_loader_rejects_are_rejected_naming_the_key_or_tensor(tmp_path, change, message):
    path = write_tiny(tmp_path / "bad.gguf", 7, **change)
    with pytest.raises(ob.GGUFError, match=message):
        load_qwen3(path, "cpu")
    with pytest.raises(ob.GGUFError):
        Model(path, max_model_len=32)


# -- the step plan ------------------------------------------------------------------------------


def test_step_batch_layout():
    b = StepBatch.for_sequences(
        [([4, 9], 14, [1, 2, 3], "all"), ([2], 0, [5], "last"), ([7, 3, 8], 30, [6, 7], False)]
    )
    assert b.input_ids.tolist() == [1, 2, 3, 5, 6, 7]
    assert b.positions.tolist() == [14, 15, 16, 0, 30, 31]
    assert b.slot_mapping.tolist() == [4 * 16 + 14, 4 * 16 + 15, 9 * 16, 2 * 16, 3 * 16 + 14, 3 * 16 + 15]
    assert b.query_start_loc.tolist() == [0, 3, 4, 6]
    assert b.seq_lens.tolist() == [17, 1, 32]
    assert b.block_tables.tolist() == [[4, 9, 0], [2, 0, 0], [7, 3, 8]]
    assert b.logits_indices.tolist() == [0, 1, 2, 3]
    assert b.decode_from.tolist() == [17, 1, 32], "by default every run of tokens is prompt"
    dtypes = [b.input_ids, b.positions, b.query_start_loc, b.seq_lens, b.block_tables, b.logits_indices]
    assert all(a.dtype == np.int32 for a in dtypes) and b.slot_mapping.dtype == np.int64
    assert (b.num_tokens, b.num_seqs) == (6, 3)
    assert b.decode_rows().shape == (0, 2)


def test_decode_rows_are_the_rows_at_or_past_decode_from(rng):
    """Against a plain loop, on random plans: sequences of 1-20 new tokens after 0-40 of context, with
    ``decode_from`` anywhere from 0 to past the end, and the default (a lone token after a context)."""
    seqs = []
    for _ in range(int(rng.integers(1, 12))):
        context, n = int(rng.integers(0, 41)), int(rng.integers(1, 21))
        decode_from = int(rng.integers(0, context + n + 2)) if rng.random() < 0.7 else None
        plan = ([0, 1, 2, 3], context, [1] * n, "last")
        seqs.append(plan if decode_from is None else (*plan, decode_from))
    b = StepBatch.for_sequences(seqs)
    want = []
    for s, (row0, end) in enumerate(zip(b.query_start_loc[:-1], b.query_start_loc[1:], strict=True)):
        want += [[r, s] for r in range(row0, end) if b.positions[r] >= b.decode_from[s]]
    rows = b.decode_rows()
    assert rows.dtype == np.int32 and rows.tolist() == want
    lone = [i for i, seq in enumerate(seqs) if len(seq) == 4 and seq[1] > 0 and len(seq[2]) == 1]
    assert all([b.query_start_loc[i], i] in want for i in lone), "a lone token after a context decodes"


@pytest.mark.parametrize(
    "seqs, message",
    [
        ([], "at least one sequence"),
        ([([0], 0, [], True)], "at least one new token"),
        ([([0], 10, [1] * 7, True)], "cannot hold 17 tokens"),
        ([([0, -1], 10, [1] * 7, True)], "cannot hold 17 tokens"),
        ([([0], 0, [1], "first")], "want_logits"),
        ([([0], 0, [1], "last", -1)], "decode_from"),
    ],
)
def test_step_batch_rejects_impossible_plans(seqs, message):
    with pytest.raises(ValueError, match=message):
        StepBatch.for_sequences(seqs)


def test_step_batch_checks_dtypes_and_lengths():
    b = StepBatch.for_sequences([([0], 0, [1, 2], True)])
    with pytest.raises(ValueError, match="StepBatch.positions must be a 1-D int32"):
        replace(b, positions=b.positions.astype(np.int64))
    with pytest.raises(ValueError, match="differ in length"):
        replace(b, slot_mapping=b.slot_mapping[:1])
    with pytest.raises(ValueError, match="S\\+1"):
        replace(b, query_start_loc=b.query_start_loc[:1])
    with pytest.raises(ValueError, match="decode_from needs one entry per sequence"):
        replace(b, decode_from=np.zeros(2, dtype=np.int32))


def test_to_device_on_the_cpu_shares_the_arrays_even_read_only_ones():
    b = StepBatch.for_sequences([([3, 1], 5, [1, 2, 3], True), ([0], 0, [4], "last")])
    for name in b.__dataclass_fields__:
        getattr(b, name).setflags(write=False)  # as the core hands them over
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        d = b.to_device("cpu")
    for name in b.__dataclass_fields__:
        array, tensor = getattr(b, name), getattr(d, name)
        assert tensor.data_ptr() == array.ctypes.data and tuple(tensor.shape) == array.shape
        assert tensor.dtype == getattr(torch, array.dtype.name)
    assert d.num_tokens == 4 and d.device.type == "cpu"


def test_the_lm_head_reads_the_rows_in_place_only_when_every_row_is_asked_in_order():
    """``logits_all_rows`` (no gather before the LM head): every row's logits in row order, as in a
    decode step or ``LLM.logits``; any other choice of rows gathers them."""
    decode = StepBatch.for_sequences([([0], 3, [1], "last"), ([1], 9, [2], "last")])
    prompt = StepBatch.for_sequences([([0], 0, [1, 2, 3], True)])
    last = StepBatch.for_sequences([([0], 0, [1, 2, 3], "last")])
    shuffled = replace(prompt, logits_indices=np.array([2, 1, 0], dtype=np.int32))
    flags = [b.to_device("cpu").logits_all_rows for b in (decode, prompt, last, shuffled)]
    assert flags == [True, True, False, False]


def test_importing_oxibonsai_or_the_step_plan_does_not_import_torch():
    code = "import sys, oxibonsai, oxibonsai.torch_backend.batch; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0
