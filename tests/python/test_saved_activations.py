"""fp8amp.save_activations_in_fp8: the activations autograd saves for backward, stored in FP8.

What the backward reads is exactly the FP8 round trip of ScaledTensor.from_tensor; which saved
tensors are stored (activations) and which are kept (parameters and their views and autocast
casts, inputs, statistics, outputs of log_softmax/tanh, FP8, integer, float64, broadcast and
small tensors); non-contiguous inputs; non-finite values; gradients of a GPT block within the FP8
noise floor; Fp8Linear; activation checkpointing; double backward; torch.compile; errors; a small
GPT training on CPU (FP8 emulation). The GPU loss check against BF16 is in test_initialize.py.

SQNR floors, as in test_linear.py: a stored value carries the relative rounding of its format,
an SQNR of 4.77 + 6.02 (m + 1) dB with m mantissa bits (28.8 dB for E4M3, 22.8 dB for E5M2); the
floors sit 3 dB under that, for the spread of random data: 25.8 and 19.8 dB. The GPT block's
gradients measured 32.8 / 26.3 dB at worst (qkv.weight); storing the statistics too (LayerNorm's
mean and rstd, SDPA's logsumexp, log_softmax's output) measured 22.7 / 17.4 dB, under the floors.
"""

from __future__ import annotations

import contextlib
import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch._dynamo.utils import counters
from torch.utils.checkpoint import checkpoint

import fp8amp
from fp8amp import E4M3, E5M2, ScaledTensor, saved_activations, saved_activations_graph
from fp8amp.ops._args import has_row_runs
from fp8amp.testing import GPT, GPTConfig, batches, load_text_bytes, train_step

SQNR_FLOOR_DB = {E4M3: 25.8, E5M2: 19.8}
FORMATS = [E4M3, E5M2]


def sqnr_db(actual: torch.Tensor, reference: torch.Tensor) -> float:
    actual, reference = actual.detach().double(), reference.detach().double()
    noise = (actual - reference).pow(2).sum()
    return math.inf if noise == 0 else 10 * math.log10(reference.pow(2).sum() / noise)


def activation(*shape, dtype=torch.float32, seed=0) -> torch.Tensor:
    """A tensor as an op in the middle of a model sees it: not a leaf, requires grad."""
    g = torch.Generator().manual_seed(seed)
    leaf = torch.randn(*shape, generator=g).to(dtype).requires_grad_()
    return leaf * 1


def is_stored(packed: object) -> bool:
    return not isinstance(packed, torch.Tensor)


def unpack(ctx, packed: object) -> torch.Tensor:
    """The unpack hook as the backward calls it: with grad mode off (on, it means double backward)."""
    with torch.no_grad():
        return ctx.unpack_hook(packed)


def round_trip(x: torch.Tensor, fmt=E4M3) -> torch.Tensor:
    return ScaledTensor.from_tensor(x.detach().contiguous(), fmt).dequantize()


# ------------------------------------------------------------------------------------------ values


