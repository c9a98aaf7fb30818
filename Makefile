# One command surface: CI and the README call these targets.
PYTHON ?= python3

.PHONY: install build lint test test-rust test-python bench bench-model bench-prefix bench-batching bench-sched bench-serve fmt device-bundle bench-gpu-smoke dist wheel-smoke

install:
	$(PYTHON) -m pip install -e '.[test]'

build:
	$(PYTHON) -m pip install -e . --no-deps

lint:
	cargo clippy --workspace --all-targets -- -D warnings
	cargo fmt --all -- --check
	ruff check python tests benches scripts
	ruff format --check python tests benches scripts
	$(PYTHON) -m mypy.stubtest oxibonsai._core

fmt:
	cargo fmt --all
	ruff format python tests benches scripts
	ruff check --fix python tests benches scripts

test: test-rust test-python

test-rust:
	cargo test -p oxibonsai-core

# Then, on an AVX-512 machine, the model tests again on the AVX2 kernels (matmuls and attention),
# which it would otherwise never run end to end; elsewhere the first run already used them.
test-python:
	$(PYTHON) -m pytest tests
	if grep -qs avx512f /proc/cpuinfo; then \
		OXIBONSAI_ISA=avx2 $(PYTHON) -m pytest -q tests/test_model.py tests/test_reference_model.py \
			tests/test_generate.py tests/test_batching.py tests/test_prefix_generate.py; \
	else echo "no AVX-512 here: the run above used the AVX2 kernels"; fi

bench:
	$(PYTHON) -m pytest benches --benchmark-only

# End to end on a random Bonsai-1.7B-shaped GGUF, against llama.cpp when llama-cpp-python is installed.
bench-model:
	$(PYTHON) benches/bench_model.py --threads 1 2 --prompt-len 512 --decode 128 --keep

# The prefix cache: Rust trie vs the pure-Python model, then TTFT and workloads on the Bonsai-1.7B shapes.
bench-prefix:
	$(PYTHON) -m pytest benches/bench_prefix_cache.py --benchmark-only --benchmark-group-by=group
	$(PYTHON) benches/bench_prefix_ttft.py --threads 2

# Continuous batching: decode tokens/s at 1/4/16/64 concurrent requests, scheduler overhead, Poisson arrivals.
bench-batching:
	$(PYTHON) benches/bench_batching.py --threads 2

# The scheduler: one schedule()+update() cycle at 64 running requests, Rust vs the pure-Python model.
bench-sched:
	$(PYTHON) -m pytest benches/bench_scheduler.py --benchmark-only --benchmark-group-by=group

# The OpenAI server against llama-cpp-python's on the Bonsai-1.7B-shaped random model (~8 min a round;
# llama-cpp-python[server] in its own venv, --llama-python PATH; without it, ours only).
bench-serve:
	$(PYTHON) benches/bench_serve.py --threads 2

# What the lent GPU machine needs to run this tree on its CPU (Python 3.12, no Rust): see the script.
device-bundle:
	bash scripts/device_bundle.sh

# Every model kernel compiled for sm_90 with the lent GPU image's Triton (3.6), in its own venv (CI).
sass-check-gpu-triton:
	bash scripts/sass_check_gpu_triton.sh

# benches/bench_gpu.py (the lent-GPU benchmark) on the CPU with tiny shapes: checks the script runs.
bench-gpu-smoke:
	$(PYTHON) benches/bench_gpu.py --smoke --out /tmp/oxibonsai-gpu-smoke.json

# An sdist and manylinux2014 wheels for every CPython 3.10-3.13 found, into dist/.
dist:
	bash scripts/build_dist.sh

# One wheel for another CPython, installed in a fresh venv and smoke-tested there (CI runs this).
wheel-smoke:
	bash scripts/wheel_smoke.sh
