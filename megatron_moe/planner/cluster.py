"""The cluster a plan is for: nodes, GPUs per node, links, memory and compute, nominal or measured.

Ranks are placed like torchrun places them: rank r on node r // gpus_per_node. A group whose ranks
all sit on one node uses the intra-node link (NVLink, PCIe); a group that spans nodes uses the
inter-node network, whose per-node bandwidth the node's GPUs share (every rank of a node runs the
same kind of collective at the same time: SPMD).

A collective of `nbytes` on a group of g ranks costs alpha + bus_bytes / bandwidth, with the
bus bytes of the ring algorithms (NCCL's busbw convention): all-reduce 2 (g - 1) / g x the
tensor, all-gather and reduce-scatter (g - 1) / g x the gathered tensor, all-to-all (g - 1) / g
x the send buffer. A group spanning nodes with r of its ranks on each node sends over the
network, per node, what its r ranks send to ranks off the node; the node's other GPUs run their
own groups of the same kind at the same time, so all gpus_per_node ranks share the NIC:
    all-to-all:  max(intra part over the intra link, gpn x nbytes (g - r) / g / inter_bw)
    ring ops:    bus bytes x max(1 / intra_bw, gpn / (r x inter_bw))
alpha is the link latency times (g - 1) (one step per peer).

A profile (`mmoe-plan profile`) replaces the nominal figures with measured ones: per link class and
collective, the latency fitted on the groups the profiling run had and the bandwidth measured at
each timed size, interpolated at the size a candidate's message has (a transport's rate depends on
the size: gloo's large all-to-alls on the emulated link sustain half the rate of its 256 KB ones;
a collective not timed, the reduce-scatter, takes the link's mean) (the inter-node figure is
stored per node, so it scales to other GPUs-per-node the same way), and per layout the measured
compute time of one micro-batch.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from typing import Optional

OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")
PROFILE_KIND = "mmoe-plan profile"

# Nominal figures per GPU kind: dense bf16 peak [TFLOP/s], memory [GiB], intra-node bandwidth
# per GPU [GB/s, one direction], intra-node latency [us], memory bandwidth [TB/s]. From the
# vendors' data sheets.
GPUS = {
    "h200": (989.0, 141.0, 450.0, 3.0, 4.8),
    "h100": (989.0, 80.0, 450.0, 3.0, 3.35),
    "a100": (312.0, 80.0, 300.0, 3.0, 2.0),
    "a100-40gb": (312.0, 40.0, 300.0, 3.0, 1.55),
    "v100": (125.0, 32.0, 150.0, 5.0, 0.9),
    "rtx4090": (165.0, 24.0, 32.0, 10.0, 1.0),
    "rtx2080ti": (54.0, 11.0, 16.0, 10.0, 0.62),
}
# Bytes the optimizer step moves per parameter: the clip's read of the gradient, then AdamW reads
# the parameter, gradient and two moments and writes the parameter and moments (fp32).
OPTIMIZER_BYTES_PER_PARAM = 4 + 4 * 4 + 3 * 4
# Share of the nominal peak a training step's GEMMs reach (bf16 GPT-2-sized GEMMs on Hopper and
# Ampere reach 40-60 % in Megatron-LM's published MFU tables); profiles replace it.
NOMINAL_EFFICIENCY = 0.45


def bus_factor(op: str, g: int) -> float:
    """Bus bytes per byte of the op's size argument on a ring of g ranks (NCCL's busbw)."""
    if g <= 1:
        return 0.0
    if op == "all_reduce":
        return 2.0 * (g - 1) / g
    if op in ("all_gather", "reduce_scatter", "all_to_all"):
        return (g - 1) / g
    raise ValueError(f"unknown collective {op!r}")


@dataclass(frozen=True)
class Link:
    """Latency [s] per peer step and bandwidth [bytes/s] (per GPU intra-node, per node inter-node);
    `ops`: measured (op, latency, bandwidth) that replace them for that collective (a profile fits
    each op: a transport's all-to-all need not reach its all-reduce's rate)."""

    latency: float
    bandwidth: float
    ops: tuple = ()  # (op, latency, ((bus bytes, bandwidth), ...) sorted by size)

    def of(self, op: str, bus_bytes: float) -> tuple[float, float]:
        """(latency, bandwidth) of collective `op` moving `bus_bytes` per rank on this link: the
        measured rate at that size, interpolated in log size between the profiled sizes (the
        nearest end outside them), else the link's figures."""
        for name, lat, points in self.ops:
            if name != op or not points:
                continue
            if bus_bytes <= points[0][0]:
                return lat, points[0][1]
            for (x0, b0), (x1, b1) in zip(points, points[1:]):
                if bus_bytes <= x1:
                    w = math.log(bus_bytes / x0) / math.log(x1 / x0)
                    return lat, b0 + w * (b1 - b0)
            return lat, points[-1][1]
        return self.latency, self.bandwidth


