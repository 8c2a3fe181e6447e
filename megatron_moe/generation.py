"""Sampling text from a trained model: a one-process model on the consolidated weights.

The one-process reference (full recomputation, no KV cache); batched generation under any
parallel layout, which tools/generate.py uses, is `megatron_moe.inference`. A checkpoint of any
layout (or a consolidated safetensors file) is loaded into a one-process `GPT2MoE` (the config's
MoE capacity unless overridden). Each step runs the context, cropped to the last max-positions
tokens, and picks the next token from the last position's logits over the real vocabulary [V]:
greedy (argmax), or temperature (softmax of logits / T, seeded torch.Generator) with optional
top-k (the k largest logits) and top-p (the smallest set of most likely tokens reaching p).
"""

from __future__ import annotations

import os
from typing import Optional

import torch

from megatron_moe.config import Config


def load_model(path: str, iteration: Optional[int] = None, capacity_factor: Optional[float] = None):
    """(model in eval mode, config) from a sharded checkpoint directory or a consolidated file.

    `capacity_factor` replaces every MoE layer's capacity factor (e.g. a large one for no drops).
    """
    from megatron_moe.convert import build_model, read_any

    ckpt = read_any(path, iteration, with_optimizer=False, progress=False)
    model = build_model(ckpt.cfg, ckpt.model)
    if capacity_factor is not None:
        if capacity_factor <= 0:
            raise ValueError(f"--moe-expert-capacity-factor must be positive, got {capacity_factor}")
        for layer in model.moe_layers():
            layer.cf = capacity_factor
    return model, ckpt.cfg


def carried_tokenizer(path: str, iteration: Optional[int] = None) -> Optional[str]:
    """The tokenizer directory a sharded checkpoint carries (ITER_DIR/tokenizer), if any; ValueError
    when it is or holds a symbolic link, or names custom code."""
    if os.path.isfile(path):
        return None
    from megatron_moe.checkpointing import TOKENIZER_DIR, check_carried_tokenizer
    from megatron_moe.convert import checkpoint_dir

    tok = os.path.join(checkpoint_dir(path, iteration), TOKENIZER_DIR)
    return check_carried_tokenizer(tok) if os.path.lexists(tok) else None


def tokenizer_path(cfg: Config, override: Optional[str] = None, carried: Optional[str] = None) -> str:
    """Where the tokenizer is: `override`, the one the checkpoint carries, the config's
    --tokenizer-name-or-path, or the directory saved beside the training data (data_path + '_tokenizer')."""
    path = override or carried or cfg.data.tokenizer_name_or_path
    if path:
        return path
    if cfg.data.data_path and os.path.isdir(f"{cfg.data.data_path}_tokenizer"):
        return f"{cfg.data.data_path}_tokenizer"
    raise ValueError(
        "no tokenizer recorded in the checkpoint's config (and none beside its --data-path "
        f"{cfg.data.data_path}): pass --tokenizer-name-or-path"
    )


def check_sampling(temperature: float, top_k: int, top_p: float) -> None:
    """Raise ValueError naming the flag for an invalid sampling setting."""
    if temperature < 0:
        raise ValueError(f"--temperature must be >= 0 (0: greedy), got {temperature}")
    if top_k < 0:
        raise ValueError(f"--top-k must be >= 0 (0: off), got {top_k}")
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"--top-p must be in (0, 1] (1: off), got {top_p}")


def filter_logits(logits_V: torch.Tensor, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """Logits [V] with everything outside the top-k and the top-p nucleus set to -inf."""
    out = logits_V.clone()
    if 0 < top_k < out.numel():
        kth = torch.topk(out, top_k).values[-1]
        out[out < kth] = float("-inf")
    if top_p < 1.0:
        sorted_logits, order = torch.sort(out, descending=True)
        cum = torch.softmax(sorted_logits, dim=-1).cumsum(dim=-1)
        # drop a token when the tokens ranked above it already reach p (the top one always stays)
        drop_sorted = (cum - torch.softmax(sorted_logits, dim=-1)) >= top_p
        out[order[drop_sorted]] = float("-inf")
    return out


def next_token(
    logits_V: torch.Tensor,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    generator: Optional[torch.Generator] = None,
) -> int:
    """The next token id from last-position logits [V] (greedy when temperature == 0)."""
    logits_V = logits_V.float()
    if temperature == 0:
        return int(torch.argmax(logits_V))
    probs = torch.softmax(filter_logits(logits_V / temperature, top_k, top_p), dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))


@torch.no_grad()
def generate(
    model,
    prompt_ids: list[int],
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int = 0,
    eod: Optional[int] = None,
) -> list[int]:
    """Extend `prompt_ids` by up to `max_new_tokens` ids (stopping after `eod` when given);
    returns only the new ids. Every id is < the model's (unpadded) vocabulary size."""
    check_sampling(temperature, top_k, top_p)
    vocab, max_pos = model.vocab_size, model.cfg.model.max_position_embeddings
    if not prompt_ids:
        raise ValueError("the prompt is empty (an empty --prompt starts from the end-of-document token)")
    if max(prompt_ids) >= vocab or min(prompt_ids) < 0:
        raise ValueError(f"prompt ids must be in [0, {vocab}): the tokenizer does not match the model")
    gen = torch.Generator(device="cpu").manual_seed(seed)  # samples from host logits: same on every device
    device = next(model.parameters()).device
    ids, new = list(prompt_ids), []
    for _ in range(max_new_tokens):
        ctx = torch.tensor([ids[-max_pos:]], dtype=torch.long, device=device)  # crop to max positions
        logits_V = model(ctx)[0, -1, :vocab].cpu()  # real vocabulary only
        tok = next_token(logits_V, temperature, top_k, top_p, gen)
        ids.append(tok)
        new.append(tok)
        if eod is not None and tok == eod:
            break
    return new
