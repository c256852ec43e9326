"""Run a function on N ranks from a notebook cell, and get every rank's result back.

    >>> def hello(ctx):
    ...     return f"rank {ctx.rank} of {ctx.world_size} on {ctx.backend}"
    >>> launch(hello, world_size=4).results
    ['rank 0 of 4 on gloo', 'rank 1 of 4 on gloo', ...]

How it works, and why:

* **forkserver with torch preloaded.**  ``spawn`` starts a fresh interpreter and
  imports torch for every rank of every launch (3-4 s for 4 ranks here).  A
  forkserver imports torch once, then forks a warm copy per rank (0.1-0.2 s).
  Only torch is preloaded: the server keeps the modules *and the environment*
  it started with, so preloading this library would hide your edits to it.
* **cloudpickle.**  Workers cannot import a function defined in a notebook
  (``__main__``), so the launcher ships it by value.
* **rendezvous through ``init_method``.**  Each launch gets a fresh
  ``file://`` store in its own temporary directory: two notebooks launching at
  the same time cannot collide on a port, and nothing travels through
  environment variables (forked children would keep the server's).
* **no process left behind.**  A worker that raises ends the launch at once with
  its traceback; a launch that runs past ``timeout`` (a deadlock, say) ends with
  a report of what every rank was blocked in; an interrupted cell kills the
  workers; and each worker watches the launching process and exits if it dies.
* **whole lines of output.**  Each worker's stdout and stderr are captured at
  the file-descriptor level and forwarded line by line, prefixed ``[rank r]``,
  so prints from several ranks never interleave mid-line.

The same worker function runs under ``torchrun`` (``env://`` rendezvous) with
:func:`run_under_torchrun`; :func:`is_torchrun` tells which world you are in.
"""
from __future__ import annotations

import faulthandler
import multiprocessing as mp
import os
import queue as queue_module
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Callable

import cloudpickle

from .trace import Trace, TraceEvent, Tracer, set_tracer

# --- what the worker function sees -------------------------------------------


@dataclass
class WorkerContext:
    """Passed as the first argument of every launched function."""

    rank: int
    """Global rank of this worker."""
    world_size: int
    """Number of workers in the launch."""
    backend: str
    """``gloo`` (CPU) or ``nccl`` (one GPU per rank)."""
    device: str
    """``cpu`` or ``cuda:N``: where this rank's tensors should live."""
    local_rank: int = 0
    """Rank within this machine (equals ``rank`` for the notebook launcher)."""

    @property
    def tracer(self) -> Tracer:
        from .trace import get_tracer
        return get_tracer()


@dataclass
class LaunchResult:
    """What a launch returns: every rank's return value, output and merged trace."""

    results: list
    """``results[r]`` is what rank r's function returned."""
    trace: Trace
    """Every recorded op of every rank, merged and sorted by start time."""
    output: dict = field(default_factory=dict)
    """Rank -> list of ``(stream, line)`` the worker printed."""
    backend: str = "gloo"
    wall_time: float = 0.0
    """Seconds from starting the first worker to collecting the last result."""

    def __getitem__(self, rank: int):
        return self.results[rank]

    def __len__(self) -> int:
        return len(self.results)


class WorkerError(RuntimeError):
    """A worker raised (or died); carries that rank's traceback."""

    def __init__(self, rank: int, summary: str, worker_traceback: str):
        self.rank = rank
        self.summary = summary
        self.worker_traceback = worker_traceback
        super().__init__(f"rank {rank} failed: {summary}\n\n"
                         f"----- traceback from rank {rank} -----\n{worker_traceback}")


class LaunchTimeout(RuntimeError):
    """The launch ran past its timeout; ``report`` says what each rank was waiting in."""

    def __init__(self, timeout: float, report: dict[int, str]):
        self.timeout = timeout
        self.report = report
        lines = [f"launch timed out after {timeout:g} s; the workers were killed. "
                 f"What each rank was doing:"]
        for rank in sorted(report):
            lines.append(f"  rank {rank}: {report[rank]}")
        lines.append("A rank blocked in a receive (or collective) whose peers never send is "
                     "a deadlock: check that every send has a matching receive on the peer, "
                     "in the same order, and that every rank of a group joins each collective.")
        super().__init__("\n".join(lines))


