"""Sharded checkpoints: one safetensors file per rank plus a JSON metadata file.

Layout of `--save DIR`:
  DIR/latest                          text: the newest complete iteration
  DIR/iter_0000100/metadata.json      layout, iteration, consumed samples, config, per-layer
                                      router call counters, optimizer kind
  DIR/iter_0000100/rank_00003.safetensors
        model/<param>                 this rank's slice of every parameter
        optim/<param>/<state>         its optimizer state (exp_avg, exp_avg_sq, step, momentum_buffer)
        rng/torch, rng/cuda           this rank's RNG states
A checkpoint is written into `iter_XXXXXXX.tmp-<pid>` and renamed when every
rank has written its shard, then `latest` is replaced atomically. Loading
reads tensors only (safetensors: no code can run from a checkpoint).
"""
from __future__ import annotations

import json
import os
import shutil
from typing import Optional

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

from megatron_moe.arguments import config_to_dict

FORMAT_VERSION = 1


def iter_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def shard_name(rank: int) -> str:
    return f"rank_{rank:05d}.safetensors"


def _barrier(ps) -> None:
    if ps.layout.world_size > 1:
        dist.barrier(group=ps.group("world"))


def _broadcast_str(s: str, ps) -> str:
    if ps.layout.world_size == 1:
        return s
    obj = [s]
    dist.broadcast_object_list(obj, src=0, group=ps.group("world"))
    return obj[0]


def state_tensors(model, optimizer) -> dict:
    """Flat {key: tensor} of this rank's model slices, optimizer state and RNG states."""
    out = {f"model/{n}": p.detach().contiguous().cpu() for n, p in model.named_parameters()}
    names = {id(p): n for n, p in model.named_parameters()}
    for p, st in optimizer.state.items():
        for k, v in st.items():
            t = v if torch.is_tensor(v) else torch.tensor(v, device="cpu")     # host copy for safetensors
            out[f"optim/{names[id(p)]}/{k}"] = t.detach().contiguous().cpu()
    out["rng/torch"] = torch.get_rng_state()
    if torch.cuda.is_available():
        out["rng/cuda"] = torch.cuda.get_rng_state()
    return out


def save_checkpoint(root: str, iteration: int, consumed_samples: int, model, optimizer, cfg, ps,
                    extra: Optional[dict] = None) -> str:
    """Write the checkpoint of `iteration` (all ranks call this); returns its directory."""
    final = iter_dir(root, iteration)
    tmp = _broadcast_str(f"{final}.tmp-{os.getpid()}", ps)
    if ps.global_rank == 0:
        os.makedirs(root, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    _barrier(ps)
    save_file(state_tensors(model, optimizer), os.path.join(tmp, shard_name(ps.global_rank)))
    _barrier(ps)
    if ps.global_rank == 0:
        lay = ps.layout
        meta = {"format_version": FORMAT_VERSION, "iteration": iteration, "consumed_samples": consumed_samples,
                "layout": {"world_size": lay.world_size, "tensor_model_parallel_size": lay.mp,
                           "expert_model_parallel_size": lay.ep, "expert_sharding_parallel_size": lay.esp},
                "config": config_to_dict(cfg), "optimizer": type(optimizer).__name__,
                "router_calls": [layer.router.calls for layer in model.moe_layers()],
                "shard_specs": {n: {"dims": [list(d) for d in p._shard.dims], "expert": p._shard.expert,
                                    "full_shape": list(p._full_shape)} for n, p in model.named_parameters()}}
        meta.update(extra or {})
        with open(os.path.join(tmp, "metadata.json"), "w") as f:
            json.dump(meta, f, indent=1)
        if os.path.exists(final):
            shutil.rmtree(final)
        os.replace(tmp, final)
        with open(os.path.join(root, "latest.tmp"), "w") as f:
            f.write(str(iteration))
        os.replace(os.path.join(root, "latest.tmp"), os.path.join(root, "latest"))
    _barrier(ps)
    return final


def latest_iteration(root: str) -> int:
    path = os.path.join(root, "latest")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"--load {root}: no 'latest' file (not a checkpoint directory?)")
    with open(path) as f:
        return int(f.read().strip())


def read_metadata(ckpt_dir: str) -> dict:
    path = os.path.join(ckpt_dir, "metadata.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"checkpoint metadata {path} is missing")
    with open(path) as f:
        return json.load(f)


def resolve(load: str) -> str:
    """A checkpoint directory from --load: DIR (uses DIR/latest) or DIR/iter_XXXXXXX."""
    if os.path.isfile(os.path.join(load, "metadata.json")):
        return load
    return iter_dir(load, latest_iteration(load))


def check_layout(meta: dict, ps, path: str) -> None:
    lay, saved = ps.layout, meta["layout"]
    now = {"world_size": lay.world_size, "tensor_model_parallel_size": lay.mp,
           "expert_model_parallel_size": lay.ep, "expert_sharding_parallel_size": lay.esp}
    if now != saved:
        raise ValueError(f"checkpoint {path} was saved with layout {saved} but this run uses {now}; "
                         f"convert it with `python tools/convert_checkpoint.py reshard --load {path} ...`")


def load_checkpoint(load: str, model, optimizer, ps) -> dict:
    """Restore model, optimizer, RNG and router counters; returns the metadata."""
    path = resolve(load)
    meta = read_metadata(path)
    check_layout(meta, ps, path)
    shard = os.path.join(path, shard_name(ps.global_rank))
    if not os.path.isfile(shard):
        raise FileNotFoundError(f"checkpoint shard {shard} is missing")
    tensors = load_file(shard)
    with torch.no_grad():
        for n, p in model.named_parameters():
            key = f"model/{n}"
            if key not in tensors:
                raise KeyError(f"{shard}: parameter {n} missing")
            p.copy_(tensors[key].to(p.device))
    names = {n: p for n, p in model.named_parameters()}
    step_on_device = bool(optimizer.defaults.get("fused") or optimizer.defaults.get("capturable"))
    for key, t in tensors.items():
        if key.startswith("optim/"):
            _, pname, state_key = key.split("/", 2)
            p = names[pname]
            on_device = state_key != "step" or step_on_device
            optimizer.state[p][state_key] = t.to(p.device) if on_device else t.clone()
    torch.set_rng_state(tensors["rng/torch"])
    if torch.cuda.is_available() and "rng/cuda" in tensors:
        torch.cuda.set_rng_state(tensors["rng/cuda"])
    for layer, calls in zip(model.moe_layers(), meta.get("router_calls", [])):
        layer.router.calls = calls
    return meta
