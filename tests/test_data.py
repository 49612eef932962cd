"""The data layer: prepare (formats, tokenizers, resume, errors), the global sampler, blending, the loader."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from phalanx.data.loader import Prefetcher, TokenSource
from phalanx.data.prepare import STATE, prepare
from phalanx.data.sampler import BLOCK, GlobalSampler, feistel_permute
from phalanx.data.shards import DatasetError, TokenDataset

DOCS = ["hello world", "ünïcödé text ✓", "a third document, a little longer than the others", "x"]


def _stream(ds: TokenDataset) -> np.ndarray:
    return np.concatenate([ds.sample(0, ds.total_tokens - 1)])


def _byte_stream(docs: list[str]) -> list[int]:
    return [t for d in docs for t in [*d.encode(), 256]]


def test_prepare_text_jsonl_parquet_joins_documents_with_eos(tmp_path: Path) -> None:
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.txt").write_text(DOCS[0])
    (tmp_path / "in" / "b.jsonl").write_text("\n".join(json.dumps({"body": d}) for d in DOCS[1:3]) + "\n")
    pq.write_table(pa.table({"body": [DOCS[3]]}), tmp_path / "in" / "c.parquet")
    ds = prepare([tmp_path / "in"], tmp_path / "ds", field="body", progress=False)
    assert _stream(ds).tolist() == _byte_stream(DOCS)  # files in sorted order: a.txt, b.jsonl, c.parquet
    assert (ds.dtype.name, ds.vocab_size, ds.eos_id, ds.index["documents"]) == ("uint16", 257, 256, 4)


def test_shards_hold_whole_documents_and_cross_boundaries_on_read(tmp_path: Path) -> None:
    src = tmp_path / "docs.jsonl"
    docs = [f"document number {i} " * (i % 5 + 1) for i in range(200)]
    src.write_text("\n".join(json.dumps({"text": d}) for d in docs))
    ds = prepare([src], tmp_path / "ds", shard_tokens=500, progress=False, batch_docs=7)
    assert len(ds.shards) > 5
    assert _stream(ds).tolist() == _byte_stream(docs)
    for shard in ds.shards:  # each shard ends a document
        assert np.fromfile(tmp_path / "ds" / shard.file, dtype=ds.dtype)[-1] == ds.eos_id


def test_trained_bpe_and_tokenizer_json_round_trip(tmp_path: Path) -> None:
    from tokenizers import Tokenizer

    src = tmp_path / "docs.jsonl"
    docs = [f"the quick brown fox {i} jumps over the lazy dog" for i in range(300)]
    src.write_text("\n".join(json.dumps({"text": d}) for d in docs))
    ds = prepare([src], tmp_path / "bpe", tokenizer="bpe:300", progress=False)
    tok = Tokenizer.from_file(str(tmp_path / "bpe" / "tokenizer.json"))
    assert ds.vocab_size <= 300 and ds.eos_id == tok.token_to_id("<|endoftext|>")
    stream = _stream(ds).tolist()
    assert stream.count(ds.eos_id) == len(docs)
    first = stream[: stream.index(ds.eos_id)]
    assert tok.decode(first) == docs[0]
    # the same tokenizer, given as a tokenizer.json path, gives the same tokens
    again = prepare([src], tmp_path / "hf", tokenizer=str(tmp_path / "bpe" / "tokenizer.json"), progress=False)
    assert _stream(again).tolist() == stream


def test_interrupted_prepare_resumes_to_the_same_dataset(tmp_path: Path) -> None:
    src = tmp_path / "docs.jsonl"
    docs = [json.dumps({"text": f"doc {i} " * 20}) for i in range(100)]
    src.write_text("\n".join([*docs[:80], "{broken", *docs[80:]]))
    with pytest.raises(ValueError, match=r"docs.jsonl:81: not valid JSON"):
        prepare([src], tmp_path / "ds", shard_tokens=1000, progress=False, batch_docs=4)
    state = json.loads((tmp_path / "ds" / STATE).read_text())
    assert 0 < state["docs_done"] <= 80 and not (tmp_path / "ds" / "index.json").exists()
    with pytest.raises(DatasetError, match="did not finish"):
        TokenDataset(tmp_path / "ds")
    src.write_text("\n".join(docs))  # repaired; the documents before the break are not tokenized again
    resumed = prepare([src], tmp_path / "ds", shard_tokens=1000, progress=False, batch_docs=4)
    (tmp_path / "clean.jsonl").write_text("\n".join(docs))
    clean = prepare([tmp_path / "clean.jsonl"], tmp_path / "clean", shard_tokens=1000, progress=False, batch_docs=4)
    assert [s.sha256 for s in resumed.shards] == [s.sha256 for s in clean.shards]
    assert not (tmp_path / "ds" / STATE).exists()


def _small_dataset(root: Path) -> Path:
    src = root / "docs.jsonl"
    src.write_text("\n".join(json.dumps({"text": f"document {i} " * 30}) for i in range(60)))
    prepare([src], root / "ds", shard_tokens=2000, progress=False)
    return root / "ds"


@pytest.fixture
def small(tmp_path: Path) -> Path:
    """A dataset of several shards that the test may damage."""
    return _small_dataset(tmp_path)


@pytest.fixture(scope="module")
def shared(tmp_path_factory) -> TokenSource:
    """A read-only source over a dataset of several shards, seq_len 16."""
    return TokenSource([TokenDataset(_small_dataset(tmp_path_factory.mktemp("shared")))], [1.0], seq_len=16, seed=3)


def test_corrupt_truncated_and_missing_shards_are_named(small: Path) -> None:
    shard = small / "shard-00001.bin"
    data = bytearray(shard.read_bytes())
    data[10] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(DatasetError, match=r"shard-00001.bin: checksum mismatch"):
        TokenDataset(small)
    TokenDataset(small, verify="size")  # a flipped byte keeps the size: only the full check sees it
    shard.write_bytes(bytes(data[:-2]))
    with pytest.raises(DatasetError, match=r"shard-00001.bin: \d+ bytes, expected \d+ .*truncated"):
        TokenDataset(small, verify="size")
    shard.unlink()
    with pytest.raises(DatasetError, match=r"shard-00001.bin: shard missing"):
        TokenDataset(small)
    cli = subprocess.run(
        [sys.executable, "-m", "phalanx", "data", "verify", str(small)], capture_output=True, text=True
    )
    assert cli.returncode == 1 and "shard-00001.bin: shard missing" in cli.stderr


def test_bad_inputs_get_clear_errors(tmp_path: Path, small: Path) -> None:
    with pytest.raises(DatasetError, match=r"fewer than one sample of seq_len \+ 1 = 100001"):
        TokenSource([TokenDataset(small)], [1.0], seq_len=100_000, seed=0)
    (tmp_path / "x.jsonl").write_text('{"content": "hi"}\n')
    with pytest.raises(ValueError, match=r"x.jsonl:1: no text field 'text' \(found: content\)"):
        prepare([tmp_path / "x.jsonl"], tmp_path / "o1", progress=False)
    with pytest.raises(ValueError, match="no such file or directory"):
        prepare([tmp_path / "nope"], tmp_path / "o2", progress=False)
    with pytest.raises(ValueError, match="valid values are byte, bpe:VOCAB, or a path"):
        prepare([tmp_path / "x.jsonl"], tmp_path / "o3", tokenizer="sentencepiece", field="content", progress=False)


def test_vocabulary_larger_than_the_token_dtype_is_refused(tmp_path: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"w{i}": i for i in range(70_000)} | {"<|endoftext|>": 70_000, "[UNK]": 70_001}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "big.json"))
    (tmp_path / "d.txt").write_text("w1 w2 w69999")
    with pytest.raises(ValueError, match=r"--dtype uint16: the tokenizer has 70002 ids, more than uint16 holds"):
        prepare(
            [tmp_path / "d.txt"], tmp_path / "o", tokenizer=str(tmp_path / "big.json"), dtype="uint16", progress=False
        )
    ds = prepare([tmp_path / "d.txt"], tmp_path / "o", tokenizer=str(tmp_path / "big.json"), progress=False)
    assert ds.dtype.name == "uint32" and _stream(ds).tolist() == [1, 2, 69_999, 70_000]


@given(n=st.integers(1, 5000), key=st.integers(0, 2**64 - 1))
@settings(max_examples=60, deadline=None)
def test_feistel_is_a_permutation(n: int, key: int) -> None:
    image = feistel_permute(np.arange(n), n, key)
    assert np.array_equal(np.sort(image), np.arange(n))


@given(
    kills=st.lists(st.floats(0.0, 1.0), max_size=4),  # where in the epoch each kill falls
    world_sizes=st.lists(st.sampled_from([1, 2, 4]), min_size=5, max_size=5),
)
@settings(max_examples=40, deadline=None)
def test_resume_at_any_world_size_sees_every_sample_of_the_epoch_once(shared: TokenSource, kills, world_sizes):
    """Kill at random steps, restart each segment at a random data-parallel size: the epoch's samples and
    their tokens are exactly the uninterrupted run's."""
    global_batch, source = 8, shared
    n = source.sampler.sizes[0]
    steps = n // global_batch  # whole steps of the first epoch
    bounds = [0, *sorted({int(k * steps) for k in kills}), steps]
    seen, tokens = [], []
    for (start, stop), dp in zip(itertools.pairwise(bounds), world_sizes, strict=False):
        for step in range(start, stop):  # a restart: all the loader needs is the step
            for rank in range(dp):
                seen += source.locate(step, global_batch, rank, dp)[1].tolist()
                tokens.append(source.local_batch(step, global_batch, rank, dp))
    reference = [i for step in range(steps) for i in source.locate(step, global_batch)[1].tolist()]
    assert seen == reference
    assert Counter(seen) == Counter(reference) and len(set(seen)) == len(seen) == steps * global_batch
    whole = [source.local_batch(step, global_batch, 0, 1) for step in range(steps)]
    assert np.array_equal(np.concatenate(tokens), np.concatenate(whole))


