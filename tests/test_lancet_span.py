"""Lancet ranges spanning everything between two MoE layers (the dense FFN included), and the
runtime's split axes against CP-SAT's solution (read back from the --lancet-report file)."""

import json

import pytest
import torch
from lancet_blocks import standard_moe_block_ops

from megatron_moe.lancet.axes import solve_axes
from megatron_moe.lancet.controller import setup
from megatron_moe.lancet.model_ir import build_model_ops, feasibility, range_axes, runtime_range, zero_costs
from megatron_moe.lancet.partitioned_moe import PartitionedRange, RangeAxes, RangeSpec
from megatron_moe.lancet.planner import LancetPlan
from megatron_moe.model.gpt2 import GPT2MoE
from megatron_moe.parallel_state import local_state
from test_lancet_runtime import config


def _run(cfg, plan, report=None):
    """Forward + backward of one micro-batch of 3; loss, hidden states, grads, drops, slots, report."""
    model = GPT2MoE(cfg, local_state())
    hidden = []
    model.ln_f.register_forward_hook(lambda m, a, o: hidden.append(o.detach().clone()))
    ids = torch.randint(0, 100, (3, 9), generator=torch.Generator().manual_seed(4))
    ctl = setup(model, local_state(), cfg.opts, plan=plan) if plan is not None else None
    lm, aux = model(ids[:, :-1], ids[:, 1:])
    (ctl.backward if ctl is not None else torch.Tensor.backward)(lm + aux)
    rep = ctl.write_report(report) if report is not None else None
    slots = {l: torch.cat([r.slot for r in b.moe.router.last_routes]) for l, b in enumerate(model.blocks) if b.is_moe}
    drops = {l: b.moe.last_stats["dropped"] for l, b in enumerate(model.blocks) if b.is_moe}
    return {
        "loss": (lm + aux).item(),
        "hidden": torch.cat(hidden),  # a range through the loss head runs ln_f part by part
        "drops": drops,
        "slots": slots,
        "report": rep,
        "grads": {n: p.grad.clone() for n, p in model.named_parameters()},
        "runners": dict(model.runners),
        "loss_runner": model.loss_runner,
    }


def _assert_equal(ref, out):
    assert sum(ref["drops"].values()) > 0 and ref["drops"] == out["drops"]
    assert all(torch.equal(ref["slots"][l], out["slots"][l]) for l in ref["slots"])
    assert abs(ref["loss"] - out["loss"]) < 1e-6
    assert (ref["hidden"] - out["hidden"]).abs().max().item() < 1e-6
    assert max((ref["grads"][n] - g).abs().max().item() for n, g in out["grads"].items()) < 1e-6


@pytest.mark.parametrize(
    "k,policy,ranges",
    [
        (1, "position", [RangeSpec(1, "attn", "dense_next_attn", 2), RangeSpec(3, "ln2", "block", 3)]),
        (1, "position", [RangeSpec(1, "ln2", "dense", 3), RangeSpec(3, "attn", "block", 2)]),
        (2, "position", [RangeSpec(1, "gate", "dense_next_attn", 3), RangeSpec(3, "gate", "block", 2)]),
        (1, "position", [RangeSpec(1, "attn", "dense_next_attn", 2), RangeSpec(3, "ln2", "head", 3)]),
        (2, "position", [RangeSpec(1, "gate", "dense", 3), RangeSpec(3, "gate", "head", 2)]),
        (1, "position", [RangeSpec(1, "dense", "dense_next_attn", 2), RangeSpec(3, "ln2", "head", 3)]),
    ],
)
def test_range_with_the_dense_ffn_equals_the_plain_run(k, policy, ranges):
    cfg = config(k, policy)
    ref = _run(cfg, None)
    out = _run(cfg, LancetPlan.manual(ranges))
    _assert_equal(ref, out)
    dense_ranged = ranges[0].end.startswith("dense")
    assert dense_ranged and 2 in out["runners"] and not isinstance(out["runners"][2], PartitionedRange)


