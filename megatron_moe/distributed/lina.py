"""Lina: gradient all-reduce in fixed-size micro-ops that never start during an all-to-all.

Lina (Li et al., USENIX ATC 2023) observed that backward all-to-alls slow down
badly when they share the network with the data-parallel all-reduce, and
fixed it by (1) splitting the all-reduce into small equal micro-ops and
(2) a priority queue in which all-to-all always goes first: a micro-op is
launched only when no all-to-all is queued or in flight, so an all-to-all
waits at most for the one micro-op already on the wire.

Here:
  * `submit(kind, flat, group)` splits one gradient tensor (GradSync hands
    over one parameter's gradient at a time, so a chunk never mixes two
    tensors) into chunks of `partition_mb` MB (the last one shorter) and
    appends them to a FIFO queue;
  * one launcher thread pops the queue, launches one async all-reduce at a
    time (like a single NCCL stream) and waits for it; it launches only while
    the gate is open: no all-to-all in flight (the `a2a_start`/`a2a_end`
    notifications the collective observer sends) and none imminent
    (`a2a_imminent()`, which every MoE layer's dispatcher calls once `attach(model)`
    registered the scheduler, when backward reaches the combine step: in a Lancet
    partitioned layer too, which tracks the output of all its parts);
  * the gate check and the launch happen under the same lock that
    `a2a_start` takes, so no micro-op is ever launched between an
    all-to-all's start and its end on this rank;
  * the queue order is the submission order, and GradSync submits in a fixed
    parameter order on every rank, so every rank of a group issues its
    micro-ops in the same order whatever the timing (gloo requires it);
    ops of the dp and expert-dp groups share the one queue, so the order
    across groups is the same on every rank too, which a launcher that waits
    for each op needs to never wait on a peer that waits on it;
  * `drain()` (GradSync.finish, before the optimizer step) opens the gate and
    waits until every micro-op has finished;
  * a watchdog: each micro-op is waited for with `timeout_s`
    (--comm-timeout); a micro-op that does not finish in time (a stalled or
    dead peer, or ranks that issued collectives in different orders) becomes
    a `CommTimeoutError` raised by `drain()` instead of a silent hang.

Every launch and finish goes into the collective observer (`observer.py`); `summary()`
returns the all-to-all time in backward and how long gradient all-reduce
overlapped an all-to-all. Micro-ops do not change any value: each element is
summed over the same ranks as in a bucketed all-reduce.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Optional

import torch

from megatron_moe.distributed import observer
from megatron_moe.distributed.collectives import all_reduce_raw, group_size
from megatron_moe.distributed.comm_errors import CommPeerLostError, CommTimeoutError, describe_group, translate
from megatron_moe.distributed.observer import group_name
from megatron_moe.profiling import annotate

log = logging.getLogger("megatron_moe.lina")
MB = 2 ** 20


@dataclass
class MicroOp:
    """Chunk `part` of `parts` of one gradient tensor, all-reduced in place over `group`."""

    index: int                 # position in this iteration's queue (= launch order)
    kind: str                  # 'dp' or 'expert_dp'
    chunk: torch.Tensor        # a contiguous 1-D view into the gradient
    group: object
    part: int                  # chunk number within its tensor
    parts: int                 # chunks of its tensor
    queued: float              # perf_counter when submitted
    handle: "GradHandle"
    work: object = None
    event: Optional[observer.CommEvent] = None

    @property
    def nbytes(self) -> int:
        return self.chunk.numel() * self.chunk.element_size()


@dataclass
class GradHandle:
    """Completion of every micro-op of one submitted tensor; `wait()` returns once they are done."""

    scheduler: "LinaScheduler"
    remaining: int
    done_event: threading.Event = field(default_factory=threading.Event)

    def wait(self) -> None:
        while not self.done_event.wait(0.5):
            self.scheduler._raise_if_failed()
        self.scheduler._raise_if_failed()


class LinaScheduler:
    """Lina's gradient all-reduce scheduler (see the module docstring).

    `partition_mb`: micro-op size in MB (2**20 bytes; --lina-partition-mb).
    `timeout_s`: seconds a micro-op may take before `drain()` raises
    CommTimeoutError (--comm-timeout). `prioritize=False` launches micro-ops
    as soon as they are queued, ignoring all-to-alls (an ablation for tests
    and benchmarks, not Lina). The scheduler keeps a CommLog running from
    construction to `close()` (the last `max_events` events, for tests and
    benchmarks) and folds each iteration's events into running totals at
    `drain()`; `summary()` returns those totals, `close()` logs them.
    """

    def __init__(self, partition_mb: float = 30.0, timeout_s: float = 600.0, *, prioritize: bool = True,
                 log_events: Optional[observer.CommLog] = None):
        if not partition_mb > 0:
            raise ValueError(f"--lina-partition-mb must be positive, got {partition_mb}")
        if not timeout_s > 0:
            raise ValueError(f"--comm-timeout must be positive, got {timeout_s}")
        self.partition_mb, self.timeout_s, self.prioritize = float(partition_mb), float(timeout_s), prioritize
        self.partition_bytes = max(1, int(partition_mb * MB))
        self._cv = threading.Condition()
        self._queue: deque[MicroOp] = deque()
        self._a2a_in_flight = 0
        self._imminent = False
        self._draining = False
        self._pending = 0              # micro-ops submitted and not finished
        self._count = 0                # micro-ops submitted this iteration
        self._error: Optional[BaseException] = None
        self._closed = False
        self._thread: Optional[threading.Thread] = None
        self._hooks: list = []
        self.log = (log_events or observer.CommLog(max_events=20_000)).start()
        self._totals: dict = {}
        self._folded_seq = -1          # events up to this seq are in _totals
        self.iterations = 0
        observer.add_a2a_listener(self)

    # ------------------------------------------------------------------ model hooks
    def attach(self, model: torch.nn.Module) -> None:
        """Listen to the dispatcher of every MoE layer of `model` that exchanges tokens between
        ranks: it calls `a2a_imminent` when backward reaches the combine step and
        `moe_backward_done` when the layer's backward is over."""
        for layer in model.moe_layers():
            # a layer whose token exchange stays inside one rank has no all-to-all to wait for
            if layer.dispatcher.crosses_ranks:
                self._hooks.append(layer.dispatcher.add_listener(self))

    # ------------------------------------------------------------------ all-to-all notifications
    def a2a_imminent(self) -> None:
        """An all-to-all is about to be issued: launch no new micro-op until it has run."""
        with self._cv:
            self._imminent = True

    def moe_backward_done(self) -> None:
        """An MoE layer's backward finished: an imminent flag it left (no all-to-all came) is void."""
        with self._cv:
            self._imminent = False
            self._cv.notify_all()

    def a2a_start(self, group: str) -> None:
        """Listener hook (collectives): an all-to-all starts now. Holds the lock the launcher
        launches under, so a launch is either before this or after the matching a2a_end."""
        with self._cv:
            self._a2a_in_flight += 1
            self._imminent = False

    def a2a_end(self, group: str) -> None:
        """Listener hook (collectives): the all-to-all finished; micro-ops may go again."""
        with self._cv:
            self._a2a_in_flight = max(0, self._a2a_in_flight - 1)
            self._cv.notify_all()

    def _gate_open(self) -> bool:
        return self._draining or not self.prioritize or (self._a2a_in_flight == 0 and not self._imminent)

    # ------------------------------------------------------------------ queue
    def submit(self, kind: str, flat: torch.Tensor, group) -> GradHandle:
        """Queue `flat` (a contiguous 1-D gradient, reduced in place) as micro-ops of
        `partition_mb` MB over `group`; returns a handle that completes with its last chunk."""
        if flat.dim() != 1 or not flat.is_contiguous():
            raise ValueError("LinaScheduler.submit needs a contiguous 1-D tensor")
        self._raise_if_failed()
        per = max(1, self.partition_bytes // flat.element_size())
        n = flat.numel()
        parts = -(-n // per) if group_size(group) > 1 else 0
        handle = GradHandle(self, parts)
        if parts == 0:                          # nothing to reduce (group of one, empty tensor)
            handle.done_event.set()
            return handle
        now = time.perf_counter()
        with self._cv:
            for j in range(parts):
                self._queue.append(MicroOp(self._count, kind, flat[j * per:min(n, (j + 1) * per)], group,
                                           j, parts, now, handle))
                self._count += 1
            self._pending += parts
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="lina-launcher", daemon=True)
                self._thread.start()
            self._cv.notify_all()
        return handle

    def _run(self) -> None:
        """Launcher thread: launch the queue head when the gate is open, wait for it, repeat."""
        while True:
            with self._cv:
                while not self._closed and not (self._queue and self._gate_open()):
                    self._cv.wait()
                if self._closed:
                    return
                op = self._queue.popleft()
                # launch under the lock: a2a_start cannot slip between the gate check and the launch
                try:
                    with annotate("lina/micro_op"), observer.tagged("lina", queued=op.queued, index=op.index, part=op.part, parts=op.parts,
                                       self_timed=True):
                        op.work = all_reduce_raw(op.chunk, op.group, async_op=True)
                        op.event = observer.last_event()
                except Exception as e:            # noqa: BLE001  (reported by drain on the main thread)
                    self._error = RuntimeError(f"Lina: launching micro-op #{op.index} failed: {e!r}")
                    self._cv.notify_all()
                    return
            try:
                op.work.wait(timeout=timedelta(seconds=self.timeout_s))
            except Exception as e:                # noqa: BLE001  (gloo raises RuntimeError on timeout)
                what = (f"Lina: gradient all_reduce micro-op #{op.index} on {describe_group(op.group)} "
                        f"({op.nbytes} bytes, chunk {op.part + 1}/{op.parts} of its tensor)")
                lost = translate(e, "all_reduce", op.group)
                err: BaseException
                if isinstance(lost, CommPeerLostError):
                    err = CommPeerLostError(f"{what}: {lost}", "all_reduce", group_name(op.group))
                else:                             # the wait above has the scheduler's own limit
                    err = CommTimeoutError(
                        f"{what} did not finish within --comm-timeout {self.timeout_s:g} s: a peer rank is "
                        f"stalled or dead, or the ranks issued collectives in different orders ({e})",
                        "all_reduce", group_name(op.group))
                with self._cv:
                    self._error = err
                    self._cv.notify_all()
                return
            # finish time stamped here, before the next launch (the future callback may run later)
            observer.stamp_finish(op.event)
            with self._cv:
                self._pending -= 1
                op.handle.remaining -= 1
                if op.handle.remaining == 0:
                    op.handle.done_event.set()
                self._cv.notify_all()

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise self._error

    def drain(self) -> None:
        """Open the gate and wait until every queued micro-op has finished (call before the
        optimizer step). Raises CommTimeoutError when one did not finish in time."""
        with self._cv:
            self._draining = True
            self._cv.notify_all()
            try:
                while self._pending and self._error is None:
                    # the launcher's own wait times out first; this bounds a wedged launcher
                    before = self._pending
                    if not self._cv.wait(timeout=self.timeout_s + 5.0) and self._pending == before \
                            and self._error is None:
                        head = self._queue[0] if self._queue else None
                        where = f" on {describe_group(head.group)}" if head is not None else ""
                        self._error = CommTimeoutError(
                            f"Lina: {self._pending} gradient all_reduce micro-ops{where} made no progress in "
                            f"--comm-timeout {self.timeout_s:g} s", "all_reduce",
                            group_name(head.group) if head is not None else "other")
            finally:
                self._draining = False
                self._imminent = False
                self._count = 0
        self._raise_if_failed()
        self._fold()

    def _fold(self) -> None:
        """Add the events since the last fold to the running totals."""
        new = [e for e in self.log.snapshot() if e.seq > self._folded_seq]
        if new:
            self._folded_seq = max(e.seq for e in new)
            for k, v in observer.summarize(new).items():
                self._totals[k] = self._totals.get(k, 0) + v
        self.iterations += 1

    # ------------------------------------------------------------------ reporting, teardown
    def summary(self) -> dict:
        """`observer.summarize` totals (ms) over every drained iteration, plus the partition
        size and the number of iterations."""
        base = observer.summarize([])
        return {"partition_mb": self.partition_mb, "iterations": self.iterations,
                **{k: self._totals.get(k, v) for k, v in base.items()}}

    def close(self) -> dict:
        """Stop the launcher, remove hooks and listeners, log and return the summary."""
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        if self._thread is not None:       # idle, it exits at once; in a wait, within the timeout
            self._thread.join(timeout=self.timeout_s + 5.0)
            if self._thread.is_alive():
                log.warning(f"lina: the launcher thread did not stop within --comm-timeout {self.timeout_s:g} s")
            self._thread = None
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        observer.remove_a2a_listener(self)
        self.log.stop()
        s = self.summary()
        log.info(f"lina (micro-ops of {self.partition_mb:g} MB): {observer.format_summary(s)}")
        return s
