"""Batched autoregressive generation with a KV cache under any trainer layout.

Legend: B requests of this rank, P longest prompt (rows are left-padded to it), T positions
of a forward, M model dim, V vocabulary (real ids), Vp padded vocabulary.

Every rank builds the model of the layout (MP, EP, ESP; DP is what is left) and loads its slices
of a checkpoint of any layout (`load_engine`). The ranks of one MP group serve the same requests;
DP ranks serve their own. Generation is prefill (T = P) then decode (T = 1 per step) through the
blocks' halves: `Block.attn_residual(x, cache)`, then the FFN half on the real tokens of unfinished
requests only, so padding and finished requests cost no expert FLOPs. MoE layers route dropless
through the dropless dispatcher's uneven all-to-all. A rank with no unfinished request takes part
in every MoE layer's all-to-all with zero tokens until every rank is done (one all-reduce of a flag
per step), so the collectives stay matched.

Greedy output equals `generation.generate` on the dropless one-process model token for token;
logits agree to float round-off.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Callable, Optional, cast

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron_moe.config import Config
from megatron_moe.convert import read_any
from megatron_moe.distributed.collectives import all_gather_raw, all_reduce_raw
from megatron_moe.generation import check_sampling, next_token
from megatron_moe.inference.kv_cache import KVCache
from megatron_moe.layers.sharding import full_shape, load_full_state
from megatron_moe.model.gpt2 import Block, GPT2MoE
from megatron_moe.parallel_state import ParallelState

# fn(block index, block, tokens [1, R, M]) -> FFN-half output [1, R, M] (residual included)
FFNRunner = Callable[[int, Block, torch.Tensor], torch.Tensor]


def inference_config(cfg: Config, ps: ParallelState) -> Config:
    """The checkpoint's config in the layout of `ps`, with dropless MoE routing (validated)."""
    out = copy.deepcopy(cfg)
    mp, ep, esp = ps.size("mp"), ps.size("ep"), ps.size("esp")
    p = out.parallel
    p.tensor_model_parallel_size, p.expert_model_parallel_size, p.expert_sharding_parallel_size = mp, ep, esp
    moe = out.moe
    H = out.model.ffn_hidden_size
    assert H is not None  # ModelConfig fills it in (4 * hidden size by default)
    if moe.num_experts and moe.num_experts % ep:
        raise ValueError(f"--expert-model-parallel-size {ep} does not divide the model's {moe.num_experts} experts")
    if moe.num_experts and H % esp:
        raise ValueError(f"--expert-sharding-parallel-size {esp} does not divide the model's ffn hidden size {H}")
    if moe.num_experts and moe.moe_router_policy == "random":
        raise ValueError(
            "the checkpoint routes with --moe-router-policy random: inference needs a "
            "deterministic router (position or batch_prioritized)"
        )
    moe.moe_dropless, moe.moe_schedule, moe.comm_profile = True, "baseline", None
    return out


def load_weights(model: GPT2MoE, full: dict, source: str) -> None:
    """This rank's slices of the full tensors `full` into `model`; a checkpoint of another model
    (missing, extra or differently shaped tensors) is a ValueError naming `source`."""
    names = dict(model.named_parameters())
    missing, extra = sorted(set(names) - set(full)), sorted(set(full) - set(names))
    if missing or extra:
        raise ValueError(
            f"{source} holds the parameters of another model (missing {missing[:3]}, unexpected {extra[:3]})"
        )
    for n, p in names.items():
        if tuple(full[n].shape) != full_shape(p):
            raise ValueError(
                f"{source} holds the parameters of another model: {n} is {tuple(full[n].shape)}, "
                f"the model of its config needs {full_shape(p)}"
            )
    load_full_state(model, full, model.ps)


def load_engine(path: str, ps: ParallelState, iteration: Optional[int] = None) -> "InferenceEngine":
    """An engine on a checkpoint directory (any layout) or a consolidated .safetensors file."""
    ckpt = read_any(path, iteration, with_optimizer=False, progress=False)
    model = GPT2MoE(inference_config(ckpt.cfg, ps), ps).eval()
    load_weights(model, ckpt.model, path)
    return InferenceEngine(model)


