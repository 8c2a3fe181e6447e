"""Every parallel layout equals the one-process reference (loss, every gradient, drops).

fp32, top-1 and top-2 (and the other router policies on a subset), capacity
factor 0.5 so tokens are dropped. One spawn per world size runs all of its
layouts; the parent computes the references and compares. The layouts of
MULTI_STEP run several SGD steps (each step's loss, the weights, the last
step's grads); every copy of a replicated value must agree across ranks.
"""

import pytest
import torch

from equivalence import compare, compare_steps, reference, reference_steps, run_layout, tiny_config
from megatron_moe.layers.sharding import ShardSpec, assemble
from megatron_moe.testing import spawn

LAYOUTS = {
    2: [(2, 1, 1), (1, 2, 1), (1, 1, 2), (1, 1, 1)],  # MP2, EP2, ESP2, DP2
    4: [(2, 2, 1), (1, 2, 2), (2, 1, 2), (1, 4, 1), (2, 1, 1)],  # MP2xEP2, EP2xESP2, MP2+ESP2, EP4, MP2xDP2
    8: [(2, 1, 1), (1, 2, 1), (1, 1, 2)],
}
STEPS = 3
MULTI_STEP = {4: [(2, 1, 2), (1, 4, 1)], 8: LAYOUTS[8]}  # MP2+ESP2, EP4, all of P=8
CASES = [(1, "position"), (2, "position")]
EXTRA_POLICY_CASES = [(1, "batch_prioritized"), (2, "batch_prioritized"), (1, "random"), (2, "random")]


def _cases(world):
    out = []
    for layout in LAYOUTS[world]:
        for k, policy in CASES + (EXTRA_POLICY_CASES if world == 4 else []):
            out.append((layout, k, policy))
    return out


def _steps(world, layout):
    return STEPS if layout in MULTI_STEP.get(world, []) else 1


def _run_all(rank, world, cases, use_hooks):
    results = []
    for (mp, ep, esp), k, policy in cases:
        results.append(
            run_layout(tiny_config(k, policy), mp, ep, esp, use_hooks=use_hooks, steps=_steps(world, (mp, ep, esp)))
        )
    return results


@pytest.mark.parametrize("world", [2, 4, 8])
def test_every_layout_matches_one_process_reference(world):
    cases = _cases(world)
    per_rank = spawn(_run_all, world, cases, world == 4, timeout=600)
    refs = {}
    for i, ((mp, ep, esp), k, policy) in enumerate(cases):
        dp, steps = world // mp, _steps(world, (mp, ep, esp))
        key = (dp, k, policy, steps)
        if key not in refs:
            refs[key] = reference_steps(tiny_config(k, policy), dp, steps)
        assert refs[key]["drops"][0] > 0, "the config must drop tokens"
        compare_steps(
            [per_rank[r][i] for r in range(world)],
            refs[key],
            f"P={world} MP{mp} EP{ep} ESP{esp} top-{k} {policy} ({steps} steps)",
        )


def _pieces(values: list[float]) -> list[dict]:
    """Four ranks holding one replicated 2 x 2 tensor (one slice, four copies)."""
    return [{"w": ((), torch.full((2, 2), v))} for v in values]


def test_assemble_names_a_diverged_replica():
    full = assemble(_pieces([1.0, 1.0, 1.0, 1.0]), {"w": ShardSpec()})
    assert torch.equal(full["w"], torch.ones(2, 2))
    assemble(_pieces([1.0, 1.0, 1.0 + 5e-7, 1.0]), {"w": ShardSpec()})  # within 1e-6
    with pytest.raises(ValueError, match=r"^w: the copy of slice \{\} on rank 2 differs from rank 0's by 0.001"):
        assemble(_pieces([1.0, 1.0, 1.001, 1.0]), {"w": ShardSpec()})


def test_compare_names_a_diverged_data_parallel_or_model_parallel_replica():
    ref = reference(tiny_config(), 1)
    grads = {n: ((), g) for n, g in ref[1].items()}
    specs = {n: ShardSpec() for n in ref[1]}
    ok = [
        {"loss": ref[0], "dp_rank": 0, "rank": r, "drops": ref[2], "grads": grads, "specs": specs} for r in range(2)
    ]  # MP2: two ranks of one DP rank, all replicated
    compare(ok, ref, "MP2")
    bad_loss = [dict(ok[0]), dict(ok[1], loss=ref[0] + 1e-3)]
    with pytest.raises(AssertionError, match="MP2: loss .* on rank 1 differs"):
        compare(bad_loss, ref, "MP2")
    bad_drops = [dict(ok[0]), dict(ok[1], drops=[ref[2][0] + 1])]
    with pytest.raises(AssertionError, match="MP2: drops .* on rank 1 differs"):
        compare(bad_drops, ref, "MP2")
    name = next(iter(grads))
    diverged = dict(grads, **{name: ((), grads[name][1] + 1e-4)})
    with pytest.raises(ValueError, match=f"^{name}: the copy of slice .* on rank 1 differs"):
        compare([dict(ok[0]), dict(ok[1], grads=diverged)], ref, "MP2")
