"""oxibonsai: fast, dependable inference for PrismML Bonsai 1-bit (Q1_0) language models.

The public API lives here; ``oxibonsai._core`` is the private native module.
"""

import os
import warnings

from oxibonsai._core import (
    GGUFError,
    GGUFFile,
    OxiBonsaiError,
    PrefixCache,
    Q1Matrix,
    QueueFull,
    __version__,
    get_num_threads,
    kernel_info,
    set_num_threads,
)
from oxibonsai.async_llm import AsyncLLM, EngineDeadError, RequestStream
from oxibonsai.beam_search import BeamSearchOutput, BeamSearchParams, BeamSearchSequence
from oxibonsai.llm import LLM
from oxibonsai.outputs import (
    CompletionOutput,
    EmbeddingOutput,
    EmbeddingRequestOutput,
    Logprob,
    RequestMetrics,
    RequestOutput,
)
from oxibonsai.rope_scaling import RopeScaling
from oxibonsai.sampling_params import SamplingParams
from oxibonsai.speculative import SpeculativeConfig
from oxibonsai.structured_output import StructuredOutputsParams
from oxibonsai.tokenizer import Tokenizer

__all__ = [
    "LLM",
    "AsyncLLM",
    "BeamSearchOutput",
    "BeamSearchParams",
    "BeamSearchSequence",
    "CompletionOutput",
    "EmbeddingOutput",
    "EmbeddingRequestOutput",
    "EngineDeadError",
    "GGUFError",
    "GGUFFile",
    "Logprob",
    "OxiBonsaiError",
    "PrefixCache",
    "Q1Matrix",
    "QueueFull",
    "RequestMetrics",
    "RequestOutput",
    "RequestStream",
    "RopeScaling",
    "SamplingParams",
    "SpeculativeConfig",
    "StructuredOutputsParams",
    "Tokenizer",
    "__version__",
    "get_num_threads",
    "kernel_info",
    "set_num_threads",
]


def _check_requested_isa() -> None:
    """Warns once, at import, when ``OXIBONSAI_ISA`` names an instruction set this CPU cannot run (the
    native side then keeps the fastest one)."""
    requested = os.environ.get("OXIBONSAI_ISA")
    if not requested:
        return  # kernel_info() would start the thread pool; nothing to check
    info = kernel_info()
    if requested != info["isa"]:
        warnings.warn(
            f"OXIBONSAI_ISA={requested!r} is not an instruction set this CPU can run "
            f"({', '.join(info['available'])}); using {info['isa']!r}",
            RuntimeWarning,
            stacklevel=2,
        )


_check_requested_isa()
