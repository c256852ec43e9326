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
  it started with, so preloading this library would hide your edits to it.  A
  server that died is started again, transparently.
* **cloudpickle.**  Workers cannot import a function defined in a notebook
  (``__main__``), so the launcher ships it by value.
* **rendezvous through ``init_method``.**  Each launch gets a fresh
  ``file://`` store in its own temporary directory: two notebooks launching at
  the same time cannot collide on a port, and nothing travels through
  environment variables (forked children would keep the server's).
* **pipes the launcher owns.**  Each rank's stdout and stderr are pipes whose
  read ends only the launcher holds, forwarded line by line, prefixed
  ``[rank r]``; what a rank wrote before it died (gloo's last words before an
  abort, say) is still in the pipe and reaches the error report.  Results come
  back over a pipe of their own per rank, so a worker that closes its stdout
  keeps its result.
* **two clocks.**  ``start_timeout`` bounds the start-up (fork, unpickling the
  function and its imports, joining the process group); the ``timeout`` clock
  starts only when every rank has joined, so a busy machine that is slow to
  start workers is never mistaken for a deadlock.
* **no process left behind.**  A worker that raises ends the launch at once with
  its traceback; a launch that runs past ``timeout`` ends with a report of what
  every rank was blocked in; an interrupted cell kills the workers.  Every worker
  leads its own process group, and the launcher ends whole groups, so the
  processes a worker started (a ``DataLoader``'s workers, a ``subprocess``) end
  with it.  Each worker holds the read end of a *liveness pipe* whose only write
  end is the launcher's: when the launcher dies, even by ``kill -9`` and never
  reaped, the pipe reports end-of-file and the worker ends its group.
* **collective checks.**  With ``check_collectives`` (on by default inside a
  notebook) torch's own consistency check (``TORCH_DISTRIBUTED_DEBUG=DETAIL``)
  wraps every process group: before each collective the ranks compare the op,
  shapes and dtypes, and a mismatch raises at once, naming the ranks and shapes
  that disagree, instead of crashing gloo or hanging until the timeout.

The same worker function runs under ``torchrun`` (``env://`` rendezvous) with
:func:`run_under_torchrun`; :func:`is_torchrun` tells which world you are in.
"""
from __future__ import annotations

import faulthandler
import fcntl
import io
import math
import multiprocessing as mp
import multiprocessing.connection as mp_connection
import os
import re
import shutil
import signal
import subprocess
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
    namespace: dict = field(default_factory=dict)
    """Names this rank keeps between calls of a persistent :class:`~tutorial_lib.cluster.Cluster`
    (a fresh dict for each :func:`launch`)."""

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
    """A worker raised (or died); carries that rank's traceback.

    ``results`` holds what the ranks that did finish returned (``None`` for the others),
    so one bad rank does not lose the rest.
    """

    def __init__(self, rank: int, summary: str, worker_traceback: str,
                 exitcode: int | None = None):
        self.rank = rank
        self.summary = summary
        self.worker_traceback = worker_traceback
        self.exitcode = exitcode
        """The process's exit status when it died without a Python exception (negative: the
        signal that killed it); ``None`` when the function raised."""
        self.results: list = []
        super().__init__(f"rank {rank} failed: {summary}\n\n"
                         f"----- traceback from rank {rank} -----\n{worker_traceback}")


class LaunchTimeout(RuntimeError):
    """The launch ran past its timeout; ``report`` says what each rank was waiting in."""

    def __init__(self, timeout: float, report: dict[int, str]):
        self.timeout = timeout
        self.report = report
        lines = [f"launch timed out {timeout:g} s after every rank had joined; the workers "
                 f"were killed. What each rank was doing:"]
        for rank in sorted(report):
            lines.append(f"  rank {rank}: {report[rank]}")
        lines.append("A rank blocked in a receive (or collective) whose peers never send is "
                     "a deadlock: check that every send has a matching receive on the peer, "
                     "in the same order, and that every rank of a group joins each collective.")
        if collective_mismatch_suspected(report):
            lines.append(MISMATCH_HINT)
        super().__init__("\n".join(lines))


RETURNED = ("finished its function (returned from fn); waits in the launcher's end-of-call "
            "barrier for the other ranks")
"""What the report says of a rank whose function returned while others still run theirs."""
MISMATCH_HINT = ("possible collective mismatch: rerun with check_collectives=True, which "
                 "compares every collective's op, shapes and dtypes across the ranks and names "
                 "the first that differ")
"""Added to a timeout's report when a rank returned while its peers wait in a collective, or
when ranks wait in the same group's op with different ops or shapes."""


RETURNED_EARLY = "returned from fn while other ranks were still inside a collective"
"""How a rank whose end-of-call barrier met its peers' collective (torch's check on) is reported."""


def describe_exit(exitcode: int) -> str:
    """``"was killed by signal SIGKILL (exit code -9)"`` or ``"exited with code 3"``."""
    if exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = f"signal {-exitcode}"
        return f"was killed by signal {name} (exit code {exitcode})"
    return f"exited with code {exitcode}"


def _returned_ranks_named(summary: str, returned: set[int]) -> str:
    """A mismatch explanation with a returned rank's barrier (torch's check sees its own
    ops there) said as what it is."""
    return re.sub(r"rank (\d+) runs [^.]*? as its op #\d+",
                  lambda m: (f"rank {m.group(1)} returned from fn" if int(m.group(1)) in returned
                             else m.group(0)), summary)


_WAIT = re.compile(r"waiting in (\S+) on (\w+ group \[[^\]]*\])(?: shape (\([^)]*\) \S+))?")
_P2P_OPS = ("send", "recv", "isend", "irecv")


def collective_mismatch_suspected(report: dict[int, str]) -> bool:
    """A timeout report that looks like ranks issuing different collectives: some rank
    returned from its function while another waits in a collective, or ranks wait in the
    same group's collective with different ops or shapes (gloo then hangs or crashes)."""
    waits = [m.groups() for m in map(_WAIT.match, report.values()) if m]
    collectives = [(op, group, shape) for op, group, shape in waits if op not in _P2P_OPS]
    returned = any(text.startswith(RETURNED.split(";")[0]) for text in report.values())
    if returned and collectives:
        return True
    seen: dict[str, set] = {}
    for op, group, shape in collectives:
        seen.setdefault(group, set()).add((op, shape))
    return any(len(kinds) > 1 for kinds in seen.values())


class StartupTimeout(RuntimeError):
    """The workers did not all join the process group within ``start_timeout`` seconds."""

    def __init__(self, start_timeout: float, report: dict[int, str]):
        self.start_timeout = start_timeout
        self.report = report
        lines = [f"the workers did not all start within start_timeout={start_timeout:g} s "
                 f"(forked, function unpickled with its imports, process group joined); "
                 f"they were killed. Where each rank was:"]
        for rank in sorted(report):
            lines.append(f"  rank {rank}: {report[rank]}")
        lines.append("On a busy machine start-up can take long: pass a larger start_timeout, "
                     "or launch fewer ranks. Nothing of your function had run yet.")
        super().__init__("\n".join(lines))


# --- choosing a backend and a device ----------------------------------------------


def process_group_backend(backend: str) -> str:
    """What ``init_process_group`` gets: with NCCL, gloo stays registered for CPU tensors.

    ``"cpu:gloo,cuda:nccl"`` makes every collective pick its backend by the tensor's
    device: tensors on ``ctx.device`` (a GPU) go over NCCL; a CPU tensor (a count a
    reader's cell makes on the CPU, say) goes over gloo instead of failing with
    "no backend for device cpu".
    """
    return "cpu:gloo,cuda:nccl" if backend == "nccl" else backend


def choose_backend(backend: str, local_ranks: int, gpus: int) -> tuple[str, str | None]:
    """The backend a launch uses, and a note to print (or ``None``); pure, no torch.

    ``local_ranks``: the ranks this machine runs; ``gpus``: the GPUs it has.  NCCL needs
    one GPU per rank (rank ``r`` uses ``cuda:r``).  ``"auto"`` picks NCCL when every
    local rank gets its own GPU, and gloo on the CPU otherwise, with a note when there
    are GPUs but too few.  ``"nccl"`` where it cannot run is a :class:`ConfigError`,
    raised before any worker starts.
    """
    from .config import ConfigError
    if backend not in ("gloo", "nccl", "auto"):
        raise ValueError(f"backend must be 'gloo', 'nccl' or 'auto', got {backend!r}")
    if backend == "gloo":
        return "gloo", None
    enough = gpus >= local_ranks
    if backend == "nccl" and not enough:
        have = "no GPU" if gpus == 0 else f"only {gpus} GPU{'s' * (gpus > 1)}"
        raise ConfigError("backend", f"backend='nccl' needs one GPU per rank: {local_ranks} "
                                     f"rank{'s' * (local_ranks > 1)} on this machine, which has "
                                     f"{have} that torch can use; run at most {gpus} ranks, or "
                                     f"pass backend='gloo' (or 'auto') to run on the CPU")
    if enough and gpus > 0:
        return "nccl", None
    if backend == "auto" and gpus > 0:
        return "gloo", (f"launch: {local_ranks} ranks but {gpus} GPU{'s' * (gpus > 1)} on this "
                        f"machine, and NCCL needs one GPU per rank: running on the CPU over "
                        f"gloo (at most {gpus} ranks would run on the GPUs)")
    return "gloo", None


def gpu_count() -> int:
    """GPUs torch can use on this machine (0 without CUDA)."""
    import torch
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def default_backend(world_size: int) -> str:
    """``nccl`` when every rank can have its own GPU, else ``gloo``."""
    return choose_backend("auto", world_size, gpu_count())[0]


_NOTES_SAID: set[str] = set()


def _say_once(note: str | None) -> None:
    """Print ``note`` to stderr the first time this process meets it."""
    if note and note not in _NOTES_SAID:
        _NOTES_SAID.add(note)
        print(note, file=sys.stderr, flush=True)


STRICT_DEVICE_VARIABLE = "TUTORIAL_LIB_DEFAULT_DEVICE"
"""Set in the launcher's environment (e.g. ``meta``), every worker makes it torch's default
device after joining the process group: a tensor created without an explicit device then
lands there, and with ``meta`` the run fails at its first use.  How the course checks that
nothing it runs relies on torch's default device (``tests/dist/test_device.py``)."""


def in_notebook() -> bool:
    """True inside a Jupyter kernel (where collective checks are on by default)."""
    shell = sys.modules.get("IPython")
    ipython = getattr(shell, "get_ipython", lambda: None)() if shell else None
    return ipython is not None and "IPKernelApp" in getattr(ipython, "config", {})


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


def _write_status(run_dir: str, rank: int, tracer: Tracer | None) -> None:
    """Write what this rank is blocked in, for the launcher's report."""
    event = tracer.pending if tracer is not None else None
    if event is not None:
        text = f"{event.t_start!r}\nwaiting in {_describe_pending(event)}"
    elif tracer is not None and tracer.finished:
        text = f"{time.time()!r}\n{RETURNED}"
    else:
        text = ""
    tmp = os.path.join(run_dir, f"status.{rank}.tmp")
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, os.path.join(run_dir, f"status.{rank}"))


def _end_my_process_group() -> None:
    """Kill this worker and every process it started (they share its process group)."""
    try:
        os.killpg(0, signal.SIGKILL)
    finally:
        os._exit(3)


def _watch(alive, run_dir: str, rank: int) -> None:
    """The worker's watchdog thread: end the group if the launcher dies; answer report requests.

    ``alive`` is the read end of the liveness pipe: nothing is ever written to it, so it
    becomes readable only at end-of-file, when the launcher's write end closes (the launcher
    exited or was killed).  The thread runs while the main thread is blocked inside a
    collective (torch releases the GIL there), so it can read the op the main thread is
    stuck in.  Each new report request (the file's content changes) is answered once.
    """
    request = os.path.join(run_dir, "report.request")
    answered = None
    while True:
        if alive.poll(_WATCH_INTERVAL):
            _end_my_process_group()
        asked = _read_if_there(request) if os.path.exists(request) else None
        if asked is not None and asked != answered:
            from .trace import get_tracer
            _write_status(run_dir, rank, get_tracer())
            answered = asked


_WATCH_INTERVAL = 0.1  # seconds between the watchdog's checks for a report request


def _safe_summary(exc: BaseException) -> str:
    """``Type: message``, even for an exception whose ``__str__`` raises."""
    try:
        text = str(exc)
    except Exception as inner:  # noqa: BLE001 - the user's __str__ may do anything
        text = f"<its __str__ raised {type(inner).__name__}: {inner!r}>"
    return f"{type(exc).__name__}: {text}"


def _send(conn, message) -> None:
    conn.send_bytes(cloudpickle.dumps(message))


def enter_worker(rank: int, stdout_conn, stderr_conn, alive, run_dir: str) -> None:
    """The first thing a worker does: its own process group, stdout and stderr into the
    launcher's pipes, the watchdog, faulthandler (a crash prints its signal and Python
    stack) and a stack dump on SIGUSR1 for the reports."""
    os.setpgid(0, 0)  # lead a process group: the launcher ends it whole
    for fd, conn in ((1, stdout_conn), (2, stderr_conn)):
        os.dup2(conn.fileno(), fd)  # the launcher holds the read end
        conn.close()
    sys.stdout = os.fdopen(1, "w", buffering=1, closefd=False)
    sys.stderr = os.fdopen(2, "w", buffering=1, closefd=False)
    threading.Thread(target=_watch, args=(alive, run_dir, rank), daemon=True).start()
    # a crash (SIGSEGV, SIGABRT, SIGBUS, SIGFPE, SIGILL) prints its signal and the Python
    # stack on stderr, which the launcher's report quotes
    faulthandler.enable(file=sys.stderr, all_threads=False)
    stack_file = open(os.path.join(run_dir, f"stack.{rank}"), "w")
    faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=False)


