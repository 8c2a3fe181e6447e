"""Comm tracer: a record of every collective this process issues.

Every collective in `megatron_moe.distributed.collectives` calls `record(...)`.
While a `CommTracer` is active (``with CommTracer() as tr:``), each record is
appended to it: op name, group name, bytes of the local input buffer ("sent")
and of the local output buffer ("recv"), and, for all-to-alls, the bytes that
actually leave this rank (the chunks for other ranks, "remote_sent").

Byte convention (what tests compute from formulas):
  all_reduce      sent = recv = numel * itemsize
  all_gather      sent = local input, recv = group_size * local input
  reduce_scatter  sent = full input, recv = full input / group_size
  all_to_all      sent = input buffer, recv = output buffer
  send / recv     sent or recv = the tensor
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Optional

_ACTIVE: list["CommTracer"] = []


@dataclass
class CommRecord:
    """One collective issued by this rank."""

    op: str
    group: str
    sent: int
    recv: int
    remote_sent: int = 0
    tag: str = ""


@dataclass
class CommTracer:
    """Collects CommRecords while active; nestable (every active tracer records)."""

    records: list[CommRecord] = field(default_factory=list)

    def __enter__(self) -> "CommTracer":
        _ACTIVE.append(self)
        return self

    def __exit__(self, *exc) -> None:
        _ACTIVE.remove(self)

    def clear(self) -> None:
        self.records.clear()

    def totals(self, key: str = "sent") -> dict[tuple[str, str], int]:
        """Sum of `key` bytes per (op, group)."""
        out: dict[tuple[str, str], int] = defaultdict(int)
        for r in self.records:
            out[(r.op, r.group)] += getattr(r, key)
        return dict(out)

    def count(self, op: Optional[str] = None, group: Optional[str] = None) -> int:
        return sum(1 for r in self.records
                   if (op is None or r.op == op) and (group is None or r.group == group))

    def by_kind(self) -> dict[str, int]:
        """Bytes sent per 'op@group' string (for benchmark JSON)."""
        return {f"{op}@{g}": v for (op, g), v in sorted(self.totals("sent").items())}


_current_tag: list[str] = [""]


def set_tag(tag: str) -> str:
    """Set a free-form tag attached to the following records (e.g. 'fwd' / 'bwd'); returns the old one."""
    old = _current_tag[0]
    _current_tag[0] = tag
    return old


def record(op: str, group: str, sent: int, recv: int, remote_sent: int = 0) -> None:
    """Append a record to every active tracer (cheap no-op when none is active)."""
    if not _ACTIVE:
        return
    rec = CommRecord(op, group, int(sent), int(recv), int(remote_sent), _current_tag[0])
    for t in _ACTIVE:
        t.records.append(rec)


_GROUP_NAMES: dict[int, str] = {}


def name_group(group, name: str) -> None:
    """Register a readable name ('mp', 'ep', ...) for a process group."""
    _GROUP_NAMES[id(group)] = name


def group_name(group) -> str:
    """The registered name of `group` ('world' for None / the default group)."""
    if group is None:
        return "world"
    return _GROUP_NAMES.get(id(group), "other")
