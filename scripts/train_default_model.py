"""Train oxibonsai's embedded default model: a small Qwen3 with 1-bit (Q1_0) quantization-aware training.

    python scripts/train_default_model.py --data /tmp/ob-train/data --out /tmp/ob-train/q1 \
        --export python/oxibonsai/models/oxibonsai-default-q1.gguf \
        --heldout tests/data/default_model_heldout.txt
    python scripts/train_default_model.py --data /tmp/ob-train/data --out /tmp/ob-train/fp --full-precision

Needs oxibonsai itself (``pip install -e .``), torch (CPU is enough; ``--device cuda`` trains on a GPU),
gguf (for ``--export`` only), and Debian's python3.11-doc for the corpus (see ``default_model/corpus.py``;
not needed once ``--data`` is prepared). Seeded; saves a checkpoint every
``--save-every`` steps, and ``--resume`` continues from the last one with the same batches and
schedule (``--stop-at`` ends a leg early). The log (``log.jsonl`` in ``--out``) records loss,
throughput, held-out bits per byte and the run time; the full-precision run is the same model and
schedule without quantization, for comparison.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tokenizers import Tokenizer as HfTokenizer

sys.path.insert(0, str(Path(__file__).parent / "default_model"))

import corpus
import evaluate
import tokenizer as tok
from model import Config, Qwen3

MODEL_NAME = "oxibonsai-default-q1"


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", type=Path, required=True, help="corpus, tokenizer and token streams (shared)")
    p.add_argument("--out", type=Path, required=True, help="checkpoints and log of this run")
    p.add_argument("--full-precision", action="store_true", help="train without Q1_0 quantization")
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=384)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--heads", type=int, default=6)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--ffn", type=int, default=1024)
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--steps", type=int, default=720)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup", type=int, default=60)
    p.add_argument("--weight-decay", type=float, default=0.05)
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where the model trains")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--save-every", type=int, default=25)
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--resume", action="store_true")
    p.add_argument(
        "--stop-at", type=int, help="save and stop after this step (the schedule still spans --steps)"
    )
    p.add_argument(
        "--bf16", action=argparse.BooleanOptionalAction, default=True, help="bf16 autocast matmuls"
    )
    p.add_argument("--export", type=Path, help="write the trained 1-bit model to this .gguf")
    p.add_argument("--heldout", type=Path, help="write the held-out text of the CI check here")
    p.add_argument("--eval-windows", type=int, help="score only the first N held-out windows (default: all)")
    return p.parse_args()


def prepare_data(data: Path, vocab_size: int) -> None:
    """Corpus -> tokenizer (trained on training documents only) -> token streams; idempotent."""
    if (data / "heldout.npy").exists():
        return
    data.mkdir(parents=True, exist_ok=True)
    docs = corpus.all_documents()
    train_docs = [d for d in docs if not d.held_out]
    held = [d for d in docs if d.held_out]
    random.Random(0).shuffle(held)  # mix documentation and docstrings in the evaluation windows
    hf = tok.train((d.text for d in train_docs), vocab_size)
    hf.save(str(data / "tokenizer.json"))
    (data / "heldout_docs.json").write_text(json.dumps([d.text for d in held]))
    eot = hf.token_to_id(tok.ENDOFTEXT)
    for name, group in (("train", train_docs), ("heldout", held)):
        ids = [[eot, *e.ids] for e in hf.encode_batch([d.text for d in group], add_special_tokens=False)]
        np.save(data / f"{name}.npy", np.concatenate([np.array(x, dtype=np.uint16) for x in ids]))
    stats = {"train_docs": len(train_docs), "heldout_docs": len(held)}
    stats |= {"train_bytes": sum(len(d.text.encode()) for d in train_docs)}
    (data / "stats.json").write_text(json.dumps(stats))


def build_model(args: argparse.Namespace) -> Qwen3:
    cfg = Config(
        vocab_size=args.vocab_size, hidden_size=args.hidden, num_layers=args.layers, num_heads=args.heads,
        num_kv_heads=args.kv_heads, head_dim=args.hidden // args.heads, ffn_size=args.ffn,
        context_length=args.context,
    )  # fmt: skip
    torch.manual_seed(args.seed)
    model = Qwen3(cfg, quantized=not args.full_precision)
    with torch.no_grad():  # GPT-2-style: out-projections start small so the residual stream is stable
        for b in model.blocks:
            b.o.weight.mul_(1 / math.sqrt(2 * cfg.num_layers))
            b.down.weight.mul_(1 / math.sqrt(2 * cfg.num_layers))
    return model


def make_optimizer(model: Qwen3, args: argparse.Namespace) -> torch.optim.Optimizer:
    matrices = [p for p in model.parameters() if p.dim() == 2]
    vectors = [p for p in model.parameters() if p.dim() < 2]
    groups = [
        {"params": matrices, "weight_decay": args.weight_decay},
        {"params": vectors, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95), eps=1e-8)


def learning_rate(step: int, args: argparse.Namespace) -> float:
    """Linear warmup, then cosine decay to a tenth of the peak."""
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    progress = (step - args.warmup) / max(1, args.steps - args.warmup)
    return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def batch_for(step: int, stream: np.ndarray, args: argparse.Namespace) -> torch.Tensor:
    """The same random windows for a given (seed, step), so a resumed run sees the same data."""
    rng = np.random.default_rng([args.seed, step])
    starts = rng.integers(0, len(stream) - args.context - 1, size=args.batch)
    windows = np.stack([stream[s : s + args.context + 1] for s in starts]).astype(np.int64)
    return torch.from_numpy(windows).to(args.device)


def train_step(
    model: Qwen3, opt: torch.optim.Optimizer, ids: torch.Tensor, args: argparse.Namespace
) -> float:
    with torch.autocast(args.device, dtype=torch.bfloat16, enabled=args.bf16):
        logits = model(ids[:, :-1])
    loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    return loss.item()


def save_checkpoint(path: Path, model: Qwen3, opt: torch.optim.Optimizer, step: int, elapsed: float) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step, "elapsed": elapsed}, tmp)
    os.replace(tmp, path)


class Log:
    def __init__(self, path: Path) -> None:
        self.path = path

    def write(self, **entry: object) -> None:
        line = json.dumps(entry)
        print(line, flush=True)
        with self.path.open("a") as f:
            f.write(line + "\n")


def evaluation(model: Qwen3, data: Path, hf: HfTokenizer, args: argparse.Namespace) -> dict[str, float]:
    held = np.load(data / "heldout.npy").astype(np.int64)
    train = np.load(data / "train.npy").astype(np.int64)
    token_bytes = tok.token_bytes(hf)
    ci = evaluate.windows(held, args.context, args.eval_windows)
    full = evaluate.windows(held, args.context)
    return {
        "bpb_ci": evaluate.model_bits_per_byte(model, ci, token_bytes),
        "bpb_heldout": evaluate.model_bits_per_byte(model, full, token_bytes),
        "unigram_bpb_ci": evaluate.unigram_bits_per_byte(train, args.vocab_size, ci, token_bytes),
        "unigram_bpb_heldout": evaluate.unigram_bits_per_byte(train, args.vocab_size, full, token_bytes),
        "heldout_tokens": len(held),
        "eval_windows": len(ci),
    }


def write_heldout_text(path: Path, data: Path, hf: HfTokenizer, args: argparse.Namespace) -> None:
    """The held-out documents that the CI check's windows cover, each after an <|endoftext|> marker."""
    count = len(evaluate.windows(np.load(data / "heldout.npy"), args.context, args.eval_windows))
    needed = count * args.context + 1
    texts, total = [], 0
    for text in json.loads((data / "heldout_docs.json").read_text()):
        texts.append(text)
        total += 1 + len(hf.encode(text, add_special_tokens=False).ids)
        if total >= needed:
            break
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(tok.ENDOFTEXT + t for t in texts), encoding="utf-8")


