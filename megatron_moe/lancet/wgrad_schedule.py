"""Weight-gradient scheduling for the backward pass (Lancet, Algorithm 1).

In backward an all-to-all blocks every instruction that needs its result, but weight-gradient (dW)
GEMMs feed only the optimizer, so many of them can be deferred and run while an all-to-all is in
flight. Lancet assigns dW instructions to all-to-alls with a best-fit greedy:

    for each all-to-all a, in program order:
        remaining = cost(a)
        while remaining > 0 and some unused dW is eligible for a:
            w = best fit for `remaining`;  assign w to a;  remaining -= cost(w)

Best fit (the paper's rule): the eligible dW whose cost is closest to the remaining time, argmin
|remaining - cost(w)|, short or over (a dW that overshoots hides the rest of the communication and
has to run somewhere anyway); ties go to the earlier instruction, so the result is deterministic.
Eligible for a: no directed path to or from a (`ir.overlappable_dw`), and before a in program order
(deferred, which is what an autograd-based runtime can do).

The runtime launches a's dW list, in order, under a, and runs the `leftover` dW at their
program-order position.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Collection, Mapping, Sequence

from megatron_moe.lancet.ir import Graph, Instr, overlappable_dw


@dataclass
class WgradSchedule:
    """Result of Algorithm 1.

    assignment: every all-to-all name (program order) -> dW names to launch
        while it is in flight, in launch order (possibly empty).
    leftover: dW names assigned to no all-to-all, in program order.
    """

    assignment: dict[str, list[str]] = field(default_factory=dict)
    leftover: list[str] = field(default_factory=list)


def eligible_dw(graph: Graph, a2a: str) -> list[str]:
    """dW names that may overlap all-to-all `a2a` (module docstring), in program order."""
    return [w for w in overlappable_dw(graph, a2a) if graph.position(w) < graph.position(a2a)]


def best_fit(graph: Graph, candidates: Sequence[str], remaining: float) -> str:
    """The candidate dW whose cost is closest to `remaining` ms: argmin |remaining - cost|; `candidates`:
    non-empty, in program order (ties go to the earliest)."""
    if not candidates:
        raise ValueError("best_fit needs at least one candidate")
    return min(candidates, key=lambda w: abs(remaining - graph[w].cost_ms))


def schedule_wgrad(graph: Graph) -> WgradSchedule:
    """Assign dW instructions to all-to-alls by Lancet's Algorithm 1 (closest-fit greedy, program order)."""
    used: set[str] = set()
    sched = WgradSchedule()
    for a in graph.of_kind("a2a"):
        remaining = a.cost_ms
        pool = [w for w in eligible_dw(graph, a.name) if w not in used]
        chosen: list[str] = []
        while remaining > 0 and pool:
            w = best_fit(graph, pool, remaining)
            pool.remove(w)
            used.add(w)
            chosen.append(w)
            remaining -= graph[w].cost_ms
        sched.assignment[a.name] = chosen
    sched.leftover = [i.name for i in graph.of_kind("dW") if i.name not in used]
    return sched


def exposed_comm_ms(graph: Graph, assignment: Mapping[str, Sequence[str]]) -> float:
    """Communication time no dW hides: sum over all-to-alls of max(0, cost - assigned dW cost).

    All-to-alls missing from `assignment` count as fully exposed. Raises
    ValueError if a key is not an all-to-all, a value is not a dW, or a dW is
    assigned twice.
    """
    seen: set[str] = set()
    for a, ws in assignment.items():
        if graph[a].kind != "a2a":
            raise ValueError(f"assignment key {a!r} is not an all-to-all")
        for w in ws:
            if graph[w].kind != "dW":
                raise ValueError(f"{w!r} assigned to {a!r} is not a dW instruction")
            if w in seen:
                raise ValueError(f"dW {w!r} assigned to more than one all-to-all")
            seen.add(w)
    total = 0.0
    for a2a in graph.of_kind("a2a"):
        hidden = sum(graph[w].cost_ms for w in assignment.get(a2a.name, ()))
        total += max(0.0, a2a.cost_ms - hidden)
    return total


