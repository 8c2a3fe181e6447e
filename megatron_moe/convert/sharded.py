"""Checkpoint conversion, sharded side: consolidate sharded checkpoints and reshard them.

Everything goes through the layout-free `FullCheckpoint`. Reading assembles each tensor from the rank
shards with the shard specs in metadata.json; writing slices it again for every target rank
(`coords_of`), so a reshard is exact (values only cut and concatenated). Every output is written under
a temporary name and renamed when complete.
"""

from __future__ import annotations

import copy
import json
import math
import os
import shutil
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Iterator, Optional

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm import tqdm

from megatron_moe.arguments import config_from_dict, validate
from megatron_moe.checkpointing import (
    FORMAT_VERSION,
    TOKENIZER_DIR,
    SaveDirLock,
    check_carried_tokenizer,
    copy_tokenizer,
    iter_dir,
    portable_config,
    resolve,
    sha256_file,
    shard_name,
    recorded_tokenizer,
    tokenizer_source,
    validate_metadata,
)
from megatron_moe.config import Config
from megatron_moe.fileio import refuse_link, replace_no_link, write_new_file
from megatron_moe.layers.sharding import (
    ShardSpec,
    coords_key,
    coords_of,
    local_shape,
    shard_spec,
    shard_tensor,
    unshard_tensor,
)

CONSOLIDATED_FORMAT = "megatron_moe.consolidated"
LAYOUT_KEYS = (
    "world_size",
    "tensor_model_parallel_size",
    "expert_model_parallel_size",
    "expert_sharding_parallel_size",
)


@dataclass
class FullCheckpoint:
    """Every tensor whole. model: name -> parameter; specs: name -> ShardSpec; optim: name -> {state:
    tensor or 0-dim scalar}; rng: per source rank {"rng/torch": ...}; meta: the source metadata."""

    cfg: Config
    model: dict
    specs: dict
    optim: dict = field(default_factory=dict)
    rng: list = field(default_factory=list)
    meta: dict = field(default_factory=dict)


# ----------------------------------------------------------------------------- JSON, shard specs, staging
def _read_json(path: str) -> dict:
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path} is missing")
    try:
        with open(path) as f:
            return json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is corrupt (not valid JSON: {e})") from e


def spec_from_json(d: dict) -> ShardSpec:
    """A ShardSpec from its metadata.json form {"dims": [[dim, kind], ...], "expert": bool}."""
    return ShardSpec(tuple((int(dim), str(kind)) for dim, kind in d["dims"]), bool(d["expert"]))


def specs_to_json(model: dict, specs: dict) -> dict:
    """metadata.json form of the shard specs (with each parameter's full shape)."""
    return {
        n: {"dims": [list(d) for d in specs[n].dims], "expert": specs[n].expert, "full_shape": list(model[n].shape)}
        for n in model
    }


def structure_specs(cfg: Config) -> dict:
    """{name: ShardSpec} of `cfg`'s model, read off a one-process model with every size shrunk to 1."""
    from megatron_moe.model.gpt2 import GPT2MoE
    from megatron_moe.parallel_state import local_state

    tiny = copy.deepcopy(cfg)
    m = tiny.model
    m.hidden_size, m.ffn_hidden_size = m.num_attention_heads, 1
    m.seq_length = m.max_position_embeddings = m.vocab_size = m.make_vocab_size_divisible_by = 1
    tiny.moe.comm_profile = None
    return {n: shard_spec(p) for n, p in GPT2MoE(tiny, local_state()).named_parameters()}


def seeded_rng_state(seed: int) -> torch.Tensor:
    """The CPU RNG state right after `torch.manual_seed(seed)` (what a fresh run starts from)."""
    return torch.Generator(device="cpu").manual_seed(seed).get_state()


@contextmanager
def staged_dir(final: str) -> Iterator[str]:
    """Yield a temporary directory beside `final`; rename it to `final` on success, remove it on error."""
    final = os.path.abspath(final)
    if os.path.lexists(final):  # a dangling link too: nothing is renamed onto a link
        raise FileExistsError(f"{final} already exists; remove it or choose another output path")
    os.makedirs(os.path.dirname(final), exist_ok=True)
    tmp = f"{final}.tmp-{os.getpid()}"
    refuse_link(tmp, "directory")
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    replace_no_link(tmp, final, "directory")


# ----------------------------------------------------------------------------- sharded -> full
def checkpoint_dir(load: str, iteration: Optional[int] = None) -> str:
    """The iteration directory of `--load DIR` (DIR/latest, or `--iteration N`) or DIR itself."""
    if iteration is not None:
        path = iter_dir(load, iteration)
        if not os.path.isdir(path):
            raise FileNotFoundError(f"--load {load} --iteration {iteration}: {path} does not exist")
        return path
    return resolve(load)  # DIR/latest, falling back to the newest complete iteration


