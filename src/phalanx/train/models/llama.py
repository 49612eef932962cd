"""Llama 3 decoder: RMSNorm, rotary embeddings, SwiGLU, grouped-query attention, tied or untied embeddings.

Blocks live in ``layers`` (a ModuleDict keyed "0", "1", ...) so that parallelize can wrap, shard and
checkpoint them one by one. Attention reshapes with ``-1`` heads, so the same code runs whole or with its
heads split across tensor-parallel ranks.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from phalanx.train.models.args import LlamaConfig


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