# ---------------------------------------------------------------------------
# IR of a GPT-2 + MoE backward pass
# ---------------------------------------------------------------------------

ATTN_BACKWARD_KEYS = ("attn.proj.dX", "attn.proj.dW", "attn.core.dX", "attn.qkv.dX", "attn.qkv.dW", "ln1.dX", "ln1.dW")
DENSE_MLP_BACKWARD_KEYS = ("mlp.fc2.dX", "mlp.fc2.dW", "mlp.fc1.dX", "mlp.fc1.dW", "ln2.dX", "ln2.dW")
MOE_BACKWARD_KEYS = (
    "moe.combine.dX",
    "moe.a2a_combine",
    "moe.expert.fc2.dX",
    "moe.expert.fc2.dW",
    "moe.expert.fc1.dX",
    "moe.expert.fc1.dW",
    "moe.a2a_dispatch",
    "moe.dispatch.dX",
    "moe.gate.dX",
    "moe.gate.dW",
    "ln2.dX",
    "ln2.dW",
)
HEAD_BACKWARD_KEYS = ("head.dX", "head.dW", "embed.dW")  # each optional


def _kind(key: str) -> str:
    if ".a2a_" in key:
        return "a2a"
    return key.rsplit(".", 1)[1]  # "dX" or "dW"


def _layer_instrs(l: int, moe: bool, costs: Mapping[str, float]) -> list[Instr]:
    """Backward instructions of block l (pre-LN: h = x + attn(ln1 x); y = h + ffn(ln2 h)).

    Reads grad_x{l+1} (gradient of the block output) and writes grad_x{l}.
    Saved forward activations are pass inputs, so they are not named.
    """
    p = f"L{l}."
    go, gi = f"grad_x{l + 1}", f"grad_x{l}"
    if moe:
        # Index-based dispatch is not differentiable w.r.t. the gates: the gate's
        # gradient comes only from the combine weights, so it waits for no all-to-all.
        ffn = [
            ("moe.combine.dX", (go,), (p + "g_expert_out", p + "g_combine_w")),
            ("moe.a2a_combine", (p + "g_expert_out",), (p + "g_expert_out_local",)),
            ("moe.expert.fc2.dX", (p + "g_expert_out_local",), (p + "g_expert_h",)),
            ("moe.expert.fc2.dW", (p + "g_expert_out_local",), (p + "wgrad.expert.fc2",)),
            ("moe.expert.fc1.dX", (p + "g_expert_h",), (p + "g_expert_in_local",)),
            ("moe.expert.fc1.dW", (p + "g_expert_h",), (p + "wgrad.expert.fc1",)),
            ("moe.a2a_dispatch", (p + "g_expert_in_local",), (p + "g_expert_in",)),
            ("moe.dispatch.dX", (p + "g_expert_in",), (p + "g_ln2_dispatch",)),
            ("moe.gate.dX", (p + "g_combine_w",), (p + "g_ln2_gate",)),
            ("moe.gate.dW", (p + "g_combine_w",), (p + "wgrad.gate",)),
            ("ln2.dX", (p + "g_ln2_dispatch", p + "g_ln2_gate", go), (p + "g_h",)),
            ("ln2.dW", (p + "g_ln2_dispatch", p + "g_ln2_gate"), (p + "wgrad.ln2",)),
        ]
    else:
        ffn = [
            ("mlp.fc2.dX", (go,), (p + "g_mlp_h",)),
            ("mlp.fc2.dW", (go,), (p + "wgrad.mlp.fc2",)),
            ("mlp.fc1.dX", (p + "g_mlp_h",), (p + "g_ln2",)),
            ("mlp.fc1.dW", (p + "g_mlp_h",), (p + "wgrad.mlp.fc1",)),
            ("ln2.dX", (p + "g_ln2", go), (p + "g_h",)),
            ("ln2.dW", (p + "g_ln2",), (p + "wgrad.ln2",)),
        ]
    attn = [
        ("attn.proj.dX", (p + "g_h",), (p + "g_ctx",)),
        ("attn.proj.dW", (p + "g_h",), (p + "wgrad.attn.proj",)),
        ("attn.core.dX", (p + "g_ctx",), (p + "g_qkv",)),
        ("attn.qkv.dX", (p + "g_qkv",), (p + "g_ln1",)),
        ("attn.qkv.dW", (p + "g_qkv",), (p + "wgrad.attn.qkv",)),
        ("ln1.dX", (p + "g_ln1", p + "g_h"), (gi,)),
        ("ln1.dW", (p + "g_ln1",), (p + "wgrad.ln1",)),
    ]
    out = []
    for key, ins, outs in ffn + attn:
        if key not in costs:
            raise ValueError(f"layer {l}: missing cost for {key!r} (needs {_required(moe)})")
        out.append(Instr(p + key, _kind(key), ins, outs, float(costs[key])))
    return out


