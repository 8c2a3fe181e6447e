"""Rank layout and process groups for MP, DP, EP, ESP, EP x ESP and expert-DP.

Layout (docs/DESIGN.md "Ranks and groups"), world size P:
  dense part:  r = mp + N_MP * dp                      (MP groups are consecutive ranks)
  expert part: r = esp + N_ESP * (ep + N_EP * edp)     (ESP fastest, then EP, then expert-DP)

`rank_layout` is pure (rank lists, no torch.distributed). `initialize_model_parallel` turns a
layout into the groups of one `ParallelState`, which model code gets passed in.
"""

from __future__ import annotations

import gc
import os
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist

from megatron_moe.distributed.collectives import LOCAL_GROUP
from megatron_moe.distributed.comm_errors import guard, set_group_timeout
from megatron_moe.distributed.observer import name_group


@dataclass(frozen=True)
class RankLayout:
    """All groups of one layout, each a list of rank lists (sorted, disjoint, covering 0..P-1)."""

    world_size: int
    mp: int
    ep: int
    esp: int
    mp_groups: list[list[int]]
    dp_groups: list[list[int]]
    ep_groups: list[list[int]]
    esp_groups: list[list[int]]
    ep_esp_groups: list[list[int]]
    expert_dp_groups: list[list[int]]

    @property
    def dp(self) -> int:
        return self.world_size // self.mp

    @property
    def expert_dp(self) -> int:
        return self.world_size // (self.ep * self.esp)

    def group_of(self, kind: str, rank: int) -> list[int]:
        """The group of kind `kind` ('mp', 'dp', 'ep', 'esp', 'ep_esp', 'expert_dp') holding `rank`."""
        for g in getattr(self, f"{kind}_groups"):
            if rank in g:
                return g
        raise KeyError(f"rank {rank} not in any {kind} group")


def validate_degrees(
    world_size: int,
    mp: int,
    ep: int,
    esp: int,
    num_experts: Optional[int] = None,
    ffn_hidden_size: Optional[int] = None,
) -> None:
    """Raise ValueError naming the flag when the parallel degrees cannot form a layout."""
    for flag, v in (
        ("--tensor-model-parallel-size", mp),
        ("--expert-model-parallel-size", ep),
        ("--expert-sharding-parallel-size", esp),
    ):
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"{flag} must be a positive integer, got {v!r}")
    if world_size < 1:
        raise ValueError(f"world size must be positive, got {world_size}")
    if world_size % mp:
        raise ValueError(f"--tensor-model-parallel-size {mp} must divide the world size {world_size}")
    if world_size % (ep * esp):
        raise ValueError(
            f"--expert-model-parallel-size {ep} x --expert-sharding-parallel-size {esp} "
            f"= {ep * esp} must divide the world size {world_size}"
        )
    if num_experts is not None and num_experts % ep:
        raise ValueError(f"--num-experts {num_experts} must be divisible by --expert-model-parallel-size {ep}")
    if ffn_hidden_size is not None and ffn_hidden_size % esp:
        raise ValueError(
            f"--ffn-hidden-size {ffn_hidden_size} must be divisible by --expert-sharding-parallel-size {esp}"
        )


