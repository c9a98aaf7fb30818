#!/usr/bin/env bash
# Builds what a user installs without Rust: an sdist (builds from source with cargo) and manylinux2014
# (glibc >= 2.17) x86_64 wheels, one per CPython found among 3.10-3.13, into dist/; aarch64 wheels for
# the same versions when rustup has the aarch64 standard library (built, never run here: no arm64 CPython).
#
#   bash scripts/build_dist.sh                 every CPython 3.10-3.13 found (PATH, then pyenv)
#   bash scripts/build_dist.sh 3.12            only these versions
#
# Wheels are linked with zig (`ziglang` from PyPI) against glibc 2.17's symbols, so they install on any
# mainstream Linux; nothing is compiled for this machine's CPU (the kernels dispatch at run time).
# Each wheel holds the native core, the type stubs and the embedded default model.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q "maturin>=1.5,<2" ziglang
versions=("$@")
[ ${#versions[@]} -gt 0 ] || versions=(3.10 3.11 3.12 3.13)
out=dist
mkdir -p "$out"
built=0
for v in "${versions[@]}"; do
    py=$(bash scripts/find_python.sh "$v" || true)
    if [ -z "$py" ]; then
        echo "build_dist: no CPython $v found; skipping its wheel" >&2
        continue
    fi
    CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-target}/dist" \
        python3 -m maturin build --release --zig --compatibility manylinux2014 -i "$py" --out "$out"
    built=$((built + 1))
    # aarch64 too where rustup has its standard library (`rustup target add aarch64-unknown-linux-gnu`):
    # zig links it; maturin supplies the target interpreter's configuration by version.
    if rustup target list --installed 2>/dev/null | grep -q '^aarch64-unknown-linux-gnu$'; then
        CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-target}/dist-aarch64" python3 -m maturin build --release --zig \
            --target aarch64-unknown-linux-gnu --compatibility manylinux2014 -i "python$v" --out "$out"
    fi
done
python3 -m maturin sdist --out "$out"
[ "$built" -gt 0 ] || { echo "build_dist: no wheel was built" >&2; exit 1; }
ls -l "$out"