def verify_checksum(shard: str, meta: dict) -> None:
    """ValueError naming `shard` when its SHA-256 differs from the one in metadata.json (none recorded: passes)."""
    expected = (meta.get("checksums") or {}).get("sha256", {}).get(os.path.basename(shard))
    if expected is not None and os.path.isfile(shard) and sha256_file(shard) != expected:
        raise ValueError(f"checkpoint shard {shard} is corrupt: its SHA-256 does not match metadata.json")


def _open_shard(path: str):
    if not os.path.isfile(path):
        raise FileNotFoundError(f"checkpoint shard {path} is missing")
    try:
        return safe_open(path, framework="pt")
    except Exception as e:  # safetensors raises its own error type for truncated/garbled files
        raise ValueError(f"checkpoint shard {path} is corrupt or truncated ({e})") from e


def _get(f, path: str, key: str) -> torch.Tensor:
    try:
        return f.get_tensor(key)
    except Exception as e:
        raise ValueError(f"checkpoint shard {path}: cannot read {key} ({e})") from e


def _layout_and_specs(meta: dict, meta_path: str) -> tuple:
    """((world, mp, ep, esp), {name: ShardSpec}, {name: full shape}, Config) from metadata.json."""
    try:
        layout = tuple(meta["layout"][k] for k in LAYOUT_KEYS)
        specs = {n: spec_from_json(s) for n, s in meta["shard_specs"].items()}
        shapes = {n: tuple(s["full_shape"]) for n, s in meta["shard_specs"].items()}
        return layout, specs, shapes, config_from_dict(meta["config"])
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"{meta_path} is corrupt or from another format ({type(e).__name__}: {e})") from e


def read_sharded(
    load: str, iteration: Optional[int] = None, with_optimizer: bool = True, progress: bool = True
) -> FullCheckpoint:
    """Consolidate a sharded checkpoint (any layout); every shard is opened (missing/truncated: an error
    naming it), each slice read once from the first rank holding it."""
    path = checkpoint_dir(load, iteration)
    meta_path = os.path.join(path, "metadata.json")
    meta = validate_metadata(_read_json(meta_path), meta_path)  # before any shard is opened
    (world, mp, ep, esp), specs, shapes, cfg = _layout_and_specs(meta, meta_path)
    cfg.data.tokenizer_name_or_path = recorded_tokenizer(cfg.data.tokenizer_name_or_path, path, meta_path)
    pieces: dict = {}  # (name, state or None) -> {coords key: slice}
    rngs = []
    for rank in tqdm(range(world), desc="reading shards", unit="shard", disable=None if progress else True):
        shard = os.path.join(path, shard_name(rank))
        coords = coords_of(rank, mp, ep, esp)
        verify_checksum(shard, meta)
        with _open_shard(shard) as f:
            keys = sorted(f.keys())
            present = set(keys)
            missing = [n for n in specs if f"model/{n}" not in present]
            if missing:
                raise ValueError(f"checkpoint shard {shard}: parameters {missing[:3]} are missing")
            for k in keys:
                kind, _, rest = k.partition("/")
                if kind == "model":
                    name, state = rest, None
                elif kind == "optim" and with_optimizer:
                    name, _, state = rest.partition("/")
                else:
                    continue
                if name not in specs:
                    raise ValueError(f"checkpoint shard {shard}: {k} belongs to no parameter of the model")
                slot, key = pieces.setdefault((name, state), {}), coords_key(coords, specs[name])
                if key in slot:
                    continue
                t = _get(f, shard, k)
                expect = local_shape(shapes[name], specs[name], coords)
                if tuple(t.shape) != expect and not (state and t.dim() == 0):
                    raise ValueError(f"checkpoint shard {shard}: {k} has shape {tuple(t.shape)}, expected {expect}")
                slot[key] = t
            rngs.append({k: _get(f, shard, k) for k in keys if k.startswith("rng/")})
    model: dict[str, torch.Tensor] = {}
    optim: dict[str, dict[str, torch.Tensor]] = {}
    for (name, state), slices in pieces.items():
        first = next(iter(slices.values()))
        full = first if first.dim() == 0 and state else unshard_tensor(slices, specs[name])
        if state is None:
            model[name] = full
        else:
            optim.setdefault(name, {})[state] = full
    drop = ("layout", "config", "shard_specs", "format_version", "checksums")
    keep = {k: v for k, v in meta.items() if k not in drop}
    keep["source"] = {"path": os.path.abspath(path), "layout": meta["layout"]}
    return FullCheckpoint(cfg, model, specs, optim, rngs, keep)


