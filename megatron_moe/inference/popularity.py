"""Lina's expert-popularity estimation (paper section 5.2): path profile, eq. (1), placement.

Legend: E experts per MoE layer, k experts per token (top-k), l path length, N devices (ranks of
the expert all-to-all group), N_t tokens of a batch.

Profile. A token's *path* before MoE layer m (0-based among MoE layers) is its first-choice expert at
each of the previous p = min(l, m) MoE layers. Per layer m and path the profile counts the tokens and
how often each expert is in their top-k at m; P_path(e) = count(e) / (k * tokens); an unseen path falls
back to the layer's overall distribution. JSON with a model fingerprint (`check_profile`).

Estimation (eq. 1). Each token looks up its path and keeps the probabilities of that path's
top-k experts; n_e = N * sum_t P_j(t)(e) / N_t devices for expert e.

Placement (`plan_placement`): experts with n_e >= 1 are popular and get round(n_e) replicas on
devices of their own; the others (0 < n_e < 1) are packed first-fit-decreasing into devices of
capacity 1 holding at most `max_per_rank` experts (at least E / N). Over N devices, replicas go
one at a time (the one whose removal leaves the least load per remaining replica), unless keeping
every replica and packing the others least-loaded onto the devices left gives a less loaded
busiest device; with one replica each and still too many, everything is packed onto the N devices
largest first, each into the least-loaded device with room (`least_loaded`). Experts with no
estimate fill the free devices, else the device of least estimated load (the paper: at random);
free devices left over take extra replicas of the expert with the highest load per replica. A
replica set splits its expert's tokens evenly.

Phase 2 (`traffic_aware_replan`): candidates are priced by compute and link rows (`layer_cost`);
phase 1's placement is kept unless one costs less (a re-plan may move a replica off its tokens' device).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from dataclasses import dataclass, field
from typing import Optional

import torch

from megatron_moe.config import Config

PROFILE_FORMAT = "megatron_moe.expert_paths"
PROFILE_VERSION = 1


def model_fingerprint(cfg: Config, gate_weights: list[torch.Tensor]) -> dict:
    """What a profile must match: the model's shape and the SHA-256 of its gate weights [E, M] (fp32)."""
    h = hashlib.sha256()
    for w in gate_weights:
        h.update(w.detach().to(device="cpu", dtype=torch.float32).contiguous().numpy().tobytes())
    out = {k: getattr(cfg.model, k) for k in ("num_layers", "hidden_size", "vocab_size")}
    out.update({k: getattr(cfg.moe, k) for k in ("num_experts", "moe_router_topk", "moe_layer_freq")})
    return {**out, "gates_sha256": h.hexdigest()}


