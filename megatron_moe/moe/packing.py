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

Lina's rule ignores what a pack costs: each rank then computes twice the experts and all-reduces
their gradients over the new (larger) expert-DP group, so a pack can make steps slower. A pack is
therefore a trial (--lina-packing-trial-iters K, default TRIAL_ITERS; 0: trust the rule): the
step times (`StepClock`: step_begins -> step_done) of the K iterations before it and the K after
it, each the MAX over the world (one all-reduce at each decision, so every rank decides on the
same numbers), are compared by `keep_packed`; unless the packed layout's median is lower the
experts are moved back to the previous EP (the same exact, collective relayout) and packing is
not tried again in the run. A due iteration with fewer than K iterations measured in the current
layout (a run resumed just before it) is skipped; due iterations during a trial are skipped.
--lina-packing-force-outcome faster|slower decides the trial whatever the medians (tests: the
real medians are still measured and logged). Both decisions and their times are logged.

Packing is a change of layout only, and every layout already equals the one-process run, so the
training curve does not change (tests/test_lina_packing.py), reverted or not. Legend: E experts, N = N_EP.
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

import statistics
from typing import TYPE_CHECKING, Optional

import torch

from megatron_moe.distributed.collectives import all_gather_raw, max_over_group
from megatron_moe.distributed.observer import CommLog
from megatron_moe.distributed.saa import SAA_CHUNKS
from megatron_moe.profiling import median_below, span_ms, stamp, trial_verdict
from megatron_moe.layers.sharding import ShardSpec, coords_of, shard_spec, shard_tensor, unshard_tensor
from megatron_moe.moe.placement import PARAMS

if TYPE_CHECKING:
    from megatron_moe.model.gpt2 import GPT2MoE
    from megatron_moe.parallel_state import ParallelState

PACK_START = 10  # first iteration (counted as iterations done) at which packing is considered
PACK_EVERY = 4  # then every this many iterations
TRIAL_ITERS = 3  # iterations timed before and after a pack (--lina-packing-trial-iters)
OUTCOMES = ("faster", "slower")  # --lina-packing-force-outcome
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


def keep_packed(before_ms: list[float], after_ms: list[float]) -> bool:
    """The trial's rule: keep a pack only when the median step time of the iterations after it is
    below the median of those before it (equal or slower: move back)."""
    return median_below(after_ms, before_ms, "keep_packed needs step times before and after the pack")


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