# --- choosing a backend -----------------------------------------------------------


def process_group_backend(backend: str) -> str:
    """What ``init_process_group`` gets: with NCCL, gloo stays registered for CPU tensors.

    ``"cpu:gloo,cuda:nccl"`` makes every collective pick its backend by the tensor's
    device: tensors on ``ctx.device`` (a GPU) go over NCCL, and the chapters' model code,
    which keeps its tensors on the CPU so that it runs anywhere, goes over gloo instead
    of failing with "no backend for device cpu".
    """
    return "cpu:gloo,cuda:nccl" if backend == "nccl" else backend


def default_backend(world_size: int) -> str:
    """``nccl`` when every rank can have its own GPU, else ``gloo``."""
    import torch
    if torch.cuda.is_available() and torch.cuda.device_count() >= world_size:
        return "nccl"
    return "gloo"


# --- the worker side ------------------------------------------------------------------


def _describe_pending(event: TraceEvent) -> str:
    parts = [f"{event.op}"]
    if event.peer is not None:
        parts.append(("to" if event.op == "send" else "from") + f" rank {event.peer}")
    parts.append(f"on {event.group_kind} group {list(event.group_ranks)}")
    parts.append(f"shape {tuple(event.shape)} {event.dtype}")
    if event.tags:
        parts.append(f"tags {event.tags}")
    return " ".join(parts)


def _write_status(run_dir: str, rank: int, tracer: Tracer) -> None:
    """Write what this rank is blocked in, for the launcher's deadlock report."""
    event = tracer.pending
    if event is not None:
        text = f"{event.t_start!r}\nwaiting in {_describe_pending(event)}"
    elif tracer.finished:
        text = f"{time.time()!r}\nfinished its function; waiting for the other ranks to finish theirs"
    else:
        text = ""
    tmp = os.path.join(run_dir, f"status.{rank}.tmp")
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, os.path.join(run_dir, f"status.{rank}"))


def _forward_fd(fd: int, stream: str, rank: int, out_queue) -> threading.Thread:
    """Point file descriptor ``fd`` at a pipe and forward whole lines to the launcher."""
    read_end, write_end = os.pipe()
    os.dup2(write_end, fd)
    os.close(write_end)

    def pump():
        with os.fdopen(read_end, "rb") as pipe:
            for raw in pipe:
                out_queue.put(("line", rank, stream, raw.decode(errors="replace").rstrip("\n")))

    thread = threading.Thread(target=pump, daemon=True)
    thread.start()
    return thread


def _watch(launcher_pid: int, run_dir: str, rank: int) -> None:
    """The worker's watchdog thread: exit if the launcher dies; answer report requests.

    It runs while the main thread is blocked inside a collective (torch releases
    the GIL there), so it can read the op the main thread is stuck in.
    """
    request = os.path.join(run_dir, "report.request")
    answered = False
    while True:
        time.sleep(_WATCH_INTERVAL)
        try:
            os.kill(launcher_pid, 0)
        except ProcessLookupError:
            os._exit(3)
        if not answered and os.path.exists(request):
            from .trace import get_tracer
            _write_status(run_dir, rank, get_tracer())
            answered = True


_WATCH_INTERVAL = 0.1  # seconds between the watchdog's checks


