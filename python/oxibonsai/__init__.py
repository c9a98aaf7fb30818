"""oxibonsai: fast, dependable inference for PrismML Bonsai 1-bit (Q1_0) language models.

The public API lives here; ``oxibonsai._core`` is the private native module.
"""

from oxibonsai._core import (
    GGUFError,
    OxiBonsaiError,
    Q1Matrix,
    get_num_threads,
    kernel_info,
    set_num_threads,
)
from oxibonsai.sampling_params import SamplingParams

__all__ = [
    "GGUFError",
    "OxiBonsaiError",
    "Q1Matrix",
    "SamplingParams",
    "get_num_threads",
    "kernel_info",
    "set_num_threads",
]
