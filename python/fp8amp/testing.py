"""Built-in data, a small GPT and its training step, shared by the examples, tests and benchmarks.

The data is text every machine with Python has: the standard library's own ``.py`` sources,
read at run time as bytes (vocabulary 256). Nothing is downloaded and nothing foreign is
copied into the repository. A user's own text file can be given instead.
"""

from __future__ import annotations

import contextlib
import math
import os
import sysconfig
from dataclasses import dataclass
from typing import Iterator, Optional

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["load_text_bytes", "batches", "GPTConfig", "GPT", "train_step"]


def load_text_bytes(path: Optional[str] = None, max_bytes: int = 64 << 20) -> torch.Tensor:
    """Returns up to ``max_bytes`` of text as a uint8 tensor.

    ``path``: a text file or a directory of ``.py`` files; by default the standard library's
    sources (``sysconfig.get_paths()["stdlib"]``), read in sorted order so every run sees the
    same bytes.
    """
    if max_bytes <= 0:
        raise ValueError(f"max_bytes must be positive, got {max_bytes}")
    root = path or sysconfig.get_paths()["stdlib"]
    if os.path.isfile(root):
        with open(root, "rb") as f:
            data = f.read(max_bytes)
    elif os.path.isdir(root):
        chunks, total = [], 0
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames.sort()
            dirnames[:] = [d for d in dirnames if d not in ("site-packages", "dist-packages", "__pycache__")]
            for name in sorted(filenames):
                if not name.endswith(".py"):
                    continue
                with open(os.path.join(dirpath, name), "rb") as f:
                    chunk = f.read(max_bytes - total)
                chunks.append(chunk)
                total += len(chunk)
                if total >= max_bytes:
                    break
            if total >= max_bytes:
                break
        data = b"".join(chunks)
    else:
        raise ValueError(f"path must be a text file or a directory of .py files, got {root!r}")
    if len(data) < 2:
        raise ValueError(f"path {root!r} holds too little text to train on ({len(data)} bytes)")
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def batches(
    data: torch.Tensor, batch_size: int, seq_len: int, device: torch.device | str = "cpu", seed: int = 0
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Endless (input, target) pairs of random windows of ``data``, as int64 [batch, seq]."""
    if data.numel() <= seq_len + 1:
        raise ValueError(f"seq_len ({seq_len}) must be shorter than the data ({data.numel()} bytes)")
    g = torch.Generator().manual_seed(seed)
    offsets = torch.arange(seq_len + 1)
    while True:
        starts = torch.randint(0, data.numel() - seq_len - 1, (batch_size, 1), generator=g)
        window = data[starts + offsets].long()
        yield window[:, :-1].to(device, non_blocking=True), window[:, 1:].to(device, non_blocking=True)


@dataclass
class GPTConfig:
    vocab_size: int = 256
    seq_len: int = 256
    n_layer: int = 4
    n_head: int = 4
    d_model: int = 256
    mlp_ratio: int = 4
    dropout: float = 0.0


class _Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_head = cfg.n_head
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=False)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.fc1 = nn.Linear(cfg.d_model, cfg.mlp_ratio * cfg.d_model)
        self.fc2 = nn.Linear(cfg.mlp_ratio * cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.n_head, c // self.n_head).unbind(2)
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x)), approximate="tanh"))


class GPT(nn.Module):
    """A plain pre-norm GPT: embeddings, attention + MLP blocks, a tied output head."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        if cfg.d_model % cfg.n_head:
            raise ValueError(f"d_model ({cfg.d_model}) must be divisible by n_head ({cfg.n_head})")
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.blocks = nn.ModuleList(_Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.apply(self._init)
        for name, p in self.named_parameters():
            if name.endswith(("proj.weight", "fc2.weight")):
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def forward(self, idx: torch.Tensor, targets: Optional[torch.Tensor] = None):
        t = idx.shape[1]
        if t > self.cfg.seq_len:
            raise ValueError(f"sequence length {t} exceeds the model's seq_len {self.cfg.seq_len}")
        x = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))
        for block in self.blocks:
            x = block(x)
        logits = F.linear(self.ln_f(x), self.tok.weight)
        if targets is None:
            return logits
        return logits, F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.reshape(-1))

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor, *,
               forward: Optional[nn.Module] = None, scheduler=None, max_norm: float = 1.0,
               saved_tensors_hooks: Optional[torch.autograd.graph.saved_tensors_hooks] = None) -> torch.Tensor:
    """One step of the training recipe the examples, benchmarks and tests share: the forward of
    ``forward`` (default ``model``; e.g. its compiled form) under bfloat16 autocast on CUDA (in
    float32 on the CPU, where FP8 is emulated) and inside ``saved_tensors_hooks`` if given (e.g.
    ``fp8amp.save_activations_in_fp8()``, entered anew each step), backward, gradient clipping of
    ``model``'s parameters to ``max_norm``, the optimizer step, ``zero_grad(set_to_none=True)`` and
    the scheduler's step. Returns the loss, detached (no host sync)."""
    autocast = (torch.autocast("cuda", dtype=torch.bfloat16) if x.device.type == "cuda"
                else contextlib.nullcontext())
    with autocast, saved_tensors_hooks or contextlib.nullcontext():
        # `is None`, not truthiness: a compiled module's truth value raises on newer torch
        _, loss = (model if forward is None else forward)(x, y)
    loss.backward()
    # foreach=True: with fp8amp's ScaledTensor gradients in the list, torch's default would norm and
    # scale them one tensor at a time (a few launches each); for plain gradients it is the default.
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm, foreach=True)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    if scheduler is not None:
        scheduler.step()
    return loss.detach()
