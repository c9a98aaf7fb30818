"""The command line the small end-to-end benchmarks share: ``--rounds``, ``--threads``, ``--model``."""

from __future__ import annotations

import argparse

import oxibonsai as ob


def parse(default_rounds: int = 5, *, model: bool = False) -> argparse.Namespace:
    """Parses ``--rounds R`` and ``--threads N`` (setting the native thread count), and with ``model``
    ``--model PATH`` (default None: the embedded model)."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=default_rounds)
    ap.add_argument("--threads", type=int, default=None)
    if model:
        ap.add_argument("--model", default=None)
    args = ap.parse_args()
    if args.threads is not None:
        ob.set_num_threads(args.threads)
    return args


def rounds_and_threads(default_rounds: int = 5) -> int:
    """``parse`` for a benchmark that takes only ``--rounds`` and ``--threads``; returns the rounds."""
    return int(parse(default_rounds).rounds)
