"""A stuck or broken collective becomes one clear error naming the collective, the group and the flag.

Every process group is created with `--comm-timeout` (`parallel_state`), so a collective whose peer
stalled or died (or ranks that issued collectives in different orders) fails instead of hanging.
gloo reports that as a RuntimeError whose text is an internal file:line:

  "[.../unbound_buffer.cc:78] Timed out waiting 5000ms for recv operation to complete"
  "Application timeout caused pair closure"        (a later op on a timed-out pair)
  "[.../pair.cc:553] Connection closed by peer ..." (the peer process exited)

`guard(collective, group)` (around a blocking call) and `wait(work, collective, group)` translate
those into `CommTimeoutError` / `CommPeerLostError`; other exceptions pass unchanged. Entry points
wrap their body in `exit_on_comm_error()`: `error: ...` once per rank, exit status 1 at once (no
traceback, no teardown that could block on a dead peer).
"""

from __future__ import annotations

import os
import sys
from contextlib import contextmanager
from typing import Iterator, NoReturn, Optional

import torch.distributed as dist

from megatron_moe.distributed.observer import group_name

EXIT_COMM_FAILURE = 1
_TIMEOUT_MARKERS = ("timed out", "timeout")
_PEER_LOST_MARKERS = ("connection closed by peer", "connection reset by peer", "broken pipe")
_TIMEOUTS: dict[int, float] = {}  # id(group) -> seconds it was created with


class _UnknownGroup:
    """Stands for the group of a collective that failed outside `guard` (entry-point fallback)."""


UNKNOWN_GROUP = _UnknownGroup()


class CommError(RuntimeError):
    """A collective failed because a peer rank stalled or went away."""

    def __init__(self, message: str, collective: str = "", group: str = ""):
        super().__init__(message)
        self.collective, self.group = collective, group


class CommTimeoutError(CommError):
    """A collective did not finish within --comm-timeout seconds."""


class CommPeerLostError(CommError):
    """A peer closed its connection during a collective (it crashed or hit its own timeout)."""


def set_group_timeout(group, seconds: float) -> None:
    """Record the timeout `group` was created with (for the error message)."""
    _TIMEOUTS[id(group)] = float(seconds)


def describe_group(group) -> str:
    """ "group 'ep' (global ranks [0, 1])"; the ranks are left out when torch cannot tell them."""
    if group is UNKNOWN_GROUP:
        return "a process group"
    name = group_name(group)
    if not dist.is_initialized():
        return f"group '{name}'"
    try:
        ranks = dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)
    except (RuntimeError, ValueError, AttributeError):
        return f"group '{name}'"
    return f"group '{name}' (global ranks {sorted(ranks)})"


def translate(exc: BaseException, collective: str, group) -> Optional[CommError]:
    """The CommError that `exc` (raised by `collective` on `group`) stands for, or None when
    it is not a timeout or a lost peer. A CommError is returned unchanged."""
    if isinstance(exc, CommError):
        return exc
    if not isinstance(exc, RuntimeError):
        return None
    text = str(exc).strip()
    low = text.lower()
    where = f"{collective} on {describe_group(group)}"
    backend = text.splitlines()[0] if text else type(exc).__name__
    if any(m in low for m in _TIMEOUT_MARKERS):
        secs = _TIMEOUTS.get(id(group))
        limit = f"--comm-timeout {secs:g} s" if secs is not None else "--comm-timeout"
        return CommTimeoutError(
            f"{where} did not finish within {limit}: a peer rank is stalled or dead, or the ranks issued "
            f"collectives in different orders (raise --comm-timeout if a step legitimately takes longer; "
            f"backend said: {backend})",
            collective,
            group_name(group),
        )
    if any(m in low for m in _PEER_LOST_MARKERS):
        return CommPeerLostError(
            f"{where} failed: a peer rank closed its connection (it crashed, or stopped after its own "
            f"--comm-timeout error; see that rank's error; backend said: {backend})",
            collective,
            group_name(group),
        )
    return None


@contextmanager
def guard(collective: str, group) -> Iterator[None]:
    """Translate a timeout or lost peer raised inside the block (see `translate`)."""
    try:
        yield
    except RuntimeError as e:
        err = translate(e, collective, group)
        if err is None or err is e:
            raise
        raise err from e


def wait(work, collective: str, group) -> None:
    """`work.wait()` (None is a no-op) with the translation of `guard`."""
    if work is None:
        return
    with guard(collective, group):
        work.wait()


@contextmanager
def exit_on_comm_error() -> Iterator[None]:
    """For entry points: a CommError (or an untranslated backend timeout) raised inside the block
    prints `error: ...` once on stderr and ends the process with status 1 at once."""
    try:
        yield
    except RuntimeError as e:
        err = translate(e, "a collective", UNKNOWN_GROUP) if not isinstance(e, CommError) else e
        if err is None:
            raise
        fail(err)


def fail(err: BaseException) -> NoReturn:
    """Print `error: [rank R] ...` and exit with EXIT_COMM_FAILURE without tearing anything down:
    destroying a process group whose peer is stalled can block, and the peers are gone anyway."""
    rank = os.environ.get("RANK")
    prefix = f"[rank {rank}] " if rank is not None else ""
    sys.stdout.flush()
    print(f"error: {prefix}{err}", file=sys.stderr, flush=True)
    os._exit(EXIT_COMM_FAILURE)