# ----------------------------------------------------------------------------- full -> sharded
def _flagged(msg: str) -> str:
    """Rename the trainer's flags in a validation message to the converter's --target-* flags."""
    for flag in ("tensor-model-parallel-size", "expert-model-parallel-size", "expert-sharding-parallel-size"):
        msg = msg.replace(f"--{flag}", f"--target-{flag}")
    return msg.replace("the world size", "the world size (--target-world-size)")


def target_config(cfg: Config, mp: int, ep: int, esp: int, world: Optional[int] = None) -> tuple[Config, int]:
    """(config with the target sizes, world size; default lcm(MP, EP x ESP)); errors name --target-*."""
    if world is None:
        world = math.lcm(mp, ep * esp) if min(mp, ep, esp) >= 1 else 1
    if world < 1:
        raise ValueError(f"--target-world-size must be positive, got {world}")
    out = copy.deepcopy(cfg)
    p = out.parallel
    p.tensor_model_parallel_size, p.expert_model_parallel_size, p.expert_sharding_parallel_size = mp, ep, esp
    if out.padded_vocab_size % max(mp, 1):
        raise ValueError(
            f"padded vocabulary {out.padded_vocab_size} is not divisible by --target-tensor-model-parallel-size {mp}"
        )
    try:
        validate(copy.deepcopy(out), world)
    except ValueError as e:
        if "--global-batch-size" not in str(e):
            raise ValueError(_flagged(str(e))) from None
    return out, world


def batch_warning(cfg: Config, world: int) -> Optional[str]:
    """A note when the saved global batch does not split over the target data-parallel size."""
    t = cfg.train
    dp = world // cfg.parallel.tensor_model_parallel_size
    if t.global_batch_size and t.global_batch_size % (t.micro_batch_size * dp):
        return (
            f"note: the saved --global-batch-size {t.global_batch_size} is not a multiple of --micro-batch-size "
            f"{t.micro_batch_size} x data-parallel size {dp}; pass compatible batch flags when resuming"
        )
    return None


def _rank_tensors(ckpt: FullCheckpoint, coords: dict, rank: int) -> dict:
    out = {f"model/{n}": shard_tensor(t, ckpt.specs[n], coords).clone() for n, t in ckpt.model.items()}
    for n, states in ckpt.optim.items():
        for k, t in states.items():
            out[f"optim/{n}/{k}"] = t.clone() if t.dim() == 0 else shard_tensor(t, ckpt.specs[n], coords).clone()
    # RNG: target rank r continues source rank r's stream (wrapping when the target is larger)
    rng = ckpt.rng[rank % len(ckpt.rng)] if ckpt.rng else {}
    out.update({k: v.clone() for k, v in rng.items()})
    out.setdefault("rng/torch", seeded_rng_state(ckpt.cfg.train.seed))
    return out


def write_sharded(
    ckpt: FullCheckpoint,
    save: str,
    cfg: Config,
    world: int,
    progress: bool = True,
    before_commit: Optional[Callable[[str], None]] = None,
) -> str:
    """Write `ckpt` in layout `cfg.parallel` on `world` ranks under `save`; returns the iteration dir.
    Staged and renamed under the root's writer lock; a root holding checkpoints is refused.
    `before_commit(staged_iteration_dir)` runs before the rename, so a failure leaves nothing behind."""
    p = cfg.parallel
    mp, ep, esp = p.tensor_model_parallel_size, p.expert_model_parallel_size, p.expert_sharding_parallel_size
    iteration = int(ckpt.meta.get("iteration", 0))
    n_moe = sum(cfg.is_moe_layer(i) for i in range(cfg.model.num_layers))
    meta = {k: v for k, v in ckpt.meta.items() if k != "source"}
    meta.update(
        {
            "format_version": FORMAT_VERSION,
            "iteration": iteration,
            "consumed_samples": int(ckpt.meta.get("consumed_samples", 0)),
            "layout": dict(zip(LAYOUT_KEYS, (world, mp, ep, esp))),
            "config": portable_config(cfg),
            "optimizer": ckpt.meta.get("optimizer"),
            "router_calls": list(ckpt.meta.get("router_calls") or [0] * n_moe),
            "shard_specs": specs_to_json(ckpt.model, ckpt.specs),
        }
    )
    if "source" in ckpt.meta:
        meta["converted_from"] = ckpt.meta["source"]

    carried = os.path.join(ckpt.meta.get("source", {}).get("path", ""), TOKENIZER_DIR)
    tokenizer = check_carried_tokenizer(carried) if os.path.lexists(carried) else tokenizer_source(cfg)

    def fill(directory: str) -> None:
        os.makedirs(directory, exist_ok=True)
        sums = {}
        for rank in tqdm(range(world), desc="writing shards", unit="shard", disable=None if progress else True):
            shard = os.path.join(directory, shard_name(rank))
            save_file(_rank_tensors(ckpt, coords_of(rank, mp, ep, esp), rank), shard)
            sums[shard_name(rank)] = sha256_file(shard)
        meta["checksums"] = {"sha256": sums}
        note = copy_tokenizer(tokenizer, os.path.join(directory, TOKENIZER_DIR))
        if note:
            print(f"note: {note}", flush=True)
        if os.path.isdir(os.path.join(directory, TOKENIZER_DIR)):
            meta["tokenizer"] = TOKENIZER_DIR
        with open(os.path.join(directory, "metadata.json"), "w") as f:
            json.dump(meta, f, indent=1)
        if before_commit is not None:
            before_commit(directory)

    final = iter_dir(os.path.abspath(save), iteration)
    if not os.path.exists(save):
        with staged_dir(save) as root:
            fill(iter_dir(root, iteration))
            with open(os.path.join(root, "latest"), "w") as f:
                f.write(str(iteration))
        return final
    if not os.path.isdir(save):
        raise FileExistsError(f"--save {save} exists and is not a directory")
    try:  # before anything is written
        refuse_link(os.path.join(save, "latest.tmp"), "regular file")
    except ValueError as e:
        raise ValueError(f"--save {save}: {e}") from None
    lock = SaveDirLock(save)  # a trainer (or another conversion) writing `save` is named and refused
    try:
        held = sorted(n for n in os.listdir(save) if n == "latest" or n.startswith("iter_"))
        if held:
            raise FileExistsError(
                f"--save {save} is the checkpoint directory of another run (it holds {held[:3]}); "
                f"writing into it would move its 'latest': choose a new directory"
            )
        with staged_dir(final) as staged:
            fill(staged)
        write_new_file(os.path.join(save, "latest.tmp"), str(iteration).encode())
        replace_no_link(os.path.join(save, "latest.tmp"), os.path.join(save, "latest"), "regular file")
    finally:
        lock.release()
    return final


