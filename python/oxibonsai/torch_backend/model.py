"""The Qwen3 forward pass of the torch path: ``TorchQwen3``, over a flat batch of new tokens and a paged
KV pool.

Per layer: RMSNorm, q/k/v projections, per-head QK-norm, NeoX RoPE at each token's position, K/V
written into the pool at the batch's slots, paged causal attention through the block tables, output
projection and residual; RMSNorm, SwiGLU MLP and residual. The ops fuse what surrounds a matmul
(``q1_fused_linear``: the RMSNorm before it, the SwiGLU and the residual add after it) and what lies
between the QKV matmul and attention (``qk_norm_rope_write_kv``; the exact CUDA set's attention takes
the QKV rows instead, ``rope_kv``, and does that work in its decode kernel in a decode step) and the
attention with the output projection (``attention_linear``: the exact CUDA op set quantizes the
projection's activations in the attention kernels). Where the op set quantizes ahead (``ops.ahead``:
the exact CUDA set), each matmul also quantizes its output for the next one (``_forward_ahead``),
inside its launch at one row, so on CUDA a one-row decode layer is 5 launches (QKV, attention, O,
gate|up, down). The final norm and the LM head run on the ``logits_indices`` rows
only (read in place when those are every row, in order). Activations are float32; the KV pool may be
float16.

This module owns the arithmetic order of the model and nothing else: kernels come from an ``ops``
namespace (``ops.dispatch.ops_for(device)``), weights and their checks from ``weights``, the step plan
from the Rust core. It never validates weights, allocates KV blocks or samples."""

from __future__ import annotations

import functools
import math
from os import PathLike
from typing import Any

import torch

from oxibonsai import GGUFFile
from oxibonsai.rope_scaling import RopeScaling
from oxibonsai.torch_backend.batch import DeviceBatch
from oxibonsai.torch_backend.kv_pool import KvPool
from oxibonsai.torch_backend.ops import ahead, pdl_rows, ref_torch
from oxibonsai.torch_backend.weights import (
    DenseWeight,
    LayerWeights,
    Linear,
    Qwen3Config,
    Qwen3Weights,
    load_qwen3,
)

Ops = Any  # a namespace of the op functions: a module such as ops.ref_torch, or what ops_for returns


