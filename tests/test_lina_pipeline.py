"""Lina's all-to-all micro-ops pipelined with the expert FFN (`moe.pipelined`, --lina-pipeline-chunks).

One 4-process spawn builds, per case, the same MoE layer twice (same seed): unsplit and in
CHUNKS pipelined micro-ops, runs one forward and backward on the same tokens and compares
outputs, aux loss, input and parameter gradients (1e-5), the router's kept / dropped counts,
and the all-to-all bytes from the collective observer. Cases: baseline (EP4; MP2 x EP2;
EP2 x ESP2), S1 (EP4, MP2 x EP2), S2 (MP2 x EP2, EP2 x ESP2), each top-1 and top-2 with a
capacity factor low enough that tokens drop. The refused combinations are checked without
a process group.
"""

import pytest
import torch

from equivalence import MICRO_BATCH, tiny_config
from megatron_moe.arguments import parse_args
from megatron_moe.distributed.observer import CommLog
from megatron_moe.moe.layer import MoELayer
from megatron_moe.moe.pipelined import DROPLESS_ERROR, DW_ERROR, chunk_bounds, pipelined_moe
from megatron_moe.parallel_state import destroy_model_parallel, initialize_model_parallel, local_state
from megatron_moe.testing import spawn

CHUNKS = 3
LAYOUTS = {(1, 4, 1): ("baseline", "s1"), (2, 2, 1): ("baseline", "s1", "s2"), (1, 2, 2): ("baseline", "s2")}


def run_layer(cfg, ps, chunks: int) -> dict:
    """One forward + backward of a fresh MoE layer on this data-parallel rank's tokens."""
    layer = MoELayer(cfg, ps, seed=11, name="moe", layer_idx=1)
    layer.set_pipeline_chunks(chunks)
    g = torch.Generator().manual_seed(100 + ps.rank("dp"))
    x = torch.randn(MICRO_BATCH, cfg.model.seq_length, cfg.model.hidden_size, generator=g).requires_grad_(True)
    weight = torch.randn(x.shape, generator=g)
    log = CommLog().start()
    y, aux = layer(x)
    ((y * weight).sum() + aux).backward()
    log.stop()
    a2a_bytes = sum(v for (op, _), v in log.totals().items() if op == "all_to_all")
    return {
        "y": y.detach(),
        "aux": aux.item(),
        "x_grad": x.grad,
        "grads": {n: p.grad.clone() for n, p in layer.named_parameters() if p.grad is not None},
        "dropped": layer.last_stats["dropped"],
        "counts": layer.last_stats["counts"].tolist(),
        "a2a_bytes": a2a_bytes,
        "n_a2a": len(log.of("all_to_all")),
        "capacity": layer.router.last_routes[0].capacity,
    }


def _cases(rank, world):
    out = {}
    for (mp, ep, esp), schedules in LAYOUTS.items():
        ps = initialize_model_parallel(mp, ep, esp)
        try:
            for schedule in schedules:
                for k in (1, 2):
                    cfg = tiny_config(k=k, schedule=schedule, cf=0.5)
                    key = (mp, ep, esp, schedule, k)
                    out[key] = (run_layer(cfg, ps, 1), run_layer(cfg, ps, CHUNKS))
        finally:
            destroy_model_parallel()
    return out


@pytest.fixture(scope="module")
def ranks():
    return spawn(_cases, 4, timeout=300)


