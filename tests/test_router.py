"""Router semantics (docs/DESIGN.md): hand-checked examples, drops, and dispatch/combine identity."""

import math

import torch

from megatron_moe.moe.dispatcher import combine, dispatch, dispatch_index
from megatron_moe.moe.router import capacity, route


def logits_for(expert_rows, E, strength=4.0):
    """Logits whose argmax per token is given; second best is (argmax + 1) % E."""
    out = torch.zeros(len(expert_rows), E)
    for s, e in enumerate(expert_rows):
        out[s, e] = strength
        out[s, (e + 1) % E] = strength / 2
    return out


def test_capacity_formula():
    assert capacity(16, 4, 1, 1.0, 1) == 4
    assert capacity(16, 4, 2, 1.0, 1) == 8
    assert capacity(10, 4, 1, 1.0, 1) == 3  # ceil(2.5)
    assert capacity(10, 4, 1, 0.1, 4) == 4  # min capacity wins


def test_top1_keeps_first_tokens_in_token_order():
    # tokens 0..5 all prefer expert 0; S=6, E=3, cf=1 -> C=2: tokens 0 and 1 kept
    logits = logits_for([0, 0, 0, 0, 1, 2], 3)
    r = route(logits, 1, 1.0, 1)
    assert r.capacity == 2
    assert r.expert[:, 0].tolist() == [0, 0, 0, 0, 1, 2]
    assert r.slot[:, 0].tolist() == [0, 1, -1, -1, 0, 0]
    gates = torch.softmax(logits, -1)
    expect_w = [gates[s, e].item() if s not in (2, 3) else 0.0 for s, e in enumerate([0, 0, 0, 0, 1, 2])]
    assert torch.allclose(r.weight[:, 0], torch.tensor(expect_w))
    assert r.counts.tolist() == [2, 1, 1]
    # aux = E * sum_e mean(gates[:, e]) * frac(argmax == e)
    frac = torch.tensor([4, 1, 1]) / 6
    assert math.isclose(r.aux_loss.item(), 3 * (gates.mean(0) * frac).sum().item(), rel_tol=1e-6)


def test_top2_second_choice_slots_follow_all_first_choices():
    # E=2, S=3: first choices 0,0,1 ; second choices 1,1,0. C = ceil(2*1*3/2) = 3
    logits = torch.tensor([[2.0, 1.0], [3.0, 0.0], [0.0, 1.0]])
    r = route(logits, 2, 1.0, 1)
    assert r.capacity == 3
    assert r.expert.tolist() == [[0, 1], [0, 1], [1, 0]]
    # expert 0: first choices tokens 0,1 -> slots 0,1 ; second choice token 2 -> 0 + 2 first choices = 2
    # expert 1: first choice token 2 -> 0 ; second choices tokens 0,1 -> 0+1, 1+1
    assert r.slot.tolist() == [[0, 1], [1, 2], [0, 2]]
    assert torch.allclose(r.weight.sum(1), torch.ones(3))  # nothing dropped: weights sum to 1
    g = torch.softmax(logits, -1)
    me, ce = g.mean(0), torch.tensor([2 / 3, 1 / 3])
    assert math.isclose(r.aux_loss.item(), (2 * 2 * (me * ce).mean()).item(), rel_tol=1e-6)


def test_top2_drop_renormalizes_the_kept_choice():
    # E=2, S=4 all prefer expert 0 then 1; cf=0.5 -> C = ceil(2*0.5*4/2) = 2
    logits = torch.tensor([[2.0, 1.0]] * 4)
    r = route(logits, 2, 0.5, 1)
    assert r.capacity == 2
    # expert 0 first choices: slots 0,1,2,3 -> tokens 2,3 dropped there
    # expert 1 second choices: slot = pos + 0 first choices of expert 1 -> 0,1,2,3 -> tokens 2,3 dropped
    assert r.slot.tolist() == [[0, 0], [1, 1], [-1, -1], [-1, -1]]
    assert torch.allclose(r.weight[:2].sum(1), torch.ones(2))
    assert r.weight[2:].abs().sum().item() == 0.0
    assert r.num_dropped == 4


def test_top2_one_choice_dropped_gets_weight_one():
    # expert 0 preferred by 3 tokens first; token 2 prefers expert 1 first. C=ceil(2*0.5*3/2)=2
    logits = torch.tensor([[2.0, 1.0], [2.0, 1.0], [0.0, 2.0]])
    r = route(logits, 2, 0.5, 1)
    # expert 1: first choice token 2 -> 0; second choices tokens 0,1 -> 1, 2 (dropped)
    # expert 0: first tokens 0,1 -> 0,1 ; second token 2 -> 0 + 2 = 2 (dropped)
    assert r.slot.tolist() == [[0, 1], [1, -1], [0, -1]]
    assert r.weight[1].tolist() == [1.0, 0.0] and r.weight[2].tolist() == [1.0, 0.0]


def test_batch_prioritized_keeps_the_most_confident_tokens():
    # four tokens prefer expert 0 with increasing confidence; C=2 keeps tokens 3 and 2
    logits = torch.tensor([[1.0, 0.0], [2.0, 0.0], [3.0, 0.0], [4.0, 0.0]])
    r = route(logits, 1, 1.0, 1, policy="batch_prioritized")
    assert r.capacity == 2
    assert r.slot[:, 0].tolist() == [-1, -1, 1, 0]
    pos = route(logits, 1, 1.0, 1, policy="position")
    assert pos.slot[:, 0].tolist() == [0, 1, -1, -1]


