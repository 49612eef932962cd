"""torchtitan's Llama 3 1B training config for bench/gpu.py: its registry's "1B" model (dim 2048, 16 layers,
32 heads, 8 KV heads, vocab 128256, tied embeddings: the shape of phalanx's llama3-1b) with bf16 and
torch.compile, on a local dataset and tokenizer that bench/gpu.py writes (nothing can be downloaded).
torchtitan loads it by module path: ``--module torchtitan_1b --config llama3_1b_bench``."""

from __future__ import annotations

import dataclasses
import os

from torchtitan.components.loss import ChunkedLossWrapper, CrossEntropyLoss
from torchtitan.config import CompileConfig, TrainingConfig
from torchtitan.hf_datasets.text_datasets import HuggingFaceTextDataLoader
from torchtitan.models.common.config_utils import decoder_vocab_size
from torchtitan.models.llama3 import model_registry
from torchtitan.models.llama3.config_registry import llama3_debugmodel


def llama3_1b_bench():
    env = os.environ
    model_spec = model_registry("1B")
    base = llama3_debugmodel()
    return dataclasses.replace(
        base,
        model_spec=model_spec,
        loss=ChunkedLossWrapper.Config(
            loss_fn=CrossEntropyLoss.Config(global_vocab_size=decoder_vocab_size(model_spec))
        ),
        hf_assets_path=env["BENCH_TOKENIZER"],
        dataloader=HuggingFaceTextDataLoader.Config(dataset="c4_test", dataset_path=env["BENCH_DATASET"]),
        training=TrainingConfig(
            local_batch_size=int(env["BENCH_BATCH"]), seq_len=int(env["BENCH_SEQ_LEN"]), steps=int(env["BENCH_STEPS"])
        ),
        parallelism=dataclasses.replace(base.parallelism, pipeline_parallel_schedule="1F1B"),
        compile=CompileConfig(enable=True, components=["model", "loss"]),
        dump_folder=env["BENCH_DUMP"],
    )
