"""Kernels of the torch path, one op per module with its plain-torch reference beside it:
``ref_torch`` (any device; the test oracle and the CPU/MPS path), Triton twins for CUDA (``q1_triton``,
``attn_triton``, ``kv_triton``, ``norm_triton``; all run under ``TRITON_INTERPRET=1``) and ``dispatch``,
which picks the set for a device."""