@pytest.mark.parametrize("fmt", FORMATS)
def test_backward_reads_the_fp8_round_trip(fmt):
    g = torch.Generator().manual_seed(0)
    a0 = torch.randn(64, 128, generator=g).requires_grad_()
    b0 = (torch.randn(64, 128, generator=g) * 3).requires_grad_()
    with fp8amp.save_activations_in_fp8(fmt, min_numel=1) as ctx:
        a, b = a0 * 1, b0 * 1  # activations: mul by a number saves nothing
        (a * b).sum().backward()  # mul saves a and b: d/da = b as stored, d/db = a as stored
    assert torch.equal(a0.grad, round_trip(b0, fmt)) and torch.equal(b0.grad, round_trip(a0, fmt))
    assert not torch.equal(a0.grad, b0.detach())  # the rounding is really there
    assert ctx.stored_tensors == 2
    assert ctx.stored_bytes == 2 * 64 * 128 * 4 and ctx.fp8_bytes == 2 * (64 * 128 + 4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_non_contiguous_tensors_come_back_contiguous_with_the_same_values(dtype):
    ctx = fp8amp.save_activations_in_fp8(min_numel=1)
    x = activation(8, 4, 16, 32, dtype=dtype).transpose(1, 2)  # a strided view, as SDPA's q, k, v
    packed = ctx.pack_hook(x)
    assert is_stored(packed) and packed.scaled.storage_format == E4M3
    back = unpack(ctx, packed)
    assert back.dtype == dtype and back.shape == x.shape and back.is_contiguous()
    assert torch.equal(back, round_trip(x)) and sqnr_db(back, x) > SQNR_FLOOR_DB[E4M3]


def test_nonfinite_values_read_back_as_nan():
    ctx = fp8amp.save_activations_in_fp8(min_numel=1)
    for bad in (math.inf, -math.inf, math.nan):
        x = activation(32, 32)
        with torch.no_grad():
            x[3, 5] = bad
        back = unpack(ctx, ctx.pack_hook(x))
        assert back.isnan().all(), bad  # never a saturated finite value
    big = activation(32, 32) * 1e30  # finite but far beyond E4M3: the scale takes it
    assert torch.isfinite(unpack(ctx, ctx.pack_hook(big))).all()


def test_nonfinite_activation_gives_nan_gradients():
    w = torch.randn(16, 16, requires_grad=True)
    x = torch.randn(16, 16)
    x[0, 0] = math.inf
    with fp8amp.save_activations_in_fp8(min_numel=1):
        h = x @ w  # an activation holding inf (row 0)
        (h * w).sum().backward()
    assert w.grad.isnan().all()


# ------------------------------------------------------------------------------------------ which


def test_what_is_stored_and_what_is_kept():
    ctx = fp8amp.save_activations_in_fp8(min_numel=64)
    param = nn.Parameter(torch.randn(16, 16))
    leaf = torch.randn(16, 16, requires_grad=True)
    act = activation(16, 16)
    stored = {
        "activation": act,
        "bfloat16 activation": activation(16, 16, dtype=torch.bfloat16),
        "float16 activation": activation(16, 16, dtype=torch.float16),
        "view of an activation": act.t(),
        "cast of an activation": act.to(torch.bfloat16),
    }
    kept = {
        "parameter": param,
        "view of a parameter": param.t(),
        "autocast's cast of a parameter": param.to(torch.bfloat16),
        "leaf that requires grad": leaf,
        "no grad (a statistic, an input)": torch.randn(16, 16),
        "small": activation(7, 9),
        "float64": activation(16, 16, dtype=torch.float64),
        "FP8": torch.randn(16, 16).to(E4M3),
        "integer": torch.arange(256),
        "ScaledTensor": ScaledTensor.from_tensor(torch.randn(16, 16), E4M3),
        "broadcast": act[:1].expand(16, 16),
        "log_softmax output": F.log_softmax(act, -1),
        "tanh output": act.tanh(),
        "sigmoid output": act.sigmoid(),
    }
    for name, x in stored.items():
        assert is_stored(ctx.pack_hook(x)), name
    for name, x in kept.items():
        packed = ctx.pack_hook(x)
        assert isinstance(packed, torch.Tensor) and (packed.shape, packed.dtype) == (x.shape, x.dtype), name
        assert packed.grad_fn is None, name  # detached: a saved output would otherwise hold its own grad_fn


def test_mlp_under_autocast_stores_its_two_activations_only():
    """Linear -> GELU -> Linear in bfloat16 autocast: GELU's input and fc2's input are stored; the
    model input, the weights, autocast's weight copies and the biases are kept."""
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64))
    x = torch.randn(32, 64)
    with torch.autocast("cpu", dtype=torch.bfloat16), fp8amp.save_activations_in_fp8(min_numel=1) as ctx:
        y = mlp(x)
    y.float().sum().backward()
    assert ctx.stored_tensors == 2 and ctx.stored_bytes == 2 * 32 * 256 * 2
    assert ctx.fp8_bytes == 2 * (32 * 256 + 4)


def test_fp8linear_saves_are_left_alone():
    """Fp8Linear saves its input as FP8 codes already: only GELU's input is stored."""
    torch.manual_seed(0)
    mlp = fp8amp.convert(nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64)), policy="all")
    with fp8amp.save_activations_in_fp8(min_numel=1) as ctx:
        y = mlp(torch.randn(32, 64))
    y.sum().backward()
    assert ctx.stored_tensors == 1 and ctx.stored_bytes == 32 * 256 * 4
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in mlp.parameters())