def join_world(rank: int, world_size: int, backend: str, init_method: str,
               options: dict) -> WorkerContext:
    """Join the process group (with torch's collective check when asked); the context.

    With NCCL rank ``r`` takes ``cuda:r`` (the launcher checked that each rank has its
    own GPU before starting any).  The tracer learns the device, so that traced ops on
    it are timed with CUDA events (:class:`~tutorial_lib.trace.Tracer`).
    """
    import torch
    import torch.distributed as dist
    torch.set_num_threads(options["threads"])
    device = "cpu"
    if backend == "nccl":
        device = f"cuda:{rank}"
        torch.cuda.set_device(device)
    if options["check_collectives"]:
        os.environ["TORCH_DISTRIBUTED_DEBUG"] = "DETAIL"
        dist.set_debug_level(dist.DebugLevel.DETAIL)
    dist.init_process_group(process_group_backend(backend), init_method=init_method, rank=rank,
                            world_size=world_size,
                            timeout=timedelta(seconds=options["timeout"] + 60))
    if options["check_collectives"]:
        from . import parallel_state
        parallel_state.make_world_p2p_group()  # P2P on WORLD then leaves the check alone
    enter_device(device, options.get("default_device"))
    return WorkerContext(rank=rank, world_size=world_size, backend=backend, device=device,
                         local_rank=rank)


