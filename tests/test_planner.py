"""mmoe-plan (`megatron_moe.planner`, `megatron_moe.cli.plan`) against the trainer it plans for.

The candidates it enumerates are exactly the layouts the trainer accepts; its parameter and
optimizer-state counts equal the real model's on every rank; its per-step communication volumes
equal what the collectives observer records in a real training step on gloo; the plan is
deterministic; bad cluster descriptions end with one `error: ...` line naming the flag and exit 2;
and the plan for the gpt2-s MoE on 8 x 8 GPUs emits a torchrun line the trainer accepts.
"""

from __future__ import annotations

import contextlib
import copy
import io
import itertools
import json
import os
import re
import shlex
import subprocess
import sys

import pytest
import torch

from megatron_moe.arguments import parse_args, validate
from megatron_moe.cli.plan import main
from megatron_moe.config import Config
from megatron_moe.fake_world import fake_world
from megatron_moe.model.gpt2 import GPT2MoE
from megatron_moe.optim import build_optimizer
from megatron_moe.optimizations import check_combination
from megatron_moe.parallel_state import initialize_model_parallel
from megatron_moe.planner.cluster import nominal
from megatron_moe.planner.memory import memory, optimizer_bytes_per_param, params_per_rank
from megatron_moe.planner.predict import Candidate, Predictor, enumerate_candidates
from megatron_moe.testing import spawn

FLAG = re.compile(r"--[a-z][a-z0-9-]+")


def _is_expert(p: torch.nn.Parameter) -> bool:
    return getattr(p, "_shard", None) is not None and p._shard.expert


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


# ----------------------------------------------------------------------------- enumeration


def _enum_config(world: int) -> tuple[Config, float | None]:
    """A model per world size whose heads, experts, FFN, vocabulary and batch reject some layouts."""
    cfg = Config()
    m, moe, t = cfg.model, cfg.moe, cfg.train
    m.vocab_size, m.num_layers, m.seq_length, m.max_position_embeddings = 1000, 2, 16, 16
    skew = None
    if world == 4:
        # heads 2: MP4 rejected; 6 experts: EP4 rejected; global batch 4 of micro-batches of 2:
        # DP4 (MP1) rejected; Lina's packing cannot be combined with Lancet
        m.hidden_size, m.num_attention_heads, m.ffn_hidden_size = 64, 2, 96
        moe.num_experts = 6
        t.micro_batch_size, t.global_batch_size = 2, 4
        cfg.opts.lina_packing = True
    elif world == 6:
        # heads 3: MP2 and MP6 rejected; MP3 passes validate but the padded vocabulary 1024 is not
        # divisible by 3 (the model's check); 4 experts: EP3 and EP6 rejected
        m.hidden_size, m.num_attention_heads, m.ffn_hidden_size = 96, 3, 192
        moe.num_experts = 4
        t.micro_batch_size, t.global_batch_size = 1, 6
    else:
        # heads 4: MP8 rejected; FFN 100: ESP8 rejected; dropless with a skew: Pro-Prophet candidates
        # (rejected below EP 2 and above --pro-prophet-n), Lancet cannot be combined with dropless
        m.hidden_size, m.num_attention_heads, m.ffn_hidden_size = 64, 4, 100
        moe.num_experts, moe.moe_dropless = 8, True
        t.micro_batch_size, t.global_batch_size = 2, 16
        skew = 1.0
    return cfg, skew


def _trainer_config(cfg: Config, c: Candidate) -> Config:
    out = copy.deepcopy(cfg)
    p, o = out.parallel, out.opts
    p.tensor_model_parallel_size, p.expert_model_parallel_size, p.expert_sharding_parallel_size = c.mp, c.ep, c.esp
    o.lancet_wgrad, o.lina, o.pro_prophet = c.opts["lancet"], c.opts["lina"], c.opts["pro_prophet"]
    return out


def _model_error(cfg: Config, world: int) -> str:
    """The ValueError the trainer's model constructor raises on rank 0 of `world` ('' if none)."""
    p = cfg.parallel
    with fake_world(0, world):
        ps = initialize_model_parallel(
            p.tensor_model_parallel_size, p.expert_model_parallel_size, p.expert_sharding_parallel_size
        )
        try:
            GPT2MoE(cfg, ps)
        except ValueError as e:
            return str(e)
    return ""


