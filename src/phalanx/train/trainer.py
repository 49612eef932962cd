"""The built-in recipe's training loop: gradient accumulation to the global batch, AdamW, warmup then
cosine / linear / constant LR, grad-norm clipping, deterministic seeding, the loss reported as the global mean."""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import math
import signal
import statistics
import time
from collections import deque
from dataclasses import dataclass
from typing import NoReturn

import torch
import torch.distributed as dist
import torch.nn.functional as F

from phalanx.checkpoint import CheckpointManager
from phalanx.checkpoint.interval import choose, default_mtbf_hours
from phalanx.data.loader import BatchSource, Prefetcher, TokenSource
from phalanx.data.synthetic import SyntheticTokens
from phalanx.obs.events import Event
from phalanx.obs.metrics import mfu, peak_flops, peak_memory_bytes
from phalanx.obs.progress import step_line
from phalanx.obs.protocol import NoRecovery
from phalanx.spec import SpecError, dump_spec
from phalanx.spec.model import Optimizer
from phalanx.train.ft import InProcess, loss_fault
from phalanx.train.guard import LossGuard
from phalanx.train.parallelize import build_mesh, build_model
from phalanx.train.pipeline import Pipeline, bubble_fraction
from phalanx.train.recipe import model_config, vocabulary_issue
from phalanx.train.sdk import WorkerContext
from phalanx.train.state import RNG, ModelAndOptimizer, Progress
from phalanx.train.timing import ForwardComputeTimer


def lr_factor(opt: Optimizer, steps: int, step: int) -> float:
    """Multiplier of the peak LR at ``step`` (0-based): linear warmup, then decay to ``min_lr_ratio``."""
    if step < opt.warmup_steps:
        return (step + 1) / opt.warmup_steps
    if opt.schedule == "constant":
        return 1.0
    progress = (step - opt.warmup_steps) / max(1, steps - opt.warmup_steps)
    shape = 0.5 * (1 + math.cos(math.pi * progress)) if opt.schedule == "cosine" else 1 - progress
    return opt.min_lr_ratio + (1 - opt.min_lr_ratio) * shape


@dataclass(frozen=True)
class StepStats:
    step: int
    loss: float
    grad_norm: float
    lr: float
    step_time_s: float  # wall time since the previous step ended (what happens between steps included)
    data_wait_s: float  # of step_time_s, waiting for the batch
    checkpoint_writing: bool  # a background save was writing as the step began
    stop: bool = False  # some rank was asked to stop (SIGTERM): checkpoint now and exit
    problem: str | None = None  # why the step was bad (NaN/Inf, a spike) and its update not applied


