"""Shared machinery of the layout-equivalence tests: a tiny config, a global batch,
one rank's run under a layout, and the one-process reference.

A run returns (loss, local param/grad slices); the test re-assembles full
gradients from every rank and compares them with the reference, which routes
each data-parallel shard of the global batch as its own routing group.
"""
from __future__ import annotations

import torch

from megatron_moe.config import Config
from megatron_moe.distributed.grad_sync import GradSync, sync_gradients
from megatron_moe.distributed.observer import CommLog as CommTracer
from megatron_moe.model.gpt2 import GPT2MoE
from megatron_moe.layers.sharding import assemble, local_pieces
from megatron_moe.parallel_state import destroy_model_parallel, initialize_model_parallel, local_state

MICRO_BATCH = 2


def tiny_config(k: int = 1, policy: str = "position", schedule: str = "baseline", cf: float = 0.5,
                num_experts: int = 4, **moe_overrides) -> Config:
    """2 blocks (block 1 is MoE), M=32, H=64, T=16, vocab 100; cf low enough that tokens drop."""
    cfg = Config()
    m = cfg.model
    m.vocab_size, m.num_layers, m.hidden_size, m.num_attention_heads = 100, 2, 32, 4
    m.ffn_hidden_size, m.seq_length, m.max_position_embeddings = 64, 16, 16
    moe = cfg.moe
    moe.num_experts, moe.moe_router_topk, moe.moe_router_policy = num_experts, k, policy
    moe.moe_expert_capacity_factor, moe.moe_min_capacity, moe.moe_schedule = cf, 1, schedule
    moe.moe_z_loss_coeff = 1e-3
    for key, v in moe_overrides.items():
        setattr(moe, key, v)
    cfg.train.seed = 7
    return cfg


def global_batch(dp: int, seq: int = 16, vocab: int = 100, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (dp * MICRO_BATCH, seq + 1), generator=g)
    return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()


def reference(cfg: Config, dp: int):
    """One process: (loss, {name: full grad}, dropped count per MoE layer)."""
    model = GPT2MoE(cfg, local_state(), routing_groups=dp)
    ids, labels = global_batch(dp)
    lm, aux = model(ids, labels)
    loss = lm + aux
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    drops = [layer.last_stats["dropped"] for layer in model.moe_layers()]
    return loss.item(), grads, drops


def run_layout(cfg: Config, mp: int, ep: int, esp: int, use_hooks: bool = False) -> dict:
    """Inside a spawned rank: forward + backward + grad sync under the layout."""
    ps = initialize_model_parallel(mp, ep, esp)
    try:
        model = GPT2MoE(cfg, ps)
        sync = GradSync(model, ps, bucket_mb=0.01) if use_hooks else None
        ids, labels = global_batch(ps.size("dp"))
        r = ps.rank("dp")
        sl = slice(r * MICRO_BATCH, (r + 1) * MICRO_BATCH)
        with CommTracer() as tracer:
            lm, aux = model(ids[sl], labels[sl])
            loss = lm + aux
            loss.backward()
        if sync is not None:
            sync.finish()
            sync.remove()
        else:
            sync_gradients(model, ps)
        specs = {n: p._shard for n, p in model.named_parameters()}
        drops = [layer.last_stats["dropped"] for layer in model.moe_layers()]
        return {"loss": loss.item(), "dp_rank": r, "grads": local_pieces(model, ps, "grad"), "specs": specs,
                "drops": drops, "records": tracer.records}
    finally:
        destroy_model_parallel()


def compare(results: list[dict], ref, tag: str, atol: float = 1e-5) -> None:
    """Assert the layout's loss, re-assembled grads and total drops equal the reference."""
    ref_loss, ref_grads, ref_drops = ref
    losses = {}
    for res in results:
        losses.setdefault(res["dp_rank"], res["loss"])
    loss = sum(losses.values()) / len(losses)
    assert abs(loss - ref_loss) < atol, f"{tag}: loss {loss} != reference {ref_loss}"
    drops = [sum(res["drops"][i] for res in results if res is results_of_dp(results, res["dp_rank"]))
             for i in range(len(ref_drops))]
    assert drops == ref_drops, f"{tag}: dropped {drops} != reference {ref_drops}"
    full = assemble([res["grads"] for res in results], results[0]["specs"])
    for name, g in ref_grads.items():
        err = (full[name] - g).abs().max().item()
        assert err < atol, f"{tag}: grad of {name} differs by {err:.3g}"


def results_of_dp(results: list[dict], dp_rank: int) -> dict:
    """The first rank's result of a data-parallel rank (MP ranks of it route the same tokens)."""
    return next(res for res in results if res["dp_rank"] == dp_rank)
