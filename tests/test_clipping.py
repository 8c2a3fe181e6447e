"""Gradient clipping: the global norm counts every element once across MP/EP/ESP/DP (equal to the
norm of the re-assembled full gradient), clipping scales to exactly the clip value and leaves
small gradients alone, and a run that really clips (--clip-grad 0.05) keeps the one-process
curve under MP2 x EP2 and EP2 x ESP2.

The curves use SGD (lr 1.0): AdamW divides the update by the gradient's running RMS, so
clipping changes an AdamW curve by less than 1e-3 here; SGD's update is the clipped gradient
(one process, 6 iterations: loss at iteration 4 is 6.186 clipped vs 5.707 unclipped)."""

import math

import pytest
import torch

from equivalence import MICRO_BATCH, global_batch, reference, tiny_config
from megatron_moe.arguments import parse_args
from megatron_moe.distributed.grad_sync import sync_gradients
from megatron_moe.model.gpt2 import GPT2MoE
from megatron_moe.layers.sharding import assemble, local_pieces
from megatron_moe.optim import clip_gradients, global_grad_norm
from megatron_moe.parallel_state import destroy_model_parallel, initialize_model_parallel
from megatron_moe.testing import spawn
from megatron_moe.training import pretrain
from tiny_run import tiny_args

LAYOUTS = {"MP2xEP2": (2, 2, 1), "EP2xESP2": (1, 2, 2)}
CLIP = 0.05
ITERS = 6
SGD = ("--optimizer", "sgd", "--lr", "1.0")
CLIPPED = (*SGD, "--clip-grad", str(CLIP))


def _curve_on_rank(rank, world, argv):
    return [(h["loss"], h["grad_norm"], h["dropped_frac"]) for h in pretrain(parse_args(argv))]


def _full_norm(full: dict) -> float:
    return math.sqrt(sum(float(g.double().pow(2).sum()) for g in full.values()))


def _clip_on_rank(rank, world, mp, ep, esp):
    """Synced grads, their global norm, then grads after clipping below and above that norm."""
    ps = initialize_model_parallel(mp, ep, esp)
    try:
        model = GPT2MoE(tiny_config(), ps)
        ids, labels = global_batch(ps.size("dp"))
        mine = slice(ps.rank("dp") * MICRO_BATCH, (ps.rank("dp") + 1) * MICRO_BATCH)
        lm, aux = model(ids[mine], labels[mine])
        (lm + aux).backward()
        sync_gradients(model, ps)
        before = local_pieces(model, ps, "grad")
        norm = global_grad_norm(model, ps)
        returned_high = clip_gradients(model, ps, 2 * norm)  # above the norm: no change
        unchanged = local_pieces(model, ps, "grad")
        returned_low = clip_gradients(model, ps, norm / 4)  # below: scaled to norm / 4
        after = local_pieces(model, ps, "grad")
        specs = {n: p._shard for n, p in model.named_parameters()}
        return {
            "norm": norm,
            "returned": (returned_high, returned_low),
            "before": before,
            "unchanged": unchanged,
            "after": after,
            "specs": specs,
            "clipped_norm": global_grad_norm(model, ps),
        }
    finally:
        destroy_model_parallel()


def _on_rank(rank, world, mp, ep, esp, argv):
    """The clipping unit check, then the clipped training curve, in one spawn (saves a start-up)."""
    unit = _clip_on_rank(rank, world, mp, ep, esp)
    return unit, _curve_on_rank(rank, world, argv)


@pytest.fixture(scope="module", params=list(LAYOUTS))
def layout_run(request, sample_data):
    """(layout, per-rank unit results, per-rank clipped curves) of one 4-process spawn."""
    mp, ep, esp = LAYOUTS[request.param]
    argv = tiny_args(
        sample_data,
        ITERS,
        *CLIPPED,
        "--tensor-model-parallel-size",
        str(mp),
        "--expert-model-parallel-size",
        str(ep),
        "--expert-sharding-parallel-size",
        str(esp),
    )
    out = spawn(_on_rank, 4, mp, ep, esp, argv, timeout=600)
    return request.param, [u for u, _ in out], [c for _, c in out]


def test_global_norm_counts_every_element_once_and_clipping_scales_to_the_clip(layout_run):
    layout, results, _ = layout_run
    mp = LAYOUTS[layout][0]
    ref_grads = reference(tiny_config(), 4 // mp)[1]  # DP = world / MP routing groups
    ref_norm = _full_norm(ref_grads)
    specs = results[0]["specs"]
    full = assemble([r["before"] for r in results], specs)
    norm = results[0]["norm"]
    assert all(r["norm"] == norm for r in results), "ranks disagree on the global norm"
    assert abs(norm - _full_norm(full)) < 1e-9 * norm, (norm, _full_norm(full))
    assert abs(norm - ref_norm) < 1e-5 * ref_norm, (norm, ref_norm)
    for r in results:
        assert r["returned"] == (norm, norm)  # the pre-clip norm is what is returned
        for name, (_, g) in r["unchanged"].items():
            assert torch.equal(g, r["before"][name][1]), f"{name} changed by a clip above the norm"
    clipped = assemble([r["after"] for r in results], specs)
    scale = (norm / 4) / (norm + 1e-6)
    for name, g in full.items():
        assert torch.allclose(clipped[name], g * scale, rtol=1e-6, atol=0), f"{name} not scaled by {scale}"
    assert abs(results[0]["clipped_norm"] - norm / 4) < 1e-5 * norm


@pytest.fixture(scope="module")
def clipped_reference(sample_data):
    """One-process SGD curves with --clip-grad 0.05 and with clipping off."""
    clipped = _curve_on_rank(0, 1, tiny_args(sample_data, ITERS, *CLIPPED))
    free = _curve_on_rank(0, 1, tiny_args(sample_data, ITERS, *SGD, "--clip-grad", "0"))
    return clipped, free


def test_clipping_changes_the_one_process_curve(clipped_reference):
    clipped, free = clipped_reference
    assert all(n > CLIP for _, n, _ in clipped), "every iteration's norm must exceed the clip"
    assert clipped[0][0] == free[0][0]  # the first loss is computed before any update
    assert all(abs(c[0] - f[0]) > 1e-3 for c, f in zip(clipped[1:], free[1:])), "clipping changed nothing"


def test_clipped_golden_curve_matches_one_process(clipped_reference, layout_run):
    ref, _ = clipped_reference
    _, _, curves = layout_run
    for curve in curves:
        assert len(curve) == ITERS
        for i, ((l_ref, n_ref, d_ref), (l, n, d)) in enumerate(zip(ref, curve)):
            assert abs(l - l_ref) < 1e-4, f"iteration {i + 1}: loss {l} vs {l_ref}"
            assert abs(n - n_ref) < 1e-3 * max(1.0, n_ref), f"iteration {i + 1}: grad norm {n} vs {n_ref}"
            assert d == d_ref, f"iteration {i + 1}: dropped fraction {d} vs {d_ref}"
