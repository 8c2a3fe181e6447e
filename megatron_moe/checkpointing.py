"""Sharded checkpoints: one safetensors file per rank plus a JSON metadata file.

Layout of `--save DIR`: `DIR/latest` (text: the newest complete iteration) and `DIR/iter_0000100/`
holding `metadata.json` (layout, iteration, consumed samples, config, router call counters,
optimizer kind, SHA-256 of every shard), `tokenizer/` (the run's tokenizer) and one
`rank_00003.safetensors` per rank with keys `model/<param>` (this rank's slice),
`optim/<param>/<state>` and `rng/torch`, `rng/cuda`.

A save never loses the previous good state. In order (each a named fault point):
  1. every rank writes and fsyncs its shard into `iter_N.tmp-<pid>`         -> "after_shards"
  2. rank 0 writes the tokenizer and metadata.json, fsyncs the directory    -> "after_metadata"
  3. an existing `iter_N` (a re-save) is renamed to `iter_N.old-<pid>`      -> "after_old_aside"
  4. the temporary directory is renamed to `iter_N`                         -> "after_new_in"
  5. `latest` is replaced atomically (write, fsync, rename, fsync dir)      -> "after_latest"
  6. the old copy is deleted                                                -> "after_old_removed"
  7. with --keep-last N, all but the newest N iterations are deleted.
Rank 0 cleans a crash's leftovers at the next save (an `.old` copy whose `iter_N` is missing is renamed
back). No link inside DIR is followed: a save refuses, before writing, when `latest`, `latest.tmp` or an
`iter_*` entry is a link; files are created with O_EXCL | O_NOFOLLOW. DIR itself may be a link.

One writer per DIR: the trainer's rank 0 holds a flock on `DIR/.writer.lock` (holding its PID) for
the run. A run without --load is refused on a DIR that holds checkpoints (it would move `latest`
back). Loading follows `latest`; when it is unusable, the newest complete iteration is used with a
warning. Loading reads tensors only, after the shard's SHA-256 and the config have been checked.

`MEGATRON_MOE_CKPT_FAULT=<fault point>` makes `save_checkpoint` raise `CheckpointFault` (a
BaseException, so nothing cleans up) there, leaving the directory as a crash would (tests only).
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import re
import shutil
import typing
import warnings
import weakref
from dataclasses import fields
from typing import Optional

import torch
import torch.distributed as dist
from safetensors.torch import load as load_bytes
from safetensors.torch import save as save_bytes

from megatron_moe.data.paths import tokenizer_dir_for
from megatron_moe.arguments import config_to_dict
from megatron_moe.config import Config
from megatron_moe.fileio import pid_alive, refuse_link, remove_tree, replace_no_link, write_new_file

FORMAT_VERSION = 1
FAULT_ENV = "MEGATRON_MOE_CKPT_FAULT"
FAULT_POINTS = (
    "after_shards",
    "after_metadata",
    "after_old_aside",
    "after_new_in",
    "after_latest",
    "after_old_removed",
)
TOKENIZER_DIR = "tokenizer"
_ITER_RE = re.compile(r"^iter_(\d{7})(?:\.old-(\d+))?$")
_TMP_RE = re.compile(r"^iter_\d{7}\.tmp-(\d+)$")


class NonFiniteError(FloatingPointError):
    """A NaN/inf loss, gradient norm or parameter: the step is not applied, nothing is saved."""


class CheckpointFault(BaseException):
    """Raised at the fault point named by MEGATRON_MOE_CKPT_FAULT (crash injection in tests)."""


def _fault_point(name: str) -> None:
    if os.environ.get(FAULT_ENV) == name:
        raise CheckpointFault(f"injected crash at checkpoint fault point {name!r}")


def iter_dir(root: str, iteration: int) -> str:
    """`root/iter_XXXXXXX`."""
    return os.path.join(root, f"iter_{iteration:07d}")


def shard_name(rank: int) -> str:
    """File name of `rank`'s shard."""
    return f"rank_{rank:05d}.safetensors"


