"""Pro-Prophet's lightweight expert placement at run time: replicas, Trans and Agg.

Legend: E experts, N_EP EP ranks, E_l = E / N_EP experts owned per EP rank (expert e is owned by
EP rank e // E_l), H_l = H / N_ESP, M model dim, M_l = M / N_ESP, R replicas held by this rank's EP
rank, X experts computed by one EP rank at most (owned + replicas).

A `Placement` maps every expert to the EP ranks (never the owner) holding a replica of it for one
iteration. In the dropless UnevenDispatcher a rank whose EP rank holds a replica of e sends its tokens
for e to its own EP rank (N_ESP > 1: its ESP peers), every other rank to the owner; an EP rank
computes its owned experts and its replicas in expert order.
Trans (forward): the owner's fc_w, fc_b, proj_w, proj_b slices of e go point to point on the EP group
to each replica rank (ESP shard j to ESP shard j) in two parts, (fc_w, fc_b) and (proj_w, proj_b).
Agg (backward): each replica's gradients go back to the owner and are summed into its parameter
gradients through autograd. Replicas are plain tensors (no optimizer state, not checkpointed).
The collective observer records ops "trans" and "agg" on group "ep".

Scheduling (Algorithm 2, block-wise), `ProProphet`:
  scheduled  the next MoE layer's Trans is launched in two parts around this layer's expert compute
             (fc before, proj after); the first MoE layer's at the runtime's anchor (else at its own
             start). A layer waits for its Trans just before its experts run. Agg is launched when the
             experts' backward is done and waited when the gradient of the previous MoE layer's output
             is due (`_AggWaitLater`), the first's at the anchor's output (else its own input).
             Trans / Agg run on CUDA side streams.
  blocking   (`pro_prophet_no_schedule`) Trans launched and waited at the point of use, Agg inside
             the experts' backward.
Either way both finish within the iteration, before the optimizer step.

Trial (`ProProphet(measure_iters=K)`, `choose.Trial` "pro-prophet"): a plan predicted near break-even
can lose (a 4 MB expert moved at skew 0 on the emulated cluster: 10 % slower), so after calibration the
arms "plain", "placed" and, with a `wider` planner, "wider" take turns, each one settling and one timed
iteration (the first iteration after a placement switch measured 10-40 % slow). Untimed rules: if no
placed iteration moved an expert the pick is "plain"; "wider" is a candidate only if it moved more
experts than the planner would have on the same counts. The pick holds for the rest of the run.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Callable, Iterable, Mapping, Optional, Sequence

import torch
import torch.distributed as dist

from megatron_moe import choose
from megatron_moe.distributed import comm_errors, observer, streams
from megatron_moe.distributed.collectives import all_gather_raw, scale_grad
from megatron_moe.moe.experts import Experts
from megatron_moe.profiling import annotate
from megatron_moe.pro_prophet.calibration import Calibrator
from megatron_moe.pro_prophet.clock import LayerClock

if TYPE_CHECKING:
    from megatron_moe.parallel_state import ParallelState

PARAMS = ("fc_w", "fc_b", "proj_w", "proj_b")
PARTS = (("fc_w", "fc_b"), ("proj_w", "proj_b"))  # Trans in two parts (Algorithm 2)
TRIAL = "pro-prophet"  # the trial's name (`choose.override`, MMOE_CHOOSE)


# ----------------------------------------------------------------------------- the placement
@dataclass(frozen=True)
class Placement:
    """replicas[e]: sorted EP ranks (never e's owner) holding a replica of expert e this iteration."""

    num_experts: int
    n_ep: int
    replicas: tuple[tuple[int, ...], ...]

    def __post_init__(self) -> None:
        E, n = self.num_experts, self.n_ep
        if n < 1 or E % n:
            raise ValueError(f"a placement needs experts ({E}) divisible by the EP size ({n})")
        if len(self.replicas) != E:
            raise ValueError(f"a placement lists {len(self.replicas)} experts, the layer has {E}")
        for e, ranks in enumerate(self.replicas):
            if list(ranks) != sorted(set(ranks)) or any(not 0 <= q < n for q in ranks):
                raise ValueError(f"expert {e}: replica ranks {ranks} must be distinct sorted EP ranks in [0, {n})")
            if self.owner(e) in ranks:
                raise ValueError(f"expert {e}: EP rank {self.owner(e)} owns it and cannot hold a replica")

    @classmethod
    def of(cls, num_experts: int, n_ep: int, mapping: Mapping[int, Iterable[int]]) -> "Placement":
        """From {expert: EP ranks} (experts not named: no replica)."""
        reps: list[tuple[int, ...]] = [()] * num_experts
        for e, ranks in mapping.items():
            if not 0 <= int(e) < num_experts:
                raise ValueError(f"expert {e} out of range [0, {num_experts})")
            reps[int(e)] = tuple(sorted({int(q) for q in ranks}))
        return cls(num_experts, n_ep, tuple(reps))

    @property
    def num_local(self) -> int:
        return self.num_experts // self.n_ep

    def owner(self, e: int) -> int:
        return e // self.num_local

    @property
    def moved(self) -> list[int]:
        """Experts with at least one replica, in expert order."""
        return [e for e, r in enumerate(self.replicas) if r]

    def held(self, ep: int) -> list[int]:
        """Experts EP rank `ep` holds a replica of, in expert order."""
        return [e for e, r in enumerate(self.replicas) if ep in r]

    def compute_experts(self, ep: int) -> list[int]:
        """Experts EP rank `ep` computes: its own and its replicas, in expert order."""
        own = range(ep * self.num_local, (ep + 1) * self.num_local)
        return sorted([*own, *self.held(ep)])

    def destination(self, e: int, ep: int) -> int:
        """EP rank the tokens of EP rank `ep` for expert e go to."""
        return ep if ep in self.replicas[e] else self.owner(e)

    def columns(self, ep: int, device: torch.device) -> tuple[torch.Tensor, int]:
        """col [E] = destination * X + the expert's place among the destination's compute experts, and X."""
        X = max(len(self.compute_experts(q)) for q in range(self.n_ep))
        col = []
        for e in range(self.num_experts):
            q = self.destination(e, ep)
            col.append(q * X + self.compute_experts(q).index(e))
        return torch.tensor(col, dtype=torch.int64, device=device), X

    def computed_tokens(self, counts_DE: Sequence[Sequence[int]]) -> list[int]:
        """Tokens each EP rank computes when EP rank d routes counts_DE[d][e] tokens to expert e."""
        out = [0] * self.n_ep
        for d, row in enumerate(counts_DE):
            for e, c in enumerate(row):
                out[self.destination(e, d)] += int(c)
        return out

    def as_dict(self) -> dict[str, list[int]]:
        """{expert: replica EP ranks} of the moved experts (JSON-ready: string keys)."""
        return {str(e): list(self.replicas[e]) for e in self.moved}

    def describe(self) -> str:
        return (
            ", ".join(f"expert {e} -> EP {','.join(map(str, self.replicas[e]))}" for e in self.moved) or "no replicas"
        )


# ----------------------------------------------------------------------------- Trans and Agg
class ReplicaExchange:
    """Trans and Agg of one MoE layer for one forward / backward, point to point on the EP group."""

    def __init__(self, placement: Placement, experts: Experts, ps: "ParallelState", layer_idx: int, blocking: bool):
        self.p, self.experts, self.layer_idx, self.blocking = placement, experts, layer_idx, blocking
        self.group, self.ranks, self.me = ps.group("ep"), ps.ranks("ep"), ps.rank("ep")
        self.held = placement.held(self.me)
        self.device = experts.fc_w.device
        # CUDA: Trans / Agg are issued on their own side streams (CPU: None, every call a no-op)
        self.side = {op: streams.side_stream(self.device, f"pro-prophet-{op}") for op in ("trans", "agg")}
        # per part: (work, {name: [R, ...] buffer}, sends) while in flight, () once `replicas()` took it
        self.trans: list = [None, None]
        self.agg: Optional[tuple] = None  # (work, [(name, local index, buffer)], sends)

    def _tag(self, e: int, name: str, kind: int) -> int:
        return ((self.layer_idx * self.p.num_experts + e) * len(PARAMS) + PARAMS.index(name)) * 2 + kind

    def _local(self, e: int) -> int:
        return e - self.me * self.p.num_local

    def _run(self, op: str, sends: list, recvs: list):
        """Post every isend / irecv ((tensor, peer EP rank, tag)) on `op`'s side stream; one observed Work."""
        sent = sum(t.numel() * t.element_size() for t, _, _ in sends)
        got = sum(t.numel() * t.element_size() for t, _, _ in recvs)
        token = observer.begin(op, self.group, sent, got) if sends or recvs else None
        side = self.side[op]
        streams.wait_stream(side, streams.current_stream(self.device))
        streams.record_stream([t for t, _, _ in sends + recvs], side)  # made on the caller's stream, used here
        with comm_errors.guard(op, self.group), streams.use(side):
            works = [dist.isend(t, self.ranks[q], group=self.group, tag=tag) for t, q, tag in sends]
            works += [dist.irecv(t, self.ranks[q], group=self.group, tag=tag) for t, q, tag in recvs]
        return observer.Work(works, token)

    def _wait(self, op: str, work) -> None:
        """Wait for `work` on `op`'s side stream; the caller's stream then waits for that stream."""
        side = self.side[op]
        with streams.use(side), annotate(f"pro_prophet/{op}_wait"):
            comm_errors.wait(work, op, self.group)
        streams.wait_stream(streams.current_stream(self.device), side)

    def launch_trans(self, part: int) -> None:
        """Start Trans part `part` (0: fc_w, fc_b; 1: proj_w, proj_b); a no-op once started."""
        if self.trans[part] is not None:
            return
        sends, recvs, bufs = [], [], {}
        for name in PARTS[part]:
            param = getattr(self.experts, name).detach()
            bufs[name] = param.new_empty((len(self.held), *param.shape[1:]))
            for e in self.p.moved:
                if self.p.owner(e) == self.me:
                    sends += [(param[self._local(e)], q, self._tag(e, name, 0)) for q in self.p.replicas[e]]
                if self.me in self.p.replicas[e]:
                    recvs.append((bufs[name][self.held.index(e)], self.p.owner(e), self._tag(e, name, 0)))
        self.trans[part] = (self._run("trans", sends, recvs), bufs, sends)  # sends: alive until waited

    def replicas(self) -> tuple[torch.Tensor, ...]:
        """Wait for Trans (launching what is not started): fc_w [R, H_l, M], fc_b [R, H_l],
        proj_w [R, M, H_l], proj_b [R, M_l] of the held replicas, in expert order. Once per exchange.
        The exchange drops the buffers it returns: kept here, they would close a cycle through the
        `_UseReplicas` node that Python's collector cannot see (+16 MB a step, never freed)."""
        out: dict = {}
        for part in range(len(PARTS)):
            self.launch_trans(part)
            if not self.trans[part]:
                raise RuntimeError(f"layer {self.layer_idx}: the replicas of this exchange were taken already")
            work, bufs, _ = self.trans[part]
            self._wait("trans", work)
            self.trans[part] = ()
            out.update(bufs)
        return tuple(out[name] for name in PARAMS)

    def launch_agg(self, grads: Sequence[torch.Tensor]) -> None:
        """Start Agg: replica gradients (shaped as `replicas()` returns) to their owners, and back to us."""
        sends, recvs, bufs = [], [], []
        for name, g in zip(PARAMS, grads):
            param = getattr(self.experts, name)
            for e in self.p.moved:
                if self.me in self.p.replicas[e]:
                    sends.append((g[self.held.index(e)].contiguous(), self.p.owner(e), self._tag(e, name, 1)))
                if self.p.owner(e) == self.me:
                    for q in self.p.replicas[e]:
                        buf = param.new_empty(param.shape[1:])
                        recvs.append((buf, q, self._tag(e, name, 1)))
                        bufs.append((name, self._local(e), buf))
        self.agg = (self._run("agg", sends, recvs), bufs, sends)

    def wait_agg(self) -> tuple[Optional[torch.Tensor], ...]:
        """Wait for Agg; the gradients it adds to fc_w, fc_b, proj_w, proj_b (None where nothing)."""
        if self.agg is None:
            return (None,) * len(PARAMS)
        work, bufs, _ = self.agg
        self._wait("agg", work)
        self.agg = None
        out: dict[str, torch.Tensor] = {}
        for name, i, buf in bufs:
            if name not in out:
                out[name] = torch.zeros_like(getattr(self.experts, name))
            out[name][i] += buf
        return tuple(out.get(name) for name in PARAMS)


class _UseReplicas(torch.autograd.Function):
    """fwd: (x, replica tensors) once Trans is done; bwd: Agg of the replicas' gradients, waited here
    (blocking) or by `_AggWait` / `_AggWaitLater` (scheduled), which hand them to the owner's parameters."""

    @staticmethod
    def forward(ctx, x, ex: ReplicaExchange, fc_w, fc_b, proj_w, proj_b):
        ctx.ex = ex
        return (x.view_as(x), *ex.replicas())

    @staticmethod
    def backward(ctx, g_x, *g_reps):
        ctx.ex.launch_agg(g_reps)
        if ctx.ex.blocking:
            return (g_x, None, *ctx.ex.wait_agg())
        return (g_x, None, None, None, None, None)


class _AggWait(torch.autograd.Function):
    """Identity on the MoE layer's input; backward: wait for Agg, its sums to the owner's parameters."""

    @staticmethod
    def forward(ctx, x, ex: ReplicaExchange, fc_w, fc_b, proj_w, proj_b):
        ctx.ex = ex
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return (g, None, *ctx.ex.wait_agg())


class AggBox:
    """Where a placed layer leaves its exchange for a wait set up earlier in the forward (`_AggWaitLater`)."""

    def __init__(self) -> None:
        self.exchange: Optional[ReplicaExchange] = None


class _AggWaitLater(torch.autograd.Function):
    """Identity on the previous MoE layer's output; backward: wait for the next layer's Agg (if boxed)."""

    @staticmethod
    def forward(ctx, y, box: AggBox, fc_w, fc_b, proj_w, proj_b):
        ctx.box = box
        return y.view_as(y)

    @staticmethod
    def backward(ctx, g):
        ex = ctx.box.exchange
        return (g, None, *(ex.wait_agg() if ex is not None else (None,) * len(PARAMS)))


# ----------------------------------------------------------------------------- the runtime
class PlacedLayer:
    """What one MoE layer's dispatcher holds while a placement with replicas is active."""

    def __init__(self, runtime: "ProProphet", layer_idx: int, placement: Placement, experts: Experts):
        self.runtime, self.layer_idx, self.placement, self.experts = runtime, layer_idx, placement, experts
        self.exchange: Optional[ReplicaExchange] = None

    def columns(self, ep: int, device: torch.device) -> tuple[torch.Tensor, int]:
        return self.placement.columns(ep, device)

    def expert_rows(self, rows_X: list[int]) -> list[int]:
        """Rows per compute expert of this rank, from the rows received per column [X] (host ints)."""
        n = len(self.placement.compute_experts(self.runtime.ps.rank("ep")))
        if sum(rows_X[n:]):
            raise RuntimeError(
                f"layer {self.layer_idx}: tokens arrived for experts this rank does not compute "
                f"(the ranks disagree on the Pro-Prophet placement)"
            )
        return list(rows_X[:n])

    def new_exchange(self) -> ReplicaExchange:
        return ReplicaExchange(
            self.placement, self.experts, self.runtime.ps, self.layer_idx, blocking=not self.runtime.schedule
        )

    def layer_input(self, x_BTM: torch.Tensor) -> torch.Tensor:
        """Take the prefetched exchange (or make one), launch its Trans (scheduled) and put the Agg wait
        in the box set up this forward, else on this layer's input."""
        ex = self.runtime.pending.pop(self.layer_idx, None) or self.new_exchange()
        box = self.runtime.boxes.pop(self.layer_idx, None)
        self.exchange = ex
        if ex.blocking:
            return x_BTM
        ex.launch_trans(0)
        ex.launch_trans(1)
        if not (torch.is_grad_enabled() and x_BTM.requires_grad):
            ex.blocking = True  # nothing to hang the wait on: Agg (if any) waits where it starts
            return x_BTM
        if box is not None:
            box.exchange = ex
            return x_BTM
        e = self.experts
        return _AggWait.apply(x_BTM, ex, e.fc_w, e.fc_b, e.proj_w, e.proj_b)

    def run_experts(self, x_RM: torch.Tensor, counts: list[int], grad_scale: float) -> torch.Tensor:
        """The experts on ragged x [R, M] (rows per compute expert: replicas below own, own, replicas
        above); own experts via `forward_ragged`, each replica group as one grouped MLP on Trans buffers."""
        ex = self.exchange if self.exchange is not None else self.new_exchange()
        self.exchange = None
        nxt = self.runtime.next_placed(self.layer_idx) if self.runtime.schedule else None
        e = self.experts
        x_RM, *reps = _UseReplicas.apply(x_RM, ex, e.fc_w, e.fc_b, e.proj_w, e.proj_b)
        if nxt is not None:
            self.runtime.prefetch(nxt, 0)
        reps = [scale_grad(t, grad_scale) for t in reps]
        me, n_own = self.runtime.ps.rank("ep"), e.num_local
        below = sum(1 for x in ex.held if x < me * n_own)  # replicas computed before the own experts
        groups = ((0, below), (below, below + n_own), (below + n_own, len(counts)))  # compute-expert ranges
        parts, row = [], 0
        with annotate("moe/experts"):
            for i, (lo, hi) in enumerate(groups):
                rows = sum(counts[lo:hi])
                x, row = x_RM[row : row + rows], row + rows
                if i == 1:
                    parts.append(e.forward_ragged(x, counts[lo:hi], grad_scale))
                elif hi > lo:
                    r0, r1 = (lo, hi) if i == 0 else (lo - n_own, hi - n_own)  # rows of the held replicas
                    parts.append(e.forward_grouped(x, counts[lo:hi], *(t[r0:r1] for t in reps)))
            y = torch.cat(parts) if len(parts) > 1 else parts[0]
        if nxt is not None:
            self.runtime.prefetch(nxt, 1)
        return y


def routed_counts(layer) -> torch.Tensor:
    """[E] int64: the routed choices this rank sent to each expert in `layer`'s last forward (CPU)."""
    routes = layer.router.last_routes
    E = layer.num_experts
    total = torch.zeros(E, dtype=torch.int64, device=routes[0].expert.device)
    for r in routes:
        total += torch.bincount(r.expert[r.slot >= 0], minlength=E)
    return total.cpu()


def gather_counts(ps: "ParallelState", counts_LE: torch.Tensor) -> torch.Tensor:
    """counts [L, E] of every EP x ESP rank -> [L, N_EP, E] (ESP ranks summed), the same on every rank
    (CPU). One all-gather of L * E integers."""
    L, E = counts_LE.shape
    n_ep, n_esp = ps.size("ep"), ps.size("esp")
    mine = counts_LE.to(device=ps.device, dtype=torch.int64).reshape(1, L, E)
    every = all_gather_raw(mine, ps.group("ep_esp"), dim=0)  # [D, L, E], D = EP-major
    return every.reshape(n_ep, n_esp, L, E).sum(dim=1).permute(1, 0, 2).cpu()


# planner(counts [N_EP, E] as lists) -> replicas[e] (EP ranks) for one layer
Planner = Callable[[list[list[int]]], Sequence[Sequence[int]]]


class ProProphet:
    """Per model: the MoE layers' placements, Trans prefetch across layers, and the next plan.

    planner / wider: counts [N_EP, E] -> replicas per expert, deterministic (every EP x ESP rank plans
      alike); run every `interval` iterations (None: placements stay as set). `wider`: the trial's third arm.
    Counts arrive via `TokenDispatcher.set_counts_sink`, summed over the iteration's autograd forwards.
      With `plan_in_flight` the next plan is made under the layer's last all-to-all, else in `end_iteration`.
    calibrator: picks the placed calibration iterations; MoE layer times are MAX-reduced and fitted.
    anchor (scheduled only): a module before the first MoE layer whose output needs a gradient; its
      forward starts that layer's Trans, its output carries its Agg wait.
    measure_iters K > 0 (with a planner): the trial's timed passes per arm; `decision` holds its pick."""

    turn = True  # `training.take_turns`: False while another in-training trial measures

    def __init__(
        self,
        layers: list,
        ps: "ParallelState",
        schedule: bool = True,
        planner: Optional[Planner] = None,
        interval: int = 1,
        calibrator: Optional[Calibrator] = None,
        plan_in_flight: bool = True,
        measure_iters: int = 0,
        anchor: Optional[torch.nn.Module] = None,
        wider: Optional[Planner] = None,
    ):
        self.layers = sorted(layers, key=lambda layer: layer.layer_idx)
        self.ps, self.schedule, self.planner, self.interval = ps, schedule, planner, interval
        self.wider = wider
        self.calibrator, self.plan_in_flight = calibrator, plan_in_flight
        self.pending: dict[int, ReplicaExchange] = {}
        self.plans: dict[int, Placement] = {}
        n_ep, E = ps.size("ep"), self.layers[0].num_experts
        self.counts = {la.layer_idx: torch.zeros(n_ep, E, dtype=torch.int64, device="cpu") for la in self.layers}
        self.forwards = {la.layer_idx: 0 for la in self.layers}  # forwards under autograd this iteration
        self.forwards_per_iteration: Optional[int] = None  # learned from the last iteration
        self.running: Optional[int] = None  # the iteration now running (known after the first ends)
        self.ended = 0  # iterations ended under this runtime (what the calibrator counts)
        self.early: dict[int, tuple[int, Placement]] = {}  # layer -> (forwards seen, plan made in flight)
        self.planned_in_flight = 0  # layer plans made under an all-to-all and used
        self.clock = LayerClock(self.layers, ps.device) if calibrator is not None and calibrator.iters else None
        for layer in self.layers:
            layer.dispatcher.set_counts_sink(self)
        self.trial: Optional[choose.Trial] = None
        if planner is not None and measure_iters > 0:
            arms = ("plain", "placed", "wider") if wider is not None else ("plain", "placed")
            self.trial = choose.Trial(TRIAL, arms, ps.group("world"), ps.device, measure_iters, warmup=0, settle=1)
            if calibrator is not None:  # the trial's iterations (and any before it) refine the fit
                calibrator.sample_more(None)
        self.trial_from: Optional[int] = None  # iterations ended under this runtime before the trial's first
        self.trial_moved = False  # a placed iteration of the trial had replicas
        self.decision: Optional[choose.Decision] = None  # the trial's
        self.trial_line: Optional[str] = None  # the decision's log line, until `take_trial_line`
        self.wider_log: list[tuple[list, Placement]] = []  # the wider arm's (counts, plan) per layer plan
        # scheduled Agg: layer l's is waited after the non-expert backward between layers l-1 and l
        self.boxes: dict[int, AggBox] = {}
        if schedule:
            for prev, nxt in zip(self.layers, self.layers[1:]):
                prev.register_forward_hook(self._agg_wait_hook(nxt))
            if anchor is not None:  # the first MoE layer's Trans starts, and its Agg is waited, at the anchor
                anchor.register_forward_pre_hook(self._trans_early_hook)
                anchor.register_forward_hook(self._agg_wait_hook(self.layers[0]))

    def _trans_early_hook(self, module, args) -> None:
        """Anchor pre-hook: launch the first MoE layer's Trans (both parts) to overlap the forward before it."""
        first = self.layers[0]
        if torch.is_grad_enabled() and first.dispatcher.placement is not None:
            self.prefetch(first.layer_idx, 0)
            self.prefetch(first.layer_idx, 1)

    def _agg_wait_hook(self, nxt):
        """A forward hook for the MoE layer before `nxt`: its output carries the wait for `nxt`'s Agg."""

        def hook(module, args, output):
            if nxt.dispatcher.placement is None:
                return None  # `nxt` runs without replicas this iteration: nothing to wait for
            y = output[0] if isinstance(output, tuple) else output
            if not (torch.is_grad_enabled() and isinstance(y, torch.Tensor) and y.requires_grad):
                return None
            box = self.boxes[nxt.layer_idx] = AggBox()
            e = nxt.experts
            y = _AggWaitLater.apply(y, box, e.fc_w, e.fc_b, e.proj_w, e.proj_b)
            return (y, *output[1:]) if isinstance(output, tuple) else y

        return hook

    # -- counts and planning under the all-to-all (called by the dispatchers) --------------------
    def add_counts(self, layer_idx: int, counts_DE: torch.Tensor) -> None:
        """Add counts [D, E] (D = EP x ESP ranks, EP-major, host) of one forward, summed per EP rank."""
        if not torch.is_grad_enabled():
            return  # evaluation forwards are no part of the training iteration
        n_ep = self.ps.size("ep")
        self.counts[layer_idx] += counts_DE.to(torch.int64).reshape(n_ep, -1, counts_DE.size(1)).sum(1)
        self.forwards[layer_idx] += 1

    def dispatch_in_flight(self, layer_idx: int) -> None:
        """Under the layer's all-to-all: plan its next iteration if its counts are complete and due."""
        if not (self.plan_in_flight and torch.is_grad_enabled()) or self.running is None:
            return
        nxt = self.ended + 1
        if (
            self._trial_at(nxt)  # the trial's iterations plan at their end: each arm pays its own planning
            or self.forwards[layer_idx] != self.forwards_per_iteration
            or self._action(self.running, nxt) != "plan"
            or (self.calibrator is not None and self.calibrator.fit_due(nxt))  # the model changes at the end
        ):
            return
        self.early[layer_idx] = (self.forwards[layer_idx], self._plan(self.counts[layer_idx], self._wide()))

    def collected_counts(self) -> torch.Tensor:
        """This iteration's counts [L, N_EP, E] (layers in order), identical on every rank of the group."""
        return torch.stack([self.counts[la.layer_idx] for la in self.layers])

    # -- the trial -------------------------------------------------------------------------------
    @property
    def decided(self) -> bool:
        """No trial, or it decided."""
        return self.trial is None or self.trial.done

    def _trial_at(self, local: int) -> bool:
        """Whether the end of the `local`-th iteration under this runtime belongs to (or begins) the trial."""
        if self.decided:
            return False
        cal = self.calibrator
        return self.trial_from is not None or (self.turn and local >= max(cal.last if cal is not None else 0, 1))

    def _arm(self) -> Optional[str]:
        """The trial's alternative for the next iteration (None outside the trial)."""
        return self.trial.next() if self.trial is not None and self.trial_from is not None else None

    def _trial_step(self) -> None:
        """At an iteration's end: end the trial's pass (deciding after the last) or begin it; start the next."""
        trial, cal = self.trial, self.calibrator
        if trial is None or trial.done:
            return
        if self.trial_from is not None:
            self.trial_moved |= trial.next() == "placed" and any(p.moved for p in self.plans.values())
            decision = trial.stop()  # collective on the pass that decides
            if decision is not None:
                self._decide(decision)
                return
        elif self._trial_at(self.ended):
            self.trial_from = self.ended
            if cal is not None:  # sampled up to the decision, then refitted
                cal.sample_more(self.ended + trial.length - cal.last)
        else:
            return
        trial.start()

    def _decide(self, d: choose.Decision) -> None:
        """The rules that are not timing rules, then the pick from the next iteration on."""
        arms = d.alternatives
        if not self.trial_moved:  # both arms ran the plain graph: nothing to keep
            d = choose.untimed(TRIAL, arms, "plain", "the planner moved no expert in a placed iteration")
        elif "wider" in arms and choose.forced(TRIAL) is None and not self._wider_moved_more():
            d = replace(d, pick=choose.pick(d.medians, arms[:2]), reason="measured; the wider plans were the planner's")
        self.decision, self.trial_line, self.wider_log = d, d.line(), []

    def _kept_passes(self, iterations) -> list[bool]:
        """For each of `iterations` (under this runtime): whether it was a timed pass of the trial's pick."""
        assert self.trial is not None and self.decision is not None and self.trial_from is not None
        order, want = self.trial.order, (self.trial.alternatives.index(self.decision.pick), True)
        return [
            0 <= i - self.trial_from - 1 < len(order) and order[i - self.trial_from - 1] == want for i in iterations
        ]

    def take_trial_line(self) -> Optional[str]:
        """The trial's decision line, once (None before the decision and after it was taken)."""
        line, self.trial_line = self.trial_line, None
        return line

    # -- the end of an iteration ---------------------------------------------------------------
    def _action(self, iteration: int, local: int) -> str:
        """What the end of `iteration` (the `local`-th here) does: "plan", "off" (no placement) or "keep"."""
        cal = self.calibrator
        if self.planner is None:
            return "keep"
        if self.decision is not None and self.decision.pick == "plain":
            return "off"  # the empty plan for the rest of the run
        if cal is not None and cal.placement_off(local + 1):
            return "off"
        arm = self._arm()
        if arm is not None:
            return "off" if arm == "plain" else "plan"
        if cal is not None and cal.calibrating(local):
            return "plan"
        return "keep" if iteration % self.interval else "plan"

    def _wide(self) -> bool:
        """Whether the next plans are the wider planner's: its trial passes, and every plan after a "wider" pick."""
        pick = self.decision.pick if self.decision is not None else None
        return self.wider is not None and (self._arm() or pick) == "wider"

    def _plan(self, counts_DE: torch.Tensor, wide: bool = False) -> Placement:
        planner = self.wider if wide else self.planner
        assert planner is not None
        E, n_ep = self.layers[0].num_experts, self.ps.size("ep")
        return Placement(E, n_ep, tuple(tuple(int(q) for q in r) for r in planner(counts_DE.tolist())))

    def _wider_moved_more(self) -> bool:
        """Whether a wider plan moved more experts than the planner would have on the same counts (pre-refit)."""
        return any(
            len(p.moved) > len(self._plan(torch.tensor(c, dtype=torch.int64, device="cpu")).moved)
            for c, p in self.wider_log
        )

    def end_iteration(self, iteration: int, counts_LDE: Optional[torch.Tensor] = None) -> bool:
        """After `iteration` (1-based): trial pass, calibration, then every `interval` iterations a plan from
        counts [L, N_EP, E] (default `collected_counts`). True when it planned."""
        counts = self.collected_counts() if counts_LDE is None else counts_LDE
        cal = self.calibrator
        self.ended += 1
        self._trial_step()  # before the refit: it fits on the picked alternative's passes
        if cal is not None and self.clock is not None:
            used = [self.placement_of(la.layer_idx).replicas for la in self.layers]
            cal.record(self.ended, counts.tolist(), used, self.clock.take())
            if cal.fit_due(self.ended):
                times = torch.tensor(cal.measured, dtype=torch.float64, device=self.ps.device)
                if dist.is_initialized():
                    dist.all_reduce(times, op=dist.ReduceOp.MAX)  # the same samples on every rank
                kept = None
                if self.decision is not None and cal.fits:  # the refit after the trial
                    kept = self._kept_passes(range(cal.last + 1, self.ended + 1))
                cal.fit(times.cpu().tolist(), kept)
            if not cal.sampling(self.ended + 1):
                self.clock.remove()
                self.clock = None
        action = self._action(iteration, self.ended)
        early, fresh = self.early, dict(self.forwards)
        self.early, self.running = {}, iteration + 1
        self.forwards_per_iteration = fresh[self.layers[0].layer_idx]
        for la in self.layers:
            self.counts[la.layer_idx].zero_()
            self.forwards[la.layer_idx] = 0
        if action == "off":
            self.set_plans({})
        if action != "plan":
            return False
        plans = {}
        wide = self._wide()
        arm_wider = self._arm() == "wider"
        for i, la in enumerate(self.layers):
            seen, p = early.get(la.layer_idx, (-1, None))
            if p is not None and seen == fresh[la.layer_idx] and counts_LDE is None:
                plans[la.layer_idx] = p
                self.planned_in_flight += 1
            else:
                plans[la.layer_idx] = self._plan(counts[i], wide)
            if arm_wider:  # the trial asks at its decision whether the planner would have moved fewer
                self.wider_log.append((counts[i].tolist(), plans[la.layer_idx]))
        self.set_plans(plans)
        return True

    def placement_of(self, layer_idx: int) -> Placement:
        """The placement layer `layer_idx` uses now (no replicas when none was set)."""
        p = self.plans.get(layer_idx)
        return p if p is not None else Placement.of(self.layers[0].num_experts, self.ps.size("ep"), {})

    def set_plans(self, plans: Mapping[int, Placement]) -> None:
        """Use `plans` ({layer index: Placement}; layers not named: no replicas) from the next forward."""
        self.pending.clear()
        self.plans = dict(plans)
        for layer in self.layers:
            p = self.plans.get(layer.layer_idx)
            layer.dispatcher.set_placement(
                PlacedLayer(self, layer.layer_idx, p, layer.experts) if p is not None and p.moved else None
            )

    def next_placed(self, layer_idx: int) -> Optional[int]:
        """The next MoE layer after `layer_idx` with replicas, or None."""
        for layer in self.layers:
            if layer.layer_idx > layer_idx:
                return layer.layer_idx if layer.dispatcher.placement is not None else None
        return None

    def prefetch(self, layer_idx: int, part: int) -> None:
        """Launch Trans part `part` of layer `layer_idx` ahead of its forward."""
        layer = next(la for la in self.layers if la.layer_idx == layer_idx)
        placed = layer.dispatcher.placement
        ex = self.pending.get(layer_idx)
        if ex is None:
            ex = self.pending[layer_idx] = placed.new_exchange()
        ex.launch_trans(part)