# ------------------------------------------------------------------------------------------ gradients


def gpt_block_grads(ctx=None, n_layer=1, seed=0) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    torch.manual_seed(seed)
    model = GPT(GPTConfig(seq_len=64, n_layer=n_layer, n_head=4, d_model=128))
    idx = torch.randint(0, 256, (4, 64), generator=torch.Generator().manual_seed(seed))
    if ctx is None:
        _, loss = model(idx, idx)
    else:
        with ctx:
            _, loss = model(idx, idx)
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("fmt", FORMATS)
def test_gpt_gradients_within_the_fp8_noise_floor(fmt):
    """Attention (SDPA's q, k, v, output), GELU and LayerNorm inputs stored: the forward is untouched
    (bit-identical loss), every gradient is within the floor of its format, and not exact."""
    loss, grads = gpt_block_grads()
    ctx = fp8amp.save_activations_in_fp8(fmt, min_numel=1024)
    loss_fp8, grads_fp8 = gpt_block_grads(ctx)
    assert torch.equal(loss_fp8, loss)
    # the block's 2 LayerNorm inputs, 4 Linear inputs, q, k, v, SDPA's output, GELU's input; ln_f's
    # input and the head's
    assert ctx.stored_tensors == 13
    for name, g in grads.items():
        assert sqnr_db(grads_fp8[name], g) > SQNR_FLOOR_DB[fmt], name
    everything = torch.cat([g.flatten() for g in grads.values()])
    assert sqnr_db(torch.cat([g.flatten() for g in grads_fp8.values()]), everything) < 60


def test_activation_checkpointing():
    """Checkpointed regions save nothing; checkpoint saves their input, which is stored, and the
    recomputation starts from it: gradients within the FP8 floor, for both implementations."""
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64))
    x = torch.randn(32, 64, requires_grad=True)

    def grad(use_reentrant=None, ctx=None):
        mlp.zero_grad()
        with ctx or contextlib.nullcontext():
            h = x * 2
            out = mlp(h) if use_reentrant is None else checkpoint(mlp, h, use_reentrant=use_reentrant)
        out.pow(2).sum().backward()
        return mlp[0].weight.grad.clone()

    reference = grad()
    for use_reentrant in (False, True):
        ctx = fp8amp.save_activations_in_fp8(min_numel=1)
        g = grad(use_reentrant, ctx)
        assert ctx.stored_tensors == 1 and ctx.stored_bytes == 32 * 64 * 4  # h only
        assert 0 < (g - reference).abs().max() and sqnr_db(g, reference) > SQNR_FLOOR_DB[E4M3]


def test_double_backward_raises():
    x = torch.randn(64, 64, requires_grad=True)
    with fp8amp.save_activations_in_fp8(min_numel=1):
        y = (x * 2).sin().sum()
    with pytest.raises(RuntimeError, match="double backward"):
        torch.autograd.grad(y, x, create_graph=True)


# ------------------------------------------------------------------------------------------ compile


needs_graph_hooks = pytest.mark.skipif(
    not saved_activations_graph._graph_hooks_supported(),
    reason="this torch does not inline saved-tensor hooks into compiled graphs")


def held_for_backward(output: torch.Tensor) -> dict[torch.dtype, int]:
    """Bytes the autograd node that made ``output`` holds for its backward, by dtype: for the output
    of a compiled graph, all that the graph saved (FP8 codes where the context stored activations);
    nothing for an eager op's node."""
    held: dict[torch.dtype, int] = {}
    with torch.no_grad():  # reading saved tensors unpacks them, as the backward does
        saved = getattr(output.grad_fn, "saved_tensors", ())  # eager nodes: not seen
    for t in saved:
        held[t.dtype] = held.get(t.dtype, 0) + t.numel() * t.element_size()
    return held


def mlp_and_input():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64)), torch.randn(32, 64, requires_grad=True)


def mlp_grad(mlp, x, model=None, ctx=None) -> tuple[torch.Tensor, dict[torch.dtype, int]]:
    mlp.zero_grad()
    with ctx or contextlib.nullcontext():
        out = (model or mlp)(x * 2)  # x * 2: an activation as the graph's input
    held = held_for_backward(out)
    out.sum().backward()
    return mlp[0].weight.grad.clone(), held


