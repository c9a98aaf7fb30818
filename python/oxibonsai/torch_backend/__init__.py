"""The torch path: a Qwen3 runner over torch tensors on any torch device (CUDA, MPS or the CPU).

The Rust core plans every step (which tokens run, where their KV lives, which blocks move between the
device and host tiers); this package computes it. ``weights`` turns the GGUF's Q1_0 matrices into packed
device tensors, ``ops`` holds the kernels (plain torch reference ops on any device, Triton on CUDA),
``model`` the Qwen3 forward, ``kv_pool`` the device and host KV memory and the copies between them, and
``runner`` binds them to the core's step plans. Nothing here is imported by ``import oxibonsai``: torch is
an optional extra (``oxibonsai[torch]``)."""
