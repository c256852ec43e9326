"""Ranks that stay up between cells: a persistent :class:`Cluster` and the ``%%ranks`` magic.

:func:`~tutorial_lib.launch.launch` starts its workers for every cell and they are gone
when it returns.  A cluster starts ``N`` workers once; they join the process group and
then wait for work.  Each call runs on every rank (or some), returns every rank's result
and the merged trace, like ``launch``, and each rank keeps a namespace between calls::

    cluster = Cluster(4)
    cluster.run(build_model)                 # fn(ctx): keep things in ctx.namespace
    cluster.run(lambda ctx: ctx.namespace["model"].weight.grad.norm().item())
    cluster.close()

In a notebook, after ``%load_ext tutorial_lib.cluster``::

    %ranks_start 4          # start (or restart) the notebook's cluster
    %%ranks                 # the cell runs on every rank, in that rank's namespace
    x = torch.full((2,), float(ctx.rank))
    comm.all_reduce(x)
    x                       # the last expression's value comes back from every rank
    %%ranks 0,3             # only on ranks 0 and 3 (no collective then, of course)
    %ranks_status           # and %ranks_stop

The guarantees are the launcher's (it shares its machinery): every rank's stdout and
stderr in whole lines prefixed ``[rank r]``; a raising rank's traceback; at ``timeout`` a
report of what every rank is blocked in, the clock starting when the call has reached
every rank; an interrupted cell stops the call; a liveness pipe and process groups, so
closing the notebook, restarting or killing its kernel leaves no process behind.

After a failure the cluster says whether it is still usable: when every rank of the call
reported back (an exception on all of them, say), it is; when some rank is stuck (it waits
in a collective for the rank that raised) the workers are stopped and
:meth:`Cluster.restart` starts fresh ones (the namespaces are lost).  Which it is, is
found a second after the failure by interrupting the ranks still inside the call, as
Ctrl-C does: a rank whose Python code takes the interrupt says so at once and is waited
for, so a rank that was only slower keeps the cluster; a rank blocked in C++, which no
interrupt reaches, is named and the workers are stopped.
"""
from __future__ import annotations

import ast
import atexit
import os
import signal
import time
import traceback
from typing import Any, Callable

import cloudpickle

from .launch import (Collector, LaunchResult, LaunchTimeout, RankProcesses, StartupTimeout,
                     WorkerError, _check_positive_int, _check_seconds, _safe_summary, _send,
                     describe_exit, enter_worker, process_running, flush_output, join_world, pickled_result, resolve_backend,
                     worker_options)
from .trace import Trace, Tracer, set_tracer

__all__ = ["Cluster", "ClusterStopped", "RankValues", "load_ipython_extension"]

#: Written alone on a line to a worker's stdout and stderr after each call: the launcher
#: knows then that it has every line the call printed.
_END_OF_CALL = "\x1etutorial_lib-end-of-call\x1e"


class ClusterStopped(RuntimeError):
    """The cluster is not running (never started, closed, or stopped after a failure)."""


# --- the worker side -----------------------------------------------------------------------


def run_cell(code: str, namespace: dict) -> Any:
    """Execute a cell's ``code`` in ``namespace``; the value of its last line if that is an
    expression (as IPython shows it), else ``None``."""
    tree = ast.parse(code, filename="<%%ranks cell>", mode="exec")
    last = None
    if tree.body and isinstance(tree.body[-1], ast.Expr):
        last = ast.Expression(tree.body.pop().value)
    exec(compile(tree, "<%%ranks cell>", "exec"), namespace)  # noqa: S102 - the user's own cell
    if last is None:
        return None
    return eval(compile(last, "<%%ranks cell>", "eval"), namespace)  # noqa: S307


