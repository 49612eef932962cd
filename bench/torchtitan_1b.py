"""torchtitan 0.2.2's Llama 3 trainer on the shape of phalanx's llama3-1b, for bench/gpu.py.

torchtitan's own llama3 model and trainer, with the Llama 3.2 1B arguments (dim 2048, 16 layers, 32 heads,
8 KV heads, FFN 8192, vocab 128256) and the output projection tied to the embedding, as Meta's 1B and
phalanx's preset have it: this torchtitan release ships neither a 1B flavour nor tying. The tie is restored
in ``init_weights``, which the trainer calls after materialising the meta-device model (``to_empty`` gives
each module a tensor of its own). Loaded by ``--experimental.custom_import torchtitan_1b`` with
``--model.name llama3_1b_bench --model.flavor 1B``.
"""

from __future__ import annotations

import dataclasses

import torch
from torchtitan.models.llama3 import Transformer, TransformerModelArgs, get_train_spec
from torchtitan.protocols.train_spec import register_train_spec

NAME, FLAVOR = "llama3_1b_bench", "1B"
ARGS = TransformerModelArgs(
    dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_dim_multiplier=1.5, multiple_of=256, rope_theta=500000
)


class TiedTransformer(Transformer):
    def __init__(self, model_args: TransformerModelArgs):
        super().__init__(model_args)
        self.output.weight = self.tok_embeddings.weight

    def init_weights(self, buffer_device: torch.device | None = None) -> None:
        self.output.weight = self.tok_embeddings.weight
        super().init_weights(buffer_device=buffer_device)


register_train_spec(NAME, dataclasses.replace(get_train_spec(), model_cls=TiedTransformer, model_args={FLAVOR: ARGS}))
