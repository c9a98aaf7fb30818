"""The pieces of ``benches/bench_gpu.py``, the one command for a lent GPU, by concern.

``plan`` holds the shapes and sizes of a GPU run and of the CPU smoke run; ``timing`` the clock (wall,
CUDA events, CUDA graphs), the time budget, the guard that turns one case's error into a record, and
the probe section (versions, device, copy GB/s); ``q1`` random ``Q1Weight``s and the Triton
``q1_linear`` section; ``models`` random Qwen3 weights and the decode/prefill section; ``tier`` the
host-tier section (promote copies, TTFT through the engine); ``report`` the JSON file and the summary
table. ``bench_gpu.py`` parses the flags and runs the sections in order.

Nothing here imports a Triton kernel module at import time: ``bench_gpu.main`` sets (or clears)
``TRITON_INTERPRET`` first, and ``q1`` imports ``q1_triton`` only when its section runs.
"""
