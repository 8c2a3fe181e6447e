"""Mutation check: break one behaviour of the library at a time and confirm a test notices.

Each `Mutation` is a small semantic change to one function (an exact snippet of
one file and its replacement) plus the pytest node ids that must fail when it
is applied. The check

  1. verifies that every selected snippet occurs exactly once in the tree
     (otherwise the mutation is NOT APPLICABLE: reported as an error, never
     counted as caught -- update the snippet when the code moves);
  2. copies the tree to a temporary directory and runs the mapped tests there
     unmutated (the sanity run: a test that already fails would make every
     "caught" meaningless), checking that `import megatron_moe` resolves to
     the copy;
  3. applies one mutation at a time to the copy, runs its tests with a
     timeout (cwd and PYTHONPATH = the copy, no bytecode cache), and records
     `caught` (a test failed), `missed` (all passed), `timeout`, or `error`
     (pytest could not run them: missing file, no tests collected);
  4. prints a table, optionally writes JSON, and exits 1 unless every
     mutation was caught.

Test entries are pytest arguments: a node id (`tests/test_x.py::test_y[p]`)
or a file followed by `-k EXPR` (`tests/test_x.py -k "a and not b"`). An
entry whose file does not exist yet is reported as pending and skipped; a
mutation with no runnable entry is an error.

Usage:
    python tools/mutation_check.py                 # every mutation (slow: minutes)
    python tools/mutation_check.py --list
    python tools/mutation_check.py --only clip_inverted,lr_warmup_off_by_one --json out.json
It is run by hand or nightly, not in .ci/run (docs/TESTING.md).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
T = "tests/test_mutation_targets.py::"  # the focused tests written for this check


@dataclass(frozen=True)
class Mutation:
    """One semantic mutation: replace `original` (exactly once in `path`) by `replacement`."""

    name: str
    doc: str  # the behaviour it breaks
    path: str  # file relative to the repository root
    original: str
    replacement: str
    tests: tuple[str, ...]  # pytest entries that must fail


M = Mutation
MUTATIONS: tuple[Mutation, ...] = (
    # ------------------------------------------------------------------ SAA, Lina's gate, random routing, ...
    M(
        "saa_sequential",
        "SAA made sequential: chunk i's MP all-gather is started and waited for before chunk i+1's "
        "all-to-all is issued (AAS in chunks; same values, no overlap)",
        "megatron_moe/distributed/saa.py",
        "                pending = start_a2a(*bounds[i + 1])  # chunk i+1 travels while ...\n"
        "            gathers.append((start_gather(recv, a, b), a, b))  # ... chunk i goes to the MP peers",
        "                gathers.append((start_gather(recv, a, b), a, b))\n"
        '                _wait(gathers[-1][0][1], "all_gather", mp_group)\n'
        "                pending = start_a2a(*bounds[i + 1])\n"
        "            else:\n"
        "                gathers.append((start_gather(recv, a, b), a, b))",
        (T + "test_saa_sends_the_next_chunk_before_gathering_the_previous_one", "tests/test_saa_overlap.py"),
    ),
    M(
        "lina_imminent_ignored",
        "Lina: an imminent all-to-all (backward reached the combine step) no longer closes the gate",
        "megatron_moe/distributed/lina.py",
        "self._imminent = True",
        "self._imminent = False",
        (T + "test_lina_launches_nothing_once_an_all_to_all_is_imminent", "tests/test_lina_gate.py"),
    ),
    M(
        "random_seed_drops_group",
        "random routing's seed drops the routing-group id: every data-parallel group draws the same experts",
        "megatron_moe/moe/router.py",
        "self.calls * 101 + gid)",
        "self.calls * 101)",
        (T + "test_random_routing_draws_differ_across_routing_groups_and_calls", "tests/test_random_routing.py"),
    ),
    M(
        "gate_under_bf16",
        "the gate's matmul runs under bf16 autocast instead of fp32",
        "megatron_moe/moe/router.py",
        "with torch.autocast(device_type=x_SM.device.type, enabled=False):",
        "with torch.autocast(device_type=x_SM.device.type, dtype=torch.bfloat16):",
        (T + "test_gate_logits_are_fp32_under_bf16_autocast", "tests/test_bf16.py"),
    ),
    M(
        "clip_inverted",
        "gradient clipping inverted: gradients are scaled by norm / max_norm instead of max_norm / norm",
        "megatron_moe/optim.py",
        "scale = max_norm / (norm + 1e-6)",
        "scale = (norm + 1e-6) / max_norm",
        (T + "test_clipping_scales_the_gradients_to_max_norm", "tests/test_clipping.py"),
    ),
    # ------------------------------------------------------------------ router
    M(
        "router_capacity_ignores_k",
        "capacity forgets the factor k (top-2 gets the top-1 capacity)",
        "megatron_moe/moe/router.py",
        "math.ceil(k * capacity_factor * num_tokens / num_experts)",
        "math.ceil(capacity_factor * num_tokens / num_experts)",
        ("tests/test_router.py::test_capacity_formula",),
    ),
    M(
        "router_second_choice_not_after_first",
        "top-k: choice j's slots no longer start after the choices < j of that expert",
        "megatron_moe/moe/router.py",
        "pos_ordered = pos_ordered + before.gather(1, ordered.t()).t()",
        "pos_ordered = pos_ordered + 0 * before.gather(1, ordered.t()).t()",
        (
            "tests/test_router.py::test_top2_second_choice_slots_follow_all_first_choices",
            "tests/test_topk.py::test_slots_follow_the_choice_order_rule_and_weights_renormalize",
        ),
    ),
    M(
        "router_no_renormalize",
        "top-2: kept combine weights are not renormalized to sum to 1",
        "megatron_moe/moe/router.py",
        "        g = g / denom",
        "        g = g",
        (
            "tests/test_router.py::test_top2_drop_renormalizes_the_kept_choice",
            "tests/test_router.py::test_top2_one_choice_dropped_gets_weight_one",
        ),
    ),
    M(
        "router_bpr_ascending",
        "batch-prioritized routing serves the least confident tokens first",
        "megatron_moe/moe/router.py",
        "torch.sort(-importance, stable=True)",
        "torch.sort(importance, stable=True)",
        ("tests/test_router.py::test_batch_prioritized_keeps_the_most_confident_tokens",),
    ),
    # ------------------------------------------------------------------ dispatch / combine
    M(
        "combine_ignores_weights",
        "combine sums the expert outputs without the gate weights",
        "megatron_moe/moe/dispatcher.py",
        "rows = picked * weight[:, None].to(buf_RM.dtype)",
        "rows = picked",
        ("tests/test_router.py::test_dispatch_then_combine_is_identity_times_weights_without_drops",),
    ),
    M(
        "groups_share_slots",
        "PaddedDispatcher.padded_plan puts every routing group at the same slots of the buffer (groups overwrite "
        "each other)",
        "megatron_moe/moe/dispatcher.py",
        "dispatch_index(r, G * Cs, g * Cs, every_choice=True)",
        "dispatch_index(r, G * Cs, 0, every_choice=True)",
        (T + "test_two_routing_groups_equal_two_separate_calls",),
    ),
    M(
        "baseline_expert_grad_unscaled",
        "baseline schedule: expert weight gradients not scaled by 1/N_MP (MP ranks duplicate the work)",
        "megatron_moe/moe/dispatcher.py",
        'super().__init__(ps, num_experts, layer_idx, 1.0 / ps.size("mp") if mode == "baseline" else 1.0)',
        "super().__init__(ps, num_experts, layer_idx, 1.0)",
        (T + "test_two_process_layout_matches_one_process[baseline-MP2xEP2]",),
    ),
    # ------------------------------------------------------------------ Parm
    M(
        "parm_s1_no_slot_offsets",
        "Parm S1: an MP rank's slots no longer start after the tokens of the MP ranks before it",
        "megatron_moe/moe/parm.py",
        "offset, totals = every[:r].sum(dim=0), every.sum(dim=0)",
        "offset, totals = every[:0].sum(dim=0), every.sum(dim=0)",
        (T + "test_two_process_layout_matches_one_process[s1-MP2xEP2]",),
    ),
    M(
        "parm_s1_gate_grad_not_summed",
        "Parm S1: the gate weight's gradient is not summed over MP when MP ranks gate different tokens",
        "megatron_moe/moe/router.py",
        'w = copy_to_group(self.gate_w, self.ps.group("mp")) if split_over_mp else self.gate_w',
        "w = self.gate_w",
        (T + "test_two_process_layout_matches_one_process[s1-MP2xEP2]",),
    ),
    M(
        "parm_s2_all_ranks_take_first_slots",
        "Parm S2: every MP rank keeps the first 1/N_MP of the slots instead of its own share",
        "megatron_moe/moe/dispatcher.py",
        "return s2.dump_a2a(buf_EGnCM[:, :, s2.r])",
        "return s2.dump_a2a(buf_EGnCM[:, :, 0])",
        (T + "test_two_process_layout_matches_one_process[s2-MP2xESP2]",),
    ),
    M(
        "saa_no_local_combine",
        "SAA/S2 return path: the N_ESP partial outputs are not summed (only ESP shard 0's is kept)",
        "megatron_moe/distributed/saa.py",
        ".sum(dim=1).reshape(n_ep * E_l, b - a, M)",
        "[:, 0].reshape(n_ep * E_l, b - a, M)",
        (T + "test_two_process_layout_matches_one_process[s2-MP2xESP2]",),
    ),
    # ------------------------------------------------------------------ Lancet
    M(
        "lancet_best_fit_farthest",
        "Lancet Algorithm 1: takes the dW farthest from the remaining time instead of the closest",
        "megatron_moe/lancet/wgrad_schedule.py",
        "return min(candidates, key=lambda w: abs(remaining - graph[w].cost_ms))",
        "return max(candidates, key=lambda w: abs(remaining - graph[w].cost_ms))",
        ("tests/test_lancet_alg1.py::test_issue_counter_example_hides_both_all_to_alls",),
    ),
    M(
        "lancet_no_capacity_passing",
        "Lancet partitions: a part's slots no longer start after the earlier parts' tokens (no capacity passing)",
        "megatron_moe/lancet/partitioned_moe.py",
        "self.offsets += choice_counts(expert, router.num_experts)",
        "self.offsets += 0",
        ("tests/test_lancet_runtime_units.py::test_chained_ranges_in_consecutive_moe_blocks_match_plain",),
    ),
    # ------------------------------------------------------------------ Lina, gradient sync
    M(
        "lina_forward_parameter_order",
        "Lina/GradSync: gradients are handed over in registration order, not in the reverse order backward "
        "produces them",
        "megatron_moe/distributed/grad_sync.py",
        "self._order = [(p, grad_group_kind(p)) for p in reversed(params)]",
        "self._order = [(p, grad_group_kind(p)) for p in params]",
        (T + "test_lina_micro_ops_follow_reverse_parameter_order",),
    ),
    M(
        "lina_lifo_queue",
        "Lina: the launcher takes the newest micro-op instead of the oldest (order no longer the submission order)",
        "megatron_moe/distributed/lina.py",
        "op = self._queue.popleft()",
        "op = self._queue.pop()",
        (T + "test_lina_micro_ops_follow_reverse_parameter_order",),
    ),
    M(
        "grad_sync_no_dp_average",
        "GradSync (bucketed): gradients are summed over data-parallel ranks, not averaged",
        "megatron_moe/distributed/grad_sync.py",
        "                flat.div_(self.dp)\n            off = 0",
        "                pass\n            off = 0",
        (T + "test_two_process_layout_matches_one_process[hooks-DP2]",),
    ),
    M(
        "sync_gradients_no_dp_average",
        "sync_gradients (blocking): gradients are summed over data-parallel ranks, not averaged",
        "megatron_moe/distributed/grad_sync.py",
        "            p.grad.div_(dp)",
        "            pass",
        (T + "test_two_process_layout_matches_one_process[baseline-EP2]",),
    ),
    M(
        "expert_grads_over_dp",
        "expert parameters are all-reduced over the dense DP group instead of expert-DP",
        "megatron_moe/distributed/grad_sync.py",
        'return "expert_dp" if getattr(p, "_shard", None) is not None and p._shard.expert else "dp"',
        'return "dp"',
        (T + "test_two_process_layout_matches_one_process[baseline-EP2]",),
    ),
    # ------------------------------------------------------------------ clipping, optimizer
    M(
        "grad_norm_counts_replicas",
        "global grad norm counts every replica of a shard (DP / MP copies) instead of each element once",
        "megatron_moe/optim.py",
        "            return False\n    return True",
        "            return True\n    return True",
        (T + "test_global_grad_norm_counts_every_element_once",),
    ),
    M(
        "weight_decay_on_vectors",
        "weight decay also applied to biases and LayerNorm parameters",
        "megatron_moe/optim.py",
        "return p.dim() >= 2 and name",
        "return p.dim() >= 1 and name",
        (T + "test_weight_decay_skips_biases_layernorms_and_the_position_table",),
    ),
    M(
        "weight_decay_on_expert_biases",
        "weight decay applied to expert biases [E, H] (2-D, but one vector per expert)",
        "megatron_moe/optim.py",
        'name != "wpe" and not expert_bias',
        'name != "wpe"',
        (T + "test_weight_decay_skips_biases_layernorms_and_the_position_table",),
    ),
    M(
        "weight_decay_on_wpe",
        "weight decay also applied to the position table",
        "megatron_moe/optim.py",
        'and name != "wpe" and',
        "and",
        (T + "test_weight_decay_skips_biases_layernorms_and_the_position_table",),
    ),
    M(
        "lr_warmup_off_by_one",
        "LR warmup starts at 0 (iteration / warmup) instead of lr / warmup at the first iteration",
        "megatron_moe/optim.py",
        "return lr * (iteration + 1) / warm",
        "return lr * iteration / warm",
        (T + "test_lr_schedule_warmup_then_decay_to_min_lr",),
    ),
    M(
        "lr_cosine_ignores_min_lr",
        "cosine decay ends at 0 instead of --min-lr",
        "megatron_moe/optim.py",
        "return min_lr + 0.5 * (lr - min_lr) * (1 + math.cos(math.pi * frac))",
        "return 0.5 * lr * (1 + math.cos(math.pi * frac))",
        (T + "test_lr_schedule_warmup_then_decay_to_min_lr",),
    ),
    # ------------------------------------------------------------------ checkpointing
    M(
        "ckpt_rng_not_restored",
        "loading a checkpoint does not restore the torch RNG state",
        "megatron_moe/checkpointing.py",
        'torch.set_rng_state(tensors["rng/torch"])',
        "pass",
        (T + "test_checkpoint_restores_optimizer_state_rng_and_routing_draws",),
    ),
    M(
        "ckpt_optimizer_state_not_restored",
        "loading a checkpoint drops the optimizer state (Adam moments, SGD momentum)",
        "megatron_moe/checkpointing.py",
        "optimizer.state[p][state_key] = t.to(p.device) if on_device else t.clone()",
        "pass",
        (T + "test_checkpoint_restores_optimizer_state_rng_and_routing_draws",),
    ),
    M(
        "ckpt_router_calls_not_restored",
        "loading a checkpoint does not restore the per-layer router call counters (random routing redraws)",
        "megatron_moe/checkpointing.py",
        "layer.router.calls = calls",
        "pass",
        (T + "test_checkpoint_restores_optimizer_state_rng_and_routing_draws",),
    ),
    M(
        "save_follows_links",
        "writes into a checkpoint directory no longer refuse a symbolic link (a planted `latest.tmp` link "
        "would receive the iteration number wherever it points)",
        "megatron_moe/fileio.py",
        "    if os.path.islink(path):\n        raise ValueError(",
        "    if False:\n        raise ValueError(",
        ("tests/test_reliability_links.py::test_a_latest_tmp_link_is_refused_and_its_target_is_untouched",),
    ),
    M(
        "save_lock_shared",
        "the one-writer lock on --save is taken shared: a second trainer on the same directory is not refused",
        "megatron_moe/checkpointing.py",
        "fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)",
        "fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)",
        (
            "tests/test_reliability_outputs.py::"
            "test_a_second_trainer_on_the_same_save_is_refused_naming_the_directory_and_the_holder",
        ),
    ),
    # ------------------------------------------------------------------ data sampler
    M(
        "sampler_same_shard_everywhere",
        "every data-parallel rank gets rank 0's samples (shards no longer disjoint)",
        "megatron_moe/data/sampler.py",
        "yield ids[j, self.dp_rank].tolist()",
        "yield ids[j, 0].tolist()",
        ("tests/test_data_sampler.py -k test_dp_shards_are_disjoint_and_cover_each_global_batch",),
    ),
    M(
        "sampler_resume_from_zero",
        "the sampler ignores consumed samples: a resumed run starts the data again from the beginning",
        "megatron_moe/data/sampler.py",
        "start = self.consumed_samples + t * self.global_batch_size",
        "start = t * self.global_batch_size",
        ("tests/test_data_sampler.py::test_resume_continues_the_exact_sequence",),
    ),
    M(
        "experts_fp32_gemms",
        "the experts' grouped GEMMs run in fp32 under bf16 autocast (one per expert, offsets read on the host)",
        "megatron_moe/moe/grouped.py",
        "                return torch._grouped_mm(a, b, offs=offs)",
        "                return _looped(a.float(), b.float(), offs).to(a.dtype)",
        ("tests/test_gpu_readiness.py -k test_every_gemm_but_the_routers_runs_in_bf16_and_the_host_syncs_are_pinned",),
    ),
    M(
        "one_rank_plan_reads_counts_on_the_host",
        "the one-rank plan reads its experts' offsets on the host (a device-to-host sync per layer on CUDA)",
        "megatron_moe/moe/dispatcher.py",
        "    offs = torch.cumsum(counts, 0, dtype=torch.int32).to(dev)",
        "    offs = torch.tensor(torch.cumsum(counts, 0).tolist(), dtype=torch.int32).to(dev)",
        ("tests/test_gpu_readiness.py -k test_every_gemm_but_the_routers_runs_in_bf16_and_the_host_syncs_are_pinned",),
    ),
)
del M


class NotApplicable(Exception):
    """The mutation's snippet does not occur exactly once in its file."""