@pytest.mark.parametrize("world", [4, 6, 8])
def test_enumeration_is_the_trainers_validation_and_covers_every_layout(world):
    cfg, skew = _enum_config(world)
    ok, bad = enumerate_candidates(cfg, world, skew)
    opt_names = ["lancet", "lina"] + (["pro_prophet"] if skew is not None else [])
    assert ok and bad
    # every candidate the plan may emit passes the trainer's checks
    for c in ok:
        tc = _trainer_config(cfg, c)
        validate(tc, world)
        check_combination(tc)
        assert c.dp == world // c.mp and not c.rejected, c
    # every rejected one carries an error naming a flag, and the trainer refuses it with that error
    # (validate / check_combination; the padded vocabulary's divisibility by MP is the model's check)
    model_errors: dict = {}
    for c in bad:
        assert FLAG.search(c.rejected), (c.name, c.rejected)
        tc = _trainer_config(cfg, c)
        try:
            validate(tc, world)
            check_combination(tc)
        except ValueError as e:
            assert str(e) == c.rejected, (c.name, str(e), c.rejected)
            continue
        key = (c.mp, c.ep, c.esp)
        if key not in model_errors:
            model_errors[key] = _model_error(tc, world)
        err = model_errors[key]
        assert err, f"{c.name}: rejected by the plan ({c.rejected}) but the trainer accepts it"
        assert "--tensor-model-parallel-size" in err and "--tensor-model-parallel-size" in c.rejected, (err, c)
    # every (MP, EP, ESP) with MP | world and EP x ESP | world is tried, with every switch combination
    brute = {
        (mp, ep, esp)
        for mp in _divisors(world)
        for ep in _divisors(world)
        for esp in _divisors(world)
        if world % (ep * esp) == 0
    }
    tried: dict = {}
    for c in ok + bad:
        tried.setdefault((c.mp, c.ep, c.esp), []).append(tuple(c.opts[n] for n in opt_names))
    assert set(tried) == brute
    every = sorted(itertools.product((False, True), repeat=len(opt_names)))
    for key, combos in tried.items():
        assert sorted(combos) == every, key
    # refusals of check_combination are among them where the config combines a switch with another
    if world in (4, 8):
        assert any("cannot be combined with" in c.rejected for c in bad)
    if world == 6:
        assert model_errors, "the padded-vocabulary case is not reached"


# ----------------------------------------------------------------------------- memory


def _mem_config(experts: int, optimizer: str = "adamw", momentum: float = 0.9) -> Config:
    """4 blocks (blocks 1 and 3 MoE), hidden 64, 4 heads, FFN 256, vocabulary 1000 (padded 1024)."""
    cfg = Config()
    m = cfg.model
    m.vocab_size, m.num_layers, m.hidden_size, m.num_attention_heads = 1000, 4, 64, 4
    m.seq_length, m.max_position_embeddings = 32, 32
    cfg.moe.num_experts = experts
    cfg.optim.optimizer, cfg.optim.sgd_momentum = optimizer, momentum
    cfg.train.micro_batch_size, cfg.train.global_batch_size = 1, 8
    return cfg


# name: (MP, EP, ESP, world, experts)
MEMORY_LAYOUTS = {
    "MP2": (2, 1, 1, 2, 8),
    "EP2": (1, 2, 1, 2, 8),
    "ESP2": (1, 1, 2, 2, 8),
    "MP2xEP2": (2, 2, 1, 4, 8),
    "EP2xESP2": (1, 2, 2, 4, 4),
    "EP4": (1, 4, 1, 4, 4),
    "MP2xEP2xESP2-DP2": (2, 2, 2, 8, 4),
}


