"""A small GPT-style byte-level language model and its data, for demos and benchmarks.

The text is the Python standard library's own sources (every Python install
has them), read in a fixed order.  Batches are a pure function of
``(seed, step, rank)``, so a rank that rolls back and recomputes a step sees
exactly the same data: no loader state to snapshot.
"""

from __future__ import annotations

import math
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass(frozen=True)
class GPTConfig:
    vocab: int = 256  # bytes
    block: int = 64  # context length
    layers: int = 4
    heads: int = 4
    width: int = 256
    dropout: float = 0.1


SIZES = {
    # name: (layers, width) -> about 3.3M and 50M parameters with the default block and vocab
    "small": (4, 256),
    "large": (8, 704),
}


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.width)
        self.qkv = nn.Linear(cfg.width, 3 * cfg.width)
        self.proj = nn.Linear(cfg.width, cfg.width)
        self.ln2 = nn.LayerNorm(cfg.width)
        self.fc = nn.Linear(cfg.width, 4 * cfg.width)
        self.out = nn.Linear(4 * cfg.width, cfg.width)
        self.drop = nn.Dropout(cfg.dropout)
        self.heads = cfg.heads
        self.dropout = cfg.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, time, width = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(width, dim=2)
        shape = (batch, time, self.heads, width // self.heads)
        q, k, v = (t.view(shape).transpose(1, 2) for t in (q, k, v))
        attn = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
        )
        x = x + self.drop(self.proj(attn.transpose(1, 2).reshape(batch, time, width)))
        return x + self.drop(self.out(F.gelu(self.fc(self.ln2(x)))))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab, cfg.width)
        self.pos = nn.Embedding(cfg.block, cfg.width)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.ln = nn.LayerNorm(cfg.width)
        self.head = nn.Linear(cfg.width, cfg.vocab, bias=False)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        positions = torch.arange(idx.shape[1], device=idx.device)
        x = self.drop(self.tok(idx) + self.pos(positions))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln(x))
        loss = F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.reshape(-1))
        return logits, loss


def build_model(size: str = "small", seed: int = 0, dropout: float = 0.1) -> GPT:
    """The same initial weights for every rank and every run with this seed."""
    layers, width = SIZES[size]
    torch.manual_seed(seed)
    return GPT(GPTConfig(layers=layers, width=width, dropout=dropout))


def load_corpus(max_bytes: int = 4 << 20) -> torch.Tensor:
    """The standard library's .py sources, in sorted path order, as a byte tensor."""
    root = Path(sysconfig.get_paths()["stdlib"])
    sources: list[Path] = []
    for here, folders, names in os.walk(root):  # not into site-packages (torch's thousands of files) or tests
        folders[:] = [name for name in folders if name not in ("site-packages", "test")]
        sources += [Path(here, name) for name in names if name.endswith(".py")]
    chunks: list[bytes] = []
    total = 0
    for path in sorted(sources):
        try:
            data = path.read_bytes()
        except OSError:
            continue
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    corpus = b"".join(chunks)[:max_bytes]
    return torch.frombuffer(bytearray(corpus), dtype=torch.uint8).long()


def get_batch(
    corpus: torch.Tensor, step: int, rank: int, batch: int, block: int, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Batch of (inputs, targets) that depends only on (seed, step, rank)."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + step * 1_009 + rank)
    starts = torch.randint(0, corpus.numel() - block - 1, (batch,), generator=generator)
    rows = torch.stack([corpus[s : s + block + 1] for s in starts.tolist()])
    return rows[:, :-1], rows[:, 1:]


def pick_device(kind: str) -> torch.device:
    """The worker's device: the CPU, or GPU ``LOCAL_RANK % device count`` with deterministic kernels.

    A GPU run is bit-identical to another only when every kernel is deterministic, so this
    turns on ``torch.use_deterministic_algorithms`` (and the cuBLAS workspace it needs),
    before any CUDA work.
    """
    if kind == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device is visible to this process")
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS
    torch.use_deterministic_algorithms(True, warn_only=True)  # a missing one warns; the digests tell
    device = torch.device("cuda", max(0, int(os.environ.get("LOCAL_RANK", "0"))) % torch.cuda.device_count())
    torch.cuda.set_device(device)
    return device


def lr_lambda(warmup: int, total: int):  # type: ignore[no-untyped-def]
    """Linear warmup then cosine decay, as a LambdaLR factor."""

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, total - warmup)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    return factor


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
