//! Binding a GGUF file's tensors to the Qwen3 model: the only place tensor names appear. Every
//! tensor's presence, type and shape is checked here, so the forward pass never validates anything.
//! Q1_0 matrices borrow the memory map; norms are copied into f32 vectors.

use crate::error::{Error, Result};
use crate::gguf::{GgmlType, GgufFile, TensorInfo};
use crate::q1::Q1Matrix;

use super::config::Qwen3Config;
use super::linear::Linear;

/// One transformer block.
pub struct LayerWeights {
    pub attn_norm: Vec<f32>,
    pub wq: Linear,
    pub wk: Linear,
    pub wv: Linear,
    pub wo: Linear,
    pub q_norm: Vec<f32>,
    pub k_norm: Vec<f32>,
    pub ffn_norm: Vec<f32>,
    pub w_gate: Linear,
    pub w_up: Linear,
    pub w_down: Linear,
}

/// All weights of a Qwen3 model.
pub struct Qwen3Weights {
    pub token_embd: Linear,
    pub layers: Vec<LayerWeights>,
    pub output_norm: Vec<f32>,
    /// `None` when the output projection is tied to `token_embd`.
    pub output: Option<Linear>,
}

impl Qwen3Weights {
    /// Binds every tensor; `config.vocab` is set from the embedding's row count.
    pub fn load(file: &GgufFile, config: &mut Qwen3Config) -> Result<Qwen3Weights> {
        let token_embd = matrix(file, "token_embd.weight", None, config.hidden)?;
        config.vocab = token_embd.rows();
        let c = config.clone();
        let layers = (0..c.n_layers).map(|i| load_layer(file, &c, i)).collect::<Result<Vec<_>>>()?;
        let output = match file.tensor("output.weight") {
            Some(_) => Some(matrix(file, "output.weight", Some(c.vocab), c.hidden)?),
            None => None,
        };
        Ok(Qwen3Weights { token_embd, layers, output_norm: vector(file, "output_norm.weight", c.hidden)?, output })
    }

    /// The LM head: `output.weight`, or the tied embedding.
    pub fn lm_head(&self) -> &Linear {
        self.output.as_ref().unwrap_or(&self.token_embd)
    }
}

fn load_layer(file: &GgufFile, c: &Qwen3Config, i: usize) -> Result<LayerWeights> {
    let name = |t: &str| format!("blk.{i}.{t}.weight");
    let m = |t: &str, rows: usize, cols: usize| matrix(file, &name(t), Some(rows), cols);
    let v = |t: &str, len: usize| vector(file, &name(t), len);
    Ok(LayerWeights {
        attn_norm: v("attn_norm", c.hidden)?,
        wq: m("attn_q", c.q_dim(), c.hidden)?,
        wk: m("attn_k", c.kv_dim(), c.hidden)?,
        wv: m("attn_v", c.kv_dim(), c.hidden)?,
        wo: m("attn_output", c.hidden, c.q_dim())?,
        q_norm: v("attn_q_norm", c.head_dim)?,
        k_norm: v("attn_k_norm", c.head_dim)?,
        ffn_norm: v("ffn_norm", c.hidden)?,
        w_gate: m("ffn_gate", c.ffn, c.hidden)?,
        w_up: m("ffn_up", c.ffn, c.hidden)?,
        w_down: m("ffn_down", c.hidden, c.ffn)?,
    })
}

fn find<'a>(file: &'a GgufFile, name: &str) -> Result<&'a TensorInfo> {
    file.tensor(name).ok_or_else(|| Error::Gguf(format!("missing tensor '{name}'")))
}

/// A 2-D weight of `rows x cols` (`rows = None`: any row count, e.g. the vocabulary).
fn matrix(file: &GgufFile, name: &str, rows: Option<usize>, cols: usize) -> Result<Linear> {
    let info = find(file, name)?;
    let got_rows = if info.dims.len() == 2 { usize::try_from(info.dims[1]).ok() } else { None };
    let shape_ok = info.dims.len() == 2 && info.dims[0] == cols as u64 && rows.is_none_or(|r| got_rows == Some(r));
    if !shape_ok || got_rows == Some(0) {
        let want = rows.map_or("rows".to_string(), |r| r.to_string());
        return Err(Error::Gguf(format!(
            "tensor '{name}' has shape {:?} (GGUF ne order), expected [{cols}, {want}]",
            info.dims
        )));
    }
    let rows = got_rows.unwrap_or(0);
    let bytes = file.tensor_bytes(info);
    match info.ggml_type {
        GgmlType::Q1_0 => Q1Matrix::from_shared(bytes, rows, cols)
            .map(Linear::Q1)
            .map_err(|e| Error::Gguf(format!("tensor '{name}': {e}"))),
        _ => Ok(Linear::Dense { rows, cols, w: widen(name, info, &bytes)? }),
    }
}

/// A 1-D f32/f16/bf16 tensor of `len` values.
fn vector(file: &GgufFile, name: &str, len: usize) -> Result<Vec<f32>> {
    let info = find(file, name)?;
    if info.dims != [len as u64] {
        return Err(Error::Gguf(format!("tensor '{name}' has shape {:?}, expected [{len}]", info.dims)));
    }
    let values = widen(name, info, &file.tensor_bytes(info))?;
    if let Some(bad) = values.iter().find(|v| !v.is_finite()) {
        return Err(Error::Gguf(format!("tensor '{name}' holds a non-finite value ({bad})")));
    }
    Ok(values)
}

/// F32, F16 or BF16 bytes as f32; any other type is an error naming the tensor.
fn widen(name: &str, info: &TensorInfo, bytes: &[u8]) -> Result<Vec<f32>> {
    Ok(match info.ggml_type {
        GgmlType::F32 => bytes.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect(),
        GgmlType::F16 => bytes.chunks_exact(2).map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32()).collect(),
        GgmlType::BF16 => {
            bytes.chunks_exact(2).map(|b| f32::from_bits((u16::from_le_bytes([b[0], b[1]]) as u32) << 16)).collect()
        }
        other => {
            return Err(Error::Gguf(format!(
                "tensor '{name}' has unsupported tensor type {} (expected Q1_0, F32, F16 or BF16)",
                other.name()
            )))
        }
    })
}
