"""A small Llama-style byte-level language model and its tensor-parallel plan, for demos and benchmarks.

RMSNorm, rotary position embeddings, a SwiGLU MLP and grouped-query attention, on the same data
as ``demos.gpt`` (its ``load_corpus``, ``get_batch`` and ``lr_lambda`` are re-exported here).
``shard`` applies torch's own tensor parallelism (``parallelize_module`` with ``tp_plan``) and
FSDP2 (``fully_shard``) to it, ``Stage`` cuts it into pipeline stages (for
``torch.distributed.pipelining``), and ``clip_grad_norm`` clips gradients that live on several meshes.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from gpt import count_parameters, get_batch, load_corpus, lr_lambda  # demos/ is on the path, as for train_gpt.py
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel, parallelize_module

__all__ = [
    "SIZES",
    "Llama",
    "LlamaConfig",
    "Stage",
    "build_model",
    "clip_grad_norm",
    "count_parameters",
    "get_batch",
    "lm_loss",
    "load_corpus",
    "lr_lambda",
    "shard",
    "tp_plan",
]


@dataclass(frozen=True)
class LlamaConfig:
    vocab: int = 256  # bytes
    block: int = 64  # context length
    layers: int = 8
    dim: int = 384
    n_heads: int = 8
    n_kv_heads: int = 4
    hidden: int = 1024  # SwiGLU hidden size, about 8/3 * dim
    rope_theta: float = 10000.0
    eps: float = 1e-5

    def __post_init__(self) -> None:
        if self.dim % self.n_heads or self.n_heads % self.n_kv_heads or (self.dim // self.n_heads) % 2:
            raise ValueError(f"dim {self.dim}, n_heads {self.n_heads}, n_kv_heads {self.n_kv_heads} do not fit")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads


SIZES = {
    # About 13.2M parameters; heads, kv heads and hidden sizes divide by 2 and 4 (tensor-parallel degrees).
    "small": LlamaConfig(),
    # About 1.3M parameters, for fast tests; also divides by 2 and 4.
    "tiny": LlamaConfig(layers=2, dim=256, n_heads=8, n_kv_heads=4, hidden=512),
}


def rope_tables(head_dim: int, length: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the rotary angles, ``(length, head_dim)``, computed in float64 then rounded."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = torch.outer(torch.arange(length, dtype=torch.float64), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().float(), angles.sin().float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` of shape ``(batch, heads, time, head_dim)`` by position (the rotate-half form)."""
    first, second = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-second, first], dim=-1) * sin


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.head_dim = cfg.head_dim
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        batch, time, _ = x.shape
        # Head counts come from the outputs' runtime shapes: under tensor parallelism the
        # projections return local tensors holding n_heads / tp and n_kv_heads / tp heads.
        q, k, v = (w(x).view(batch, time, -1, self.head_dim).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        repeat = q.shape[1] // k.shape[1]
        if repeat > 1:  # grouped-query attention: query head h reads key/value head h // repeat
            k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(batch, time, -1))


class FeedForward(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.hidden, bias=False)  # gate
        self.w3 = nn.Linear(cfg.dim, cfg.hidden, bias=False)  # up
        self.w2 = nn.Linear(cfg.hidden, cfg.dim, bias=False)  # down

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.attention_norm = nn.RMSNorm(cfg.dim, eps=cfg.eps)
        self.attention = Attention(cfg)
        self.ffn_norm = nn.RMSNorm(cfg.dim, eps=cfg.eps)
        self.feed_forward = FeedForward(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin)
        return x + self.feed_forward(self.ffn_norm(x))