def sha256_file(path: str) -> str:
    """Hex SHA-256 of a file's bytes."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_durably(path: str, data: bytes) -> None:
    write_new_file(path, data, durable=True)  # O_EXCL | O_NOFOLLOW, fsynced


def link_problem(root: str) -> Optional[str]:
    """Why checkpoints cannot be written under `root`: a link where a checkpoint entry belongs (or None)."""
    if not os.path.isdir(root):
        return None
    for name in sorted(os.listdir(root)):
        expected = "regular file" if name in ("latest", "latest.tmp", LOCK_FILE) else "directory"
        if name in ("latest", "latest.tmp", LOCK_FILE) or name.startswith("iter_"):
            try:
                refuse_link(os.path.join(root, name), expected)
            except ValueError as e:
                return f"--save {root}: {e}"
    return None


def _barrier(ps) -> None:
    if ps.layout.world_size > 1:
        dist.barrier(group=ps.group("world"))


def _broadcast_str(s: str, ps) -> str:
    if ps.layout.world_size == 1:
        return s
    obj = [s]
    dist.broadcast_object_list(obj, src=0, group=ps.group("world"))
    return obj[0]


def _gather(obj, ps) -> list:
    if ps.layout.world_size == 1:
        return [obj]
    out = [None] * ps.layout.world_size
    dist.all_gather_object(out, obj, group=ps.group("world"))
    return out


def state_tensors(model, optimizer) -> dict:
    """Flat {key: tensor} of this rank's model slices, optimizer state and RNG states."""
    out = {f"model/{n}": p.detach().contiguous().cpu() for n, p in model.named_parameters()}
    names = {id(p): n for n, p in model.named_parameters()}
    for p, st in optimizer.state.items():
        for k, v in st.items():
            t = v if torch.is_tensor(v) else torch.tensor(v, device="cpu")  # host copy for safetensors
            out[f"optim/{names[id(p)]}/{k}"] = t.detach().contiguous().cpu()
    out["rng/torch"] = torch.get_rng_state()
    if torch.cuda.is_available():
        out["rng/cuda"] = torch.cuda.get_rng_state()
    return out


def _non_finite(tensors: dict) -> list:
    return [k for k, t in tensors.items() if t.is_floating_point() and not bool(torch.isfinite(t).all())]


# ----------------------------------------------------------------------------- tokenizer
def tokenizer_source(cfg) -> Optional[str]:
    """The run's tokenizer: --tokenizer-name-or-path, else the one preprocessing wrote beside the data."""
    if cfg.data.tokenizer_name_or_path:
        return cfg.data.tokenizer_name_or_path
    if cfg.data.data_path and os.path.isdir(tokenizer_dir_for(cfg.data.data_path)):
        return tokenizer_dir_for(cfg.data.data_path)
    return None


def check_carried_tokenizer(directory: str) -> str:
    """`directory` (ITER_DIR/tokenizer) after refusing links in it and custom code (an `auto_map`)."""
    from megatron_moe.data.tokenizer import refuse_custom_code, refuse_links

    refuse_links(directory)
    refuse_custom_code(directory)
    return directory


def recorded_tokenizer(value: Optional[str], checkpoint: str, source: str) -> Optional[str]:
    """A checkpoint's recorded tokenizer (`source`: its metadata file). Absolute: kept; relative: resolved
    inside `checkpoint` (ValueError if it leaves it), else a hub name unless it exists in the cwd (ValueError)."""
    if not value or os.path.isabs(value):
        return value
    field = "config.data.tokenizer_name_or_path"
    base = os.path.realpath(checkpoint)
    path = os.path.realpath(os.path.join(base, value))
    if os.path.commonpath([base, path]) != base:
        raise ValueError(
            f"{field} {value!r} in {source} leaves the checkpoint directory {checkpoint}: "
            "pass --tokenizer-name-or-path instead"
        )
    if os.path.lexists(os.path.join(base, value)):
        return path
    if os.path.lexists(value):
        raise ValueError(
            f"{field} {value!r} in {source} is a relative path that is not inside the checkpoint "
            f"directory {checkpoint} (it is not read from the current directory): pass --tokenizer-name-or-path"
        )
    return value


TOKENIZER_FILE_PREFIXES = (
    "tokenizer",
    "vocab",
    "merges",
    "special_tokens",
    "added_tokens",
    "spiece",
    "megatron_moe_tokenizer",
)


