"""The ``oxibonsai`` command. Until model loading lands, ``oxibonsai demo`` runs the Q1_0 kernels."""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

from oxibonsai import Q1Matrix, get_num_threads, kernel_info


def _demo(rows: int, cols: int, repeats: int) -> int:
    rng = np.random.default_rng()
    w = rng.standard_normal((rows, cols), dtype=np.float32)
    x = rng.standard_normal(cols, dtype=np.float32)
    m = Q1Matrix.quantize(w)
    info = kernel_info()
    print(f"kernels: gemv={info['gemv']} gemm={info['gemm']} threads={get_num_threads()}")
    print(f"matrix: {m.rows}x{m.cols} Q1_0, {m.nbytes / 2**20:.2f} MiB (f32: {w.nbytes / 2**20:.1f} MiB)")
    exact = m.dequantize().astype(np.float64) @ x.astype(np.float64)
    for kernel in ("lut", "signflip", "reference"):
        y = m.matmul(x, kernel=kernel)
        start = time.perf_counter()
        for _ in range(repeats):
            m.matmul(x, kernel=kernel)
        secs = (time.perf_counter() - start) / repeats
        err = np.linalg.norm(y - exact) / np.linalg.norm(exact)
        print(f"{kernel:>9}: {secs * 1e6:9.1f} us/GEMV  {m.nbytes / secs / 1e9:6.2f} GB/s  rel.err {err:.1e}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="oxibonsai", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="quantize a random matrix and time the Q1_0 GEMV kernels")
    demo.add_argument("--rows", type=int, default=2048)
    demo.add_argument("--cols", type=int, default=2048)
    demo.add_argument("--repeats", type=int, default=200)
    args = parser.parse_args(argv)
    if args.command == "demo":
        return _demo(args.rows, args.cols, args.repeats)
    return 2


if __name__ == "__main__":
    sys.exit(main())
