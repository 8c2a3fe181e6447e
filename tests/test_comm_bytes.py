"""Comm tracer byte counts of the baseline schedule equal its formulas (docs/DESIGN.md, "Schedules"), and the
autograd collectives have the right backward."""

import math

import torch

from equivalence import MICRO_BATCH, run_layout, tiny_config
from megatron_moe.testing import spawn


def _baseline_records(rank, world, mp, ep, esp, k):
    res = run_layout(tiny_config(k), mp, ep, esp)
    return [(r.op, r.group, r.sent, r.recv) for r in res["records"]]


def test_baseline_bytes_match_formula():
    mp, ep, esp, k = 1, 2, 2, 2
    cfg = tiny_config(k)
    S = MICRO_BATCH * cfg.model.seq_length
    E, M = cfg.moe.num_experts, cfg.model.hidden_size
    C = max(math.ceil(k * cfg.moe.moe_expert_capacity_factor * S / E), cfg.moe.moe_min_capacity)
    buf = E * C * M * 4  # one rank's dispatch buffer, fp32 bytes
    per_rank = spawn(_baseline_records, 4, mp, ep, esp, k)
    moe_layers = sum(cfg.is_moe_layer(i) for i in range(cfg.model.num_layers))
    for recs in per_rank:

        def sent(op, group):
            return sorted(s for o, g, s, _ in recs if o == op and g == group)

        # forward: ESP all-gather of E*C*M; backward: its reduce-scatter of N_ESP*E*C*M
        assert sent("all_gather", "esp") == [buf] * moe_layers
        assert sent("reduce_scatter", "esp") == [esp * buf] * moe_layers
        # two EP all-to-alls of E*C*M*N_ESP per direction -> 4 per layer
        assert sent("all_to_all", "ep") == [esp * buf] * (4 * moe_layers)
        # ESP all-reduce of the partial outputs, forward and backward
        assert sent("all_reduce", "esp") == [esp * buf] * (2 * moe_layers)
        # and nothing else moves (MP1: no tensor-parallel collectives)
        assert {(o, g) for o, g, _, _ in recs} == {
            ("all_gather", "esp"),
            ("reduce_scatter", "esp"),
            ("all_to_all", "ep"),
            ("all_reduce", "esp"),
        }


def _collective_grads(rank, world):
    from megatron_moe.distributed import collectives as c
    from megatron_moe.distributed.observer import CommLog as CommTracer
    import torch.distributed as dist

    group = dist.group.WORLD
    out = {}
    x = torch.arange(6.0).reshape(3, 2).mul(rank + 1).requires_grad_()
    # uneven all-to-all: rank r sends r+1 rows to rank 1-r... world 2: in_splits per rank
    in_splits = [1, 2] if rank == 0 else [2, 1]
    out_splits = [1, 2] if rank == 0 else [2, 1]
    with CommTracer() as tr:
        y = c.all_to_all(x, group, out_splits, in_splits)
        (y * (torch.arange(y.numel()).reshape(y.shape) + 1)).sum().backward()
    out["a2a_y"], out["a2a_grad"] = y.detach(), x.grad.clone()
    out["a2a_remote"] = [r.remote_sent for r in tr.records]
    z = torch.ones(2, 2, requires_grad=True)
    g = c.all_gather(z * (rank + 1), group, dim=0)
    (g * torch.arange(1.0, 9.0).reshape(4, 2)).sum().backward()
    out["ag_grad"] = z.grad.clone()
    w = torch.ones(4, 1, requires_grad=True)
    rs = c.reduce_scatter(w * (rank + 1), group, dim=0)
    (rs * (rank + 1)).sum().backward()
    out["rs"], out["rs_grad"] = rs.detach(), w.grad.clone()
    return out


def test_autograd_collectives_forward_and_backward():
    r0, r1 = spawn(_collective_grads, 2)
    x0 = torch.arange(6.0).reshape(3, 2)
    x1 = x0 * 2
    # rank 0 receives its own row 0 and rank 1's rows 0..1; rank 1 gets rank 0's rows 1..2 and its row 2
    assert torch.equal(r0["a2a_y"], torch.cat([x0[:1], x1[:2]]))
    assert torch.equal(r1["a2a_y"], torch.cat([x0[1:], x1[2:]]))
    w = torch.arange(1.0, 7.0).reshape(3, 2)  # d(sum(y * w))/dy = w on each rank
    assert torch.equal(r0["a2a_grad"], torch.cat([w[:1], w[:2]]))
    assert torch.equal(r1["a2a_grad"], torch.cat([w[1:], w[2:]]))
    assert r0["a2a_remote"][0] == 2 * 2 * 4 and r1["a2a_remote"][0] == 2 * 2 * 4
    # all-gather backward sums every rank's gradient of its chunk: rank r's chunk rows 2r..2r+1
    wg = torch.arange(1.0, 9.0).reshape(4, 2)
    assert torch.equal(r0["ag_grad"], 2 * wg[:2] * 1)
    assert torch.equal(r1["ag_grad"], 2 * wg[2:] * 2)
    # reduce-scatter: sum of (rank+1) -> 3, split; backward all-gathers (rank+1) -> [1,1,2,2]
    assert torch.equal(r0["rs"], torch.full((2, 1), 3.0))
    assert torch.equal(r0["rs_grad"], torch.tensor([[1.0], [1.0], [2.0], [2.0]]) * 1)
    assert torch.equal(r1["rs_grad"], torch.tensor([[1.0], [1.0], [2.0], [2.0]]) * 2)
