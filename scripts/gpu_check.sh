#!/usr/bin/env bash
# The first GPU command of a session, sized to the device time a session gets (15 minutes, start-up
# included; one command at most 10): the bench's Triton kernels found in the cache .device carried
# (compiled on every core where not: benches/gpu/precompile.py) beside the CUDA-first tests (PDL,
# pinned copies, graphs, the inline-PTX kernels against their twins, the side-stream tier copies), then
# benches/bench_gpu.py with the rest of the time (every figure of issue 23 and its correctness
# flags). The rest of the torch suite, and any bench section this one did not reach, go in a second
# command right after, while the machine is warm (scripts/gpu_followup.sh). Each part writes its log
# (and the bench its JSON) under $OUT; the summary at the end (what the device tool's output_tail
# shows) gives each part's exit status, the bench's table and the tests' failures and counts.
#
# Here: bash scripts/device_bundle.sh
# Then, with the device tool:
#   run(carry=[".device"], timeout_s=560, command="bash .device/run.sh bash scripts/gpu_check.sh 520")
# Its argument is the seconds the parts may take together (default 520; the first phase gets 29%).
# Then at once: run(..., command="bash .device/run.sh bash scripts/gpu_followup.sh SECONDS [SECTION...]").
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

source scripts/gpu_tests_first.sh  # gpu_first: the CUDA-first test files
cache_entries() { ls "${TRITON_CACHE_DIR:-$HOME/.triton/cache}" 2>/dev/null | wc -l; }
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv >"$out/nvidia-smi.txt" 2>&1
# the Triton here, for the carried kernels' keys (scripts/device_triton_cache.sh keys them for a build)
python3 -c "import triton; print('triton', triton.__version__, triton.__file__)" >>"$out/nvidia-smi.txt" 2>&1
sha256sum "$(python3 -c 'import triton, os; print(os.path.dirname(triton.__file__))')/_C/libtriton.so" \
    >>"$out/nvidia-smi.txt" 2>&1

# The precompile (all cores; with the kernels .device carried, a check that they are in the cache)
# and the CUDA-first tests (compiling their own kernels, a whole file's in 4 processes) side by side:
# neither is timed. One pytest per file, verbose, so a file cut off by the time limit still leaves
# every result before it and each finished file its failures' tracebacks.
workers=()
python3 -c "import xdist" 2>/dev/null && workers=(-n 4)
first=$((total * 29 / 100))  # 150 s of 520
echo "[0 s] precompile beside the CUDA-first tests (at most ${first}s)"
( timeout --kill-after=10 "$first" python3 benches/gpu/precompile.py --launchers >"$out/precompile.log" 2>&1
  echo "precompile: exit $? after $((SECONDS - start)) s" >"$out/precompile.status" ) &
precompiling=$!
for file in "${gpu_first[@]}"; do
    budget=$((first - (SECONDS - start)))
    if ((budget < 10)); then
        echo "$file: not run (time)" >>"$out/tests-cuda-first.log"
        continue
    fi
    split=("${workers[@]}")
    [[ $file == *::* ]] && split=()  # one test: no processes to start
    timeout --kill-after=5 "$budget" python3 -m pytest -v -rs --tb=short -p no:cacheprovider "${split[@]}" "$file" \
        >>"$out/tests-cuda-first.log" 2>&1
    printf '\n%s: exit %s\n' "$file" "$?" >>"$out/tests-cuda-first.log"  # after a line cut short
done
status+=("tests-cuda-first: after $((SECONDS - start)) s")
wait "$precompiling"
status+=("$(cat "$out/precompile.status" 2>/dev/null || echo 'precompile: no status')")
entries=("triton cache entries: $(cache_entries) before the bench")
bench_s=$(( $(left) - 45 ))  # its budget: sections start only within it; the timeout allows one more
part bench $((bench_s + 40)) python3 benches/bench_gpu.py --budget-s "$bench_s" --out "$out/gpu.json"
# the q1 sweep's tuned table (gpu.tuned.json, if a form beat the defaults), for gpu_followup.sh's bench
cp "$out/gpu.tuned.json" /tmp/oxibonsai-gpu.tuned.json 2>/dev/null || true
entries+=("$(cache_entries) after it (new ones: kernels the run compiled itself)")

echo "== summary"
cat "$out/nvidia-smi.txt"
printf '%s\n' "${status[@]}"
printf '%s; ' "${entries[@]}"; echo
tail -n 3 "$out/precompile.log" 2>/dev/null
echo "== bench"
tail -n 40 "$out/bench.log" 2>/dev/null
for name in tests-cuda-first; do
    echo "== $name"
    grep -E "(FAILED|ERROR)|: exit |not run" "$out/$name.log" 2>/dev/null | head -n 30
    grep -cE "PASSED" "$out/$name.log" 2>/dev/null | sed 's/$/ passed/'
    tail -n 2 "$out/$name.log" 2>/dev/null
done
