"""Checkpoint formats other than our sharded one: Hugging Face GPT-2 and one consolidated file.

  Hugging Face a GPT2LMHeadModel `save_pretrained` directory (dense models only; import
               also upcycles into MoE blocks)
  consolidated FILE.safetensors (full parameters, our names) + FILE.json (config, counters, specs)
Both go through `FullCheckpoint` (megatron_moe.convert.sharded); outputs are staged and renamed.
"""

from __future__ import annotations

import json
import os
from typing import Any, Callable, Optional

import torch
from safetensors.torch import save_file

from megatron_moe.arguments import config_from_dict, config_to_dict
from megatron_moe.checkpointing import FORMAT_VERSION, recorded_tokenizer
from megatron_moe.config import Config
from megatron_moe.convert.sharded import (
    CONSOLIDATED_FORMAT,
    FullCheckpoint,
    _get,
    _open_shard,
    _read_json,
    fixed_batch,
    model_logits,
    read_sharded,
    spec_from_json,
    specs_to_json,
    staged_dir,
    structure_specs,
)


# ----------------------------------------------------------------------------- Hugging Face GPT-2
def load_hf_model(name_or_path: str):
    """transformers' GPT2LMHeadModel from a `save_pretrained` directory or a hub name (eval mode).
    Every tensor missing from, extra in or shaped differently from what config.json describes is a
    ValueError naming it (`from_pretrained` itself fills missing ones randomly with only a log line)."""
    from transformers import GPT2LMHeadModel
    from transformers.utils import logging as hf_logging

    if not os.path.isdir(name_or_path) and _looks_like_path(name_or_path):
        raise FileNotFoundError(f"--hf {name_or_path}: no such directory")
    verbosity, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()  # the mismatches are reported below, as one error line
    hf_logging.disable_progress_bar()
    try:
        loaded: Any = GPT2LMHeadModel.from_pretrained(
            name_or_path, output_loading_info=True, ignore_mismatched_sizes=True
        )
        model, info = loaded  # (model, {missing_keys, unexpected_keys, mismatched_keys, ...})
    except Exception as e:  # missing directory, no hub access, not a GPT-2: say which flag
        raise ValueError(f"--hf {name_or_path}: cannot load a GPT2LMHeadModel ({type(e).__name__}: {e})") from e
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()
    problems = [f"{k} is missing from the weights" for k in sorted(info["missing_keys"])]
    problems += [f"{k} is in the weights but not in the model of config.json" for k in sorted(info["unexpected_keys"])]
    problems += [
        f"{k} has shape {list(theirs)} in the weights, config.json needs {list(ours)}"
        for k, theirs, ours in sorted(info["mismatched_keys"], key=lambda m: m[0])
    ]
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise ValueError(f"--hf {name_or_path}: the weights do not match its config.json: {problems[0]}{more}")
    return model.eval()


def _looks_like_path(name: str) -> bool:
    """A local path rather than a hub id ("gpt2", "org/name"): absolute, ./ ../ ~, two or more
    slashes, a path separator other than '/', or a first component that exists here."""
    if os.path.isabs(name) or name.startswith((".", "~")) or name.count("/") > 1 or os.sep != "/" and os.sep in name:
        return True
    return "/" in name and os.path.exists(name.split("/")[0])


def import_hf(
    hf_model,
    source: str,
    num_experts: int = 0,
    moe_layer_freq: int = 2,
    topk: int = 1,
    capacity_factor: float = 1.0,
    seed: int = 0,
) -> FullCheckpoint:
    """Our full checkpoint (iteration 0, no optimizer state) of a GPT2LMHeadModel; with
    num_experts > 0 every `moe_layer_freq`-th block becomes an MoE block whose experts all
    start as the block's MLP and whose gate is small and random (seeded by `seed`)."""
    from megatron_moe.model.hf_import import config_from_hf, full_state_from_hf

    cfg = config_from_hf(hf_model.config, num_experts, moe_layer_freq, topk, capacity_factor)
    cfg.train.seed = seed
    tokenizer_files = ("tokenizer.json", "vocab.json", "tokenizer_config.json")
    if not os.path.isdir(source) or any(os.path.isfile(os.path.join(source, f)) for f in tokenizer_files):
        cfg.data.tokenizer_name_or_path = source
    full = full_state_from_hf(hf_model.state_dict(), cfg, seed=seed)
    return FullCheckpoint(cfg, full, structure_specs(cfg), meta=_fresh_meta(cfg, {"hf": source}))


