"""``phalanx data``: prepare tokenized datasets and check them."""

from __future__ import annotations

from pathlib import Path

import typer

from phalanx.cli.common import err

data_app = typer.Typer(no_args_is_help=True, help="Prepare and check tokenized datasets.")


@data_app.command("prepare")
def data_prepare(
    sources: list[Path] = typer.Argument(..., help="text files, .jsonl, .parquet, or directories of them"),
    out: str = typer.Option(..., "--out", help="the dataset directory to write, or an fsspec URL (s3://bucket/prefix)"),
    tokenizer: str = typer.Option("byte", help="byte | bpe:VOCAB (trained on the inputs) | path to tokenizer.json"),
    field: str = typer.Option("text", help="the text field of JSON lines / column of Parquet"),
    shard_tokens: int = typer.Option(1 << 26, help="tokens per shard (shards hold whole documents)"),
    eos_token: str = typer.Option(None, help="end-of-document token of a tokenizer.json (default: detected)"),
    dtype: str = typer.Option(None, help="uint16 | uint32 (default: the smallest that holds the vocabulary)"),
    chunk_bytes: int = typer.Option(1 << 20, help="the unit a remote reader fetches and checks (multiple of 4)"),
) -> None:
    """Tokenize documents into memory-mapped shards with a checksummed index; rerun to resume if interrupted."""
    from phalanx.data.prepare import prepare

    try:
        ds = prepare(
            sources,
            out,
            tokenizer=tokenizer,
            field=field,
            shard_tokens=shard_tokens,
            eos_token=eos_token,
            dtype=dtype,
            chunk_bytes=chunk_bytes,
        )
    except (ValueError, OSError) as e:
        err.print(f"[bold red]cannot prepare[/] {out}: {e}", highlight=False)
        raise typer.Exit(2) from None
    err.print(
        f"{out}: {ds.index['documents']:,} documents, {ds.total_tokens:,} tokens in {len(ds.shards)} "
        f"shard(s), {ds.dtype.name}, vocabulary {ds.vocab_size:,}",
        highlight=False,
    )


@data_app.command("verify")
def data_verify(dataset: str = typer.Argument(..., help="a prepared dataset directory, or its URL (s3://...)")) -> None:
    """Check every shard against the index (size and sha256); exit 1 naming the first bad file."""
    from phalanx.data.remote import DataFetchError, RemoteShards, open_dataset
    from phalanx.data.shards import DatasetError

    try:
        ds = open_dataset(dataset)
        if isinstance(ds.reader, RemoteShards):
            ds.reader.verify()
    except (DatasetError, DataFetchError) as e:
        err.print(f"[bold red]bad dataset[/]: {e}", highlight=False)
        raise typer.Exit(1) from None
    err.print(f"{dataset}: ok, {len(ds.shards)} shard(s), {ds.total_tokens:,} tokens", highlight=False)


def register(app: typer.Typer) -> None:
    app.add_typer(data_app, name="data")
