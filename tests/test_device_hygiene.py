"""Device hygiene: every tensor the library creates is given its device explicitly.

Static half: every call of a torch tensor factory in `megatron_moe/**.py` passes
`device=` (or is a `*_like` call, which inherits the device of its argument).
Dynamic half: the trainer, run through `tests/meta_run.py` with
`torch.set_default_device("meta")` set before anything else, trains exactly as
without it (any tensor created without a device would be a meta tensor and fail
next to a real one, or carry no data).
"""

from __future__ import annotations

import ast
import json
import os
import sys
from pathlib import Path

import pytest
import torch
from tiny_run import tiny_args

from megatron_moe.arguments import parse_args
from megatron_moe.model.gpt2 import GPT2MoE
from megatron_moe.parallel_state import default_backend, device_and_backend, local_state, resolve_device
from megatron_moe.testing import free_port, run_command

LIBRARY = Path(__file__).resolve().parent.parent / "megatron_moe"
FACTORIES = {
    "zeros",
    "empty",
    "ones",
    "full",
    "arange",
    "tensor",
    "randn",
    "rand",
    "randint",
    "randperm",
    "linspace",
    "eye",
}


def _factory_name(call: ast.Call) -> str | None:
    """'zeros' for `torch.zeros(...)` (any `<...>.torch.zeros` attribute chain), else None."""
    f = call.func
    if isinstance(f, ast.Attribute) and f.attr in FACTORIES:
        base = f.value
        if isinstance(base, ast.Name) and base.id == "torch":
            return f.attr
        if isinstance(base, ast.Attribute) and base.attr == "torch":
            return f.attr
    return None


def factory_calls_without_device(source: str, filename: str) -> list[str]:
    """`file:line torch.NAME` for every tensor-factory call in `source` that passes no `device=`."""
    out = []
    for node in ast.walk(ast.parse(source, filename)):
        if isinstance(node, ast.Call):
            name = _factory_name(node)
            if name and not any(k.arg == "device" for k in node.keywords):
                out.append(f"{filename}:{node.lineno} torch.{name}")
    return out


def test_checker_flags_a_factory_without_device():
    src = (
        "import torch\nx = torch.zeros(3)\ny = torch.ones(2, device=d)\nz = torch.zeros_like(x)\n"
        "w = torch.tensor([1], dtype=torch.long)\n"
    )
    assert factory_calls_without_device(src, "m.py") == ["m.py:2 torch.zeros", "m.py:5 torch.tensor"]


def test_library_tensor_factories_pass_device():
    offenders = []
    for path in sorted(LIBRARY.rglob("*.py")):
        offenders += factory_calls_without_device(path.read_text(), str(path.relative_to(LIBRARY.parent)))
    assert offenders == [], "tensor factories without device=:\n" + "\n".join(offenders)


# ---------------------------------------------------------------- one place decides the device
def test_device_flag_resolution_and_errors():
    assert resolve_device("cpu") == torch.device("cpu")
    assert default_backend(torch.device("cpu")) == "gloo"
    assert default_backend(torch.device("cuda", 0)) == "nccl"
    if torch.cuda.is_available():
        assert resolve_device("auto").type == "cuda"
    else:
        assert resolve_device("auto") == torch.device("cpu")
        with pytest.raises(ValueError, match="--device cuda: CUDA is not available"):
            resolve_device("cuda")
    assert device_and_backend("cpu", None) == (torch.device("cpu"), "gloo")
    assert device_and_backend("auto", "gloo") == (torch.device("cpu"), "gloo")  # gloo keeps the CPU
    with pytest.raises(ValueError, match="--distributed-backend nccl needs --device cuda"):
        device_and_backend("cpu", "nccl")
    assert parse_args(["--device", "cpu"]).parallel.device == "cpu"
    with pytest.raises(ValueError, match="--distributed-backend nccl needs --device cuda"):
        parse_args(["--device", "cpu", "--distributed-backend", "nccl"])


def test_model_parameters_are_created_on_the_given_device():
    """`GPT2MoE(..., device=)` reaches every layer: on the meta device no parameter holds data,
    and the shapes are those of the CPU model (the host-drawn init values are never copied)."""
    cfg = parse_args(
        [
            "--num-layers",
            "2",
            "--hidden-size",
            "32",
            "--num-attention-heads",
            "4",
            "--seq-length",
            "16",
            "--vocab-size",
            "100",
            "--num-experts",
            "4",
        ]
    )
    meta = GPT2MoE(cfg, local_state(), device="meta")
    cpu = GPT2MoE(cfg, local_state())
    assert {n: p.device.type for n, p in meta.named_parameters()} == {n: "meta" for n, _ in cpu.named_parameters()}
    assert {n: p.shape for n, p in meta.named_parameters()} == {n: p.shape for n, p in cpu.named_parameters()}
    assert local_state().device == torch.device("cpu")


# ---------------------------------------------------------------- the trainer under a meta default device
ROOT = LIBRARY.parent
META_RUN = str(ROOT / "tests" / "meta_run.py")
ALL_SWITCHES = ["--lina", "--lancet-wgrad", "--lancet-partition"]
RUNS = {  # name -> (processes, flags)
    "1proc-lancet": (1, ["--lancet-wgrad", "--lancet-partition"]),
    "EP2-lina-lancet": (2, ["--expert-model-parallel-size", "2", *ALL_SWITCHES]),
    "MP2xEP2-s1-lina-lancet": (
        4,
        [
            "--tensor-model-parallel-size",
            "2",
            "--expert-model-parallel-size",
            "2",
            "--moe-schedule",
            "s1",
            *ALL_SWITCHES,
        ],
    ),
    "MP2xEP2-s2-lina-lancet": (
        4,
        [
            "--tensor-model-parallel-size",
            "2",
            "--expert-model-parallel-size",
            "2",
            "--moe-schedule",
            "s2",
            *ALL_SWITCHES,
        ],
    ),
}
TIMING = ("ms_per_iter", "tokens_per_s", "tflops")