def unique_rows(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(distinct rows [U, p], index of each row's distinct row [N]); p = 0: one empty row."""
    if rows.size(1) == 0:
        return (
            torch.zeros((1, 0), dtype=torch.long, device=rows.device),
            torch.zeros(rows.size(0), dtype=torch.long, device=rows.device),
        )
    return torch.unique(rows, dim=0, return_inverse=True)


@dataclass
class PathProfile:
    """Per MoE layer m: path -> (tokens, counts [E] of top-k choices at layer m)."""

    fingerprint: dict
    path_length: int
    num_experts: int
    top_k: int
    tokens: list[dict[tuple[int, ...], int]] = field(default_factory=list)
    counts: list[dict[tuple[int, ...], list[int]]] = field(default_factory=list)
    _tables: dict = field(default_factory=dict, init=False, repr=False, compare=False)  # token_popularity's lookups

    @property
    def num_layers(self) -> int:
        return len(self.counts)

    def path_len(self, m: int) -> int:
        """Experts in the path before MoE layer m: min(l, m)."""
        return min(self.path_length, m)

    def distribution(self, m: int, path: tuple[int, ...]) -> list[float]:
        """P_path(e) at MoE layer m (the layer's overall distribution for a path never seen)."""
        E = self.num_experts
        c = self.counts[m].get(tuple(path))
        if c is None:
            c = [sum(v[e] for v in self.counts[m].values()) for e in range(E)]
        total = sum(c)
        return [x / total for x in c] if total else [0.0] * E

    # ------------------------------------------------------------------ collection
    def add(self, first_choices: list[torch.Tensor], experts: list[torch.Tensor]) -> None:
        """Count a batch: per MoE layer, each token's first choice [N] and top-k experts [N, k]."""
        if not self.counts:
            self.tokens, self.counts = [{} for _ in experts], [{} for _ in experts]
        E = self.num_experts
        self._tables.clear()
        for m, exp in enumerate(experts):
            p = self.path_len(m)
            hist = (
                torch.stack([first_choices[j].cpu() for j in range(m - p, m)], dim=1)
                if p
                else torch.zeros((exp.size(0), 0), dtype=torch.long, device="cpu")
            )
            keys, inverse = unique_rows(hist)
            exp_cpu = exp.cpu()
            for u in range(keys.size(0)):
                rows = inverse == u
                path = tuple(int(x) for x in keys[u])
                add = torch.bincount(exp_cpu[rows].reshape(-1), minlength=E).tolist()
                old = self.counts[m].get(path, [0] * E)
                self.counts[m][path] = [a + b for a, b in zip(old, add)]
                self.tokens[m][path] = self.tokens[m].get(path, 0) + int(rows.sum())

    # ------------------------------------------------------------------ estimation
    def token_popularity(self, m: int, paths: torch.Tensor) -> torch.Tensor:
        """[N_t, E] P_path(e) of each token's path (`paths` [N_t, p]), 0 outside that path's top-k."""
        E = self.num_experts
        if paths.size(0) == 0:
            return torch.zeros((0, E), dtype=torch.float64, device="cpu")
        seen, table = self._table(m)
        U, p = seen.size(0), seen.size(1)
        paths = paths.cpu()
        if E**p < 2**62:  # a path as a base-E number: seen paths are sorted, so a binary search finds it
            digits = torch.tensor([E ** (p - 1 - j) for j in range(p)], dtype=torch.long, device="cpu")
            seen_code, code = (seen * digits).sum(dim=1), (paths * digits).sum(dim=1)
            at = torch.searchsorted(seen_code, code).clamp(max=max(U - 1, 0))
            found = seen_code[at] == code if U else torch.zeros_like(code, dtype=torch.bool)
            return table[torch.where(found, at, torch.full_like(at, U))]  # row U: never seen
        # distinct rows of seen and asked paths together: each asked path finds its seen row (or none)
        _, inverse = unique_rows(torch.cat([seen, paths]))
        row_of = torch.full((int(inverse.max()) + 1,), U, dtype=torch.long, device="cpu")  # U: never seen
        row_of[inverse[:U]] = torch.arange(U, device="cpu")
        return table[row_of[inverse[U:]]]

    def _table(self, m: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(seen paths [U, p], top-k-kept P_path [U + 1, E], last row for unseen paths); cached per layer."""
        if m not in self._tables:
            E, k, p = self.num_experts, self.top_k, self.path_len(m)
            keys = sorted(self.counts[m])
            seen = torch.tensor(keys, dtype=torch.long, device="cpu").view(len(keys), p)
            rows = [self.distribution(m, key) for key in keys] + [self.distribution(m, (-1,) * p)]
            dist = torch.tensor(rows, dtype=torch.float64, device="cpu").view(len(rows), E)
            top = torch.topk(dist, min(k, E), dim=1).indices
            self._tables[m] = (seen, torch.zeros_like(dist).scatter(1, top, dist.gather(1, top)))
        return self._tables[m]


def devices_per_expert(popularity_sum: torch.Tensor, num_tokens: int, num_devices: int) -> list[float]:
    """Eq. (1): n_e = N * sum_t P(e) / N_t from the summed token popularities [E]."""
    if num_tokens == 0:
        return [0.0] * popularity_sum.numel()
    return [num_devices * float(x) / num_tokens for x in popularity_sum]


# ----------------------------------------------------------------------------- placement
@dataclass
class Placement:
    """hosts[e]: the devices running expert e, in replica order (its tokens split evenly among them)."""

    hosts: list[list[int]]

    def experts_of(self, device: int) -> list[int]:
        return [e for e, h in enumerate(self.hosts) if device in h]


def device_rows(placement: Placement, counts: list[int], num_devices: int) -> list[int]:
    """Expert rows each device computes when expert e's `counts[e]` choices split evenly over its replicas."""
    rows = [0] * num_devices
    for e, hosts in enumerate(placement.hosts):
        c, r = int(counts[e]), len(hosts)
        for j, d in enumerate(hosts):
            rows[d] += (j + 1) * c // r - j * c // r
    return rows


def static_placement(num_experts: int, num_devices: int) -> Placement:
    """The trained layout: expert e on device e // (E / N)."""
    per = num_experts // num_devices
    return Placement([[e // per] for e in range(num_experts)])


def first_fit_decreasing(items: list[tuple[int, float]], capacity: float, max_items: int) -> list[list[int]]:
    """Bins' experts: (expert, size) largest first (ties: lower id), each into the first bin with room."""
    bins: list[list[int]] = []
    loads: list[float] = []
    for e, size in sorted(items, key=lambda it: (-it[1], it[0])):
        for b in range(len(bins)):
            if loads[b] + size <= capacity + 1e-12 and len(bins[b]) < max_items:
                bins[b].append(e)
                loads[b] += size
                break
        else:
            bins.append([e])
            loads.append(size)
    return bins


def least_loaded(items: list[tuple[int, float]], num_bins: int, max_items: int) -> list[list[int]]:
    """`num_bins` bins: (expert, size) largest first, each into the least-loaded bin with < max_items."""
    bins: list[list[int]] = [[] for _ in range(num_bins)]
    loads = [0.0] * num_bins
    for e, size in sorted(items, key=lambda it: (-it[1], it[0])):
        b = min((b for b in range(num_bins) if len(bins[b]) < max_items), key=lambda b: (loads[b], b))
        bins[b].append(e)
        loads[b] += size
    return bins


def device_loads(devices: list[list[int]], n_e: list[float]) -> list[float]:
    """Each device's load when expert e's n_e splits evenly over the devices holding it."""
    count = {e: sum(e in d for d in devices) for d in devices for e in d}
    return [sum(n_e[e] / count[e] for e in d) for d in devices]


def max_load(devices: list[list[int]], n_e: list[float]) -> float:
    """The busiest device's load (`device_loads`)."""
    return max(device_loads(devices, n_e), default=0.0)


def plan_placement(n_e: list[float], num_devices: int, max_per_rank: int) -> Placement:
    """Replicate popular experts, pack unpopular ones (module docstring)."""
    E, N = len(n_e), num_devices
    if max_per_rank < 1:
        raise ValueError(f"--max-experts-per-rank must be >= 1, got {max_per_rank}")
    max_per_rank = max(max_per_rank, -(-E // N))  # never fewer than the trained layout holds
    replicas = {e: max(1, int(math.floor(n + 0.5))) for e, n in enumerate(n_e) if n >= 1.0}
    small = [(e, n) for e, n in enumerate(n_e) if 0.0 < n < 1.0]
    bins = first_fit_decreasing(small, 1.0, max_per_rank)
    # too many devices: the other candidate keeps every replica, packs the rest least-loaded
    left = N - sum(replicas.values())
    keep = None
    if sum(replicas.values()) + len(bins) > N and small and left >= 1 and left * max_per_rank >= len(small):
        keep = [[e] for e in sorted(replicas, key=lambda e: (-n_e[e], e)) for _ in range(replicas[e])]
        keep += least_loaded(small, left, max_per_rank)
    while sum(replicas.values()) + len(bins) > N and any(r > 1 for r in replicas.values()):
        e = min((e for e, r in replicas.items() if r > 1), key=lambda e: (n_e[e] / (replicas[e] - 1), e))
        replicas[e] -= 1
    devices: list[list[int]] = []
    if sum(replicas.values()) + len(bins) > N:  # one replica each and still too many: repack all
        devices = [b for b in least_loaded([(e, n) for e, n in enumerate(n_e) if n > 0.0], N, max_per_rank) if b]
        replicas = {}
    else:
        for e in sorted(replicas, key=lambda e: (-n_e[e], e)):
            devices += [[e] for _ in range(replicas[e])]
        devices += bins
    if keep is not None and max_load(keep, n_e) < max_load(devices, n_e):
        devices = [d for d in keep if d]
    used = len(devices)
    devices += [[] for _ in range(N - used)]
    zero = [e for e, n in enumerate(n_e) if n <= 0.0]
    free = list(range(used, N))
    for i, e in enumerate(zero):
        spots = [d for d in free if len(devices[d]) < max_per_rank] if free else []
        if spots:
            target = min(spots, key=lambda d: (len(devices[d]), d))
        else:  # the least estimated load (ties: fewest experts, lower device)
            if all(len(dd) >= max_per_rank for dd in devices):  # replicas took every slot: drop one
                most = max(range(E), key=lambda x: (sum(x in dd for dd in devices), -x))
                devices[max(d for d in range(N) if most in devices[d])].remove(most)
            load = device_loads(devices, n_e)
            target = min(
                (d for d in range(N) if len(devices[d]) < max_per_rank), key=lambda d: (load[d], len(devices[d]), d)
            )
        devices[target].append(e)
    count = {e: sum(e in d for d in devices) for e in range(E)}
    for d in range(N):  # still empty: one more replica of the busiest
        if not devices[d]:
            busiest = max((e for e in range(E) if n_e[e] > 0), key=lambda e: (n_e[e] / count[e], -e), default=None)
            if busiest is None:
                break
            devices[d].append(busiest)
            count[busiest] += 1
    return Placement([[d for d in range(N) if e in devices[d]] for e in range(E)])


def top_experts(load: list[float], n: int) -> set[int]:
    """The n experts with the highest load (ties: lower expert id)."""
    return set(sorted(range(len(load)), key=lambda e: (-load[e], e))[:n])


# ----------------------------------------------------------------------------- traffic-aware phase 2
def link_rows(placement: Placement, counts_DE: list[list[int]]) -> tuple[list[int], list[int]]:
    """(rows each device sends to other devices, rows each receives from them) in the dispatch
    all-to-all: expert e's choices, in (source device, token) order, split evenly over its replicas
    (replica j takes indices [j c // r, (j + 1) c // r) of its c choices); a choice whose replica sits
    on its own device stays off the link. The combine all-to-all sends the same rows back."""
    D = len(counts_DE)
    sent, recv = [0] * D, [0] * D
    for e, hosts in enumerate(placement.hosts):
        c, r = sum(counts_DE[s][e] for s in range(D)), len(hosts)
        lo = 0
        for s in range(D):
            n = counts_DE[s][e]
            for j, d in enumerate(hosts):
                if d == s:
                    continue
                a, b = j * c // r, (j + 1) * c // r
                x = max(0, min(b, lo + n) - max(a, lo))
                sent[s] += x
                recv[d] += x
            lo += n
    return sent, recv


def layer_cost(placement: Placement, counts_DE: list[list[int]], row_s: float, link_row_s: float) -> float:
    """Modelled time [s]: busiest device's rows x `row_s` + busiest sender's/receiver's link rows x `link_row_s`."""
    D = len(counts_DE)
    rows = device_rows(placement, [sum(counts_DE[s][e] for s in range(D)) for e in range(len(placement.hosts))], D)
    sent, recv = link_rows(placement, counts_DE)
    return max(rows, default=0) * row_s + (max(sent, default=0) + max(recv, default=0)) * link_row_s


def add_replicas(
    placement: Placement, counts_DE: list[list[int]], max_per_rank: int, row_s: float, link_row_s: float
) -> Placement:
    """Greedy: add the replica that lowers `layer_cost` most (<= `max_per_rank` per device) until none does."""
    hosts = [list(h) for h in placement.hosts]
    D = len(counts_DE)
    held = [sum(d in h for h in hosts) for d in range(D)]
    cost = layer_cost(Placement(hosts), counts_DE, row_s, link_row_s)
    while True:
        best: Optional[tuple[float, int, int]] = None
        for e in range(len(hosts)):
            if not any(counts_DE[s][e] for s in range(D)):
                continue
            for d in range(D):
                if d in hosts[e] or held[d] >= max_per_rank:
                    continue
                trial = Placement([sorted(h + [d]) if i == e else h for i, h in enumerate(hosts)])
                c = layer_cost(trial, counts_DE, row_s, link_row_s)
                if c < cost and (best is None or c < best[0]):
                    best = (c, e, d)
        if best is None:
            return Placement(hosts)
        cost, e, d = best
        hosts[e] = sorted(hosts[e] + [d])
        held[d] += 1


def traffic_aware_replan(
    kept: Placement, counts_DE: list[list[int]], max_per_rank: int, row_s: float, link_row_s: float
) -> tuple[Placement, str]:
    """Phase 2 (module docstring): the lowest `layer_cost` of `kept` (phase 1's placement), the
    re-plan from the actual counts, each with replicas added (`add_replicas`), and every chosen expert
    on every device where `max_per_rank` allows; ties to the first in that order. Returns (placement,
    which): which is "keep", "keep+replicas", "replan", "replan+replicas" or "everywhere"."""
    D = len(counts_DE)
    actual = [float(sum(counts_DE[s][e] for s in range(D))) for e in range(len(kept.hosts))]
    total = max(sum(actual), 1.0)
    replan = plan_placement([D * a / total for a in actual], D, max_per_rank)
    limit = max(max_per_rank, -(-len(kept.hosts) // D))
    cands = [
        ("keep", kept),
        ("keep+replicas", add_replicas(kept, counts_DE, limit, row_s, link_row_s)),
        ("replan", replan),
        ("replan+replicas", add_replicas(replan, counts_DE, limit, row_s, link_row_s)),
    ]
    # every chosen expert on every device (limit allowing): one-at-a-time additions may not reach it
    chosen = [e for e, a in enumerate(actual) if a > 0]
    everywhere = [list(range(D)) if a > 0 else list(kept.hosts[e]) for e, a in enumerate(actual)]
    if all(sum(d in h for h in everywhere) <= limit for d in range(D)) and chosen:
        cands.append(("everywhere", Placement(everywhere)))
    costs = [layer_cost(p, counts_DE, row_s, link_row_s) for _, p in cands]
    best = min(range(len(cands)), key=lambda i: (costs[i], i))  # the first of the cheapest
    return cands[best][1], cands[best][0]


# ----------------------------------------------------------------------------- files
def save_profile(profile: PathProfile, path: str) -> None:
    """Write the profile as JSON (temporary name, then rename)."""
    doc = {
        "format": PROFILE_FORMAT,
        "version": PROFILE_VERSION,
        "model": profile.fingerprint,
        "path_length": profile.path_length,
        "num_experts": profile.num_experts,
        "top_k": profile.top_k,
        "layers": [
            {
                "path_length": profile.path_len(m),
                "paths": {
                    "-".join(map(str, p)): {"tokens": profile.tokens[m][p], "counts": c}  # '' for the empty path
                    for p, c in sorted(profile.counts[m].items())
                },
            }
            for m in range(profile.num_layers)
        ],
    }
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=1)
    os.replace(tmp, path)


def load_profile(path: str) -> PathProfile:
    """Read a profile written by `save_profile` (JSON; nothing is executed)."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"--lina-inference {path} does not exist")
    try:
        with open(path) as f:
            doc = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"--lina-inference {path} is not a JSON expert-path profile ({e})") from None
    if not isinstance(doc, dict) or doc.get("format") != PROFILE_FORMAT or doc.get("version") != PROFILE_VERSION:
        raise ValueError(
            f"--lina-inference {path} is not a {PROFILE_FORMAT} v{PROFILE_VERSION} file "
            f"(make one with tools/profile_expert_paths.py)"
        )
    prof = PathProfile(doc["model"], int(doc["path_length"]), int(doc["num_experts"]), int(doc["top_k"]))
    for layer in doc["layers"]:
        parse = lambda s: tuple(int(x) for x in s.split("-")) if s else ()  # noqa: E731
        prof.tokens.append({parse(k): int(v["tokens"]) for k, v in layer["paths"].items()})
        prof.counts.append({parse(k): [int(x) for x in v["counts"]] for k, v in layer["paths"].items()})
    return prof


def check_profile(profile: PathProfile, fingerprint: dict, path: str, num_moe_layers: Optional[int] = None) -> None:
    """ValueError naming the file when `profile` was made for another model."""
    diff = sorted(
        k for k in set(fingerprint) | set(profile.fingerprint) if fingerprint.get(k) != profile.fingerprint.get(k)
    )
    if diff or (num_moe_layers is not None and profile.num_layers != num_moe_layers):
        raise ValueError(
            f"--lina-inference {path} was profiled on another model (differs in {diff or 'MoE layers'}); "
            f"profile this checkpoint with tools/profile_expert_paths.py"
        )


@torch.no_grad()
def collect_profile(model, batches, path_length: int, fingerprint: dict) -> PathProfile:
    """Profile `model` (one-process GPT2MoE, dropless) over `batches` of ids [B, T]."""
    if path_length < 0:
        raise ValueError(f"--path-length must be >= 0, got {path_length}")
    moe = model.moe_layers()
    if not moe:
        raise ValueError("the model has no MoE layer: there is no expert popularity to profile")
    prof = PathProfile(fingerprint, path_length, moe[0].num_experts, moe[0].router.k)
    for ids in batches:
        model(ids)
        experts = [torch.cat([r.expert for r in layer.router.last_routes]) for layer in moe]
        prof.add([e[:, 0] for e in experts], experts)
    return prof


def calibration_batches(
    ids: list[int], seq_length: int, batch_size: int, max_batches: int, device: torch.device
) -> list[torch.Tensor]:
    """Up to `max_batches` batches of `batch_size` windows of `seq_length` ids (partial last batch kept)."""
    if seq_length < 1 or batch_size < 1 or max_batches < 1:
        raise ValueError("--seq-length, --batch-size and --max-batches must be >= 1")
    n = min(len(ids) // seq_length, batch_size * max_batches)
    if n == 0:
        raise ValueError(
            f"the calibration text holds {len(ids)} tokens, fewer than one --seq-length {seq_length} window"
        )
    rows = torch.tensor(ids[: n * seq_length], dtype=torch.long, device=device).view(n, seq_length)
    return list(rows.split(batch_size))
