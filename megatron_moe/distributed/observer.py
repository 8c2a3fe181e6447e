"""The observer of collectives: what every collective of this process moved, and when.

Every collective in `megatron_moe.distributed` (and the dispatchers' all-to-alls) calls
`begin(op, group, sent, recv, remote_sent)` before launch and `end(token)` when it finishes (sync:
on return; async: at `Work.wait()` or future completion). While a `CommLog` is started each
collective becomes one `CommEvent`. With no log and no listener, `begin` costs one global read.

Byte convention (what tests compute from formulas):
  all_reduce      sent = recv = numel * itemsize
  all_gather      sent = local input, recv = group_size * local input
  reduce_scatter  sent = full input, recv = full input / group_size
  all_to_all      sent = input buffer, recv = output buffer,
                  remote_sent = the bytes that leave this rank

Intervals are [launch, finish] in `time.perf_counter()` seconds. All-to-all listeners (Lina) get
`a2a_start(group)` before the launch is stamped and `a2a_end(group, event)` after the finish is.
`a2a_queued()` stamps the `queued` time of the next all-to-all.

CUDA times completion, not enqueue: `begin` records a timed event on the caller's stream, the end
event goes on a per-group observer side stream after `work.wait()` there (the GPU waits, not the
host). `finish` is None until it completed; `resolve` (by `snapshot` and `CommLog.finish_step()`)
maps the events onto the `perf_counter` timeline; `completed(event)` asks without blocking. Under
TORCH_NCCL_BLOCKING_WAIT=1 the end event is recorded at the caller's `Work.wait()`, and an async
all-reduce ended by its future stays unresolved. On gloo an event finishes when its `Work` does.

Tags: 'lina' (a Lina micro-op), 'grad' (a GradSync bucket), '' (else); set with `tagged(...)`.
"""

from __future__ import annotations

import itertools
import os
import threading
import time
from collections import defaultdict, deque
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator, Optional

import torch
import torch.distributed as dist

from megatron_moe.distributed import streams

ACTIVE = False  # a log or a listener is registered
_LOGS: list["CommLog"] = []
_A2A_LISTENERS: list = []
_SEQ = itertools.count()
_local = threading.local()
_QUEUED: list[Optional[float]] = [None]
GRAD_TAGS = ("lina", "grad")  # tags of gradient all-reduces
_GROUP_NAMES: dict[int, str] = {}


def name_group(group, name: str) -> None:
    """Register a readable name ('mp', 'ep', ...) for a process group."""
    _GROUP_NAMES[id(group)] = name


def group_name(group) -> str:
    """The registered name of `group` ('world' for None / the default group)."""
    return "world" if group is None else _GROUP_NAMES.get(id(group), "other")


@dataclass
class CommEvent:
    """One collective. seq: launch order; nbytes (= `sent`): local input bytes; phase: 'bwd' inside
    autograd backward, else 'fwd'; launch / finish: perf_counter s (finish None while running);
    queued: when it was known to be coming; info["blocked"]: intervals spent in `wait()`.
    """

    seq: int
    op: str
    group: str
    nbytes: int
    tag: str
    phase: str
    launch: float
    finish: Optional[float] = None
    queued: Optional[float] = None
    info: dict = field(default_factory=dict)
    recv: int = 0
    remote_sent: int = 0

    @property
    def sent(self) -> int:
        return self.nbytes

    @property
    def duration(self) -> float:
        """Seconds from launch to finish (0 while unfinished)."""
        return 0.0 if self.finish is None else self.finish - self.launch


class CommLog:
    """Collects CommEvents while started (the last `max_events`); several logs may be active, each
    gets every event."""

    def __init__(self, max_events: int = 200_000):
        self.events: deque[CommEvent] = deque(maxlen=max_events)
        self._lock = threading.Lock()  # other threads append while one reads

    def start(self) -> "CommLog":
        """Begin receiving events (idempotent); returns self."""
        if self not in _LOGS:
            _LOGS.append(self)
            _refresh()
        return self

    def stop(self) -> None:
        """Stop receiving events; the kept ones stay readable."""
        if self in _LOGS:
            _LOGS.remove(self)
            _refresh()

    def __enter__(self) -> "CommLog":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def clear(self) -> None:
        with self._lock:
            self.events.clear()

    def snapshot(self) -> list[CommEvent]:
        """A copy of the kept events (safe while another thread adds some); CUDA-timed events whose
        end event has completed get their GPU times first (`resolve`)."""
        with self._lock:
            evs = list(self.events)
        resolve(evs)
        return evs

    def finish_step(self) -> list[CommEvent]:
        """End of a step: wait for the GPU (when CUDA is in use), then resolve every CUDA-timed
        event; returns the snapshot."""
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()
        return self.snapshot()

    @property
    def records(self) -> list[CommEvent]:
        return self.snapshot()

    def of(
        self, op: Optional[str] = None, tags: Optional[Iterable[str]] = None, phase: Optional[str] = None
    ) -> list[CommEvent]:
        """Events matching op, any of `tags` and phase (None matches all), in launch order."""
        tags = None if tags is None else tuple(tags)
        evs = [e for e in self.snapshot() if (op is None or e.op == op) and (phase is None or e.phase == phase)]
        return sorted((e for e in evs if tags is None or e.tag in tags), key=lambda e: e.seq)

    def totals(self, key: str = "sent") -> dict[tuple[str, str], int]:
        """Sum of `key` bytes per (op, group)."""
        out: dict[tuple[str, str], int] = defaultdict(int)
        for e in self.snapshot():
            out[(e.op, e.group)] += getattr(e, key)
        return dict(out)

    def by_kind(self) -> dict[str, int]:
        """Bytes sent per 'op@group' string (for benchmark JSON)."""
        return {f"{op}@{g}": v for (op, g), v in sorted(self.totals("sent").items())}

    def summary(self) -> dict:
        return summarize(self.snapshot())


