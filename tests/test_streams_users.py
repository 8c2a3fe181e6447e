"""The order of the CUDA stream calls of Lina's micro-ops and Lancet's partitioned pipeline, checked on
the CPU: both take the stream API as an argument (`stream_api`, the `streams` module by default), and
a recorder with the same functions logs every call, with the thread that made it and a time, next to
the collective observer's launch / finish times. On the CPU the real calls are no-ops, so what is
checked here is where the code puts them: which stream a collective is issued on, what a side stream
waits for before it starts and what the consumer waits for before it reads."""

from __future__ import annotations

import ast
import itertools
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from megatron_moe.distributed import streams
from megatron_moe.distributed.grad_sync import lina_group, make_lina_groups
from megatron_moe.distributed.lina import LinaScheduler
from megatron_moe.distributed.observer import CommLog
from megatron_moe.lancet.controller import setup
from megatron_moe.lancet.partitioned_moe import PartitionedRange, RangeSpec
from megatron_moe.lancet.planner import LancetPlan
from megatron_moe.model.gpt2 import GPT2MoE
from megatron_moe.parallel_state import destroy_model_parallel, initialize_model_parallel
from megatron_moe.testing import spawn
from test_lancet_runtime import config

ROOT = Path(__file__).resolve().parents[1]


@dataclass(eq=False)
class FakeStream:
    """A named stand-in for a CUDA stream."""

    name: str


@dataclass(eq=False)
class NumberedMarker(streams.Marker):
    """A marker (complete at once, as on the CPU) with a number the log can name."""

    n: int = -1


class StreamRecorder:
    """The functions of `streams` that the library calls, recording each call as
    (time, thread name, call, stream name, detail) in `log`; `current_stream` is "compute" unless a
    `use` block of this thread set another."""

    def __init__(self) -> None:
        self.log: list[tuple[float, str, str, str, Any]] = []
        self._lock = threading.Lock()
        self._sides: dict[str, FakeStream] = {}
        self._compute = FakeStream("compute")
        self._local = threading.local()
        self._numbers = itertools.count()

    def _add(self, call: str, stream: Any, detail: Any = None) -> None:
        name = stream.name if stream is not None else "none"
        with self._lock:
            self.log.append((time.perf_counter(), threading.current_thread().name, call, name, detail))

    def side_stream(self, device: torch.device, name: str) -> FakeStream:
        with self._lock:
            return self._sides.setdefault(name, FakeStream(name))

    def current_stream(self, device: torch.device) -> FakeStream:
        stack = getattr(self._local, "stack", [])
        return stack[-1] if stack else self._compute

    @contextmanager
    def use(self, stream: FakeStream):
        stack = self._local.__dict__.setdefault("stack", [])
        self._add("enter", stream)
        stack.append(stream)
        try:
            yield
        finally:
            stack.pop()
            self._add("exit", stream)

    def wait_stream(self, waiter: FakeStream, producer: FakeStream) -> None:
        self._add("wait_stream", waiter, producer.name)

    def record_event(self, stream: FakeStream, timing: bool = False) -> NumberedMarker:
        m = NumberedMarker(n=next(self._numbers))
        self._add("record", stream, m.n)
        return m

    def wait_event(self, stream: FakeStream, marker: NumberedMarker) -> None:
        self._add("wait_event", stream, marker.n)

    def record_stream(self, tensors: Any, stream: FakeStream) -> None:
        self._add("record_stream", stream, tuple(tensors.shape) if isinstance(tensors, torch.Tensor) else None)

    def of(self, thread_prefix: str) -> list:
        """The calls made by the threads whose name starts with `thread_prefix`, in order."""
        return [e for e in self.log if e[1].startswith(thread_prefix)]


def _use_blocks(entries: list, stream: str) -> list[tuple[float, float]]:
    """(enter, exit) times of the `use` blocks of `stream` among one thread's `entries`, in order."""
    enters = [t for t, _, c, s, _ in entries if c == "enter" and s == stream]
    exits = [t for t, _, c, s, _ in entries if c == "exit" and s == stream]
    assert len(enters) == len(exits)
    return list(zip(enters, exits))