def by_name() -> dict[str, Mutation]:
    """Mutations keyed by name (names are unique)."""
    out: dict[str, Mutation] = {}
    for m in MUTATIONS:
        if m.name in out:
            raise ValueError(f"duplicate mutation name {m.name!r}")
        out[m.name] = m
    return out


def apply_to_text(text: str, m: Mutation) -> str:
    """`text` with the mutation's snippet replaced; NotApplicable unless it occurs exactly once."""
    n = text.count(m.original)
    if n != 1:
        raise NotApplicable(f"{m.name}: snippet found {n} times in {m.path} (must be exactly once): {m.original!r}")
    return text.replace(m.original, m.replacement)


def apply(root: str, m: Mutation) -> str:
    """Mutate `root/m.path` in place (write to a temporary name, then rename); returns the original text."""
    path = os.path.join(root, m.path)
    if not os.path.isfile(path):
        raise NotApplicable(f"{m.name}: {m.path} does not exist")
    with open(path, encoding="utf-8") as f:
        text = f.read()
    mutated = apply_to_text(text, m)
    _write(path, mutated)
    return text


def _write(path: str, text: str) -> None:
    tmp = f"{path}.mutation-tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, path)


def entry_args(entry: str) -> list[str]:
    """pytest arguments of one test entry (a node id, or a file and -k EXPR)."""
    return shlex.split(entry)