def enter_device(device: str, default_device: str | None = None) -> None:
    """Tell this process's tracer where its tensors live (CUDA: time ops with CUDA events);
    with ``default_device`` (:data:`STRICT_DEVICE_VARIABLE`) make that torch's default."""
    from .trace import get_tracer
    get_tracer().use_device(device)
    if default_device:
        import torch
        torch.set_default_device(default_device)


def _result_to_cpu(obj):
    """A tensor on a GPU as a CPU tensor for the trip back (same values, gradient flag
    kept); anything else unchanged."""
    import torch
    cpu = obj.detach().to("cpu")
    if isinstance(obj, torch.nn.Parameter):
        return torch.nn.Parameter(cpu, requires_grad=obj.requires_grad)
    return cpu.requires_grad_(obj.requires_grad)


def _same(value):
    return value


class _CPUResultPickler(cloudpickle.Pickler):
    """cloudpickle, with every tensor on an accelerator sent as a CPU copy: a notebook on a
    GPU machine gets results it can compare with its own CPU tensors (and a kernel without
    CUDA could not rebuild a CUDA tensor at all)."""

    def reducer_override(self, obj):
        torch = sys.modules.get("torch")
        if torch is not None and isinstance(obj, torch.Tensor) \
                and obj.device.type not in ("cpu", "meta"):
            return _same, (_result_to_cpu(obj),)
        return super().reducer_override(obj)


def dumps_to_cpu(obj) -> bytes:
    """``obj`` pickled with :class:`_CPUResultPickler`."""
    buffer = io.BytesIO()
    _CPUResultPickler(buffer).dump(obj)
    return buffer.getvalue()


def pickled_result(rank: int, result) -> bytes:
    """``result`` pickled to travel back (tensors on a GPU as CPU copies), or a TypeError
    that says what to return instead."""
    try:
        return dumps_to_cpu(result)
    except Exception as exc:  # noqa: BLE001
        raise TypeError(f"rank {rank}'s return value (a {type(result).__name__}) cannot be "
                        f"pickled to send it back: {_safe_summary(exc)}; return plain data "
                        f"(numbers, lists, dicts, tensors)") from exc


def flush_output() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # the function may have closed its own stdout
            pass


