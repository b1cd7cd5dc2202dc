"""Loads the compiled extension, which registers the ``torch.ops.fp8amp`` operators and the
``torch.classes.fp8amp`` classes.

``lib`` is the operator namespace, ``classes`` the classes'; only the op layer (this package) uses
them."""

import glob
import os

import torch

# The extension is installed beside the package's top-level modules.
_HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _load() -> None:
    candidates = sorted(glob.glob(os.path.join(_HERE, "_fp8amp_ops*.so")))
    if not candidates:
        raise ImportError(
            f"fp8amp's compiled extension (_fp8amp_ops.so) is missing from {_HERE}; "
            "build and install the package with `pip install --no-build-isolation .`"
        )
    torch.ops.load_library(candidates[0])


_load()
lib = torch.ops.fp8amp
classes = torch.classes.fp8amp