def _worker_main(rank, world_size, backend, init_method, payload, out_queue, run_dir,
                 launcher_pid, options) -> None:
    threading.Thread(target=_watch, args=(launcher_pid, run_dir, rank), daemon=True).start()
    pumps = [_forward_fd(1, "stdout", rank, out_queue), _forward_fd(2, "stderr", rank, out_queue)]
    sys.stdout = os.fdopen(1, "w", buffering=1, closefd=False)
    sys.stderr = os.fdopen(2, "w", buffering=1, closefd=False)
    stack_file = open(os.path.join(run_dir, f"stack.{rank}"), "w")
    faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=False)
    status = "ok"
    try:
        import torch
        import torch.distributed as dist
        torch.set_num_threads(options["threads"])
        tracer = set_tracer(Tracer(rank, enabled=options["trace"],
                                   capture_values=options["capture_values"]))
        device = "cpu"
        if backend == "nccl":
            torch.cuda.set_device(rank % torch.cuda.device_count())
            device = f"cuda:{torch.cuda.current_device()}"
        dist.init_process_group(process_group_backend(backend), init_method=init_method, rank=rank,
                                world_size=world_size,
                                timeout=timedelta(seconds=options["timeout"] + 60))
        fn, args, kwargs = cloudpickle.loads(payload)
        ctx = WorkerContext(rank=rank, world_size=world_size, backend=backend, device=device,
                            local_rank=rank)
        result = fn(ctx, *args, **kwargs)
        if dist.is_initialized():
            tracer.finished = True
            # Leave together: a rank that exits while a peer still reads from it
            # would break that peer's last op ("Connection reset by peer").
            dist.barrier()
        message = ("ok", rank, cloudpickle.dumps(result), [e.to_dict() for e in tracer.events])
    except BaseException as exc:  # noqa: BLE001 - every failure must reach the notebook
        status = "error"
        summary = f"{type(exc).__name__}: {exc}"
        message = ("error", rank, summary, traceback.format_exc())
    sys.stdout.flush()
    sys.stderr.flush()
    # Close our ends of the pipes so the pumps see end-of-file and finish first:
    # then every line a worker printed reaches the launcher before its result.
    os.close(1)
    os.close(2)
    for pump in pumps:
        pump.join(timeout=2)
    out_queue.put(message)
    out_queue.close()
    out_queue.join_thread()
    if status == "ok":
        try:
            import torch.distributed as dist
            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - the result is already delivered
            pass
    os._exit(0)


# --- the launcher side -------------------------------------------------------------


_CONTEXT = None


def _get_context():
    """The forkserver context, with torch preloaded into the server (once per kernel)."""
    global _CONTEXT
    if _CONTEXT is None:
        ctx = mp.get_context("forkserver")
        # torch, and the parts of it imported lazily that would otherwise cost every rank
        # of every launch: sympy via symbolic_shapes (~0.3 s of CPU, the first backward
        # with an explicit gradient) and torch._dynamo (~1-2 s, any optimizer's __init__).
        ctx.set_forkserver_preload(["torch", "torch.fx.experimental.symbolic_shapes",
                                    "torch._dynamo"])
        _CONTEXT = ctx
    return _CONTEXT


@contextmanager
def _main_module_hidden():
    """Start workers without re-running the caller's script in each of them.

    multiprocessing normally re-imports ``__main__`` in every child, so a script
    without an ``if __name__ == "__main__":`` guard would launch again from each
    worker.  The function travels by value (cloudpickle), so the workers never
    need ``__main__``: hide its file and spec while the processes start.
    """
    main = sys.modules.get("__main__")
    saved_file = main.__dict__.pop("__file__", None)
    saved_spec = getattr(main, "__spec__", None)
    main.__spec__ = None
    try:
        yield
    finally:
        main.__spec__ = saved_spec
        if saved_file is not None:
            main.__file__ = saved_file


def _kill(processes) -> None:
    processes = [p for p in processes if p.pid is not None]  # skip never-started ones
    for p in processes:
        if p.is_alive():
            p.terminate()
    deadline = time.time() + 1.0
    for p in processes:
        p.join(max(0.0, deadline - time.time()))
        if p.is_alive():
            p.kill()
            p.join(1.0)


def _clean_stack(text: str) -> str:
    """Innermost first: the frames of user and library code the rank is blocked in."""
    frames = []
    for line in text.splitlines():
        line = line.strip()
        if not line.startswith("File "):
            continue
        # faulthandler writes: File "/path/x.py", line 12 in func
        path, _, rest = line[len('File "'):].partition('", line ')
        if path == __file__ or any(skip in path for skip in ("/multiprocessing/", "/torch/", "<string>")):
            continue
        lineno, _, func = rest.partition(" in ")
        frames.append(f"{os.path.basename(path)}:{lineno} in {func}")
    return " <- ".join(frames[:6]) if frames else "(no Python frames)"