def test_range_through_dense_blocks_and_the_loss_head_equals_the_plain_run():
    cfg = config(1, "position")
    cfg.model.num_layers = 5  # MoE blocks 1 and 3, dense block 4 after the last one
    ref = _run(cfg, None)
    out = _run(cfg, LancetPlan.manual([RangeSpec(1, "attn", "block", 2), RangeSpec(3, "attn", "head", 3)]))
    _assert_equal(ref, out)
    assert out["loss_runner"] is not None and out["loss_runner"][0] == 3
    assert 4 in out["runners"] and not isinstance(out["runners"][4], PartitionedRange)  # the range ran block 4


def test_dense_start_runs_the_blocks_before_and_sits_on_the_first():
    cfg = config(1, "position")
    ref = _run(cfg, None)
    out = _run(cfg, LancetPlan.manual([RangeSpec(1, "dense", "block", 2), RangeSpec(3, "dense", "head", 3)]))
    _assert_equal(ref, out)
    assert isinstance(out["runners"][0], PartitionedRange) and not isinstance(out["runners"][1], PartitionedRange)
    assert isinstance(out["runners"][2], PartitionedRange) and out["loss_runner"][0] == 2  # block 3's range from 2
    model = GPT2MoE(cfg, local_state())
    with pytest.raises(ValueError, match="runs block 2, which another range already runs"):
        setup(
            model,
            local_state(),
            cfg.opts,
            plan=LancetPlan.manual([RangeSpec(1, "attn", "dense", 2), RangeSpec(3, "dense", "block", 2)]),
        )
    cfg.model.num_layers, cfg.moe.moe_layer_freq = 4, 1  # every block an MoE block: nothing precedes block 1
    with pytest.raises(ValueError, match="no dense block precedes MoE block 1"):
        setup(
            GPT2MoE(cfg, local_state()),
            local_state(),
            cfg.opts,
            plan=LancetPlan.manual([RangeSpec(1, "dense", "block", 2)]),
        )