def _cluster_worker(rank, world_size, backend, init_method, result_conn, stdout_conn,
                    stderr_conn, alive, run_dir, options, commands) -> None:
    enter_worker(rank, stdout_conn, stderr_conn, alive, run_dir)
    try:
        set_tracer(Tracer(rank, enabled=False))
        ctx = join_world(rank, world_size, backend, init_method, options)
        import torch
        import torch.distributed as dist
        from . import comm
        ctx.namespace.update({"ctx": ctx, "torch": torch, "dist": dist, "comm": comm,
                              "__name__": "__ranks__"})
        _send(result_conn, ("ready", rank))
    except BaseException as exc:  # noqa: BLE001
        _send(result_conn, ("error", rank, _safe_summary(exc), traceback.format_exc()))
        os._exit(1)
    in_call = [False]

    def on_interrupt(signum, frame):  # Ctrl-C in the notebook stops a call, never an idle rank
        if in_call[0]:
            # Python has control again (a rank blocked in a collective never gets here): say
            # so at once, before the traceback is written, for the launcher's verdict.  The
            # main code sends on this pipe only outside the call, so nothing interleaves.
            _send(result_conn, ("interrupted", rank))
            raise KeyboardInterrupt

    signal.signal(signal.SIGINT, on_interrupt)
    while True:
        try:
            request = cloudpickle.loads(commands.recv_bytes())
        except (EOFError, OSError):
            os._exit(0)  # the cluster closed its end
        if request[0] == "stop":
            break
        _, what, trace, capture_values = request
        tracer = set_tracer(Tracer(rank, enabled=trace, capture_values=capture_values))
        tracer.use_device(ctx.device)
        _send(result_conn, ("started", rank))  # the call's timeout clock starts with all of these
        try:
            in_call[0] = True
            if isinstance(what, str):
                result = run_cell(what, ctx.namespace)
            else:
                fn, args, kwargs = what
                result = fn(ctx, *args, **kwargs)
            in_call[0] = False
            message = ("ok", rank, pickled_result(rank, result), tracer.event_dicts())
        except BaseException as exc:  # noqa: BLE001 - KeyboardInterrupt too: report and wait
            in_call[0] = False
            message = ("error", rank, _safe_summary(exc), traceback.format_exc())
        flush_output()
        for fd in (1, 2):
            try:
                os.write(fd, f"{_END_OF_CALL}\n".encode())
            except OSError:  # the call closed this stream: nothing more can come from it
                pass
        _send(result_conn, message)
    try:
        import torch.distributed as dist
        dist.destroy_process_group()
    finally:
        os._exit(0)


# --- the launcher side ---------------------------------------------------------------------


class _CallCollector(Collector):
    """The launcher's collector, per call: ``started`` ranks and the end-of-call markers."""

    def __init__(self, world_size: int, print_output: bool):
        super().__init__(world_size, print_output)
        self.started: set[int] = set()
        self.interrupted: set[int] = set()  # ranks whose Python code took the interrupt
        self.ended: dict[int, set[str]] = {r: set() for r in range(world_size)}

    def new_call(self, targets: list[int]) -> None:
        for r in targets:
            self.results[r] = None
            self.output[r] = []
            self.ended[r] = set()
        self.events, self.failures = [], []
        self.started, self.finished, self.interrupted = set(), set(), set()

    def _line(self, rank: int, stream: str, text: str) -> None:
        if text.endswith(_END_OF_CALL):  # after a last line printed without a newline, too
            text = text[:-len(_END_OF_CALL)]
            if text:
                super()._line(rank, stream, text)
            self.ended[rank].add(stream)
        else:
            super()._line(rank, stream, text)

    def reported(self) -> set[int]:
        return self.finished | {f.rank for f in self.failures}

    def handle(self, rank: int, message: tuple) -> None:
        if message[0] == "started":
            self.started.add(rank)
        elif message[0] == "interrupted":
            self.interrupted.add(rank)
        else:
            super().handle(rank, message)

    def streams_of(self, rank: int) -> set[str]:
        """The streams of ``rank`` still open (a closed one sends no end marker)."""
        return {stream for r, stream in self._streams.values() if r == rank}