def _deadlock_report(processes, run_dir: str, finished: set[int]) -> dict[int, str]:
    open(os.path.join(run_dir, "report.request"), "w").close()  # the watchdogs answer this
    for rank, p in enumerate(processes):
        if rank not in finished and p.is_alive():
            try:
                os.kill(p.pid, signal.SIGUSR1)  # faulthandler dumps the stack, even mid-C call
            except ProcessLookupError:
                pass
    time.sleep(3 * _WATCH_INTERVAL + 0.2)
    now = time.time()
    report = {}
    for rank, p in enumerate(processes):
        if rank in finished:
            report[rank] = "finished"
            continue
        status_text = ""
        try:
            with open(os.path.join(run_dir, f"status.{rank}")) as f:
                raw = f.read()
            if raw:
                since, text = raw.split("\n", 1)
                status_text = f"{text} (for {now - float(since):.1f} s)"
        except FileNotFoundError:
            pass
        stack = ""
        try:
            with open(os.path.join(run_dir, f"stack.{rank}")) as f:
                stack = _clean_stack(f.read())
        except FileNotFoundError:
            pass
        waiting = status_text or "running, not inside a traced op"
        report[rank] = f"{waiting}; stack: {stack}" if stack else waiting
    return report


def launch(fn: Callable[..., Any], world_size: int, args: tuple = (), kwargs: dict | None = None,
           backend: str = "auto", timeout: float = 60.0, trace: bool = True,
           capture_values: int = 0, print_output: bool = True, threads: int | None = None
           ) -> LaunchResult:
    """Run ``fn(ctx, *args, **kwargs)`` on ``world_size`` ranks and return every result.

    ``backend``: ``"gloo"``, ``"nccl"`` or ``"auto"`` (NCCL when each rank gets a GPU).
    ``timeout``: seconds before the launch is declared deadlocked and killed.
    ``trace``: record every traced op; ``capture_values``: also record the values
    of tensors with at most this many elements (for animations).
    ``threads``: torch threads per worker (default: the cores shared among ranks).
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a whole number >= 1, got {world_size!r}")
    if backend == "auto":
        backend = default_backend(world_size)
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be 'gloo', 'nccl' or 'auto', got {backend!r}")
    payload = cloudpickle.dumps((fn, tuple(args), dict(kwargs or {})))
    options = {"timeout": float(timeout), "trace": trace, "capture_values": int(capture_values),
               "threads": threads or max(1, (os.cpu_count() or 1) // world_size)}
    context = _get_context()
    run_dir = tempfile.mkdtemp(prefix="tutorial_lib_launch_")
    init_method = f"file://{os.path.join(run_dir, 'rendezvous')}"
    out_queue = context.Queue()
    processes = [
        context.Process(target=_worker_main, name=f"tutorial_lib-rank{rank}", daemon=True,
                        args=(rank, world_size, backend, init_method, payload, out_queue,
                              run_dir, os.getpid(), options))
        for rank in range(world_size)
    ]
    collector = _Collector(world_size, print_output)
    started = time.time()
    try:
        with _main_module_hidden():
            for p in processes:
                p.start()
        deadline = started + timeout
        while len(collector.finished) < world_size:
            if collector.poll(out_queue, wait=0.05):
                if collector.failures:
                    raise collector.first_cause(processes, out_queue)
                continue
            for rank, p in enumerate(processes):
                if rank not in collector.finished and p.exitcode is not None:
                    raise collector.first_cause(processes, out_queue)
            if time.time() > deadline:
                raise LaunchTimeout(timeout, _deadlock_report(processes, run_dir, collector.finished))
    finally:
        _kill(processes)
        out_queue.close()
        out_queue.cancel_join_thread()
        shutil.rmtree(run_dir, ignore_errors=True)
    return LaunchResult(results=collector.results, trace=Trace(collector.events),
                        output=collector.output, backend=backend, wall_time=time.time() - started)


class _Collector:
    """Reads the workers' messages: output lines, results with traces, errors."""

    def __init__(self, world_size: int, print_output: bool):
        self.print_output = print_output
        self.results: list = [None] * world_size
        self.events: list[TraceEvent] = []
        self.output: dict[int, list] = {r: [] for r in range(world_size)}
        self.finished: set[int] = set()
        self.failures: list[WorkerError] = []

    def poll(self, out_queue, wait: float) -> bool:
        """Handle one message if one arrives within ``wait`` seconds; False if none did."""
        try:
            message = out_queue.get(timeout=wait)
        except queue_module.Empty:
            return False
        kind, rank = message[0], message[1]
        if kind == "line":
            self.output[rank].append((message[2], message[3]))
            if self.print_output:
                target = sys.stderr if message[2] == "stderr" else sys.stdout
                target.write(f"[rank {rank}] {message[3]}\n")
                target.flush()
        elif kind == "ok":
            self.results[rank] = cloudpickle.loads(message[2])
            self.events.extend(Trace.from_dicts(message[3]))
            self.finished.add(rank)
        elif kind == "error":
            self.failures.append(WorkerError(rank, message[2], message[3]))
        return True

    def first_cause(self, processes, out_queue, grace: float = 0.5) -> WorkerError:
        """The failure that started it all, with the others it caused listed after it.

        When one rank fails its peers soon fail too ("Connection reset by peer"):
        wait a moment for every report, then blame a rank that died without an
        exception, else the first one whose error is not a lost connection.
        """
        end = time.time() + grace
        while time.time() < end:
            self.poll(out_queue, wait=0.05)
        reported = {f.rank for f in self.failures}
        for rank, p in enumerate(processes):
            if rank not in self.finished and rank not in reported and p.exitcode is not None:
                self.failures.insert(0, WorkerError(
                    rank, f"process exited with code {p.exitcode} before returning a result",
                    "(no Python traceback: the process died, e.g. killed by a signal, "
                    "os._exit, or out of memory)"))
        lost_peer = ("Connection reset by peer", "Connection closed by peer", "Broken pipe")
        causes = [f for f in self.failures if not any(t in f.summary for t in lost_peer)]
        first = (causes or self.failures)[0]
        others = [f for f in self.failures if f is not first]
        if others:
            first.args = (first.args[0] + "\n\nAfterwards, probably as a consequence:\n" +
                          "\n".join(f"  rank {f.rank}: {f.summary[:200]}" for f in others),)
        return first