def test_prefetcher_resumes_from_its_state(shared: TokenSource) -> None:
    source = shared
    straight = Prefetcher(source, 8, 1, 2, start_step=0)
    want = [straight.next() for _ in range(6)]
    straight.close()
    first = Prefetcher(source, 8, 1, 2, start_step=0)
    got = [first.next() for _ in range(4)]
    state = first.state_dict()
    first.close()
    assert state == {"step": 4}  # O(1): the step is the whole state
    second = Prefetcher(source, 8, 1, 2, start_step=state["step"])
    got += [second.next() for _ in range(2)]
    second.close()
    assert all(np.array_equal(a, b) for a, b in zip(got, want, strict=True))


def test_resume_position_costs_the_same_anywhere(shared: TokenSource, monkeypatch: pytest.MonkeyPatch) -> None:
    """Resuming at step 10 million reads what starting at step 0 reads: the batches of the steps it is asked
    for, the rows of those batches and no others (a position is computed, never replayed)."""
    dataset = shared.datasets[0]
    asked: list[int] = []
    rows: list[int] = []
    monkeypatch.setattr(shared, "locate", lambda step, *a, f=shared.locate: asked.append(step) or f(step, *a))
    monkeypatch.setattr(dataset, "samples", lambda i, n, f=dataset.samples: rows.append(len(i)) or f(i, n))
    for start in (0, 10_000_000):
        asked.clear()
        rows.clear()
        batch = Prefetcher(shared, 8, 0, 1, start_step=start)
        got = batch.next()
        batch.close()
        # the step taken, two queued (depth 2) and one read waiting to go in, at most
        assert asked == list(range(start, start + len(asked))) and 1 <= len(asked) <= 4
        assert rows == [8] * len(asked)  # each step's 8 rows, read at once
    monkeypatch.undo()
    assert np.array_equal(got, shared.local_batch(10_000_000, 8, 0, 1))


