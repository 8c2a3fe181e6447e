"""GPT-2 with MoE blocks, tensor parallel over MP (Megatron style).

Exactly GPT-2's architecture, so GPT-2 weights load: learned positions, pre-LayerNorm blocks,
causal self-attention, tanh-GELU MLP, final LayerNorm, LM head tied to the word embedding. Every
`--moe-layer-freq`-th block's MLP is an MoE layer. Shapes are batch-first: ids [B, T], hidden
[B, T, M]. The constructor takes the `ParallelState` (`local_state()` for one process); every
parameter is created full from a generator seeded by (seed, name) and sliced, so any layout
starts from the same weights.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Optional, Protocol, cast

import torch
import torch.nn as nn
import torch.nn.functional as F

from megatron_moe.distributed.collectives import copy_to_group
from megatron_moe.layers.fused import gelu_tanh, layer_norm
from megatron_moe.layers.sharding import InitSpec, ShardSpec, tag
from megatron_moe.layers.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    make_param,
    vocab_parallel_cross_entropy,
)
from megatron_moe.moe.layer import MoELayer

if TYPE_CHECKING:
    from megatron_moe.config import Config, ModelConfig
    from megatron_moe.parallel_state import ParallelState


class AttentionCache(Protocol):
    """A KV cache (megatron_moe.inference): stores k, v [B, h, T, d] and returns the attention output."""

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor: ...


class Attention(nn.Module):
    """Causal self-attention, heads split over MP. [B, T, M] -> [B, T, M]."""

    def __init__(self, cfg: "Config", ps: "ParallelState", seed: int, name: str, device: torch.device):
        super().__init__()
        m = cfg.model
        mp = ps.size("mp")
        if m.num_attention_heads % mp:
            raise ValueError(
                f"--num-attention-heads {m.num_attention_heads} must be divisible by --tensor-model-parallel-size {mp}"
            )
        self.heads = m.num_attention_heads // mp
        self.head_dim = m.hidden_size // m.num_attention_heads
        M, std, proj_std = m.hidden_size, m.init_method_std, m.init_method_std / (2 * m.num_layers) ** 0.5
        self.qkv = ColumnParallelLinear(M, 3 * M, ps, seed, f"{name}.qkv", qkv=True, std=std, device=device)
        self.proj = RowParallelLinear(M, M, ps, seed, f"{name}.proj", std=proj_std, device=device)

    def forward(self, x: torch.Tensor, cache: Optional["AttentionCache"] = None) -> torch.Tensor:
        """`cache` (inference): appends this call's keys/values and attends over the cached ones."""
        B, T, _ = x.shape
        q, k, v = self.qkv(x).split(self.heads * self.head_dim, dim=-1)
        q, k, v = (t.view(B, T, self.heads, self.head_dim).transpose(1, 2) for t in (q, k, v))
        # no dropout on the attention probabilities: --hidden-dropout acts on the replicated
        # [B, T, M] activations only (Block), so every MP rank and a one-process run draw the same masks
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True) if cache is None else cache.attend(q, k, v)
        return self.proj(o.transpose(1, 2).reshape(B, T, self.heads * self.head_dim))


def ffn_hidden_size(m: "ModelConfig") -> int:
    """The MLP hidden size H (ModelConfig.__post_init__ fills in its default, 4 * M)."""
    if m.ffn_hidden_size is None:
        raise ValueError(
            "ModelConfig.ffn_hidden_size (--ffn-hidden-size) is None; its __post_init__ sets 4 * hidden_size"
        )
    return m.ffn_hidden_size


