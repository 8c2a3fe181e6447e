"""Random routing: draws depend on (seed, layer, call, routing group) -- they differ across
routing groups and across calls, and repeat exactly for the same seed, group and call."""

import torch

from equivalence import tiny_config
from megatron_moe.model.gpt2 import GPT2MoE
from megatron_moe.parallel_state import destroy_model_parallel, initialize_model_parallel, local_state
from megatron_moe.testing import spawn


def _layer(routing_groups: int, seed: int = 7):
    cfg = tiny_config(k=2, policy="random", cf=4.0)  # no drops: every choice is visible
    cfg.train.seed = seed
    return GPT2MoE(cfg, local_state(), routing_groups=routing_groups).moe_layers()[0]


def _experts(layer, x_GSM: torch.Tensor) -> list[torch.Tensor]:
    """The experts chosen for each routing group of x_GSM (one route call per group)."""
    return [layer.router.route(x_GSM[g], g).expert for g in range(x_GSM.size(0))]


def _same_tokens(groups: int) -> torch.Tensor:
    x = torch.randn(1, 64, 32, generator=torch.Generator().manual_seed(3))
    return x.expand(groups, 64, 32).contiguous()


def test_identical_tokens_in_two_routing_groups_draw_different_experts():
    layer = _layer(routing_groups=2)
    e0, e1 = _experts(layer, _same_tokens(2))
    assert not torch.equal(e0, e1), "two routing groups drew the same experts"
    # every draw is k distinct experts per token
    assert all((e[:, 0] != e[:, 1]).all() for e in (e0, e1))


def test_draws_differ_across_calls_and_repeat_for_the_same_seed_group_call():
    a, b = _layer(routing_groups=1), _layer(routing_groups=1)
    x = _same_tokens(1)
    first = _experts(a, x)[0]
    assert torch.equal(first, _experts(b, x)[0])  # same seed, group and call: same draw
    other_seed = _experts(_layer(routing_groups=1, seed=8), x)[0]
    assert not torch.equal(first, other_seed), "the run seed does not change the draw"
    with torch.no_grad():
        a(x.view(2, 32, 32))  # one forward: the layer's next call
        b(x.view(2, 32, 32))
    second = _experts(a, x)[0]
    assert not torch.equal(first, second), "the next call drew the same experts"
    assert torch.equal(second, _experts(b, x)[0])  # reproducible on the next call too


def _dp_draws(rank, world):
    """MP1 x EP1, DP2: both data-parallel ranks route the same tokens."""
    ps = initialize_model_parallel(1, 1, 1)
    try:
        cfg = tiny_config(k=2, policy="random", cf=4.0)
        layer = GPT2MoE(cfg, ps).moe_layers()[0]
        return ps.rank("dp"), _experts(layer, _same_tokens(1))[0]
    finally:
        destroy_model_parallel()


def test_data_parallel_ranks_with_the_same_tokens_draw_different_experts():
    """A DP rank is its own routing group: its draws differ from the other DP rank's, and equal
    the one-process reference's draws for that group (routing_groups = DP)."""
    (r0, e0), (r1, e1) = spawn(_dp_draws, 2)
    assert (r0, r1) == (0, 1)
    assert not torch.equal(e0, e1), "both data-parallel ranks drew the same experts"
    ref = _experts(_layer(routing_groups=2), _same_tokens(2))
    assert torch.equal(e0, ref[0]) and torch.equal(e1, ref[1])
