"""oxibonsai: fast, dependable inference for PrismML Bonsai 1-bit (Q1_0) language models.

The public API lives here; ``oxibonsai._core`` is the private native module.
"""

from oxibonsai._core import (
    GGUFError,
    GGUFFile,
    OxiBonsaiError,
    Q1Matrix,
    get_num_threads,
    kernel_info,
    set_num_threads,
)

__all__ = [
    "GGUFError",
    "GGUFFile",
    "OxiBonsaiError",
    "Q1Matrix",
    "get_num_threads",
    "kernel_info",
    "set_num_threads",
]