class MLP(nn.Module):
    """GPT-2 MLP, hidden dim split over MP. [B, T, M] -> [B, T, M]."""

    def __init__(self, cfg: "Config", ps: "ParallelState", seed: int, name: str, device: torch.device):
        super().__init__()
        m = cfg.model
        H, proj_std = ffn_hidden_size(m), m.init_method_std / (2 * m.num_layers) ** 0.5
        self.fc = ColumnParallelLinear(m.hidden_size, H, ps, seed, f"{name}.fc", std=m.init_method_std, device=device)
        self.proj = RowParallelLinear(H, m.hidden_size, ps, seed, f"{name}.proj", std=proj_std, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(gelu_tanh(self.fc(x)))


class Block(nn.Module):
    """Pre-LN transformer block; `self.moe` replaces `self.mlp` in MoE blocks. Returns (x, aux)."""

    def __init__(
        self, cfg: "Config", ps: "ParallelState", seed: int, idx: int, routing_groups: int, device: torch.device
    ):
        super().__init__()
        m = cfg.model
        name = f"blocks.{idx}"
        self.ln1 = layer_norm(m.hidden_size, m.layernorm_epsilon, device)
        self.attn = Attention(cfg, ps, seed, f"{name}.attn", device)
        self.ln2 = layer_norm(m.hidden_size, m.layernorm_epsilon, device)
        self.is_moe = cfg.is_moe_layer(idx)
        if self.is_moe:
            self.moe = MoELayer(cfg, ps, seed, f"{name}.moe", idx, routing_groups, device=device)
        else:
            self.mlp = MLP(cfg, ps, seed, f"{name}.mlp", device)
        self.drop = nn.Dropout(m.dropout)

    def attn_residual(self, x: torch.Tensor, cache: Optional["AttentionCache"] = None) -> torch.Tensor:
        """The attention half: x + drop(attn(ln1(x))) (`cache`: a KV cache, inference)."""
        return x + self.drop(self.attn(self.ln1(x), cache))

    def ffn_residual(self, x: torch.Tensor):
        """The FFN half: (x + drop(ffn(ln2(x))), aux or None)."""
        h = self.ln2(x)
        if self.is_moe:
            y, aux = self.moe(h)
        else:
            y, aux = self.mlp(h), None
        return x + self.drop(y), aux

    def forward(self, x: torch.Tensor):
        return self.ffn_residual(self.attn_residual(x))


class GPT2MoE(nn.Module):
    """GPT-2 (MoE) language model.

    forward(ids [B, T], labels [B, T] or None):
      labels None -> this rank's logits [B, T, Vp / MP] (vocab-parallel slice)
      labels      -> (lm loss: mean cross entropy, aux: sum of MoE aux losses)
    `routing_groups`: how many data-parallel shards a batch holds (the one-process reference of a
    DP run passes DP). `set_block_runner` / `set_loss_runner` let an optimization (Lancet's
    pipelined ranges) run blocks another way.
    """

    def __init__(
        self,
        cfg: "Config",
        ps: "ParallelState",
        seed: int | None = None,
        routing_groups: int = 1,
        device: torch.device | None = None,
    ):
        super().__init__()
        m = cfg.model
        seed = cfg.train.seed if seed is None else seed
        device = torch.device(device) if device is not None else ps.device  # parameters are created here
        self.cfg, self.ps = cfg, ps
        vp = cfg.padded_vocab_size
        if vp % ps.size("mp"):
            raise ValueError(
                f"padded vocabulary {vp} is not divisible by --tensor-model-parallel-size "
                f"{ps.size('mp')}; change --make-vocab-size-divisible-by"
            )
        self.vocab_size, self.padded_vocab = m.vocab_size, vp
        self.wte = VocabParallelEmbedding(vp, m.hidden_size, ps, seed, "wte", std=m.init_method_std, device=device)
        init, shape = InitSpec("normal", m.init_method_std), (m.max_position_embeddings, m.hidden_size)
        self.wpe = make_param(shape, ShardSpec(), init, ps, seed, "wpe.weight", device)
        self.drop = nn.Dropout(m.dropout)
        self.blocks = nn.ModuleList(Block(cfg, ps, seed, i, routing_groups, device) for i in range(m.num_layers))
        self.ln_f = layer_norm(m.hidden_size, m.layernorm_epsilon, device)
        self.runners: dict[int, Callable] = {}
        self.loss_runner: Optional[tuple[int, Callable]] = None
        for p in self.parameters():  # LayerNorms: replicated, deterministic init
            if not hasattr(p, "_shard"):
                tag(p, ShardSpec(), p.shape)

    def block_list(self) -> list[Block]:
        """The transformer blocks in order (iterating the nn.ModuleList yields untyped Modules)."""
        return cast("list[Block]", list(self.blocks))  # the constructor fills it with Blocks only

    def compile_blocks(self) -> None:
        """torch.compile each block in place (--compile): a dense block whole, an MoE block its attention
        and layer norms (the MoE layer's collectives, routing-sized tensors and autograd functions would
        break the graph)."""
        for b in self.block_list():
            if b.is_moe:
                for m in (b.ln1, b.attn, b.ln2):
                    m.compile()
            else:
                b.compile()

    def moe_layers(self) -> list[MoELayer]:
        return [b.moe for b in self.block_list() if b.is_moe]

    def set_pipeline_chunks(self, chunks: int) -> None:
        """Lina's all-to-all pipelining (`MoELayer.set_pipeline_chunks`) for every MoE layer; 1: off."""
        for layer in self.moe_layers():
            layer.set_pipeline_chunks(chunks)

    def set_block_runner(self, idx: int, fn: Optional[Callable]) -> None:
        """Run block `idx` with `fn(x) -> (x, aux)` instead of the block (None: the block again)."""
        if fn is None:
            self.runners.pop(idx, None)
        else:
            self.runners[idx] = fn

    def set_loss_runner(self, idx: int, fn: Optional[Callable]) -> None:
        """With labels, run blocks `idx`.. and the loss head as `fn(x, labels) -> (losses [B, T], aux)`
        (None: the blocks and `head_losses` again)."""
        self.loss_runner = None if fn is None else (idx, fn)

    def _blocks(self, ids: torch.Tensor, stop: int):
        """Blocks 0..stop-1 on the embedded ids: (their output [B, T, M], the summed aux loss)."""
        T = ids.size(1)
        x = self.drop(self.wte(ids) + self.wpe[:T][None])
        aux_total = x.new_zeros((), dtype=torch.float32)
        for i, block in enumerate(self.block_list()[:stop]):
            x, aux = self.runners.get(i, block)(x)
            if aux is not None:
                aux_total = aux_total + aux
        return x, aux_total

    def hidden(self, ids: torch.Tensor):
        """Final hidden states [B, T, M] and the summed aux loss."""
        x, aux = self._blocks(ids, len(self.blocks))
        return self.ln_f(x), aux

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        """This rank's vocabulary-parallel logits of final hidden states h (after ln_f)."""
        return F.linear(copy_to_group(h, self.ps.group("mp")), self.wte.weight)

    def head_losses(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The loss head: ln_f, the tied LM head and the vocabulary-parallel cross entropy of the last
        block's output x [B, T, M] -> per-token losses [B, T] (row by row: parts of the batch give
        the rows of the whole)."""
        logits = self._logits(self.ln_f(x))
        return vocab_parallel_cross_entropy(logits, labels, self.ps.group("mp"), self.wte.start, self.vocab_size)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor | None = None):
        if labels is None:
            h, _ = self.hidden(ids)
            return self._logits(h)
        stop, run = self.loss_runner or (len(self.blocks), None)
        x, aux = self._blocks(ids, stop)
        if run is None:
            return self.head_losses(x, labels).mean(), aux
        losses, aux_r = run(x, labels)
        return losses.mean(), aux if aux_r is None else aux + aux_r