def copy_tokenizer(src: Optional[str], dest: str) -> Optional[str]:
    """Copy tokenizer `src` (a directory's tokenizer files, or a name) to `dest`; a warning if it could not."""
    if not src:
        return None
    if os.path.isdir(src):
        names = [
            n
            for n in sorted(os.listdir(src))
            if n.startswith(TOKENIZER_FILE_PREFIXES) and os.path.isfile(os.path.join(src, n))
        ]
        if names:
            os.makedirs(dest)
            for n in names:
                shutil.copyfile(os.path.join(src, n), os.path.join(dest, n))
            return None
    try:
        from megatron_moe.data.tokenizer import load_tokenizer, save_tokenizer

        tok = load_tokenizer(src)
        if hasattr(tok.backend, "save_pretrained"):
            tok.backend.save_pretrained(dest)
        else:
            save_tokenizer(tok, dest)
    except Exception as e:  # a tokenizer that cannot be copied must not lose the weights
        shutil.rmtree(dest, ignore_errors=True)
        return f"tokenizer {src} not copied into the checkpoint ({type(e).__name__}: {e})"
    return None


def _is_number(word: str) -> bool:
    try:
        float(word)
        return True
    except ValueError:
        return False


def portable_config(cfg) -> dict:
    """config_to_dict with existing local paths made absolute (no cwd-relative path is recorded)."""
    d = config_to_dict(cfg)
    data = d["data"]
    if isinstance(data.get("data_path"), str):
        data["data_path"] = os.path.abspath(data["data_path"])
    elif data.get("data_path"):  # a blend: weights stay, prefixes become absolute
        data["data_path"] = [w if _is_number(w) else os.path.abspath(w) for w in data["data_path"]]
    tok = data.get("tokenizer_name_or_path")
    if tok and os.path.exists(tok):  # a hub name stays as it is
        data["tokenizer_name_or_path"] = os.path.abspath(tok)
    return d


# ----------------------------------------------------------------------------- one writer per directory
LOCK_FILE = ".writer.lock"


def _unlock(fd: int, path: str) -> None:
    try:  # removed while still locked: a waiter that opened this file sees it is gone and retries
        if os.stat(path, follow_symlinks=False).st_ino == os.fstat(fd).st_ino:
            os.unlink(path)
    except FileNotFoundError:
        pass
    finally:
        os.close(fd)


class SaveDirLock:
    """Exclusive flock on `root/.writer.lock` (holding the PID); released by `release()`, collection or exit."""

    def __init__(self, root: str, flag: str = "--save"):
        self.root, self.path = root, os.path.join(root, LOCK_FILE)
        os.makedirs(root, exist_ok=True)
        while True:
            refuse_link(self.path, "regular file")
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                if e.errno not in (errno.EAGAIN, errno.EWOULDBLOCK):  # a file system without flock
                    warnings.warn(f"{flag} {root}: no writer lock ({e.strerror}); make sure one run writes it")
                    break
                holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
                os.close(fd)
                raise ValueError(
                    f"{flag} {root} is being written by another process (PID {holder} holds {self.path}): "
                    f"two runs must not write one checkpoint directory; wait for it to end or choose another {flag}"
                ) from None
            try:
                same = os.stat(self.path, follow_symlinks=False).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)  # the holder released and removed it between our open and our lock
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._finalizer = weakref.finalize(self, _unlock, fd, self.path)

    def release(self) -> None:
        self._finalizer()  # runs once


def held_checkpoints(root: str) -> list:
    """Names of the checkpoints under `root` (`latest`, `iter_*` directories and their `.old` copies)."""
    if not os.path.isdir(root):
        return []
    return sorted(n for n in os.listdir(root) if n == "latest" or _ITER_RE.match(n))


def lock_save_dir(root: str, resuming: bool) -> SaveDirLock:
    """Take `root`'s writer lock; without `resuming` (no --load) refuse a `root` that holds checkpoints."""
    lock = SaveDirLock(root)
    held = [] if resuming else held_checkpoints(root)
    if held:
        lock.release()
        raise ValueError(
            f"--save {root} already holds checkpoints ({', '.join(held[:3])}{', ...' if len(held) > 3 else ''}) "
            f"and this run has no --load: pass --load {root} to resume from them, or choose another --save "
            f"(a fresh run would move their 'latest' back and later replace their iterations)"
        )
    return lock


# ----------------------------------------------------------------------------- save
def _clean_leftovers(root: str, own_tmp: str) -> None:
    """Rank 0, before a save: remove crashed temporaries, restore or drop `.old` copies."""
    for name in sorted(os.listdir(root)):
        path = os.path.join(root, name)
        m = _TMP_RE.match(name)
        if m and path != own_tmp:
            pid = int(m.group(1))
            if pid != os.getpid() and pid_alive(pid):
                continue  # another live process may be writing it
            _drop(path)
            continue
        m = _ITER_RE.match(name)
        if m and m.group(2) is not None:
            final = iter_dir(root, int(m.group(1)))
            if not _is_complete(final) and _is_complete(path):
                _drop(final)
                replace_no_link(path, final, "directory")  # the only good copy of this iteration
            else:
                _drop(path)
    _fsync_dir(root)


