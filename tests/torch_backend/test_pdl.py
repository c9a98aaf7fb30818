"""Programmatic dependent launch: the rule that keeps it correct (a kernel launched with the attribute
waits for the kernel before it before touching memory), off where it cannot be used, and on a Hopper
GPU the same logits with it as without."""

from __future__ import annotations

import ast
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from oxibonsai.torch_backend.ops import pdl  # noqa: E402

OPS = Path(pdl.__file__).parent


def jit_functions_with_pdl() -> list[tuple[str, ast.FunctionDef]]:
    found = []
    for path in sorted(OPS.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef) and any(a.arg == "PDL" for a in node.args.args):
                found.append((f"{path.name}:{node.name}", node))
    return found


PURE = {"tl.program_id", "tl.arange", "tl.minimum", "tl.maximum", "range", "tl.static_range"}
HINTS = {"_prefetch_rows", "prefetch_l2"}  # ask L2 for weights: no value is read


def calls(node: ast.AST) -> set[str]:
    return {ast.unparse(c.func) for c in ast.walk(node) if isinstance(c, ast.Call)}


def before_the_wait(fn: ast.FunctionDef) -> list[ast.stmt]:
    """The statements of ``fn`` before its top-level ``grid_dependency(PDL)`` (a docstring dropped);
    fails if it has none."""
    body = fn.body
    if isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]
    for i, stmt in enumerate(body):
        if isinstance(stmt, ast.Expr) and ast.unparse(stmt) == "grid_dependency(PDL)":
            return body[:i]
    raise AssertionError(f"{fn.name} never calls grid_dependency(PDL) at its top level")


def test_every_kernel_with_a_pdl_switch_waits_before_touching_memory():
    kernels = [(name, fn) for name, fn in jit_functions_with_pdl()
               if fn.name not in {"grid_dependency", *HINTS}]  # fmt: skip
    names = {name.split(":")[1] for name, _ in kernels}
    expected = {"_embedding_kernel", "_quantize_kernel", "_gemv_kernel", "_gemv_split_kernel",
                "_combine_kernel", "_gemm_kernel", "_qk_norm_rope_write_kv_kernel", "_decode_kernel",
                "_merge_kernel", "_prefill_kernel", "_double_kernel"}  # fmt: skip
    assert expected <= names, expected - names
    for name, fn in kernels:
        for stmt in before_the_wait(fn):  # index arithmetic and weight prefetch hints only
            assert calls(stmt) <= PURE | HINTS, (name, ast.unparse(stmt))
            assert isinstance(stmt, ast.Assign) or calls(stmt) & HINTS, (name, ast.unparse(stmt))


def test_the_prefetch_hints_read_nothing():
    hints = {fn.name: fn for _, fn in jit_functions_with_pdl() if fn.name in HINTS}
    assert set(hints) == HINTS
    for fn in hints.values():
        assert calls(fn) <= PURE | HINTS | {"tl.inline_asm_elementwise"}, (fn.name, calls(fn))
    asm = ast.unparse(hints["prefetch_l2"])
    assert "prefetch.global.L2" in asm and "ld." not in asm


def test_only_the_pdl_module_sets_the_launch_attribute():
    for path in sorted(OPS.parent.rglob("*.py")):
        if path.name != "pdl.py":
            assert "launch_pdl=" not in path.read_text(), path


def test_launch_arguments_pair_the_switch_with_the_attribute(monkeypatch):
    assert pdl.launch(torch.device("cpu")) == {"PDL": False}
    monkeypatch.setattr(pdl, "enabled", lambda device: True)
    assert pdl.launch(torch.device("cpu")) == {"PDL": True, "launch_pdl": True}


def test_only_steps_of_few_rows_launch_with_pdl_unless_all_is_asked(monkeypatch, rng):
    from oxibonsai.torch_backend.ops import pdl_rows

    monkeypatch.setattr(pdl, "enabled", lambda device: True)
    cpu = torch.device("cpu")
    few, many = int(rng.integers(1, pdl_rows.MAX_ROWS + 1)), int(rng.integers(pdl_rows.MAX_ROWS + 1, 600))
    with pdl_rows.step_rows(pdl_rows.MAX_ROWS):
        assert pdl.launch(cpu)["PDL"]
    with pdl_rows.step_rows(pdl_rows.MAX_ROWS + 1):
        assert not pdl.launch(cpu)["PDL"]
    with pdl_rows.step_rows(few):
        assert pdl.launch(cpu)["PDL"]
        with pdl_rows.step_rows(many):
            assert pdl.launch(cpu) == {"PDL": False}
        assert pdl.launch(cpu)["PDL"], "the outer step's choice comes back"
    assert pdl.launch(cpu)["PDL"], "a kernel launched outside any step"
    monkeypatch.setenv(pdl.ENV_VAR, "all")
    with pdl_rows.step_rows(many):
        assert pdl.launch(cpu) == {"PDL": True, "launch_pdl": True}


def test_off_except_on_cuda_and_when_asked_off(monkeypatch):
    assert not pdl.enabled(torch.device("cpu"))
    assert not pdl.enabled(torch.device("meta"))
    monkeypatch.setenv(pdl.ENV_VAR, "0")
    assert not pdl.enabled(torch.device("cuda", 0))  # decided before any CUDA call


def test_this_triton_can_launch_with_it():
    assert pdl.triton_has_pdl()


def hopper() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9


@pytest.mark.skipif(not hopper(), reason="PDL needs an NVIDIA GPU of compute capability 9.0 or later")
def test_a_chain_of_pdl_kernels_reads_what_the_one_before_wrote():
    device = torch.device("cuda", torch.cuda.current_device())
    assert pdl.chain_works(device)
    assert pdl.enabled(device)


@pytest.mark.skipif(not hopper(), reason="PDL needs an NVIDIA GPU of compute capability 9.0 or later")
def test_the_engine_gives_the_same_logits_and_tokens_with_and_without_pdl(tiny_model, rng, monkeypatch):
    import oxibonsai as ob

    args = {"runner": "torch", "max_model_len": 128, "max_num_seqs": 4}
    vocab = ob.LLM(tiny_model, device="cpu", **args).config["vocab"]
    prompts = [[int(t) for t in rng.integers(0, vocab, int(rng.integers(1, 40)))] for _ in range(3)]
    params = [ob.SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in (9, 4, 16)]
    runs = []
    for setting in ("1", "0"):
        monkeypatch.setenv(pdl.ENV_VAR, setting)
        llm = ob.LLM(tiny_model, device="cuda", **args)
        outputs = llm.generate(prompts, params)
        runs.append(([o.outputs[0].token_ids for o in outputs], llm.logits(prompts[0])))
        assert llm._runner.graphs.replays > 0  # type: ignore[attr-defined]
    (tokens_on, logits_on), (tokens_off, logits_off) = runs
    assert tokens_on == tokens_off
    assert np.array_equal(logits_on, logits_off)
