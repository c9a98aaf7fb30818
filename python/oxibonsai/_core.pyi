"""Type stubs for the native module ``oxibonsai._core`` (built from ``rust/py``)."""

import os
from typing import Any, Literal, TypedDict, final

import numpy as np
import numpy.typing as npt

__all__ = [
    "GGUFError",
    "GGUFFile",
    "OxiBonsaiError",
    "Q1Matrix",
    "get_num_threads",
    "kernel_info",
    "quantize_activations",
    "set_num_threads",
]

_Kernel = Literal["auto", "lut", "gemm", "signflip", "reference"]
_Isa = Literal["scalar", "avx2", "avx512", "neon"]

class OxiBonsaiError(Exception):
    """Base class of every oxibonsai-specific error."""

class GGUFError(OxiBonsaiError):
    """A GGUF file is malformed, truncated, or not a model oxibonsai can run."""

class _TensorInfo(TypedDict):
    name: str
    shape: tuple[int, ...]
    dims: tuple[int, ...]
    type: str
    offset: int
    nbytes: int

@final
class GGUFFile:
    """A GGUF file, memory-mapped read-only and validated on open."""

    def __new__(cls, path: str | os.PathLike[str]) -> GGUFFile: ...
    @property
    def version(self) -> int: ...
    @property
    def alignment(self) -> int: ...
    @property
    def data_offset(self) -> int: ...
    @property
    def path(self) -> str: ...
    @property
    def metadata(self) -> dict[str, Any]: ...
    def tensor_names(self) -> list[str]: ...
    def tensor_info(self, name: str) -> _TensorInfo: ...
    def tensors(self) -> list[_TensorInfo]: ...
    def tensor_bytes(self, name: str) -> npt.NDArray[np.uint8]: ...

@final
class Q1Matrix:
    """A Q1_0 weight matrix: 128 weights per block, one fp16 scale, one sign bit per weight."""

    @staticmethod
    def quantize(w: npt.NDArray[np.float32]) -> Q1Matrix: ...
    @staticmethod
    def from_bytes(buf: Any, rows: int, cols: int) -> Q1Matrix: ...
    def to_bytes(self) -> bytes: ...
    def dequantize(self) -> npt.NDArray[np.float32]: ...
    def matmul(
        self, x: npt.NDArray[np.float32], kernel: _Kernel = "auto", isa: _Isa | None = None
    ) -> npt.NDArray[np.float32]: ...
    @property
    def rows(self) -> int: ...
    @property
    def cols(self) -> int: ...
    @property
    def nbytes(self) -> int: ...
    @property
    def shape(self) -> tuple[int, int]: ...

def quantize_activations(
    x: npt.NDArray[np.float32], isa: _Isa | None = None
) -> tuple[npt.NDArray[np.int8], npt.NDArray[np.float32]]: ...
def set_num_threads(n: int) -> None: ...
def get_num_threads() -> int: ...
def kernel_info() -> dict[str, Any]: ...