def _drop(path: str) -> None:
    """Remove a leftover directory, never through a link (refused, naming it)."""
    refuse_link(path, "directory")
    shutil.rmtree(path, ignore_errors=True)


def _retain(root: str, keep_last: int, keep: int) -> list:
    """Delete all but the newest `keep_last` iterations (never `keep`); returns the deleted dirs."""
    if not keep_last:
        return []
    its = sorted(it for it, path in complete_iterations(root) if path == iter_dir(root, it))
    doomed = [it for it in its[:-keep_last] if it != keep]
    for it in doomed:
        remove_tree(iter_dir(root, it))
    return [iter_dir(root, it) for it in doomed]


def save_checkpoint(
    root: str, iteration: int, consumed_samples: int, model, optimizer, cfg, ps, extra: Optional[dict] = None
) -> str:
    """All ranks: write `iteration`'s checkpoint, return its directory; NonFiniteError on NaN/inf (if checked)."""
    final = iter_dir(root, iteration)
    tensors = state_tensors(model, optimizer)
    if cfg.train.check_for_nan_in_loss_and_grad:
        bad = _non_finite(tensors)
        flags = _gather(bool(bad), ps)
        if any(flags):
            raise NonFiniteError(
                f"iteration {iteration}: not saved, non-finite values in "
                f"{bad[:3] if bad else 'another rank'} (a NaN/inf checkpoint is never written)"
            )
    problem = _broadcast_str((link_problem(root) or "") if ps.global_rank == 0 else "", ps)
    if problem:  # before anything is written, on every rank
        raise ValueError(problem)
    tmp = _broadcast_str(f"{final}.tmp-{os.getpid()}", ps)
    try:
        if ps.global_rank == 0:
            os.makedirs(root, exist_ok=True)
            _clean_leftovers(root, tmp)
            _drop(tmp)
            os.makedirs(tmp)
        _barrier(ps)
        name = shard_name(ps.global_rank)
        data = save_bytes(tensors)
        _write_durably(os.path.join(tmp, name), data)
        checksums = dict(_gather((name, hashlib.sha256(data).hexdigest()), ps))
        del data
        _fault_point("after_shards")
        if ps.global_rank == 0:
            _commit(root, tmp, final, iteration, consumed_samples, model, optimizer, cfg, ps, checksums, extra)
    except (KeyboardInterrupt, OSError):  # Ctrl-C or a failed write leaves no half-written iteration
        # (a crash's goes at the next save)
        if ps.global_rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)  # never follows a link
        raise
    _barrier(ps)
    return final


def _commit(root, tmp, final, iteration, consumed_samples, model, optimizer, cfg, ps, checksums, extra) -> None:
    """Rank 0: metadata, renames and `latest` (steps 2-7 of the module docstring)."""
    note = copy_tokenizer(tokenizer_source(cfg), os.path.join(tmp, TOKENIZER_DIR))
    if note:
        warnings.warn(note)
    lay = ps.layout
    meta = {
        "format_version": FORMAT_VERSION,
        "iteration": iteration,
        "consumed_samples": consumed_samples,
        "layout": {
            "world_size": lay.world_size,
            "tensor_model_parallel_size": lay.mp,
            "expert_model_parallel_size": lay.ep,
            "expert_sharding_parallel_size": lay.esp,
        },
        "config": portable_config(cfg),
        "optimizer": type(optimizer).__name__,
        "has_optimizer_state": bool(optimizer.state),
        "router_calls": [layer.router.calls for layer in model.moe_layers()],
        "shard_specs": {
            n: {"dims": [list(d) for d in p._shard.dims], "expert": p._shard.expert, "full_shape": list(p._full_shape)}
            for n, p in model.named_parameters()
        },
        "checksums": {"sha256": checksums},
    }
    if os.path.isdir(os.path.join(tmp, TOKENIZER_DIR)):
        meta["tokenizer"] = TOKENIZER_DIR
    meta.update(extra or {})
    _write_durably(os.path.join(tmp, "metadata.json"), json.dumps(meta, indent=1).encode())
    _fsync_dir(tmp)
    _fault_point("after_metadata")
    aside = None
    if os.path.lexists(final):
        aside = f"{final}.old-{os.getpid()}"
        replace_no_link(final, aside, "directory")
        _fsync_dir(root)
        _fault_point("after_old_aside")
    replace_no_link(tmp, final, "directory")
    _fsync_dir(root)
    _fault_point("after_new_in")
    latest_tmp = os.path.join(root, "latest.tmp")
    _write_durably(latest_tmp, str(iteration).encode())
    replace_no_link(latest_tmp, os.path.join(root, "latest"), "regular file")
    _fsync_dir(root)
    _fault_point("after_latest")
    if aside is not None:
        remove_tree(aside)
        _fault_point("after_old_removed")
    _retain(root, cfg.train.keep_last, iteration)