def summarize(evs: list[CommEvent]) -> dict:
    """Totals over `evs` (ms): a2a_bwd_ms / a2a_fwd_ms; grad_allreduce_ms (union); overlap_ms
    (gradient all-reduce during an all-to-all); launched_during_a2a (gradient all-reduces launched
    while an all-to-all was queued or in flight); n_a2a, n_grad_allreduce, grad_allreduce_bytes.
    """
    a2a = sorted((e for e in evs if e.op == "all_to_all"), key=lambda e: e.seq)
    grads = sorted((e for e in evs if e.op == "all_reduce" and e.tag in GRAD_TAGS), key=lambda e: e.seq)
    a2a_u = union([(e.launch, e.finish) for e in a2a if e.finish is not None])
    ar_u = union([(e.launch, e.finish) for e in grads if e.finish is not None])
    return {
        "a2a_bwd_ms": 1e3 * sum(e.duration for e in a2a if e.phase == "bwd"),
        "a2a_fwd_ms": 1e3 * sum(e.duration for e in a2a if e.phase == "fwd"),
        "grad_allreduce_ms": 1e3 * total_length(ar_u),
        "overlap_ms": 1e3 * intersection_length(a2a_u, ar_u),
        "launched_during_a2a": len(launched_during(grads, a2a)),
        "n_a2a": len(a2a),
        "n_grad_allreduce": len(grads),
        "grad_allreduce_bytes": sum(e.nbytes for e in grads),
    }


def format_summary(s: dict) -> str:
    """One readable line of `summarize`."""
    return (
        f"comm events: all-to-all {s['n_a2a']} ({s['a2a_bwd_ms']:.1f} ms in backward, "
        f"{s['a2a_fwd_ms']:.1f} ms in forward); gradient all-reduce {s['n_grad_allreduce']} ops, "
        f"{s['grad_allreduce_bytes'] / 2**20:.1f} MB, {s['grad_allreduce_ms']:.1f} ms busy, "
        f"{s['overlap_ms']:.1f} ms overlapped with all-to-all, "
        f"{s['launched_during_a2a']} launched during an all-to-all"
    )


# ----------------------------------------------------------------------------- interval arithmetic