def entry_file(entry: str) -> str:
    """The test file an entry names (the part of its first argument before '::')."""
    return entry_args(entry)[0].split("::", 1)[0]


def copy_tree(src: str, dst: str) -> None:
    """Copy the repository's files (no .git, caches, run outputs) to `dst`."""
    ignore = shutil.ignore_patterns(
        ".git",
        "__pycache__",
        "*.pyc",
        ".pytest_cache",
        ".venv",
        "runs",
        "checkpoints",
        "wandb",
        ".mypy_cache",
        ".ruff_cache",
    )
    shutil.copytree(src, dst, ignore=ignore, symlinks=True)


def _env(copy: str) -> dict:
    env = dict(os.environ)
    env.update(
        PYTHONPATH=copy, PYTHONDONTWRITEBYTECODE="1", HF_HUB_OFFLINE="1", WANDB_MODE="offline", OMP_NUM_THREADS="1"
    )
    return env


def check_import_resolves(copy: str) -> str:
    """`import megatron_moe` run inside the copy must load the copy's package; returns its path."""
    out = subprocess.run(
        [sys.executable, "-c", "import megatron_moe, os; print(os.path.realpath(megatron_moe.__file__))"],
        cwd=copy,
        env=_env(copy),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    where = out.stdout.strip()
    want = os.path.realpath(os.path.join(copy, "megatron_moe", "__init__.py"))
    if out.returncode != 0 or where != want:
        raise RuntimeError(
            f"import megatron_moe inside the copy resolved to {where!r} (want {want}): {out.stderr.strip()[-500:]}"
        )
    return where


def run_pytest(copy: str, args: list[str], timeout: float) -> tuple[str, float, str]:
    """Run pytest in the copy; returns (status, seconds, output tail).

    status: 'passed' (exit 0), 'failed' (1: a test failed; 2: collection or import error
    the mutation caused), 'timeout', or 'error' (pytest could not run: usage, no tests).
    On timeout the whole process group (pytest and the ranks it spawned) is killed.
    """
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *args]
    t0 = time.monotonic()
    proc = subprocess.Popen(
        cmd,
        cwd=copy,
        env=_env(copy),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        return "timeout", time.monotonic() - t0, output[-1500:]
    status = {0: "passed", 1: "failed", 2: "failed"}.get(proc.returncode, "error")
    return status, time.monotonic() - t0, output[-1500:]


def failures(output: str) -> list[str]:
    """The FAILED / ERROR lines of pytest's short summary (which test noticed, and why)."""
    return [line.strip()[:300] for line in output.splitlines() if line.startswith(("FAILED ", "ERROR "))]


def runnable_entries(copy: str, m: Mutation) -> tuple[list[str], list[str]]:
    """(entries whose test file exists in the copy, entries still pending)."""
    ready = [e for e in m.tests if os.path.isfile(os.path.join(copy, entry_file(e)))]
    return ready, [e for e in m.tests if e not in ready]


def _group_args(entries: list[str]) -> list[list[str]]:
    """Node ids go into one pytest call; each `-k` entry gets its own."""
    plain = sorted({e for e in entries if len(entry_args(e)) == 1})
    calls = [plain] if plain else []
    calls += [entry_args(e) for e in sorted(set(entries)) if len(entry_args(e)) > 1]
    return calls


def sanity(copy: str, mutations: list[Mutation], timeout: float) -> tuple[bool, str]:
    """The unmutated copy must pass every mapped test; returns (ok, report)."""
    entries = [e for m in mutations for e in runnable_entries(copy, m)[0]]
    for args in _group_args(entries):
        status, dt, tail = run_pytest(copy, args, timeout)
        if status != "passed":
            return False, f"sanity: unmutated tests {status} ({dt:.0f} s): {' '.join(args)}\n{tail}"
    return True, f"sanity: {len(set(entries))} mapped test entries pass unmutated"


def check_one(copy: str, m: Mutation, timeout: float) -> dict:
    """Apply `m` to the copy, run its tests, restore the file; returns the result record."""
    rec = {
        "name": m.name,
        "path": m.path,
        "doc": m.doc,
        "tests": list(m.tests),
        "pending": [],
        "status": "",
        "seconds": 0.0,
        "failed": [],
        "detail": "",
    }
    ready, rec["pending"] = runnable_entries(copy, m)
    if not ready:
        rec.update(status="error", detail="none of its test files exists")
        return rec
    try:
        original = apply(copy, m)
    except NotApplicable as e:
        rec.update(status="not-applicable", detail=str(e))
        return rec
    try:
        status, dt, tail = "passed", 0.0, ""
        for args in _group_args(ready):
            status, dt1, tail = run_pytest(copy, args, timeout)
            dt += dt1
            if status != "passed":
                break
    finally:
        _write(os.path.join(copy, m.path), original)
    result = {"failed": "caught", "passed": "missed"}.get(status, status)
    rec.update(
        status=result,
        seconds=round(dt, 1),
        failed=failures(tail),
        detail="" if result in ("caught", "missed") else tail,
    )
    return rec


def table(records: list[dict]) -> str:
    """A plain-text table: mutation, file, result, seconds."""
    w = max([len(r["name"]) for r in records] + [8])
    f = max([len(r["path"]) for r in records] + [4])
    lines = [f"{'mutation':<{w}}  {'file':<{f}}  {'result':<14}  {'s':>6}", "-" * (w + f + 28)]
    for r in records:
        lines.append(f"{r['name']:<{w}}  {r['path']:<{f}}  {r['status']:<14}  {r['seconds']:>6.1f}")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--only", default="", help="comma-separated mutation names (default: all)")
    p.add_argument("--json", default="", metavar="PATH", help="write the results as JSON to PATH")
    p.add_argument("--list", action="store_true", help="list the mutations and exit")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per pytest call (default 600)")
    return p.parse_args(argv)


def select(only: str) -> list[Mutation]:
    """The mutations named in `only` (all when empty); ValueError naming --only otherwise."""
    muts = by_name()
    if not only:
        return list(MUTATIONS)
    names = [n.strip() for n in only.split(",") if n.strip()]
    unknown = [n for n in names if n not in muts]
    if unknown:
        raise ValueError(f"--only: unknown mutation(s) {', '.join(unknown)} (see --list)")
    return [muts[n] for n in names]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        chosen = select(args.only)
        if args.timeout <= 0:
            raise ValueError(f"--timeout must be positive, got {args.timeout:g}")
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.list:
        for m in chosen:
            print(f"{m.name}  [{m.path}]\n    {m.doc}\n    tests: {', '.join(m.tests)}")
        return 0
    started = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    records: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="mutation-check-") as tmp:
        copy = os.path.join(tmp, "repo")
        copy_tree(ROOT, copy)
        print(f"copy of {ROOT} in {copy}; megatron_moe from {check_import_resolves(copy)}", flush=True)
        applicable = []
        for m in chosen:  # fail loudly before spending time on tests
            try:
                with open(os.path.join(copy, m.path), encoding="utf-8") as f:
                    apply_to_text(f.read(), m)
                applicable.append(m)
            except (NotApplicable, OSError) as e:
                records.append(
                    {
                        "name": m.name,
                        "path": m.path,
                        "doc": m.doc,
                        "tests": list(m.tests),
                        "pending": [],
                        "status": "not-applicable",
                        "seconds": 0.0,
                        "failed": [],
                        "detail": str(e),
                    }
                )
                print(f"NOT APPLICABLE: {e}", flush=True)
        ok, report = sanity(copy, applicable, args.timeout)
        print(report, flush=True)
        if not ok:
            print(
                "error: the unmutated copy fails its mapped tests; no mutation result would mean anything",
                file=sys.stderr,
            )
            return 1
        for m in applicable:
            rec = check_one(copy, m, args.timeout)
            records.append(rec)
            print(
                f"{rec['name']:<40} {rec['status']:<14} {rec['seconds']:6.1f} s"
                + (f"  pending: {', '.join(rec['pending'])}" if rec["pending"] else ""),
                flush=True,
            )
            if rec["failed"]:
                print(f"    {rec['failed'][0][:160]}", flush=True)
            if rec["detail"] and rec["status"] not in ("caught", "missed"):
                print(rec["detail"], flush=True)
    order = {m.name: i for i, m in enumerate(chosen)}
    records.sort(key=lambda r: order[r["name"]])
    print()
    print(table(records))
    bad = [r for r in records if r["status"] != "caught"]
    print(f"\n{len(records) - len(bad)} of {len(records)} mutations caught ({started})")
    if args.json:
        out = {
            "date": started,
            "command": "python tools/mutation_check.py " + " ".join(argv or sys.argv[1:]),
            "caught": len(records) - len(bad),
            "total": len(records),
            "results": records,
        }
        tmp_path = f"{args.json}.tmp-{os.getpid()}"
        with open(tmp_path, "w") as f:
            json.dump(out, f, indent=1)
        os.replace(tmp_path, args.json)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
