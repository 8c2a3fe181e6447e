"""Lina's expert packing (Lina sections 4.2, 4.3; --lina-packing): more experts per rank when
the expert FFN is too short to hide an all-to-all. Legend: E experts, N = N_EP.

The rule (RULE, untimed; `choose.override` or MMOE_CHOOSE force it): at iteration PACK_START and
every PACK_EVERY after it, `ExpertPacking.step_done` takes the mean time of one FFN micro-op (one
call of a layer's `Experts`, timed by forward hooks) and of one forward all-to-all micro-op (the
collective observer's events) of the iteration just finished, MAX over the world (every rank
decides on the same numbers), and packs when the FFN is shorter: EP = N -> N/2, expert-DP
doubled, while N is even and the experts per rank stay within --lina-max-experts-per-rank (0: no
bound).

A pack doubles each rank's experts and all-reduces their gradients over a larger group, so it can
make steps slower: with --measure-iters K > 0 it is measured (`choose.Trial` TRIAL over
("unpacked", "packed"), K iterations each, no warm-up rounds: every switch moves experts). Unless
"packed" is picked the experts go back and packing is not tried again in the run. The trainer runs
this trial last (`training.TRIALS`). Every layout equals the one-process run, so packing, reverted
or not, does not change the training curve.

A relayout (collective, every rank in the same order):
  1. each expert parameter and each of its optimizer-state tensors of the same shape is gathered
     over the *old* EP group and cut again for the rank's new EP coordinate
     (`layers.sharding.unshard_tensor` / `shard_tensor` restricted to the EP split);
  2. `ParallelState.relayout_experts` builds the new ep, ep_esp and expert_dp groups;
  3. each layer's `Experts.relayout` takes its new slices (the same parameter objects, so the
     optimizer, GradSync's hooks and Lina keep them) and `MoELayer.use_schedule` builds the
     dispatcher again on the new groups.
A checkpoint saved after packing has the packed layout in its metadata; `tools/convert_checkpoint.py
reshard` brings it back to the original one.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch

from megatron_moe import choose
from megatron_moe.distributed.collectives import all_gather_raw, max_over_group
from megatron_moe.distributed.observer import CommLog
from megatron_moe.distributed.saa import SAA_CHUNKS
from megatron_moe.profiling import span_ms, stamp
from megatron_moe.layers.sharding import ShardSpec, coords_of, shard_spec, shard_tensor, unshard_tensor
from megatron_moe.moe.placement import PARAMS

if TYPE_CHECKING:
    from megatron_moe.model.gpt2 import GPT2MoE
    from megatron_moe.parallel_state import ParallelState

PACK_START = 10  # first iteration (counted as iterations done) at which packing is considered
PACK_EVERY = 4  # then every this many iterations
RULE, TRIAL = "lina-packing-rule", "lina-packing"  # the decisions' names (`choose.override`, MMOE_CHOOSE)
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

    def _begin(self, module, args) -> None:
        self._open[id(module)] = stamp(self.cuda)

    def _end(self, module, args, out) -> None:
        start = self._open.pop(id(module), None)
        if start is not None:
            self._spans.append((start, stamp(self.cuda)))

    def durations_ms(self) -> list[float]:
        return span_ms(self._spans, self.cuda)

    def clear(self) -> None:
        self._spans.clear()

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()


def mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0


class ExpertPacking:
    """The packing stage of a run (module docstring). Every rank calls `step_begins()` before each
    training iteration and `step_done(iteration)` after its optimizer step; `step_done` returns the
    log lines of the decisions taken (none most of the time); `decisions` keeps them as dicts.
    `iters`: K of the trial (0: trust the rule). `start` / `every`: the due iterations (the trainer
    keeps PACK_START / PACK_EVERY; a benchmark packs during its warm-up)."""

    turn = True  # `training.take_turns`: False while an earlier in-training trial measures

    def __init__(
        self,
        model: "GPT2MoE",
        optimizer: torch.optim.Optimizer,
        ps: "ParallelState",
        num_experts: int,
        max_per_rank: int = 0,
        iters: int = 0,
        start: int = PACK_START,
        every: int = PACK_EVERY,
    ):
        self.model, self.optimizer, self.ps = model, optimizer, ps
        self.num_experts, self.max_per_rank, self.iters = num_experts, max_per_rank, iters
        self.start, self.every = start, every
        self.decisions: list[dict] = []
        self.log: Optional[CommLog] = None
        self.clock: Optional[FFNClock] = None
        self.trial: Optional[choose.Trial] = None  # a pack being measured
        self.layouts = (0, 0)  # the trial's EP unpacked and packed
        self.backed_off = False  # a trial kept the unpacked layout: no more packing in this run
        if self.can_pack:
            self.log = CommLog(max_events=20_000).start()
            self.clock = FFNClock(model, ps.device)

    @property
    def experts_per_rank(self) -> int:
        return self.num_experts // self.ps.size("ep")

    @property
    def can_pack(self) -> bool:
        return next_ep(self.ps.size("ep"), self.num_experts, self.max_per_rank) is not None

    @property
    def busy(self) -> bool:
        """A pack is being measured."""
        return self.trial is not None

    @property
    def decided(self) -> bool:
        """Nothing left to try: no pack measured and none possible."""
        return self.trial is None and (self.backed_off or not self.can_pack)

    def micro_op_ms(self) -> tuple[float, float]:
        """(FFN micro-op ms, forward all-to-all micro-op ms): this rank's means of the last iteration."""
        assert self.log is not None and self.clock is not None
        a2a = [
            1e3 * e.duration
            for e in self.log.snapshot()
            if e.op == "all_to_all" and e.phase == "fwd" and e.group in A2A_GROUPS and e.finish is not None
        ]
        return mean(self.clock.durations_ms()), mean(a2a)

    def step_begins(self) -> None:
        """A training iteration starts: what is measured from here on is its own (not an evaluation's);
        a trial's pass gets its layout."""
        if self.log is not None and self.clock is not None:
            self.log.clear()
            self.clock.clear()
        if self.trial is not None:
            ep = self.layouts[self.trial.next() == "packed"]
            if ep != self.ps.size("ep"):
                self.relayout(ep)
            self.trial.start()

    def step_done(self, iteration: int) -> list[str]:
        """After iteration `iteration`: end a trial's pass (deciding after the last), else at a due
        iteration with the turn apply Lina's rule (module docstring). The log lines of what was decided."""
        lines: list[str] = []
        if self.trial is not None:
            decision = self.trial.stop()  # collective on the pass that decides
            if decision is not None:
                lines.append(self.end_trial(decision, iteration))
        elif self.turn and self.log is not None and packing_due(iteration, self.start, self.every):
            lines.append(self.consider(iteration))
        if self.backed_off or not self.can_pack:
            self.close()  # Lina's rule is asked no more
        if self.log is not None and self.clock is not None:
            self.log.clear()  # nothing kept until the next iteration (step_begins clears it too)
            self.clock.clear()
        return lines

    def consider(self, iteration: int) -> str:
        """Lina's rule at a due iteration; packs (or starts a trial of the pack when K > 0) if it says so."""
        old = self.ps.size("ep")
        ffn, comm = max_over_group(
            list(self.micro_op_ms()), self.ps.group("world"), self.ps.device, f"{RULE} all_reduce"
        )
        pack = should_pack(ffn, comm)
        why = f"FFN micro-op {ffn:.3f} ms {'<' if pack else '>='} all-to-all micro-op {comm:.3f} ms, max over ranks"
        if choose.forced(RULE) is not None:
            why += f"; forced ({choose.ENV} or choose.override)"
        rule = choose.untimed(RULE, ("keep", "pack"), "pack" if pack else "keep", why)
        new = next_ep(old, self.num_experts, self.max_per_rank)
        line = f"iteration {iteration}: {rule.line()}"
        if rule.pick == "pack" and new is not None and self.iters:
            self.layouts = (old, new)
            self.trial = choose.Trial(
                TRIAL, ("unpacked", "packed"), self.ps.group("world"), self.ps.device, self.iters, 0, turn=self.iters
            )
            line += f": measured first, {self.iters} iterations at EP {old}, then {self.iters} at EP {new}"
        elif rule.pick == "pack" and new is not None:
            self.relayout(new)
            line += (
                f": EP {old} -> {new}, {self.experts_per_rank} experts per rank, expert-DP {self.ps.size('expert_dp')}"
            )
        else:
            line += f": kept EP {old}"
        self.decisions.append(
            {"kind": "rule", "iteration": iteration, "pick": rule.pick, "ffn_ms": ffn, "a2a_ms": comm, "line": line}
        )
        return line

    def end_trial(self, decision: choose.Decision, iteration: int) -> str:
        """The trial's pick applied: the packed layout kept, or the experts moved back and packing stopped."""
        unpacked, packed = self.layouts
        ep = packed if decision.pick == "packed" else unpacked
        if ep != self.ps.size("ep"):
            self.relayout(ep)
        self.trial, self.backed_off = None, decision.pick == "unpacked"
        line = f"iteration {iteration}: {decision.line()}: " + (
            f"kept EP {ep}"
            if ep == packed
            else f"back to EP {ep}, expert-DP {self.ps.size('expert_dp')}; no more packing in this run"
        )
        self.decisions.append({"kind": "trial", "iteration": iteration, "pick": decision.pick, "ep": ep, "line": line})
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
        """Stop timing micro-ops (Lina's rule will not be asked again, or the run ends)."""
        if self.log is not None:
            self.log.stop()
            self.log = None
        if self.clock is not None:
            self.clock.remove()
            self.clock = None
