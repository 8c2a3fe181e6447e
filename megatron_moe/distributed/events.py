"""Event log: when every traced collective of this process was launched and finished.

The comm tracer counts bytes; this log keeps *times*, so tests and benchmarks
can see which collectives ran at the same time. `collectives.py` calls
`op_begin` / `op_end` around its all-reduces and `a2a_begin` / `a2a_end`
around its all-to-alls, but only when `ACTIVE` is true (a log or an
all-to-all listener is registered), so the hooks cost one attribute read
otherwise.

An event's interval is [launch, finish] in `time.perf_counter()` seconds of
this process. A synchronous collective finishes when its call returns; an
asynchronous one when its work completes (a future callback, which fires on
the backend's thread). For all-to-alls, "in flight" is the interval from the
start of the call to its return (or to `wait()` of its async work).

All-to-all listeners (Lina's scheduler) are told `a2a_start(group)` *before*
the start is time-stamped and `a2a_end(group)` *after* the end is, so a
listener that refuses to launch between the two sees exactly the intervals
the log records.

Tags say who issued an op: 'lina' (a Lina micro-op), 'grad' (a GradSync
bucket), '' (anything else, e.g. an ESP all-reduce in the MoE layer). A
thread sets the tag of the ops it issues with `with tagged('lina', ...)`.
"""
from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterable, Iterator, Optional

import torch

ACTIVE = False                      # read by collectives.py before calling anything here
_LOGS: list["EventLog"] = []
_A2A_LISTENERS: list = []
_SEQ = itertools.count()
_local = threading.local()
GRAD_TAGS = ("lina", "grad")        # tags of gradient all-reduces


@dataclass
class CommEvent:
    """One collective issued by this process.

    seq: launch order in this process; op: 'all_to_all' / 'all_reduce';
    group: group kind ('ep', 'dp', ...); nbytes: local input bytes;
    tag: 'lina' / 'grad' / ''; phase: 'bwd' when issued inside autograd
    backward, else 'fwd'; launch / finish: perf_counter seconds (finish None
    while running); queued: when a scheduled op entered its queue (Lina);
    info: free-form details (micro-op index, chunk, ...).
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

    @property
    def duration(self) -> float:
        """Seconds from launch to finish (0 while unfinished)."""
        return 0.0 if self.finish is None else self.finish - self.launch


class EventLog:
    """Collects CommEvents while started (``with EventLog() as log:`` or start()/stop()).

    Keeps the last `max_events` events (a deque), so a long run cannot grow
    it without bound. Several logs may be active; each gets every event.
    """

    def __init__(self, max_events: int = 200_000):
        self.events: deque[CommEvent] = deque(maxlen=max_events)
        self._lock = threading.Lock()       # the launcher thread appends while others read

    def start(self) -> "EventLog":
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

    def __enter__(self) -> "EventLog":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def clear(self) -> None:
        """Forget the kept events."""
        with self._lock:
            self.events.clear()

    def snapshot(self) -> list[CommEvent]:
        """A copy of the kept events (safe while another thread adds some)."""
        with self._lock:
            return list(self.events)

    def of(self, op: Optional[str] = None, tags: Optional[Iterable[str]] = None,
           phase: Optional[str] = None) -> list[CommEvent]:
        """Events matching op, any of `tags` and phase (None matches all), in launch order."""
        tags = None if tags is None else tuple(tags)
        out = [e for e in self.snapshot()
               if (op is None or e.op == op) and (tags is None or e.tag in tags)
               and (phase is None or e.phase == phase)]
        return sorted(out, key=lambda e: e.seq)

    def summary(self) -> dict:
        """`summarize` of the kept events."""
        return summarize(self.snapshot())


def summarize(evs: list[CommEvent]) -> dict:
    """Totals over `evs` (milliseconds):

    a2a_bwd_ms: all-to-all time in backward; a2a_fwd_ms: in forward;
    grad_allreduce_ms: time some gradient all-reduce was running (union);
    overlap_ms: time a gradient all-reduce ran while an all-to-all was in flight;
    launched_during_a2a: gradient all-reduces launched while an all-to-all was in flight;
    n_a2a, n_grad_allreduce, grad_allreduce_bytes.
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
    """One readable line of `EventLog.summary()`."""
    return (f"comm events: all-to-all {s['n_a2a']} ({s['a2a_bwd_ms']:.1f} ms in backward, "
            f"{s['a2a_fwd_ms']:.1f} ms in forward); gradient all-reduce {s['n_grad_allreduce']} ops, "
            f"{s['grad_allreduce_bytes'] / 2 ** 20:.1f} MB, {s['grad_allreduce_ms']:.1f} ms busy, "
            f"{s['overlap_ms']:.1f} ms overlapped with all-to-all, "
            f"{s['launched_during_a2a']} launched during an all-to-all")


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
        if hi > lo:
            total += hi - lo
        if u[i][1] < v[j][1]:
            i += 1
        else:
            j += 1
    return total


