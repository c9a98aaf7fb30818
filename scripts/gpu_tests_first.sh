# The CUDA-only test files gpu_check.sh runs first (PDL, pinned copies, graphs, the inline-PTX kernels
# against their twins, the side-stream tier copies, the kernels that count with fenced atomics);
# gpu_followup.sh runs the others. Sourced by both.
gpu_first=(tests/torch_backend/test_kv_pool.py tests/torch_backend/test_pdl.py
           tests/torch_backend/test_pending.py tests/torch_backend/test_decode_graphs.py
           tests/torch_backend/test_async_scheduling.py tests/torch_backend/test_q1_exact.py
           tests/torch_backend/test_q1_fast.py tests/torch_backend/test_attention_ops.py)