class Trainer:
    def __init__(self, ctx: WorkerContext):
        assert ctx.spec is not None and ctx.spec.train is not None and ctx.spec.parallel is not None
        self.ctx, self.train, self.parallel = ctx, ctx.spec.train, ctx.spec.parallel
        t = self.train
        self.cfg = model_config(ctx.spec)
        self.data = self._data_source()
        self.accum_steps = ctx.spec.microbatches
        # Without FSDP there is no mixed-precision policy to cast for us: autocast does it.
        self.autocast = (
            torch.autocast(ctx.device.type, dtype=torch.bfloat16)
            if t.precision == "bf16" and self.parallel.dp == 1
            else contextlib.nullcontext()
        )
        self.flops_per_token = self.cfg.flops_per_token(t.seq_len)
        self.bubble = bubble_fraction(self.parallel, self.accum_steps) if self.parallel.pp > 1 else None
        self._poison = 1.0
        self.peak = peak_flops(ctx.device, t.precision, t.peak_tflops)
        self.progress = Progress()
        self._preempted_at: float | None = None
        self.guard = LossGuard(ctx.spec.resilience.loss_spike_factor, ctx.spec.resilience.on_nan)
        self._checkpoint_s = 0.0
        self._last_step_end: float | None = None
        self._step_times: deque[float] = deque(maxlen=20)  # recent steps' wall times, for every_steps: auto
        self._interval_chosen = False  # every_steps: auto has chosen from measured costs (said once, then changes)
        # The run's start, for the hours a failure rate is measured over (every_steps: auto).
        self._run_started = (ctx.run_dir.started_at() if ctx.run_dir is not None else None) or time.time()
        self._build(weights=ctx.generation == 0)
        resilience = ctx.spec.resilience
        # In-process recovery: the state in memory, this rank's and a neighbour's (train/ft.py).
        self.ft = InProcess(ctx) if resilience.in_process else None
        if self.ft is not None and ctx.generation > 0:  # a warm spare in a failed rank's place: state from peers
            decided = self.ft.joining()
            self.checkpoints.last_saved = self.ft.restore(
                self.in_memory, decided["ranks"], decided["reached"], _Stored(self)
            )
        elif (latest := self.checkpoints.latest_valid()) is not None:
            self.checkpoints.load(latest, self.state)
            self._say(f"resumed from {latest.path} at step {self.progress.step}")
        self.batches = self._batches()
        if ctx.is_main:
            print(self.describe(), flush=True)

    def _build(self, weights: bool) -> None:
        """What lives on the process group: the mesh, the sharded model and its optimizer, the checkpoints.
        Built again by an in-process recovery, on the new group (``weights`` off: they are about to be
        restored, so they are not initialised)."""
        ctx, t = self.ctx, self.train
        assert ctx.spec is not None
        self.mesh = build_mesh(ctx.device.type, self.parallel)
        # Seeded: the same initial weights on every rank, and the same as a 1-process run.
        self.model, stages = build_model(self.cfg, self.mesh, t, ctx.device, ctx.device.type == "cuda", weights)
        self.pipeline = (
            Pipeline(stages, self.parallel, self.mesh.mesh["pp"], ctx.device, self.accum_steps, self._loss)
            if self.parallel.pp > 1
            else None
        )
        self.compute = ForwardComputeTimer(list(self.model.layers.values()), ctx.device)
        o = t.optimizer
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=o.lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay, foreach=True
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda s: lr_factor(o, t.steps, s))
        self.checkpoints = CheckpointManager(
            ctx.checkpoint_location(),
            ctx.spec.checkpoint,
            layout=self.parallel.model_dump(),
            spec_hash=hashlib.sha256(dump_spec(ctx.spec).encode()).hexdigest()[:16],
            model={"preset": t.model.preset, **dataclasses.asdict(self.cfg)},
            device=ctx.device,
            log=self._say,
            event=ctx.event,
        )
        self.state = {
            "train": ModelAndOptimizer(self.model, self.optimizer),
            "scheduler": self.scheduler,
            "rng": RNG(),
            "progress": self.progress,
        }
        # In memory the layout never changes, so the model and optimizer keep their native state dicts.
        self.in_memory = {
            "model": self.model,
            "optimizer": self.optimizer,
            **{k: v for k, v in self.state.items() if k != "train"},
        }

    def _batches(self) -> Prefetcher:
        """The global batches from the current step on, this rank's share of each."""
        t = self.train
        return Prefetcher(self.data, t.global_batch, self.mesh.dp_rank, self.parallel.dp, self.progress.step)

    def _data_source(self) -> BatchSource:
        """The spec's datasets, or the synthetic token source when the spec names none."""
        spec, t = self.ctx.spec, self.train
        assert spec is not None
        if spec.data is None:
            return SyntheticTokens(self.cfg.vocab_size, t.seq_len, t.seed)
        source = TokenSource.from_spec(spec.data, t.seq_len, t.seed)
        if (issue := vocabulary_issue(self.cfg.vocab_size, source.vocab_size, "the datasets")) is not None:
            raise SpecError(spec.name, [issue])
        return source

    def describe(self) -> str:
        """One line saying what runs where: the model, the mesh, and how much of the model this rank holds."""
        p = self.parallel
        local = sum(getattr(w, "to_local", lambda w=w: w)().numel() for w in self.model.parameters())
        total = self.cfg.num_params()
        block = type(next(iter(self.model.layers.values()))).__name__  # shows the checkpoint / compile wrappers
        pipeline = (
            [f"pipeline {p.pp_schedule}, {p.stages} stages, bubble {self.bubble:.1%} in theory"] if self.bubble else []
        )
        return " | ".join(
            [
                f"model {self.train.model.preset}: {total:,} params, {self.flops_per_token:.3g} FLOPs/token",
                f"mesh pp={p.pp} dp_replicate={p.dp_replicate} dp_shard={p.dp_shard} tp={p.tp}",
                *pipeline,
                f"rank {self.ctx.rank} holds {local:,} params ({local / total:.1%})",
                f"{self.accum_steps} micro-batch(es) of {self.train.micro_batch} per step",
                f"blocks run as {block}, {self.train.precision}",
            ]
        )

    def train_step(self) -> StepStats:
        t, started = self.train, time.perf_counter()
        since = self._last_step_end if self._last_step_end is not None else started
        step, writing = self.progress.step, self.checkpoints.writing
        batch = self.batches.next().to(self.ctx.device, non_blocking=True)
        data_wait = time.perf_counter() - started
        self._poison, reported = loss_fault(self.ctx, self.pipeline is not None)  # phalanx chaos nan|spike
        loss_sum = torch.zeros((), device=self.ctx.device)
        if self.pipeline is not None:
            with self.autocast:
                losses = self.pipeline.step(batch[:, :-1], batch[:, 1:])
            loss_sum += sum(loss.detach() for loss in losses)
        else:
            for micro in batch.split(t.micro_batch):
                with self.autocast:
                    loss = self._loss(self.model(micro[:, :-1]), micro[:, 1:])
                (loss / self.accum_steps).backward()
                loss_sum += loss.detach()
        norm = self._clip_grad_norm(t.optimizer.grad_clip or math.inf)
        # Before the update, every rank learns the step's loss and whether some rank was asked to stop, so all
        # of them agree on whether to apply it and where to stop. Every rank of a tensor-parallel group holds
        # the same loss, and so does every rank that runs the pipeline's last stage (the others none): the
        # sum over all ranks over world / pp is the data-parallel mean.
        stopping = torch.tensor(float(self._preempted_at is not None), device=self.ctx.device)
        totals = torch.stack([loss_sum / self.accum_steps, stopping, torch.tensor(reported, device=stopping.device)])
        dist.all_reduce(totals)
        loss_sum, stopping, reported = totals.tolist()
        loss_mean = loss_sum / (self.ctx.world_size // self.parallel.pp) * (1 + reported)
        if self.ft is not None:  # the last memory snapshot's copy, done before anything changes the state
            self._checkpoint_s += self.ft.memory.copied()
        problem = self.guard.problem(loss_mean, norm)
        lr = self.scheduler.get_last_lr()[0]
        if problem is None:  # a bad step changes nothing; resilience.on_nan decides what happens next
            self.guard.good(loss_mean)
            waiting = time.perf_counter()
            self.checkpoints.staged()  # an async save may still be copying the weights the step changes
            self._checkpoint_s += time.perf_counter() - waiting
            self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.progress.step += 1
        if self.ctx.device.type == "cuda":
            torch.cuda.synchronize(self.ctx.device)  # the clock reads when the step's GPU work ended, not its launch
        self._last_step_end = time.perf_counter()
        took = self._last_step_end - since
        return StepStats(step, loss_mean, norm, lr, took, data_wait, writing, stop=stopping > 0, problem=problem)

    def _loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """A micro-batch's mean cross-entropy (times the injected fault's factor, 1 but under `phalanx chaos`)."""
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten()) * self._poison

    def _clip_grad_norm(self, max_norm: float) -> float:
        """Clip the gradients to ``max_norm`` by their norm over the whole model; that norm. A pipeline rank
        holds its stages' gradients only: the squares of the stages' norms add up over the pipeline ranks."""
        params = list(self.model.parameters())
        norm = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
        if hasattr(norm, "full_tensor"):  # a DTensor: summed over the data- and tensor-parallel shards
            norm = norm.full_tensor()
        if self.pipeline is not None:
            squared = norm**2
            dist.all_reduce(squared, group=self.mesh.mesh["pp"].get_group())
            norm = squared.sqrt()
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
        return norm.item()

    def report(self, s: StepStats) -> None:
        tokens = self.train.global_batch * self.train.seq_len
        tps = tokens / s.step_time_s
        per_device = tps / self.ctx.world_size
        util = mfu(self.flops_per_token, per_device, self.peak)
        mem = peak_memory_bytes(self.ctx.device)
        figures = {
            "loss": s.loss,
            "grad_norm": s.grad_norm,
            "lr": s.lr,
            "step_time_s": s.step_time_s,
            "data_wait_s": s.data_wait_s,
            "checkpoint_s": self._checkpoint_s,  # training blocked by checkpoints since the previous report
            "checkpoint_writing": s.checkpoint_writing,  # its extra cost: the ledger compares it with other steps
            "compute_s": self.compute.take(),  # this rank's own forward compute: in its heartbeat, for stragglers
            "tokens_per_s": tps,
            "tokens_per_s_per_device": per_device,
            "mfu": util,
            "bubble": self.bubble,
            "peak_memory_bytes": mem,
            **self.batches.figures(),  # from object storage: bytes fetched, cache hits, the wait for chunks
        }
        self.ctx.report(s.step, **figures)
        self._step_times.append(s.step_time_s)
        self._checkpoint_s = 0.0
        if self.ctx.is_main and not self.ctx.supervised:  # under phalanx the supervisor shows the progress
            print(step_line({"step": s.step, **figures}, self.train.steps), flush=True)

    def _say(self, message: str) -> None:
        if self.ctx.is_main:
            print(message, flush=True)

    def fit(self) -> None:
        signal.signal(signal.SIGTERM, self._on_sigterm)
        try:
            if self.ft is not None:
                self.ft.snapshot(self.progress.step, self.in_memory, first=True)
            while self.progress.step < self.train.steps:
                try:
                    self._step()
                except RuntimeError as e:
                    if self.ft is None or not self.ft.recovers(e):
                        raise
                    self._recover(e)
        finally:
            self.batches.close()
        if self.ft is not None:
            self.ft.memory.close()
        self.checkpoints.close()

    def _step(self) -> None:
        """One step, and what follows it: the in-memory snapshot, the checkpoint, a bad step's handling."""
        stats = self.train_step()
        self.report(stats)
        if stats.stop:
            self._save_and_stop()
        if stats.problem is not None and self._after_bad_step(stats):
            return  # rolled back: progress is the checkpoint's step, saved already
        step = self.progress.step
        if self.ft is not None:
            self._checkpoint_s += self.ft.snapshot(step, self.in_memory)
        if self.checkpoints.due(step) or step == self.train.steps:
            cost = self.checkpoints.blocked_s  # the previous save's, whole by now (its copy waited for too)
            saving = time.perf_counter()
            self.checkpoints.save(step, self.state)
            self._checkpoint_s += time.perf_counter() - saving
            if self.ctx.spec.checkpoint.every_steps == "auto" and cost > 0:
                self._retune(cost)

    def _retune(self, cost_s: float) -> None:
        """checkpoint.every_steps: auto: the next interval, by Young/Daly, from the last save's cost, the recent
        step time and the failures so far; every rank decides from the same figures (their maximum)."""
        assert self.ctx.spec is not None
        resilience, world = self.ctx.spec.resilience, self.ctx.world_size
        run_s = time.time() - self._run_started
        figures = torch.tensor([cost_s, statistics.median(self._step_times), run_s], dtype=torch.float64)
        dist.all_reduce(figures, op=dist.ReduceOp.MAX)
        cost, step_s, run_s = figures.tolist()
        prior = resilience.mtbf_hours or default_mtbf_hours(world)
        chosen = choose(cost, step_s, prior, self.ctx.attempt + self.ctx.generation, run_s / 3600)
        if chosen.steps != self.checkpoints.every or not self._interval_chosen:  # the first even if it is 10
            self._say(chosen.why())
            self.ctx.event(Event.CHECKPOINT_INTERVAL, **dataclasses.asdict(chosen))
        self.checkpoints.every, self._interval_chosen = chosen.steps, True

    def _recover(self, error: RuntimeError) -> None:
        """A peer died in a collective: wait for the supervisor's recovery (a warm spare in its place), join
        its process group, rebuild on it and restore the state from memory (train/ft.py)."""
        assert self.ctx.spec is not None and self.ft is not None
        began = time.perf_counter()
        decided = self.ft.decision(error)
        self.ft.memory.settle()  # a trade in flight ends (given up on, now that a recovery began) before its group
        self.batches.close()
        self.checkpoints.abandon(self.ft.timeout_s)
        every = self.checkpoints.every  # an automatic interval tuned so far is kept
        del (
            self.state,
            self.in_memory,
            self.model,
            self.optimizer,
            self.scheduler,
            self.compute,
            self.checkpoints,
            self.mesh,
        )
        with self.ft.rebuilding():
            self.ctx.rejoin(self.ctx.generation + 1)
        self._build(weights=False)
        self.ft.memory.bind()
        self.checkpoints.every = every
        step = self.ft.restore(self.in_memory, decided["ranks"], decided["reached"], _Stored(self), began=began)
        self.checkpoints.last_saved = step
        self.batches = self._batches()
        self._last_step_end = None

    def _after_bad_step(self, s: StepStats) -> bool:
        """Apply resilience.on_nan (train/guard.py) to a step whose loss or grad norm was NaN/Inf or whose loss
        spiked (its update was not applied). Returns True if the state was rolled back to the last checkpoint."""
        what = f"{s.problem} at step {s.step + 1}"
        if self.guard.bad(s.step, what):
            self.checkpoints.wait()
            if (latest := self.checkpoints.latest_valid()) is not None:
                self.guard.rolled_back(s.step)
                self.checkpoints.load(latest, self.state)
                self.batches.close()
                self.batches = self._batches()
                self._say(f"{what}: rolled back to the checkpoint of step {latest.step}, replaying from it")
                self.ctx.event(
                    Event.BAD_STEP_ROLLBACK, step=s.step + 1, to_step=latest.step, loss=s.loss, problem=s.problem
                )
                return True
        policy = self.guard.on_nan
        self._say(f"{what}: batch skipped (resilience.on_nan: {policy})")
        self.ctx.event(Event.BAD_STEP_SKIPPED, step=s.step + 1, loss=s.loss, problem=s.problem, policy=policy)
        return False

    def _on_sigterm(self, signum: int, _frame: object) -> None:
        """Preemption: note it; the loop checkpoints at the end of the step every rank agrees on, then exits."""
        self._preempted_at = time.monotonic()

    def _save_and_stop(self) -> NoReturn:
        """The emergency save: synchronous, committed before the supervisor's grace period (resilience.stop_grace_s)
        runs out and it sends SIGKILL; then exit as a process stopped by SIGTERM does."""
        assert self.ctx.spec is not None
        step = self.progress.step
        if self.ft is not None:
            self.ft.memory.close()  # every rank stops at this step: its trade ends
        self.checkpoints.save(step, self.state, sync=True)
        self.checkpoints.close()
        since = time.monotonic() - self._preempted_at if self._preempted_at is not None else 0.0
        print(  # by every rank, into its own log: each says where it stopped
            f"rank {self.ctx.rank} stopped by SIGTERM: emergency checkpoint of step {step} committed {since:.1f} s "
            f"after the signal (grace {self.ctx.spec.resilience.stop_grace_s:g} s)",
            flush=True,
        )
        self.ctx.event(Event.PREEMPTED, step=step, saved_after_s=since)
        raise SystemExit(128 + signal.SIGTERM)


@dataclass(frozen=True)
class _Stored:
    """The trainer's storage checkpoints, as an in-process recovery falls back on them (train/ft.py)."""

    trainer: Trainer

    def newest(self) -> int | None:
        return self.trainer.checkpoints.newest_committed()

    def load(self, step: int) -> int:
        """Load the newest checkpoint that verifies (``step``'s, unless it does not); its step."""
        checkpoints = self.trainer.checkpoints
        latest = checkpoints.latest_valid()
        if latest is None:
            raise NoRecovery(f"the checkpoint of step {step} does not verify, nor does any older one")
        checkpoints.load(latest, self.trainer.state)
        return latest.step