def _real_counts(cfg: Config, mp: int, ep: int, esp: int, world: int, rank: int, optimizer_steps: bool):
    """(dense, expert) parameter elements of the real model on `rank`, and with `optimizer_steps`
    the bytes of the optimizer's per-element state after one step on zero gradients."""
    with fake_world(rank, world):
        ps = initialize_model_parallel(mp, ep, esp)
        model = GPT2MoE(cfg, ps)
        params = list(model.parameters())
        dense = sum(p.numel() for p in params if not _is_expert(p))
        expert = sum(p.numel() for p in params if _is_expert(p))
        state_bytes = None
        if optimizer_steps:
            opt, _ = build_optimizer(model, cfg.optim, torch.device("cpu"))
            for p in params:
                p.grad = torch.zeros_like(p)
            opt.step()
            tensors = [v for s in opt.state.values() for v in s.values() if torch.is_tensor(v)]
            # AdamW's step counter is one 0-dim tensor per parameter tensor, not per element:
            # the per-element state is what scales with the model
            assert all(v.dim() == 0 and v.numel() == 1 for v in tensors if v.dim() == 0)
            state_bytes = sum(v.numel() * v.element_size() for v in tensors if v.dim() > 0)
    return dense, expert, state_bytes


@pytest.mark.parametrize("name", list(MEMORY_LAYOUTS))
def test_params_per_rank_equal_the_real_models_parameters_on_every_kind_of_rank(name):
    mp, ep, esp, world, experts = MEMORY_LAYOUTS[name]
    cfg = _mem_config(experts)
    want = params_per_rank(cfg, mp, ep, esp)
    assert want[1] > 0
    # rank 0 and the last rank hold different MP, EP, ESP and DP coordinates
    for rank in sorted({0, world // 2 + 1 if world > 2 else 1, world - 1}):
        dense, expert, _ = _real_counts(cfg, mp, ep, esp, world, rank, False)
        assert (dense, expert) == want, (name, rank)


@pytest.mark.parametrize(
    "optimizer,momentum", [("adamw", 0.9), ("sgd", 0.9), ("sgd", 0.0)], ids=["adamw", "sgd", "sgd-no-momentum"]
)
@pytest.mark.parametrize("name", ["MP2xEP2", "EP2xESP2"])
def test_optimizer_state_equals_bytes_per_param_times_the_ranks_parameters(name, optimizer, momentum):
    mp, ep, esp, world, experts = MEMORY_LAYOUTS[name]
    cfg = _mem_config(experts, optimizer, momentum)
    dense, expert, state = _real_counts(cfg, mp, ep, esp, world, world - 1, True)
    n = dense + expert
    assert state == optimizer_bytes_per_param(cfg) * n, (state, optimizer_bytes_per_param(cfg), n)
    c = Candidate(mp, ep, esp, world // mp)
    mem = memory(cfg, c, 1.0)
    assert mem["optimizer"] == state
    # fp32 weights and fp32 gradients of the same elements
    assert mem["parameters"] == mem["gradients"] == 4 * n


# ----------------------------------------------------------------------------- communication volumes

VOLUME_WORLD = 4
MICRO, N_MICRO = 2, 2  # micro-batch size, micro-batches per step
# name: (MP, EP, ESP, bf16)
VOLUME_LAYOUTS = {
    "EP2": (1, 2, 1, False),
    "MP2": (2, 1, 1, False),
    "ESP2": (1, 1, 2, False),
    "MP2xEP2": (2, 2, 1, False),
    "EP2xESP2": (1, 2, 2, False),
    "EP2-bf16": (1, 2, 1, True),
    "ESP2-bf16": (1, 1, 2, True),
}


def _volume_config(mp: int, bf16: bool) -> Config:
    """2 blocks (block 1 MoE), hidden 32, 4 heads, FFN 64, sequence 16, vocabulary 100, 4 experts
    top-2 at capacity factor 1, the baseline schedule; two micro-batches per step."""
    cfg = Config()
    m = cfg.model
    m.vocab_size, m.num_layers, m.hidden_size, m.num_attention_heads = 100, 2, 32, 4
    m.ffn_hidden_size, m.seq_length, m.max_position_embeddings = 64, 16, 16
    c = cfg.moe
    c.num_experts, c.moe_router_topk, c.moe_expert_capacity_factor, c.moe_min_capacity = 4, 2, 1.0, 1
    c.moe_schedule = "baseline"
    cfg.optim.bf16 = bf16
    cfg.train.micro_batch_size = MICRO
    cfg.train.global_batch_size = MICRO * N_MICRO * (VOLUME_WORLD // mp)
    return cfg


def _one_training_step(rank: int, world: int, layouts: dict) -> dict:
    """Inside a spawned rank: one iteration of the trainer's `train_step` per layout, every collective
    the observer saw as (op, group, tag, sent, recv)."""
    from megatron_moe.distributed.grad_sync import GradSync
    from megatron_moe.distributed.observer import CommLog
    from megatron_moe.parallel_state import destroy_model_parallel
    from megatron_moe.training import Trainer

    out = {}
    for name, (mp, ep, esp, bf16) in layouts.items():
        cfg = _volume_config(mp, bf16)
        p = cfg.parallel
        p.tensor_model_parallel_size, p.expert_model_parallel_size, p.expert_sharding_parallel_size = mp, ep, esp
        validate(cfg, world)
        ps = initialize_model_parallel(mp, ep, esp)
        try:
            # the trainer's iteration (micro-batches, bucketed gradient all-reduce, clipping, step)
            # on a trainer holding just what `train_step` uses
            t = Trainer.__new__(Trainer)
            t.cfg, t.ps, t.device, t.iteration, t.lancet = cfg, ps, ps.device, 0, None
            t.model = GPT2MoE(cfg, ps)
            t.optimizer, _ = build_optimizer(t.model, cfg.optim, ps.device)
            t.grad_sync = GradSync(t.model, ps)
            g = torch.Generator().manual_seed(ps.rank("dp"))
            seq = cfg.model.seq_length + 1
            batches = [{"tokens": torch.randint(0, cfg.model.vocab_size, (MICRO, seq), generator=g)}] * N_MICRO
            with CommLog() as log:
                t.train_step(batches)
            out[name] = [(e.op, e.group, e.tag, e.sent, e.recv) for e in log.snapshot()]
            t.grad_sync.remove()
        finally:
            destroy_model_parallel()
    return out


@pytest.fixture(scope="module")
def observed() -> list:
    return spawn(_one_training_step, VOLUME_WORLD, VOLUME_LAYOUTS, timeout=240)


def _measured(events: list, cfg: Config) -> dict:
    """Bytes per "op@group" in the planner's size convention: the gathered output of an all-gather
    (the observer's `recv`), the input of every other op (`sent`).

    Left out: the vocabulary-parallel cross entropy's three fp32 all-reduces over MP of one value
    per token (max logit, sum of exponentials, target logit): control-sized reductions the planner
    does not model. The loss-statistics and gradient-norm all-reduces do not go through the
    observer. Gradient all-reduces run in buckets: their bytes are summed, as the planner's are."""
    tokens = cfg.train.micro_batch_size * cfg.model.seq_length
    out: dict = {}
    for op, group, _tag, sent, recv in events:
        if op == "all_reduce" and group == "mp" and sent == tokens * 4:
            continue
        key = f"{op}@{group}"
        out[key] = out.get(key, 0) + (recv if op == "all_gather" else sent)
    return out


def _predicted(name: str) -> tuple[Config, dict]:
    mp, ep, esp, bf16 = VOLUME_LAYOUTS[name]
    cfg = _volume_config(mp, bf16)
    vols = Predictor(cfg, nominal(1, VOLUME_WORLD)).volumes(Candidate(mp, ep, esp, VOLUME_WORLD // mp))
    return cfg, vols


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "name",
    list(VOLUME_LAYOUTS),
)
def test_predicted_volumes_equal_the_observed_bytes_of_one_training_step(observed, name):
    cfg, predicted = _predicted(name)
    predicted = {k: v for k, v in predicted.items() if k != "all_reduce@mp"}  # its own test below
    for rank, per_layout in enumerate(observed):
        measured = {k: v for k, v in _measured(per_layout[name], cfg).items() if k != "all_reduce@mp"}
        assert measured == pytest.approx(predicted, rel=0, abs=0), (name, rank, measured, predicted)


# the MP all-reduces: two per attention and dense MLP (forward, backward), plus the vocabulary-parallel
# embedding's output (forward) and the LM head's input gradient (backward)


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", ["MP2", "MP2xEP2"])
def test_predicted_mp_all_reduce_equals_the_observed_bytes(observed, name):
    cfg, predicted = _predicted(name)
    for rank, per_layout in enumerate(observed):
        measured = _measured(per_layout[name], cfg)
        assert measured["all_reduce@mp"] == predicted["all_reduce@mp"], (name, rank, measured, predicted)


# ----------------------------------------------------------------------------- the CLI

SMALL = ["--nodes", "2", "--gpus-per-node", "4", "--num-layers", "4", "--hidden-size", "64"]
SMALL += ["--num-attention-heads", "4", "--seq-length", "64", "--num-experts", "8", "--vocab-size", "1000"]
SMALL += ["--micro-batch-size", "2", "--global-batch-size", "32"]


def _run(argv: list) -> tuple[int, str, str]:
    """main(argv): (exit code, stdout, stderr); argparse's SystemExit gives its code."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = main(argv)
        except SystemExit as e:
            rc = e.code
    return rc, out.getvalue(), err.getvalue()


def _without_timing(x):
    if isinstance(x, dict):
        return {k: _without_timing(v) for k, v in x.items() if not re.search(r"elapsed|wall|planned|seconds_taken", k)}
    if isinstance(x, list):
        return [_without_timing(v) for v in x]
    return x


def test_the_plan_is_deterministic(tmp_path):
    argv = SMALL + ["--moe-dropless", "--skew", "1.2"]
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    rc, out_a, err = _run(argv + ["--json", str(a)])
    assert rc == 0, err
    # a second run in another interpreter with another hash seed (set and dict orders may differ)
    env = dict(os.environ, PYTHONHASHSEED="12345")
    code = "import sys; from megatron_moe.cli.plan import main; sys.exit(main(sys.argv[1:]))"
    proc = subprocess.run(
        [sys.executable, "-c", code, *argv, "--json", str(b)], capture_output=True, text=True, env=env, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    ja, jb = json.loads(a.read_text()), json.loads(b.read_text())
    assert ja["candidates"] and any(c["opts"].get("pro_prophet") for c in ja["candidates"])
    assert _without_timing(ja) == _without_timing(jb)

    def lines(s):
        return [x for x in s.splitlines() if not x.startswith("planned in")]

    assert lines(out_a) == lines(proc.stdout)
    # and a third run in this process gives the same file again
    rc, _, err = _run(argv + ["--json", str(b)])
    assert rc == 0, err
    assert _without_timing(json.loads(b.read_text())) == _without_timing(ja)


def _profile(tmp_path, name: str, content: str) -> str:
    path = tmp_path / name
    path.write_text(content)
    return str(path)


BAD = {
    "nodes-0": (["--nodes", "0"], "--nodes"),
    "gpus-per-node-negative": (["--gpus-per-node", "-1"], "--gpus-per-node"),
    "gpus-per-node-not-int": (["--gpus-per-node", "1.5"], "--gpus-per-node"),
    "inter-node-gbps-0": (["--inter-node-gbps", "0"], "--inter-node-gbps"),
    "intra-node-gbps-negative": (["--intra-node-gbps", "-3"], "--intra-node-gbps"),
    "gpu-memory-negative": (["--gpu-memory-gib", "-5"], "--gpu-memory-gib"),
    "gpu-memory-nan": (["--gpu-memory-gib", "nan"], "--gpu-memory-gib"),
    "gpu-tflops-0": (["--gpu-tflops", "0"], "--gpu-tflops"),
    "latency-negative": (["--inter-node-latency-us", "-1"], "--inter-node-latency-us"),
    "skew-negative": (["--skew", "-1"], "--skew"),
    "top-0": (["--top", "0"], "--top"),
    "profile-missing": (["--profile", "{tmp}/missing.json"], "--profile"),
    "profile-not-json": (["--profile", "{notjson}"], "--profile"),
    "profile-a-list": (["--profile", "{alist}"], "--profile"),
    "profile-other-kind": (["--profile", "{otherkind}"], "--profile"),
    "profile-missing-fields": (["--profile", "{partial}"], "--profile"),
    "heads-not-dividing-hidden": (["--num-attention-heads", "3"], "--num-attention-heads"),
    "no-layout": (["--micro-batch-size", "3"], "--global-batch-size"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_cluster_or_model_exits_2_with_one_error_line_naming_the_flag(tmp_path, case):
    extra, flag = BAD[case]
    files = {
        "tmp": str(tmp_path),
        "notjson": _profile(tmp_path, "notjson.json", "{not json"),
        "alist": _profile(tmp_path, "alist.json", "[1, 2]"),
        "otherkind": _profile(tmp_path, "other.json", json.dumps({"kind": "mmoe-bench result", "flops": 1e12})),
        "partial": _profile(tmp_path, "partial.json", json.dumps({"kind": "mmoe-plan profile", "version": 1})),
    }
    extra = [x.format(**files) for x in extra]
    given = {extra[i] for i in range(0, len(extra), 2)}
    base = [x for pair in zip(SMALL[::2], SMALL[1::2]) if pair[0] not in given for x in pair]
    rc, out, err = _run(base + extra)
    assert rc == 2, (rc, out, err)
    lines = err.strip().splitlines()
    if lines and lines[-1].startswith("mmoe-plan: error:"):  # argparse's own type errors
        assert flag in lines[-1], err
        return
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert flag in lines[0], err
    if case == "no-layout":
        assert "no layout" in lines[0], err


@pytest.mark.parametrize("where", ["missing-directory", "a-directory"])
def test_unwritable_json_exits_2_and_leaves_no_temporary_file(tmp_path, where):
    target = tmp_path / "out.json"
    if where == "missing-directory":
        target = tmp_path / "nowhere" / "out.json"
    else:
        target.mkdir()  # the final rename onto a directory fails after the temporary file was written
    before = sorted(p.name for p in tmp_path.rglob("*"))
    rc, _, err = _run(SMALL + ["--json", str(target)])
    assert rc == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: --json"), err
    assert sorted(p.name for p in tmp_path.rglob("*")) == before


GPT2_S_MOE = ["--num-layers", "12", "--hidden-size", "768", "--num-attention-heads", "12", "--seq-length", "512"]
GPT2_S_MOE += ["--num-experts", "64", "--micro-batch-size", "8", "--global-batch-size", "512", "--bf16"]


def test_gpt2_s_moe_on_8x8_prints_a_ranked_table_and_a_torchrun_line_the_trainer_accepts():
    rc, out, err = _run(["--nodes", "8", "--gpus-per-node", "8", *GPT2_S_MOE])
    assert rc == 0, err
    lines = out.splitlines()
    header = next(i for i, x in enumerate(lines) if "candidate" in x and "step ms" in x)
    rows = []
    for x in lines[header + 1 :]:
        m = re.match(r"\s*(\d+) (MP(\d+) EP(\d+) ESP(\d+) DP(\d+)\b.*)$", x[:48].rstrip())
        if not m:
            break
        step_ms = float(x[48:].split()[1])  # after the candidate column: schedule, step ms, ...
        rows.append((int(m.group(1)), m.group(2), tuple(int(m.group(i)) for i in (3, 4, 5, 6)), step_ms))
    assert len(rows) >= 2 and [r[0] for r in rows] == list(range(1, len(rows) + 1))
    steps = [r[3] for r in rows]
    assert steps == sorted(steps)  # ranked: fastest first
    torchrun = [x.strip() for x in lines if x.strip().startswith("torchrun ")]
    assert len(torchrun) == 1, out
    words = shlex.split(torchrun[0])
    script = next(i for i, w in enumerate(words) if w.endswith(".py"))
    assert words[words.index("--nnodes") + 1] == "8" and words[words.index("--nproc-per-node") + 1] == "8"
    cfg = parse_args(words[script + 1 :])
    validate(cfg, 64)
    check_combination(cfg)
    p, m = cfg.parallel, cfg.model
    # the command line is the top row's layout and switches, with the model flags given
    mp, ep, esp, dp = rows[0][2]
    assert (p.tensor_model_parallel_size, p.expert_model_parallel_size, p.expert_sharding_parallel_size) == (
        mp,
        ep,
        esp,
    )
    assert cfg.opts.lancet_wgrad == ("lancet" in rows[0][1]) and cfg.opts.lina == ("lina" in rows[0][1])
    assert (m.num_layers, m.hidden_size, m.num_attention_heads, m.seq_length) == (12, 768, 12, 512)
    assert (cfg.moe.num_experts, cfg.train.micro_batch_size, cfg.train.global_batch_size) == (64, 8, 512)
    assert cfg.optim.bf16 and dp == 64 // mp
