"""The ``oxibonsai`` command: ``generate`` (stream a completion), ``chat`` (interactive, keeps the
history), ``info`` (what a GGUF file holds), ``demo`` (time the Q1_0 kernels) and ``serve`` (the
OpenAI-compatible HTTP server, ``oxibonsai.server``). Text goes to stdout;
progress and timing lines go to stderr. Without ``--model`` the embedded default model is used.
``generate`` and ``chat`` constrain their output with llama.cpp's flags (``--json-schema``,
``--grammar``, their ``-file`` forms) plus ``--regex`` and ``--json``, as structured output."""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Iterator
from typing import Any

import numpy as np

from oxibonsai import _core
from oxibonsai.generation_config import model_sampling_defaults
from oxibonsai.llm import LLM, default_model_path
from oxibonsai.outputs import RequestOutput
from oxibonsai.sampling_params import SamplingParams
from oxibonsai.server.cli_args import (
    add_device_flags,
    add_generation_config_flag,
    add_kv_dtype_flag,
    add_rope_flags,
    add_serve_flags,
    add_speculative_flag,
    device_args,
    rope_args,
)
from oxibonsai.structured_output import StructuredOutputsParams

_SAMPLING_FIELDS = (
    "max_tokens",
    "min_tokens",
    "temperature",
    "top_k",
    "top_p",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "seed",
    "stop",
    "ignore_eos",
    "thinking_token_budget",
)


