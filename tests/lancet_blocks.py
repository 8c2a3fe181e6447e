"""Lancet's usual MoE-block range as an `AxisRange` (Lancet Sec. 5), written by hand: the tests' oracle
for the axis solver and for the op IR `lancet.model_ir` builds from a model."""

from megatron_moe.lancet.axes import AxisOp, AxisRange


def _attention(p: str, x: str, out: str, t: dict[str, tuple[str, ...]]) -> list[AxisOp]:
    """Pre-LN attention sub-block out = x + proj(attn(qkv(ln1(x)))) on [B,T,M] tensors."""
    t.update(
        {
            p + "ln1": ("B", "T", "M"),
            p + "qkv": ("B", "T", "Q"),
            p + "qkv_h": ("B", "H", "T", "D3"),
            p + "ctx_h": ("B", "H", "T", "D"),
            p + "ctx": ("B", "T", "M"),
            p + "attn": ("B", "T", "M"),
            out: ("B", "T", "M"),
        }
    )
    return [
        AxisOp(p + "ln1", "layernorm", (x,), (p + "ln1",), {"dim": "M"}),
        AxisOp(p + "qkv", "linear", (p + "ln1",), (p + "qkv",), {"contract": "M", "out_dim": "Q"}),
        AxisOp(p + "split_heads", "view", (p + "qkv",), (p + "qkv_h",), {"dim_map": {"B": "B", "T": "T"}}),
        AxisOp(p + "core", "attention", (p + "qkv_h",), (p + "ctx_h",)),
        AxisOp(p + "merge_heads", "view", (p + "ctx_h",), (p + "ctx",), {"dim_map": {"B": "B", "T": "T"}}),
        AxisOp(p + "proj", "linear", (p + "ctx",), (p + "attn",), {"contract": "M", "out_dim": "M"}),
        AxisOp(p + "residual", "elementwise", (x, p + "attn"), (out,)),
    ]


def standard_moe_block_ops(
    batch_prioritized: bool = False, start_at_gate: bool = False, next_block: bool = True
) -> AxisRange:
    """The usual Lancet range: attention -> layernorm -> gate -> dispatch -> a2a -> experts
    -> a2a -> combine (-> the next block's attention when next_block).

    Dims: B batch, T sequence, M model, Q = 3M, H heads, D head dim, S = B*T
    tokens, E experts, C capacity. start_at_gate drops the ops before the gate
    (the range then reads the token tensor "tok" [S, M]).
    """
    t: dict[str, tuple[str, ...]] = {"x": ("B", "T", "M")}
    ops = _attention("attn.", "x", "h", t)
    t.update(
        {
            "ln2": ("B", "T", "M"),
            "tok": ("S", "M"),
            "gates": ("S", "E"),
            "disp": ("E", "C", "M"),
            "disp_x": ("E", "C", "M"),
            "exp_out": ("E", "C", "M"),
            "exp_back": ("E", "C", "M"),
            "moe_tok": ("S", "M"),
            "moe_out": ("B", "T", "M"),
            "y": ("B", "T", "M"),
        }
    )
    ops += [
        AxisOp("ln2", "layernorm", ("h",), ("ln2",), {"dim": "M"}),
        AxisOp("flatten", "view", ("ln2",), ("tok",), {"dim_map": {"B": "S"}}),
    ]
    gate_at = len(ops)
    ops += [
        AxisOp("gate", "gate", ("tok",), ("gates",), {"batch_prioritized": batch_prioritized}),
        AxisOp("dispatch", "dispatch", ("tok", "gates"), ("disp",)),
        AxisOp("a2a_dispatch", "a2a", ("disp",), ("disp_x",)),
        AxisOp("experts", "experts", ("disp_x",), ("exp_out",)),
        AxisOp("a2a_combine", "a2a", ("exp_out",), ("exp_back",)),
        AxisOp("combine", "combine", ("exp_back", "gates"), ("moe_tok",)),
        AxisOp("unflatten", "view", ("moe_tok",), ("moe_out",), {"dim_map": {"S": "B"}}),
        AxisOp("residual2", "elementwise", ("h", "moe_out"), ("y",)),
    ]
    if next_block:
        ops += _attention("next.", "y", "next.h", t)
    if start_at_gate:
        ops = ops[gate_at:]
    used = {n for op in ops for n in op.inputs + op.outputs}
    return AxisRange({n: d for n, d in t.items() if n in used}, ops)