def _env() -> dict:
    return {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "WANDB_MODE": "offline",
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": str(ROOT),
        "MMOE_CHOOSE": "lancet partitions=2",  # partition every MoE block whatever the planner predicts
    }


def _launch(nproc: int, meta: bool, script: str, args: list[str], timeout: float = 300) -> str:
    """Run `script args` through meta_run.py (under torchrun when nproc > 1); returns its output."""
    wrapped = [META_RUN, *(["--meta"] if meta else []), script, *args]
    if nproc == 1:
        cmd = [sys.executable, *wrapped]
    else:
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            str(nproc),
            "--master-port",
            str(free_port()),
            *wrapped,
        ]
    res = run_command(cmd, cwd=ROOT, env=_env(), timeout=timeout)
    assert res.returncode == 0, f"{' '.join(cmd)} failed:\n{res.stdout[-3000:]}\n{res.stderr[-6000:]}"
    return res.stdout


def test_meta_run_makes_unplaced_tensors_meta(tmp_path):
    script = tmp_path / "where.py"
    script.write_text("import torch\nprint(torch.zeros(1).device, torch.zeros(1, device='cpu').device)\n")
    assert _launch(1, True, str(script), []).split() == ["meta", "cpu"]
    assert _launch(1, False, str(script), []).split() == ["cpu", "cpu"]


def _curve(path) -> list[dict]:
    with open(path) as f:
        recs = [json.loads(line) for line in f]
    return [{k: v for k, v in r.items() if k not in TIMING} for r in recs]


@pytest.mark.parametrize("name", list(RUNS))
def test_trainer_under_meta_default_device_matches_the_plain_run(sample_data, tmp_path, name):
    """Every tensor the trainer, the model and the optimizations create is placed explicitly:
    with torch.set_default_device("meta") the run trains exactly as without it."""
    nproc, flags = RUNS[name]
    curves = {}
    for meta in (False, True):
        log = tmp_path / f"{'meta' if meta else 'plain'}.jsonl"
        args = tiny_args(sample_data, 3, *flags, "--log-interval", "1", "--eval-iters", "1", "--log-json", str(log))
        _launch(nproc, meta, str(ROOT / "pretrain_gpt_moe.py"), args)
        curves[meta] = _curve(log)
    assert [r.get("iteration") for r in curves[False]] == [1, 2, 3, 3, 3]  # 3 train records, valid, test
    assert curves[True] == curves[False]


# ---------------------------------------------------------------- the benchmark tools under a meta default device
SMALL = [
    "--hidden-size",
    "32",
    "--num-attention-heads",
    "4",
    "--ffn-hidden-size",
    "64",
    "--num-experts",
    "4",
    "--seq-length",
    "32",
    "--micro-batch-size",
    "2",
    "--num-layers",
    "2",
    "--vocab-size",
    "512",
    "--expert-model-parallel-size",
    "2",
    "--iters",
    "2",
    "--warmup",
    "1",
]
BENCH = {  # tool -> (extra flags, key of a row, the rows it must write)
    "bench_moe_layer.py": (["--schedules", "baseline,s1,s2"], "schedule", ["baseline", "s1", "s2"]),
    "bench_lancet.py": (["--timeline"], "mode", ["none", "dw", "partition", "both", "auto"]),
    "bench_lina.py": (["--rounds", "1", "--partitions", "1"], "mode", ["alone", "no_lina", "lina"]),
}


@pytest.mark.parametrize("tool", list(BENCH))
def test_bench_tool_under_meta_default_device(tmp_path, tool):
    """Each benchmark runs (2 processes, 2 iterations) with a meta default device and writes every row;
    the MoE-layer benchmark's bytes per collective equal those of the plain run."""
    extra, key, want = BENCH[tool]
    out = {}
    for meta in (False, True) if tool == "bench_moe_layer.py" else (True,):
        path = tmp_path / f"{'meta' if meta else 'plain'}.json"
        _launch(2, meta, str(ROOT / "tools" / tool), [*SMALL, *extra, "--json", str(path)])
        with open(path) as f:
            out[meta] = json.load(f)
    assert [r[key] for r in out[True]] == want
    if tool == "bench_moe_layer.py":
        assert [r["bytes"] for r in out[True]] == [r["bytes"] for r in out[False]]
        assert all(sum(r["bytes"].values()) > 0 for r in out[True])
    if tool == "bench_lancet.py":  # --timeline: every mode's all-to-alls of one more iteration, in order
        assert out[True][0]["speedup_paired"] == [1.0, 1.0, 1.0]  # none over itself, round by round
        assert all(lo <= med <= hi for med, lo, hi in (r["speedup_paired"] for r in out[True]))
        for r in out[True]:
            tl = r["timeline"]
            assert tl["a2a"] and 0 < tl["forward_ms"] < tl["iteration_ms"]
            assert all(0 <= e["launch_ms"] <= e["finish_ms"] <= tl["iteration_ms"] for e in tl["a2a"])
            assert {e["phase"] for e in tl["a2a"]} == {"fwd", "bwd"}