def train(model: Qwen3, args: argparse.Namespace, log: Log) -> None:
    stream = np.load(args.data / "train.npy")
    opt = make_optimizer(model, args)
    ckpt = args.out / "checkpoint.pt"
    step, elapsed = 0, 0.0
    if args.resume and ckpt.exists():
        state = torch.load(ckpt, map_location=args.device)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        step, elapsed = state["step"], state["elapsed"]
        log.write(event="resume", step=step, elapsed_s=round(elapsed, 1))
    hf = HfTokenizer.from_file(str(args.data / "tokenizer.json"))
    last = min(args.steps, args.stop_at or args.steps)
    while step < last:
        t0 = time.perf_counter()
        for group in opt.param_groups:
            group["lr"] = learning_rate(step, args)
        loss = train_step(model, opt, batch_for(step, stream, args), args)
        step += 1
        dt = time.perf_counter() - t0
        elapsed += dt
        log.write(
            step=step,
            loss=round(loss, 4),
            tok_per_s=round(args.batch * args.context / dt),
            elapsed_s=round(elapsed),
        )
        if step % args.eval_every == 0 or step == args.steps:
            ev = evaluation(model, args.data, hf, args)
            log.write(event="eval", step=step, **{k: round(v, 4) for k, v in ev.items()})
        if step % args.save_every == 0 or step == last:
            save_checkpoint(ckpt, model, opt, step, elapsed)
    log.write(event="done", steps=step, run_time_s=round(elapsed), run_time_min=round(elapsed / 60, 1))


def export_model(model: Qwen3, args: argparse.Namespace) -> None:
    import export  # needs gguf, which training alone does not

    hf = HfTokenizer.from_file(str(args.data / "tokenizer.json"))
    ev = evaluation(model, args.data, hf, args)
    stats = json.loads((args.data / "stats.json").read_text())
    extra = {
        "general.description": (
            "oxibonsai's embedded default model: a small 1-bit Qwen3 trained by the project"
        ),
        "general.license": "Apache-2.0",
        "oxibonsai.training.corpus": corpus.SOURCES,
        "oxibonsai.training.corpus_license": "PSF-2.0",
        "oxibonsai.training.steps": args.steps,
        "oxibonsai.training.tokens": args.steps * args.batch * args.context,
        "oxibonsai.training.corpus_bytes": stats["train_bytes"],
        "oxibonsai.eval.window_tokens": args.context,
        "oxibonsai.eval.windows": int(ev["eval_windows"]),
        "oxibonsai.eval.bits_per_byte": ev["bpb_ci"],
        "oxibonsai.eval.unigram_bits_per_byte": ev["unigram_bpb_ci"],
    }
    export.write_gguf(args.export, model.cpu(), MODEL_NAME, tok.gguf_metadata(hf), extra)
    print(json.dumps({"exported": str(args.export), "bytes": args.export.stat().st_size, **ev}), flush=True)


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    prepare_data(args.data, args.vocab_size)
    args.out.mkdir(parents=True, exist_ok=True)
    log = Log(args.out / "log.jsonl")
    model = build_model(args).to(args.device)
    log.write(
        event="start",
        params=model.num_parameters(),
        quantized=model.quantized,
        config=model.c.to_dict(),
        args={k: str(v) for k, v in vars(args).items()},
    )
    train(model, args, log)
    hf = HfTokenizer.from_file(str(args.data / "tokenizer.json"))
    if args.heldout:
        write_heldout_text(args.heldout, args.data, hf, args)
    if args.export:
        export_model(model, args)


if __name__ == "__main__":
    main()
