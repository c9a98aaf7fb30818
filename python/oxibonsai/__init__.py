"""oxibonsai: fast, dependable inference for PrismML Bonsai 1-bit (Q1_0) language models.

The public API lives here; ``oxibonsai._core`` is the private native module.
"""

from oxibonsai._core import (
    GGUFError,
    GGUFFile,
    OxiBonsaiError,
    PrefixCache,
    Q1Matrix,
    QueueFull,
    get_num_threads,
    kernel_info,
    set_num_threads,
)
from oxibonsai.async_llm import AsyncLLM, EngineDeadError, RequestStream
from oxibonsai.llm import LLM
from oxibonsai.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from oxibonsai.sampling_params import SamplingParams
from oxibonsai.tokenizer import Tokenizer

__all__ = [
    "LLM",
    "AsyncLLM",
    "CompletionOutput",
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
    "SamplingParams",
    "Tokenizer",
    "get_num_threads",
    "kernel_info",
    "set_num_threads",
]
