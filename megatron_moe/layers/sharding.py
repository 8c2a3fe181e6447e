"""How every parameter is split across ranks, and deterministic layout-free init.

A parameter carries `_shard` (a `ShardSpec`): for each split tensor dim, the kind of group it is
split over ('mp', 'ep', 'esp'), or 'mp_qkv' for the fused QKV weight, whose dim 0 is [3, M] and is
split on the M part. The spec drives initialization (make the full tensor, keep this rank's
slice), the equivalence tests (re-assemble full tensors) and checkpoint resharding.
`coords` maps kind -> (rank in that kind's group, group size).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from megatron_moe.parallel_state import ParallelState


@dataclass(frozen=True)
class ShardSpec:
    """dims: tuple of (dim, kind); expert: synced over expert-DP instead of DP."""

    dims: tuple = ()
    expert: bool = False


Coords = dict  # kind -> (rank, size)


def tag(p: torch.nn.Parameter, spec: ShardSpec, full_shape) -> None:
    """Attach the split of `p` (its `ShardSpec`) and the shape of the full tensor to the parameter."""
    setattr(p, "_shard", spec)
    setattr(p, "_full_shape", tuple(full_shape))


def shard_spec(p: torch.Tensor) -> ShardSpec:
    """The `ShardSpec` a parameter was tagged with (`tag`); KeyError-like ValueError when untagged."""
    spec = getattr(p, "_shard", None)
    if not isinstance(spec, ShardSpec):
        raise ValueError(f"parameter of shape {tuple(p.shape)} has no shard spec (built outside make_param?)")
    return spec


def full_shape(p: torch.Tensor) -> tuple:
    """The full (unsplit) shape a parameter was tagged with."""
    return tuple(getattr(p, "_full_shape"))


def coords_of(rank: int, mp: int, ep: int, esp: int) -> Coords:
    """Group coordinates of a global rank under the layout of docs/DESIGN.md "Ranks and groups"."""
    return {"mp": (rank % mp, mp), "esp": (rank % esp, esp), "ep": ((rank // esp) % ep, ep)}


def local_shape(full_shape, spec: ShardSpec, coords: Coords) -> tuple:
    """The shape of this rank's slice of a tensor of `full_shape`."""
    shape = list(full_shape)
    for dim, kind in spec.dims:
        size = coords["mp" if kind == "mp_qkv" else kind][1]
        shape[dim] //= size
    return tuple(shape)


def shard_tensor(full: torch.Tensor, spec: ShardSpec, coords: Coords) -> torch.Tensor:
    """This rank's slice of a full tensor."""
    t = full
    for dim, kind in spec.dims:
        if kind == "mp_qkv":
            r, n = coords["mp"]
            parts = t.chunk(3, dim=dim)
            t = torch.cat([p.chunk(n, dim=dim)[r] for p in parts], dim=dim)
        else:
            r, n = coords[kind]
            if t.size(dim) % n:
                raise ValueError(f"dim {dim} of size {t.size(dim)} is not divisible by the {kind} size {n}")
            t = t.chunk(n, dim=dim)[r]
    return t.contiguous()


def unshard_tensor(pieces: dict, spec: ShardSpec) -> torch.Tensor:
    """Re-assemble a full tensor from {coords-key: slice}, keys from `coords_key`; every split kind
    must be present once per rank of its group. Merged dimension by dimension, the last split first."""
    items = dict(pieces)
    for dim, kind in reversed(spec.dims):
        k = "mp" if kind == "mp_qkv" else kind
        merged: dict = {}
        groups: dict = {}
        for key, t in items.items():
            d = dict(key)
            r = d.pop(k)
            groups.setdefault(tuple(sorted(d.items())), {})[r] = t
        for rest, by_rank in groups.items():
            ordered = [by_rank[r] for r in sorted(by_rank)]
            if kind == "mp_qkv":
                thirds = [torch.cat([p.chunk(3, dim=dim)[j] for p in ordered], dim=dim) for j in range(3)]
                merged[rest] = torch.cat(thirds, dim=dim)
            else:
                merged[rest] = torch.cat(ordered, dim=dim)
        items = merged
    return items[()]


