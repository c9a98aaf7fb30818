#!/usr/bin/env bash
# Builds one manylinux2014 wheel for a CPython other than the one running the tests (3.12, or 3.13
# when that is the one), installs it in a fresh virtual environment of that Python, and checks it as a
# user would: `auditwheel show` reports the manylinux2014 (manylinux_2_17) policy, the CLI runs, the
# package imports from the environment (not this tree), and a smoke subset of the tests passes against
# it, again with OXIBONSAI_ISA=scalar (an x86-64 CPU without AVX2). Nothing here needs cargo at import.
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$PWD
here=$(python3 -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')
version=3.12
[ "$here" != "$version" ] || version=3.13
py=$(bash scripts/find_python.sh "$version") || { echo "wheel_smoke: CPython $version not found" >&2; exit 1; }
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

python3 -m pip install -q "maturin>=1.5,<2" ziglang auditwheel
CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-target}/dist" \
    python3 -m maturin build --release --zig --compatibility manylinux2014 -i "$py" --out "$work/dist"
wheel=$(ls "$work"/dist/oxibonsai-*.whl)
python3 -m auditwheel show "$wheel" | tee "$work/auditwheel.txt"
grep -q 'manylinux_2_17_x86_64' "$work/auditwheel.txt"

"$py" -m venv "$work/venv"
venv="$work/venv/bin"
"$venv/python" -m pip install -q --disable-pip-version-check "$wheel" pytest gguf hypothesis
cd "$work"  # away from the source tree: only the installed wheel can be imported
"$venv/python" - "$repo" <<'PY'
import sys
import oxibonsai
assert not oxibonsai.__file__.startswith(sys.argv[1]), oxibonsai.__file__
assert "site-packages" in oxibonsai.__file__, oxibonsai.__file__
print("imported", oxibonsai.__version__, "from", oxibonsai.__file__, "on", sys.version.split()[0])
PY
[ "$("$venv/oxibonsai" --version)" = "oxibonsai $("$venv/python" -c 'import oxibonsai; print(oxibonsai.__version__)')" ]
"$venv/oxibonsai" generate "The os module provides" --temperature 0 --max-tokens 8

cp -r "$repo/tests" "$work/tests"
smoke=(tests/test_q1_format.py tests/test_q1_kernels.py tests/test_gguf.py tests/test_generate.py
       tests/test_default_model.py tests/test_cli.py)
"$venv/python" -m pytest -q -p no:cacheprovider "${smoke[@]}"
# The scalar kernels take minutes over the default model's bits-per-byte corpus: that one test is left out.
OXIBONSAI_ISA=scalar "$venv/python" -m pytest -q -p no:cacheprovider -k "not bits_per_byte" "${smoke[@]}"
echo "wheel_smoke: $(basename "$wheel") passed on CPython $version"