def _fresh_meta(cfg: Config, source: dict) -> dict:
    """The counters of a checkpoint at iteration 0 without optimizer state; `source` says where it came from."""
    n_moe = sum(cfg.is_moe_layer(i) for i in range(cfg.model.num_layers))
    return {"iteration": 0, "consumed_samples": 0, "optimizer": None, "router_calls": [0] * n_moe, "source": source}


@torch.no_grad()
def hf_logit_diff(hf_model, ckpt: FullCheckpoint, no_drop: bool = False) -> float:
    """max |logits(ours) - logits(HF)| on `fixed_batch`."""
    ids = fixed_batch(ckpt.cfg)
    return float((model_logits(ckpt.cfg, ckpt.model, ids, no_drop) - hf_model(ids).logits).abs().max())


def hf_config_of(cfg: Config):
    """The GPT2Config of a dense model of `cfg` (what `export_hf` writes)."""
    from transformers import GPT2Config

    m = cfg.model
    eos = 50256 if m.vocab_size > 50256 else None  # GPT-2's only where it exists; `_copy_tokenizer` sets the real one
    return GPT2Config(
        vocab_size=m.vocab_size,
        n_positions=m.max_position_embeddings or m.seq_length,
        n_embd=m.hidden_size,
        n_layer=m.num_layers,
        n_head=m.num_attention_heads,
        n_inner=None if m.ffn_hidden_size == 4 * m.hidden_size else m.ffn_hidden_size,
        activation_function="gelu_new",
        layer_norm_epsilon=m.layernorm_epsilon,
        resid_pdrop=m.dropout,
        embd_pdrop=m.dropout,
        attn_pdrop=m.dropout,
        bos_token_id=eos,
        eos_token_id=eos,
    )


def _copy_tokenizer(cfg: Config, directory: str, hf_config) -> str:
    """Save the checkpoint's tokenizer (config's --tokenizer-name-or-path, or the one beside the
    data) into `directory`; returns what happened, in words. Best effort: never an error."""
    from megatron_moe.data.tokenizer import load_tokenizer, save_tokenizer

    src = cfg.data.tokenizer_name_or_path
    if not src and cfg.data.data_path and os.path.isdir(f"{cfg.data.data_path}_tokenizer"):
        src = f"{cfg.data.data_path}_tokenizer"
    if not src:
        return "tokenizer: none recorded in the config, not copied"
    try:
        tok = load_tokenizer(src)
        if hasattr(tok.backend, "save_pretrained"):
            tok.backend.save_pretrained(directory)
        else:
            save_tokenizer(tok, directory)
    except Exception as e:  # a missing tokenizer must not lose the exported weights
        return f"tokenizer: {src} could not be copied ({type(e).__name__}: {e})"
    hf_config.bos_token_id = hf_config.eos_token_id = tok.eod
    return f"tokenizer: copied from {src}"


def export_hf(ckpt: FullCheckpoint, output: str, before_commit: Optional[Callable[[str], None]] = None) -> str:
    """Write a dense checkpoint as a GPT2LMHeadModel `save_pretrained` directory; returns a
    note on the tokenizer. `before_commit(staged_dir)` runs before the rename."""
    from transformers import GPT2LMHeadModel
    from megatron_moe.model.hf_import import hf_state_from_full

    if any(ckpt.cfg.is_moe_layer(i) for i in range(ckpt.cfg.model.num_layers)):
        raise ValueError(
            "export-hf: the model has MoE layers, which GPT2LMHeadModel cannot hold; "
            "use `export` (consolidated safetensors) instead"
        )
    sd = hf_state_from_full(ckpt.model, ckpt.cfg)
    hf_config = hf_config_of(ckpt.cfg)
    with staged_dir(output) as tmp:
        note = _copy_tokenizer(ckpt.cfg, tmp, hf_config)
        model = GPT2LMHeadModel(hf_config)
        missing, unexpected = model.load_state_dict(sd, strict=False)
        if unexpected or [k for k in missing if not k.endswith(("attn.bias", "attn.masked_bias"))]:
            raise RuntimeError(f"export-hf: state dict mismatch (missing {missing}, unexpected {unexpected})")
        model.save_pretrained(tmp)
        if before_commit is not None:
            before_commit(tmp)
    return note