def _worker_main(rank, world_size, backend, init_method, payload, result_conn, stdout_conn,
                 stderr_conn, alive, run_dir, options) -> None:
    enter_worker(rank, stdout_conn, stderr_conn, alive, run_dir)
    try:
        tracer = set_tracer(Tracer(rank, enabled=options["trace"],
                                   capture_values=options["capture_values"]))
        fn, args, kwargs = cloudpickle.loads(payload)  # imports the function's modules
        ctx = join_world(rank, world_size, backend, init_method, options)
        _send(result_conn, ("ready", rank))  # the launcher's timeout clock starts now
        result = fn(ctx, *args, **kwargs)
        import torch.distributed as dist
        if dist.is_initialized():
            tracer.finished = True
            # Leave together: a rank that exits while a peer still reads from it
            # would break that peer's last op ("Connection reset by peer").
            try:
                dist.barrier()
            except Exception:  # noqa: BLE001 - torch's check met a peer's collective here
                raise RuntimeError(f"{RETURNED_EARLY} (the launcher's end-of-call barrier met "
                                   f"theirs): every rank must issue the same collectives; "
                                   f"did this rank skip one, or return early?") from None
        message = ("ok", rank, pickled_result(rank, result), tracer.event_dicts())
    except BaseException as exc:  # noqa: BLE001 - every failure must reach the notebook
        message = ("error", rank, _safe_summary(exc), traceback.format_exc())
    flush_output()
    _send(result_conn, message)
    result_conn.close()
    if message[0] == "ok":
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


def _restart_forkserver() -> None:
    """Forget a forkserver that died (or is dying), so the next start launches a new one."""
    from multiprocessing import forkserver
    try:
        forkserver._forkserver._stop()
    except (OSError, ChildProcessError):
        server = forkserver._forkserver
        server._forkserver_address = server._forkserver_alive_fd = server._forkserver_pid = None


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


def _signal_group(process, sig: int) -> None:
    """Send ``sig`` to the process group a worker leads (it and what it started).

    A worker that has not yet made its group (just forked) gets the signal alone.  A
    group outlives its leader while a member lives, and Linux does not reuse the number
    meanwhile, so signalling the group of a worker that already exited is safe.
    """
    try:
        os.killpg(process.pid, sig)
        return
    except (ProcessLookupError, PermissionError):
        pass
    if process.exitcode is None:
        try:
            os.kill(process.pid, sig)
        except ProcessLookupError:
            pass


def _kill(processes) -> None:
    """End every worker and everything it started; reap the workers."""
    processes = [p for p in processes if p.pid is not None]  # skip never-started ones
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for p in processes:
            _signal_group(p, sig)
        deadline = time.time() + 1.0
        for p in processes:
            p.join(max(0.0, deadline - time.time()))


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


def _untraced_torch_call(text: str) -> str | None:
    """The ``torch.distributed`` function a rank is blocked in, when no traced op says so."""
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("File ") and "/torch/distributed/" in line and " in " in line:
            func = line.rsplit(" in ", 1)[1]
            if not func.startswith("_") and func != "wrapper":
                return func
    return None


