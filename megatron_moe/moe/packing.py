"""Lina's expert packing (Lina sections 4.2, 4.3; --lina-packing): more experts per rank when
the expert FFN is too short to hide an all-to-all.

An all-to-all micro-op can only be pipelined behind the FFN of the previous chunk when that FFN
takes at least as long. From iteration PACK_START on, and every PACK_EVERY iterations after it,
the trainer asks `ExpertPacking.step_done`: it takes the mean time of one FFN micro-op (one call
of a layer's `Experts`, timed by the module's forward hooks) and of one forward all-to-all
micro-op (the collective observer's events on the token all-to-all groups) of the iteration just
finished, reduces both with an all-reduce MAX over the world (so every rank decides on the same
numbers, never on its own timing), and when the FFN is shorter it packs: EP = N -> N/2 with
expert-DP doubled, as long as N is even and the experts per rank stay within
--lina-max-experts-per-rank (0: no bound). --lina-packing-force packs at the due iterations
whatever the times (tests, fixed benchmarks). The decision and the times are logged.

Packing is a change of layout only, and every layout already equals the one-process run, so the
training curve does not change (tests/test_lina_packing.py). Legend: E experts, N = N_EP.
A relayout (collective, every rank in the same order):
  1. each expert parameter and each of its optimizer-state tensors of the same shape is gathered
     over the *old* EP group (every rank of it holds the same ESP slice of other experts) and
     cut again for the rank's new EP coordinate with the checkpoint resharding functions
     (`layers.sharding.unshard_tensor` / `shard_tensor` restricted to the EP split);
  2. `ParallelState.relayout_experts` builds the new ep, ep_esp and expert_dp groups;
  3. each layer's `Experts.relayout` takes its new slices (the same parameter objects, so the
     optimizer, GradSync's hooks and Lina keep them) and `MoELayer.use_schedule` builds the
     dispatcher again on the new groups. Expert gradients are then all-reduced over the new
     expert-DP group (GradSync asks the state for the group at each step).
A checkpoint saved after packing has the packed layout in its metadata; `tools/convert_checkpoint.py
reshard` brings it back to the original one.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Optional

import torch
import torch.distributed as dist

from megatron_moe.distributed.collectives import all_gather_raw
from megatron_moe.distributed.comm_errors import guard
from megatron_moe.distributed.observer import CommLog
from megatron_moe.distributed.saa import SAA_CHUNKS
from megatron_moe.layers.sharding import ShardSpec, coords_of, shard_spec, shard_tensor, unshard_tensor
from megatron_moe.moe.placement import PARAMS

if TYPE_CHECKING:
    from megatron_moe.model.gpt2 import GPT2MoE
    from megatron_moe.parallel_state import ParallelState

PACK_START = 10  # first iteration (counted as iterations done) at which packing is considered
PACK_EVERY = 4  # then every this many iterations
A2A_GROUPS = ("ep", "ep_esp")  # the groups of the token all-to-alls


def packing_due(iteration: int, start: int = PACK_START, every: int = PACK_EVERY) -> bool:
    """True at iterations start, start + every, start + 2 * every, ..."""
    return iteration >= start and (iteration - start) % every == 0


def next_ep(ep: int, num_experts: int, max_per_rank: int) -> Optional[int]:
    """The EP size after one packing step (N -> N/2), or None when EP is odd or 1, or the experts
    per rank would exceed `max_per_rank` (0: no bound)."""
    if ep < 2 or ep % 2:
        return None
    if max_per_rank and num_experts // (ep // 2) > max_per_rank:
        return None
    return ep // 2


def should_pack(ffn_ms: float, a2a_ms: float) -> bool:
    """Lina's rule: pack when an FFN micro-op is shorter than an all-to-all micro-op."""
    return ffn_ms < a2a_ms


def ep_only(spec: ShardSpec) -> ShardSpec:
    """The part of a parameter's split that runs over EP (the ESP split stays where it is)."""
    return ShardSpec(tuple(d for d in spec.dims if d[1] == "ep"), expert=spec.expert)


def regroup(t: torch.Tensor, spec: ShardSpec, old_ep_group, new_ep_coord: tuple[int, int]) -> torch.Tensor:
    """This rank's slice of tensor `t` (split like `spec`) under a new EP coordinate (rank, size):
    the slices of the old EP group are gathered (group rank j holds EP slice j) and cut again."""
    ep_spec = ep_only(spec)
    gathered = all_gather_raw(t.detach().unsqueeze(0), old_ep_group, dim=0)  # [N_old, ...]
    full = unshard_tensor({(("ep", j),): gathered[j] for j in range(gathered.size(0))}, ep_spec)
    return shard_tensor(full, ep_spec, {"ep": new_ep_coord})


class FFNClock:
    """Durations (ms) of the calls of every MoE layer's `Experts` (one FFN micro-op each: one chunk
    under --lina-pipeline-chunks), from the modules' forward pre/post hooks; CUDA events on a GPU."""

    def __init__(self, model: "GPT2MoE", device: torch.device):
        self.cuda = device.type == "cuda"
        self._open: dict[int, object] = {}
        self._spans: list = []  # (start, end): perf_counter seconds, or CUDA events
        self._hooks = []
        for layer in model.moe_layers():
            self._hooks.append(layer.experts.register_forward_pre_hook(self._begin))
            self._hooks.append(layer.experts.register_forward_hook(self._end))

    def _stamp(self):
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    def _begin(self, module, args) -> None:
        self._open[id(module)] = self._stamp()

    def _end(self, module, args, out) -> None:
        start = self._open.pop(id(module), None)
        if start is not None:
            self._spans.append((start, self._stamp()))

    def durations_ms(self) -> list[float]:
        if self.cuda:
            torch.cuda.synchronize()
            return [a.elapsed_time(b) for a, b in self._spans]
        return [1e3 * (b - a) for a, b in self._spans]

    def clear(self) -> None:
        self._spans.clear()

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()


def mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0


class ExpertPacking:
    """The packing stage of a run (module docstring). `step_done(iteration)` after every optimizer
    step (every rank); returns the log line of a decision, else None. `start` / `every`: the due
    iterations (the trainer keeps PACK_START / PACK_EVERY; a benchmark packs during its warm-up)."""

    def __init__(
        self,
        model: "GPT2MoE",
        optimizer: torch.optim.Optimizer,
        ps: "ParallelState",
        num_experts: int,
        max_per_rank: int = 0,
        force: bool = False,
        start: int = PACK_START,
        every: int = PACK_EVERY,
    ):
        self.model, self.optimizer, self.ps = model, optimizer, ps
        self.start, self.every = start, every
        self.num_experts, self.max_per_rank, self.force = num_experts, max_per_rank, force
        self.decisions: list[dict] = []
        self.log: Optional[CommLog] = None
        self.clock: Optional[FFNClock] = None
        if self.can_pack:
            self.log = CommLog(max_events=20_000).start()
            self.clock = FFNClock(model, ps.device)

    @property
    def experts_per_rank(self) -> int:
        return self.num_experts // self.ps.size("ep")

    @property
    def can_pack(self) -> bool:
        return next_ep(self.ps.size("ep"), self.num_experts, self.max_per_rank) is not None

    def measure(self) -> tuple[float, float]:
        """(FFN micro-op ms, all-to-all micro-op ms) of the last iteration, MAX over the world."""
        assert self.log is not None and self.clock is not None
        a2a = [
            1e3 * e.duration
            for e in self.log.snapshot()
            if e.op == "all_to_all" and e.phase == "fwd" and e.group in A2A_GROUPS and e.finish is not None
        ]
        t = torch.tensor([mean(self.clock.durations_ms()), mean(a2a)], dtype=torch.float64, device=self.ps.device)
        if self.ps.layout.world_size > 1:
            with guard("packing all_reduce", self.ps.group("world")):
                dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.ps.group("world"))
        ffn, comm = t.tolist()
        return ffn, comm

    def step_begins(self) -> None:
        """A training iteration starts: what is measured from here on is its own (not an evaluation's)."""
        if self.log is not None and self.clock is not None:
            self.log.clear()
            self.clock.clear()

    def step_done(self, iteration: int) -> Optional[str]:
        """After iteration `iteration`: decide at the due iterations (module docstring), pack if so."""
        if self.log is None or self.clock is None:
            return None
        line = None
        if packing_due(iteration, self.start, self.every):
            ffn, comm = self.measure()
            pack = self.force or should_pack(ffn, comm)
            old = self.ps.size("ep")
            new = next_ep(old, self.num_experts, self.max_per_rank)
            why = "forced (--lina-packing-force)" if self.force else ("<" if pack else ">=")
            times = f"FFN micro-op {ffn:.3f} ms, all-to-all micro-op {comm:.3f} ms (max over ranks)"
            if pack and new is not None:
                self.relayout(new)
                line = (
                    f"lina packing at iteration {iteration}: {times}, {why}: EP {old} -> {new}, "
                    f"expert-DP {self.ps.layout.world_size // (old * self.ps.size('esp'))} -> "
                    f"{self.ps.size('expert_dp')}, {self.experts_per_rank} experts per rank"
                )
            else:
                line = f"lina packing at iteration {iteration}: {times}: kept EP {old}"
            self.decisions.append(
                {"iteration": iteration, "ffn_ms": ffn, "a2a_ms": comm, "ep_before": old, "ep": self.ps.size("ep")}
            )
            if not self.can_pack:
                self.close()
        self.step_begins()  # nothing kept until the next iteration (callers may also call it then)
        return line

    def relayout(self, new_ep: int) -> None:
        """Move every MoE layer's experts and their optimizer state to EP = `new_ep` (collective)."""
        ps = self.ps
        lay = ps.layout
        if lay.world_size % (new_ep * lay.esp) or self.num_experts % new_ep:
            raise ValueError(f"expert packing: EP {new_ep} does not fit {self.num_experts} experts on {lay.world_size}")
        old_group = ps.group("ep")
        coord = coords_of(ps.global_rank, lay.mp, new_ep, lay.esp)["ep"]
        moved: list = []  # (layer, {name: new slice}, {param: {state key: new slice}})
        for layer in self.model.moe_layers():
            params, states = {}, {}
            for name in PARAMS:
                p = getattr(layer.experts, name)
                spec = shard_spec(p)
                params[name] = regroup(p, spec, old_group, coord)
                st = self.optimizer.state.get(p, {})
                states[p] = {
                    k: regroup(v, spec, old_group, coord)
                    for k, v in sorted(st.items())
                    if torch.is_tensor(v) and v.shape == p.shape
                }
            moved.append((layer, params, states))
        ps.relayout_experts(new_ep)
        for layer, params, states in moved:
            layer.experts.relayout(params, self.num_experts // new_ep)
            for p, new_state in states.items():
                self.optimizer.state[p].update(new_state)
            chunks = getattr(layer.dispatcher, "saa_chunks", SAA_CHUNKS)
            layer.use_schedule(layer.schedule, chunks, layer.schedule_choice)  # the dispatcher on the new groups

    def close(self) -> None:
        """Stop measuring (no packing step is left, or the run ends)."""
        if self.log is not None:
            self.log.stop()
            self.log = None
        if self.clock is not None:
            self.clock.remove()
            self.clock = None
