"""fp8amp: FP8 automatic mixed-precision training for PyTorch, with a C++/CUDA core."""

from ._library import ops

__all__ = ["ops"]
__version__ = "0.1.0"
