#!/usr/bin/env bash
# The second device command of a GPU session, run right after scripts/gpu_check.sh while the machine
# is still warm (it goes back after 30 s idle) and its Triton cache still holds what the first
# command compiled: the bench sections the first run did not reach (its gpu.json is not carried
# back, so name them), then the torch suite's files that gpu_check.sh does not run first, in 8
# processes, verbose (a run cut off by the time limit keeps every result before it).
#
#   run(carry=[".device"], timeout_s=LEFT, command="bash .device/run.sh bash scripts/gpu_followup.sh SECONDS [SECTION...]")
# SECONDS: what the two parts may take together; SECTIONs: bench_gpu.py's (e.g. q1 tier), none to skip it.
set -uo pipefail
cd "$(dirname "$0")/.."
total=${1:-240}
shift || true
out=${OUT:-/tmp/oxibonsai-gpu-followup}
mkdir -p "$out"
start=$SECONDS
if (($#)); then
    bench_s=$((total / 2))
    echo "[0 s] bench sections $* (at most $((bench_s + 30))s)"
    tuned=()  # gpu_check.sh's q1 sweep's table, for the decode section's tuned graphs
    [ -f /tmp/oxibonsai-gpu.tuned.json ] && tuned=(--tuned /tmp/oxibonsai-gpu.tuned.json)
    timeout --kill-after=10 $((bench_s + 30)) python3 benches/bench_gpu.py --sections "$@" "${tuned[@]}" \
        --budget-s "$bench_s" --out "$out/gpu-followup.json" >"$out/bench.log" 2>&1
    echo "bench: exit $? after $((SECONDS - start)) s"
    tail -n 30 "$out/bench.log"
fi
source scripts/gpu_tests_first.sh  # gpu_first: the files gpu_check.sh ran
rest=()
for file in tests/torch_backend/test_*.py; do
    [[ " ${gpu_first[*]} " == *" $file "* ]] || rest+=("$file")
done
workers=()
python3 -c "import xdist" 2>/dev/null && workers=(-n 8)
left=$((total - (SECONDS - start) - 5))
echo "[$((SECONDS - start)) s] torch suite, ${#rest[@]} files (at most ${left}s)"
timeout --kill-after=5 "$left" python3 -m pytest -v -rs --tb=short -p no:cacheprovider "${workers[@]}" \
    "${rest[@]}" >"$out/tests.log" 2>&1
echo "tests: exit $? after $((SECONDS - start)) s"
grep -E "(FAILED|ERROR)" "$out/tests.log" | head -n 30
grep -cE "PASSED" "$out/tests.log" | sed 's/$/ passed/'
tail -n 2 "$out/tests.log"