def test_loss_head_range_without_labels_and_removed():
    cfg = config(1, "position")
    cfg.model.num_layers = 5
    model = GPT2MoE(cfg, local_state())
    ids = torch.randint(0, 100, (3, 8), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        ref = model(ids)
        ctl = setup(model, local_state(), cfg.opts, plan=LancetPlan.manual([RangeSpec(3, "ln2", "head", 3)]))
        got = model(ids)  # no labels: the range ends like "dense" and the head runs whole
        assert model.loss_runner is not None
        ctl.remove()
        assert model.loss_runner is None and not model.runners
        again = model(ids)
    assert (ref - got).abs().max().item() < 1e-5
    assert torch.equal(ref, again)
    with pytest.raises(ValueError, match="ends at the loss head, but an MoE block follows block 1"):
        setup(model, local_state(), cfg.opts, plan=LancetPlan.manual([RangeSpec(1, "ln2", "head", 2)]))


def test_six_blocks_two_dense_between_moe_blocks():
    cfg = config(1, "position")
    cfg.model.num_layers, cfg.moe.moe_layer_freq = 6, 3  # MoE blocks 2 and 5, dense 3 and 4 between
    ref = _run(cfg, None)
    out = _run(cfg, LancetPlan.manual([RangeSpec(2, "attn", "dense_next_attn", 2), RangeSpec(5, "ln2", "block", 2)]))
    _assert_equal(ref, out)
    assert sorted(out["runners"]) == [2, 3, 4, 5]


def test_model_ir_offers_the_whole_span_between_moe_layers():
    model = GPT2MoE(config(1, "position"), local_state())
    mo = build_model_ops(model, zero_costs(model), None)
    n = [op.name for op in mo.sim]
    lo = n.index("L1.ln1")
    assert runtime_range(mo, lo, n.index("L2.mlp.fc2") + 1) == (1, "attn", "dense")
    assert runtime_range(mo, lo, n.index("L3.attn.proj") + 1) == (1, "attn", "dense_next_attn")
    assert runtime_range(mo, lo, n.index("L2.mlp.fc1") + 1) is None  # ends inside the dense FFN
    assert runtime_range(mo, n.index("L3.ln2"), n.index("L3.moe.combine") + 1) == (3, "ln2", "block")
    assert runtime_range(mo, n.index("L3.ln1"), len(n)) == (3, "attn", "head")  # on through the loss head
    assert runtime_range(mo, n.index("L0.ln1"), n.index("L1.moe.combine") + 1) == (1, "dense", "block")
    assert runtime_range(mo, n.index("L2.ln1"), len(n)) == (3, "dense", "head")  # dense block 2, MoE block 3, head
    assert mo.starts[1][n.index("L0.ln1")] == "dense" and 0 not in mo.starts
    assert runtime_range(mo, lo, len(n)) is None  # the head's range is the last MoE block's
    assert feasibility(mo)(lo, n.index("L3.attn.proj") + 1)
    bp = GPT2MoE(config(1, "batch_prioritized"), local_state())
    mo_bp = build_model_ops(bp, zero_costs(bp), None)
    assert not feasibility(mo_bp)(lo, n.index("L3.attn.proj") + 1)  # the gate must see the batch
    assert feasibility(mo_bp)(n.index("L1.moe.gate"), n.index("L3.attn.proj") + 1)


# sim op of the model -> first input tensor of the same op in lancet_blocks.standard_moe_block_ops(next_block=True)
STANDARD = {
    "ln1": "x",
    "attn.qkv": "attn.ln1",
    "attn.core": "attn.qkv_h",
    "attn.proj": "attn.ctx",
    "ln2": "h",
    "moe.gate": "tok",
    "moe.dispatch": "tok",
    "moe.a2a_dispatch": "disp",
    "moe.experts": "disp_x",
    "moe.a2a_combine": "exp_out",
    "moe.combine": "exp_back",
}
NEXT = {"ln1": "y", "attn.qkv": "next.ln1", "attn.core": "next.qkv_h", "attn.proj": "next.ctx"}


def test_runtime_split_axes_equal_the_cp_sat_solution_in_the_report(tmp_path):
    cfg = config(1, "position")
    path = tmp_path / "report.json"
    _run(cfg, LancetPlan.manual([RangeSpec(1, "attn", "next_attn", 2), RangeSpec(3, "ln2", "block", 3)]), str(path))
    rep = json.loads(path.read_text())
    solved = solve_axes(standard_moe_block_ops(next_block=True))  # independent: the paper's block
    want = {f"L1.{op}": solved[t] for op, t in STANDARD.items()} | {f"L2.{op}": solved[t] for op, t in NEXT.items()}
    got = {op: a["runtime"] for op, a in rep["ranges"][0]["axes"].items()}
    assert got == want
    assert set(want.values()) == {"B", "S", "C"}
    assert all(a["runtime"] == a["solved"] for r in rep["ranges"] for a in r["axes"].values())
    assert sorted(rep["ranges"][1]["axes"]) == sorted(f"L3.{op}" for op in list(STANDARD)[4:])


def test_runtime_follows_the_solution_and_refuses_what_it_cannot_split():
    cfg = config(1, "position")
    model = GPT2MoE(cfg, local_state())
    spec = RangeSpec(1, "attn", "block", 2)
    ax = range_axes(model, spec)
    assert ax.x == ("x1", ("B", "T", "M"), "B") and ax.split_dim() == 0
    along_t = RangeAxes(("x1", ("B", "T", "M"), "T"), ax.ops)
    runner = PartitionedRange(model.blocks[1], spec, False, model.blocks[1].moe.dispatcher, axes=along_t)
    x = torch.randn(3, 8, 32, device=model.wte.weight.device)
    with pytest.raises(
        ValueError,
        match="split the residual stream along 'T'; a range with an MoE layer must split it along the batch 'B'",
    ):
        runner(x)
    wrong = dict(ax.ops, **{"L1.moe.experts": ("L1.disp_x", ("E", "C", "M"), "M")})
    runner = PartitionedRange(model.blocks[1], spec, False, model.blocks[1].moe.dispatcher, axes=RangeAxes(ax.x, wrong))
    with pytest.raises(
        ValueError, match="CP-SAT partitions L1.moe.experts along 'M', the runtime can only split it along 'C'"
    ):
        runner(x)
