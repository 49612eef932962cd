"""Llama 3 decoder: RMSNorm, rotary embeddings, SwiGLU, grouped-query attention, tied or untied embeddings.

Blocks live in ``layers`` (a ModuleDict keyed "0", "1", ...) so that parallelize can wrap, shard and
checkpoint them one by one. Attention reshapes with ``-1`` heads, so the same code runs whole or with its
heads split across tensor-parallel ranks.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class LlamaConfig:
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    vocab_size: int
    ffn_dim: int
    norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    max_seq_len: int = 8192
    tie_embeddings: bool = False

    def __post_init__(self) -> None:
        if self.dim % self.n_heads:
            raise ValueError(f"model.dim = {self.dim} must be divisible by model.n_heads = {self.n_heads}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"model.n_heads = {self.n_heads} must be divisible by model.n_kv_heads = {self.n_kv_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(f"head dim dim / n_heads = {self.head_dim} must be even for rotary embeddings")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    def num_params(self, include_embedding: bool = True) -> int:
        """Exact parameter count of ``Llama(self)``."""
        kv = self.n_kv_heads * self.head_dim
        attention = self.dim * self.dim * 2 + self.dim * kv * 2  # wq, wo; wk, wv
        block = attention + 3 * self.dim * self.ffn_dim + 2 * self.dim  # SwiGLU + two norms
        embedding = self.vocab_size * self.dim
        total = self.n_layers * block + self.dim + embedding * (1 if self.tie_embeddings else 2)
        return total if include_embedding else total - embedding

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token, the PaLM / torchtitan convention: 6N + 12·L·H·Q·T.

        6N: forward (2N) and backward (4N) matmul FLOPs of the N non-embedding parameters (the output
        projection counts; the embedding lookup is no matmul). 12·L·H·Q·T: attention scores and values,
        L layers, H heads, Q head dim, T sequence length, forward and backward, without causal savings.
        """
        n = self.num_params(include_embedding=False)
        if self.tie_embeddings:  # the shared matrix is still multiplied once, as the output projection
            n += self.vocab_size * self.dim
        return 6 * n + 12 * self.n_layers * self.n_heads * self.head_dim * seq_len


def _ffn_dim(dim: int, multiplier: float, multiple_of: int) -> int:
    """Meta's SwiGLU hidden size: 2/3 of 4·dim, scaled, rounded up to a multiple."""
    hidden = int(multiplier * int(2 * 4 * dim / 3))
    return multiple_of * math.ceil(hidden / multiple_of)


PRESETS: dict[str, LlamaConfig] = {
    # test sizes: tiny (131k params) for multi-process CPU tests, debug (4M) for the CPU demo
    "llama-tiny": LlamaConfig(
        dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=256, ffn_dim=192, max_seq_len=2048
    ),
    "llama-debug": LlamaConfig(
        dim=256, n_layers=4, n_heads=8, n_kv_heads=4, vocab_size=2048, ffn_dim=768, max_seq_len=2048
    ),
    "llama3-1b": LlamaConfig(
        dim=2048,
        n_layers=16,
        n_heads=32,
        n_kv_heads=8,
        vocab_size=128256,
        ffn_dim=_ffn_dim(2048, 1.5, 256),
        tie_embeddings=True,
    ),
    "llama3-3b": LlamaConfig(
        dim=3072,
        n_layers=28,
        n_heads=24,
        n_kv_heads=8,
        vocab_size=128256,
        ffn_dim=_ffn_dim(3072, 1.0, 256),
        tie_embeddings=True,
    ),
    "llama3-8b": LlamaConfig(
        dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, vocab_size=128256, ffn_dim=_ffn_dim(4096, 1.3, 1024)
    ),
    "llama3-70b": LlamaConfig(
        dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, vocab_size=128256, ffn_dim=_ffn_dim(8192, 1.3, 4096)
    ),
}


def config_from(preset: str, **overrides: int | bool | None) -> LlamaConfig:
    """A preset with the given fields replaced; ``ffn_dim`` follows a changed ``dim``."""
    if preset not in PRESETS:
        raise ValueError(f"train.model.preset = {preset!r} is not a preset; valid: {', '.join(PRESETS)}")
    base = PRESETS[preset]
    changes = {k: v for k, v in overrides.items() if v is not None}
    if "dim" in changes and "ffn_dim" not in changes:
        changes["ffn_dim"] = _ffn_dim(changes["dim"], 1.0, 64)
    return dataclasses.replace(base, **changes)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).type_as(x) * self.weight