class TorchQwen3:
    """A Qwen3 model on one torch device: ``forward(batch, kv) -> float32 [R, vocab]``."""

    def __init__(self, config: Qwen3Config, weights: Qwen3Weights, ops: Ops) -> None:
        self.config = config
        self.weights = weights
        self.ops = ops
        self.scale = 1.0 / math.sqrt(config.head_dim)
        device = weights.output_norm.device
        self.cos_sin = ref_torch.rope_cos_sin(
            config.max_positions, config.head_dim, config.rope_base, device, config.rope_scaling
        )

    @classmethod
    def from_gguf(
        cls,
        source: str | PathLike[str] | GGUFFile,
        device: torch.device | str,
        ops: Ops | None = None,
        *,
        rope_scaling: RopeScaling | None = None,
        rope_theta: float | None = None,
    ) -> TorchQwen3:
        """Loads a GGUF file onto ``device``; ``ops`` defaults to the set chosen for that device;
        ``rope_scaling`` and ``rope_theta`` replace the file's."""
        config, weights = load_qwen3(source, device, rope_scaling=rope_scaling, rope_theta=rope_theta)
        if ops is None:
            from oxibonsai.torch_backend.ops.dispatch import ops_for

            ops = ops_for(torch.device(device))
        return cls(config, weights, ops)

    def new_kv_pool(
        self, num_blocks: int, dtype: torch.dtype = torch.float32, device: torch.device | str | None = None
    ) -> KvPool:
        """An empty pool shaped for this model (on the weights' device unless ``device`` is given)."""
        c = self.config
        where = device if device is not None else self.weights.output_norm.device
        return KvPool(c.n_layers, num_blocks, c.n_kv_heads, c.head_dim, dtype, where)

    @torch.inference_mode()
    def forward(self, batch: DeviceBatch, kv: KvPool) -> torch.Tensor:
        """Runs the batch's tokens, writing their K/V into ``kv``; float32 logits ``[R, vocab]`` of the
        ``batch.logits_indices`` rows, in that order."""
        self._check_pool(kv)
        with pdl_rows.step_rows(int(batch.input_ids.shape[0])):
            x = self._embed(batch.input_ids)
            if self.quantizes_ahead:
                return self._forward_ahead(x, batch, kv)
            for index, layer in enumerate(self.weights.layers):
                x = self._attention(index, layer, x, batch, kv)
                x = self._mlp(layer, x)
            if batch.logits_indices.numel() == 0:  # a step that only fills the cache: no LM head launch
                return x.new_empty((0, self.config.vocab))
            rows = x if batch.logits_all_rows else x.index_select(0, batch.logits_indices)
            return self._linear(rows, self.weights.lm_head, norm=self.weights.output_norm)

    def hidden(self, batch: DeviceBatch, kv: KvPool) -> torch.Tensor:
        """Runs the batch's tokens like ``forward``; the final RMS-normed hidden states ``[R, hidden]``
        of the ``batch.logits_indices`` rows (what the LM head reads) instead of their logits."""
        self._check_pool(kv)
        with pdl_rows.step_rows(int(batch.input_ids.shape[0])):
            x = self._embed(batch.input_ids)
            for index, layer in enumerate(self.weights.layers):
                x = self._attention(index, layer, x, batch, kv)
                x = self._mlp(layer, x)
            rows = x if batch.logits_all_rows else x.index_select(0, batch.logits_indices)
            return self._norm(rows, self.weights.output_norm)

    @functools.cached_property
    def quantizes_ahead(self) -> bool:
        """Whether ``forward`` runs ``_forward_ahead``: the op set quantizes ahead (``ops.ahead``) and
        every matrix is a fused Q1 one (found once: the ops and weights never change)."""
        w = self.weights
        q1 = [
            w.lm_head,
            *(m for layer in w.layers for m in (layer.wqkv, layer.wo, layer.w_gate_up, layer.w_down)),
        ]
        return ahead.supported(self.ops) and all(m is not None and not isinstance(m, DenseWeight) for m in q1)

    def _forward_ahead(self, x: torch.Tensor, batch: DeviceBatch, kv: KvPool) -> torch.Tensor:
        """``forward``'s layers where each matmul quantizes its output for the next one (``ops.ahead``):
        the same arithmetic in the same order, the quantizations inside the matmuls' launches where the
        kernels allow. The last layer's output is quantized for the LM head only when every row's
        logits are wanted."""
        ops, eps, layers = self.ops, self.config.rms_eps, self.weights.layers
        acts = None  # x quantized (and normalized) for the next matmul, when the matmul before did it
        for index, layer in enumerate(layers):
            qkv, _ = ops.q1_fused_linear_ahead(x, layer.wqkv, norm=layer.attn_norm, eps=eps, acts=acts)
            args, hints = self._attention_inputs(index, layer, qkv, batch, kv)
            after_o = ahead.QuantizeNext(layer.ffn_norm, eps)
            x, acts = ops.attention_linear_ahead(*args, layer.wo, residual=x, then=after_o, **hints)
            gated, gated_acts = ops.q1_fused_linear_ahead(
                x,
                layer.w_gate_up,
                norm=layer.ffn_norm,
                eps=eps,
                gated=True,
                acts=acts,
                then=ahead.QuantizeNext(),
            )
            last = index + 1 == len(layers)
            next_norm = self.weights.output_norm if last else layers[index + 1].attn_norm
            then = ahead.QuantizeNext(next_norm, eps) if not last or batch.logits_all_rows else None
            x, acts = ops.q1_fused_linear_ahead(gated, layer.w_down, residual=x, acts=gated_acts, then=then)
        if batch.logits_indices.numel() == 0:
            return x.new_empty((0, self.config.vocab))
        if not batch.logits_all_rows:
            rows = x.index_select(0, batch.logits_indices)
            return self._linear(rows, self.weights.lm_head, norm=self.weights.output_norm)
        logits, _ = ops.q1_fused_linear_ahead(x, self.weights.lm_head, norm=self.weights.output_norm, eps=eps,
                                              acts=acts)  # fmt: skip
        return logits

    def _attention(
        self, index: int, layer: LayerWeights, x: torch.Tensor, batch: DeviceBatch, kv: KvPool
    ) -> torch.Tensor:
        """``x`` plus the attention block's output."""
        c, ops = self.config, self.ops
        if layer.wqkv is not None:  # one matmul; the op splits it by columns
            qkv = self._linear(x, layer.wqkv, norm=layer.attn_norm)
        else:
            h = self._norm(x, layer.attn_norm)
            qkv = torch.cat([self._linear(h, w) for w in (layer.wq, layer.wk, layer.wv)], dim=1)
        args, hints = self._attention_inputs(index, layer, qkv, batch, kv)
        if not isinstance(layer.wo, DenseWeight):  # one op: the exact set quantizes in attention
            out: torch.Tensor = ops.attention_linear(*args, layer.wo, residual=x, **hints)
            return out
        attention = ops.paged_attention(*args, **hints)
        return self._linear(attention.reshape(x.shape[0], c.q_dim), layer.wo, residual=x)

    def _attention_inputs(
        self, index: int, layer: LayerWeights, qkv: torch.Tensor, batch: DeviceBatch, kv: KvPool
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """QK-norm, RoPE and the K/V write of a layer's QKV rows; then the attention's arguments (q,
        the layer's caches, the plan, the scale) and its hints."""
        c = self.config
        k_cache, v_cache = kv.layer(index)
        rope = (qkv, layer.q_norm, layer.k_norm, batch.positions, batch.slot_mapping, k_cache, v_cache)
        if hasattr(self.ops, "rope_kv"):  # the attention does it (in a decode step, in its own kernel)
            q = self.ops.rope_kv(*rope, self.cos_sin, c.n_heads, c.rms_eps)
        else:
            q = self.ops.qk_norm_rope_write_kv(
                qkv, layer.q_norm, layer.k_norm, batch.positions, k_cache, v_cache, batch.slot_mapping,
                q_heads=c.n_heads, cos_sin=self.cos_sin, eps=c.rms_eps,
            )  # fmt: skip
        args = (q, k_cache, v_cache, batch.block_tables, batch.seq_lens, batch.query_start_loc, self.scale)
        hints = {
            "decode_from": batch.decode_from,
            "decode_rows": batch.decode_rows,
            "max_q_len": batch.max_query_len,
        }
        return args, hints

    def _mlp(self, layer: LayerWeights, x: torch.Tensor) -> torch.Tensor:
        """``x`` plus the SwiGLU MLP's output."""
        if layer.w_gate_up is not None:
            gated = self._linear(x, layer.w_gate_up, norm=layer.ffn_norm, gated=True)
        else:
            h = self._norm(x, layer.ffn_norm)
            gated = self.ops.silu_mul(self._linear(h, layer.w_gate), self._linear(h, layer.w_up))
        return self._linear(gated, layer.w_down, residual=x)

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.ops.rms_norm(x, weight, self.config.rms_eps)
        return out

    def _linear(
        self,
        x: torch.Tensor,
        w: Linear,
        *,
        norm: torch.Tensor | None = None,
        residual: torch.Tensor | None = None,
        gated: bool = False,
    ) -> torch.Tensor:
        """``residual + f(rms_norm(x, norm) @ W.T)``, ``f`` the SwiGLU of a gate|up matrix when
        ``gated``: one fused op for a Q1 matrix, composed for a dense one."""
        eps = self.config.rms_eps
        if not isinstance(w, DenseWeight):
            out: torch.Tensor = self.ops.q1_fused_linear(
                x, w, norm=norm, eps=eps, residual=residual, gated=gated
            )
            return out
        y = w.linear(x if norm is None else self._norm(x, norm))
        if gated:
            y = self.ops.silu_mul(*y.chunk(2, dim=1))
        return y if residual is None else residual + y

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        w = self.weights.token_embd
        if isinstance(w, DenseWeight):
            return w.rows_dequantized(ids)
        out: torch.Tensor = self.ops.embedding(ids, w)
        return out

    def _check_pool(self, kv: KvPool) -> None:
        c = self.config
        want = (c.n_layers, c.n_kv_heads, c.head_dim)
        if (kv.num_layers, kv.kv_heads, kv.head_dim) != want:
            raise ValueError(
                f"KV pool has (layers, kv_heads, head_dim) = {(kv.num_layers, kv.kv_heads, kv.head_dim)}, "
                f"the model needs {want}"
            )
