#!/usr/bin/env bash
# Builds what the lent GPU machine (`device` in the tool library) needs to run this tree's Python
# package, tests and kernel examples on its CPU: that machine has Python 3.12 with numpy (and torch)
# but no Rust, no network and none of our other dependencies.
#
# Writes .device/ (git-ignored, well under the 64 MiB a run may carry):
#   _core.cpython-312-x86_64-linux-gnu.so   the extension, built for CPython 3.12 without an interpreter
#   site/                                   unzipped cp312/abi3 wheels: tokenizers, jinja2, llguidance, gguf, pytest, ...
#   tests/<name>                            the Rust core's test binaries (release)
#   examples/<name>                         gemm_speed and gemv_speed
#   triton-cache.tar.gz                     the run's Triton kernels, compiled for the device's Triton
#                                           (scripts/device_triton_cache.sh; DEVICE_TRITON_CACHE=0: none)
#   run.sh                                  sets up the package there, then runs its arguments
#
# Then, with the device tool: run(carry=[".device"], command="bash .device/run.sh python3 -m pytest -q tests")
# or command="bash .device/run.sh .device/examples/gemm_speed 6144 2048 2 16".
set -euo pipefail
cd "$(dirname "$0")/.."
out=.device
rm -rf "$out" && mkdir -p "$out/site" "$out/tests" "$out/examples" "$out/wheels"
target=${CARGO_TARGET_DIR:-target}

# The extension: PyO3 reads the interpreter's configuration from this file instead of running one.
cat > "$out/pyo3-3.12.cfg" <<'EOF'
implementation=CPython
version=3.12
shared=true
abi3=false
lib_name=python3.12
pointer_width=64
build_flags=
suppress_build_script_link_lines=false
EOF
PYO3_CONFIG_FILE="$PWD/$out/pyo3-3.12.cfg" CARGO_TARGET_DIR="$target/device-cp312" \
    cargo build --release -p oxibonsai-py --features pyo3/extension-module
cp "$target/device-cp312/release/lib_core.so" "$out/_core.cpython-312-x86_64-linux-gnu.so"

# Pure-Python and abi3 dependencies, no more (numpy is already there; --no-deps keeps tokenizers'
# Hub client and its friends out of the 64 MiB).
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 \
    --platform manylinux_2_31_x86_64 \
    -d "$out/wheels" tokenizers jinja2 markupsafe gguf pyyaml tqdm llguidance \
    pytest pluggy iniconfig packaging pygments hypothesis sortedcontainers pytest-benchmark py-cpuinfo \
    pytest-xdist execnet
for wheel in "$out"/wheels/*.whl; do
    case "$(basename "$wheel")" in numpy-*) ;; *) python3 -m zipfile -e "$wheel" "$out/site" ;; esac
done
rm -rf "$out/wheels"

# The Rust core's test binaries and the kernel examples.
cargo test --release -p oxibonsai-core --no-run --message-format=json 2>/dev/null | python3 -c '
import json, shutil, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["profile"]["test"]:
        shutil.copy(m["executable"], sys.argv[1] + "/tests/" + m["target"]["name"])
' "$out"
cargo build --release -p oxibonsai-core --example gemm_speed --example gemv_speed
cp "$target/release/examples/gemm_speed" "$target/release/examples/gemv_speed" "$out/examples/"

[ "${DEVICE_TRITON_CACHE:-1}" = 0 ] || bash scripts/device_triton_cache.sh "$out/triton-cache.tar.gz"

cat > "$out/run.sh" <<'EOF'
#!/usr/bin/env bash
# On the device: puts the 3.12 extension into the package, the carried wheels on the path and the
# carried kernels into Triton's cache, then runs "$@".
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
cp "$here/_core.cpython-312-x86_64-linux-gnu.so" "$here/../python/oxibonsai/"
export PYTHONPATH="$here/site:$here/../python${PYTHONPATH:+:$PYTHONPATH}"
if [ -f "$here/triton-cache.tar.gz" ]; then
    carried=$(mktemp -d)
    tar -xzf "$here/triton-cache.tar.gz" -C "$carried"
    python3 "$here/../benches/gpu/triton_cache.py" unpack "$carried/triton-cache" || true
    rm -rf "$carried"
fi
exec "$@"
EOF
chmod +x "$out/run.sh"
du -sh "$out"
