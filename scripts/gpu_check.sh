#!/usr/bin/env bash
# The whole GPU check in one device command, sized to the device time a session gets (15 minutes,
# start-up included; one command at most 10): the bench's Triton kernels compiled on every core
# (benches/gpu/precompile.py, into Triton's cache), the CUDA-only tests (PDL, pinned copies, graphs,
# the inline-PTX kernels against their twins, the side-stream tier copies: a minute or two), then
# benches/bench_gpu.py within a budget (every figure of issue 23 and its correctness flags), then the
# whole torch test suite on the GPU with what is left. Each part writes its log (and the bench its JSON)
# under $OUT; the summary at the end (what the device tool's output_tail shows) gives each part's exit
# status, the bench's table and the tests' last lines.
#
# Here: bash scripts/device_bundle.sh
# Then, with the device tool:
#   run(carry=[".device"], timeout_s=560, command="bash .device/run.sh bash scripts/gpu_check.sh 520")
# Its argument is the seconds the three parts may take together (default 520).
set -uo pipefail
cd "$(dirname "$0")/.."
total=${1:-520}
out=${OUT:-/tmp/oxibonsai-gpu-check}
mkdir -p "$out"
start=$SECONDS
left() { echo $((total - (SECONDS - start))); }
status=()

part() {  # part NAME SECONDS COMMAND...: runs COMMAND under a timeout, its output to $out/NAME.log
    local name=$1 seconds=$2
    shift 2
    if ((seconds < 20)); then
        status+=("$name: skipped (${seconds}s left)")
        return
    fi
    echo "[$((SECONDS - start)) s] $name (at most ${seconds}s)"
    timeout --kill-after=10 "$seconds" "$@" >"$out/$name.log" 2>&1
    status+=("$name: exit $? after $((SECONDS - start)) s")
}

gpu_only=(tests/torch_backend/test_pdl.py tests/torch_backend/test_pending.py
          tests/torch_backend/test_decode_graphs.py tests/torch_backend/test_async_scheduling.py
          tests/torch_backend/test_q1_exact.py tests/torch_backend/test_q1_fast.py
          tests/torch_backend/test_kv_pool.py)
cache_entries() { ls "${TRITON_CACHE_DIR:-$HOME/.triton/cache}" 2>/dev/null | wc -l; }
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv >"$out/nvidia-smi.txt" 2>&1
part precompile 150 python3 benches/gpu/precompile.py
entries=("triton cache entries: $(cache_entries) after precompiling")
part tests-cuda-first 150 python3 -m pytest -q -rs -p no:cacheprovider "${gpu_only[@]}"
bench_s=$(( $(left) * 70 / 100 ))
entries+=("$(cache_entries) before the bench")
part bench $((bench_s + 60)) python3 benches/bench_gpu.py --budget-s "$bench_s" --out "$out/gpu.json"
entries+=("$(cache_entries) after it (new ones: kernels the run compiled itself)")
workers=()  # the torch suite in 8 processes where pytest-xdist came along: its time is mostly compiling
python3 -c "import xdist" 2>/dev/null && workers=(-n 8)
part tests-torch "$(( $(left) - 10 ))" python3 -m pytest -q -rs -p no:cacheprovider "${workers[@]}" tests/torch_backend

echo "== summary"
cat "$out/nvidia-smi.txt"
printf '%s\n' "${status[@]}"
printf '%s; ' "${entries[@]}"; echo
tail -n 2 "$out/precompile.log" 2>/dev/null
echo "== bench"
tail -n 40 "$out/bench.log" 2>/dev/null
for name in tests-cuda-first tests-torch; do
    echo "== $name"
    grep -E "^(FAILED|ERROR)" "$out/$name.log" 2>/dev/null | head -n 20
    tail -n 3 "$out/$name.log" 2>/dev/null
done
