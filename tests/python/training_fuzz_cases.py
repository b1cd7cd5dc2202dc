"""The cases of test_training_fuzz.py and its reference: the test's own FP8 quantizer (the scale
rules, tiles and E8M0 blocks of docs/numerics.md and docs/tiles.md), the models and the draw."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

import fp8amp
from fp8amp import E4M3, E5M2

DIMS = (1, 3, 15, 16, 17, 31, 32, 33, 48, 64, 96, 127, 128, 129, 130, 256, 384)
TOKENS = (1, 3, 15, 17, 31, 33, 127, 129, 130)
AUTOCAST = (None, torch.bfloat16, torch.float16)
FMAX = {E4M3: 448.0, E5M2: 57344.0}
FMAX_LOG2 = {E4M3: 8, E5M2: 15}


# ---------------------------------------------------------------- the reference quantizer

def _scale(amax: torch.Tensor, fmax: float, margin: int, pow2: bool) -> torch.Tensor:
    """The float32 scale of an amax by ScalingRecipe's rule (docs/numerics.md#scales): by default
    ``2^(floor(log2(fl32(fmax / amax))) - margin)``, the exponent clamped to [-126, 126]; with
    ``pow2=False`` ``fl32(fmax / amax) 2^-margin``, FLT_MAX where that overflows. 1 for an
    amax of 0 (a non-finite amax is the caller's)."""
    amax = amax.float()
    q = torch.tensor(fmax, dtype=torch.float32) / amax
    if pow2:
        e = torch.where(torch.isinf(q), 128, torch.frexp(q).exponent - 1) - margin  # inf: its exponent bits
        scale = torch.ldexp(torch.ones_like(q), e.clamp(-126, 126))
    else:
        scale = q * 2.0 ** -margin
        scale = torch.where(torch.isinf(scale), torch.finfo(torch.float32).max, scale)
    return torch.where(amax > 0, scale, torch.ones_like(scale))


def _e8m0_scale(amax: torch.Tensor, fmt) -> torch.Tensor:
    """MXFP8's multiplier ``2^-e``: e the smallest >= -127 with ``amax 2^-e <= fmax``; 1 for 0."""
    amax64 = amax.double()
    e = (torch.frexp(amax.float()).exponent - 1) - FMAX_LOG2[fmt]
    e = torch.where(torch.ldexp(amax64, -e) > FMAX[fmt], e + 1, e).clamp(min=-127)
    scale = torch.ldexp(torch.ones_like(amax64), -e)
    return torch.where(amax64 > 0, scale, torch.ones_like(scale))


def fake_quant(t: torch.Tensor, fmt, tile, *, mx: bool = False, amax: torch.Tensor | None = None,
               margin: int = 0, pow2: bool = True):
    """``(real, scale_inv)`` of the 2-D float64 ``t`` quantized to ``fmt`` in tiles of ``tile``
    (rows, cols; None: the whole dim), each tile's scale from its own amax (or, for a whole tensor,
    from ``amax``: a delayed scale) by the E8M0 rule (``mx``) or ScalingRecipe's; both of ``t``'s
    shape, ``scale_inv`` spread over the elements. Codes are ``fl32(x scale)``, inf as NaN,
    saturated at ±fmax, rounded to nearest even by torch's float8 cast; real = code scale_inv."""
    rows, cols = t.shape
    tr = rows if tile[0] is None else min(tile[0], rows)
    tc = cols if tile[1] is None else min(tile[1], cols)
    pr, pc = -rows % tr, -cols % tc
    padded = F.pad(t, (0, pc, 0, pr))
    blocks = padded.view((rows + pr) // tr, tr, (cols + pc) // tc, tc)
    tile_amax = blocks.abs().amax(dim=(1, 3), keepdim=True) if amax is None else amax.double().reshape(1, 1, 1, 1)
    finite = tile_amax.isfinite()
    safe = torch.where(finite, tile_amax, torch.zeros_like(tile_amax))
    if mx:
        scale = _e8m0_scale(safe, fmt)
        scale_inv = 1 / scale
    else:
        scale = _scale(safe, FMAX[fmt], margin, pow2)
        scale_inv = (1 / scale).float().double()  # fl32(1 / scale): exact for powers of two
        scale = scale.double()
    v = (blocks * scale).float()
    v = torch.where(v.isinf(), torch.full_like(v, math.nan), v).clamp(-FMAX[fmt], FMAX[fmt])
    real = v.to(fmt).double() * scale_inv
    if amax is None:  # a tile holding an inf or NaN reads NaN
        real = torch.where(finite, real, torch.full_like(real, math.nan))
    unpad = (slice(0, rows), slice(0, cols))
    return real.reshape(padded.shape)[unpad], scale_inv.expand_as(blocks).reshape(padded.shape)[unpad]


def operand(recipe: fp8amp.Recipe, role: str, t: torch.Tensor, fmt, amax=None) -> torch.Tensor:
    """A GEMM operand ``t`` [rows, contraction] as ``recipe`` casts it in ``role``."""
    if recipe.kind == "mxfp8":
        return fake_quant(t, fmt, (1, 32), mx=True)[0]
    tile = {"tensorwise": (None, None), "rowwise": (1, None)}.get(
        recipe.kind, (128, 128) if role == "weight" else (1, 128))
    return fake_quant(t, fmt, tile, amax=amax, margin=recipe.margin, pow2=recipe.pow2_scale)[0]


def real(t: torch.Tensor) -> torch.Tensor:
    """The real values of a param, a gradient or a moment, in float64."""
    if isinstance(t, (fp8amp.ScaledTensor, fp8amp.BlockScaledTensor)):
        return t.dequantize(torch.float32).double()
    return t.detach().double()


def eps(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).eps


def subnormal(dtype: torch.dtype) -> float:
    """The subnormal step of ``dtype``: twice the largest error of rounding a tiny value."""
    return torch.finfo(dtype).smallest_normal * torch.finfo(dtype).eps


def close(what: str, got: torch.Tensor, ref: torch.Tensor, tol: torch.Tensor) -> list[str]:
    """Where ``got`` is farther than ``tol`` from ``ref`` (float64), one line; NaN matches NaN."""
    got = got.detach().double()
    assert got.shape == ref.shape, f"{what}: shape {tuple(got.shape)}, expected {tuple(ref.shape)}"
    both_nan = got.isnan() & ref.isnan()
    bad = ~both_nan & ~((got - ref).abs() <= tol)
    if not bool(bad.any()):
        return []
    i = int(bad.flatten().nonzero()[0])
    return [f"{what}: {int(bad.sum())} of {bad.numel()} elements outside the bound, first at flat {i}: got "
            f"{got.flatten()[i].item():.9g}, ref {ref.flatten()[i].item():.9g}, tol {tol.flatten()[i].item():.3g}"]


# ---------------------------------------------------------------- models and cases

class Stack(nn.Module):
    def __init__(self, dims: list[int], biases: list[bool]):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(a, b, bias=bias) for a, b, bias in zip(dims, dims[1:], biases))

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            x = layer(x if i == 0 else F.gelu(x))
        return x


class Attention(nn.Module):
    """q, k, v projections, causal SDPA over the last leading dim, an output projection."""

    def __init__(self, d: int, d_out: int, heads: int, bias: bool):
        super().__init__()
        self.heads = heads
        self.q, self.k, self.v = (nn.Linear(d, d, bias=bias) for _ in range(3))
        self.o = nn.Linear(d, d_out, bias=not bias)

    def forward(self, x):
        lead, d = x.shape[:-1], x.shape[-1]

        def split(t):
            return t.reshape(*lead, self.heads, d // self.heads).transpose(-2, -3)

        a = F.scaled_dot_product_attention(split(self.q(x)), split(self.k(x)), split(self.v(x)), is_causal=True)
        return self.o(a.transpose(-2, -3).reshape(*lead, d))


@dataclass
class Case:
    level: str
    recipe: fp8amp.Recipe
    autocast: torch.dtype | None
    model: str            # "stack" or "attention"
    dims: list[int]
    biases: list[bool]
    lead: tuple[int, ...]
    values: str           # "normal", "zeros", "const", "outliers"
    magnitude: float
    seed: int
    steps: int = 3
    layout: str = "contiguous"   # "contiguous", "transposed" (leading dims), "sliced" (of a wider last dim)
    micro: int = 1               # micro-batches a step
    validate: bool = False       # an eval() forward under no_grad before each step
    dtype: torch.dtype = torch.float32  # the model's (bfloat16: a model loaded in bf16, no autocast)
    scaler: bool = False         # torch.amp.GradScaler (float16 autocast)
    clip: bool = False           # clip_grad_norm_(foreach=True) before the step
    input_grad: bool = True      # the input requires grad (else data: no dX for the first layers)
    frozen: int = -1             # the index of a Linear whose weight is frozen (not of a model's only one)

    def __str__(self) -> str:
        ac = ("fp32" if self.autocast is None else str(self.autocast).removeprefix("torch.")) + (
            "-bf16model" if self.dtype == torch.bfloat16 else "") + ("-scaler" if self.scaler else "") + (
            "-clip" if self.clip else "") + ("" if self.input_grad else "-nodx") + (
            f"-frozen{self.frozen}" if self.frozen >= 0 else "")
        r = self.recipe
        rec = r.kind + (f"(h={r.history_len})" if r.kind == "tensorwise" else "")
        rec += "-e5m2" if r.grad_format == E5M2 and r.kind != "tensorwise" else ""
        rec += "-e4m3grad" if r.grad_format == E4M3 and r.kind == "tensorwise" else ""
        rec += (f"-margin{r.margin}" if r.margin else "") + ("" if r.pow2_scale else "-exact")
        return (f"{self.level}-{rec}-{ac}-{self.model}{self.dims}-bias{[int(b) for b in self.biases]}-"
                f"x{list(self.lead)}-{self.layout}-{self.values}{self.magnitude:g}-micro{self.micro}"
                f"{'-validate' if self.validate else ''}-seed{self.seed}")


def draw_recipe(rng: random.Random, kind: str, index: int) -> fp8amp.Recipe:
    """The recipe ``kind``, tensorwise also with a history of 1 or 2 steps (delayed scales after the
    warm-up), and sometimes the other gradient format, a margin or TE's exact scales."""
    options = {}
    if kind == "tensorwise" and index % 3:
        options["history_len"] = index % 3
    if rng.random() < 0.2:
        options["grad_format"] = E4M3 if kind == "tensorwise" else E5M2
    if kind != "mxfp8" and rng.random() < 0.2:
        options["margin"] = 1
    if kind != "mxfp8" and rng.random() < 0.2:
        options["pow2_scale"] = False
    return fp8amp.Recipe(kind, **options)


def draw_case(rng: random.Random, level: str, kind: str, index: int) -> Case:
    recipe = draw_recipe(rng, kind, index)
    fitting = [d for d in DIMS if d % recipe.feature_multiple == 0]

    def dim():
        return rng.choice(fitting if rng.random() < 0.6 else DIMS)

    model = "attention" if rng.random() < 0.3 else "stack"
    if model == "attention":
        d = rng.choice([d for d in fitting if d <= 256] if rng.random() < 0.7 else DIMS)
        dims, biases = [d, dim()], [rng.random() < 0.5]
    else:
        depth = rng.randint(1, 3)
        dims = [dim() for _ in range(depth + 1)]
        biases = [rng.random() < 0.6 for _ in range(depth)]
    tokens = rng.choice(TOKENS)
    lead = rng.choice([(tokens,), (1, tokens), (2, tokens), (1, 1, tokens), (3, 1, tokens), (tokens, 1)])
    values = rng.choices(["normal", "zeros", "const", "outliers"], [6, 1, 1, 2])[0]
    autocast = rng.choice(AUTOCAST)
    magnitude = rng.choice([1e-3, 1.0] if autocast == torch.float16 else [1e-3, 1.0, 30.0])
    layout = rng.choices(["contiguous", "transposed", "sliced"], [4, 1, 1])[0]
    if layout == "transposed" and len(lead) == 1:
        layout = "sliced"
    return Case(level, recipe, autocast, model, dims, biases, lead, values, magnitude, rng.randrange(1 << 30),
                steps=4 if kind == "tensorwise" else 3, layout=layout, micro=rng.choices([1, 2], [3, 1])[0],
                validate=rng.random() < 0.2,
                dtype=torch.bfloat16 if autocast is None and rng.random() < 0.3 else torch.float32,
                scaler=autocast == torch.float16 and rng.random() < 0.6, clip=rng.random() < 0.3,
                input_grad=rng.random() < 0.7,
                frozen=rng.randrange(len(dims) + 2) - 2 if model == "attention" or len(dims) > 2 else -1)


def build(case: Case) -> nn.Module:
    torch.manual_seed(case.seed)
    if case.model == "attention":
        d = case.dims[0]
        model = Attention(d, case.dims[1], 2 if d % 2 == 0 and d >= 32 else 1, case.biases[0])
    else:
        model = Stack(case.dims, case.biases)
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    if 0 <= case.frozen < len(linears):
        linears[case.frozen].weight.requires_grad_(False)
    return model.to(case.dtype)


def make_input(case: Case, step: int, g: torch.Generator) -> torch.Tensor:
    """A batch of the case's values, a leaf (that requires grad if the case says so), in the case's
    layout."""
    shape = (*case.lead, case.dims[0])
    x = torch.randn(shape, generator=g).to(case.dtype) * case.magnitude
    if case.values == "zeros" and step == 1:
        x = torch.zeros(shape, dtype=case.dtype)
    elif case.values == "const":
        x = torch.full(shape, case.magnitude * (0.37 + step), dtype=case.dtype)
    elif case.values == "outliers":  # where plain torch stays finite: float16's range, attention's softmax
        rows = x.view(-1, shape[-1])
        rows[:: 3] *= 3e4 if case.autocast != torch.float16 and case.model == "stack" else 30.0
    grad = case.input_grad
    if case.layout == "transposed":  # the same values, leading dims 0 and 1 swapped in memory
        return x.transpose(0, 1).contiguous().requires_grad_(grad).transpose(0, 1)
    if case.layout == "sliced":  # rows strided by a wider last dim
        return F.pad(x, (0, 5)).requires_grad_(grad)[..., : shape[-1]]
    return x.requires_grad_(grad)