# ---------------------------------------------------------------- Lina
def _lina_on_side_streams(rank: int, world: int) -> dict:
    """dp and expert-dp gradients through Lina with a recorder (1024-element micro-ops, coalesced):
    2500 dp, 700 expert-dp, then 300 + 200 dp (one coalesced micro-op of two tensors)."""
    ps = initialize_model_parallel(1, 1, 1)  # world 2: dp 2, expert-dp 2
    try:
        make_lina_groups(ps)
        groups = {kind: lina_group(ps, kind) for kind in ("dp", "expert_dp")}
        rec = StreamRecorder()
        sched = LinaScheduler(1024 * 4 / 2**20, 60.0, coalesce=True, stream_api=rec)
        cpu = ps.device
        grads = [
            ("dp", torch.full((2500,), rank + 1.0, device=cpu)),
            ("expert_dp", torch.full((700,), 10.0 * (rank + 1), device=cpu)),
            ("dp", torch.full((300,), 100.0 * (rank + 1), device=cpu)),
            ("dp", torch.full((200,), 1000.0 * (rank + 1), device=cpu)),
        ]
        with CommLog() as log:
            for kind, t in grads:
                sched.submit(kind, t, groups[kind])
            sched.drain()
        evs = sorted((e for e in log.snapshot() if e.tag == "lina"), key=lambda e: e.seq)
        sched.close()
        return {
            "values": [t.tolist() for _, t in grads],
            "ops": [(e.group, e.nbytes, e.info["index"], e.launch, e.finish) for e in evs],
            "main": [e for e in rec.log if e[1] == "MainThread"],
            # launches: by the submitting thread when the head may go at once, else by the launcher thread
            "launcher": [
                e
                for e in rec.log
                if e[1].startswith("lina-launcher") or (e[1] == "MainThread" and e[3].startswith("lina-"))
            ],
            "reaper": rec.of("lina-reaper"),
        }
    finally:
        destroy_model_parallel()