def rank_layout(world_size: int, mp: int = 1, ep: int = 1, esp: int = 1) -> RankLayout:
    """Compute every group of the layout for `world_size` ranks (pure; no process groups)."""
    validate_degrees(world_size, mp, ep, esp)
    P = world_size
    mp_groups = [list(range(d * mp, (d + 1) * mp)) for d in range(P // mp)]
    dp_groups = [list(range(m, P, mp)) for m in range(mp)]
    block = ep * esp  # ranks of one EP x ESP group
    n_edp = P // block
    esp_groups, ep_groups, ep_esp_groups = [], [], []
    for edp in range(n_edp):
        base = edp * block
        ep_esp_groups.append(list(range(base, base + block)))
        for e in range(ep):
            esp_groups.append(list(range(base + e * esp, base + (e + 1) * esp)))
        for s in range(esp):
            ep_groups.append([base + s + esp * e for e in range(ep)])
    expert_dp_groups = [list(range(j, P, block)) for j in range(block)]
    return RankLayout(P, mp, ep, esp, mp_groups, dp_groups, ep_groups, esp_groups, ep_esp_groups, expert_dp_groups)


GROUP_KINDS = ("mp", "dp", "ep", "esp", "ep_esp", "expert_dp", "world")
EXPERT_REGROUPED = ("ep", "ep_esp", "expert_dp")  # the kinds whose ranks change with EP (`relayout_experts`)


def derived_from(kind: str, base: str) -> bool:
    """True when group kind `kind` is `base` or a second communicator over its ranks named
    PREFIX_base ("lina_expert_dp" of "expert_dp"), so it follows `base` in `relayout_experts`."""
    if kind == base:
        return True
    longer = [b for b in EXPERT_REGROUPED if len(b) > len(base) and b.endswith("_" + base)]
    return kind.endswith("_" + base) and not any(kind == b or kind.endswith("_" + b) for b in longer)


@dataclass
class ParallelState:
    """torch.distributed groups of one layout, for the calling rank.

    `group(kind)` returns the ProcessGroup of this rank for kind in GROUP_KINDS
    ('world' is the default group); `rank(kind)` / `size(kind)` its rank and
    size in that group; `ranks(kind)` its global ranks.
    """

    layout: RankLayout
    global_rank: int
    backend: str
    timeout: timedelta = dist.default_pg_timeout  # every group's (--comm-timeout)
    _groups: dict = field(default_factory=dict)
    # The device of this rank's tensors (the groups' device: CUDA under NCCL, CPU under gloo).
    # Every tensor the library creates takes its device from here or from the model's parameters.
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    # groups replaced by `relayout_experts`, destroyed with the others by `destroy_model_parallel`
    retired_groups: list = field(default_factory=list)

    def group(self, kind: str):
        return self._groups[kind]

    def new_groups(self, kind: str, rank_lists: list[list[int]], backend: Optional[str] = None):
        """Create one group per rank list (collective: every rank, same order) with this state's
        timeout; keep, name and return the one holding this rank (None if none does).
        `destroy_model_parallel` destroys it with the others. The one public way to add a group."""
        if kind in self._groups:
            raise ValueError(f"a group of kind {kind!r} already exists")
        mine = None
        if self.backend == "fake":  # one process playing a rank (`megatron_moe.fake_world`): no other backend
            backend = None
        for ranks in rank_lists:
            g = dist.new_group(ranks, backend=backend or self.backend, timeout=self.timeout)
            if self.global_rank in ranks:
                mine = g
        if mine is not None:
            self._keep(kind, mine)
            name_group(mine, kind)
            set_group_timeout(mine, self.timeout.total_seconds())
        return mine

    def relayout_experts(self, ep: int) -> RankLayout:
        """Switch the expert part of the layout to EP = `ep` (MP, ESP and the world unchanged, so
        expert-DP becomes P / (ep * N_ESP)); returns the new layout. Collective (same `ep` on every
        rank): the ep, ep_esp and expert_dp groups and those `derived_from` them are remade; the
        esp groups keep their ranks. Old groups are kept for `destroy_model_parallel` (a caller may
        still hold them)."""
        lay = self.layout
        new = rank_layout(lay.world_size, lay.mp, ep, lay.esp)
        kinds = [(k, base) for k in sorted(self._groups) for base in EXPERT_REGROUPED if derived_from(k, base)]
        for kind, _ in kinds:
            self.retired_groups.append(self._groups.pop(kind))
        self.layout = new
        for kind, base in kinds:
            self.new_groups(kind, getattr(new, f"{base}_groups"))
        return new

    def has_group(self, kind: str) -> bool:
        """True when a group of `kind` is held (the layout's kinds, or one made with `new_groups`)."""
        return kind in self._groups

    def _keep(self, kind: str, group) -> None:
        """Hold an existing group (the world group, LOCAL_GROUP) under `kind`."""
        if kind in self._groups:
            raise ValueError(f"a group of kind {kind!r} already exists")
        self._groups[kind] = group

    def ranks(self, kind: str) -> list[int]:
        if kind == "world":
            return list(range(self.layout.world_size))
        return self.layout.group_of(kind, self.global_rank)

    def size(self, kind: str) -> int:
        return len(self.ranks(kind))

    def rank(self, kind: str) -> int:
        return self.ranks(kind).index(self.global_rank)


def local_state(device: torch.device | None = None) -> ParallelState:
    """A one-process state (every group is LOCAL_GROUP, size 1) on `device` (default CPU), usable
    with or without torch.distributed initialized: the one-process reference model uses it."""
    state = ParallelState(rank_layout(1), 0, "none", device=torch.device(device or "cpu"))
    for kind in GROUP_KINDS:
        state._keep(kind, LOCAL_GROUP)
    state.global_rank = 0
    return state


_STATE: Optional[ParallelState] = None


def default_group_timeout() -> timedelta:
    """The timeout the default group was created with (init_process_group's `timeout=`, which the
    trainer sets from --comm-timeout); torch's default when the backend does not tell."""
    world = dist.group.WORLD
    if world is None:
        return dist.default_pg_timeout
    for device in ("cpu", "cuda"):
        try:
            return world._get_backend(torch.device(device)).options._timeout
        except (AttributeError, RuntimeError):
            continue
    return dist.default_pg_timeout


def initialize_model_parallel(
    mp: int = 1,
    ep: int = 1,
    esp: int = 1,
    backend: Optional[str] = None,
    timeout_s: Optional[float] = None,
    device: torch.device | None = None,
) -> ParallelState:
    """Create the process groups of the layout on an initialized default group (collective: every
    rank, same order) and return this rank's state. Every group gets `timeout_s` seconds
    (--comm-timeout; None: the default group's), so a stalled peer fails a collective instead of
    waiting torch's 30 minutes. `device` (default `backend_device(backend)`): this rank's tensors.
    """
    global _STATE
    if not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialized: call init_process_group first")
    if timeout_s is not None and not timeout_s > 0:
        raise ValueError(f"--comm-timeout must be positive, got {timeout_s}")
    world, rank = dist.get_world_size(), dist.get_rank()
    layout = rank_layout(world, mp, ep, esp)
    if backend is None:
        backend = dist.get_backend()
    timeout = timedelta(seconds=timeout_s) if timeout_s is not None else default_group_timeout()
    state = ParallelState(layout, rank, backend, timeout, device=torch.device(device or backend_device(backend)))
    state._keep("world", dist.group.WORLD)
    name_group(dist.group.WORLD, "world")
    set_group_timeout(dist.group.WORLD, default_group_timeout().total_seconds())
    for kind in ("mp", "dp", "ep", "esp", "ep_esp", "expert_dp"):
        state.new_groups(kind, getattr(layout, f"{kind}_groups"))
    _STATE = state
    return state


def destroy_model_parallel() -> None:
    """Forget the current state and destroy its groups (not the default group)."""
    global _STATE
    if _STATE is not None:
        groups = [g for kind, g in _STATE._groups.items() if kind != "world"] + _STATE.retired_groups
        for g in groups:
            if g is not None:
                try:
                    dist.destroy_process_group(g)
                except Exception:
                    pass
    _STATE = None


def shutdown(barrier: bool = True) -> None:
    """End this process's communication: the one teardown of the trainer, tools and tests.

    Every rank calls it after closing its helpers (Lina's threads). `barrier=True` (a successful
    run) first waits on WORLD, so no rank tears down a connection a peer still reads. Then every
    group and the default group are destroyed and garbage is collected, so the gloo backends'
    destructors join their worker threads now: left to interpreter exit, one that needs the GIL
    aborts the process with "terminate called without an active exception".
    """
    if dist.is_initialized():
        if barrier and dist.get_world_size() > 1:
            with guard("shutdown barrier", dist.group.WORLD):
                dist.barrier()
        destroy_model_parallel()
        dist.destroy_process_group()
    gc.collect()


def resolve_device(choice: str) -> torch.device:
    """The device of a run from --device: 'cpu', 'cuda' (this process's GPU: LOCAL_RANK) or
    'auto' (CUDA when available, else CPU). The one place that decides it."""
    if choice not in ("auto", "cpu", "cuda"):
        raise ValueError(f"--device must be auto, cpu or cuda, got {choice!r}")
    if choice == "auto":
        choice = "cuda" if torch.cuda.is_available() else "cpu"
    if choice == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("--device cuda: CUDA is not available on this machine")
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def device_and_backend(device: str, backend: Optional[str]) -> tuple[torch.device, str]:
    """The run's (device, collective backend) from --device and --distributed-backend: the one place
    that decides them (the trainer and the benchmark tools call it). Backend default: the device's
    (`default_backend`); --device auto with --distributed-backend gloo stays on the CPU."""
    dev = resolve_device("cpu" if device == "auto" and backend == "gloo" else device)
    backend = backend or default_backend(dev)
    if backend == "nccl" and dev.type != "cuda":
        raise ValueError("--distributed-backend nccl needs --device cuda (NCCL has no CPU tensors)")
    return dev, backend


def default_backend(device: torch.device) -> str:
    """The collective backend of a device: NCCL for CUDA, gloo for CPU."""
    return "nccl" if device.type == "cuda" else "gloo"


def backend_device(backend: str) -> torch.device:
    """The device tensors of `backend`'s collectives live on (NCCL: this rank's GPU; else CPU)."""
    return resolve_device("cuda") if backend == "nccl" else torch.device("cpu")
