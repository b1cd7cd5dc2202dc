"""The whole training step in one CUDA graph (GPU): forward, backward, gradient clipping, the
optimizer step and fp8amp's delayed-scaling update, captured once with ``torch.cuda.graph`` and
replayed, give bit for bit what the same steps give in eager mode, at every level (FP8 compute with
torch's capturable AdamW, O1 and O2 with fp8amp's optimizer, O2 with FP8 activations), with each
recipe (tensorwise, rowwise, blockwise).

That holds because nothing in a step reads device values on the host: scales, amax histories, the
warm-up counters and the optimizer's step counts live on the device, so the captured kernels make
the same decisions at replay that eager code makes. The replays run past the delayed-scaling
warm-up (history_len = 16 steps), so the switch from current to delayed scaling happens inside
the graph. The network avoids ops whose CUDA backward adds with atomics (attention, embeddings),
so eager runs are reproducible bit for bit and any difference is the graph's.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fp8amp
from fp8amp import Fp8Linear, ScaledTensor
from fp8amp.testing import train_step

pytestmark = pytest.mark.gpu

WARMUP = 3   # eager steps before the capture: the optimizer creates its state in the first
REPLAYS = 20  # steps 4-23: across the switch from current to delayed scaling at step 16
TOKENS = 72  # not a multiple of 16: Fp8Linear's padded path
WIDTH = 128


class Net(nn.Module):
    """Two residual MLP blocks with LayerNorm and biases; ``forward(x, y)`` returns (out, MSE loss)
    as ``fp8amp.testing.train_step`` expects."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(WIDTH), nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(), nn.Linear(4 * WIDTH, WIDTH))
            for _ in range(2))
        self.head = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor, y: torch.Tensor):
        for block in self.blocks:
            x = x + block(x)
        out = self.head(x)
        return out, nn.functional.mse_loss(out.float(), y)


def setup(mode: str, recipe: str = "tensorwise"):
    torch.manual_seed(0)
    model = Net().cuda()
    level = mode.removesuffix("-fp8act")
    # torch's AdamW must be capturable to be captured; initialize passes the flag on to fp8amp's
    # optimizer, which accepts it (it always is).
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1, capturable=True)
    if level == "fp8":  # FP8 compute: float32 weights, torch's AdamW
        fp8amp.convert(model, optimizer=optimizer, policy="all", recipe=recipe)
    else:
        model, optimizer = fp8amp.initialize(model, optimizer, level, policy="all", recipe=recipe)
        assert isinstance(model.head.weight, ScaledTensor)
    assert sum(isinstance(m, Fp8Linear) for m in model.modules()) == 5
    hooks = fp8amp.save_activations_in_fp8() if mode.endswith("-fp8act") else None
    return model, optimizer, hooks


def data():
    gen = torch.Generator(device="cuda").manual_seed(1)
    target = torch.randn(WIDTH, WIDTH, device="cuda", generator=gen) / WIDTH ** 0.5
    out = []
    for _ in range(WARMUP + REPLAYS):
        x = torch.randn(TOKENS, WIDTH, device="cuda", generator=gen)
        out.append((x, x @ target))
    return out


def snapshot(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """Every parameter (real values and, for masters, their codes, scale and E4M3 copy), buffer
    (the scaling states) and optimizer state tensor, cloned."""
    out = {}
    for name, p in model.named_parameters():
        if isinstance(p, ScaledTensor):
            out[name + ".codes"] = p._data.clone()
            out[name + ".scale_inv"] = p._scale_inv.clone()
            for i, t in enumerate(p.fp8_copy or ()):
                out[f"{name}.fp8_copy{i}"] = t.clone()
        else:
            out[name] = p.detach().clone()
    for name, b in model.named_buffers():
        out[name] = b.clone()
    for i, state in enumerate(optimizer.state.values()):
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                out[f"opt{i}.{key}"] = value.clone()
    return out


def assert_bit_identical(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in a:
        x, y = a[key], b[key]
        assert x.dtype == y.dtype and x.shape == y.shape, key
        assert torch.equal(x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8)), key  # bits


def eager_and_replayed(mode: str, recipe: str = "tensorwise"):
    """The steps of ``data()`` in eager mode, and WARMUP eager steps then REPLAYS replays of one
    captured step: (eager losses, eager snapshot, the losses, the model, the optimizer, the input
    scaling counters right after the capture)."""
    batches = data()

    model, optimizer, hooks = setup(mode, recipe)
    eager_losses = [train_step(model, optimizer, x, y, saved_tensors_hooks=hooks) for x, y in batches]
    torch.cuda.synchronize()
    eager = snapshot(model, optimizer)

    model, optimizer, hooks = setup(mode, recipe)
    static_x, static_y = (t.clone() for t in batches[0])
    side = torch.cuda.Stream()  # warm-up on a side stream, as torch.cuda.graph asks
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        losses = [train_step(model, optimizer, x, y, saved_tensors_hooks=hooks) for x, y in batches[:WARMUP]]
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_loss = train_step(model, optimizer, static_x, static_y, saved_tensors_hooks=hooks)
    counters = [m.input_scaling.counter.clone() for m in model.modules() if isinstance(m, Fp8Linear)]
    for x, y in batches[WARMUP:]:
        static_x.copy_(x)
        static_y.copy_(y)
        graph.replay()
        losses.append(static_loss.clone())
    torch.cuda.synchronize()
    return eager_losses, eager, losses, model, optimizer, counters


@pytest.mark.parametrize("mode", ["fp8", "O1", "O2", "O2-fp8act"])
def test_whole_step_in_a_cuda_graph_matches_eager(mode):
    eager_losses, eager, losses, model, optimizer, counters = eager_and_replayed(mode)
    # The capture ran nothing (the counters stayed at the warm-up's); the replays made the steps.
    assert all(int(c.max()) <= WARMUP for c in counters)
    assert int(model.head.input_scaling.counter.max()) >= 16
    assert torch.equal(torch.stack(losses), torch.stack(eager_losses))
    assert_bit_identical(snapshot(model, optimizer), eager)
    assert torch.isfinite(torch.stack(losses)).all() and losses[-1] < losses[0]


@pytest.mark.parametrize("recipe", ["rowwise", "blockwise"])
@pytest.mark.parametrize("mode", ["fp8", "O1", "O2", "O2-fp8act"])
def test_tiled_recipes_step_in_a_cuda_graph_matches_eager(recipe, mode):
    """The tiled recipes (current tile scales; blockwise pads the 72 tokens to 128): their casts,
    tile GEMMs (the scale copies into cuBLASLt's layouts, the workspace from torch's allocator)
    and, at O1/O2, the masters' per-forward tile casts and the per-tensor E4M3 weight gradients
    capture and replay bit for bit as eager steps."""
    eager_losses, eager, losses, model, optimizer, _ = eager_and_replayed(mode, recipe)
    assert all(m.recipe.kind == recipe for m in model.modules() if isinstance(m, Fp8Linear))
    assert torch.equal(torch.stack(losses), torch.stack(eager_losses))
    assert_bit_identical(snapshot(model, optimizer), eager)
    assert torch.isfinite(torch.stack(losses)).all() and losses[-1] < losses[0]