# ----------------------------------------------------------------------------- consolidated file
def json_path_of(path: str) -> str:
    """The config file beside a consolidated file: FILE.safetensors -> FILE.json."""
    return os.path.splitext(path)[0] + ".json"


def export_file(
    ckpt: FullCheckpoint, output: str, before_commit: Optional[Callable[[str, str], None]] = None
) -> tuple[str, str]:
    """Write the full parameters to `output` (safetensors, our names) and config/counters/specs
    to its .json; both staged and renamed. Returns (safetensors path, json path)."""
    js = json_path_of(output)
    if os.path.abspath(js) == os.path.abspath(output):
        raise ValueError(f"--output {output}: use a .safetensors file name")
    for p in (output, js):
        if os.path.exists(p):
            raise FileExistsError(f"{p} already exists; remove it or choose another --output")
    os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
    tmp, tmp_js = f"{output}.tmp-{os.getpid()}", f"{js}.tmp-{os.getpid()}"
    info = {
        "format": CONSOLIDATED_FORMAT,
        "format_version": FORMAT_VERSION,
        "config": config_to_dict(ckpt.cfg),
        "iteration": int(ckpt.meta.get("iteration", 0)),
        "consumed_samples": int(ckpt.meta.get("consumed_samples", 0)),
        "router_calls": ckpt.meta.get("router_calls", []),
        "shard_specs": specs_to_json(ckpt.model, ckpt.specs),
    }
    try:
        save_file({n: t.contiguous() for n, t in ckpt.model.items()}, tmp, metadata={"format": CONSOLIDATED_FORMAT})
        with open(tmp_js, "w") as f:
            json.dump(info, f, indent=1)
        if before_commit is not None:
            before_commit(tmp, tmp_js)
        os.replace(tmp_js, js)
        os.replace(tmp, output)
    finally:
        for p in (tmp, tmp_js):
            if os.path.exists(p):
                os.remove(p)
    return output, js


def read_file(path: str, json_path: Optional[str] = None) -> FullCheckpoint:
    """A consolidated file (+ its .json) as a FullCheckpoint at iteration 0 without optimizer
    state (the exported training counters are kept under meta['source'])."""
    js = json_path or json_path_of(path)
    info = _read_json(js)
    if info.get("format") != CONSOLIDATED_FORMAT:
        raise ValueError(f"{js} is not a {CONSOLIDATED_FORMAT} config (format {info.get('format')!r})")
    cfg = config_from_dict(info["config"])
    cfg.data.tokenizer_name_or_path = recorded_tokenizer(
        cfg.data.tokenizer_name_or_path, os.path.dirname(os.path.abspath(js)), js
    )
    with _open_shard(path) as f:
        model = {k: _get(f, path, k) for k in f.keys()}
    specs = (
        {n: spec_from_json(s) for n, s in info["shard_specs"].items()}
        if "shard_specs" in info
        else structure_specs(cfg)
    )
    if set(specs) != set(model):
        raise ValueError(f"{path}: tensors {sorted(set(specs) ^ set(model))} do not match the model in {js}")
    source = {"file": os.path.abspath(path), "iteration": info.get("iteration")}
    source["consumed_samples"] = info.get("consumed_samples")
    return FullCheckpoint(cfg, model, specs, meta=_fresh_meta(cfg, source))


def read_any(
    load: str, iteration: Optional[int] = None, with_optimizer: bool = True, progress: bool = True
) -> FullCheckpoint:
    """A sharded checkpoint directory (any layout) or a consolidated .safetensors file."""
    if os.path.isfile(load):
        return read_file(load)
    return read_sharded(load, iteration, with_optimizer, progress)
