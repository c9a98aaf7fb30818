"""The cost of structured output, in two parts, alternated over ``--rounds`` rounds (medians printed).

1. End to end on the embedded model (vocab 4,096), or ``--model PATH``: decode tokens/s of one
   request, plain greedy vs constrained to a regex and to a JSON schema (every token pays the
   grammar's mask, the masked sampler and the grammar's advance).
2. At Bonsai's vocabulary size (151,936 ids; the test vocabulary padded with ``[PADn]`` tokens, the
   only one of that size that can be built offline, so the mask's cost on Qwen3's real vocabulary may
   differ): the time of ``GrammarState.mask`` + ``accept`` per token while a JSON document is fed
   through a schema, and of one Rust ``Sampler.sample`` with and without the mask.

    python benches/bench_structured_output.py [--rounds 5] [--threads N] [--model PATH]
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import numpy as np

import oxibonsai as ob
from oxibonsai.server.forced_tools import strict_calls_tag
from oxibonsai.structured_output import GrammarCompiler, StructuredOutputsParams
from oxibonsai.tokenizer import Tokenizer

from bench_args import parse

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from tiny_vocab import tokenizer_metadata

SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "score": {"type": "number"},
    },
    "required": ["title", "tags", "score"],
}
DOCUMENT = json.dumps(
    {"title": "the module returns a list of files", "tags": ["os", "path", "data"] * 4, "score": 0.75}
)
BONSAI_VOCAB = 151_936
LONG_TEXT = {
    "type": "object",
    "properties": {"text": {"type": "string", "minLength": 400}},
    "required": ["text"],
}


def end_to_end(model: str | None, rounds: int) -> None:
    llm = ob.LLM(model, enable_prefix_caching=False, max_model_len=512)
    prompt = "The module returns a list of files in the path and"
    specs = {
        "plain": None,
        "regex [a-z ]+": StructuredOutputsParams(regex="[a-z ]+"),
        "json schema": StructuredOutputsParams(json=LONG_TEXT),
    }
    rates: dict[str, list[float]] = {name: [] for name in specs}
    lengths: dict[str, int] = {}
    for _ in range(rounds):
        for name, spec in specs.items():
            params = ob.SamplingParams(
                max_tokens=64, temperature=0, ignore_eos=spec is None, structured_outputs=spec
            )
            out = llm.generate([prompt], params)[0]
            rates[name].append(out.metrics.decode_tokens_per_s)
            lengths[name] = len(out.outputs[0].token_ids)
    base = float(np.median(rates["plain"]))
    print(f"end to end, {model or 'embedded model'} (vocab {llm.config['vocab']}), one request, greedy:")
    for name, r in rates.items():
        med = float(np.median(r))
        print(f"  {name:14s} {med:7.1f} tokens/s ({lengths[name]} tokens)  {med / base:.2f}x plain")


def mask_and_accept(
    compiler: GrammarCompiler, spec: StructuredOutputsParams, tokens: list[int], rounds: int
) -> float:
    """Median seconds per token of ``mask`` + ``accept`` while ``tokens`` are fed through ``spec``."""
    per_token = []
    for _ in range(rounds):
        grammar = compiler.compile(spec)
        start = time.perf_counter()
        for t in tokens:
            grammar.mask()
            grammar.accept([t])
        per_token.append((time.perf_counter() - start) / len(tokens))
        assert not grammar.error, grammar.error
    return float(np.median(per_token))


def bonsai_vocabulary(rounds: int) -> None:
    tokenizer = Tokenizer.from_gguf_metadata(tokenizer_metadata(BONSAI_VOCAB))
    start = time.perf_counter()
    compiler = GrammarCompiler(tokenizer, BONSAI_VOCAB)
    compiler.compile(StructuredOutputsParams(regex="a"))  # builds the grammar engine's tokenizer
    setup = time.perf_counter() - start
    spec = StructuredOutputsParams(json=SCHEMA)
    start = time.perf_counter()
    compiler.compile(spec)
    first = time.perf_counter() - start
    start = time.perf_counter()
    compiler.compile(spec)
    cached = time.perf_counter() - start
    per_token = mask_and_accept(compiler, spec, tokenizer.encode(DOCUMENT), rounds)
    tool = {"name": "lookup", "strict": True, "parameters": SCHEMA}
    strict = StructuredOutputsParams(structural_tag=strict_calls_tag([tool]))
    call = '<tool_call>\n{"name": "lookup", "arguments": ' + DOCUMENT + "}\n</tool_call>"
    text = "The files are listed below, and I will look up the rest. " + call
    strict_per_token = mask_and_accept(compiler, strict, tokenizer.encode(text), rounds)
    print(f"Bonsai vocabulary ({BONSAI_VOCAB} ids, padded test vocabulary):")
    print(f"  the engine's first structured request: {1e3 * setup:.0f} ms (the grammar tokenizer)")
    print(f"  schema compile {1e3 * first:.1f} ms; the same schema again (cached) {1e3 * cached:.2f} ms")
    print(f"  mask + accept, JSON schema: {1e6 * per_token:.0f} us per token")
    print(f"  mask + accept, strict tool (text, then a call): {1e6 * strict_per_token:.0f} us per token")
    rng = np.random.default_rng(0)
    logits = rng.standard_normal(BONSAI_VOCAB).astype(np.float32)
    mask = compiler.compile(spec).mask()
    samplers = {
        "sample t=0.8": ob.SamplingParams(temperature=0.8, seed=1).sampler(0),
        "greedy": ob.SamplingParams(temperature=0).sampler(0),
    }
    timings: dict[str, list[float]] = {}
    for _ in range(rounds):
        for kind, sampler in samplers.items():
            for name, allowed in ((kind, None), (f"{kind} + mask", mask)):
                start = time.perf_counter()
                for _ in range(50):
                    sampler.sample(logits, [], [], None, None, allowed)
                timings.setdefault(name, []).append((time.perf_counter() - start) / 50)
    for name, t in timings.items():
        print(f"  Rust {name:20s} {1e6 * float(np.median(t)):.0f} us per token")


def main() -> None:
    args = parse(model=True)
    rounds = args.rounds
    print(f"kernels {ob.kernel_info()}")
    end_to_end(args.model, rounds)
    bonsai_vocabulary(rounds)


if __name__ == "__main__":
    main()