def launched_during(ops: list[CommEvent], a2as: list[CommEvent]) -> list[CommEvent]:
    """The ops of `ops` whose launch time lies inside some all-to-all's [launch, finish]
    (an unfinished all-to-all counts as still in flight)."""
    spans = [(a.launch, a.finish if a.finish is not None else float("inf")) for a in a2as]
    return [e for e in ops if any(lo <= e.launch <= hi for lo, hi in spans)]


def overlapping(ops: list[CommEvent], a2a: CommEvent) -> list[CommEvent]:
    """The ops of `ops` whose [launch, finish] intersects the all-to-all's interval."""
    hi_a = a2a.finish if a2a.finish is not None else float("inf")
    return [e for e in ops if e.launch <= hi_a and (e.finish is None or e.finish >= a2a.launch)]


# ----------------------------------------------------------------------------- hooks for collectives.py

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
    """Ops issued by this thread inside the block carry `tag` and `info` (queued=... sets
    the event's queued time)."""
    old = getattr(_local, "tag", None)
    _local.tag = (tag, info)
    try:
        yield
    finally:
        _local.tag = old


def _in_backward() -> bool:
    # -1 outside a backward pass; the API is private but stable (torch.utils.checkpoint uses it)
    f = getattr(torch._C, "_current_graph_task_id", None)
    return f is not None and f() >= 0


def op_begin(op: str, group: str, nbytes: int) -> Optional[CommEvent]:
    """Time-stamp the launch of a collective; None when no log is active."""
    _local.last = None
    if not _LOGS:
        return None
    tag, info = getattr(_local, "tag", None) or ("", {})
    info = dict(info)
    queued = info.pop("queued", None)
    ev = CommEvent(next(_SEQ), op, group, int(nbytes), tag, "bwd" if _in_backward() else "fwd",
                   time.perf_counter(), queued=queued, info=info)
    for log in list(_LOGS):
        with log._lock:
            log.events.append(ev)
    _local.last = ev
    return ev


def last_event() -> Optional[CommEvent]:
    """The event of the last op this thread began (None if no log was active then)."""
    return getattr(_local, "last", None)


def op_end(ev: Optional[CommEvent]) -> None:
    """Time-stamp the finish of an event from op_begin (None is ignored)."""
    if ev is not None and ev.finish is None:
        ev.finish = time.perf_counter()


def end_when_complete(ev: Optional[CommEvent], work) -> None:
    """Finish `ev` now (work None: the call was synchronous) or when the async work completes
    (a future callback on the backend's thread), unless the issuing thread stamps the finish
    itself (`tagged(..., self_timed=True)`: Lina's launcher, which waits for every op anyway)."""
    if ev is None:
        return
    if work is None:
        op_end(ev)
        return
    if ev.info.get("self_timed"):
        return
    try:
        work.get_future().then(lambda _f: op_end(ev))
    except (RuntimeError, AttributeError):    # a backend without futures: the event stays unfinished
        ev.info["unfinished"] = True


def a2a_begin(group: str, nbytes: int) -> "CommEvent | _NoEvent":
    """Tell listeners an all-to-all starts, then time-stamp it. Returns the token for a2a_end
    (its CommEvent, or a bare token when only listeners are registered)."""
    for listener in list(_A2A_LISTENERS):
        listener.a2a_start(group)
    ev = op_begin("all_to_all", group, nbytes)
    return ev if ev is not None else _NoEvent(group)


def a2a_end(token) -> None:
    """Time-stamp the end of an all-to-all, then tell listeners it is over (once per token)."""
    if getattr(token, "_ended", False):
        return
    token._ended = True
    if isinstance(token, CommEvent):
        op_end(token)
    for listener in list(_A2A_LISTENERS):
        listener.a2a_end(token.group)


@dataclass
class _NoEvent:
    """The token of an all-to-all seen by listeners while no log is active."""

    group: str


class A2AWork:
    """An async all-to-all's work: `wait()` waits, then ends the all-to-all's interval.
    Other attributes are the wrapped work's."""

    def __init__(self, work, token):
        self._work, self._token = work, token

    def wait(self, *args, **kwargs):
        out = self._work.wait(*args, **kwargs)
        a2a_end(self._token)
        return out

    def __getattr__(self, name):
        return getattr(self._work, name)