def rope_tables(head_dim: int, seq_len: int, theta: float) -> torch.Tensor:
    """cos and sin of every (position, frequency) pair, stacked: [2, seq_len, head_dim // 2]."""
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float32), freqs)
    return torch.stack([angles.cos(), angles.sin()])


def apply_rope(x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    """Rotate channel pairs (2i, 2i+1) of x [batch, seq, heads, head_dim] by their position's angle."""
    cos, sin = (t[: x.shape[1]].view(1, x.shape[1], 1, -1) for t in rope)
    pairs = x.float().unflatten(-1, (-1, 2))
    even, odd = pairs[..., 0], pairs[..., 1]
    rotated = torch.stack([even * cos - odd * sin, even * sin + odd * cos], dim=-1)
    return rotated.flatten(-2).type_as(x)


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.head_dim = cfg.head_dim
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        bsz, seq, _ = x.shape
        q = self.wq(x).view(bsz, seq, -1, self.head_dim)
        k = self.wk(x).view(bsz, seq, -1, self.head_dim)
        v = self.wv(x).view(bsz, seq, -1, self.head_dim)
        q, k = apply_rope(q, rope), apply_rope(k, rope)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, enable_gqa=True
        )
        return self.wo(out.transpose(1, 2).reshape(bsz, seq, -1))


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.feed_forward = FeedForward(cfg.dim, cfg.ffn_dim)

    def forward(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), rope)
        return h + self.feed_forward(self.ffn_norm(h))


class Llama(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleDict({str(i): Block(cfg) for i in range(cfg.n_layers)})
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        self.tie_weights()
        self.register_buffer("rope", rope_tables(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta), persistent=False)
        self.init_weights()

    def tie_weights(self) -> None:
        """With ``tie_embeddings``, the output projection is the embedding matrix: one parameter, one gradient."""
        if self.cfg.tie_embeddings and self.tok_embeddings is not None and self.output is not None:
            self.output.weight = self.tok_embeddings.weight

    def keep_only(self, blocks: list[str], first: bool, last: bool) -> None:
        """Drop every module a pipeline rank does not run: the blocks not in ``blocks``, the embedding unless
        it runs the first stage, the final norm and output projection unless it runs the last. The names of
        what is kept do not change, so its state dict is the whole model's, restricted."""
        for name in [n for n in self.layers if n not in blocks]:
            del self.layers[name]
        if not first:
            self.tok_embeddings = None
        if not last:
            self.norm = self.output = None

    def stage(self, blocks: list[str], first: bool, last: bool) -> Llama:
        """A pipeline stage: a model made of some of this one's modules (shared, not copied)."""
        stage = Llama.__new__(Llama)
        nn.Module.__init__(stage)
        stage.cfg = self.cfg
        stage.tok_embeddings = self.tok_embeddings if first else None
        stage.layers = nn.ModuleDict({name: self.layers[name] for name in blocks})
        stage.norm, stage.output = (self.norm, self.output) if last else (None, None)
        stage.register_buffer("rope", self.rope, persistent=False)
        return stage

    def init_buffers(self, device: torch.device | None = None) -> None:
        """The rotary tables: what a model materialised by ``to_empty`` needs besides its weights (on
        ``device``, by default where they are)."""
        tables = rope_tables(self.cfg.head_dim, self.cfg.max_seq_len, self.cfg.rope_theta)
        self.rope = tables.to(device or self.rope.device)

    @torch.no_grad()
    def init_weights(self) -> None:
        """Normal(0, 0.02) for inputs, depth-scaled for the projections that write into the residual stream.
        Also (re)computes the rotary tables, so a model built on the meta device can be materialised by
        ``to_empty``, then ``tie_weights``, then this."""
        self.init_buffers()
        residual_std = 0.02 / math.sqrt(2 * self.cfg.n_layers)
        for name, p in self.named_parameters():
            if name.endswith("norm.weight"):
                nn.init.ones_(p)
            elif name.endswith(("wo.weight", "w2.weight")):
                nn.init.trunc_normal_(p, std=residual_std, a=-3 * residual_std, b=3 * residual_std)
            else:
                nn.init.trunc_normal_(p, std=0.02, a=-0.06, b=0.06)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits [batch, seq, vocab] for tokens [batch, seq]. A pipeline stage without the embedding takes the
        hidden states [batch, seq, dim] instead; one without the output projection returns them."""
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        for block in self.layers.values():
            h = block(h, self.rope)
        return self.output(self.norm(h)) if self.output is not None else h
