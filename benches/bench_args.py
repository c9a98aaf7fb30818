"""The command line the small end-to-end benchmarks share: ``--rounds`` and ``--threads``."""

from __future__ import annotations

import argparse

import oxibonsai as ob


def rounds_and_threads(default_rounds: int = 5) -> int:
    """Parses ``--rounds R`` and ``--threads N`` (setting the native thread count); returns R."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=default_rounds)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    if args.threads is not None:
        ob.set_num_threads(args.threads)
    return int(args.rounds)