# ----------------------------------------------------------------------------- models and --verify
def build_model(cfg: Config, full: dict, no_drop: bool = False):
    """A one-process eval-mode GPT2MoE holding the full state; `no_drop`: dropless routing."""
    from megatron_moe.model.gpt2 import GPT2MoE
    from megatron_moe.layers.sharding import load_full_state
    from megatron_moe.parallel_state import local_state

    one = copy.deepcopy(cfg)
    one.parallel.tensor_model_parallel_size = one.parallel.expert_model_parallel_size = 1
    one.parallel.expert_sharding_parallel_size = 1
    one.moe.comm_profile = None
    if no_drop:  # every routed choice kept; every schedule is equal on one process
        one.moe.moe_dropless, one.moe.moe_schedule = True, "baseline"
    model = GPT2MoE(one, local_state(), routing_groups=1).eval()
    load_full_state(model, full, local_state())
    return model


def fixed_batch(cfg: Config, batch: int = 2, length: int = 16) -> torch.Tensor:
    """The --verify batch: token ids [batch, T] (T = min(length, seq length)) from a seed-0 generator."""
    T = min(length, cfg.model.seq_length, cfg.model.max_position_embeddings or cfg.model.seq_length)
    gen = torch.Generator(device="cpu").manual_seed(0)  # the one-process CPU reference of --verify
    return torch.randint(0, cfg.model.vocab_size, (batch, T), generator=gen, device="cpu")


@torch.no_grad()
def model_logits(cfg: Config, full: dict, ids: torch.Tensor, no_drop: bool = False) -> torch.Tensor:
    """Logits [B, T, V] over the real (unpadded) vocabulary of the model `full` on `ids` [B, T]."""
    return build_model(cfg, full, no_drop)(ids)[..., : cfg.model.vocab_size]


def max_logit_diff(a: FullCheckpoint, b: FullCheckpoint) -> float:
    """max |logits_a - logits_b| on `fixed_batch` of two consolidated checkpoints of one model."""
    ids = fixed_batch(a.cfg)
    return float((model_logits(a.cfg, a.model, ids) - model_logits(b.cfg, b.model, ids)).abs().max())


def optimizer_mismatches(a: FullCheckpoint, b: FullCheckpoint) -> list[str]:
    """Names 'param/state' whose optimizer tensors differ in any bit (or exist on one side only)."""
    keys_a = {(n, k) for n, s in a.optim.items() for k in s}
    keys_b = {(n, k) for n, s in b.optim.items() for k in s}
    bad = [f"{n}/{k}" for n, k in sorted(keys_a ^ keys_b)]
    bad += [f"{n}/{k}" for n, k in sorted(keys_a & keys_b) if not torch.equal(a.optim[n][k], b.optim[n][k])]
    return bad
