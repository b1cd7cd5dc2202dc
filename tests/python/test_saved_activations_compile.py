"""fp8amp.save_activations_in_fp8 under torch.compile: compiled graphs store their activations in
FP8 (the graph pass's quantize bit for bit the kernels'), compiled GPT and O2 blocks keep their
statistics, unbind items and the logits the backward needs; the filtering mode's scope; graphs
without the hooks warn; entering the context inside fullgraph code raises."""

from __future__ import annotations

import contextlib
import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch._dynamo.utils import counters

import fp8amp
from fp8amp import E4M3, ScaledTensor, saved_activations, saved_activations_graph
from fp8amp.ops._args import has_row_runs
from fp8amp.testing import GPT, GPTConfig, batches, load_text_bytes, train_step
from saved_activations_reference import FORMATS, SQNR_FLOOR_DB, held_for_backward, sqnr_db


needs_graph_hooks = pytest.mark.skipif(
    not saved_activations_graph._graph_hooks_supported(),
    reason="this torch does not inline saved-tensor hooks into compiled graphs")


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


class NormMasterHead(nn.Module):
    """A LayerNorm, an Linear converted at O2 (its weight a master: several graph inputs) and a
    Linear kept in high precision after it."""

    def __init__(self) -> None:
        super().__init__()
        self.norm, self.body, self.head = nn.LayerNorm(256), nn.Linear(256, 256), nn.Linear(256, 256)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.body(self.norm(x))))


@needs_graph_hooks
def test_compiled_graph_keeps_the_parameters_after_a_master_as_eager_does():
    """Torch 2.15 marks a graph's static inputs (parameters, buffers) by their positions before an
    O1/O2 master is split into its inner tensors, so every input after the master read another
    input's mark: the head's weight (its autocast copy) was stored in FP8, 4 % off eager in the
    input gradient. The compiled step now gives eager's gradients, and still stores the graph's
    input, which the LayerNorm saves."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    base = NormMasterHead()
    model, _ = fp8amp.initialize(base, torch.optim.AdamW(base.parameters()), "O2",
                                 module_filter_fn=lambda m, name: name != "head", policy="all")
    data = torch.randn(64, 256)

    def grads(forward):
        x = data.clone().requires_grad_()
        with fp8amp.save_activations_in_fp8(min_numel=1024), torch.autocast("cpu", dtype=torch.bfloat16):
            out = forward(x * 2)  # x * 2: an activation as the graph's input
        held = held_for_backward(out)
        out.float().square().sum().backward()
        result = [x.grad, model.head.weight.grad.clone(), model.body.bias.grad.clone()]
        model.zero_grad()
        return result, held

    eager, _ = grads(model)
    compiled, held = grads(torch.compile(model, backend="aot_eager"))
    for e, c in zip(eager, compiled):
        assert torch.equal(c, e)
    assert held[torch.float8_e4m3fn] >= data.numel()  # the input, stored (with the ReLU's output)
    assert held[torch.float32] < 2 * 256 * 256  # the head's float32 weight, not its FP8-stored copy


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
    # (x * 2 inside the graph: a view of a graph input is stored only where torch marks the input
    # non-static, 2.15 but not 2.11; see _is_graph_activation)
    compiled = torch.compile(lambda t: attention(t * 2), backend="inductor")
    held = {}
    for name, ctx in (("plain", None), ("fp8", fp8amp.save_activations_in_fp8(min_numel=1024))):
        with ctx or contextlib.nullcontext():
            held[name] = held_for_backward(compiled(x))
    weights = sum(p.numel() * 4 for n, p in attention.named_parameters() if n.endswith("weight"))
    activation_numel = x.numel()  # the input, q, k, v and SDPA's output each hold as many
    assert held["fp8"][torch.float8_e4m3fn] == 5 * activation_numel
    assert 0 < held["fp8"][torch.float32] - weights < 0.02 * (held["plain"][torch.float32] - weights)


@needs_graph_hooks
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_compiled_model_keeps_the_logits_its_backward_exponentiates(device):
    """The whole GPT compiled: Inductor's backward recomputes log_softmax from the saved logits as
    exp(logits - max - log-sum-exp), where a relative rounding of the logits would become an error
    of the exponent; the logits are kept float32, the blocks' activations stored. Every gradient
    within E4M3's floor: with torch 2.11's Inductor, whose fused kernels had read an amax buffer
    before the amax op wrote it, LayerNorm weights' gradients were noise (0.1 dB)."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    torch._dynamo.reset()
    torch.manual_seed(0)
    cfg = GPTConfig(seq_len=64, n_layer=1, n_head=4, d_model=128)
    model = GPT(cfg).to(device)
    idx = torch.randint(0, 256, (4, 64), generator=torch.Generator().manual_seed(0)).to(device)
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
