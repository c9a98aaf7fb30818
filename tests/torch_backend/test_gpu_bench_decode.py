"""The GPU bench's decode rows (``benches/gpu/models.decode_rate``) with the exact Triton kernels, run here
under the interpreter (on CUDA, compiled) as the GPU run would run them: the one-row row times the
graphs again with the quantizations apart, with each other form of the split GEMV and with a tuned
table's forms (``q1_tuned``), and each of those steps gives the default's logits bit for bit. (The smoke
run's decode section takes the torch ops on a CPU, so it never reaches these branches; the GPU minutes
should not be where they first run.)"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (pip install 'oxibonsai[torch]')")
pytest.importorskip("triton", reason="triton is not installed")
sys.path.append(str(Path(__file__).resolve().parents[2] / "benches"))  # for the gpu package

import gpu.models  # noqa: E402
from gpu.models import blocks_for, decode_rate, random_weights  # noqa: E402
from gpu.plan import SMOKE_PLAN, ModelSpec, qwen3  # noqa: E402

from oxibonsai.torch_backend.kv_pool import KvPool  # noqa: E402
from oxibonsai.torch_backend.model import TorchQwen3  # noqa: E402
from oxibonsai.torch_backend.ops.dispatch import ops_for  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
ONE_LAYER = ModelSpec("one-layer", qwen3(1, 256, 256, 2, 1, 256), tied=False)  # two groups a row everywhere


def test_the_one_row_decode_row_times_every_split_gemv_form_with_the_same_logits(monkeypatch, tmp_path):
    from oxibonsai.torch_backend.ops import q1_exact

    monkeypatch.setenv("OXIBONSAI_TORCH_OPS", "triton")
    monkeypatch.setenv("OXIBONSAI_Q1_ARITHMETIC", "exact")
    monkeypatch.setattr(q1_exact, "_default_split_k", lambda tiles, groups, device: 2)  # as on a GPU
    monkeypatch.setattr(gpu.models, "kernel_times", lambda *args: {})  # the profile: not what is tested
    # One step a form, none to warm up: the interpreter has nothing to warm and the times are not tested.
    plan = dataclasses.replace(
        SMOKE_PLAN, models=(ONE_LAYER,), batches=(1,), decode_steps=1, context=16, warmup=0
    )
    config = ONE_LAYER.config
    torch.manual_seed(int(np.random.default_rng().integers(2**31)))
    model = TorchQwen3(config, random_weights(ONE_LAYER, DEVICE), ops_for(DEVICE))
    pool = KvPool(config.n_layers, blocks_for(plan.context + plan.warmup + plan.decode_steps + 1),
                  config.n_kv_heads, config.head_dim, torch.float16, DEVICE)  # fmt: skip
    pool.data.normal_()
    c = config
    tuned = tmp_path / "tuned.json"
    tuned.write_text(json.dumps({"choices": [
        {"rows": c.q_dim + 2 * c.kv_dim, "cols": c.hidden, "gated": False, "m": 1,
         "options": {"kernel": "gemv_fixup", "split_k": 2}},
        {"rows": c.ffn, "cols": c.hidden, "gated": True, "m": 1, "options": {"kernel": "gemv", "split_k": 2}},
    ]}))  # fmt: skip
    rng = np.random.default_rng()
    row = decode_rate(model, pool, 1, plan, DEVICE, rng, compare_pdl=True, tuned=tuned)
    assert row["graph_logits_equal"] and row["unfused_logits_equal"], row
    assert row["one_row_default"] == "gemv_split"
    assert set(row["one_row_forms"]) == {"gemv", "gemv_fixup"}
    for form in row["one_row_forms"].values():
        assert form["logits_equal"] and form["graph_tok_s"] > 0 and form["over_default"] > 0, form
    assert row["tuned_forms"] == {"qkv": "gemv_fixup/2", "gate_up": "gemv/2"}
    assert row["tuned_logits_equal"] and row["tuned_gain"] > 0, row


def test_above_eight_rows_the_decode_row_times_the_merge_in_the_decode_kernel(monkeypatch):
    from oxibonsai.torch_backend.batch import StepBatch
    from oxibonsai.torch_backend.ops import attn_triton

    monkeypatch.setenv("OXIBONSAI_TORCH_OPS", "triton")
    monkeypatch.setenv("OXIBONSAI_Q1_ARITHMETIC", "exact")
    monkeypatch.delenv(attn_triton.FUSE_MERGE_ENV_VAR, raising=False)
    config, rows = ONE_LAYER.config, attn_triton.MERGE_MAX_ROWS + 1
    rng = np.random.default_rng()
    torch.manual_seed(int(rng.integers(2**31)))
    model = TorchQwen3(config, random_weights(ONE_LAYER, DEVICE), ops_for(DEVICE))
    per_seq = blocks_for(20)
    pool = KvPool(config.n_layers, rows * per_seq, config.n_kv_heads, config.head_dim, torch.float16, DEVICE)
    pool.data.normal_()
    tables = rng.permutation(pool.num_blocks).reshape(rows, per_seq).tolist()
    plans = [
        StepBatch.for_sequences([(t, 16 + s, [int(rng.integers(256))], "last") for t in tables])
        for s in (0, 1)
    ]
    for plan in plans:  # each step writes its row's K/V: the last step's logits need the first's
        eager = model.forward(plan.to_device(DEVICE), pool)
    row = gpu.models.graphs_merged(model, pool, plans, per_seq, 1, DEVICE, eager, 1.0)
    assert row["merged_logits_equal"] and row["merged_graph_tok_s"] > 0 and row["merge_gain"] > 0, row
    alone = [StepBatch.for_sequences([(tables[0], 16, [1], "last")])] * 2
    assert gpu.models.graphs_merged(model, pool, alone, per_seq, 1, DEVICE, eager, 1.0) == {}  # merges anyway
