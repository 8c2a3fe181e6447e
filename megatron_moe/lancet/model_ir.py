"""Lancet's view of a concrete model: profiled costs, the forward op list and its CP-SAT IR.

Legend: B micro-batch, T sequence, S = B*T tokens, M model dim, H ffn dim, E experts (E_l local),
C capacity, K experts per token, D ranks of the token all-to-all group.

`profile_costs` times this rank's compute ops with an OpProfiler (once per op and shape, random
inputs of the model's shapes, local GEMMs only: ranks never wait on each other);
`profile_a2a_model` times the token all-to-all on the real group at the sizes Lancet sends.
`build_model_ops` turns them into the forward op list the partition DP searches: embed; per block
ln1, attn.qkv, attn.core, attn.proj, ln2, then mlp.fc1, mlp.fc2 or moe.gate, moe.dispatch,
moe.a2a_dispatch (comm, bytes), moe.experts, moe.a2a_combine (comm), moe.combine; head (ln_f, LM
head, cross entropy). Each op maps to the AxisOps (`axes.py`) of its tensors, so CP-SAT can check
any op range, and the ops where the runtime can start or end a range (`partitioned_moe.RangeSpec`)
are recorded. `feasibility`: the runtime can run the range and CP-SAT finds batch axes (a
batch-prioritized or top-2 gate then only allows ranges starting at it).

Approximations: MP all-reduces inside attention/MLP are not timed (local GEMMs only); an all-to-all
moves the expected real tokens min(S*K, E*C) (times N_ESP copies).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn.functional as F

from megatron_moe.distributed.collectives import group_size, max_over_group
from megatron_moe.layers.fused import gelu_tanh
from megatron_moe.lancet.axes import AxisOp, AxisRange, solve_axes
from megatron_moe.lancet.cost import CommCostModel, OpProfiler
from megatron_moe.lancet.partitioned_moe import RangeAxes, leading_blocks, needs_whole_batch_gate
from megatron_moe.lancet.simulator import SimOp
from megatron_moe.model.gpt2 import GPT2MoE, ffn_hidden_size
from megatron_moe.moe.comm_profile import time_collective
from megatron_moe.moe.dispatcher import combine, dispatch, dispatch_index
from megatron_moe.moe.router import capacity
from megatron_moe.parallel_state import ParallelState

DENSE_OPS = ("ln1", "attn.qkv", "attn.core", "attn.proj", "ln2", "mlp.fc1", "mlp.fc2")
MOE_OPS = (
    "ln1",
    "attn.qkv",
    "attn.core",
    "attn.proj",
    "ln2",
    "moe.gate",
    "moe.dispatch",
    "moe.a2a_dispatch",
    "moe.experts",
    "moe.a2a_combine",
    "moe.combine",
)
COMM_OPS = ("moe.a2a_dispatch", "moe.a2a_combine")


def token_group_kind(ps: ParallelState) -> str:
    """The token all-to-all group of partitioned parts: EP, or EP x ESP when experts are sharded."""
    return "ep" if ps.size("esp") == 1 else "ep_esp"


def deferrable_dw_names(model) -> set[str]:
    """IR names of the dW GEMMs the runtime can defer (column/row parallel linears and experts)."""
    out = set()
    for l, b in enumerate(model.blocks):
        out |= {f"L{l}.attn.qkv.dW", f"L{l}.attn.proj.dW"}
        out |= (
            {f"L{l}.moe.expert.fc1.dW", f"L{l}.moe.expert.fc2.dW"}
            if b.is_moe
            else {f"L{l}.mlp.fc1.dW", f"L{l}.mlp.fc2.dW"}
        )
    return out


# ---------------------------------------------------------------------- shapes and profiling


@dataclass
class Shapes:
    """Per-rank sizes the costs depend on."""

    B: int
    T: int
    M: int
    H: int
    heads: int  # attention heads on this MP rank
    mp: int
    E: int
    E_l: int
    K: int
    C: int
    D: int
    n_esp: int
    vocab_local: int

    @property
    def S(self) -> int:
        """Tokens of the micro-batch."""
        return self.B * self.T

    def a2a_bytes(self) -> float:
        """Expected bytes one rank sends in a token all-to-all (real tokens, every ESP copy)."""
        return min(self.S * self.K, self.E * self.C) * self.n_esp * self.M * 4.0


def model_shapes(model: GPT2MoE, ps: ParallelState, B: int, T: int) -> Shapes:
    """Shapes of `model` on this rank for micro-batch B x T."""
    m, moe = model.cfg.model, model.cfg.moe
    E = max(moe.num_experts, 1)
    K = moe.moe_router_topk
    C = capacity(B * T, E, K, moe.moe_expert_capacity_factor, moe.moe_min_capacity)
    mp = ps.size("mp")
    return Shapes(
        B,
        T,
        m.hidden_size,
        ffn_hidden_size(m),
        m.num_attention_heads // mp,
        mp,
        E,
        E // ps.size("ep"),
        K,
        C,
        ps.size("ep") * ps.size("esp"),
        ps.size("esp"),
        model.padded_vocab // mp,
    )


def _ops_of_block(block, sh: Shapes, batch: int) -> dict:
    """name -> zero-argument callable running that forward op on random inputs of `batch` samples."""
    T, M = sh.T, sh.M
    dev = block.attn.qkv.weight.device  # the inputs live where the block's weights do
    x = torch.randn(batch, T, M, device=dev)
    a = block.attn
    hd = M // (sh.heads * sh.mp)
    qkv = torch.randn(batch, sh.heads, T, hd, device=dev)
    ctx = torch.randn(batch, T, sh.heads * hd, device=dev)
    ops = {
        "ln1": lambda: block.ln1(x),
        "attn.qkv": lambda: F.linear(x, a.qkv.weight, a.qkv.bias),
        "attn.core": lambda: (
            F.scaled_dot_product_attention(qkv, qkv, qkv, is_causal=True).transpose(1, 2).reshape(batch, T, -1)
        ),
        "attn.proj": lambda: x + F.linear(ctx, a.proj.weight) + a.proj.bias,
        "ln2": lambda: block.ln2(x),
    }
    if not block.is_moe:
        h = torch.randn(batch, T, block.mlp.fc.weight.size(0), device=dev)
        ops["mlp.fc1"] = lambda: gelu_tanh(F.linear(x, block.mlp.fc.weight, block.mlp.fc.bias))
        ops["mlp.fc2"] = lambda: x + F.linear(h, block.mlp.proj.weight) + block.mlp.proj.bias
        return ops
    layer = block.moe
    tok = x.reshape(-1, M)
    S = tok.size(0)
    C = layer.router.capacity(S)
    r = layer.router.route(tok, 0)
    idx = dispatch_index(r)
    buf = torch.randn(sh.E * C, M, device=dev)
    ops["moe.gate"] = lambda: layer.router.route(tok, 0)
    ops["moe.dispatch"] = lambda: dispatch(tok, idx, sh.E * C)
    if layer.schedule != "s2" or layer.dispatcher.local_only:
        # the parts' uneven dispatcher (`LancetController.part_dispatcher`), or one rank: the kept rows grouped
        # by local expert, every source's expected tokens, at most C
        rows = sh.D * min(C, -(-S * sh.K // sh.E))
        x_kept = torch.randn(sh.E_l * rows, M, device=dev)
        ops["moe.experts"] = lambda: layer.experts.forward_ragged(x_kept, [rows] * sh.E_l)
    else:  # S2's parts run the layer's padded buffer
        x_in = torch.randn(sh.E_l, sh.D * C, M, device=dev)
        ops["moe.experts"] = lambda: layer.experts(x_in)
    ops["moe.combine"] = lambda: x + combine(buf, idx, S).view(batch, T, M)
    return ops


def _dw_ops(model, sh: Shapes) -> dict:
    """IR key -> callable running that dW GEMM at this model's shapes (one block of each kind)."""
    S, M, mp = sh.S, sh.M, sh.mp
    dev = model.wte.weight.device
    g = lambda *s: torch.randn(*s, device=dev)  # noqa: E731
    ops = {
        "attn.qkv.dW": (lambda a, b: lambda: a.t().mm(b))(g(S, 3 * M // mp), g(S, M)),
        "attn.proj.dW": (lambda a, b: lambda: a.t().mm(b))(g(S, M), g(S, M // mp)),
        "mlp.fc1.dW": (lambda a, b: lambda: a.t().mm(b))(g(S, sh.H // mp), g(S, M)),
        "mlp.fc2.dW": (lambda a, b: lambda: a.t().mm(b))(g(S, M), g(S, sh.H // mp)),
        "moe.gate.dW": (lambda a, b: lambda: a.t().mm(b))(g(S, sh.E), g(S, M)),
        "head.dW": (lambda a, b: lambda: a.t().mm(b))(g(S, sh.vocab_local), g(S, M)),
    }
    N, Hl = sh.D * sh.C, sh.H // sh.n_esp
    ops["moe.expert.fc1.dW"] = (lambda a, b: lambda: a.transpose(1, 2).bmm(b))(g(sh.E_l, N, M), g(sh.E_l, N, Hl))
    ops["moe.expert.fc2.dW"] = (lambda a, b: lambda: a.transpose(1, 2).bmm(b))(g(sh.E_l, N, Hl), g(sh.E_l, N, M))
    return ops


@dataclass
class Costs:
    """Profiled ms: forward ops per block kind ('dense' / 'moe' -> op -> ms), dW GEMMs, head, overhead;
    `parts`: k -> the forward ops of one part of a k-way batch split ({'dense': ..., 'moe': ...,
    'head': ms}, measured at that part's batch), for k = 2 .. the most partitions profiled."""

    fwd: dict
    dw: dict
    head_ms: float
    embed_ms: float
    overhead_ms: float
    parts: dict = field(default_factory=dict)


def _head_op(model: GPT2MoE, ps: ParallelState, sh: Shapes, batch: int):
    """The loss head's forward on random inputs of `batch` samples (no collective)."""
    dev = model.wte.weight.device
    h = torch.randn(batch, sh.T, sh.M, device=dev)
    lab = torch.randint(0, min(sh.vocab_local, model.vocab_size), (batch, sh.T), device=dev)
    if ps.size("mp") == 1:  # the loss head itself: ln_f, LM head, cross entropy
        return lambda: model.head_losses(h, lab)
    # its cross entropy all-reduces over MP: a local stand-in of the same shapes
    return lambda: F.cross_entropy(
        F.linear(model.ln_f(h), model.wte.weight).view(batch * sh.T, -1), lab.view(-1), reduction="none"
    )


def _forward_costs(model: GPT2MoE, ps: ParallelState, sh: Shapes, batch: int, prof: OpProfiler, iters: int) -> dict:
    """{'dense': {op: ms}, 'moe': {op: ms}, 'head': ms} of the forward ops at `batch` samples."""
    out: dict = {}
    for block in model.blocks:
        kind = "moe" if block.is_moe else "dense"
        if kind not in out:
            out[kind] = {
                name: prof.time(f"{kind}.{name}", (batch, sh.T, sh.M), fn, warmup=1, iters=iters)
                for name, fn in _ops_of_block(block, sh, batch).items()
            }
    out["head"] = prof.time("head", (batch, sh.T, sh.M), _head_op(model, ps, sh, batch), warmup=1, iters=iters)
    return out


def profile_costs(
    model: GPT2MoE,
    ps: ParallelState,
    B: int,
    T: int,
    profiler: Optional[OpProfiler] = None,
    iters: int = 3,
    max_parts: int = 1,
) -> Costs:
    """Measure this rank's op costs (no collectives): every forward op at the micro-batch B and, for
    k = 2 .. min(max_parts, B), at one part's batch ceil(B / k) (`Costs.parts`: what a k-way range
    pays per part, small-GEMM inefficiency included, as Lancet's profiler times ops at the shapes
    they run at). The fallback overhead per op and part (ops without part costs) is the intercept
    a of t(b) = a + c*b fitted from batches B and 1, averaged over the compute ops."""
    prof = profiler or OpProfiler(None)
    sh = model_shapes(model, ps, B, T)
    with torch.no_grad():
        by_batch = {B: _forward_costs(model, ps, sh, B, prof, iters)}
        for b in sorted({-(-B // k) for k in range(2, min(max_parts, B) + 1)} | ({1} if B > 1 else set())):
            by_batch[b] = _forward_costs(model, ps, sh, b, prof, iters)
        dw = {k: prof.time(f"dw.{k}", (B, T, sh.M), fn, warmup=1, iters=iters) for k, fn in _dw_ops(model, sh).items()}
        ids = torch.randint(0, model.vocab_size, (B, T), device=model.wte.weight.device)
        embed_ms = (
            prof.time("embed", (B, T, sh.M), lambda: model.wte(ids) + model.wpe[:T][None], warmup=1, iters=iters)
            if ps.size("mp") == 1
            else 0.0
        )
    full = by_batch[B]
    fwd = {kind: ops for kind, ops in full.items() if kind != "head"}
    intercepts = (
        [
            max(0.0, (B * by_batch[1][kind][name] - ms) / (B - 1))
            for kind, ops in fwd.items()
            for name, ms in ops.items()
        ]
        if B > 1
        else []
    )
    parts = {k: by_batch[-(-B // k)] for k in range(2, min(max_parts, B) + 1)}
    overhead = sum(intercepts) / len(intercepts) if intercepts else 0.0
    return Costs(fwd, dw, full["head"], embed_ms, overhead, parts)


A2A_MIN_BYTES = 1024  # the token all-to-all is timed from 1 KB, doubling, up to the whole message


def profile_a2a_model(ps: ParallelState, max_bytes: int) -> CommCostModel:
    """Time of an all-to-all on the token group by size (collective over the world), as Lancet builds its
    communication cost model ("Caching Op Profiler"): measured at 1 KB, 2 KB, 4 KB, ... up to the whole
    message `max_bytes`, linear between the points (`CommCostModel`); a part of an n-way range is priced
    at max_bytes / n. Each point: `time_collective` on the real group, the lower of two medians of 3 (a
    1 MB all-to-all on the emulated link took about 40 or about 76 ms from one call to the next, and
    the parts' messages ran at the faster rate), the slowest rank's. Points, not Parm's alpha-beta line
    (`moe.comm_profile`): on a shaped link the first tens of KB pass at the token bucket's burst, and a
    line fitted to the small sizes put a 1 MB all-to-all at 8 ms where it took 39."""
    kind = token_group_kind(ps)
    group = ps.group(kind)
    if group_size(group) == 1:
        return CommCostModel([(1.0, 0.0), (2.0, 0.0)])
    top = max(2048, int(max_bytes))
    sizes = [A2A_MIN_BYTES]  # bytes: 1 KB, 2 KB, ... up to half the whole message, and the whole message
    while sizes[-1] * 2 <= top // 2:
        sizes.append(sizes[-1] * 2)
    sizes.append(top)
    mine = [
        1e3 * min(time_collective("all_to_all", group, nb // 4, device=ps.device) for _ in range(2)) for nb in sizes
    ]
    ms = max_over_group(mine, ps.group("world"), ps.device, "Lancet's all-to-all profile")  # one model on every rank
    return CommCostModel(zip(sizes, ms))


# ---------------------------------------------------------------------- forward op list and CP-SAT IR


@dataclass
class ModelOps:
    """The forward op list of the model for the DP, its CP-SAT IR, and where ranges may start/end.

    axis_span[j]: AxisOps of sim op j are axis.ops[a:b]. starts[l] / ends[l]:
    op indices where a partitioned range of MoE block l may start / end
    (exclusive), mapped to RangeSpec start / end names.
    """

    sim: list[SimOp]
    axis: AxisRange
    axis_span: list[tuple[int, int]]
    starts: dict = field(default_factory=dict)
    ends: dict = field(default_factory=dict)


def _block_axis_ops(p: str, x: str, out: str, moe: bool, whole_gate: bool, t: dict) -> dict:
    """AxisOps of one block, keyed by the sim op they belong to (prefix p, input x, output out)."""
    t.update(
        {
            p + "ln1": ("B", "T", "M"),
            p + "qkv": ("B", "T", "Q"),
            p + "qkv_h": ("B", "H", "T", "D3"),
            p + "ctx_h": ("B", "H", "T", "D"),
            p + "ctx": ("B", "T", "M"),
            p + "h": ("B", "T", "M"),
            p + "ln2": ("B", "T", "M"),
            out: ("B", "T", "M"),
        }
    )
    ops = {
        "ln1": [AxisOp(p + "ln1", "layernorm", (x,), (p + "ln1",), {"dim": "M"})],
        "attn.qkv": [AxisOp(p + "qkv", "linear", (p + "ln1",), (p + "qkv",), {"contract": "M", "out_dim": "Q"})],
        "attn.core": [
            AxisOp(p + "split", "view", (p + "qkv",), (p + "qkv_h",), {"dim_map": {"B": "B", "T": "T"}}),
            AxisOp(p + "core", "attention", (p + "qkv_h",), (p + "ctx_h",)),
            AxisOp(p + "merge", "view", (p + "ctx_h",), (p + "ctx",), {"dim_map": {"B": "B", "T": "T"}}),
        ],
        "attn.proj": [
            AxisOp(p + "proj", "linear", (p + "ctx",), (p + "attn",), {"contract": "M", "out_dim": "M"}),
            AxisOp(p + "res1", "elementwise", (x, p + "attn"), (p + "h",)),
        ],
        "ln2": [AxisOp(p + "ln2", "layernorm", (p + "h",), (p + "ln2",), {"dim": "M"})],
    }
    t[p + "attn"] = ("B", "T", "M")
    if not moe:
        t.update({p + "fc1": ("B", "T", "F"), p + "fc2": ("B", "T", "M")})
        ops["mlp.fc1"] = [AxisOp(p + "fc1", "linear", (p + "ln2",), (p + "fc1",), {"contract": "M", "out_dim": "F"})]
        ops["mlp.fc2"] = [
            AxisOp(p + "fc2", "linear", (p + "fc1",), (p + "fc2",), {"contract": "F", "out_dim": "M"}),
            AxisOp(p + "res2", "elementwise", (p + "h", p + "fc2"), (out,)),
        ]
        return ops
    t.update(
        {
            p + "tok": ("S", "M"),
            p + "gates": ("S", "E"),
            p + "disp": ("E", "C", "M"),
            p + "disp_x": ("E", "C", "M"),
            p + "exp": ("E", "C", "M"),
            p + "back": ("E", "C", "M"),
            p + "moe_tok": ("S", "M"),
            p + "moe": ("B", "T", "M"),
        }
    )
    ops["ln2"].append(AxisOp(p + "flatten", "view", (p + "ln2",), (p + "tok",), {"dim_map": {"B": "S"}}))
    ops["moe.gate"] = [AxisOp(p + "gate", "gate", (p + "tok",), (p + "gates",), {"batch_prioritized": whole_gate})]
    ops["moe.dispatch"] = [AxisOp(p + "dispatch", "dispatch", (p + "tok", p + "gates"), (p + "disp",))]
    ops["moe.a2a_dispatch"] = [AxisOp(p + "a2a1", "a2a", (p + "disp",), (p + "disp_x",))]
    ops["moe.experts"] = [AxisOp(p + "experts", "experts", (p + "disp_x",), (p + "exp",))]
    ops["moe.a2a_combine"] = [AxisOp(p + "a2a2", "a2a", (p + "exp",), (p + "back",))]
    ops["moe.combine"] = [
        AxisOp(p + "combine", "combine", (p + "back", p + "gates"), (p + "moe_tok",)),
        AxisOp(p + "unflatten", "view", (p + "moe_tok",), (p + "moe",), {"dim_map": {"S": "B"}}),
        AxisOp(p + "res2", "elementwise", (p + "h", p + "moe"), (out,)),
    ]
    return ops


def _last_moe_before(model, l: int) -> Optional[int]:
    """Index of the last MoE block before block l, None if there is none."""
    return next((j for j in range(l - 1, -1, -1) if model.blocks[j].is_moe), None)


def zero_costs(model) -> Costs:
    """Costs of 0 ms for every op (for the op list's structure and axes alone)."""
    zero = {"dense": {op: 0.0 for op in DENSE_OPS}, "moe": {op: 0.0 for op in MOE_OPS}}
    return Costs(zero, {}, 0.0, 0.0, 0.0)


def _part_ms(costs: Costs, kind: str, op: Optional[str] = None) -> Optional[tuple[tuple[int, float], ...]]:
    """(k, ms of one part of a k-way split) of a block op (kind, op) or of the head (kind 'head')."""
    if not costs.parts:
        return None
    return tuple((k, c[kind] if op is None else c[kind][op]) for k, c in sorted(costs.parts.items()))


def build_model_ops(model, costs: Costs, sh: Optional[Shapes]) -> ModelOps:
    """The forward op list with costs, its AxisRange, and the supported range boundaries
    (sh None: all-to-alls carry no byte count)."""
    tensors: dict = {"ids": ("B", "T"), "x0": ("B", "T", "M")}
    sim: list[SimOp] = [SimOp("embed", "compute", costs.embed_ms)]
    axis_ops = [AxisOp("embed", "elementwise", ("ids",), ("x0",))]
    spans = [(0, 1)]
    starts: dict[int, dict[int, str]] = {}  # see ModelOps
    block_at: dict[int, int] = {}  # block -> index of its first op (ln1)
    ends: dict[int, dict[int, str]] = {}
    nbytes = sh.a2a_bytes() if sh is not None else None
    first_dense = 0  # the first block of the current run of dense blocks
    for l, block in enumerate(model.blocks):
        j0, moe = len(sim), block.is_moe
        if moe and first_dense < l:  # dense blocks first..l-1 lead up to block l: a "dense" start
            starts.setdefault(l, {})[block_at[first_dense]] = "dense"
        block_at[l] = j0
        first_dense = l + 1 if moe else first_dense
        whole = moe and needs_whole_batch_gate(block.moe)
        per_op = _block_axis_ops(f"L{l}.", f"x{l}", f"x{l + 1}", moe, whole, tensors)
        kind = "moe" if moe else "dense"
        for op in MOE_OPS if moe else DENSE_OPS:
            j = len(sim)
            if op in ("ln1", "ln2", "moe.gate"):
                if moe:
                    starts.setdefault(l, {})[j] = {"ln1": "attn", "ln2": "ln2", "moe.gate": "gate"}[op]
            if op in COMM_OPS:
                sim.append(SimOp(f"L{l}.{op}", "comm", 0.0, nbytes))
            else:
                sim.append(SimOp(f"L{l}.{op}", "compute", costs.fwd[kind][op], None, _part_ms(costs, kind, op)))
            spans.append((len(axis_ops), len(axis_ops) + len(per_op[op])))
            axis_ops += per_op[op]
        if moe:
            ends.setdefault(l, {})[len(sim)] = "block"
        if l > 0 and model.blocks[l - 1].is_moe:  # after this block's attn.proj: end of l-1's range
            ends.setdefault(l - 1, {})[j0 + 4] = "next_attn"
        prev = _last_moe_before(model, l)
        if prev is not None and prev < l - 1:  # dense blocks prev+1..l-1 lie between two MoE blocks
            if moe:
                ends.setdefault(prev, {})[j0] = "dense"
                ends[prev][j0 + 4] = "dense_next_attn"
    prev = _last_moe_before(model, len(model.blocks))
    if prev is not None and prev < len(model.blocks) - 1:  # dense blocks after the last MoE block
        ends.setdefault(prev, {})[len(sim)] = "dense"
    L = len(model.blocks)
    tensors["logits"] = ("B", "T", "V")
    sim.append(SimOp("head", "compute", costs.head_ms, None, _part_ms(costs, "head")))
    spans.append((len(axis_ops), len(axis_ops) + 1))
    axis_ops.append(AxisOp("head", "linear", (f"x{L}",), ("logits",), {"contract": "M", "out_dim": "V"}))
    if prev is not None:  # the last MoE block's range may run on through the loss head
        ends.setdefault(prev, {})[len(sim)] = "head"
    return ModelOps(sim, AxisRange(tensors, axis_ops), spans, starts, ends)


def op_span(mo: ModelOps, spec) -> tuple[int, int]:
    """Op indices [lo, hi) of the RangeSpec `spec` (ValueError if the model has no such range)."""
    lo = next((j for j, n in mo.starts.get(spec.layer, {}).items() if n == spec.start), None)
    hi = next((j for j, n in mo.ends.get(spec.layer, {}).items() if n == spec.end), None)
    if lo is None or hi is None:
        raise ValueError(
            f"Lancet range {spec}: the model has no such range (starts {mo.starts.get(spec.layer)}, "
            f"ends {mo.ends.get(spec.layer)})"
        )
    return lo, hi


def range_axes(model, spec, time_limit_s: float = 10.0) -> RangeAxes:
    """CP-SAT's partition dims for the ops of `spec` in `model` (ValueError when it has none:
    the range cannot be partitioned)."""
    mo = build_model_ops(model, zero_costs(model), None)
    lo, hi = op_span(mo, spec)
    a, b = mo.axis_span[lo][0], mo.axis_span[hi - 1][1]
    sol = solve_axes(mo.axis, a, b, time_limit_s)
    if sol is None:
        raise ValueError(f"Lancet range {spec}: CP-SAT finds no partition axes (an op in it cannot be split)")
    dims = mo.axis.tensors
    ops = {}
    for j in range(lo, hi):
        first = mo.axis.ops[mo.axis_span[j][0]]
        t = first.inputs[0]
        ops[mo.sim[j].name] = (t, dims[t], sol[t])
    # the residual stream the runtime splits first: the first leading block's input (dense start), the
    # block input (attn start) or its attention output
    lead = leading_blocks(spec, [b.is_moe for b in model.blocks])
    x = f"x{lead[0]}" if lead else f"x{spec.layer}" if spec.start == "attn" else f"L{spec.layer}.h"
    return RangeAxes((x, dims[x], sol[x]), ops)


def runtime_range(mo: ModelOps, lo: int, hi: int) -> Optional[tuple[int, str, str]]:
    """(layer, start, end) of the RangeSpec ops lo..hi-1 form, or None if the runtime cannot run it."""
    for l, starts in mo.starts.items():
        if lo in starts and hi in mo.ends.get(l, {}):
            return l, starts[lo], mo.ends[l][hi]
    return None


def feasibility(mo: ModelOps, time_limit_s: float = 10.0):
    """feasible(lo, hi) for plan_ops: a runtime range whose tensors CP-SAT can split along the batch."""

    def feasible(lo: int, hi: int) -> bool:
        if runtime_range(mo, lo, hi) is None:
            return False
        return solve_axes(mo.axis, mo.axis_span[lo][0], mo.axis_span[hi - 1][1], time_limit_s) is not None

    return feasible