class RankValues(dict):
    """What each rank's last expression evaluated to, by rank; shown one line per rank."""

    def __repr__(self) -> str:
        return "\n".join(f"rank {r}: {v!r}" for r, v in sorted(self.items()))

    def _repr_pretty_(self, printer, cycle) -> None:
        printer.text(repr(self))


class Cluster:
    """``world_size`` workers that join the process group once and run call after call.

    ``backend``, ``check_collectives``, ``threads`` as in :func:`~tutorial_lib.launch.launch`;
    ``start_timeout`` bounds the start (:class:`~tutorial_lib.launch.StartupTimeout`).
    """

    #: When a call is stopped (Ctrl-C, or an error on another rank): how long a rank may
    #: take to get the interrupt into its Python code (a blocked one never does), then how
    #: long it may take to report back once it has.
    INTERRUPT_ACK_SECONDS = 3.0
    INTERRUPT_REPORT_SECONDS = 30.0

    def __init__(self, world_size: int, backend: str = "auto", *, start_timeout: float = 180.0,
                 check_collectives: bool | None = None, threads: int | None = None,
                 print_output: bool = True, collective_timeout: float = 600.0):
        _check_positive_int("world_size", world_size)
        _check_seconds("start_timeout", start_timeout)
        self.world_size = world_size
        self.backend = resolve_backend(backend, world_size)
        self.start_timeout = start_timeout
        self.print_output = print_output
        # torch's own timeout for a blocked collective: long, the call's timeout comes first
        self._options = worker_options(world_size, collective_timeout, threads=threads,
                                       check_collectives=check_collectives)
        self._ranks: RankProcesses | None = None
        self._commands: list = []
        self.calls = 0
        self.last_failure: str = ""
        self.start()
        atexit.register(self.close)

    # -- life cycle --

    def start(self) -> None:
        """Start the workers and wait until every one has joined the process group."""
        if self._ranks is not None:
            raise RuntimeError("the cluster is already running; restart() stops it first")
        ranks = RankProcesses(self.world_size, self.print_output, prefix="tutorial_lib_cluster_")
        ranks.collector = _CallCollector(self.world_size, self.print_output)
        commands = []

        def args_of(rank, ends):
            read, write = ranks.context.Pipe(duplex=False)
            commands.append(write)
            return ((rank, self.world_size, self.backend, ranks.init_method, *ends, ranks.run_dir,
                     self._options, read), [read])

        try:
            ranks.start(_cluster_worker, args_of)
            deadline = ranks.started + self.start_timeout
            collector = ranks.collector
            while len(collector.ready) < self.world_size:
                collector.poll(0.05)
                if collector.failures or ranks.dead_ranks(collector.ready):
                    error = collector.first_cause(ranks.processes)
                    if error is not None:
                        raise error
                if time.time() > deadline:
                    raise StartupTimeout(self.start_timeout, ranks.report(collector.ready))
        except BaseException:
            ranks.close()
            for conn in commands:
                conn.close()
            raise
        self._ranks, self._commands = ranks, commands
        self.last_failure = ""

    @property
    def running(self) -> bool:
        """True while the workers are up and ready for a call: every process is alive (a rank
        that died since the last call stops the cluster, :meth:`status` says which)."""
        return self._dead_rank_error() is None and self._ranks is not None

    def _dead_rank_error(self) -> WorkerError | None:
        """A rank whose process ended while the cluster ran, as a :class:`WorkerError` (rank,
        exit code or signal, its last lines on stderr); the cluster is stopped then."""
        if self._ranks is None:
            return None
        for rank, process in enumerate(self._ranks.processes):
            if process.exitcode is None and not process_running(process.pid):
                process.join(5.0)  # gone: the forkserver reports its exit status soon
            if process.exitcode is not None:
                self._ranks.collector.drain(0.5)  # what it wrote before it died
                error = self._ranks.collector.died(rank, process.exitcode)
                self._fail(f"rank {rank} {describe_exit(process.exitcode)} between calls")
                return _with_note(error, "It died while the cluster was idle; the cluster was "
                                         "stopped. cluster.restart() starts it again.")
        return None

    def close(self) -> None:
        """Stop every worker (and what it started); the cluster can be started again."""
        ranks, self._ranks = self._ranks, None
        if ranks is None:
            return
        for conn in self._commands:
            try:
                conn.send_bytes(cloudpickle.dumps(("stop",)))
            except OSError:
                pass
            conn.close()
        self._commands = []
        for p in ranks.processes:
            p.join(0.5)
        ranks.close()

    def restart(self) -> None:
        """Stop the workers if they run, and start fresh ones (namespaces start empty)."""
        self.close()
        self.start()

    def status(self) -> str:
        """One line: running or not, the ranks, the calls so far, the last failure (a rank
        that died is found here, from its process)."""
        if not self.running:
            why = f" ({self.last_failure})" if self.last_failure else ""
            return f"cluster of {self.world_size} ranks: stopped{why}; restart() starts it"
        pids = [p.pid for p in self._ranks.processes]
        return (f"cluster of {self.world_size} ranks on {self.backend}: running, {self.calls} "
                f"call(s) so far, worker pids {pids}")

    def __enter__(self) -> "Cluster":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<Cluster: {self.status()}>"

    # -- calls --

    def run(self, fn: Callable[..., Any], *args, ranks: list[int] | None = None,
            timeout: float = 60.0, trace: bool = True, capture_values: int = 0,
            **kwargs) -> LaunchResult:
        """Run ``fn(ctx, *args, **kwargs)`` on ``ranks`` (default: all); every result and the
        merged trace.  ``ctx.namespace`` is the rank's dict kept between calls."""
        return self._call((fn, tuple(args), dict(kwargs)), ranks, timeout, trace, capture_values)

    def run_code(self, code: str, ranks: list[int] | None = None, timeout: float = 60.0,
                 trace: bool = True) -> LaunchResult:
        """Execute ``code`` in each rank's namespace (``ctx``, ``torch``, ``dist``, ``comm``
        are there); ``results[r]`` is the value of its last line if that is an expression."""
        return self._call(str(code), ranks, timeout, trace, 0)

    def _targets(self, ranks) -> list[int]:
        if ranks is None:
            return list(range(self.world_size))
        targets = sorted({int(r) for r in ranks})
        bad = [r for r in targets if not 0 <= r < self.world_size]
        if not targets or bad:
            raise ValueError(f"ranks must name ranks of this cluster (0 to {self.world_size - 1}), "
                             f"got {list(ranks)!r}")
        return targets

    def _call(self, what, ranks, timeout: float, trace: bool, capture_values: int) -> LaunchResult:
        _check_seconds("timeout", timeout)
        targets = self._targets(ranks)
        dead = self._dead_rank_error()
        if dead is not None:
            raise dead
        if not self.running:
            raise ClusterStopped(self.status())
        request = cloudpickle.dumps(("call", what, trace, capture_values))
        collector: _CallCollector = self._ranks.collector
        collector.new_call(targets)
        started = time.time()
        for r in targets:
            try:
                self._commands[r].send_bytes(request)
            except OSError:  # BrokenPipeError: the rank died just now
                self._ranks.processes[r].join(5.0)  # reap it: its exit status names the cause
                raise self._dead_rank_error() or ClusterStopped(self.status()) from None
        self.calls += 1
        try:
            self._wait(collector, targets, timeout)
        except KeyboardInterrupt:
            self._interrupt(collector, targets)
            raise
        results = [collector.results[r] if r in targets else None for r in range(self.world_size)]
        return LaunchResult(results=results, trace=Trace(collector.events),
                            output={r: collector.output[r] for r in targets},
                            backend=self.backend, wall_time=time.time() - started)

    def _call_done(self, collector: _CallCollector, targets: list[int]) -> bool:
        reported = collector.reported()
        return all(r in reported and collector.streams_of(r) <= collector.ended[r]
                   for r in targets)

    def _wait(self, collector: _CallCollector, targets: list[int], timeout: float) -> None:
        deadline = None
        while not self._call_done(collector, targets):
            collector.poll(0.02)
            dead = self._ranks.dead_ranks(collector.finished)
            error = collector.first_cause(self._ranks.processes) if dead else None
            if error is not None:
                exitcode = self._ranks.processes[dead[0]].exitcode
                self._fail(f"rank {dead[0]} {describe_exit(exitcode)} during a call")
                raise _with_note(error, "The cluster was stopped. cluster.restart() starts it again.")
            if deadline is None and collector.started >= set(targets):
                deadline = time.time() + timeout  # the clock starts when every rank has the call
            if deadline is not None and time.time() > deadline:
                report = self._ranks.report(collector.finished)
                self._fail("a call ran past its timeout")
                raise LaunchTimeout(timeout, {r: report[r] for r in targets})
            if collector.failures and not self._settle(collector, targets):
                # the others are still inside the call: computing, or blocked in C++ waiting
                # for a rank that has left it; stop them as Ctrl-C does, keep them if it can
                why = self._stop_the_call(collector, targets)
                if why is not None:
                    error = collector.first_cause(self._ranks.processes)
                    self._fail(f"rank {error.rank} raised while other ranks were still inside "
                               f"the call")
                    raise _with_note(error, f"The cluster was stopped: the other ranks could "
                                            f"not finish the call ({why}). cluster.restart() "
                                            f"starts it again.")
        if collector.failures:
            error = collector.first_cause(self._ranks.processes, grace=0)
            stopped = (f"Rank(s) {sorted(collector.interrupted)} were still running it and were "
                       f"interrupted; then every rank" if collector.interrupted else "Every rank")
            raise _with_note(error, f"{stopped} of the call reported back: the cluster is still "
                                    f"running and the namespaces are kept.")

    def _settle(self, collector: _CallCollector, targets: list[int], grace: float = 1.0,
                done: Callable[[], bool] | None = None) -> bool:
        """After a failure: wait a moment for every rank's report (or for ``done``); True if
        it came."""
        done = done or (lambda: self._call_done(collector, targets))
        end = time.time() + grace
        while time.time() < end and not done():
            collector.poll(0.02)
        return done()

    def _stop_the_call(self, collector: _CallCollector, targets: list[int]) -> str | None:
        """Interrupt the ranks still inside the call and wait for them; ``None`` when every
        rank reported back, else why not.

        A rank is stuck when its Python code does not take the interrupt: it is blocked in
        C++ (a collective waiting for a rank that left).  Taking it is acknowledged at once,
        so the first wait is only for the signal to be delivered and the rank scheduled;
        writing the traceback afterwards may take long on a loaded machine and has a wait
        of its own."""
        for r in set(targets) - collector.reported():
            try:
                os.kill(self._ranks.processes[r].pid, signal.SIGINT)
            except ProcessLookupError:
                pass

        def not_taken() -> list[int]:  # neither reported back nor took the interrupt
            return sorted(set(targets) - collector.reported() - collector.interrupted)

        self._settle(collector, targets, grace=self.INTERRUPT_ACK_SECONDS,
                     done=lambda: not not_taken())
        if blocked := not_taken():
            return f"rank(s) {blocked} blocked (in C++: a collective, say) at the interrupt"
        if self._settle(collector, targets, grace=self.INTERRUPT_REPORT_SECONDS):
            return None
        late = sorted(set(targets) - collector.reported())
        return (f"rank(s) {late} took the interrupt but did not report back within "
                f"{self.INTERRUPT_REPORT_SECONDS:g} s")

    def _interrupt(self, collector: _CallCollector, targets: list[int]) -> None:
        """Ctrl-C: stop the call on every rank (:meth:`_stop_the_call`); stop the cluster if
        some rank is stuck.  A second interrupt during the waits stops it at once."""
        try:
            why = self._stop_the_call(collector, targets)
        except KeyboardInterrupt:  # a second interrupt: stop now, wait no longer
            self._fail("interrupted again while the ranks were winding down")
            print("[cluster] interrupted again while the ranks were winding down, so the "
                  "cluster was stopped: cluster.restart() starts it again")
            raise
        if why is None:
            print("[cluster] call interrupted on every rank; the cluster is still running")
            return
        self._fail(why)
        print(f"[cluster] call interrupted; {why}, so the cluster was stopped: "
              "cluster.restart() starts it again")

    def _fail(self, why: str) -> None:
        self.last_failure = why
        self.close()


