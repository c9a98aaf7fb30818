#!/usr/bin/env bash
# Compiles every kernel the torch model launches (Bonsai-1.7B shapes, both Q1 arithmetics) for sm_90
# with the Triton of the lent GPU image (3.6; this machine's torch brings a newer one), failing on a
# compile error or a spill. A venv over the system packages holds that Triton alone. A kernel that
# compiles with one Triton can fail with another: 3.6 wanted `out_dtype` on the int8 dots.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/gpu_triton_venv.sh  # $venv, with Triton $version
env -u TRITON_INTERPRET TRITON_DEFAULT_FP_FUSION=1 TRITON_CACHE_DIR="$PWD/target-triton/cache-$version" \
  "$venv/bin/python" benches/gpu/sass.py --model 1.7b --batches 1 2 4 5 16 --prefill 40 --check
for kernel in gemv gemv_fixup; do  # the other one-row split GEMV forms the bench times
  env -u TRITON_INTERPRET TRITON_DEFAULT_FP_FUSION=1 TRITON_CACHE_DIR="$PWD/target-triton/cache-$version" \
    OXIBONSAI_ONE_ROW_GEMV=$kernel \
    "$venv/bin/python" benches/gpu/sass.py --model 1.7b --batches 1 --prefill 40 --q1 exact --check
done
# the decode kernel merging its own splits above 8 rows (OXIBONSAI_FUSE_MERGE=all, which the bench times)
env -u TRITON_INTERPRET TRITON_DEFAULT_FP_FUSION=1 TRITON_CACHE_DIR="$PWD/target-triton/cache-$version" \
  OXIBONSAI_FUSE_MERGE=all "$venv/bin/python" benches/gpu/sass.py --model 1.7b --batches 16 --prefill 40 --q1 exact --check