def test_lina_micro_ops_run_on_one_side_stream_per_communicator_after_their_gradients():
    for r in spawn(_lina_on_side_streams, 2, timeout=120):
        # the reduction itself: every element summed over the 2 ranks
        assert r["values"] == [[3.0] * 2500, [30.0] * 700, [300.0] * 300, [3000.0] * 200]
        kinds = ["dp", "dp", "dp", "expert_dp", "dp"]  # 1024, 1024, 452 | 700 | 300 + 200 coalesced
        assert [(g, n, i) for g, n, i, *_ in r["ops"]] == [
            ("lina_dp", 4096, 0),
            ("lina_dp", 4096, 1),
            ("lina_dp", 1808, 2),
            ("lina_expert_dp", 2800, 3),
            ("lina_dp", 2000, 4),
        ]
        sides = [f"lina-{k}" for k in kinds]
        # the submitter recorded one ready marker per micro-op on its (compute) stream, in queue order
        ready = [d for _, _, c, s, d in r["main"] if c == "record" and s == "compute"]
        assert len(ready) == 5
        # launcher: wait for that op's ready marker on its communicator's side stream, then issue the
        # all-reduce inside a `use` block of that side stream, then record_stream the chunk there
        launcher = [(c, s, d) for _, _, c, s, d in r["launcher"]]
        want = []
        for i, side in enumerate(sides):
            want += [("wait_event", side, ready[i]), ("enter", side, None), ("exit", side, None)]
            want.append(("record_stream", side, (r["ops"][i][1] // 4,)))
        assert launcher == want
        for i, side in enumerate(sides):
            blocks = _use_blocks([e for e in r["launcher"]], side)
            nth = sides[: i + 1].count(side) - 1
            lo, hi = blocks[nth]
            assert lo <= r["ops"][i][3] <= hi, f"micro-op {i} was not launched on its side stream"
        # reaper: the wait for the all-reduce and the done marker, on the side stream
        reaper = [(c, s) for _, _, c, s, _ in r["reaper"]]
        assert reaper == [x for side in sides for x in (("enter", side), ("record", side), ("exit", side))]
        done = [d for _, _, c, _, d in r["reaper"] if c == "record"]
        record_t = [t for t, _, c, _, _ in r["reaper"] if c == "record"]
        assert all(op[4] is not None and op[4] <= t for op, t in zip(r["ops"], record_t)), "done before finish"
        # the consumer (drain) waits on its stream for the last done marker of each side stream
        waits = [(c, s, d) for _, _, c, s, d in r["main"] if c == "wait_event" and s == "compute"]
        assert waits == [("wait_event", "compute", done[4]), ("wait_event", "compute", done[3])]
        last_wait = max(t for t, _, c, s, _ in r["main"] if c == "wait_event" and s == "compute")
        assert last_wait >= max(record_t)


# ---------------------------------------------------------------- Lancet's partitioned pipeline
def _partitioned_on_side_stream(rank: int, world: int) -> dict:
    """Block 1 of the Lancet test model as a 2-part range (EP2), once with the real stream calls and
    once with the recorder; outputs, input gradients, the recorder's log and the token all-to-alls."""
    ps = initialize_model_parallel(1, 2, 1)
    try:
        cfg = config(1, "position")
        model = GPT2MoE(cfg, ps)
        spec = RangeSpec(1, "ln2", "block", 2)
        ctl = setup(model, ps, cfg.opts, plan=LancetPlan.manual([spec]))
        block = model.blocks[1]
        g = torch.Generator(device="cpu").manual_seed(5 + rank)
        x = torch.randn((3, 8, cfg.model.hidden_size), generator=g, device="cpu").to(model.wte.weight.device)
        out = {}
        for name, api in (("real", streams), ("recorded", StreamRecorder())):
            runner = PartitionedRange(block, spec, False, ctl.part_dispatcher(block.moe), stream_api=api)
            xi = x.clone().requires_grad_(True)
            seen: list[float] = []
            experts, ragged = block.moe.experts, block.moe.experts.forward_ragged  # the parts' expert input

            def timed(*args, ragged=ragged, seen=seen):
                y = ragged(*args)
                seen.append(time.perf_counter())
                return y

            experts.forward_ragged = timed
            with CommLog() as log:
                y, aux = runner(xi)
            del experts.forward_ragged
            (y.sum() + aux).backward()
            a2a = sorted((e for e in log.snapshot() if e.op == "all_to_all" and e.group == "ep"), key=lambda e: e.seq)
            out[name] = {
                "y": y.detach(),
                "grad": xi.grad,
                "experts": seen,
                "a2a": [e.launch for e in a2a],
                "log": api.log if isinstance(api, StreamRecorder) else None,
            }
        return out
    finally:
        destroy_model_parallel()


def test_partitioned_parts_run_experts_and_return_launches_on_the_side_stream():
    for r in spawn(_partitioned_on_side_stream, 2, timeout=180):
        real, rec = r["real"], r["recorded"]
        assert torch.equal(real["y"], rec["y"]) and torch.equal(real["grad"], rec["grad"])
        log = rec["log"]
        calls = [(c, s) for _, _, c, s, _ in log]
        assert calls == [
            ("wait_stream", "lancet-parts"),  # the side stream starts after the caller's plans
            ("enter", "lancet-parts"),
            ("record_stream", "lancet-parts"),  # part 0's received tokens are read there
            ("record_stream", "lancet-parts"),  # part 1's
            ("exit", "lancet-parts"),
            ("record", "lancet-parts"),
            ("record_stream", "compute"),  # part 0's returned rows are read on the caller's stream
            ("record_stream", "compute"),
            ("wait_event", "compute"),  # once, after the post-ops
        ]
        assert log[0][4] == "compute"
        end = log[5][4]
        assert log[-1][4] == end
        (lo, hi) = _use_blocks(log, "lancet-parts")[0]
        # 2 dispatches launched before the side block (from the caller's stream, right after each
        # part's routing), both parts' experts and both returns inside it
        assert len(rec["a2a"]) == 4 and all(t < lo for t in rec["a2a"][:2])
        assert all(lo <= t <= hi for t in rec["a2a"][2:]), "a return was launched off the side stream"
        assert len(rec["experts"]) == 2 and all(lo <= t <= hi for t in rec["experts"])


def test_capacity_passing_keeps_its_offsets_on_the_routers_device():
    """`_CapacityPassing` adds each part's counts to offsets on the router's device: a `.cpu()` copy
    there would add a CPU tensor to a CUDA one (a crash on a GPU that the CPU cannot show)."""
    tree = ast.parse((ROOT / "megatron_moe" / "lancet" / "partitioned_moe.py").read_text())
    host = [
        n.lineno
        for n in ast.walk(tree)
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr in ("cpu", "numpy")
    ]
    assert host == []