class StepClock:
    """Wall time of the last `keep` training iterations, `begin` (step_begins) -> `end` (step_done).
    CPU: perf_counter; ops run synchronously and the step's gloo collectives are waited for before
    the optimizer step, so the end is the step's completion. CUDA: events recorded on the current
    stream at both ends (after the optimizer step, which waits for the gradient collectives), read
    after a synchronize when a decision needs them: never host time around an enqueue."""

    def __init__(self, device: torch.device, keep: int):
        self.cuda, self.keep = device.type == "cuda", keep
        self._start = None
        self._spans: list = []

    def begin(self) -> None:
        self._start = stamp(self.cuda)

    def end(self) -> None:
        if self._start is None:
            raise RuntimeError("ExpertPacking.step_done without step_begins: the iteration was not timed")
        self._spans = (self._spans + [(self._start, stamp(self.cuda))])[-self.keep :]
        self._start = None

    def __len__(self) -> int:
        return len(self._spans)

    def durations_ms(self) -> list[float]:
        return span_ms(self._spans, self.cuda)

    def reset(self) -> None:
        """Forget the iterations timed so far (the layout changed)."""
        self._spans.clear()


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
    `start` / `every`: the due iterations (the trainer keeps PACK_START / PACK_EVERY; a benchmark
    packs during its warm-up). `trial_iters`: K of the trial (0: no trial); `force_outcome`:
    "faster" / "slower" decides every trial whatever the medians (tests)."""

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
        trial_iters: int = TRIAL_ITERS,
        force_outcome: Optional[str] = None,
    ):
        if trial_iters < 0:
            raise ValueError(f"--lina-packing-trial-iters must be >= 0, got {trial_iters}")
        if force_outcome is not None and (force_outcome not in OUTCOMES or not trial_iters):
            raise ValueError(
                f"--lina-packing-force-outcome must be one of {', '.join(OUTCOMES)} and needs "
                f"--lina-packing-trial-iters >= 1, got {force_outcome!r} with {trial_iters}"
            )
        self.model, self.optimizer, self.ps = model, optimizer, ps
        self.start, self.every = start, every
        self.num_experts, self.max_per_rank, self.force = num_experts, max_per_rank, force
        self.trial_iters, self.force_outcome = trial_iters, force_outcome
        self.decisions: list[dict] = []
        self.log: Optional[CommLog] = None
        self.clock: Optional[FFNClock] = None
        self.steps: Optional[StepClock] = None
        self.trial: Optional[dict] = None  # the pack on trial: iteration, ep_before, before_ms
        self.backed_off = False  # a trial moved the experts back: no more packing in this run
        if self.can_pack:
            self.log = CommLog(max_events=20_000).start()
            self.clock = FFNClock(model, ps.device)
            if trial_iters:
                self.steps = StepClock(ps.device, trial_iters)

    @property
    def experts_per_rank(self) -> int:
        return self.num_experts // self.ps.size("ep")

    @property
    def can_pack(self) -> bool:
        return next_ep(self.ps.size("ep"), self.num_experts, self.max_per_rank) is not None

    @property
    def busy(self) -> bool:
        """A pack is on trial (its K iterations after are still running)."""
        return self.trial is not None

    def max_over_world(self, values: list[float]) -> list[float]:
        """`values` reduced element-wise with MAX over the world (every rank passes as many)."""
        return max_over_group(values, self.ps.group("world"), self.ps.device, "packing all_reduce")

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
        """A training iteration starts: what is measured from here on is its own (not an evaluation's)."""
        if self.log is not None and self.clock is not None:
            self.log.clear()
            self.clock.clear()
        if self.steps is not None:
            self.steps.begin()

    def step_done(self, iteration: int) -> list[str]:
        """After iteration `iteration`: end a trial that has its K iterations, then at a due
        iteration apply Lina's rule (module docstring). The log lines of what was decided."""
        lines: list[str] = []
        if self.steps is not None:
            self.steps.end()
        if self.trial is not None and self.steps is not None and len(self.steps) >= self.trial_iters:
            lines.append(self.end_trial(iteration))
        if self.log is not None and self.trial is None and packing_due(iteration, self.start, self.every):
            lines.append(self.consider(iteration))
        if self.backed_off or not self.can_pack:
            self.stop_rule_timing()  # Lina's rule is asked no more
            if self.trial is None:
                self.close()
        if self.log is not None and self.clock is not None:
            self.log.clear()  # nothing kept until the next iteration (step_begins clears it too)
            self.clock.clear()
        return lines

    def consider(self, iteration: int) -> str:
        """Lina's rule at a due iteration; packs (and starts a trial when K > 0) if it says so."""
        old = self.ps.size("ep")
        head = f"lina packing at iteration {iteration}"
        if self.steps is not None and len(self.steps) < self.trial_iters:  # same count on every rank
            done = len(self.steps)
            return f"{head}: {done} of the {self.trial_iters} iterations a trial compares timed at EP {old}: not yet"
        before = self.steps.durations_ms() if self.steps is not None else []
        ffn, comm, *before = self.max_over_world([*self.micro_op_ms(), *before])
        pack = self.force or should_pack(ffn, comm)
        new = next_ep(old, self.num_experts, self.max_per_rank)
        why = "forced (--lina-packing-force)" if self.force else ("<" if pack else ">=")
        line = f"{head}: FFN micro-op {ffn:.3f} ms, all-to-all micro-op {comm:.3f} ms (max over ranks)"
        if pack and new is not None:
            self.relayout(new)
            line += (
                f", {why}: EP {old} -> {new}, expert-DP {self.ps.layout.world_size // (old * self.ps.size('esp'))} -> "
                f"{self.ps.size('expert_dp')}, {self.experts_per_rank} experts per rank"
            )
            if self.steps is not None:
                self.trial = {"iteration": iteration, "ep_before": old, "before_ms": before}
                self.steps.reset()
                line += (
                    f"; on trial: kept if the median step of the next {self.trial_iters} iterations is below "
                    f"{statistics.median(before):.1f} ms (the median of the {self.trial_iters} before, max over ranks)"
                )
        else:
            line += f": kept EP {old}"
        self.decisions.append(
            {
                "kind": "pack",
                "iteration": iteration,
                "ffn_ms": ffn,
                "a2a_ms": comm,
                "ep_before": old,
                "ep": self.ps.size("ep"),
                "line": line,
            }
        )
        return line

    def end_trial(self, iteration: int) -> str:
        """Compare the K step times after the pack on trial with the K before it (both MAX over the
        world); keep the packed layout only if faster, else move the experts back and stop packing."""
        assert self.trial is not None and self.steps is not None
        before = self.trial["before_ms"]
        after = self.max_over_world(self.steps.durations_ms())
        b, a = statistics.median(before), statistics.median(after)
        faster, why = trial_verdict(keep_packed(before, after), self.force_outcome, "--lina-packing-force-outcome")
        packed, back = self.ps.size("ep"), self.trial["ep_before"]
        line = (
            f"lina packing trial at iteration {iteration}: median step {a:.1f} ms over the {len(after)} "
            f"iterations at EP {packed} vs {b:.1f} ms over the {len(before)} before at EP {back} (max over ranks), "
            f"{why}: "
        )
        if faster:
            line += f"kept EP {packed}"
        else:
            self.relayout(back)
            self.backed_off = True
            line += f"back to EP {back}, expert-DP {self.ps.size('expert_dp')}; no more packing in this run"
        self.decisions.append(
            {
                "kind": "trial",
                "iteration": iteration,
                "step_ms_before": b,
                "step_ms_after": a,
                "ep_before": packed,
                "ep": self.ps.size("ep"),
                "line": line,
            }
        )
        self.trial = None
        self.steps.reset()
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

    def stop_rule_timing(self) -> None:
        """Stop timing micro-ops (Lina's rule will not be asked again)."""
        if self.log is not None:
            self.log.stop()
            self.log = None
        if self.clock is not None:
            self.clock.remove()
            self.clock = None

    def close(self) -> None:
        """Stop measuring (no packing step and no trial is left, or the run ends)."""
        self.stop_rule_timing()
        self.steps = None
