# Sourced: makes $venv, a venv over the system packages holding the lent GPU image's Triton
# ($version, default 3.6.0; this machine's torch brings a newer one) alone, for compiling kernels
# as the device's Triton compiles them. Used by sass_check_gpu_triton.sh and device_triton_cache.sh.
version="${GPU_TRITON_VERSION:-3.6.0}"
venv="target-triton/venv-$version"
[ -x "$venv/bin/python" ] || python3 -m venv --system-site-packages "$venv"
"$venv/bin/python" -c "import triton, sys; sys.exit(triton.__version__ != '$version')" 2>/dev/null || {
  "$venv/bin/python" -m pip install -q --disable-pip-version-check "triton==$version" 2>&1 \
    | grep -v "requires triton\|requires setuptools\|dependency resolver\|^$" || true
  "$venv/bin/python" -c "import triton; assert triton.__version__ == '$version', triton.__version__"
}
