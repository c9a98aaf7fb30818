"""Which activation quantization issue 26 should adopt, chosen by measurement in numpy.

Every scheme is modelled exactly: a function that rounds a matmul input the way the kernels would and
returns the values the integer sums then stand for (values taken out of the integer path come back
exact, as f32). `SchemeQwen3` is the float64 reference (`tests/qwen3_reference.py`) with every matmul
input rounded by one scheme; its logits are compared with the unrounded reference's on the same random
Bonsai-shaped models (`tests/model_factory.py`, Qwen3-0.6B's proportions at --hidden), plain and with
massive activation channels (`tests/test_massive_activations.py`: four fixed hidden channels of every
attn_norm and ffn_norm weight multiplied by each of --scales, so the q/k/v and gate/up inputs carry
them at every position), and with --default-model on the packaged trained model (held-out text).

Metrics: per model, the median over all positions of the relative L2 distance of the logits rows to
float64's, and the top-1 agreement; how many matmul input values exceed 6 rms of their row. Then the
normalized MSE of one Q1 matmul (--rows x 2048) against float64 for n = 1, 4, 16, 64 activation rows
with outliers: 0.1% of the values times 20 (the activations of `tests/test_q1_kernels.py`), and one
column per 128-block times 20 or 100 (the issue's "outlier columns").
--native adds today's engine and kernels (`oxibonsai`, f32 KV cache) as a row, --llama-python PATH
llama.cpp's (a python with llama_cpp; f32 KV cache): both check that the numpy models of the schemes
reproduce the real engines.

    python benches/act_quant_study.py [--hidden 1024] [--layers 4] [--prompts 8] [--native]
        [--default-model] [--llama-python PATH] [--skip-matmul]
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from test_massive_activations import (
    add_massive_channels,
    logit_errors,
    massive_channels,
    outlier_columns,
)

from model_factory import TinyQwen3Config, write_qwen3_gguf
from q1_reference import QK, dequantize, dequantized, quantize, quantize_activations
from qwen3_reference import ReferenceQwen3

TESTS_DIR = Path(__file__).resolve().parent.parent / "tests"
Scheme = Callable[[np.ndarray], np.ndarray]
SUB = 32  # the sub-block of the per-32 schemes (llama.cpp's q8_0)
OUTLIER_RMS = 6.0  # |x| > 6 rms of its row leaves the integer path


def int_groups(x: np.ndarray, group: int, levels: int = 127, fp16_scale: bool = False) -> np.ndarray:
    """One scale per `group` values, amax / levels, round half even in float32 (act.rs's rules)."""
    n, k = x.shape
    xb = x.astype(np.float32).reshape(n, k // group, group)
    amax = np.abs(xb).max(axis=2, keepdims=True)
    with np.errstate(divide="ignore"):
        inv = np.where(amax > 0, np.float32(levels) / amax, np.float32(0)).astype(np.float32)
    q = np.clip(np.rint(xb * inv), -levels, levels)
    scale = amax / np.float32(levels)
    if fp16_scale:  # llama.cpp's q8_0 stores d as fp16 and rounds with the f32 inverse
        scale = scale.astype(np.float16).astype(np.float32)
    return (q.astype(np.float64) * scale.astype(np.float64)).reshape(n, k)


def int16_l1(x: np.ndarray) -> np.ndarray:
    """The kernels' scheme since issue 26 (`q1_reference.quantize_activations`): int16 per 128 with
    sum |q| <= 32639 per block."""
    return dequantized(*quantize_activations(x.astype(np.float32)))


def int8_pow2(x: np.ndarray, max_shift: int) -> np.ndarray:
    """int8 per 128 (scale amax/127) where each 32-sub-block may use scale / 2^e, 0 <= e <= max_shift:
    the largest e whose range still holds the sub-block's amax."""
    n, k = x.shape
    xb = x.astype(np.float32).reshape(n, k // QK, QK // SUB, SUB)
    amax_s = np.abs(xb).max(axis=3, keepdims=True)
    amax = amax_s.max(axis=2, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        e = np.floor(np.log2(amax.astype(np.float64) / amax_s))
    e = np.clip(np.nan_to_num(e, nan=max_shift, posinf=max_shift), 0, max_shift)
    scale = (amax / np.float32(127)).astype(np.float64) * 2.0**-e
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(scale > 0, np.clip(np.rint(xb / scale), -127, 127), 0)
    return (q * scale).reshape(n, k)


def outlier_mask(x: np.ndarray, k_rms: float = OUTLIER_RMS) -> np.ndarray:
    x32 = x.astype(np.float32)
    rms = np.sqrt(np.mean(x32.astype(np.float64) ** 2, axis=1, keepdims=True))
    return np.abs(x32) > k_rms * rms


def top1_mask(x: np.ndarray) -> np.ndarray:
    """The largest |x| of every 128-block."""
    n, k = x.shape
    xb = np.abs(x).reshape(n, k // QK, QK)
    return (np.arange(QK) == xb.argmax(axis=2)[:, :, None]).reshape(n, k)


def with_exact(base: Scheme, mask_of: Callable[[np.ndarray], np.ndarray]) -> Scheme:
    """Values where `mask_of` is set leave the integer path and are applied exactly (as f32)."""

    def scheme(x: np.ndarray) -> np.ndarray:
        mask = mask_of(x)
        x32 = x.astype(np.float32).astype(np.float64)
        return base(np.where(mask, 0.0, x32)) + np.where(mask, x32, 0.0)

    return scheme


SCHEMES: dict[str, Scheme] = {
    "int8/128 (before issue 26)": lambda x: int_groups(x, QK),
    "int8/32": lambda x: int_groups(x, SUB),
    "q8_0 (llama.cpp: /32, fp16 d)": lambda x: int_groups(x, SUB, fp16_scale=True),
    "int8/128 + pow2/32 e<=1": lambda x: int8_pow2(x, 1),
    "int8/128 + pow2/32 e<=7": lambda x: int8_pow2(x, 7),
    "int8/128 + top1/128 exact": with_exact(lambda x: int_groups(x, QK), top1_mask),
    "int8/128 + >6rms exact": with_exact(lambda x: int_groups(x, QK), outlier_mask),
    "int8/32 + >6rms exact": with_exact(lambda x: int_groups(x, SUB), outlier_mask),
    "int16/128 L1-bounded": int16_l1,
    "int16/128 L1-bounded + >6rms exact": with_exact(int16_l1, outlier_mask),
    "int16/128 amax (bound)": lambda x: int_groups(x, QK, levels=32767),
}


class SchemeQwen3(ReferenceQwen3):
    """The float64 reference with every matmul input rounded by `scheme`; counts the values above
    6 rms of their row in every input row."""

    def __init__(self, base: ReferenceQwen3, scheme: Scheme) -> None:
        super().__init__(base.hp, base.w)
        self.scheme = scheme
        self.outliers: list[int] = []

    def linear(self, x: np.ndarray, name: str) -> np.ndarray:
        self.outliers += outlier_mask(x).sum(axis=1).tolist()
        return self.scheme(x) @ self.w[name].T


def model_config(hidden: int, layers: int, vocab: int) -> TinyQwen3Config:
    """Qwen3-0.6B's proportions (Bonsai-1.7B's at hidden 2048): head_dim 128, hidden/64 query heads."""
    heads = hidden // 64
    return TinyQwen3Config(
        vocab_size=vocab,
        hidden_size=hidden,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=heads // 2,
        head_dim=128,
        ffn_size=3 * hidden,
        name=f"act-quant-study-{hidden}",
    )


def write_models(
    out: Path, cfg: TinyQwen3Config, scales: list[float], seed: int, tied: bool = True
) -> dict[str, Path]:
    """One plain model and the same weights with massive channels at each scale."""
    models = {}
    for scale in [1.0, *scales]:
        name = "plain" if scale == 1.0 else f"massive x{scale:g}"
        path = out / f"{name.replace(' ', '-')}.gguf"
        write_qwen3_gguf(path, cfg, np.random.default_rng(seed), tied=tied)
        if scale != 1.0:
            add_massive_channels(path, scale)
        models[name] = path
    return models


def native_logits(path: Path, prompts: list[list[int]]) -> list[np.ndarray]:
    import oxibonsai

    llm = oxibonsai.LLM(str(path), kv_cache_dtype="f32")
    return [llm.logits(p) for p in prompts]


LLAMA_SCRIPT = """
import json, sys
import numpy as np
from llama_cpp import Llama
path, prompts, out = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
llm = Llama(path, n_ctx=512, n_batch=512, logits_all=True, type_k=0, type_v=0, verbose=False,
            n_threads=2, seed=0)
rows = []
for p in prompts:
    llm.reset()
    llm.eval(p)
    rows.append(np.array(llm.scores[: len(p)], dtype=np.float32))
np.save(out, np.stack(rows))
"""


def llama_logits(python: str, path: Path, prompts: list[list[int]]) -> list[np.ndarray]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "logits.npy"
        cmd = [python, "-c", LLAMA_SCRIPT, str(path), json.dumps(prompts), str(out)]
        subprocess.run(cmd, check=True)
        return list(np.load(out))


def study_logits(args: argparse.Namespace, models: dict[str, tuple[Path, list[list[int]]]]) -> dict:
    """{scheme: {model: (median rel L2, top-1)}}, plus the outlier counts per matmul input row."""
    results: dict[str, dict[str, tuple[float, float]]] = {}
    outliers: dict[str, tuple[float, int]] = {}
    for model, (path, prompts) in models.items():
        t0 = time.perf_counter()
        ref = SchemeQwen3(ReferenceQwen3.from_gguf(path), lambda x: x)
        exact = [ref.logits64(p) for p in prompts]
        outliers[model] = (float(np.mean(ref.outliers)), int(np.max(ref.outliers)))
        for name, scheme in SCHEMES.items():
            variant = SchemeQwen3(ref, scheme)
            results.setdefault(name, {})[model] = logit_errors([variant.logits64(p) for p in prompts], exact)
        if args.native:
            results.setdefault("native oxibonsai today", {})[model] = logit_errors(
                native_logits(path, prompts), exact
            )
        if args.llama_python:
            results.setdefault("native llama.cpp", {})[model] = logit_errors(
                llama_logits(args.llama_python, path, prompts), exact
            )
        print(f"  {model}: {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
    return {"logits": results, "outliers": outliers}


def default_model(count: int, tokens: int) -> tuple[Path, list[list[int]]]:
    """The packaged trained model and `count` windows of its held-out text."""
    from oxibonsai import LLM
    from oxibonsai.llm import default_model_path

    llm = LLM()
    text = (TESTS_DIR / "data" / "default_model_heldout.txt").read_text(encoding="utf-8")
    ids = llm.tokenizer.encode(text, add_special_tokens=False)
    step = len(ids) // count
    return default_model_path(), [ids[i * step : i * step + tokens] for i in range(count)]


def random_q1(rng: np.random.Generator, rows: int, cols: int) -> np.ndarray:
    """Dequantized Q1_0 weights of N(0, s_r^2) rows with s_r ~ U(0.01, 1) (as tests/test_q1_kernels.py)."""
    w = rng.standard_normal((rows, cols)).astype(np.float32) * rng.uniform(0.01, 1.0, (rows, 1))
    return dequantize(quantize(w.astype(np.float32)), rows, cols).astype(np.float64)


MATMUL_KINDS = {  # name: (share of random values, or None for one column per 128-block, factor)
    "0.1% x20": (0.001, 20.0),
    "col/128 x20": (None, 20.0),
    "col/128 x100": (None, 100.0),
}


def outlier_acts(rng: np.random.Generator, n: int, cols: int, kind: str) -> np.ndarray:
    """Standard normal; "0.1% x20": random values times 20 (tests/test_q1_kernels.py's activations);
    "col/128 xF": one fixed column per 128-block (`outlier_columns`) times F in every row."""
    share, factor = MATMUL_KINDS[kind]
    x = rng.standard_normal((n, cols)).astype(np.float32)
    if share is not None:
        x[rng.random((n, cols)) < share] *= np.float32(factor)
    else:
        x[:, outlier_columns(cols)] *= np.float32(factor)
    return x


def study_matmul(args: argparse.Namespace, rng: np.random.Generator) -> dict:
    """{(kind, n): {scheme: (median NMSE, max NMSE)}} over `trials` fresh matrices and activations."""
    cols, out = 2048, {}
    native = None
    if args.native:
        from oxibonsai import Q1Matrix

        native = Q1Matrix
    for kind in MATMUL_KINDS:
        for n in (1, 4, 16, 64):
            nmse: dict[str, list[float]] = {}
            for _ in range(args.trials):
                w = random_q1(rng, args.rows, cols)
                x = outlier_acts(rng, n, cols, kind)
                exact = x.astype(np.float64) @ w.T
                for name, scheme in SCHEMES.items():
                    y = scheme(x.astype(np.float64)) @ w.T
                    nmse.setdefault(name, []).append(float(np.sum((y - exact) ** 2) / np.sum(exact**2)))
                if native is not None:
                    y = native.quantize(w.astype(np.float32)).matmul(x).astype(np.float64)
                    key = "native oxibonsai today"
                    nmse.setdefault(key, []).append(float(np.sum((y - exact) ** 2) / np.sum(exact**2)))
            out[(kind, n)] = {k: (float(np.median(v)), float(np.max(v))) for k, v in nmse.items()}
    return out


def print_logit_table(res: dict, models: list[str]) -> None:
    """Median relative L2 (x1e-3) / top-1 per model, and the worst ratio of the rel L2 to int8/32's."""
    floor = res["logits"]["int8/32"]
    print("| scheme | " + " | ".join(models) + " | worst vs int8/32 |")
    print("|---" * (len(models) + 2) + "|")
    for name, per_model in res["logits"].items():
        cells = " | ".join(f"{per_model[m][0] * 1e3:.2f} / {per_model[m][1] * 100:.1f}%" for m in models)
        worst = max(per_model[m][0] / floor[m][0] for m in models)
        print(f"| {name} | {cells} | {worst:.2f}x |")
    print()
    print("Matmul inputs with |x| > 6 rms of their row, per row (mean / max over every matmul input):")
    print(", ".join(f"{m}: {mean:.2f} / {mx}" for m, (mean, mx) in res["outliers"].items()))


def print_matmul_table(res: dict, rows: int, trials: int) -> None:
    keys = list(res)
    print(f"\nNormalized MSE of one {rows}x2048 Q1 matmul vs float64 (x1e-4, median (max) of {trials}")
    print("trials); '0.1% x20': random values times 20, 'col/128 xF': one column per 128-block times F.\n")
    print("| scheme | " + " | ".join(f"{kind} n={n}" for kind, n in keys) + " |")
    print("|---" * (len(keys) + 1) + "|")
    for name in res[keys[0]]:
        cells = " | ".join(f"{res[k][name][0] * 1e4:.3g} ({res[k][name][1] * 1e4:.3g})" for k in keys)
        print(f"| {name} | {cells} |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--scales", type=float, nargs="*", default=[30.0, 100.0, 1000.0])
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--rows", type=int, default=1024, help="rows of the matmul check")
    p.add_argument("--trials", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--native", action="store_true", help="add today's oxibonsai kernels as a row")
    p.add_argument("--llama-python", help="a python with llama_cpp: add llama.cpp as a row")
    p.add_argument("--default-model", action="store_true", help="add the packaged trained model")
    p.add_argument("--skip-matmul", action="store_true")
    args = p.parse_args()
    rng = np.random.default_rng(args.seed)
    cfg = model_config(args.hidden, args.layers, args.vocab)
    prompts = [rng.integers(0, args.vocab, args.tokens).tolist() for _ in range(args.prompts)]
    print(f"command: {shlex.join([sys.executable, *sys.argv])}")
    print(f"models: {cfg}; massive channels {massive_channels(args.hidden)}; {args.prompts} prompts of")
    print(f"{args.tokens} random tokens; outliers: |x| > {OUTLIER_RMS} rms of the row\n")
    with tempfile.TemporaryDirectory() as tmp:
        models = {m: (p, prompts) for m, p in write_models(Path(tmp), cfg, args.scales, args.seed).items()}
        if args.default_model:
            models["default (trained)"] = default_model(args.prompts, args.tokens)
        res = study_logits(args, models)
    print_logit_table(res, list(models))
    if not args.skip_matmul:
        print_matmul_table(study_matmul(args, rng), args.rows, args.trials)


if __name__ == "__main__":
    main()