def _required(moe: bool) -> tuple[str, ...]:
    return (MOE_BACKWARD_KEYS if moe else DENSE_MLP_BACKWARD_KEYS) + ATTN_BACKWARD_KEYS


def build_gpt_moe_backward(
    num_layers: int,
    moe_layers: Collection[int],
    layer_costs: Mapping[str, float] | Sequence[Mapping[str, float]],
    head_costs: Mapping[str, float] | None = None,
) -> Graph:
    """IR of the backward pass of a GPT-2 (+MoE) model, layers in reverse order.

    num_layers: transformer blocks; moe_layers: indices (0-based) of MoE blocks.
    layer_costs: ms per op key, one mapping for all layers or one per layer;
        a dense block needs DENSE_MLP_BACKWARD_KEYS + ATTN_BACKWARD_KEYS, an
        MoE block MOE_BACKWARD_KEYS + ATTN_BACKWARD_KEYS ("moe.a2a_*" are the
        all-to-alls, "*.dW" weight gradients, "*.dX" activation gradients).
    head_costs: optional "head.dX" / "head.dW" (LM head + final LN, first in
        backward) and "embed.dW" (last); each is added only if present.
    Instruction names are "L{l}.{key}", or the key itself for head/embed.
    """
    if num_layers < 1:
        raise ValueError(f"num_layers must be >= 1, got {num_layers}")
    bad = [l for l in moe_layers if not 0 <= l < num_layers]
    if bad:
        raise ValueError(f"moe_layers {bad} outside 0..{num_layers - 1}")
    if isinstance(layer_costs, Mapping):
        per_layer: Sequence[Mapping[str, float]] = [layer_costs] * num_layers
    else:
        per_layer = list(layer_costs)
        if len(per_layer) != num_layers:
            raise ValueError(f"layer_costs has {len(per_layer)} entries for {num_layers} layers")
    head = dict(head_costs or {})
    unknown = set(head) - set(HEAD_BACKWARD_KEYS)
    if unknown:
        raise ValueError(f"unknown head_costs keys {sorted(unknown)}; allowed {HEAD_BACKWARD_KEYS}")
    instrs: list[Instr] = []
    if "head.dX" in head:
        instrs.append(Instr("head.dX", "dX", ("grad_logits",), (f"grad_x{num_layers}",), head["head.dX"]))
    if "head.dW" in head:
        instrs.append(Instr("head.dW", "dW", ("grad_logits",), ("wgrad.head",), head["head.dW"]))
    for l in reversed(range(num_layers)):
        instrs += _layer_instrs(l, l in set(moe_layers), per_layer[l])
    if "embed.dW" in head:
        instrs.append(Instr("embed.dW", "dW", ("grad_x0",), ("wgrad.embed",), head["embed.dW"]))
    return Graph(instrs)
