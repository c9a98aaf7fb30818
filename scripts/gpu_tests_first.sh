# The CUDA-only tests gpu_check.sh runs first (PDL, pinned copies, graphs, the inline-PTX kernels
# against their twins, the side-stream tier copies, the kernels that count with fenced atomics or
# write K/V before reading it: those first, as the interpreter runs programs one at a time and
# cannot show a race); gpu_followup.sh runs the other files, whole. Sourced by both. An entry is a
# test file or a pytest node id.
gpu_first=(tests/torch_backend/test_attention_ops.py::test_the_decode_kernels_own_merge_gives_the_merge_launchs_bits
           tests/torch_backend/test_attention_ops.py::test_the_decode_kernel_does_the_qk_norm_rope_and_kv_write_with_their_launchs_bits
           tests/torch_backend/test_q1_exact.py tests/torch_backend/test_kv_pool.py
           tests/torch_backend/test_pdl.py tests/torch_backend/test_pending.py
           tests/torch_backend/test_decode_graphs.py tests/torch_backend/test_async_scheduling.py
           tests/torch_backend/test_q1_fast.py)