def coords_key(coords: Coords, spec: ShardSpec) -> tuple:
    """Key of a slice in `unshard_tensor`: the rank in each kind the spec splits over."""
    kinds = sorted({"mp" if k == "mp_qkv" else k for _, k in spec.dims})
    return tuple(sorted((k, coords[k][0]) for k in kinds))


def seeded_generator(seed: int, name: str) -> torch.Generator:
    """A CPU generator whose seed depends on the run seed and the parameter name only."""
    h = int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:8], "little")
    g = torch.Generator(device="cpu")
    g.manual_seed(h & 0x7FFF_FFFF_FFFF_FFFF)
    return g


@dataclass
class InitSpec:
    """How to initialize a full tensor: 'normal' with std, 'zeros' or 'ones'."""

    kind: str = "normal"
    std: float = 0.02


def make_full(shape, init: InitSpec, seed: int, name: str) -> torch.Tensor:
    """The full initial tensor, on the host: drawn from a CPU generator seeded by (seed, name) so
    every device and layout starts from the same numbers; `make_param` moves its slice to the device."""
    if init.kind == "zeros":
        return torch.zeros(shape, device="cpu")
    if init.kind == "ones":
        return torch.ones(shape, device="cpu")
    return torch.randn(shape, generator=seeded_generator(seed, name), device="cpu") * init.std


def rank_coords(ps: "ParallelState") -> Coords:
    """Coordinates of the calling rank from a ParallelState."""
    return {k: (ps.rank(k), ps.size(k)) for k in ("mp", "ep", "esp")}


def local_pieces(model: torch.nn.Module, ps: "ParallelState", what: str = "param") -> dict:
    """{name: (coords_key, tensor)} of this rank's slices of params ('param') or grads ('grad')."""
    out = {}
    coords = rank_coords(ps)
    for name, p in model.named_parameters():
        t = p.detach() if what == "param" else (p.grad if p.grad is not None else torch.zeros_like(p))
        out[name] = (coords_key(coords, shard_spec(p)), t.detach().cpu().clone())
    return out


def assemble(per_rank: list[dict], specs: dict, atol: float = 1e-6) -> dict:
    """Full tensors from every rank's `local_pieces` output (`specs`: name -> ShardSpec).

    A slice held by several ranks (data-parallel replicas, parameters replicated over MP, ...)
    must be the same on all of them (max abs difference <= `atol`); otherwise ValueError names
    the parameter, the slice and the two ranks (positions in `per_rank`).
    """
    full = {}
    for name, spec in specs.items():
        pieces: dict = {}
        for i, d in enumerate(per_rank):
            key, t = d[name]
            first = pieces.setdefault(key, (i, t))
            if first[0] != i:
                if t.shape != first[1].shape:
                    err = float("inf")
                else:
                    err = (t.double() - first[1].double()).abs().max().item() if t.numel() else 0.0
                if not err <= atol:
                    raise ValueError(
                        f"{name}: the copy of slice {dict(key)} on rank {i} differs from rank "
                        f"{first[0]}'s by {err:.3g} (replicas must agree within {atol:g})"
                    )
        full[name] = unshard_tensor({k: t for k, (_, t) in pieces.items()}, spec)
    return full


def load_full_state(model: torch.nn.Module, full: dict, ps: "ParallelState") -> None:
    """Copy this rank's slice of every full tensor in `full` into the model's parameters."""
    coords = rank_coords(ps)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name not in full:
                raise KeyError(f"parameter {name} missing from the full state")
            src = shard_tensor(full[name], shard_spec(p), coords)
            if src.shape != p.shape:
                raise ValueError(f"{name}: slice {tuple(src.shape)} does not fit parameter {tuple(p.shape)}")
            p.copy_(src)
