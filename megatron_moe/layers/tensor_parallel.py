"""Megatron tensor-parallel layers over the MP group, with layout-free initialization.

ColumnParallelLinear: Y = X A^T with A split by rows (output features) over MP.
RowParallelLinear:    Y = sum_mp X_mp A_mp^T with A split by columns; bias after the sum.
VocabParallelEmbedding: rows of the table split over MP; partial embeddings all-reduced.
vocab_parallel_cross_entropy: cross entropy of logits split over the vocab dim without
  gathering them (max and sum-exp all-reduced over MP).
Every parameter is made full (seeded by (seed, name)) and sliced (`make_param`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn as nn
import torch.nn.functional as F

from megatron_moe.distributed.collectives import all_reduce_raw, copy_to_group, reduce_from_group
from megatron_moe.layers.sharding import InitSpec, ShardSpec, make_full, shard_tensor, tag

if TYPE_CHECKING:
    from megatron_moe.parallel_state import ParallelState


def make_param(
    full_shape,
    spec: ShardSpec,
    init: InitSpec,
    ps: "ParallelState",
    seed: int,
    name: str,
    device: torch.device | None = None,
) -> nn.Parameter:
    """Create the full tensor deterministically (host), keep this rank's slice on `device`
    (default `ps.device`), tag it with its spec."""
    full = make_full(full_shape, init, seed, name)
    coords = {k: (ps.rank(k), ps.size(k)) for k in ("mp", "ep", "esp")}
    p = nn.Parameter(shard_tensor(full, spec, coords).to(device if device is not None else ps.device))
    tag(p, spec, full_shape)
    return p


class _ParallelLinear(nn.Module):
    """A linear layer over MP whose weight-gradient GEMM can be handed to a queue (`set_dw_queue`)."""

    def __init__(self, n_in, n_out, ps, seed, name, spec, bias_spec, bias, std, device) -> None:
        super().__init__()
        self.group = ps.group("mp")
        self.weight = make_param((n_out, n_in), spec, InitSpec("normal", std), ps, seed, f"{name}.weight", device)
        self.bias = (
            make_param((n_out,), bias_spec, InitSpec("zeros"), ps, seed, f"{name}.bias", device) if bias else None
        )
        self.dw_queue, self.dw_name = None, ""

    def set_dw_queue(self, queue, name: str) -> None:
        """Hand the weight-gradient GEMM to `queue` (Lancet's WgradRuntime) under `name`; None: plain."""
        self.dw_queue, self.dw_name = queue, name

    def _linear(self, x: torch.Tensor, bias) -> torch.Tensor:
        """F.linear with the weight, or the dW queue's linear that defers the weight gradient."""
        if self.dw_queue is None:
            return F.linear(x, self.weight, bias)
        return self.dw_queue.linear(self.dw_name)(x, self.weight, bias)


class ColumnParallelLinear(_ParallelLinear):
    """Linear whose output features are split over MP; input is replicated.

    in [..., in_features] -> out [..., out_features / MP].
    `qkv=True` splits a fused [q; k; v] weight per third so each rank keeps its heads.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        ps: "ParallelState",
        seed: int,
        name: str,
        bias: bool = True,
        qkv: bool = False,
        std: float = 0.02,
        device: torch.device | None = None,
    ):
        spec = ShardSpec(((0, "mp_qkv" if qkv else "mp"),))
        super().__init__(in_features, out_features, ps, seed, name, spec, spec, bias, std, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._linear(copy_to_group(x, self.group), self.bias)


class RowParallelLinear(_ParallelLinear):
    """Linear whose input features are split over MP; output is all-reduced, then biased.

    in [..., in_features / MP] -> out [..., out_features] (replicated).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        ps: "ParallelState",
        seed: int,
        name: str,
        bias: bool = True,
        std: float = 0.02,
        device: torch.device | None = None,
    ):
        super().__init__(
            in_features, out_features, ps, seed, name, ShardSpec(((1, "mp"),)), ShardSpec(), bias, std, device
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = reduce_from_group(self._linear(x, None), self.group)
        return y + self.bias if self.bias is not None else y


class VocabParallelEmbedding(nn.Module):
    """Embedding table [V, M] split by rows over MP. ids [...] -> [..., M] (replicated)."""

    def __init__(
        self,
        num_embeddings: int,
        dim: int,
        ps: "ParallelState",
        seed: int,
        name: str,
        std: float = 0.02,
        device: torch.device | None = None,
    ):
        super().__init__()
        self.group = ps.group("mp")
        self.weight = make_param(
            (num_embeddings, dim), ShardSpec(((0, "mp"),)), InitSpec("normal", std), ps, seed, f"{name}.weight", device
        )
        per = num_embeddings // ps.size("mp")
        self.start, self.end = ps.rank("mp") * per, (ps.rank("mp") + 1) * per

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        outside = (ids < self.start) | (ids >= self.end)
        local = (ids - self.start).masked_fill(outside, 0)
        emb = F.embedding(local, self.weight).masked_fill(outside[..., None], 0.0)
        return reduce_from_group(emb, self.group)


class _VocabParallelCE(torch.autograd.Function):
    """Cross entropy of logits split over the vocab (last) dim; returns per-token loss."""

    @staticmethod
    def forward(ctx, logits, target, group, start, valid_vocab):
        logits = logits.float()
        end = start + logits.size(-1)
        if valid_vocab is not None and valid_vocab < end:
            # padded vocabulary entries never take part in the softmax
            pad_from = max(valid_vocab - start, 0)
            logits = logits.clone()
            logits[..., pad_from:] = float("-inf")
        lmax = logits.max(dim=-1).values
        all_max = lmax.clone()
        all_reduce_raw(all_max, group, op="max")
        shifted = logits - all_max[..., None]
        outside = (target < start) | (target >= end)
        local_t = (target - start).masked_fill(outside, 0)
        pred = shifted.gather(-1, local_t[..., None]).squeeze(-1).masked_fill(outside, 0.0)
        exp = shifted.exp_()  # in place: `shifted` is not read again ([..., V/MP] passes are the cost here)
        sum_exp = exp.sum(dim=-1)
        all_reduce_raw(sum_exp, group)
        all_reduce_raw(pred, group)
        loss = sum_exp.log() - pred
        softmax = exp.div_(sum_exp[..., None])
        ctx.save_for_backward(softmax, local_t, outside)
        return loss

    @staticmethod
    def backward(ctx, g):
        """(softmax - onehot(target)) * g in one pass over the logits: softmax * g, then each target's
        entry rewritten as (softmax - 1) * g (- 0 for a target outside this rank's columns)."""
        softmax, local_t, outside = ctx.saved_tensors
        g = g[..., None]
        grad = softmax * g
        idx = local_t[..., None]
        hit = (~outside)[..., None].to(softmax.dtype)
        grad.scatter_(-1, idx, (softmax.gather(-1, idx) - hit) * g)
        return grad, None, None, None, None


def vocab_parallel_cross_entropy(
    logits_local: torch.Tensor, target: torch.Tensor, group, vocab_start: int, valid_vocab: int | None = None
) -> torch.Tensor:
    """Per-token cross entropy [...] of logits [..., V/MP] whose columns start at `vocab_start`.

    Columns at or past `valid_vocab` (vocabulary padding) are excluded from the softmax.
    """
    return _VocabParallelCE.apply(logits_local, target, group, vocab_start, valid_vocab)