class Llama(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab, cfg.dim)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.norm = nn.RMSNorm(cfg.dim, eps=cfg.eps)
        self.head = nn.Linear(cfg.dim, cfg.vocab, bias=False)
        cos, sin = rope_tables(cfg.head_dim, cfg.block, cfg.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        time = idx.shape[1]
        cos, sin = self.rope_cos[:time], self.rope_sin[:time]
        x = self.tok(idx)
        for block in self.blocks:
            x = block(x, cos, sin)
        logits = self.head(self.norm(x))
        return logits, lm_loss(logits, targets)


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Next-byte cross entropy, averaged over the tokens."""
    return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.reshape(-1))


class Stage(nn.Module):
    """Pipeline stage `index` of `stages` cut from `model`: its share of the blocks, the embedding on the first stage,
    the final norm and the output head on the last (the whole model's own modules, so the weights are the same)."""

    def __init__(self, model: Llama, index: int, stages: int) -> None:
        super().__init__()
        layers = len(model.blocks)
        if layers % stages:
            raise ValueError(f"{layers} blocks do not split into {stages} pipeline stages")
        per = layers // stages
        self.tok = model.tok if index == 0 else None
        self.blocks = nn.ModuleList(model.blocks[index * per:(index + 1) * per])
        self.norm = model.norm if index == stages - 1 else None
        self.head = model.head if index == stages - 1 else None
        self.register_buffer("rope_cos", model.rope_cos, persistent=False)
        self.register_buffer("rope_sin", model.rope_sin, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Token ids (first stage) or hidden states in; hidden states or logits (last stage) out."""
        if self.tok is not None:
            x = self.tok(x)
        cos, sin = self.rope_cos[:x.shape[1]], self.rope_sin[:x.shape[1]]
        for block in self.blocks:
            x = block(x, cos, sin)
        if self.norm is not None and self.head is not None:
            x = self.head(self.norm(x))
        return x


def build_model(size: str = "small", seed: int = 0) -> Llama:
    """The same initial weights for every rank and every run with this seed."""
    torch.manual_seed(seed)
    return Llama(SIZES[size])


def tp_plan() -> dict[str, ParallelStyle]:
    """Megatron-style tensor parallelism for one block: heads and hidden units split across the tp ranks."""
    return {
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(),
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w3": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(),
    }


def shard(model: Llama | Stage, dp_mesh: DeviceMesh | None = None, tp_mesh: DeviceMesh | None = None) -> None:
    """Tensor-parallel blocks on ``tp_mesh``, then FSDP2 over ``dp_mesh`` (each block, then the rest).

    The embedding, the norms and the output head stay whole (replicated across the tp ranks).
    """
    for block in model.blocks:
        if tp_mesh is not None:
            parallelize_module(block, tp_mesh, tp_plan())
        if dp_mesh is not None:
            fully_shard(block, mesh=dp_mesh)
    if dp_mesh is not None:
        fully_shard(model, mesh=dp_mesh)


def clip_grad_norm(parameters: Iterable[torch.Tensor], max_norm: float,
                   pp_group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Clip gradients to a total 2-norm of ``max_norm``, in place; returns the total norm (a plain tensor).

    Unlike ``torch.nn.utils.clip_grad_norm_`` this works when the gradients are DTensors on different
    meshes (FSDP2 x TP: the tp parameters on the 2-D mesh, the rest on the dp mesh): each mesh's
    gradients (and the plain tensors, apart) get one norm, and the squares of those are summed; with
    `pp_group`, over the pipeline stages too (each holds its own parameters).
    """
    groups: dict[DeviceMesh | None, list[torch.Tensor]] = {}  # in first-seen order: the same on every rank
    for p in parameters:
        if p.grad is not None:
            groups.setdefault(p.grad.device_mesh if isinstance(p.grad, DTensor) else None, []).append(p)
    squares: list[torch.Tensor] = []
    for params in groups.values():
        norm = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        squares.append(norm.float().square())
    total = torch.stack(squares).sum() if squares else torch.zeros(())
    if pp_group is not None:
        dist.all_reduce(total, group=pp_group)
    total = total.sqrt()
    for params in groups.values():
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    return total