def _read_if_there(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except FileNotFoundError:
        return ""


def _rank_report(processes, run_dir: str, done: set[int]) -> dict[int, str]:
    """What every rank not in ``done`` is doing: its traced op, else its stack."""
    with open(os.path.join(run_dir, "report.request"), "w") as f:  # the watchdogs answer it
        f.write(repr(time.time()))  # new content: a new request
    for rank, p in enumerate(processes):
        if rank not in done and p.is_alive():
            try:
                os.kill(p.pid, signal.SIGUSR1)  # faulthandler dumps the stack, even mid-C call
            except ProcessLookupError:
                pass
    time.sleep(3 * _WATCH_INTERVAL + 0.2)
    now = time.time()
    report = {}
    for rank, p in enumerate(processes):
        if rank in done:
            report[rank] = "finished"
            continue
        status_text = ""
        raw = _read_if_there(os.path.join(run_dir, f"status.{rank}"))
        if raw:
            since, text = raw.split("\n", 1)
            status_text = f"{text} (for {now - float(since):.1f} s)"
        raw_stack = _read_if_there(os.path.join(run_dir, f"stack.{rank}"))
        untraced = _untraced_torch_call(raw_stack)
        if status_text:
            waiting = status_text
        elif untraced:
            waiting = f"waiting in torch.distributed.{untraced} (not traced: called directly)"
        elif not p.is_alive() or p.pid is None:
            waiting = "not running"
        else:
            waiting = "running, not inside a traced op"
        stack = _clean_stack(raw_stack) if raw_stack else ""
        report[rank] = f"{waiting}; stack: {stack}" if stack else waiting
    return report


_FINGERPRINT = re.compile(r"Rank (\d+) is running collective: CollectiveFingerPrint\("
                          r"SequenceNumber=(\d+),? ?OpType=(\w+)(?:, TensorShape=\[([^\]]*)\], "
                          r"TensorDtypes=(\w+))?")


def explain_collective_mismatch(summary: str) -> str | None:
    """A short reading of torch's collective-consistency error, or ``None`` for other errors.

    torch's check (``TORCH_DISTRIBUTED_DEBUG=DETAIL``) prints two long fingerprints; this
    names the two ranks, their ops, shapes and dtypes, and how many ops each had issued
    on the group before (its sequence number).
    """
    found = _FINGERPRINT.findall(summary)
    if "Detected mismatch between collectives" not in summary or len(found) < 2:
        return None

    def side(rank, op, shape, dtype):
        what = f"rank {rank} runs {op.lower()}"
        return what + (f" of shape [{shape}] {dtype.lower()}" if dtype else "")

    (r0, seq0, op0, shape0, dtype0), (r1, seq1, op1, shape1, dtype1) = found[:2]
    text = (f"collective mismatch: {side(r0, op0, shape0, dtype0)} as its op #{seq0} on the "
            f"group, but {side(r1, op1, shape1, dtype1)} as its op #{seq1}.")
    if (op0, shape0, dtype0) == (op1, shape1, dtype1) and seq0 != seq1:
        text += (" The ops match but their counts differ: one rank skipped or added a "
                 "collective on this group earlier (torch.distributed.send/recv called "
                 "directly on the group count too; tutorial_lib.comm's do not).")
    return text + (" Every rank of a group must issue the same collectives, with the same "
                   "shapes and dtypes, in the same order.")


class Collector:
    """Reads the workers' pipes: output lines, readiness, results with traces, errors."""

    def __init__(self, world_size: int, print_output: bool):
        self.print_output = print_output
        self.results: list = [None] * world_size
        self.events: list[TraceEvent] = []
        self.output: dict[int, list] = {r: [] for r in range(world_size)}
        self.ready: set[int] = set()
        self.finished: set[int] = set()
        self.failures: list[WorkerError] = []
        self.closed: set[int] = set()  # ranks whose result pipe reached end-of-file
        self._partial: dict[int, bytes] = {}
        self._streams: dict[int, tuple[int, str]] = {}  # fd -> (rank, stream)
        self._results: dict[Any, int] = {}              # result connection -> rank

    def add_rank(self, rank: int, result_conn, stdout_fd: int, stderr_fd: int) -> None:
        self._results[result_conn] = rank
        for fd, stream in ((stdout_fd, "stdout"), (stderr_fd, "stderr")):
            os.set_blocking(fd, False)
            fcntl.fcntl(fd, fcntl.F_SETFD, fcntl.FD_CLOEXEC)
            self._streams[fd] = (rank, stream)
            self._partial[fd] = b""

    def waitables(self) -> list:
        return list(self._results) + list(self._streams)

    def poll(self, wait: float) -> bool:
        """Handle whatever arrives within ``wait`` seconds; False if nothing did."""
        ready = mp_connection.wait(self.waitables(), timeout=wait)
        for obj in ready:
            if obj in self._results:
                self._read_result(obj)
            else:
                self._read_output(obj)
        return bool(ready)

    def _line(self, rank: int, stream: str, text: str) -> None:
        self.output[rank].append((stream, text))
        if self.print_output:
            target = sys.stderr if stream == "stderr" else sys.stdout
            target.write(f"[rank {rank}] {text}\n")
            target.flush()

    def _read_output(self, fd: int, final: bool = False) -> None:
        rank, stream = self._streams[fd]
        try:
            chunk = os.read(fd, 1 << 16)
        except BlockingIOError:
            return
        if not chunk:  # end-of-file: every writer is gone
            self._flush_partial(fd)
            del self._streams[fd]
            os.close(fd)
            return
        *lines, self._partial[fd] = (self._partial[fd] + chunk).split(b"\n")
        for raw in lines:
            self._line(rank, stream, raw.decode(errors="replace"))

    def _flush_partial(self, fd: int) -> None:
        if self._partial.get(fd):
            rank, stream = self._streams[fd]
            self._line(rank, stream, self._partial[fd].decode(errors="replace"))
            self._partial[fd] = b""

    def _read_result(self, conn) -> None:
        rank = self._results[conn]
        try:
            message = cloudpickle.loads(conn.recv_bytes())
        except (EOFError, OSError):
            del self._results[conn]
            conn.close()
            self.closed.add(rank)
            return
        self.handle(rank, message)

    def handle(self, rank: int, message: tuple) -> None:
        """One message from ``rank``: ``("ready",)``, ``("ok", result, events)`` or
        ``("error", summary, traceback)`` (each with the rank second)."""
        kind = message[0]
        if kind == "ready":
            self.ready.add(rank)
        elif kind == "ok":
            try:
                self.results[rank] = cloudpickle.loads(message[2])
            except Exception as exc:  # noqa: BLE001 - name the rank, keep the others
                self.failures.append(WorkerError(
                    rank, f"its return value could not be unpickled in the launcher: "
                          f"{_safe_summary(exc)}",
                    "(the function returned normally; only rebuilding its result here failed. "
                    "Return plain data: numbers, lists, dicts, tensors.)"))
            self.events.extend(Trace.from_dicts(message[3]))
            self.finished.add(rank)
        elif kind == "error":
            summary = explain_collective_mismatch(message[2]) or message[2]
            self.failures.append(WorkerError(rank, summary, message[3]))

    def drain(self, seconds: float) -> None:
        """Read what is left in the pipes, for at most ``seconds``."""
        end = time.time() + seconds
        while self._streams and time.time() < end:
            if not self.poll(0.02):
                break
        for fd in list(self._streams):
            self._flush_partial(fd)

    def close(self) -> None:
        for fd in list(self._streams):
            os.close(fd)
        self._streams.clear()
        for conn in list(self._results):
            conn.close()
        self._results.clear()

    def last_stderr(self, rank: int, lines: int = 8) -> list[str]:
        return [text for stream, text in self.output[rank] if stream == "stderr"][-lines:]

    def died(self, rank: int, exitcode: int) -> WorkerError:
        """The error of ``rank``, whose process ended with ``exitcode`` without a result: the
        signal by name, and what it wrote last on stderr: its last 8 lines, and when it
        crashed those before faulthandler's "Fatal Python error" (a C++ library's last words)
        and that report (the signal and the Python stack)."""
        lines = [text for stream, text in self.output[rank] if stream == "stderr"]
        crash = [i for i, text in enumerate(lines) if text.startswith("Fatal Python error")]
        last = (lines[max(0, crash[-1] - 8):crash[-1]] + lines[crash[-1]:][:40] if crash
                else lines[-8:])
        said = ("its last lines on stderr:\n" + "\n".join(f"    {t}" for t in last)
                if last else "it wrote nothing to stderr")
        return WorkerError(rank, f"process {describe_exit(exitcode)} before returning a result",
                           f"(no Python traceback: the process died, e.g. killed by a signal, "
                           f"os._exit, a C++ abort, or out of memory; {said})", exitcode=exitcode)

    def first_cause(self, processes, grace: float = 0.5) -> WorkerError | None:
        """The failure that started it all, with the others it caused listed after it.

        When one rank fails its peers soon fail too ("Connection reset by peer"):
        wait a moment for every report, then blame a rank that died without an
        exception (with the last lines it wrote to stderr), else the first one whose
        error is not a lost connection.  ``None`` if, after the wait, nothing failed.
        """
        end = time.time() + grace
        while time.time() < end:
            self.poll(0.05)
        reported = {f.rank for f in self.failures}
        for rank, p in enumerate(processes):
            if rank not in self.finished and rank not in reported and p.exitcode is not None:
                self.failures.insert(0, self.died(rank, p.exitcode))
        if not self.failures:  # what looked like a death was a result still in its pipe
            return None
        lost_peer = ("Connection reset by peer", "Connection closed by peer", "Broken pipe")
        causes = [f for f in self.failures if not any(t in f.summary for t in lost_peer)]
        # a rank that returned while the others were in a collective comes first: their
        # errors then name its end-of-call barrier as "returned from fn"
        returned = {f.rank for f in self.failures if RETURNED_EARLY in f.summary}
        # but an exception a rank raised on its own (not a collective check's complaint
        # about that barrier) is the cause, and an early return its consequence
        mismatch = ("as its op #", "mismatch between collectives")
        causes.sort(key=lambda f: (1 if f.rank in returned else
                                   2 if any(t in f.summary for t in mismatch) else 0))
        first = (causes or self.failures)[0]
        others = [f for f in self.failures if f is not first]
        if others:
            first.args = (first.args[0] + "\n\nAfterwards, probably as a consequence:\n" +
                          "\n".join(f"  rank {f.rank}: {_returned_ranks_named(f.summary, returned)[:200]}"
                                    for f in others),)
        first.results = list(self.results)
        return first


UNIX_SOCKET_PATH_MAX = 103 if sys.platform == "darwin" else 107
"""The longest path a Unix socket may have (``sun_path``: 108 bytes on Linux, 104 on
macOS, the final NUL included)."""


def forkserver_socket_problem(temp_dir: str) -> str | None:
    """Why the forkserver could not listen under ``temp_dir`` (multiprocessing's folder for
    this process, made inside ``TMPDIR``), or ``None``.  Its socket is
    ``temp_dir/listener-`` plus 8 characters; a longer path than the system allows fails
    deep inside multiprocessing with ``OSError: AF_UNIX path too long``."""
    length = len(os.fsencode(os.path.join(temp_dir, "listener-" + "x" * 8)))
    if length <= UNIX_SOCKET_PATH_MAX:
        return None
    return (f"the workers' forkserver listens on a Unix socket inside {temp_dir}: with its "
            f"name that path is {length} bytes, and this system allows at most "
            f"{UNIX_SOCKET_PATH_MAX}; start Python with a shorter temporary folder, e.g. "
            f"TMPDIR=/tmp")


def _ensure_forkserver() -> None:
    """Start the forkserver, if it is not running, with Ctrl-C ignored (refused with
    :func:`forkserver_socket_problem`'s reason before anything starts).

    It shares the terminal's process group with the launcher, so a Ctrl-C reaches it too;
    CPython's forkserver ignores SIGINT only once its preloaded imports are done, and one
    that arrives during ``import torch`` printed the server's traceback.  An ignored
    signal stays ignored across ``exec``: the server starts deaf to Ctrl-C.
    """
    from multiprocessing import forkserver, util

    from .config import ConfigError
    problem = forkserver_socket_problem(util.get_temp_dir())
    if problem:
        raise ConfigError("temporary folder", problem)
    if threading.current_thread() is not threading.main_thread():
        forkserver.ensure_running()  # only the main thread may change a signal's handler
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        forkserver.ensure_running()
    finally:
        signal.signal(signal.SIGINT, previous)


def start_forkserver() -> None:
    """Start the workers' forkserver now, if it is not running, without waiting for it.

    The server imports torch in its own process, which takes seconds; a command line that
    calls this before importing torch itself has both imports run at once, on two cores
    (``examples/train_4d.py``: a 2-step run of 4 ranks took 6.3-7.5 s instead of 8.4-9.3 s
    on the course's 2-core machines).  Its environment is the one it starts with, as at any
    first launch.
    Raises :class:`~tutorial_lib.config.ConfigError` where the temporary folder's path is
    too long for the server's socket (:func:`forkserver_socket_problem`)."""
    _get_context()  # sets the preloaded modules
    _ensure_forkserver()


def _start(processes) -> None:
    """Start the workers; if the forkserver died, start a new one and try once more."""
    with _main_module_hidden():
        for p in processes:
            try:
                _ensure_forkserver()
                p.start()
            except (EOFError, ConnectionError, FileNotFoundError):
                _restart_forkserver()
                _ensure_forkserver()
                p.start()


RUN_DIR = re.compile(r"^tutorial_lib_[a-z0-9]+_(\d+)_")
"""The temporary folders of launches, clusters and train_4d runs: ``tutorial_lib_<kind>_<pid>_``
and a random tail, ``<pid>`` the process that made it."""


def proc_stat(pid: int | str) -> list[str]:
    """The fields of ``/proc/PID/stat`` after the command's name (Linux): its state first
    (of the main thread: ``R``, ``S``, ``Z``, ...), then its parent's pid.  The name comes
    in parentheses and may itself hold spaces or ``)``, so the fields start after the last
    ``)``.  ``OSError`` where there is no such process, or no ``/proc``."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()


def process_running(pid: int) -> bool:
    """Whether ``pid`` runs: a zombie (exited, not yet reaped by its parent) does not."""
    try:
        return proc_stat(pid)[0] != "Z"
    except FileNotFoundError:
        return False
    except OSError:  # no /proc: ask the kernel (a zombie then counts as running)
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:  # another user's process
            return True
        return True


def remove_orphaned_run_dirs(directory: str | None = None) -> list[str]:
    """Remove the run folders (:data:`RUN_DIR`) whose process is gone: a launcher killed by
    ``SIGKILL`` cannot remove its own.  Returns the paths removed."""
    directory = directory or tempfile.gettempdir()
    removed = []
    for name in os.listdir(directory):
        found = RUN_DIR.match(name)
        if found and not process_running(int(found.group(1))):
            shutil.rmtree(os.path.join(directory, name), ignore_errors=True)
            removed.append(os.path.join(directory, name))
    return removed


def make_run_dir(prefix: str) -> str:
    """A new temporary folder ``<prefix><pid>_...`` (``prefix`` like ``tutorial_lib_launch_``),
    after removing those of processes that died without removing theirs."""
    remove_orphaned_run_dirs()
    return tempfile.mkdtemp(prefix=f"{prefix}{os.getpid()}_")


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (children, their children, ...): the one process-tree walk
    (the launcher's tests, the course grader).  The parents come from ``/proc`` on Linux, from
    ``ps`` elsewhere; an empty list when neither answers."""
    children: dict[int, list[int]] = {}
    for child, parent in _parents():
        children.setdefault(parent, []).append(child)
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def _parents() -> list[tuple[int, int]]:
    """``(pid, parent pid)`` of every process this user can see."""
    if os.path.isdir("/proc/self"):
        pairs = []
        for entry in filter(str.isdigit, os.listdir("/proc")):
            try:
                pairs.append((int(entry), int(proc_stat(entry)[1])))
            except (OSError, ValueError, IndexError):
                continue  # exited since the listing
        return pairs
    try:
        table = subprocess.run(["ps", "-A", "-o", "pid=,ppid="], capture_output=True,
                               text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [(int(parts[0]), int(parts[1]))
            for parts in map(str.split, table.split("\n")) if len(parts) == 2]


class RankProcesses:
    """The worker processes of one launch (or one cluster) and the launcher's pipe ends.

    Per rank: a result pipe, stdout and stderr pipes (read by :class:`Collector`); for all
    ranks one liveness pipe whose write end only this object holds.  ``close`` ends every
    worker's process group, reads what is left in the pipes and removes the run folder.
    """

    def __init__(self, world_size: int, print_output: bool, prefix: str = "tutorial_lib_launch_"):
        self.world_size = world_size
        self.context = _get_context()
        self.run_dir = make_run_dir(prefix)
        self.init_method = f"file://{os.path.join(self.run_dir, 'rendezvous')}"
        self.collector = Collector(world_size, print_output)
        self.processes: list = []
        self._alive_write: int | None = None
        self.started = time.time()

    def start(self, target: Callable, args_of: Callable) -> None:
        """One process per rank running ``target(*args)``, with ``args, extra =
        args_of(rank, ends)``: ``ends`` are the child's ends ``(result, stdout, stderr,
        alive)``; ``extra`` lists the child's ends of any further pipes, closed here once
        the children hold their copies."""
        alive_read, self._alive_write = os.pipe()  # the launcher alone holds the write end
        alive = mp_connection.Connection(alive_read, writable=False)
        to_close = [alive]
        for rank in range(self.world_size):
            result_read, result_write = self.context.Pipe(duplex=False)
            out_read, out_write = os.pipe()
            err_read, err_write = os.pipe()
            self.collector.add_rank(rank, result_read, out_read, err_read)
            ends = (result_write, mp_connection.Connection(out_write, readable=False),
                    mp_connection.Connection(err_write, readable=False), alive)
            args, extra = args_of(rank, ends)
            to_close += [*ends[:3], *extra]
            self.processes.append(self.context.Process(target=target, args=args,
                                                       name=f"tutorial_lib-rank{rank}"))
        self.started = time.time()
        try:
            _start(self.processes)
        finally:
            for conn in to_close:  # the children hold their own copies now
                conn.close()

    def dead_ranks(self, done: set[int], grace: float = 0.5) -> list[int]:
        """Ranks outside ``done`` whose process exited without a result.

        A rank sends its result and exits at once (all ranks leave together, after a
        barrier), so it can exit between the launcher's read of the pipes and its look at
        the exit codes, its result still waiting in the pipe: read what arrives for
        ``grace`` seconds before calling it dead (``done`` grows meanwhile).
        """
        def missing():
            return [r for r, p in enumerate(self.processes)
                    if r not in done and p.exitcode is not None]
        end = time.time() + grace
        while missing() and not self.collector.failures and time.time() < end:
            self.collector.poll(0.05)
        return missing()

    def report(self, done: set[int]) -> dict[int, str]:
        return _rank_report(self.processes, self.run_dir, done)

    def close(self) -> None:
        _kill(self.processes)
        self.collector.drain(1.0)
        self.collector.close()
        if self._alive_write is not None:
            os.close(self._alive_write)
            self._alive_write = None
        shutil.rmtree(self.run_dir, ignore_errors=True)


def worker_options(world_size: int, timeout: float, trace: bool = True, capture_values: int = 0,
                   threads: int | None = None, check_collectives: bool | None = None) -> dict:
    """What every worker needs to know, checked."""
    _check_seconds("timeout", timeout)
    if check_collectives is None:
        check_collectives = in_notebook()
    return {"timeout": float(timeout), "trace": trace, "capture_values": int(capture_values),
            # one thread per rank, as torchrun sets OMP_NUM_THREADS=1: the course's tensors are
            # small, and a second thread that waits on a busy machine costs more than it gives
            "threads": threads or 1,
            "check_collectives": bool(check_collectives),
            # read here, in the launcher: a forked worker has the forkserver's environment
            "default_device": os.environ.get(STRICT_DEVICE_VARIABLE) or None}


def resolve_backend(backend: str, world_size: int) -> str:
    """The backend of a launch of ``world_size`` ranks on this machine
    (:func:`choose_backend`); says once when GPUs are there but too few."""
    if backend == "gloo":
        return "gloo"
    chosen, note = choose_backend(backend, world_size, gpu_count())
    _say_once(note)
    return chosen


def launch(fn: Callable[..., Any], world_size: int, args: tuple = (), kwargs: dict | None = None,
           backend: str = "auto", timeout: float = 60.0, trace: bool = True,
           capture_values: int = 0, print_output: bool = True, threads: int | None = None,
           start_timeout: float = 180.0, check_collectives: bool | None = None) -> LaunchResult:
    """Run ``fn(ctx, *args, **kwargs)`` on ``world_size`` ranks and return every result.

    ``backend``: ``"gloo"``, ``"nccl"`` or ``"auto"`` (NCCL when each rank gets a GPU: rank
    ``r`` uses ``cuda:r``, its ``ctx.device``; with more ranks than GPUs, gloo on the CPU, and
    a note says so once).  ``"nccl"`` on a machine with fewer GPUs than ranks raises
    :class:`~tutorial_lib.config.ConfigError` before any worker starts.  Tensors on a GPU in
    the results come back as CPU tensors.
    ``timeout``: seconds, counted from the moment every rank has joined the process group,
    before the launch is declared deadlocked and killed; ``start_timeout`` bounds the
    start-up before that.  ``trace``: record every traced op; ``capture_values``: also
    record the values of tensors with at most this many elements (for animations).
    ``threads``: torch threads per worker (default 1, as torchrun's ``OMP_NUM_THREADS``).
    ``check_collectives``: compare every collective's op, shapes and dtypes across ranks
    before it runs (torch's ``TORCH_DISTRIBUTED_DEBUG=DETAIL``); default: on inside a
    notebook, off elsewhere (it costs an extra exchange per collective).
    """
    _check_positive_int("world_size", world_size)
    backend = resolve_backend(backend, world_size)
    _check_seconds("start_timeout", start_timeout)
    options = worker_options(world_size, timeout, trace, capture_values, threads,
                             check_collectives)
    payload = cloudpickle.dumps((fn, tuple(args), dict(kwargs or {})))
    ranks = RankProcesses(world_size, print_output)
    collector = ranks.collector
    try:
        ranks.start(_worker_main, lambda rank, ends: (
            (rank, world_size, backend, ranks.init_method, payload, *ends, ranks.run_dir,
             options), ()))
        deadline = ranks.started + start_timeout
        joined = False
        while len(collector.finished) < world_size:
            collector.poll(0.05)
            if collector.failures or ranks.dead_ranks(collector.finished):
                error = collector.first_cause(ranks.processes)
                if error is not None:
                    raise error
            if not joined and len(collector.ready) == world_size:
                joined, deadline = True, time.time() + timeout
            if time.time() > deadline:
                report = ranks.report(collector.finished)
                if joined:
                    raise LaunchTimeout(timeout, report)
                for rank in range(world_size):
                    if rank in collector.ready and rank not in collector.finished:
                        report[rank] = "joined the process group; " + report[rank]
                raise StartupTimeout(start_timeout, report)
        for p in ranks.processes:
            p.join(2.0)  # each rank exits right after its result
    finally:
        ranks.close()
    return LaunchResult(results=collector.results, trace=Trace(collector.events),
                        output=collector.output, backend=backend,
                        wall_time=time.time() - ranks.started)


def _check_positive_int(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a whole number >= 1, got {value!r}")


def _check_seconds(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or value <= 0:
        raise ValueError(f"{name} must be a finite number of seconds > 0, got {value!r}; "
                         f"e.g. {name}=60")


def warm_up() -> float:
    """Start the forkserver (imports torch once); returns the seconds it took."""
    t0 = time.time()
    launch(_noop, 1, trace=False, check_collectives=False)
    return time.time() - t0


def _noop(ctx):
    return ctx.rank


# --- torchrun -----------------------------------------------------------------------------


def is_torchrun() -> bool:
    """True inside a process started by ``torchrun`` (it sets these variables)."""
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR"))


def torchrun_backend(backend: str = "auto") -> tuple[str, str]:
    """``(backend, device)`` of this torchrun process: ``LOCAL_RANK`` picks the GPU.

    ``"auto"``: NCCL when every local rank (``LOCAL_WORLD_SIZE``) has its own GPU, else
    gloo on the CPU (local rank 0 says why, when there are GPUs); ``"nccl"`` without a GPU
    for each local rank is a :class:`~tutorial_lib.config.ConfigError`, raised before the
    process group is joined.
    """
    local_rank = int(os.environ["LOCAL_RANK"])
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", local_rank + 1))
    chosen, note = choose_backend(backend, local_ranks, gpu_count())
    if local_rank == 0:
        _say_once(note)
    return chosen, (f"cuda:{local_rank}" if chosen == "nccl" else "cpu")


def _torchrun_store(rank: int, world_size: int):
    """torchrun's store (``MASTER_ADDR:MASTER_PORT``, as ``env://`` reads it), its keys under
    a prefix of this attempt (``TORCHELASTIC_RESTART_COUNT``).  After ``--max-restarts``
    starts the workers again, torch 2.13's store still holds the dead attempt's gloo
    addresses, and the new workers tried to connect to them ("Connection refused")."""
    import torch.distributed as dist
    use_agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size,
                          is_master=not use_agent_store and rank == 0,
                          multi_tenant=not use_agent_store)
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return dist.PrefixStore(f"tutorial_lib/attempt_{attempt}", store)


def run_under_torchrun(fn: Callable[..., Any], args: tuple = (), kwargs: dict | None = None,
                       backend: str = "auto", trace: bool = True, capture_values: int = 0):
    """Run ``fn(ctx, ...)`` in this torchrun process; returns ``(result, tracer events)``.

    ``backend``: as :func:`torchrun_backend` decides (``ctx.device`` is ``cuda:LOCAL_RANK``
    under NCCL).
    """
    import torch.distributed as dist
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ["LOCAL_RANK"])
    backend, device = torchrun_backend(backend)
    if backend == "nccl":
        import torch
        torch.cuda.set_device(device)
    tracer = set_tracer(Tracer(rank, enabled=trace, capture_values=capture_values))
    dist.init_process_group(process_group_backend(backend), store=_torchrun_store(rank, world_size),
                            rank=rank, world_size=world_size)
    try:
        enter_device(device, os.environ.get(STRICT_DEVICE_VARIABLE) or None)
        ctx = WorkerContext(rank=rank, world_size=world_size, backend=backend, device=device,
                            local_rank=local_rank)
        result = fn(ctx, *args, **(kwargs or {}))
        events = tracer.resolved_events()
    finally:
        dist.destroy_process_group()
    return result, events
