"""Llama 3's shapes: the model's arguments and the named presets, apart from the model (``llama.py``), as
torchtitan keeps ``model/args.py``: the spec's checks, the server and the CLI read them without torch."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass


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
