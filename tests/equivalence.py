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
STEP_LR = 0.5  # SGD learning rate of the multi-step checks


def tiny_config(
    k: int = 1,
    policy: str = "position",
    schedule: str = "baseline",
    cf: float = 0.5,
    num_experts: int = 4,
    **moe_overrides,
) -> Config:
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
    r = reference_steps(cfg, dp, 1)
    return r["losses"][-1], r["grads"], r["drops"]


def _sgd(model: torch.nn.Module) -> torch.optim.Optimizer:
    """The optimizer of multi-step checks: SGD with momentum, a step large enough to move routing."""
    return torch.optim.SGD(model.parameters(), lr=STEP_LR, momentum=0.9)


def reference_steps(cfg: Config, dp: int, steps: int) -> dict:
    """One process, `steps` iterations on the batches `global_batch(dp, seed=step)`, an SGD step
    after all but the last: {losses per step, grads and drops of the last step, params before it}."""
    model = GPT2MoE(cfg, local_state(), routing_groups=dp)
    opt = _sgd(model)
    losses = []
    for step in range(steps):
        if step:
            opt.step()
        opt.zero_grad(set_to_none=True)
        ids, labels = global_batch(dp, seed=step)
        lm, aux = model(ids, labels)
        loss = lm + aux
        loss.backward()
        losses.append(loss.item())
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    drops = [layer.last_stats["dropped"] for layer in model.moe_layers()]
    return {"losses": losses, "grads": grads, "drops": drops, "params": params}


def run_layout(cfg: Config, mp: int, ep: int, esp: int, use_hooks: bool = False, steps: int = 1) -> dict:
    """Inside a spawned rank: forward + backward + grad sync under the layout, `steps` times
    with an SGD step in between (as `reference_steps`); the last step's loss, grads and drops."""
    ps = initialize_model_parallel(mp, ep, esp)
    try:
        model = GPT2MoE(cfg, ps)
        sync = GradSync(model, ps, bucket_mb=0.01) if use_hooks else None
        opt = _sgd(model) if steps > 1 else None
        r = ps.rank("dp")
        sl = slice(r * MICRO_BATCH, (r + 1) * MICRO_BATCH)
        losses = []
        for step in range(steps):
            if step:
                opt.step()
                opt.zero_grad(set_to_none=True)
            ids, labels = global_batch(ps.size("dp"), seed=step)
            with CommTracer() as tracer:
                lm, aux = model(ids[sl].to(ps.device), labels[sl].to(ps.device))
                loss = lm + aux
                loss.backward()
            if sync is not None:
                sync.finish()
            else:
                sync_gradients(model, ps)
            losses.append(loss.item())
        if sync is not None:
            sync.remove()
        specs = {n: p._shard for n, p in model.named_parameters()}
        drops = [layer.last_stats["dropped"] for layer in model.moe_layers()]
        return {
            "loss": losses[-1],
            "losses": losses,
            "dp_rank": r,
            "rank": ps.global_rank,
            "grads": local_pieces(model, ps, "grad"),
            "params": local_pieces(model, ps, "param"),
            "specs": specs,
            "drops": drops,
            "records": tracer.records,
        }
    finally:
        destroy_model_parallel()


def _replicated(results: list[dict], key: str, tag: str, atol: float = 1e-6):
    """The value of `key` that every rank of each data-parallel rank reports ({dp_rank: value});
    ranks of one DP rank (its MP and ESP ranks) route the same tokens, so they must agree."""
    seen: dict = {}
    for res in results:
        v, first = res[key], seen.setdefault(res["dp_rank"], (res[key], res.get("rank")))
        same = v == first[0] if not isinstance(v, float) else abs(v - first[0]) <= atol
        assert same, (
            f"{tag}: {key} {v} on rank {res.get('rank')} differs from {first[0]} on rank "
            f"{first[1]} (same data-parallel rank {res['dp_rank']})"
        )
    return {d: v for d, (v, _) in seen.items()}


def compare(results: list[dict], ref, tag: str, atol: float = 1e-5) -> None:
    """Assert the layout's loss, re-assembled grads and total drops equal the reference; every
    copy of a replicated value (loss and drops on the ranks of a DP rank, grads of replicated
    shards) must agree too."""
    ref_loss, ref_grads, ref_drops = ref
    losses = _replicated(results, "loss", tag)
    loss = sum(losses.values()) / len(losses)
    assert abs(loss - ref_loss) < atol, f"{tag}: loss {loss} != reference {ref_loss}"
    per_dp = _replicated(results, "drops", tag)
    drops = [sum(d[i] for d in per_dp.values()) for i in range(len(ref_drops))]
    assert drops == ref_drops, f"{tag}: dropped {drops} != reference {ref_drops}"
    full = assemble([res["grads"] for res in results], results[0]["specs"])
    for name, g in ref_grads.items():
        err = (full[name] - g).abs().max().item()
        assert err < atol, f"{tag}: grad of {name} differs by {err:.3g}"


def compare_steps(results: list[dict], ref: dict, tag: str, atol: float = 1e-5) -> None:
    """`compare` for a multi-step run: every step's loss, the weights the last step started from
    (every replica equal) and the last step's grads and drops."""
    for step in range(len(ref["losses"])):
        per_dp = _replicated([dict(r, step_loss=r["losses"][step]) for r in results], "step_loss", tag)
        loss = sum(per_dp.values()) / len(per_dp)
        assert abs(loss - ref["losses"][step]) < atol, f"{tag}: step {step + 1} loss {loss} != {ref['losses'][step]}"
    params = assemble([res["params"] for res in results], results[0]["specs"])
    for name, p in ref["params"].items():
        err = (params[name] - p).abs().max().item()
        assert err < atol, f"{tag}: weight {name} after {len(ref['losses']) - 1} steps differs by {err:.3g}"
    compare(results, (ref["losses"][-1], ref["grads"], ref["drops"]), tag, atol)
