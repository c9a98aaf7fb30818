"""Issue 26: the engine's numerics with massive activation channels, against a float64 reference.

Real LLMs carry a few hidden channels 30-1000x larger than the rest, token after token (Sun et al.,
2024). With one int8 scale per 128 activations, one such value sets the step of its whole block and the
other 127 values keep a few bits. These tests build such models and hold the native engine to bounds
that the int8-per-128 kernels (before issue 26) failed and the kernels' activation quantization
passes: int16 per 128 values with an L1-bounded scale (`q1_reference.quantize_activations`), chosen in
`benches/act_quant_study.py`. Each bound is also checked on numpy models of both schemes
(`test_bounds_separate_the_schemes`).

How the massive channels are made (`add_massive_channels`): a random Bonsai-shaped model from
`model_factory`, then entries `massive_channels(hidden)` (four channels, each in its own 128-block, off
the 32-boundaries) of every layer's `attn_norm` and `ffn_norm` weights multiplied by `MASSIVE_SCALE` in
the file. Those norms produce the inputs of the q/k/v and gate/up matrices, so those inputs carry the
four channels ~100x larger than the rest at every position, as a massive channel of the residual
stream would after RMSNorm. `output_norm` is left alone so that the logits stay token dependent.

Measured on this file's shapes (8 model seeds, 4 prompts of 32 tokens; median relative L2 of the logits
rows x1e-3 / top-1 agreement): plain: int8/128 (the kernels before issue 26, native) 18.8-20.1 /
94.5-98.4%, int8/32 14.7-16.0, int16-L1 (numpy; the native kernels now give the same to ~1%) 2.9-3.1 /
98.4-99.2%; massive x100: int8/128 56-80 / 82.8-89.1%, int8/32 29-38 / 88.3-95.3%, int16-L1 1.7-2.3 /
98.4-100%. The default model (held-out text): int8/128 6.7, int8/32 4.9, int16-L1 0.68. The
kernel="reference" path (f32 activations) stays at 1e-6.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest

import oxibonsai as ob
from oxibonsai.llm import default_model_path

from model_factory import TinyQwen3Config, write_qwen3_gguf
from q1_reference import QK, dequantized, quantize_activations, quantize_activations_int8
from qwen3_reference import Int8ActivationQwen3, QuantizedActivationQwen3, ReferenceQwen3

MASSIVE_NORMS = ("attn_norm.weight", "ffn_norm.weight")
MASSIVE_AT = (0.02, 0.29, 0.55, 0.81)  # fractions of the hidden size: four channels in four blocks
MASSIVE_SCALE = 100.0
CFG = TinyQwen3Config(
    vocab_size=1024, hidden_size=512, num_layers=2, num_heads=8, num_kv_heads=4, ffn_size=1536
)
PROMPTS, TOKENS = 4, 32
HELDOUT = Path(__file__).parent / "data" / "default_model_heldout.txt"

# Bounds: median relative L2 of the logits rows against float64, and top-1 agreement (massive models;
# on plain ones near-ties make top-1 a poor discriminator). Margins are in the module docstring.
REL_L2_MAX = 6e-3
TOP1_MIN = 0.97
DEFAULT_MODEL_REL_L2_MAX = 2e-3
MATMUL_NMSE_MAX = 2e-5  # the issue asks <= 5e-4; int8/128 sat at 5.0e-4 (20x) and 6.5e-4 (100x)


def massive_channels(hidden: int) -> list[int]:
    """Four fixed channels, each in a different 128-block when hidden >= 512, off the 32-boundaries."""
    return [int(f * hidden) | 1 for f in MASSIVE_AT]


def outlier_columns(cols: int) -> list[int]:
    """One column per 128-block (the issue's "outlier columns"), at offsets that vary between blocks."""
    return [b * QK + (37 * b + 5) % QK for b in range(cols // QK)]


def add_massive_channels(path: Path, scale: float) -> None:
    """Multiplies `massive_channels` of every attn_norm and ffn_norm weight by `scale`, in the file."""
    reader = gguf.GGUFReader(path, "r+")
    hidden = int(reader.get_field("qwen3.embedding_length").contents())
    channels = massive_channels(hidden)
    for t in reader.tensors:
        if t.name.endswith(MASSIVE_NORMS):
            t.data[channels] *= np.float32(scale)
    reader.data.flush()


def logit_errors(ours: list[np.ndarray], exact: list[np.ndarray]) -> tuple[float, float]:
    """(median relative L2 of the logits rows, top-1 agreement) over every position of every prompt."""
    a, b = np.concatenate(ours).astype(np.float64), np.concatenate(exact)
    rel = np.linalg.norm(a - b, axis=1) / np.linalg.norm(b, axis=1)
    return float(np.median(rel)), float(np.mean(a.argmax(1) == b.argmax(1)))


class Case:
    """One model file, its float64 reference and prompts, and the reference's logits."""

    def __init__(self, path: Path, prompts: list[list[int]]) -> None:
        self.path = path
        self.prompts = prompts
        self.ref = ReferenceQwen3.from_gguf(path)
        self.exact = [self.ref.logits64(p) for p in prompts]

    def native(self, **kwargs: str) -> tuple[float, float]:
        llm = ob.LLM(self.path, kv_cache_dtype="f32", **kwargs)
        return logit_errors([llm.logits(p) for p in self.prompts], self.exact)

    def numpy(self, model: type[ReferenceQwen3]) -> tuple[float, float]:
        m = model(self.ref.hp, self.ref.w)
        return logit_errors([m.logits64(p) for p in self.prompts], self.exact)


@pytest.fixture(scope="module", params=["plain", "massive"])
def case(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, model_seed: int) -> Case:
    path = tmp_path_factory.mktemp("massive") / f"{request.param}.gguf"
    rng = np.random.default_rng(model_seed)
    write_qwen3_gguf(path, CFG, rng)
    if request.param == "massive":
        add_massive_channels(path, MASSIVE_SCALE)
    prompts = [rng.integers(0, CFG.vocab_size, TOKENS).tolist() for _ in range(PROMPTS)]
    return Case(path, prompts)


@pytest.fixture(scope="module")
def default_case() -> Case:
    """The packaged trained model on windows of held-out text."""
    ids = ob.LLM().tokenizer.encode(HELDOUT.read_text(encoding="utf-8"), add_special_tokens=False)
    step = len(ids) // PROMPTS
    return Case(default_model_path(), [ids[i * step : i * step + TOKENS] for i in range(PROMPTS)])


def check_bounds(rel_l2: float, top1: float, massive: bool) -> None:
    assert rel_l2 <= REL_L2_MAX, f"median relative L2 {rel_l2:.2e} > {REL_L2_MAX:.0e}"
    if massive:
        assert top1 >= TOP1_MIN, f"top-1 agreement {top1:.3f} < {TOP1_MIN}"


def test_massive_channels_reach_the_matmul_inputs(case: Case) -> None:
    """Every q/k/v and gate/up input row carries the four channels far above its typical value."""
    inputs: list[np.ndarray] = []

    class Recording(ReferenceQwen3):
        def linear(self, x: np.ndarray, name: str) -> np.ndarray:
            if name.endswith(("attn_q.weight", "ffn_gate.weight")):
                inputs.append(x)
            return super().linear(x, name)

    Recording(case.ref.hp, case.ref.w).logits64(case.prompts[0])
    x = np.concatenate(inputs)
    ratio = np.abs(x[:, massive_channels(CFG.hidden_size)]) / np.median(np.abs(x), axis=1, keepdims=True)
    if case.path.stem == "massive":
        assert np.median(ratio) > 30 and np.mean(ratio > 10) > 0.8, np.median(ratio)
    else:
        assert np.median(ratio) < 3


def test_f32_activations_match_float64(case: Case) -> None:
    """The models are well conditioned: unquantized activations (kernel="reference") stay at ~1e-6, so
    the errors below are the activation quantization's."""
    rel_l2, top1 = case.native(kernel="reference")
    assert rel_l2 < 1e-5 and top1 == 1.0


def test_bounds_separate_the_schemes(case: Case) -> None:
    """The numpy model of the kernels' scheme passes the bounds; int8 per 128 (the old one) fails them."""
    massive = case.path.stem == "massive"
    check_bounds(*case.numpy(QuantizedActivationQwen3), massive)
    with pytest.raises(AssertionError):
        check_bounds(*case.numpy(Int8ActivationQwen3), massive)


def test_native_logits_stay_close_to_float64(case: Case) -> None:
    check_bounds(*case.native(), case.path.stem == "massive")


def test_default_model_logits_stay_close_to_float64(default_case: Case) -> None:
    rel_l2, top1 = default_case.native()
    assert rel_l2 <= DEFAULT_MODEL_REL_L2_MAX and top1 >= TOP1_MIN, (rel_l2, top1)


def test_default_model_bound_separates_the_schemes(default_case: Case) -> None:
    assert default_case.numpy(QuantizedActivationQwen3)[0] <= DEFAULT_MODEL_REL_L2_MAX / 2
    assert default_case.numpy(Int8ActivationQwen3)[0] > 2 * DEFAULT_MODEL_REL_L2_MAX


def outlier_matmul(
    rng: np.random.Generator, factor: float
) -> tuple[ob.Q1Matrix, np.ndarray, list[np.ndarray]]:
    """A random 512x2048 Q1 matrix, its float64 values, and activations for n = 1, 4, 16, 64 with one
    column per 128-block `factor` times larger (the issue's outlier columns)."""
    rows, cols = 512, 2048
    w = rng.standard_normal((rows, cols)).astype(np.float32) * rng.uniform(0.01, 1.0, (rows, 1)).astype(
        np.float32
    )
    m = ob.Q1Matrix.quantize(w)
    xs = []
    for n in (1, 4, 16, 64):
        x = rng.standard_normal((n, cols)).astype(np.float32)
        x[:, outlier_columns(cols)] *= np.float32(factor)
        xs.append(x)
    return m, m.dequantize().astype(np.float64), xs


def nmse(y: np.ndarray, exact: np.ndarray) -> float:
    return float(np.sum((y - exact) ** 2) / np.sum(exact**2))


@pytest.mark.parametrize("factor", [20.0, 100.0])
def test_q1_matmul_with_outlier_columns(rng: np.random.Generator, factor: float) -> None:
    """Normalized MSE of the native matmul against float64, for every n."""
    m, w64, xs = outlier_matmul(rng, factor)
    for x in xs:
        err = nmse(m.matmul(x), x.astype(np.float64) @ w64.T)
        assert err <= min(5e-4, MATMUL_NMSE_MAX), (x.shape[0], err)


@pytest.mark.parametrize("factor", [20.0, 100.0])
def test_matmul_bound_separates_the_schemes(rng: np.random.Generator, factor: float) -> None:
    """The kernels' scheme's exact value (numpy) is 4x inside the bound, int8 per 128 5x outside."""
    _, w64, xs = outlier_matmul(rng, factor)
    for x in xs:
        exact = x.astype(np.float64) @ w64.T
        assert nmse(dequantized(*quantize_activations(x)) @ w64.T, exact) <= MATMUL_NMSE_MAX / 4
        assert nmse(dequantized(*quantize_activations_int8(x)) @ w64.T, exact) > 5 * MATMUL_NMSE_MAX
