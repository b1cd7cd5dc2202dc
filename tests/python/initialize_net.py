"""The model and data the fp8amp.initialize tests train (test_initialize.py,
test_initialize_optimizer.py): a small token model with every kind of parameter initialize must
handle, two param groups, seeded token batches, and the real value of a (possibly scaled) tensor."""

from __future__ import annotations

import torch
from torch import nn

import fp8amp
from fp8amp import ScaledTensor

E4M3, FP16 = torch.float8_e4m3fn, torch.float16


class Net(nn.Module):
    """Biased and bias-less Linears, a Linear pair sharing one weight, a frozen Linear, a LayerNorm,
    an embedding tied to an (unconverted-by-sharing) head, and a Linear FP8 cannot take (24 wide)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(64, 32)
        self.up = nn.Linear(32, 64)
        self.down = nn.Linear(64, 32, bias=False)
        self.shared_a = nn.Linear(32, 32)
        self.shared_b = nn.Linear(32, 32)
        self.shared_b.weight = self.shared_a.weight
        self.frozen = nn.Linear(32, 32)
        self.frozen.requires_grad_(False)
        self.norm = nn.LayerNorm(32)
        self.odd = nn.Linear(32, 24)
        self.head = nn.Linear(32, 64, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.emb(tokens)
        h = h + self.down(torch.relu(self.up(h)))
        h = h + self.shared_b(torch.tanh(self.shared_a(h)))
        h = self.norm(self.frozen(h))
        return self.head(h) + self.odd(h).sum(-1, keepdim=True)


def net(seed=0, device="cpu"):
    torch.manual_seed(seed)
    return Net().to(device)


def groups(model):
    """Two param groups with different lr / weight decay (matrices, and the rest)."""
    params = [p for p in model.parameters() if p.requires_grad]
    mats = [p for p in params if p.dim() == 2]
    rest = [p for p in params if p.dim() != 2]
    return [dict(params=mats, lr=2e-3, weight_decay=0.1), dict(params=rest, lr=5e-3, weight_decay=0.0)]


def tokens(step, n=48, device="cpu"):
    gen = torch.Generator().manual_seed(1000 + step)
    return torch.randint(0, 64, (n + 1,), generator=gen).to(device)


def loss_of(model, step, device="cpu"):
    t = tokens(step, device=device)
    return nn.functional.cross_entropy(model(t[:-1]), t[1:])


def setup(level="O2", cls=torch.optim.AdamW, seed=0):
    model = net(seed)
    return fp8amp.initialize(model, cls(groups(model)), level)


def real(t):
    return t.dequantize(torch.float32) if isinstance(t, ScaledTensor) else t.float()