def _sampling_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=128)
    g.add_argument("--min-tokens", type=int, default=0)
    # Left out: the model's recommended value (--generation-config auto), else _FALLBACK's or
    # SamplingParams' default.
    g.add_argument("--temperature", type=float, default=None, help="default: the model's, else 0.7")
    g.add_argument("--top-k", type=int, default=None, help="default: the model's, else 0 (off)")
    g.add_argument("--top-p", type=float, default=None, help="default: the model's, else 1.0")
    g.add_argument("--min-p", type=float, default=None, help="default: the model's, else 0.0")
    g.add_argument("--repetition-penalty", type=float, default=None, help="default: the model's, else 1.0")
    g.add_argument("--presence-penalty", type=float, default=0.0)
    g.add_argument("--frequency-penalty", type=float, default=0.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append", default=None, help="a stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument(
        "--thinking-token-budget",
        "--reasoning-budget",
        type=int,
        default=None,
        help="at most this many tokens inside <think> ... </think>, then </think> is forced",
    )
    c = g.add_mutually_exclusive_group()
    c.add_argument("--json-schema", "-j", default=None, help="constrain the output to this JSON schema")
    c.add_argument("--json-schema-file", "-jf", default=None, help="... to the JSON schema in this file")
    c.add_argument("--grammar", default=None, help="... to this grammar (GBNF, as llama.cpp's, or Lark)")
    c.add_argument("--grammar-file", default=None, help="... to the grammar in this file")
    c.add_argument("--regex", default=None, help="... to this regular expression")
    c.add_argument("--json", action="store_true", help="... to any JSON object")


def _model_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", "-m", default=None, help="path to a .gguf (default: the embedded model)")
    p.add_argument("--threads", "-t", type=int, default=None)
    p.add_argument("--max-model-len", type=int, default=None)
    add_kv_dtype_flag(p)
    add_device_flags(p)
    add_rope_flags(p)
    add_generation_config_flag(p)
    add_speculative_flag(p)


# The CLI's own default where neither the flag nor the model gives a value (else SamplingParams').
_FALLBACK = {"temperature": 0.7}


def _params(args: argparse.Namespace, llm: LLM) -> SamplingParams:
    """Every sampling flag is named after its ``SamplingParams`` field; one left out takes the model's
    recommended value (``LLM.default_sampling_fields``), else ``_FALLBACK``'s; the constraint flags
    make its ``structured_outputs``."""
    fields = {**_FALLBACK, **llm.default_sampling_fields}
    fields.update({name: getattr(args, name) for name in _SAMPLING_FIELDS if getattr(args, name) is not None})
    return SamplingParams(**fields, structured_outputs=_structured(args))


def _structured(args: argparse.Namespace) -> StructuredOutputsParams | None:
    schema = _read(args.json_schema_file) if args.json_schema_file else args.json_schema
    grammar = _read(args.grammar_file) if args.grammar_file else args.grammar
    if schema is not None:
        try:
            return StructuredOutputsParams(json=json.loads(schema))
        except json.JSONDecodeError as e:
            raise ValueError(f"the JSON schema is not valid JSON: {e}") from None
    if grammar is not None:
        return StructuredOutputsParams(grammar=grammar)
    if args.regex is not None:
        return StructuredOutputsParams(regex=args.regex)
    return StructuredOutputsParams(json_object=True) if args.json else None


def _read(path: str) -> str:
    with open(path, encoding="utf-8") as f:
        return f.read()


def _load(args: argparse.Namespace) -> LLM:
    start = time.perf_counter()
    llm = LLM(
        args.model,
        num_threads=args.threads,
        max_model_len=args.max_model_len,
        kv_cache_dtype=args.kv_cache_dtype,
        generation_config=args.generation_config,
        speculative_config=args.speculative_config,
        **device_args(args),
        **rope_args(args),
    )
    print(f"[loaded {llm.model_path.name} in {time.perf_counter() - start:.2f}s]", file=sys.stderr)
    if llm.default_sampling_fields:
        defaults = _fields_text(llm.default_sampling_fields)
        note = f"[the model's sampling defaults: {defaults}; --generation-config vllm ignores them]"
        print(note, file=sys.stderr)
    return llm


def _fields_text(fields: dict[str, Any]) -> str:
    return ", ".join(f"{name}={value}" for name, value in fields.items())


def _print_stream(outputs: Iterator[RequestOutput]) -> RequestOutput | None:
    """Writes each new piece of text as it arrives; returns the final output."""
    shown, last = 0, None
    for out in outputs:
        text = out.outputs[0].text
        sys.stdout.write(text[shown:])
        sys.stdout.flush()
        shown, last = len(text), out
    sys.stdout.write("\n")
    return last


def _timing_line(out: RequestOutput | None) -> None:
    if out is None:
        return
    m = out.metrics
    ttft = f"{m.time_to_first_token * 1e3:.0f} ms" if m.time_to_first_token is not None else "-"
    decode = f"{m.decode_tokens_per_s:.1f} tok/s" if m.decode_tokens_per_s else "-"
    print(
        f"[{m.num_prompt_tokens} prompt + {m.num_generated_tokens} generated tokens, "
        f"time to first token {ttft}, decode {decode}, finish: {out.outputs[0].finish_reason}]",
        file=sys.stderr,
    )


def _generate(args: argparse.Namespace) -> int:
    llm = _load(args)
    _timing_line(_print_stream(llm.stream(args.prompt, _params(args, llm))))
    return 0


def _chat(args: argparse.Namespace) -> int:
    llm = _load(args)
    history: list[dict[str, Any]] = [{"role": "system", "content": args.system}] if args.system else []
    params = _params(args, llm)
    print("[chat: an empty line or Ctrl-D ends the session]", file=sys.stderr)
    while True:
        try:
            line = input("> ")
        except EOFError:
            break
        if not line.strip():
            break
        history.append({"role": "user", "content": line})
        extra = {"enable_thinking": False} if args.no_think else {}
        out = _print_stream(llm.stream(llm.chat_prompt(history, **extra), params))
        _timing_line(out)
        history.append({"role": "assistant", "content": out.outputs[0].text if out else ""})
    return 0


def _info(args: argparse.Namespace) -> int:
    path = args.path or default_model_path()
    f = _core.GGUFFile(path)
    meta = f.metadata
    tensors = f.tensors()
    print(f"file: {path}  (GGUF v{f.version}, {len(tensors)} tensors, {len(meta)} metadata keys)")
    arch = meta.get("general.architecture", "?")
    print(f"architecture: {arch}  name: {meta.get('general.name', '?')}")
    for key in sorted(k for k in meta if k.startswith(f"{arch}.")):
        print(f"  {key} = {meta[key]}")
    by_type: dict[str, list[int]] = {}
    for t in tensors:
        counts = by_type.setdefault(t["type"], [0, 0, 0])
        counts[0] += 1
        counts[1] += int(np.prod(t["shape"]))
        counts[2] += t["nbytes"]
    for name, (n, params, nbytes) in sorted(by_type.items()):
        print(f"tensors {name}: {n} tensors, {params / 1e6:.1f} M weights, {nbytes / 2**20:.1f} MiB")
    tokens = meta.get("tokenizer.ggml.tokens", [])
    print(
        f"tokenizer: {meta.get('tokenizer.ggml.model', '?')} / pre={meta.get('tokenizer.ggml.pre', '?')}, "
        f"{len(tokens)} tokens, eos={meta.get('tokenizer.ggml.eos_token_id')}"
    )
    template = meta.get("tokenizer.chat_template")
    print(f"chat template: {len(template)} characters" if template else "chat template: none")
    defaults = model_sampling_defaults(meta)
    print(f"sampling defaults: {_fields_text(defaults)}" if defaults else "sampling defaults: none")
    return 0


def _demo(args: argparse.Namespace) -> int:
    rng = np.random.default_rng()
    w = rng.standard_normal((args.rows, args.cols), dtype=np.float32)
    x = rng.standard_normal(args.cols, dtype=np.float32)
    m = _core.Q1Matrix.quantize(w)
    info = _core.kernel_info()
    print(f"kernels: gemv={info['gemv']} gemm={info['gemm']} threads={_core.get_num_threads()}")
    print(f"matrix: {m.rows}x{m.cols} Q1_0, {m.nbytes / 2**20:.2f} MiB (f32: {w.nbytes / 2**20:.1f} MiB)")
    exact = m.dequantize().astype(np.float64) @ x.astype(np.float64)
    for kernel in ("lut", "signflip", "reference"):
        y = m.matmul(x, kernel=kernel)
        start = time.perf_counter()
        for _ in range(args.repeats):
            m.matmul(x, kernel=kernel)
        secs = (time.perf_counter() - start) / args.repeats
        err = np.linalg.norm(y - exact) / np.linalg.norm(exact)
        print(f"{kernel:>9}: {secs * 1e6:9.1f} us/GEMV  {m.nbytes / secs / 1e9:6.2f} GB/s  rel.err {err:.1e}")
    return 0


def _serve(args: argparse.Namespace) -> int:
    try:
        from oxibonsai.server.launcher import serve
    except ImportError as e:
        raise OSError(f"the server needs its extra: pip install 'oxibonsai[server]' ({e})") from e
    return serve(args)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="oxibonsai", description=__doc__)
    parser.add_argument("--version", action="version", version=f"oxibonsai {_core.__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="stream a completion of PROMPT to stdout")
    gen.add_argument("prompt")
    _model_flags(gen)
    _sampling_flags(gen)
    gen.set_defaults(run=_generate)
    chat = sub.add_parser("chat", help="an interactive chat that keeps its history")
    _model_flags(chat)
    _sampling_flags(chat)
    chat.add_argument("--system", default=None, help="a system prompt")
    chat.add_argument("--no-think", action="store_true", help="pass enable_thinking=False to the template")
    chat.set_defaults(run=_chat)
    info = sub.add_parser("info", help="architecture, sizes, quantization, tokenizer and template of a GGUF")
    info.add_argument("path", nargs="?", default=None)
    info.set_defaults(run=_info)
    demo = sub.add_parser("demo", help="quantize a random matrix and time the Q1_0 GEMV kernels")
    demo.add_argument("--rows", type=int, default=2048)
    demo.add_argument("--cols", type=int, default=2048)
    demo.add_argument("--repeats", type=int, default=200)
    demo.set_defaults(run=_demo)
    serve = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (needs oxibonsai[server])")
    add_serve_flags(serve)
    serve.set_defaults(run=_serve)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        return int(args.run(args))
    except (_core.OxiBonsaiError, ValueError, TypeError, OSError) as e:
        print(f"oxibonsai {args.command}: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
