"""Warm spares forked from a template process (a zygote): a spare's start costs a fork, not Python's and
torch's imports and a warm-up.

A spare started beside training takes its CPU from training. Its imports alone are about 2 s of CPU here
(torch, torch.distributed, the recipe), its warm-up about one more; on a host whose cores the ranks keep
busy that was the larger part of what a failure cost beyond the recovery itself (bench/RESULTS.md). The
zygote, started with the attempt's first spares, imports the worker's module once, runs its ``warm()`` (the
recipe's code paths on a miniature model) and then only waits; each spare is a fork of it, sharing its
memory copy-on-write, warm, and runs the module's ``main()``. Forking is safe there because the zygote keeps
nothing that does not survive a fork: its warm-up runs on the CPU, on one thread (no OpenMP pool), and
destroys its process group.

The supervisor talks to it over a Unix socket (``SOCK_SEQPACKET``: one message per request or answer). A
request carries the spare's environment and its CPU priority, and, as a passed file descriptor, the write
end of the pipe its output goes to; the zygote answers each request, in order, with the spare's pid, and
later with its exit status, which only the zygote, its parent, can wait for. Each spare runs in a session of
its own, as every worker does, and dies with the zygote, which dies with the supervisor (parent-death
signals).

``Zygote`` starts the zygote as ``python -c "...; serve(<socket fd>, <module>)"``: as ``python -m`` it would
run a module its package has imported already, which Python warns of.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import importlib
import json
import os
import queue
import select
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Mapping
from typing import IO, Generic, TypeVar

from phalanx.launch import priority
from phalanx.launch.lifetime import die_with_parent

MESSAGE = 1 << 20  # the largest message: an environment
Tag = TypeVar("Tag")


class Forked:
    """A process the zygote forked, as the worker group sees a ``subprocess.Popen``: pid, stdout, wait(),
    returncode (negative for a signal, as Popen's)."""

    def __init__(self, pid: int, stdout: IO[bytes]):
        self.pid, self.stdout = pid, stdout
        self.returncode: int | None = None
        self._exited = threading.Event()

    def wait(self, timeout: float | None = None) -> int | None:
        self._exited.wait(timeout)
        return self.returncode

    def poll(self) -> int | None:
        return self.returncode

    def _exit(self, returncode: int) -> None:
        self.returncode = returncode
        self._exited.set()


class Zygote(Generic[Tag]):
    """The supervisor's side: start the zygote for ``module`` with ``env``; ``fork`` asks it for a process,
    ``forked`` gives those it has forked since, each with the tag it was asked with."""

    def __init__(self, module: str, env: Mapping[str, str]):
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        entry = f"import sys; from {__name__} import serve; serve(*sys.argv[1:])"
        self.proc = subprocess.Popen(
            [sys.executable, "-c", entry, str(theirs.fileno()), module],
            env=dict(env),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,  # its errors (an import that fails) go to the supervisor's stderr
            pass_fds=(theirs.fileno(),),
            start_new_session=True,
            preexec_fn=functools.partial(die_with_parent, os.getpid()),
        )
        theirs.close()
        self._sock = ours
        self._lock = threading.Lock()
        self._asked: collections.deque[tuple[Tag, int]] = collections.deque()  # tags and read ends, in order
        self._running: dict[int, Forked] = {}
        self._forked: queue.SimpleQueue[tuple[Tag, Forked]] = queue.SimpleQueue()
        threading.Thread(target=self._listen, name="zygote", daemon=True).start()

    def fork(self, tag: Tag, env: Mapping[str, str], nice: int = priority.NORMAL) -> None:
        """Ask for a process with ``env`` whose session runs at ``nice`` (launch/priority.py); ``forked`` gives
        it back with ``tag``."""
        read, write = os.pipe()
        with self._lock:
            self._asked.append((tag, read))
            try:
                socket.send_fds(self._sock, [json.dumps({"env": dict(env), "nice": nice}).encode()], [write])
            except OSError:  # the zygote is gone: no answer will come
                self._asked.pop()
                os.close(read)
        os.close(write)

    def forked(self) -> list[tuple[Tag, Forked]]:
        done = []
        with contextlib.suppress(queue.Empty):
            while True:
                done.append(self._forked.get_nowait())
        return done

    def _listen(self) -> None:
        while True:
            try:
                message = self._sock.recv(MESSAGE)
            except OSError:
                message = b""
            if not message:  # the zygote ended: its children died with it (their parent-death signal)
                with self._lock:
                    for process in self._running.values():
                        process._exit(-signal.SIGKILL)
                    while self._asked:
                        os.close(self._asked.popleft()[1])
                return
            answer = json.loads(message)
            with self._lock:
                if "exited" in answer:
                    self._running.pop(answer["exited"])._exit(answer["returncode"])
                else:
                    tag, read = self._asked.popleft()
                    process = Forked(answer["pid"], os.fdopen(read, "rb"))
                    self._running[process.pid] = process
                    self._forked.put((tag, process))

    def stop(self) -> None:
        """Kill the zygote and with it every process it forked."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        self._sock.close()


def serve(fd: str, module: str) -> None:
    """The zygote, on the socket ``fd``: import ``module`` and run its ``warm()`` if it has one, then fork a
    process for each request and report how each ends, as soon as it ends (each child's pidfd is waited on
    with the socket)."""
    sock = socket.socket(fileno=int(fd))
    if (warm := getattr(importlib.import_module(module), "warm", None)) is not None:
        warm()
    children: dict[int, int] = {}  # pidfd -> pid
    while True:
        for ready in select.select([sock, *children], [], [])[0]:
            if ready in children:
                pid = children.pop(ready)
                os.close(ready)
                status = os.waitpid(pid, 0)[1]
                sock.send(json.dumps({"exited": pid, "returncode": os.waitstatus_to_exitcode(status)}).encode())
                continue
            message, fds, _, _ = socket.recv_fds(sock, MESSAGE, 1)
            if not message:  # the supervisor is gone
                return
            request = json.loads(message)
            pid = os.fork()
            if pid == 0:
                sock.close()
                for pidfd in children:
                    os.close(pidfd)
                _become(module, request["env"], request["nice"], fds[0])
            os.close(fds[0])
            children[os.pidfd_open(pid)] = pid
            sock.send(json.dumps({"pid": pid}).encode())


def _become(module: str, env: dict[str, str], nice: int, output: int) -> None:
    """In a fresh fork: become a worker that runs ``module``'s ``main()`` with ``env``, and exit as such a
    worker would (an exception, ``sys.exit`` or the end of ``main()`` ends the interpreter); never returns."""
    os.setsid()
    die_with_parent(os.getppid())
    priority.set_session_nice(os.getpid(), nice)
    os.dup2(output, 1)
    os.dup2(output, 2)
    os.close(output)
    os.environ.clear()
    os.environ.update(env)
    importlib.import_module(module).main()
    sys.exit(0)