def test_blend_matches_its_weights_and_is_deterministic() -> None:
    weights = [0.6, 0.3, 0.1]
    a = GlobalSampler([5000, 200, 37], weights, seed=11)
    src, idx = a.locate(np.arange(10_000))
    mix = np.bincount(src, minlength=3) / 10_000
    assert np.all(np.abs(mix - weights) < 0.01), mix
    b = GlobalSampler([5000, 200, 37], weights, seed=11)
    assert all(np.array_equal(x, y) for x, y in zip((src, idx), b.locate(np.arange(10_000)), strict=True))
    # a small source is repeated epoch after epoch, each epoch a permutation of it
    small = idx[src == 2]
    assert all(sorted(small[e * 37 : (e + 1) * 37]) == list(range(37)) for e in range(len(small) // 37))
    # interleaved through each block, not in runs
    assert np.bincount(src[:BLOCK], minlength=3).tolist() == [600, 300, 100]


def test_builtin_stdlib_dataset_trains_with_fsdp_like_one_process(tmp_path: Path) -> None:
    from conftest import REPO, Job

    env = {**os.environ, "PHALANX_CACHE": str(tmp_path / "cache")}
    losses = []
    for procs in (1, 2):
        job = Job(tmp_path / f"p{procs}")
        job.tmp.mkdir()
        spec = job.spec(
            f"name: t\nresources: {{procs_per_node: {procs}, device: cpu}}\n"
            "train: {model: {preset: llama-tiny, vocab_size: 320}, steps: 4, global_batch: 8, micro_batch: 4,"
            " seq_len: 32, optimizer: {warmup_steps: 1}}\ndata: {sources: [{path: 'builtin:stdlib'}]}\n"
        )
        run = subprocess.run(job.argv(spec), capture_output=True, text=True, timeout=300, cwd=REPO, env=env)
        assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
        losses.append([json.loads(line)["loss"] for line in (job.run_dir() / "metrics.jsonl").open()])
    assert losses[0] == pytest.approx(losses[1], rel=1e-5)
    index = json.loads((tmp_path / "cache" / "datasets" / "stdlib-byte" / "index.json").read_text())
    assert index["total_tokens"] > 1_000_000 and index["tokenizer"] == {"kind": "byte"}


def test_batched_reads_equal_one_by_one_reads_across_shard_boundaries(shared: TokenSource) -> None:
    ds = shared.datasets[0]
    assert len(ds.shards) > 3
    indices = np.arange(shared.sampler.sizes[0])  # every sample, so every boundary-crossing window too
    rows = ds.samples(indices, 16)
    assert all(np.array_equal(rows[i], ds.sample(int(i), 16)) for i in indices)