def _with_note(error: WorkerError, note: str) -> WorkerError:
    error.args = (f"{error.args[0]}\n\n{note}",)
    return error


# --- the notebook magic --------------------------------------------------------------------


_NOTEBOOK_CLUSTER: Cluster | None = None


def _parse_ranks(text: str, world_size: int) -> list[int] | None:
    text = text.strip()
    if not text:
        return None
    try:
        return [int(part) for part in text.replace(" ", ",").split(",") if part]
    except ValueError:
        raise ValueError(f"%%ranks takes rank numbers such as 0,3 (this cluster has ranks 0 to "
                         f"{world_size - 1}), got {text!r}") from None


def load_ipython_extension(ipython) -> None:
    """``%load_ext tutorial_lib.cluster``: registers ``%%ranks`` and ``%ranks_start/stop/status``."""
    from IPython.core.magic import Magics, cell_magic, line_magic, magics_class

    @magics_class
    class RanksMagics(Magics):
        @line_magic
        def ranks_start(self, line: str):
            """%ranks_start N [gloo|nccl]: start (or restart) this notebook's cluster."""
            global _NOTEBOOK_CLUSTER
            words = line.split()
            if not words:
                raise ValueError("%ranks_start takes the number of ranks, e.g. %ranks_start 4")
            if _NOTEBOOK_CLUSTER is not None:
                _NOTEBOOK_CLUSTER.close()
            _NOTEBOOK_CLUSTER = Cluster(int(words[0]), *(words[1:2] or ["auto"]))
            print(_NOTEBOOK_CLUSTER.status())

        @line_magic
        def ranks_stop(self, line: str = ""):
            """%ranks_stop: stop this notebook's cluster."""
            if _NOTEBOOK_CLUSTER is not None:
                _NOTEBOOK_CLUSTER.close()
                print(_NOTEBOOK_CLUSTER.status())

        @line_magic
        def ranks_status(self, line: str = ""):
            """%ranks_status: is the cluster running, with how many ranks."""
            print(_NOTEBOOK_CLUSTER.status() if _NOTEBOOK_CLUSTER else
                  "no cluster: %ranks_start N starts one")

        @cell_magic
        def ranks(self, line: str, cell: str):
            """%%ranks [0,3]: run the cell on every rank (or those listed), in its namespace."""
            if _NOTEBOOK_CLUSTER is None:
                raise ClusterStopped("no cluster yet: run %ranks_start N first")
            targets = _parse_ranks(line, _NOTEBOOK_CLUSTER.world_size)
            out = _NOTEBOOK_CLUSTER.run_code(cell, ranks=targets)
            values = RankValues({r: v for r, v in enumerate(out.results)
                                 if (targets is None or r in targets)})
            return None if all(v is None for v in values.values()) else values

    ipython.register_magics(RanksMagics)


def notebook_cluster() -> Cluster | None:
    """The cluster ``%ranks_start`` made (``None`` before)."""
    return _NOTEBOOK_CLUSTER