def warm_up() -> float:
    """Start the forkserver (imports torch once); returns the seconds it took."""
    t0 = time.time()
    launch(_noop, 1, trace=False)
    return time.time() - t0


def _noop(ctx):
    return ctx.rank


# --- torchrun -----------------------------------------------------------------------------


def is_torchrun() -> bool:
    """True inside a process started by ``torchrun`` (it sets these variables)."""
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR"))


def run_under_torchrun(fn: Callable[..., Any], args: tuple = (), kwargs: dict | None = None,
                       backend: str = "auto", trace: bool = True, capture_values: int = 0):
    """Run ``fn(ctx, ...)`` in this torchrun process; returns ``(result, tracer events)``."""
    import torch
    import torch.distributed as dist
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ["LOCAL_RANK"])
    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    device = "cpu"
    if backend == "nccl":
        torch.cuda.set_device(local_rank)
        device = f"cuda:{local_rank}"
    tracer = set_tracer(Tracer(rank, enabled=trace, capture_values=capture_values))
    dist.init_process_group(process_group_backend(backend), init_method="env://", rank=rank,
                            world_size=world_size)
    try:
        ctx = WorkerContext(rank=rank, world_size=world_size, backend=backend, device=device,
                            local_rank=local_rank)
        result = fn(ctx, *args, **(kwargs or {}))
    finally:
        dist.destroy_process_group()
    return result, list(tracer.events)