def test_pipelined_layer_equals_unsplit_outputs_gradients_and_drops(ranks):
    keys = list(ranks[0])
    assert len(keys) == 2 * 7
    for rank, r in enumerate(ranks):
        for key in keys:
            plain, piped = r[key]
            msg = f"rank {rank} case {key}"
            torch.testing.assert_close(piped["y"], plain["y"], rtol=1e-5, atol=1e-6, msg=msg)
            assert piped["aux"] == pytest.approx(plain["aux"], rel=1e-6), msg
            torch.testing.assert_close(piped["x_grad"], plain["x_grad"], rtol=1e-5, atol=1e-6, msg=msg)
            assert piped["grads"].keys() == plain["grads"].keys(), msg
            for name, g in plain["grads"].items():
                torch.testing.assert_close(piped["grads"][name], g, rtol=1e-5, atol=1e-6, msg=f"{msg} {name}")
            assert piped["dropped"] == plain["dropped"] and piped["counts"] == plain["counts"], msg
            assert piped["n_a2a"] > plain["n_a2a"], f"{msg}: the all-to-alls were not split"
    # not vacuous: tokens were dropped, and values are not all zero
    assert all(r[key][0]["dropped"] > 0 for r in ranks for key in keys)
    assert all(r[key][0]["y"].abs().sum() > 0 for r in ranks for key in keys)


def test_pipelined_all_to_all_moves_the_same_bytes(ranks):
    for rank, r in enumerate(ranks):
        for (mp, ep, esp, schedule, k), (plain, piped) in r.items():
            extra = 0
            if schedule == "s1":
                # each extra chunk has its own count exchange: int64 counts [D, E_l]
                d, e_l = ep * esp, 4 // ep
                extra = (len(chunk_bounds(plain["capacity"], CHUNKS)) - 1) * d * e_l * 8
            assert piped["a2a_bytes"] == plain["a2a_bytes"] + extra, (
                f"rank {rank} case {(mp, ep, esp, schedule, k)}: {piped['a2a_bytes']} vs {plain['a2a_bytes']}"
            )


def test_chunk_bounds_cover_the_range_evenly():
    assert chunk_bounds(10, 3) == [(0, 3), (3, 6), (6, 10)]
    assert chunk_bounds(2, 3) == [(0, 1), (1, 2)]
    assert chunk_bounds(1, 4) == [(0, 1)]


def test_refused_combinations_name_the_flags():
    cfg = tiny_config(moe_dropless=True)
    layer = MoELayer(cfg, local_state(), seed=1, name="moe", layer_idx=1)
    with pytest.raises(ValueError, match=DROPLESS_ERROR):
        layer.set_pipeline_chunks(2)
    layer = MoELayer(tiny_config(), local_state(), seed=1, name="moe", layer_idx=1)
    layer.dispatcher.set_dw_queue(object())
    with pytest.raises(ValueError, match=DW_ERROR):
        pipelined_moe(layer.dispatcher, layer.experts, torch.zeros(4, 32), [], 2)
    with pytest.raises(ValueError, match="--lina-pipeline-chunks must be >= 1"):
        parse_args(["--lina-pipeline-chunks", "0"])


def test_apply_sets_the_chunks_of_every_moe_layer_and_refuses_lancet():
    from megatron_moe.distributed.grad_sync import GradSync
    from megatron_moe.model.gpt2 import GPT2MoE
    from megatron_moe.optimizations import apply

    cfg = tiny_config()
    cfg.model.num_layers = 4  # MoE blocks 1 and 3
    cfg.opts.lina_pipeline_chunks = 3
    ps = local_state()
    model = GPT2MoE(cfg, ps)
    applied = apply(model, ps, cfg, GradSync(model, ps))
    assert [layer.pipeline_chunks for layer in model.moe_layers()] == [3, 3]
    assert any("3 token-chunk micro-ops" in c for c in applied.changes), applied.changes
    for flag in ("lancet_wgrad", "lancet_partition"):
        cfg2 = tiny_config()
        cfg2.opts.lina_pipeline_chunks = 2
        setattr(cfg2.opts, flag, True)
        model = GPT2MoE(cfg2, ps)
        with pytest.raises(
            ValueError, match="--lina-pipeline-chunks cannot be combined with --" + flag.replace("_", "-")
        ):
            apply(model, ps, cfg2, GradSync(model, ps))
