#!/usr/bin/env bash
# Compiles here every kernel the GPU run's plan launches (benches/gpu/precompile.py) with the lent
# image's Triton version, keyed for that image's Python build of it (a Triton's cache key hashes its
# libtriton.so, which differs between Python builds), and packs what loading them needs into OUT
# (default .device/triton-cache.tar.gz). .device/run.sh unpacks it into the device's Triton cache,
# so the device loads these kernels instead of compiling them in its minutes (session 25: the
# precompile took 83 s of 16 cores, and the first tests were cut off compiling). On the device,
# precompile.py then says how many launches it found ("N of M launches were in the cache
# already"); another build of Triton there just compiles them as before.
#
#   bash scripts/device_triton_cache.sh [OUT]     (device_bundle.sh runs it; GPU_PYTHON_VERSION=3.12)
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-.device/triton-cache.tar.gz}
source scripts/gpu_triton_venv.sh  # $venv, with Triton $version
py=${GPU_PYTHON_VERSION:-3.12}
lib="target-triton/libtriton-$version-cp${py/./}.so"
if [ ! -f "$lib" ]; then
    wheels=$(mktemp -d)
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$py" \
        --platform manylinux_2_27_x86_64 -d "$wheels" "triton==$version"
    python3 - "$wheels"/triton-*.whl "$lib" <<'PY'
import shutil, sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as wheel, wheel.open("triton/_C/libtriton.so") as src:
    with open(sys.argv[2], "wb") as dst:
        shutil.copyfileobj(src, dst)
PY
    rm -rf "$wheels"
fi
cache="$PWD/target-triton/device-cache-$version"  # kept: a later bundle compiles only what changed
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
env -u TRITON_INTERPRET TRITON_CACHE_DIR="$cache" "$venv/bin/python" benches/gpu/precompile.py \
    --libtriton "$lib" --manifest "$work/manifest" --jobs "$(nproc)"
"$venv/bin/python" benches/gpu/triton_cache.py pack "$cache" "$work/triton-cache" --manifest "$work/manifest"
tar -czf "$out" -C "$work" triton-cache
du -h "$out"
