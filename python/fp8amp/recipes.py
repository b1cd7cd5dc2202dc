"""Scaling recipes: how finely an Fp8Linear's FP8 operands are scaled (docs/tiles.md#recipes).

``"tensorwise"`` gives each operand one scale (delayed scaling of the input and the output
gradient, current scaling of the weight): the fastest recipe, and the default. ``"rowwise"`` and
``"blockwise"`` give each tile its own current scale, so that one outlier row coarsens only its
own tiles; ``"mxfp8"`` is OCP Microscaling (1 x 32 blocks with E8M0 power-of-two scales), whose
GEMM needs a Blackwell GPU (docs/tiles.md#mxfp8). :func:`resolve_recipe` turns what a user passes
as ``recipe=`` into a :class:`Recipe`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

import torch

from .formats import E4M3, E5M2, HIGH_PRECISION_DTYPES
from .scaling import ScalingRecipe

__all__ = ["Recipe", "RECIPES", "resolve_recipe"]

#: The accepted recipe names.
RECIPES = ("tensorwise", "rowwise", "blockwise", "mxfp8")

#: The side of blockwise's tiles: 1 x 128 for inputs and gradients, 128 x 128 for weights.
BLOCK = 128

#: The elements of an MXFP8 block (1 x 32, along every GEMM's contraction).
MX_BLOCK = 32

# The compute capability whose cuBLASLt offers the MXFP8 GEMM (Blackwell).
_MX_CAPABILITY = (10, 0)

# The multiple cuBLASLt's FP8 GEMMs need of every inner dimension.
_GEMM_ALIGN = 16


@dataclass(frozen=True)
class Recipe:
    """How an :class:`~fp8amp.Fp8Linear` scales its FP8 operands.

    Attributes:
        kind: ``"tensorwise"`` (one scale per tensor: delayed scaling of the input and output
            gradient, current scaling of the weight; the default), ``"rowwise"`` (one current
            scale per row of each GEMM operand, the row running along the GEMM's contraction) or
            ``"blockwise"`` (current scales per 1 x 128 tile of the input and output gradient and
            per 128 x 128 block of the weight, FP32 scales) or ``"mxfp8"`` (OCP MX: an E8M0
            power-of-two scale per 1 x 32 block of every GEMM operand along its contraction;
            CPU emulation or a Blackwell GPU).
        grad_format: the output gradient's format, E4M3 or E5M2. None (default): E5M2 for
            ``"tensorwise"`` (its delayed scale needs the range), E4M3 for the tiled recipes
            (each tile's own scale gives the range, E4M3 the precision).
        margin: scales are divided by ``2^margin`` (headroom). ``"mxfp8"`` takes 0 only (its
            E8M0 scale rule is fixed: docs/tiles.md#mxfp8).
        pow2_scale: power-of-two scales (exact ``scale_inv``), as :class:`~fp8amp.ScalingRecipe`.
            ``"mxfp8"`` takes True only (E8M0 scales are powers of two).
        history_len: the delayed-scaling history of ``"tensorwise"`` (the tiled recipes scale
            every tile from its current amax and keep no history).

    Inputs and weights are E4M3 in every recipe.
    """

    kind: str = "tensorwise"
    grad_format: Optional[torch.dtype] = None
    margin: int = 0
    pow2_scale: bool = True
    history_len: int = 16

    def __post_init__(self) -> None:
        if not isinstance(self.kind, str) or self.kind not in RECIPES:
            raise ValueError(f"fp8amp.Recipe: kind must be one of {_names()}; got {self.kind!r}")
        if self.grad_format is None:
            object.__setattr__(self, "grad_format", E5M2 if self.kind == "tensorwise" else E4M3)
        elif self.grad_format not in (E4M3, E5M2):
            raise ValueError(f"fp8amp.Recipe: grad_format must be torch.float8_e4m3fn or torch.float8_e5m2 (or None); "
                             f"got {self.grad_format!r}")
        ScalingRecipe(self.history_len, self.margin, self.pow2_scale)  # checks the three, naming them
        if self.kind == "mxfp8" and (self.margin != 0 or not self.pow2_scale):
            raise ValueError(f"fp8amp.Recipe: kind 'mxfp8' has a fixed E8M0 scale rule: margin must be 0 and "
                             f"pow2_scale True; got margin={self.margin}, pow2_scale={self.pow2_scale}")

    @property
    def scaling(self) -> ScalingRecipe:
        """The scale rule (and tensorwise's history) as the scaling states take it."""
        return ScalingRecipe(self.history_len, self.margin, self.pow2_scale)

    @property
    def tiled(self) -> bool:
        """Whether scales are per tile (rowwise, blockwise) rather than per tensor."""
        return self.kind != "tensorwise"

    @property
    def feature_multiple(self) -> int:
        """What in_features and out_features must be multiples of: 128 for blockwise (whole
        weight blocks), 32 for mxfp8 (whole MX blocks along both GEMM contractions of the
        weight), 16 otherwise (cuBLASLt's FP8 rule)."""
        return {"blockwise": BLOCK, "mxfp8": MX_BLOCK}.get(self.kind, _GEMM_ALIGN)

    @property
    def token_multiple(self) -> int:
        """What the token count is padded to with zero rows (they change no gradient): the
        weight-gradient GEMM contracts over the tokens, in whole 1 x 128 tiles for blockwise
        and whole 1 x 32 blocks for mxfp8."""
        return self.feature_multiple

    def unsupported_reason(self, in_features: int, out_features: int,
                           dtype: Optional[torch.dtype] = None) -> Optional[str]:
        """Why a Linear of this shape (and weight ``dtype``, if given) cannot run under this recipe
        (None: it can)."""
        def multiples(m: int) -> bool:
            return in_features > 0 and out_features > 0 and in_features % m == 0 and out_features % m == 0

        if dtype is not None and dtype not in HIGH_PRECISION_DTYPES:
            return (f"weight dtype {dtype} (the FP8 casts read "
                    f"{', '.join(str(d).removeprefix('torch.') for d in HIGH_PRECISION_DTYPES)})")
        if not multiples(_GEMM_ALIGN):
            return f"in/out features not multiples of {_GEMM_ALIGN} (cuBLASLt FP8)"
        if not multiples(self.feature_multiple):
            if self.kind == "mxfp8":
                return f"in/out features not multiples of {MX_BLOCK} (mxfp8 recipe: 1 x 32 blocks)"
            return f"in/out features not multiples of {BLOCK} (blockwise recipe: 128 x 128 weight blocks)"
        return None

    def check_device(self, device: Union[None, str, torch.device], caller: str) -> None:
        """Refuses (NotImplementedError) a recipe the device cannot run: mxfp8 on a CUDA GPU below
        Blackwell (its GEMM is cuBLASLt's, sm_100+). The CPU runs every recipe (mxfp8 in FP8
        emulation through the CPU reference). ``device`` None: torch's default device."""
        if self.kind != "mxfp8":
            return
        device = torch.empty(0).device if device is None else torch.device(device)
        if device.type != "cuda":
            return
        major, minor = torch.cuda.get_device_capability(device)
        if (major, minor) < _MX_CAPABILITY:
            raise NotImplementedError(f"{caller}: mxfp8 needs a Blackwell GPU (sm_100+); this GPU is sm_{major}{minor}: "
                                      f"use recipe='blockwise'")

    def __str__(self) -> str:
        grad = "e4m3" if self.grad_format == E4M3 else "e5m2"
        return f"{self.kind} (e4m3/{grad})"


def _names() -> str:
    return ", ".join(map(repr, RECIPES))


def resolve_recipe(recipe: Union[None, str, Recipe, ScalingRecipe], caller: str) -> Recipe:
    """The :class:`Recipe` that ``recipe=`` names: None (tensorwise), one of :data:`RECIPES`, a
    Recipe, or a :class:`~fp8amp.ScalingRecipe` (tensorwise with that history, margin and rule).
    ``caller`` names the function in the errors."""
    if recipe is None:
        return Recipe()
    if isinstance(recipe, Recipe):
        return recipe
    if isinstance(recipe, ScalingRecipe):
        return Recipe("tensorwise", margin=recipe.margin, pow2_scale=recipe.pow2_scale,
                      history_len=recipe.history_len)
    if isinstance(recipe, str):
        if recipe not in RECIPES:
            raise ValueError(f"{caller}: recipe must be one of {_names()} (or an fp8amp.Recipe); got {recipe!r}")
        return Recipe(recipe)
    raise TypeError(f"{caller}: recipe must be one of {_names()}, an fp8amp.Recipe or an fp8amp.ScalingRecipe; "
                    f"got {type(recipe).__name__}")