def union(intervals: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    """Sorted disjoint intervals covering the same points as `intervals`."""
    out: list[list[float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def total_length(u: list[tuple[float, float]]) -> float:
    """Summed length of disjoint intervals."""
    return sum(b - a for a, b in u)


def intersection_length(u: list[tuple[float, float]], v: list[tuple[float, float]]) -> float:
    """Length of the intersection of two unions of disjoint sorted intervals."""
    i = j = 0
    total = 0.0
    while i < len(u) and j < len(v):
        lo, hi = max(u[i][0], v[j][0]), min(u[i][1], v[j][1])
        total += max(0.0, hi - lo)
        if u[i][1] < v[j][1]:
            i += 1
        else:
            j += 1
    return total


def launched_during(ops: list[CommEvent], a2as: list[CommEvent]) -> list[CommEvent]:
    """The ops of `ops` launched inside some all-to-all's [queued or launch, finish]
    (an unfinished all-to-all counts as still in flight)."""
    spans = [
        (a.launch if a.queued is None else min(a.queued, a.launch), a.finish if a.finish is not None else float("inf"))
        for a in a2as
    ]
    return [e for e in ops if any(lo <= e.launch <= hi for lo, hi in spans)]


def overlapping(ops: list[CommEvent], a2a: CommEvent) -> list[CommEvent]:
    """The ops of `ops` whose [launch, finish] intersects the all-to-all's interval."""
    hi_a = a2a.finish if a2a.finish is not None else float("inf")
    return [e for e in ops if e.launch <= hi_a and (e.finish is None or e.finish >= a2a.launch)]


# ----------------------------------------------------------------------------- completion on CUDA


@dataclass
class CudaTiming:
    """The CUDA events of one NCCL collective: `start` on the caller's stream before the launch,
    `end` after its completion (None until recorded); `resolved` once launch/finish were set."""

    start: streams.Marker
    end: Optional[streams.Marker] = None
    resolved: bool = False


_ANCHOR: list = [None]  # (perf_counter seconds, Marker): one point on both clocks
_NCCL: dict[int, bool] = {}  # id(group) -> runs on NCCL
# with TORCH_NCCL_BLOCKING_WAIT, work.wait() blocks the host: no early wait on the observer stream
_BLOCKING_WAIT = os.environ.get("TORCH_NCCL_BLOCKING_WAIT", "0").lower() in ("1", "true")


def _on_nccl(group) -> bool:
    """True when `group`'s collectives run on NCCL (complete on the GPU, after the call returns)."""
    if isinstance(group, str) or not torch.cuda.is_available() or not dist.is_initialized():
        return False
    key = id(group)
    if key not in _NCCL:
        try:
            _NCCL[key] = dist.get_backend(group) == "nccl"
        except (RuntimeError, ValueError, TypeError, AttributeError):  # LOCAL_GROUP, a foreign object
            _NCCL[key] = False
    return _NCCL[key]


def _anchor() -> tuple[float, streams.Marker]:
    """The anchor of GPU times: an event recorded and waited for right after a synchronize, and the
    host time then (taken once per process)."""
    if _ANCHOR[0] is None:
        torch.cuda.synchronize()
        m = streams.record_event(torch.cuda.current_stream(), timing=True)
        m.synchronize()
        _ANCHOR[0] = (time.perf_counter(), m)
    return _ANCHOR[0]


def _cuda_start() -> CudaTiming:
    _anchor()
    return CudaTiming(streams.record_event(torch.cuda.current_stream(), timing=True))


def _record_completion(token: Optional["_Token"], works: Optional[list]) -> None:
    """CUDA: record the end event of `token`'s collective once: on the group's observer stream after
    it waited on `works` (async), or on the caller's stream (`works` None: a synchronous call)."""
    if token is None or token.event is None:
        return
    timing = token.event.info.get("cuda")
    if not isinstance(timing, CudaTiming) or timing.end is not None:
        return
    if works is None:
        timing.end = streams.record_event(torch.cuda.current_stream(), timing=True)
        return
    if _BLOCKING_WAIT:  # wait() would block the host here: the end is recorded at the caller's wait
        return
    side = streams.side_stream(torch.device("cuda", torch.cuda.current_device()), f"observer-{token.group}")
    with streams.use(side):
        for w in works:
            w.wait()  # NCCL: the side stream waits for the collective; the host does not
        timing.end = streams.record_event(side, timing=True)


def resolve_times(evs: Iterable[CommEvent], anchor_s: float, elapsed_ms: Callable[[streams.Marker], float]) -> int:
    """Set launch / finish of every CUDA-timed event of `evs` whose end marker has completed, to
    `anchor_s + elapsed_ms(marker) / 1e3`; returns how many were resolved."""
    n = 0
    for e in evs:
        timing = e.info.get("cuda")
        if not isinstance(timing, CudaTiming) or timing.resolved or timing.end is None or not timing.end.query():
            continue
        e.info.setdefault("enqueued", e.launch)
        e.launch = anchor_s + elapsed_ms(timing.start) / 1e3
        e.finish = anchor_s + elapsed_ms(timing.end) / 1e3
        timing.resolved = True
        n += 1
    return n


def resolve(evs: Iterable[CommEvent]) -> int:
    """`resolve_times` against this process's anchor (no-op when no CUDA event was recorded)."""
    if _ANCHOR[0] is None:
        return 0
    host, anchor = _ANCHOR[0]
    return resolve_times(evs, host, lambda m: anchor.cuda.elapsed_time(m.cuda))


def completed(ev: Optional[CommEvent]) -> bool:
    """Has the collective of `ev` completed? CUDA-timed: its end event has (never blocks); else:
    its finish was stamped."""
    if ev is None:
        return False
    timing = ev.info.get("cuda")
    if isinstance(timing, CudaTiming):
        return timing.end is not None and timing.end.query()
    return ev.finish is not None


# ----------------------------------------------------------------------------- hooks for collectives


def _refresh() -> None:
    global ACTIVE
    ACTIVE = bool(_LOGS or _A2A_LISTENERS)


def add_a2a_listener(listener) -> None:
    """Register an object with a2a_start(group: str) and a2a_end(group: str) methods."""
    if listener not in _A2A_LISTENERS:
        _A2A_LISTENERS.append(listener)
        _refresh()


def remove_a2a_listener(listener) -> None:
    """Unregister a listener added with add_a2a_listener (no error if absent)."""
    if listener in _A2A_LISTENERS:
        _A2A_LISTENERS.remove(listener)
        _refresh()


@contextmanager
def tagged(tag: str, **info) -> Iterator[None]:
    """Ops issued by this thread inside the block carry `tag` and `info` (queued=... sets the
    event's queued time; self_timed=True: the issuing thread stamps the finish itself)."""
    old = getattr(_local, "tag", None)
    _local.tag = (tag, info)
    try:
        yield
    finally:
        _local.tag = old


def a2a_queued() -> None:
    """An all-to-all is about to be issued (backward reached a combine step): stamp the next one."""
    if _QUEUED[0] is None:
        _QUEUED[0] = time.perf_counter()


def _in_backward() -> bool:
    # -1 outside a backward pass; the API is private but stable (torch.utils.checkpoint uses it)
    f = getattr(torch._C, "_current_graph_task_id", None)
    return f is not None and f() >= 0


@dataclass
class _Token:
    """What `begin` hands to `end`: the group and the event (None when no log is active)."""

    op: str
    group: str
    event: Optional[CommEvent]
    ended: bool = False


def begin(op: str, group, sent: int, recv: int = 0, remote_sent: int = 0) -> Optional[_Token]:
    """A collective on `group` is launched now; returns the token for `end` (None if unobserved)."""
    _local.last = None
    if not ACTIVE:
        return None
    name = group if isinstance(group, str) else group_name(group)
    if op == "all_to_all":
        for listener in list(_A2A_LISTENERS):
            listener.a2a_start(name)
    ev = None
    if _LOGS:
        tag, info = getattr(_local, "tag", None) or ("", {})
        info = dict(info)
        queued = info.pop("queued", None)
        if op == "all_to_all":
            queued, _QUEUED[0] = _QUEUED[0], None
        if _on_nccl(group):
            info["cuda"] = _cuda_start()
        ev = CommEvent(
            next(_SEQ),
            op,
            name,
            int(sent),
            tag,
            "bwd" if _in_backward() else "fwd",
            time.perf_counter(),
            queued=queued,
            info=info,
            recv=int(recv),
            remote_sent=int(remote_sent),
        )
        for log in list(_LOGS):
            with log._lock:
                log.events.append(ev)
        _local.last = ev
    return _Token(op, name, ev)


def last_event() -> Optional[CommEvent]:
    """The event of the last op this thread began (None if no log was active then)."""
    return getattr(_local, "last", None)


def stamp_finish(ev: Optional[CommEvent]) -> None:
    """Time-stamp the finish of an event (None is ignored; a CUDA-timed one keeps the host time in
    info["host_end"]: its finish is its end event's)."""
    if ev is None:
        return
    if isinstance(ev.info.get("cuda"), CudaTiming):
        ev.info.setdefault("host_end", time.perf_counter())
    elif ev.finish is None:
        ev.finish = time.perf_counter()


def end(token: Optional[_Token]) -> None:
    """The collective of `token` finished (once per token): stamp it, then tell the listeners."""
    if token is None or token.ended:
        return
    token.ended = True
    _record_completion(token, None)  # CUDA, synchronous: the caller's stream waited on it
    stamp_finish(token.event)
    if token.op == "all_to_all":
        for listener in list(_A2A_LISTENERS):
            listener.a2a_end(token.group, token.event)


def end_when_complete(token: Optional[_Token], work) -> None:
    """Finish now (work None: synchronous), or when async work completes (a future callback),
    unless the issuing thread stamps the finish itself (`tagged(..., self_timed=True)`)."""
    if token is None:
        return
    if work is None:
        end(token)
    elif token.event is not None and isinstance(token.event.info.get("cuda"), CudaTiming):
        _record_completion(token, [work])  # completion from CUDA events, not the future
    elif token.event is not None and not token.event.info.get("self_timed"):
        try:
            work.get_future().then(lambda _f: end(token))
        except (RuntimeError, AttributeError):  # a backend without futures: the event stays unfinished
            token.event.info["unfinished"] = True


class Work:
    """An async collective's work (or several, waited on as one): `wait()` waits, then ends the
    observed interval. Other attributes are the first wrapped work's."""

    def __init__(self, work, token: Optional[_Token]):
        self._works = work if isinstance(work, list) else [work]
        self._token = token
        _record_completion(token, self._works)  # CUDA: the end event, recorded at launch time

    def wait(self, *args, **kwargs):
        t0 = time.perf_counter()
        for w in self._works:
            w.wait(*args, **kwargs)
        if self._token is not None and self._token.event is not None:  # when this thread was blocked
            self._token.event.info.setdefault("blocked", []).append((t0, time.perf_counter()))
        end(self._token)
        return True

    def __getattr__(self, name):
        return getattr(self._works[0], name)