@dataclass
class Generated:
    """The new ids of one request and, when asked for, the logits [V] that chose each of them."""

    tokens: list[int]
    logits: list[torch.Tensor]


def check_prompts(prompts: list[list[int]], vocab: int, max_pos: int) -> None:
    """ValueError for an empty prompt, an id outside the vocabulary or a prompt longer than the context."""
    for i, p in enumerate(prompts):
        if not p:
            raise ValueError(f"prompt {i} is empty (an empty --prompt starts from the end-of-document token)")
        if max(p) >= vocab or min(p) < 0:
            raise ValueError(f"prompt {i}: ids must be in [0, {vocab}): the tokenizer does not match the model")
        if len(p) > max_pos:
            raise ValueError(
                f"prompt {i} has {len(p)} tokens, longer than the model's context of {max_pos} "
                f"positions (--max-position-embeddings)"
            )


class InferenceEngine:
    """Generation on one rank of a layout (module docstring). `ffn_runner` replaces how MoE
    blocks' FFN halves run (Lina's scheduled MoE); default: the block's own `ffn_residual`."""

    def __init__(self, model: GPT2MoE, ffn_runner: Optional[FFNRunner] = None):
        self.model, self.ps, self.cfg = model, model.ps, model.cfg
        max_pos = model.cfg.model.max_position_embeddings
        assert max_pos is not None  # ModelConfig fills it in (the sequence length by default)
        self.vocab, self.max_pos = model.vocab_size, max_pos
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.ffn_runner = ffn_runner
        self.moe_blocks = [i for i in range(len(model.blocks)) if self.block(i).is_moe]

    def block(self, i: int) -> Block:
        """The model's block i (typed: `nn.ModuleList` items are plain `nn.Module`s to mypy)."""
        return cast(Block, self.model.blocks[i])

    def set_ffn_runner(self, runner: Optional[FFNRunner]) -> None:
        """Run MoE blocks' FFN halves with `runner` (None: the blocks' own `ffn_residual`)."""
        self.ffn_runner = runner

    # ------------------------------------------------------------------ one forward
    def _moe_half(self, i: int, block: Block, x_1RM: torch.Tensor) -> torch.Tensor:
        if self.ffn_runner is not None:
            return self.ffn_runner(i, block, x_1RM)
        return block.ffn_residual(x_1RM)[0]

    def _ffn(self, i: int, block: Block, x_BTM: torch.Tensor, use_BT: torch.Tensor) -> torch.Tensor:
        """The FFN half; MoE blocks compute (and send) only the rows where `use_BT` is True."""
        if not block.is_moe:
            return block.ffn_residual(x_BTM)[0]
        out = x_BTM.clone()
        out[use_BT] = self._moe_half(i, block, x_BTM[use_BT][None])[0]
        return out

    def idle_step(self) -> None:
        """Take part in every MoE layer's collectives with no tokens (nothing to compute here)."""
        M = self.cfg.model.hidden_size
        empty = torch.zeros((1, 0, M), dtype=self.dtype, device=self.device)
        for i in self.moe_blocks:
            self._moe_half(i, self.block(i), empty)

    def forward(self, ids_BT: torch.Tensor, cache: KVCache, use_BT: torch.Tensor) -> torch.Tensor:
        """Logits [B, V] of the last position of each row after the T new positions of `ids_BT`."""
        m = self.model
        T = ids_BT.size(1)
        pos = cache.positions(T).clamp(max=self.max_pos - 1)
        x = m.drop(m.wte(ids_BT) + m.wpe[pos])
        for i in range(len(m.blocks)):
            block = self.block(i)
            x = block.attn_residual(x, cache.layers[i])
            x = self._ffn(i, block, x, use_BT)
        cache.advance(T)
        h = m.ln_f(x[:, -1])
        logits = all_gather_raw(F.linear(h, m.wte.weight), self.ps.group("mp"), dim=-1)  # [B, Vp]
        return logits[:, : self.vocab]

    def _any_active(self, active: bool) -> bool:
        """True while a request of any rank is unfinished (a collective over the world)."""
        flag = torch.tensor([1 if active else 0], dtype=torch.long, device=self.device)
        all_reduce_raw(flag, self.ps.group("world"), op="max")
        return bool(flag.item())

    # ------------------------------------------------------------------ generation
    @torch.no_grad()
    def generate(
        self,
        prompts: list[list[int]],
        max_new_tokens: int,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        seeds: Optional[list[int]] = None,
        eod: Optional[int] = None,
        keep_logits: bool = False,
    ) -> list[Generated]:
        """Extend each of this rank's prompts by up to `max_new_tokens` ids (stopping after `eod`,
        or when the context is full). Request b samples with a generator seeded `seeds[b]` (as
        `generation.generate` does). Collective: every rank of the world calls it, possibly with
        no prompts."""
        check_sampling(temperature, top_k, top_p)
        if max_new_tokens < 0:
            raise ValueError(f"--max-new-tokens must be >= 0, got {max_new_tokens}")
        check_prompts(prompts, self.vocab, self.max_pos)
        B = len(prompts)
        seeds = list(seeds) if seeds is not None else [0] * B
        if len(seeds) != B:
            raise ValueError(f"{len(seeds)} seeds for {B} prompts")
        P = max((len(p) for p in prompts), default=0)
        cache = KVCache(len(self.model.blocks), [P - len(p) for p in prompts], P + max(max_new_tokens, 1), self.device)
        gens = [torch.Generator(device="cpu").manual_seed(s) for s in seeds]
        out = [Generated([], []) for _ in range(B)]
        lengths = [len(p) for p in prompts]
        done = [max_new_tokens == 0 or n >= self.max_pos for n in lengths]
        rows = [[0] * (P - len(p)) + list(p) for p in prompts]  # left-padded
        ids = torch.tensor(rows, dtype=torch.long, device=self.device).view(B, P)
        while self._any_active(not all(done)):
            if all(done):
                self.idle_step()
                continue
            active = torch.tensor([not d for d in done], dtype=torch.bool, device=self.device)
            use = cache.real(ids.size(1)) & active[:, None]
            logits = self.forward(ids, cache, use).float().cpu()
            nxt = [0] * B
            for b in range(B):
                if done[b]:
                    continue
                tok = next_token(logits[b], temperature, top_k, top_p, gens[b])
                out[b].tokens.append(tok)
                if keep_logits:
                    out[b].logits.append(logits[b].clone())
                lengths[b] += 1
                nxt[b] = tok
                done[b] = len(out[b].tokens) >= max_new_tokens or tok == eod or lengths[b] >= self.max_pos
            ids = torch.tensor(nxt, dtype=torch.long, device=self.device).view(B, 1)
        return out