@dataclass
class Cluster:
    """nodes x gpus_per_node ranks; `intra` and `inter` links; memory [bytes]; `flops` [FLOP/s] the
    GEMM throughput a step reaches (nominal peak x efficiency, or measured); `compute` measured
    seconds per micro-batch per layout key (`layout_key`), empty when nominal; `source` names where
    the figures come from."""

    nodes: int
    gpus_per_node: int
    intra: Link
    inter: Link
    memory: float
    flops: float
    device: str = "nominal"
    compute: dict = field(default_factory=dict)
    source: str = "nominal"
    memory_bandwidth: float = 0.0  # bytes/s of the GPU's memory (the optimizer step's bound); 0: not known

    def __post_init__(self) -> None:
        for name in ("nodes", "gpus_per_node"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be a positive integer, got {v!r}")
        for name, link in (("intra-node", self.intra), ("inter-node", self.inter)):
            if not (link.bandwidth > 0 and math.isfinite(link.bandwidth)):
                raise ValueError(f"--{name}-gbps must be a positive number, got {link.bandwidth * 8e-9:g}")
            if not (link.latency >= 0 and math.isfinite(link.latency)):
                raise ValueError(f"--{name}-latency-us must be >= 0, got {link.latency * 1e6:g}")
        if not (self.memory > 0 and math.isfinite(self.memory)):
            raise ValueError(f"--gpu-memory-gib must be positive, got {self.memory / 2**30:g}")
        if not (self.flops > 0 and math.isfinite(self.flops)):
            raise ValueError(f"--gpu-tflops must be positive, got {self.flops * 1e-12:g}")

    @property
    def world(self) -> int:
        return self.nodes * self.gpus_per_node

    def node_of(self, rank: int) -> int:
        return rank // self.gpus_per_node

    def link_class(self, ranks: list[int]) -> str:
        """'intra' when the group's ranks share one node, 'inter' when it spans nodes, '' for one rank."""
        if len(ranks) <= 1:
            return ""
        return "intra" if len({self.node_of(r) for r in ranks}) == 1 else "inter"

    def collective(self, op: str, ranks: list[int], nbytes: float) -> float:
        """Seconds of collective `op` of `nbytes` (module docstring's size convention) on `ranks`."""
        g = len(ranks)
        cls = self.link_class(ranks)
        if not cls or nbytes <= 0:
            return 0.0
        bus = bus_factor(op, g) * nbytes
        intra_lat, intra_bw = self.intra.of(op, bus)
        if cls == "intra":
            return intra_lat * (g - 1) + bus / intra_bw
        inter_lat, inter_bw = self.inter.of(op, bus)
        per_node: dict[int, int] = {}
        for r in ranks:
            per_node[self.node_of(r)] = per_node.get(self.node_of(r), 0) + 1
        r = max(per_node.values())
        gpn = self.gpus_per_node
        if op == "all_to_all":
            local = nbytes * (r - 1) / g / intra_bw
            remote = gpn * nbytes * (g - r) / g / inter_bw
            t = max(local, remote)
        else:
            t = bus * max(1.0 / intra_bw, gpn / (r * inter_bw))
        return inter_lat * (g - 1) + t

    def describe(self) -> str:
        return (
            f"{self.nodes} nodes x {self.gpus_per_node} GPUs ({self.device}), "
            f"intra-node {self.intra.bandwidth * 8e-9:g} Gb/s per GPU / {self.intra.latency * 1e6:g} us, "
            f"inter-node {self.inter.bandwidth * 8e-9:g} Gb/s per node / {self.inter.latency * 1e6:g} us, "
            f"{self.memory / 2**30:g} GiB, GEMMs at {self.flops * 1e-12:g} TFLOP/s; figures: {self.source}"
        )


def nominal(
    nodes: int,
    gpus_per_node: int,
    gpu: str = "h100",
    intra_gbps: Optional[float] = None,
    inter_gbps: float = 400.0 * 8,
    intra_latency_us: Optional[float] = None,
    inter_latency_us: float = 10.0,
    memory_gib: Optional[float] = None,
    tflops: Optional[float] = None,
) -> Cluster:
    """A cluster from data-sheet figures: `gpu` in GPUS gives the defaults the other arguments
    override (bandwidths in Gbit/s, inter-node per node; latencies in us; tflops the peak)."""
    if gpu not in GPUS:
        raise ValueError(f"--gpu must be one of {', '.join(sorted(GPUS))}, got {gpu!r}")
    peak, mem, intra_gBps, intra_lat, hbm = GPUS[gpu]
    intra_bw = (intra_gbps / 8 * 1e9) if intra_gbps is not None else intra_gBps * 1e9
    for flag, v in (("--inter-node-gbps", inter_gbps), ("--intra-node-gbps", intra_gbps), ("--gpu-tflops", tflops)):
        if v is not None and not v > 0:
            raise ValueError(f"{flag} must be positive, got {v:g}")
    return Cluster(
        nodes,
        gpus_per_node,
        intra=Link((intra_latency_us if intra_latency_us is not None else intra_lat) * 1e-6, intra_bw),
        inter=Link(inter_latency_us * 1e-6, inter_gbps / 8 * 1e9),
        memory=(memory_gib if memory_gib is not None else mem) * 2**30,
        flops=(tflops if tflops is not None else peak) * 1e12 * NOMINAL_EFFICIENCY,
        device=gpu,
        source=f"nominal ({gpu} data sheet, GEMMs at {NOMINAL_EFFICIENCY:.0%} of peak)",
        memory_bandwidth=hbm * 1e12,
    )


@dataclass
class Profile:
    """What `mmoe-plan profile` measured: device name, GEMM throughput [FLOP/s], per link class the
    fitted latency [s per peer step] and bandwidth [bytes/s; per node for 'inter'], per layout key
    the compute seconds of one micro-batch {"forward": s, "backward": s} and of the step's clipping and
    optimizer update {"optimizer": s} (0 in profiles that did not time it), and the model flags the
    compute was timed for."""

    device: str
    flops: float
    links: dict
    compute: dict
    model: dict
    memory: float = 0.0

    def to_json(self) -> dict:
        return {"kind": PROFILE_KIND, "version": 1, **asdict(self)}

    @classmethod
    def read(cls, path: str) -> "Profile":
        try:
            with open(path) as f:
                d = json.load(f)
        except OSError as e:
            raise ValueError(f"--profile {path}: cannot read it ({e.strerror or e})") from None
        except ValueError as e:
            raise ValueError(f"--profile {path}: not JSON ({e})") from None
        if not isinstance(d, dict) or d.get("kind") != PROFILE_KIND:
            raise ValueError(f"--profile {path}: not a profile written by `mmoe-plan profile`")
        try:
            p = cls(
                str(d["device"]),
                float(d["flops"]),
                {k: dict(v) for k, v in d["links"].items()},
                {
                    k: {part: float(v.get(part, 0.0)) for part in ("forward", "backward", "optimizer")}
                    for k, v in d["compute"].items()
                },
                dict(d["model"]),
                float(d.get("memory", 0.0)),
            )
            for k, v in p.links.items():
                if k not in ("intra", "inter") or not float(v["bandwidth"]) > 0 or float(v["latency"]) < 0:
                    raise ValueError(f"link {k!r}: {v}")
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"--profile {path}: malformed ({e})") from None
        if not p.flops > 0:
            raise ValueError(f"--profile {path}: flops must be positive")
        return p

    def apply(self, base: Cluster) -> Cluster:
        """`base` with the measured figures in place of the nominal ones (links not measured stay nominal)."""
        links = {
            k: Link(float(v["latency"]), float(v["bandwidth"]), measured_rates(v.get("fits", {})))
            for k, v in self.links.items()
            if k in ("intra", "inter")
        }
        measured = sorted(links) + (["compute"] if self.compute else [])
        return Cluster(
            base.nodes,
            base.gpus_per_node,
            intra=links.get("intra", base.intra),
            inter=links.get("inter", base.inter),
            memory=self.memory or base.memory,
            flops=self.flops,
            device=self.device,
            compute=dict(self.compute),
            source=f"profile on {self.device} (measured: {', '.join(measured) or 'GEMM throughput'}; "
            f"nominal: {', '.join(k for k in ('intra', 'inter') if k not in links) or 'nothing'})",
            memory_bandwidth=base.memory_bandwidth,
        )


def measured_rates(fits: dict) -> tuple:
    """Link.ops from a profile's per-op fits: at each timed size, the bus bytes per rank and the
    bandwidth that makes `Cluster.collective` reproduce the measured time over the fitted latency
    (sizes whose time is mostly latency are left out; an op without usable sizes keeps its fitted
    rate at every size)."""
    out = []
    for op, f in sorted(fits.items()):
        g, sharers, alpha = int(f["group_size"]), float(f.get("sharers", 1)), float(f["alpha"])
        points = []
        for nbytes, t in zip(f.get("bytes", []), f.get("times", [])):
            bus = bus_factor(op, g) * float(nbytes)
            if t - alpha > 0.05 * t and bus > 0:
                points.append((bus, sharers * bus / (t - alpha)))
        if not points and float(f.get("bandwidth", 0)) > 0:
            points = [(1.0, float(f["bandwidth"]))]
        out.append((op, float(f["latency"]), tuple(sorted(points))))
    return tuple(out)


def layout_key(mp: int, ep: int, esp: int, micro_batch: int, schedule: str) -> str:
    """Key of a profiled compute time: the per-rank shapes follow from these."""
    return f"mp{mp}-ep{ep}-esp{esp}-mb{micro_batch}-{schedule}"