def test_random_routing_is_seeded_and_uniform():
    logits = torch.zeros(4000, 4)
    g1, g2 = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    a = route(logits, 2, 10.0, 1, policy="random", generator=g1)
    b = route(logits, 2, 10.0, 1, policy="random", generator=g2)
    assert torch.equal(a.expert, b.expert)
    assert (a.expert[:, 0] != a.expert[:, 1]).all()
    freq = torch.bincount(a.expert[:, 0], minlength=4).float() / 4000
    assert (freq - 0.25).abs().max() < 0.03


def test_z_loss_value():
    logits = torch.tensor([[1.0, 2.0], [0.0, 0.0]])
    r = route(logits, 1, 1.0, 1, z_loss_coeff=0.5)
    expect = 0.5 * torch.logsumexp(logits, -1).pow(2).mean()
    assert math.isclose(r.z_loss.item(), expect.item(), rel_tol=1e-6)


def test_dispatch_then_combine_is_identity_times_weights_without_drops():
    torch.manual_seed(0)
    S, E, M = 32, 4, 8
    x = torch.randn(S, M)
    for k in (1, 2):
        r = route(torch.randn(S, E), k, 4.0, 1)
        assert r.num_dropped == 0
        for every_choice in (False, True):  # the padded plan's index lists every choice
            idx = dispatch_index(r, every_choice=every_choice)
            buf = dispatch(x, idx, E * r.capacity)
            y = combine(buf, idx, S)
            assert torch.allclose(y, x * r.weight.sum(1, keepdim=True), atol=1e-6)
            if k == 2:
                assert torch.allclose(y, x, atol=1e-6)  # renormalized weights sum to 1


def test_dispatch_places_tokens_at_expert_slot_rows_and_drops_zero():
    logits = logits_for([0, 0, 0, 1], 2)
    r = route(logits, 1, 0.5, 1)  # C = ceil(0.5*4/2) = 1
    x = torch.arange(4.0)[:, None].repeat(1, 3)
    buf = dispatch(x, dispatch_index(r), 2 * r.capacity).view(2, 1, 3)
    assert buf[0, 0].tolist() == [0.0] * 3 and buf[1, 0].tolist() == [3.0] * 3
    y = combine(buf.view(2, 3), dispatch_index(r), 4)
    assert y[1].abs().sum() == 0 and y[2].abs().sum() == 0  # dropped tokens get zero output


def _mask_cumsum_reference(logits, k, cf, min_cap):
    """Independent dense formulation of GShard/DeepSpeed gating (masks and cumsum), for testing."""
    gates = torch.softmax(logits, -1)
    S, E = gates.shape
    C = max(math.ceil(k * cf * S / E), min_cap)
    idx1 = gates.argmax(-1)
    mask1 = torch.nn.functional.one_hot(idx1, E)
    loc1 = torch.cumsum(mask1, 0) - 1
    me, ce = gates.mean(0), mask1.float().mean(0)
    if k == 1:
        aux = (me * ce).sum() * E
        keep1 = mask1 * (loc1 < C)
        slot = (loc1 * keep1).sum(1) - (1 - keep1.sum(1))
        w = (gates * keep1).sum(1)
        return slot[:, None], w[:, None], aux
    idx2 = logits.masked_fill(mask1.bool(), float("-inf")).argmax(-1)
    mask2 = torch.nn.functional.one_hot(idx2, E)
    loc2 = torch.cumsum(mask2, 0) - 1 + mask1.sum(0, keepdim=True)
    aux = (me * ce).mean() * E * E
    keep1, keep2 = mask1 * (loc1 < C), mask2 * (loc2 < C)
    s1 = torch.where(keep1.sum(1) > 0, (loc1 * keep1).sum(1), -1)
    s2 = torch.where(keep2.sum(1) > 0, (loc2 * keep2).sum(1), -1)
    g1, g2 = (gates * keep1).sum(1), (gates * keep2).sum(1)
    den = (g1 + g2).clamp(min=torch.finfo(gates.dtype).eps)
    return torch.stack([s1, s2], 1), torch.stack([g1 / den, g2 / den], 1), aux


def test_router_equals_dense_mask_formulation_on_random_logits():
    torch.manual_seed(1)
    for trial in range(20):
        S, E = 64, [2, 4, 8][trial % 3]
        logits = torch.randn(S, E) * 2
        for k in (1, 2):
            for cf in (0.25, 0.5, 1.0, 2.0):
                r = route(logits, k, cf, 2)
                slot, w, aux = _mask_cumsum_reference(logits, k, cf, 2)
                assert torch.equal(r.slot, slot), (trial, k, cf)
                assert torch.allclose(r.weight, w, atol=1e-7)
                assert math.isclose(r.aux_loss.item(), aux.item(), rel_tol=1e-6)


def test_routes_kept_past_the_forward_hold_no_graph():
    """The router keeps its last routes for statistics and placement; detached, so they hold neither
    the step's activations nor the gradient accumulators of earlier layers' parameters (whose shapes
    Lina's expert packing changes between steps)."""
    from equivalence import global_batch, tiny_config
    from megatron_moe.model.gpt2 import GPT2MoE
    from megatron_moe.parallel_state import local_state

    cfg = tiny_config(k=2, num_experts=4)
    cfg.moe.moe_layer_freq = 1  # two MoE blocks: the second router's input depends on the first's experts
    model = GPT2MoE(cfg, local_state())
    ids, labels = global_batch(1)
    lm, aux = model(ids, labels)
    (lm + aux).backward()
    routes = [r for layer in model.moe_layers() for r in layer.router.last_routes]
    assert len(model.moe_layers()) == 2 and routes
    for r in routes:
        assert all(t.grad_fn is None and not t.requires_grad for t in (r.weight, r.aux_loss, r.z_loss, r.gates))
