"""What can be checked on this machine before any process starts (`phalanx validate`, `run`, `agent`): the
recipe's model against the spec, each dataset against the model and the sequence length, and the command.
Every problem comes back as a SpecError naming its field, instead of a worker's traceback seconds later."""

from __future__ import annotations

import os
import shutil

from phalanx.spec import JobSpec, SpecError, SpecIssue

REMOTE_CHECK_S = 10.0


def preflight(spec: JobSpec, cwd: str | None = None, remote_data: bool = True) -> None:
    """Raise SpecError with every problem found. ``cwd``: the directory the job will run in, which relative
    paths are relative to (default: this process's; the server checks a job for the directory it came from).
    ``remote_data``: also read the indexes of datasets in object storage (the server does not: it may not hold
    the workers' credentials, and it answers a submission at once)."""
    issues = []
    if spec.train is not None:
        from phalanx.train.recipe import model_config

        cfg = model_config(spec)  # raises its own SpecError: the model is needed for the data checks
        issues += _data_issues(spec, cfg.vocab_size, cwd, remote_data)
    if spec.command is not None and (issue := _command_issue(spec.command[0], cwd)) is not None:
        issues.append(issue)
    if issues:
        raise SpecError(spec.name, issues)


def _command_issue(head: str, cwd: str | None) -> SpecIssue | None:
    if head in ("python", "python3"):
        return None  # this interpreter (launch/node.py)
    if os.sep in head:
        path = os.path.join(cwd or "", head)
        if not os.path.isfile(path):
            return SpecIssue("command", f"{head!r}: no such file")
        if not os.access(path, os.X_OK):
            return SpecIssue("command", f"{head!r} is not executable (chmod +x, or run it with python)")
        return None
    if shutil.which(head) is None:
        return SpecIssue("command", f"{head!r} is not a command on PATH; give its path or fix PATH")
    return None


def _data_issues(spec: JobSpec, vocab_size: int, cwd: str | None, remote: bool) -> list[SpecIssue]:
    """Open each prepared dataset's index (not its shards' checksums: the workers do that) and check it fits.
    A store that does not answer within ``REMOTE_CHECK_S`` is left to the workers, who try for longer."""
    from phalanx.data.builtin import PREFIX
    from phalanx.data.remote import CacheSettings, DataFetchError, open_dataset
    from phalanx.data.shards import DatasetError, is_url, too_short
    from phalanx.train.recipe import vocabulary_issue

    if spec.data is None or spec.train is None:
        return []
    issues, seq_len = [], spec.train.seq_len
    settings = CacheSettings(fetch_timeout_s=min(REMOTE_CHECK_S, spec.data.fetch_timeout_s))
    for i, source in enumerate(spec.data.sources):
        if source.path.startswith(PREFIX) or (is_url(source.path) and not remote):
            continue  # built-in (prepared by the workers on first use), or remote and left to the workers
        field = f"data.sources.{i}.path"
        try:
            path = source.path if is_url(source.path) else os.path.join(cwd or "", source.path)
            ds = open_dataset(path, "size", settings)
        except DatasetError as e:
            issues.append(SpecIssue(field, str(e)))
            continue
        except DataFetchError:  # the store does not answer now: the workers try for fetch_timeout_s
            continue
        if (issue := vocabulary_issue(vocab_size, ds.vocab_size, source.path)) is not None:
            issues.append(issue)
        if (short := too_short(ds, seq_len)) is not None:
            issues.append(SpecIssue(field, short))
    return issues