def serve(
    engine: InferenceEngine,
    prompts: list[list[int]],
    max_new_tokens: int,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seeds: Optional[list[int]] = None,
    eod: Optional[int] = None,
) -> list[list[int]]:
    """Every request's new ids, on every rank. Collective: every rank passes the same requests;
    request i is generated by data-parallel rank i % DP (its MP group), then all are gathered."""
    if not prompts:
        raise ValueError("the prompt list is empty: give at least one --prompt or a non-empty --prompts-file")
    check_prompts(prompts, engine.vocab, engine.max_pos)
    seeds = list(seeds) if seeds is not None else [0] * len(prompts)
    dp, r = engine.ps.size("dp"), engine.ps.rank("dp")
    mine = list(range(r, len(prompts), dp))
    out = engine.generate(
        [prompts[i] for i in mine], max_new_tokens, temperature, top_k, top_p, [seeds[i] for i in mine], eod
    )
    pairs = [(i, o.tokens) for i, o in zip(mine, out)]
    if engine.ps.size("world") > 1:
        gathered: list = [None] * engine.ps.size("world")
        dist.all_gather_object(gathered, pairs, group=engine.ps.group("world"))
        pairs = [p for part in gathered for p in part]
    by_index = dict(pairs)
    return [by_index[i] for i in range(len(prompts))]