# ----------------------------------------------------------------------------- metadata
MAX_WORLD_SIZE = 1 << 20  # a bound on the shards looked for (each is a file to stat and open)
MAX_LAYERS = 1 << 14  # the converter loops over the config's blocks
SPEC_KINDS = ("mp", "mp_qkv", "ep", "esp")
LAYOUT_KEYS = (
    "world_size",
    "tensor_model_parallel_size",
    "expert_model_parallel_size",
    "expert_sharding_parallel_size",
)


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _shown(v) -> str:
    text = json.dumps(v) if not isinstance(v, str) else repr(v)
    return text if len(text) <= 60 else text[:57] + "..."


def _hint_words(value, hint) -> Optional[str]:
    """What `value` must be for the scalar type hint `hint` (None: it is, or the hint is not checked here)."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if typing.get_origin(hint) is typing.Union:
        if value is None:
            return None
        return _hint_words(value, args[0]) if len(args) == 1 else None
    if hint is bool:
        return None if isinstance(value, bool) else "true or false"
    if hint is int:
        return None if _is_int(value) else "an integer"
    if hint is float:
        return None if _is_int(value) or isinstance(value, float) else "a number"
    if hint is str:
        return None if isinstance(value, str) else "a string"
    return None


def validate_metadata(meta, path: str) -> dict:
    """`meta` after checking the types and ranges of every field loading or converting reads; ValueError
    naming the file and field. Known config fields must have their declared scalar types."""

    def bad(field: str, words: str, value) -> ValueError:
        return ValueError(f"checkpoint metadata {path}: {field} must be {words}, got {_shown(value)}")

    if not isinstance(meta, dict):
        raise bad("the file", "a JSON object", meta)
    for key in ("iteration", "consumed_samples", "layout", "config"):
        if key not in meta:
            raise ValueError(f"checkpoint metadata {path}: {key} is missing (corrupt or from another format)")
    version = meta.get("format_version", FORMAT_VERSION)
    if not _is_int(version) or not 1 <= version <= FORMAT_VERSION:
        raise bad("format_version", f"an integer from 1 to {FORMAT_VERSION}", version)
    for key in ("iteration", "consumed_samples"):
        if not _is_int(meta[key]) or meta[key] < 0:
            raise bad(key, "an integer >= 0", meta[key])
    layout = meta["layout"]
    if not isinstance(layout, dict):
        raise bad("layout", "an object", layout)
    for key in LAYOUT_KEYS:
        if key not in layout:
            raise ValueError(f"checkpoint metadata {path}: layout.{key} is missing")
        v = layout[key]
        if not _is_int(v) or v < 1:
            raise bad(f"layout.{key}", "an integer >= 1", v)
    world, mp, ep, esp = (layout[k] for k in LAYOUT_KEYS)
    if world > MAX_WORLD_SIZE:
        raise bad("layout.world_size", f"at most {MAX_WORLD_SIZE}", world)
    if world % mp or world % (ep * esp):
        raise ValueError(
            f"checkpoint metadata {path}: layout.world_size {world} must be a multiple of "
            f"tensor_model_parallel_size {mp} and of expert_model_parallel_size x "
            f"expert_sharding_parallel_size {ep * esp}"
        )
    _validate_config(meta["config"], bad)
    checksums = meta.get("checksums")
    if checksums is not None:
        if not isinstance(checksums, dict):
            raise bad("checksums", "an object", checksums)
        sums = checksums.get("sha256", {})
        if not isinstance(sums, dict):
            raise bad("checksums.sha256", "an object", sums)
        for name, digest in sums.items():
            if not isinstance(digest, str):
                raise bad(f"checksums.sha256.{name}", "a hex string", digest)
    calls = meta.get("router_calls")
    if calls is not None and not (isinstance(calls, list) and all(_is_int(c) and c >= 0 for c in calls)):
        raise bad("router_calls", "a list of integers >= 0", calls)
    for key, words in (
        ("has_optimizer_state", "true or false"),
        ("optimizer", "a string"),
        ("wandb_run_id", "a string"),
    ):
        v = meta.get(key)
        if v is not None and (not isinstance(v, bool) if key == "has_optimizer_state" else not isinstance(v, str)):
            raise bad(key, words, v)
    if "shard_specs" in meta:
        _validate_specs(meta["shard_specs"], bad)
    return meta


def _validate_config(config, bad) -> None:
    if not isinstance(config, dict):
        raise bad("config", "an object", config)
    sections = {f.name: f.default_factory for f in fields(Config)}
    for section, values in config.items():
        if section not in sections:
            continue
        if not isinstance(values, dict):
            raise bad(f"config.{section}", "an object", values)
        hints = typing.get_type_hints(sections[section])
        for name, value in values.items():
            words = _hint_words(value, hints[name]) if name in hints else None
            if words:
                raise bad(f"config.{section}.{name}", words, value)
    layers = config.get("model", {}).get("num_layers")
    if layers is not None and not 1 <= layers <= MAX_LAYERS:
        raise bad("config.model.num_layers", f"an integer from 1 to {MAX_LAYERS}", layers)


def _validate_specs(specs, bad) -> None:
    if not isinstance(specs, dict):
        raise bad("shard_specs", "an object", specs)
    for name, spec in specs.items():
        field = f"shard_specs.{name}"
        if not isinstance(spec, dict):
            raise bad(field, "an object", spec)
        shape = spec.get("full_shape")
        if not (isinstance(shape, list) and all(_is_int(d) and d >= 0 for d in shape)):
            raise bad(f"{field}.full_shape", "a list of integers >= 0", shape)
        if not isinstance(spec.get("expert"), bool):
            raise bad(f"{field}.expert", "true or false", spec.get("expert"))
        dims = spec.get("dims")
        ok = isinstance(dims, list) and all(
            isinstance(d, list)
            and len(d) == 2
            and _is_int(d[0])
            and 0 <= d[0] < len(shape)
            and isinstance(d[1], str)
            and d[1] in SPEC_KINDS
            for d in dims
        )
        if not ok:
            raise bad(f"{field}.dims", f"a list of [dimension, one of {list(SPEC_KINDS)}]", dims)


# ----------------------------------------------------------------------------- finding a checkpoint
def read_metadata(ckpt_dir: str) -> dict:
    """metadata.json of an iteration directory, validated (`validate_metadata`); errors name the file."""
    path = os.path.join(ckpt_dir, "metadata.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"checkpoint metadata {path} is missing")
    try:
        with open(path) as f:
            meta = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"checkpoint metadata {path} is corrupt (not valid JSON: {e})") from e
    return validate_metadata(meta, path)


def incomplete_reason(path: str) -> Optional[str]:
    """Why the iteration directory `path` cannot be loaded (None: metadata readable, every shard present)."""
    if not os.path.isdir(path):
        return f"{path} does not exist"
    try:
        world = int(read_metadata(path)["layout"]["world_size"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        return str(e)
    missing = [shard_name(r) for r in range(world) if not os.path.isfile(os.path.join(path, shard_name(r)))]
    if not missing:
        return None
    more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
    return f"checkpoint shard {os.path.join(path, missing[0])} is missing{more}"


def _is_complete(path: str) -> bool:
    return incomplete_reason(path) is None


def complete_iterations(root: str) -> list:
    """[(iteration, directory)] of complete checkpoints under `root`, newest first, `.old` copies last."""
    found = []
    for name in os.listdir(root) if os.path.isdir(root) else []:
        m = _ITER_RE.match(name)
        path = os.path.join(root, name)
        if m and _is_complete(path):
            found.append((int(m.group(1)), m.group(2) is not None, path))
    return [(it, path) for it, _, path in sorted(found, key=lambda x: (-x[0], x[1]))]


def latest_iteration(root: str) -> int:
    """The iteration named by `root/latest`; errors name the file."""
    path = os.path.join(root, "latest")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path} is missing (not a checkpoint directory?)")
    with open(path, "rb") as f:
        text = f.read(64).decode(errors="replace").strip()
    if not text.isdigit():
        raise ValueError(f"{path} is unreadable: {text[:20]!r} is not an iteration number")
    return int(text)


def resolve(load: str) -> str:
    """--load's checkpoint: DIR/iter_X as is, else DIR/latest's (unusable: newest complete, warned)."""
    if os.path.isfile(os.path.join(load, "metadata.json")):
        return load
    if not os.path.isdir(load):
        raise FileNotFoundError(f"--load {load}: no such checkpoint directory")
    try:
        path = iter_dir(load, latest_iteration(load))
        reason = incomplete_reason(path)
        if reason is None:
            return path
        problem = f"{os.path.join(load, 'latest')} names an unusable checkpoint ({reason})"
    except (OSError, ValueError) as e:
        problem = str(e)
    found = complete_iterations(load)
    if not found:
        raise FileNotFoundError(f"{problem}; no complete iteration exists under --load {load} to fall back to")
    it, path = found[0]
    warnings.warn(f"{problem}; skipped, using the newest complete iteration {it} ({path})")
    return path


# ----------------------------------------------------------------------------- --use-checkpoint-args
CHECKPOINT_ARGS = {
    "model": None,
    "moe": (
        "num_experts",
        "moe_layer_freq",
        "moe_router_topk",
        "moe_expert_capacity_factor",
        "moe_min_capacity",
        "moe_router_policy",
        "moe_aux_loss_coeff",
        "moe_z_loss_coeff",
        "moe_schedule",
        "moe_s1_local_capacity",
        "moe_saa",
    ),
}


def checkpoint_args(saved: dict, explicit: frozenset) -> dict:
    """{"section.field": value} --use-checkpoint-args takes from `saved`: CHECKPOINT_ARGS but `explicit`."""
    out = {}
    for section, names in CHECKPOINT_ARGS.items():
        for name in names or [f.name for f in fields(getattr(Config(), section))]:
            if f"{section}.{name}" not in explicit and name in saved.get(section, {}):
                out[f"{section}.{name}"] = saved[section][name]
    return out


def apply_checkpoint_args(cfg, meta: dict) -> list:
    """--use-checkpoint-args on `cfg` (sections rebuilt, so validated); returns the fields set."""
    explicit: frozenset[str] = getattr(cfg, "explicit_flags", frozenset())
    saved, taken = meta["config"], checkpoint_args(meta["config"], explicit)
    changed = list(taken)
    for section in CHECKPOINT_ARGS:
        sub = getattr(cfg, section)
        values = {f.name: getattr(sub, f.name) for f in fields(sub)}
        values.update({k.split(".", 1)[1]: v for k, v in taken.items() if k.split(".", 1)[0] == section})
        setattr(cfg, section, type(sub)(**values))
    if "data.tokenizer_name_or_path" not in explicit:
        path = resolve(cfg.train.load)
        carried = os.path.join(path, TOKENIZER_DIR)
        tok: Optional[str]
        if os.path.lexists(carried):
            tok = check_carried_tokenizer(carried)
        else:
            recorded = saved.get("data", {}).get("tokenizer_name_or_path")
            tok = recorded_tokenizer(recorded, path, os.path.join(path, "metadata.json"))
        if tok:
            cfg.data.tokenizer_name_or_path = tok
            changed.append("data.tokenizer_name_or_path")
    return changed


# ----------------------------------------------------------------------------- checks before loading
def _flag(section, name: str) -> str:
    f = {f.name: f for f in fields(section)}[name]
    return f.metadata.get("flag", "--" + name.replace("_", "-"))


MODEL_FIELDS = (
    "num_layers",
    "hidden_size",
    "num_attention_heads",
    "ffn_hidden_size",
    "max_position_embeddings",
    "vocab_size",
    "make_vocab_size_divisible_by",
)
MOE_FIELDS = ("num_experts", "moe_layer_freq")


def config_mismatches(meta: dict, cfg, ps) -> list:
    """["--flag: checkpoint X, this run Y", ...]: every difference that makes the tensors unloadable."""
    saved = meta["config"]
    out = []
    for section, names in (("model", MODEL_FIELDS), ("moe", MOE_FIELDS)):
        now = getattr(cfg, section)
        for name in names:
            old = saved.get(section, {}).get(name)
            if old is not None and old != getattr(now, name):
                out.append(f"{_flag(now, name)}: checkpoint {old}, this run {getattr(now, name)}")
    old_opt = saved.get("optim", {}).get("optimizer")
    has_state = meta.get("has_optimizer_state", meta.get("optimizer") is not None)
    if has_state and old_opt is not None and old_opt != cfg.optim.optimizer:
        out.append(f"--optimizer: checkpoint {old_opt} (its optimizer state), this run {cfg.optim.optimizer}")
    return out + layout_mismatches(meta, ps)


def layout_mismatches(meta: dict, ps) -> list:
    """Differences of the parallel layout, each naming the conversion tool."""
    out = []
    lay, layout = ps.layout, meta["layout"]
    now_layout = {
        "world_size": lay.world_size,
        "tensor_model_parallel_size": lay.mp,
        "expert_model_parallel_size": lay.ep,
        "expert_sharding_parallel_size": lay.esp,
    }
    for key, value in now_layout.items():
        if layout.get(key) != value:
            flag = "world size" if key == "world_size" else "--" + key.replace("_", "-")
            out.append(
                f"{flag}: checkpoint {layout.get(key)}, this run {value} (layout: convert it with "
                f"`python tools/convert_checkpoint.py reshard`)"
            )
    return out


def check_config(meta: dict, cfg, ps, path: str) -> None:
    """Raise ValueError listing every mismatch (before any tensor is read)."""
    bad = config_mismatches(meta, cfg, ps)
    if bad:
        raise ValueError(
            f"checkpoint {path} does not match this run:\n  "
            + "\n  ".join(bad)
            + "\nchange these flags (or pass --use-checkpoint-args to take the model flags from "
            "the checkpoint)"
        )


def read_shard(path: str, meta: dict) -> dict:
    """{key: tensor} of one shard after checking its SHA-256 against metadata.json."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"checkpoint shard {path} is missing")
    with open(path, "rb") as f:
        data = f.read()
    expected = (meta.get("checksums") or {}).get("sha256", {}).get(os.path.basename(path))
    if expected is not None and hashlib.sha256(data).hexdigest() != expected:
        raise ValueError(f"checkpoint shard {path} is corrupt: its SHA-256 does not match metadata.json")
    try:
        return load_bytes(data)
    except Exception as e:  # safetensors raises its own error type for truncated/garbled files
        raise ValueError(f"checkpoint shard {path} is corrupt or truncated ({e})") from e