@needs_graph_hooks
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiled_graph_stores_its_activations_in_fp8(backend):
    """The compiled forward quantizes what it saves: its input x * 2, GELU's input and fc2's input
    are held as E4M3 codes (one byte an element), only the weights and the scales stay float32, and
    the backward reads what the eager context gives (aot_eager: bit for bit; Inductor: within
    float32 reordering)."""
    torch._dynamo.reset()
    mlp, x = mlp_and_input()
    reference, _ = mlp_grad(mlp, x)
    eager, _ = mlp_grad(mlp, x, ctx=fp8amp.save_activations_in_fp8(min_numel=1))
    ctx = fp8amp.save_activations_in_fp8(min_numel=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        g, held = mlp_grad(mlp, x, torch.compile(mlp, backend=backend), ctx)
    assert not [w for w in caught if "save_activations_in_fp8" in str(w.message)]  # no "keeps them"
    assert ctx.in_compiled_graphs and ctx.stored_tensors == 0  # counted: what is stored outside graphs
    weights = sum(p.numel() * 4 for n, p in mlp.named_parameters() if n.endswith("weight"))
    assert held == {torch.float8_e4m3fn: 32 * 64 + 2 * 32 * 256, torch.float32: weights + 3 * 4}
    assert sqnr_db(g, reference) > SQNR_FLOOR_DB[E4M3] and not torch.equal(g, reference)
    if backend == "aot_eager":
        assert torch.equal(g, eager)
    else:
        assert sqnr_db(g, eager) > 100


@needs_graph_hooks
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_quantize_in_graph_is_the_kernels_bit_for_bit(fmt, dtype):
    """The compiled graphs' quantize (torch ops, for Inductor to fuse) gives the codes and scale of
    ScaledTensor.from_tensor(x, fmt, nan_if_nonfinite=True), eagerly and compiled by Inductor: for
    ordinary, tiny, huge, all-zero and non-finite tensors."""
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(0)
    compiled = torch.compile(saved_activations_graph._quantize_in_graph, backend="inductor", fullgraph=True)
    cases = {"randn": torch.randn(64, 48, generator=g), "exact power of two amax": torch.ones(8, 8) * 2.0 ** -7,
             "tiny": torch.randn(64, 48, generator=g) * 1e-30, "huge": torch.randn(64, 48, generator=g) * 1e30,
             "zeros": torch.zeros(16, 16)}
    qkv = torch.randn(2, 16, 3, 4, 8, generator=g)  # (B, T, q/k/v, H, D), as SDPA's inputs come
    strided = {"q of a qkv output": qkv[:, :, 0].transpose(1, 2), "v of a qkv output": qkv[:, :, 2].transpose(1, 2),
               "a permutation": qkv.permute(3, 0, 4, 2, 1), "not row runs": qkv[:, ::2, :, ::2]}
    assert [has_row_runs(x) for x in strided.values()] == [True, True, True, False]
    cases.update(strided)
    for name, x in cases.items():
        x = x.to(dtype)
        if not torch.isfinite(x).all():
            continue  # 1e30 in float16
        expected = ScaledTensor.from_tensor(x, fmt, nan_if_nonfinite=True)
        for codes, scale_inv in (saved_activations_graph._quantize_in_graph(x, fmt), compiled(x, fmt)):
            assert torch.equal(codes.view(torch.uint8), expected._data.view(torch.uint8)), name
            assert torch.equal(scale_inv, expected._scale_inv), name
    for bad in (math.inf, math.nan):
        x = torch.randn(32, 32, generator=g).to(dtype)
        x[1, 2] = bad
        for codes, scale_inv in (saved_activations_graph._quantize_in_graph(x, fmt), compiled(x, fmt)):
            assert scale_inv.isnan().all() and (codes.float() * scale_inv).isnan().all()


@needs_graph_hooks
def test_compiled_gpt_blocks_store_activations_and_keep_statistics():
    """Each transformer block compiled by Inductor, the context entered outside (the fastest
    configuration): a block's compiled forward holds its activations as E4M3 (its input, q, k, v,
    SDPA's output, the LayerNorm outputs, the GELU input and output, the proj output it
    recomputes the residual from); what stays float32 is the weights, the 1-element scales and the
    statistics (LayerNorms' mean and rstd, SDPA's logsumexp), under 2 % of what it held. The loss
    is the compiled model's without the context, bit for bit, the gradients are within the E4M3
    floor of eager's, and a new context (train_step enters one each step) reuses the compiled
    graphs."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = GPT(GPTConfig(seq_len=64, n_layer=2, n_head=4, d_model=128))
    idx = torch.randint(0, 256, (4, 64), generator=torch.Generator().manual_seed(0))
    loss, grads = gpt_block_grads_of(model, idx)
    for block in model.blocks:
        block.compile(backend="inductor")
    held = []
    handle = model.blocks[0].register_forward_hook(lambda m, i, out: held.append(held_for_backward(out)))
    loss_plain, _ = gpt_block_grads_of(model, idx)
    ctx = fp8amp.save_activations_in_fp8(min_numel=1024)
    loss_fp8, grads_fp8 = gpt_block_grads_of(model, idx, ctx)
    counters.clear()
    loss_again, _ = gpt_block_grads_of(model, idx, fp8amp.save_activations_in_fp8(min_numel=1024))
    handle.remove()
    assert not counters["stats"]["unique_graphs"]  # no recompilation for the new context
    assert torch.equal(loss_fp8, loss_plain) and torch.equal(loss_again, loss_plain)  # the forward is untouched
    for name, g in grads.items():
        assert sqnr_db(grads_fp8[name], g) > SQNR_FLOOR_DB[E4M3], name
    without, with_fp8, _ = held
    assert set(without) == {torch.float32} and set(with_fp8) == {torch.float32, torch.float8_e4m3fn}
    weights = sum(p.numel() * 4 for n, p in model.blocks[0].named_parameters() if n.endswith("weight") and "ln" not in n)
    activations = without[torch.float32] - weights
    statistics = with_fp8[torch.float32] - weights
    assert activations > 0 and 0 < statistics < 0.02 * activations
    assert 4 * with_fp8[torch.float8_e4m3fn] > 0.95 * activations  # stored at one byte instead of four
    # ln_f's input and the head's input are saved outside the compiled blocks: stored by the hooks
    assert ctx.stored_tensors == 2


def gpt_block_grads_of(model, idx, ctx=None):
    model.zero_grad()
    with ctx or contextlib.nullcontext():
        _, loss = model(idx, idx)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@needs_graph_hooks
def test_compiled_o2_blocks_store_activations():
    """O2 (Fp8Linear, ScaledTensor masters; FP8 emulated on the CPU), blocks compiled by Inductor,
    train_step entering the context each step: a block's compiled forward keeps its Fp8Linears'
    FP8 saves and stores its input, q, k, v, SDPA's output and the GEMM outputs it saves in E4M3,
    so all but ~2 % of its float32 bytes go; the losses of 4 steps follow those without the context."""
    torch._dynamo.reset()
    data = load_text_bytes(max_bytes=1 << 16)
    cfg = GPTConfig(seq_len=64, n_layer=2, n_head=4, d_model=64)

    def run(ctx=None):
        torch.manual_seed(0)
        model = GPT(cfg)
        opt = torch.optim.AdamW(model.parameters(), lr=2e-3)
        model, opt = fp8amp.initialize(model, opt, "O2", policy="all")
        for block in model.blocks:
            block.compile(backend="inductor")
        held = []
        model.blocks[1].register_forward_hook(lambda m, i, out: held.append(held_for_backward(out)))
        losses = torch.stack([train_step(model, opt, x, y, saved_tensors_hooks=ctx)
                              for _, (x, y) in zip(range(4), batches(data, 4, cfg.seq_len))])
        return losses, held[-1]

    plain, held_plain = run()
    fp8, held_fp8 = run(fp8amp.save_activations_in_fp8(min_numel=1024))
    assert held_fp8[torch.float8_e4m3fn] > held_plain[torch.float8_e4m3fn]  # Fp8Linear's, and now more
    assert held_fp8[torch.float32] < 0.02 * held_plain[torch.float32]
    assert torch.isfinite(fp8).all() and (fp8 - plain).abs().max() < 0.01 * plain.max()


class UnboundQkvAttention(nn.Module):
    """Attention in timm's layout: q, k and v are the items of one unbind of the permuted qkv output,
    saved as they are (fp8amp.testing's GPT saves transposes of them)."""

    def __init__(self, d_model: int = 128, n_head: int = 4) -> None:
        super().__init__()
        self.n_head, self.qkv, self.proj = n_head, nn.Linear(d_model, 3 * d_model), nn.Linear(d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, c = x.shape
        q, k, v = self.qkv(x).reshape(b, n, 3, self.n_head, c // self.n_head).permute(2, 0, 3, 1, 4).unbind(0)
        return self.proj(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, n, c))


@needs_graph_hooks
def test_compiled_graph_stores_every_item_of_an_unbind():
    """The items of a view op (unbind's k and v) are activations like its first (q), not the
    statistics that a multi-output op's later outputs are (LayerNorm's mean and rstd): the compiled
    attention stores its input, q, k, v and SDPA's output in E4M3, and keeps in float32 only the
    weights, the logsumexp and the scales. (k and v were kept, in float32 here and float16 under
    autocast: 3 GiB of timm's 1B ViT.)"""
    torch._dynamo.reset()
    torch.manual_seed(0)
    attention = UnboundQkvAttention()
    x = torch.randn(4, 64, 128, requires_grad=True)
    compiled = torch.compile(attention, backend="inductor")
    held = {}
    for name, ctx in (("plain", None), ("fp8", fp8amp.save_activations_in_fp8(min_numel=1024))):
        with ctx or contextlib.nullcontext():
            held[name] = held_for_backward(compiled(x * 2))
    weights = sum(p.numel() * 4 for n, p in attention.named_parameters() if n.endswith("weight"))
    activation_numel = x.numel()  # the input, q, k, v and SDPA's output each hold as many
    assert held["fp8"][torch.float8_e4m3fn] == 5 * activation_numel
    assert 0 < held["fp8"][torch.float32] - weights < 0.02 * (held["plain"][torch.float32] - weights)


@needs_graph_hooks
def test_compiled_model_keeps_the_logits_its_backward_exponentiates():
    """The whole GPT compiled: Inductor's backward recomputes log_softmax from the saved logits as
    exp(logits - max - log-sum-exp), where a relative rounding of the logits would become an error
    of the exponent; the logits are kept float32, the blocks' activations stored."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    cfg = GPTConfig(seq_len=64, n_layer=1, n_head=4, d_model=128)
    model = GPT(cfg)
    idx = torch.randint(0, 256, (4, 64), generator=torch.Generator().manual_seed(0))
    loss, grads = gpt_block_grads_of(model, idx)
    compiled = torch.compile(model, backend="inductor")
    with fp8amp.save_activations_in_fp8(min_numel=1024):
        _, loss_fp8 = compiled(idx, idx)
    saved = loss_fp8.grad_fn.saved_tensors
    logits = 4 * 64 * cfg.vocab_size
    assert any(t.dtype == torch.float32 and t.numel() == logits for t in saved)
    assert sum(t.numel() for t in saved if t.dtype == torch.float8_e4m3fn) > 10 * 4 * 64 * cfg.d_model
    model.zero_grad()
    loss_fp8.backward()
    assert torch.allclose(loss_fp8.detach(), loss, rtol=1e-5, atol=0)  # Inductor's float32 rounding
    for name, g in grads.items():
        assert sqnr_db(model.get_parameter(name).grad, g) > SQNR_FLOOR_DB[E4M3], name


@needs_graph_hooks
def test_filtering_mode_is_set_inside_the_context_only():
    mode = torch._functorch.config.saved_tensors_hooks_filtering_mode
    with fp8amp.save_activations_in_fp8():
        assert torch._functorch.config.saved_tensors_hooks_filtering_mode == "no_static"
    assert torch._functorch.config.saved_tensors_hooks_filtering_mode == mode
    with fp8amp.save_activations_in_fp8(compiled_graphs=False):
        assert torch._functorch.config.saved_tensors_hooks_filtering_mode == mode


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize("why", ["compiled_graphs=False", "this torch"])
def test_without_graph_hooks_compiled_graphs_warn_and_keep_their_intermediates(backend, why, monkeypatch):
    """With plain Python hooks (compiled_graphs=False, or a torch that cannot inline GraphModule
    hooks) the hooks run on what the compiled graph saves: its intermediates arrive without grad and
    are kept (with a warning), its inputs that are activations are stored; gradients stay right."""
    torch._dynamo.reset()
    if why == "this torch":
        monkeypatch.setattr(saved_activations, "_graph_hooks_supported", lambda: False)
        ctx = fp8amp.save_activations_in_fp8(min_numel=1)
    else:
        ctx = fp8amp.save_activations_in_fp8(min_numel=1, compiled_graphs=False)
    assert not ctx.in_compiled_graphs
    mlp, x = mlp_and_input()
    reference, _ = mlp_grad(mlp, x)
    with pytest.warns(UserWarning, match=f"torch.compile'd graph.*{why.split('=')[0]}"):
        g, held = mlp_grad(mlp, x, torch.compile(mlp, backend=backend), ctx)
    assert ctx.stored_tensors == 1  # the graph's input x * 2; GELU's input is an intermediate: kept
    assert torch.float8_e4m3fn not in held
    assert sqnr_db(g, reference) > SQNR_FLOOR_DB[E4M3]


def test_entering_inside_fullgraph_compiled_code_raises():
    """Dynamo does not trace saved_tensors_hooks: the context must be entered outside compiled code."""
    torch._dynamo.reset()

    def f(x):
        with fp8amp.save_activations_in_fp8():
            return (x * 2).sin()

    with pytest.raises(Exception, match="saved_tensors_hooks"):
        torch.compile(f, backend="aot_eager", fullgraph=True)(torch.randn(8, requires_grad=True))


# ------------------------------------------------------------------------------------------ errors


def test_bad_arguments_name_the_argument_and_the_accepted_values():
    with pytest.raises(ValueError, match=r"fmt must be one of torch.float8_e4m3fn, torch.float8_e5m2; got torch.float16"):
        fp8amp.save_activations_in_fp8(torch.float16)
    with pytest.raises(TypeError, match="fmt must be a torch.dtype"):
        fp8amp.save_activations_in_fp8("e4m3")
    with pytest.raises(ValueError, match=r"min_numel must be a positive int \(1 or more\), got 0"):
        fp8amp.save_activations_in_fp8(min_numel=0)
    for bad in (2.0, True):
        with pytest.raises(TypeError, match="min_numel must be an int"):
            fp8amp.save_activations_in_fp8(min_numel=bad)


# ------------------------------------------------------------------------------------------ training


def test_small_gpt_trains_with_fp8_activations():
    """O2 on CPU (FP8 emulation) with and without the context, same data and initial weights: the
    loss falls as far. Measured: the means of the last 10 of 40 steps differ by 0.2 % (as much as O2
    and fp32 do), so the bound is 2 %."""
    data = load_text_bytes(max_bytes=1 << 20)
    cfg = GPTConfig(seq_len=64, n_layer=2, n_head=4, d_model=64)

    def losses(ctx=None) -> torch.Tensor:
        torch.manual_seed(0)
        model = GPT(cfg)
        opt = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.0)
        model, opt = fp8amp.initialize(model, opt, "O2", policy="all")
        schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 10))
        return torch.stack([train_step(model, opt, x, y, scheduler=schedule, saved_tensors_hooks=ctx)
                            for _, (x, y) in zip(range(40), batches(data, 8, cfg.seq_len))])

    ctx = fp8amp.save_activations_in_fp8(min_numel=4096)
    plain, fp8 = losses(), losses(ctx)
    # in a step: 7 a block (2 LayerNorm inputs, q, k, v, SDPA's output, GELU's input; the Fp8Linears'
    # inputs are FP8 already), ln_f's input and the head's
    assert ctx.stored_tensors == 16
    assert fp8[-10:].mean() < fp8[0] - 2.0
    assert abs(fp8[-10:].mean() - plain[-10:].mean()) / plain[-10:].mean() < 0.02


# ------------------------------------------------------------------------------------------ GPU


def _held_for_backward(model: nn.Module, x: torch.Tensor, y: torch.Tensor, ctx=None) -> int:
    """Bytes a forward under BF16 autocast leaves allocated for its backward."""
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    with torch.autocast("cuda", dtype=torch.bfloat16), ctx or contextlib.nullcontext():
        _, loss = model(x, y)
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated() - before
    loss.backward()
    model.zero_grad(set_to_none=True)
    return held


@pytest.mark.gpu
def test_cuda_memory_held_for_backward_matches_the_prediction():
    """O2 on the GPU: what a GPT forward keeps for its backward, per token, in bytes (docs/o1_o2.md):
    a block keeps 31 d without the context (qkv's and fc1's BF16 outputs 6 d + 8 d, SDPA's output
    2 d, two fp32 LayerNorm inputs 8 d, the Fp8Linears' FP8 inputs 7 d) and 17 d with it (3 d + 4 d +
    d + 2 d + 7 d); the rest keeps ln_f's fp32 input (4 d -> d), the head's BF16 input (2 d -> d) and
    log_softmax's fp32 output (4 vocab, kept). Statistics add ~0.3 %. The memory the context frees
    is what it accounts for (stored_bytes - fp8_bytes): the originals are really released."""
    cfg = GPTConfig(seq_len=512, n_layer=4, n_head=8, d_model=512)
    torch.manual_seed(0)
    model = GPT(cfg).cuda()
    model, _ = fp8amp.initialize(model, None, "O2", policy="all")
    idx = torch.randint(0, cfg.vocab_size, (16, cfg.seq_len + 1), device="cuda")
    x, y = idx[:, :-1], idx[:, 1:]
    d, vocab = cfg.d_model, cfg.vocab_size
    predicted = ((cfg.n_layer * 17 * d + 2 * d + 4 * vocab)
                 / (cfg.n_layer * 31 * d + 6 * d + 4 * vocab))  # 0.545
    _held_for_backward(model, x, y)  # warm-up: cuBLASLt workspaces and the like stay allocated
    without = _held_for_backward(model, x, y)
    ctx = fp8amp.save_activations_in_fp8()
    with_fp8 = _held_for_backward(model, x, y, ctx)
    assert abs(with_fp8 / without - predicted) < 0.03, (with_fp8, without, predicted)
    freed = ctx.stored_bytes - ctx.fp8_bytes
    assert abs((without - with_fp8) - freed) < 0.05 * freed, (without - with_fp8, freed)


@pytest.mark.gpu
def test_cuda_memory_held_for_backward_under_compile_matches_the_prediction():
    """O2 with each block compiled by Inductor, the context entered outside: a compiled block keeps
    29 d bytes a token without the context (eager's 31 d, but the proj GEMM's BF16 output 2 d, from
    which the backward recomputes the second LayerNorm's input, instead of that fp32 input 4 d) and
    17 d with it (its input d, q, k, v 3 d, SDPA's output d, the proj and fc1 outputs d + 4 d, the
    Fp8Linears' 7 d); the head and the loss run eagerly, as above (2 stored by the Python hooks)."""
    cfg = GPTConfig(seq_len=512, n_layer=4, n_head=8, d_model=512)
    torch.manual_seed(0)
    model = GPT(cfg).cuda()
    model, _ = fp8amp.initialize(model, None, "O2", policy="all")
    for block in model.blocks:
        block.compile()
    idx = torch.randint(0, cfg.vocab_size, (16, cfg.seq_len + 1), device="cuda")
    x, y = idx[:, :-1], idx[:, 1:]
    d, vocab = cfg.d_model, cfg.vocab_size
    predicted = ((cfg.n_layer * 17 * d + 2 * d + 4 * vocab)
                 / (cfg.n_layer * 29 * d + 6 * d + 4 * vocab))  # 0.581
    _held_for_backward(model, x, y)  # warm-up and compilation, without and with the context
    _held_for_backward(model, x, y, fp8amp.save_activations_in_fp8())
    without = _held_for_backward(model, x, y)
    ctx = fp8amp.save_activations_in_fp8()
    assert ctx.in_compiled_graphs, f"torch {torch.__version__} cannot inline the hooks"
    with_fp8 = _held_for_backward(model, x, y, ctx)
    assert ctx.stored_tensors == 2  # ln_f's input and the head's, outside the compiled blocks
    assert abs(with_fp8 / without - predicted) < 0.03, (with_fp8, without, predicted)

