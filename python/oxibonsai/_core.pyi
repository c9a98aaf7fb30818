"""Type stubs for the native module ``oxibonsai._core`` (built from ``rust/py``)."""

from typing import Any, Literal, final

import numpy as np
import numpy.typing as npt

__all__ = [
    "GGUFError",
    "OxiBonsaiError",
    "Q1Matrix", "get_num_threads", "kernel_info", "quantize_activations", "set_num_threads"]

_Kernel = Literal["auto", "lut", "gemm", "signflip", "reference"]
_Isa = Literal["scalar", "avx2", "avx512", "neon"]

class OxiBonsaiError(Exception):
    """Base class of every oxibonsai-specific error."""

class GGUFError(OxiBonsaiError):
    """A GGUF file is malformed, truncated, or not a model oxibonsai can run."""

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
