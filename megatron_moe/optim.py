"""Optimizer, learning-rate schedule and global gradient-norm clipping.

Weight decay applies to matrices only (not to biases, LayerNorm parameters or
the position table, as in Megatron/nanoGPT). The global norm counts every
parameter element exactly once across MP/EP/ESP/DP: each rank adds the
squares of the shards it *owns* (the lowest global rank among the replicas of
that shard) and the sums are all-reduced over the world.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.distributed as dist

from megatron_moe.distributed.comm_errors import guard
from megatron_moe.layers.sharding import coords_of, shard_spec


def decays(name: str, p: torch.nn.Parameter) -> bool:
    """Whether weight decay applies: matrices only. Not biases (an expert bias is [E_l, H], one
    dim per expert), LayerNorm parameters, or the position table `wpe`."""
    expert_bias = shard_spec(p).expert and p.dim() == 2
    return p.dim() >= 2 and name != "wpe" and not expert_bias


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    decay: list[torch.nn.Parameter] = []
    no_decay: list[torch.nn.Parameter] = []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (decay if decays(name, p) else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def build_optimizer(model: torch.nn.Module, optim_cfg, device: torch.device) -> tuple[torch.optim.Optimizer, str]:
    """AdamW (fused when this torch supports it on the device) or SGD with momentum; returns (opt, name)."""
    groups = param_groups(model, optim_cfg.weight_decay)
    if optim_cfg.optimizer == "sgd":
        return torch.optim.SGD(groups, lr=optim_cfg.lr, momentum=optim_cfg.sgd_momentum), "SGD(momentum)"
    kw = dict(lr=optim_cfg.lr, betas=(optim_cfg.adam_beta1, optim_cfg.adam_beta2), eps=optim_cfg.adam_eps)
    try:
        return torch.optim.AdamW(groups, fused=True, **kw), f"AdamW(fused, {device.type})"
    except (RuntimeError, TypeError, ValueError):
        return torch.optim.AdamW(groups, foreach=True, **kw), "AdamW(foreach)"


def lr_at(iteration: int, optim_cfg) -> float:
    """Linear warmup to --lr over --lr-warmup-iters, then cosine/linear/constant decay to --min-lr."""
    lr, min_lr, warm = optim_cfg.lr, optim_cfg.min_lr, optim_cfg.lr_warmup_iters
    if warm and iteration < warm:
        return lr * (iteration + 1) / warm
    if optim_cfg.lr_decay_style == "constant":
        return lr
    total = max(optim_cfg.lr_decay_iters - warm, 1)
    frac = min(max(iteration - warm, 0) / total, 1.0)
    if optim_cfg.lr_decay_style == "linear":
        return lr - (lr - min_lr) * frac
    return min_lr + 0.5 * (lr - min_lr) * (1 + math.cos(math.pi * frac))


@functools.lru_cache(maxsize=None)
def _owns(rank: int, kinds: frozenset, mp: int, ep: int, esp: int) -> bool:
    """True if `rank` is the lowest global rank holding its slice of a tensor split over `kinds`."""
    me = coords_of(rank, mp, ep, esp)
    for other in range(rank):
        c = coords_of(other, mp, ep, esp)
        if all(c[k][0] == me[k][0] for k in kinds):
            return False
    return True


def global_grad_norm(model: torch.nn.Module, ps) -> float:
    """L2 norm of the full gradient (every element once), identical on all ranks."""
    lay = ps.layout
    device = next(model.parameters()).device
    sq = torch.zeros((), dtype=torch.float64, device=device)
    for p in model.parameters():
        if p.grad is None:
            continue
        kinds = frozenset("mp" if k == "mp_qkv" else k for _, k in shard_spec(p).dims)
        if _owns(ps.global_rank, kinds, lay.mp, lay.ep, lay.esp):
            sq += p.grad.detach().double().pow(2).sum()
    if ps.layout.world_size > 1:
        with guard("gradient-norm all_reduce", ps.group("world")):
            dist.all_reduce(sq, group=ps.group("world"))
    return float(sq.sqrt())


def clip_gradients(model: torch.nn.Module, ps, max_norm: float) -> float:
    """Scale gradients so the global norm is at most `max_norm` (0: no clipping); returns the norm."""
    norm = global_grad_norm(model, ps)
    if max_norm > 0 and norm > max_norm:
        scale = max_norm / (norm + 1e-6)
        for p in model.parameters():
            if p.grad is not None:
                p.grad.mul_(scale)
    return norm