# ----------------------------------------------------------------------------- load
def load_checkpoint(load: str, model, optimizer, ps, cfg=None) -> dict:
    """Restore model, optimizer, RNG, router counters (config checked first with `cfg`); returns metadata."""
    path = resolve(load)
    meta = read_metadata(path)
    if cfg is not None:
        check_config(meta, cfg, ps, path)
    else:
        bad = layout_mismatches(meta, ps)
        if bad:
            raise ValueError(f"checkpoint {path} was saved with another layout:\n  " + "\n  ".join(bad))
    shard = os.path.join(path, shard_name(ps.global_rank))
    tensors = read_shard(shard, meta)
    with torch.no_grad():
        for n, p in model.named_parameters():
            key = f"model/{n}"
            if key not in tensors:
                raise ValueError(f"checkpoint shard {shard}: parameter {n} missing")
            if tuple(tensors[key].shape) != tuple(p.shape):
                raise ValueError(
                    f"checkpoint shard {shard}: {n} has shape {tuple(tensors[key].shape)}, this model {tuple(p.shape)}"
                )
            p.copy_(tensors[key].to(p.device))
    names = {n: p for n, p in model.named_parameters()}
    step_on_device = bool(optimizer.defaults.get("fused") or optimizer.defaults.get("capturable"))
    for key, t in tensors.items():
        if key.startswith("optim/"):
            _, pname, state_key = key.split("/", 2)
            if pname not in names:
                raise ValueError(f"checkpoint shard {shard}: optimizer state {key} belongs to no parameter")
            p = names[pname]
            on_device = state_key != "step" or step_on_device
            optimizer.state[p][state_key] = t.to(p.device) if on_device else t.clone()
    torch.set_rng_state(tensors["rng/torch"])
    if torch.cuda.is_available() and "rng/cuda" in tensors:
        torch.cuda.set_rng_state(tensors["rng/cuda"])
    for layer, calls in zip(model.moe_layers(), meta.get("router_calls") or []):
        layer.router.calls = calls
    return meta
