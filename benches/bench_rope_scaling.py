"""What YaRN rope scaling costs: the same file (default: the random Bonsai-1.7B-shaped GGUF of
``bench_model.py``) loaded twice, plain and with ``rope_scaling`` (YaRN x4
over the file's context), prefilling ``--prompt-len`` random ids and decoding ``--decode`` greedy tokens,
the two alternated over ``--rounds`` rounds (prefix cache off); prints each one's median prefill and
decode tokens/s and the ratio scaled / plain within each round (median, min, max).

    python benches/bench_rope_scaling.py [--model PATH] [--rounds 5] [--threads N]
                                         [--prompt-len 512] [--decode 64]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
from bench_model import machine_lines, untied_model_path

import oxibonsai as ob


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--decode", type=int, default=64)
    args = ap.parse_args()
    if args.threads is not None:
        ob.set_num_threads(args.threads)
    length = args.prompt_len + args.decode + 8
    model = untied_model_path(Path(args.model) if args.model else None)
    print("\n".join(machine_lines()))
    plain = ob.LLM(model, max_model_len=length, enable_prefix_caching=False, max_num_seqs=1)
    context = plain.config["context_length"]
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": context}
    scaled = ob.LLM(
        model, max_model_len=length, enable_prefix_caching=False, max_num_seqs=1, rope_scaling=yarn
    )
    print(f"{plain.model_path.name}: context {context}; scaled {scaled.config['rope_scaling']}")
    print(
        f"prompt {args.prompt_len}, decode {args.decode}, threads {ob.get_num_threads()}, {ob.kernel_info()}"
    )
    params = ob.SamplingParams(max_tokens=args.decode, temperature=0.0, ignore_eos=True)
    rng = np.random.default_rng()
    speeds: dict[str, dict[str, list[float]]] = {"plain": {}, "yarn": {}}
    for _ in range(args.rounds):
        ids = [int(t) for t in rng.integers(0, plain.config["vocab"], args.prompt_len)]
        for name, llm in (("plain", plain), ("yarn", scaled)):
            m = llm.generate([ids], params)[0].metrics
            speeds[name].setdefault("prefill", []).append(args.prompt_len / m.time_to_first_token)
            speeds[name].setdefault("decode", []).append(m.decode_tokens_per_s)
    for phase in ("prefill", "decode"):
        p, y = np.array(speeds["plain"][phase]), np.array(speeds["yarn"][phase])
        r = y / p
        print(
            f"{phase:8s} plain {np.median(p):8.1f} tok/s  yarn {np.median(y):8.1f} tok/s  "
            f"yarn/plain median {np.median(r):.3f} (min {r.min():.3f}, max {r.max():.3f})"
        )


if __name__ == "__main__":
    main()
