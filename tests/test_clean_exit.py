"""Benchmarks exit 0 after a successful run.

`tools/bench_moe_layer.py` (MP2 x EP2 x ESP2, every schedule) used to die with SIGABRT
("terminate called without an active exception") after printing its table: the process groups
were torn down during interpreter finalization, while a gloo worker thread still released a
finished work. Every entry point now ends through `parallel_state.shutdown()`. These runs use
tiny sizes; each checks the exit status of every rank (torchrun fails if any rank fails), that
no rank aborted, and the JSON the run wrote.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from megatron_moe.testing import free_port, run_command

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _torchrun(nproc: int, script: str, *args: str, choose: str = "") -> subprocess.CompletedProcess:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        str(nproc),
        "--master-port",
        str(free_port()),
        os.path.join(ROOT, "tools", script),
        *args,
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", MMOE_CHOOSE=choose)  # forced picks
    return run_command(cmd, cwd=ROOT, env=env, timeout=300)


def test_bench_moe_layer_mp2_ep2_esp2_every_schedule_exits_0(tmp_path):
    out = tmp_path / "moe.json"
    run = _torchrun(
        4,
        "bench_moe_layer.py",
        "--hidden-size",
        "16",
        "--ffn-hidden-size",
        "32",
        "--num-experts",
        "4",
        "--micro-batch-size",
        "2",
        "--seq-length",
        "8",
        "--tensor-model-parallel-size",
        "2",
        "--expert-model-parallel-size",
        "2",
        "--expert-sharding-parallel-size",
        "2",
        "--schedules",
        "baseline,s1,s2,auto",
        "--iters",
        "1",
        "--warmup",
        "0",
        "--json",
        str(out),
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert "terminate called" not in run.stderr
    rows = json.loads(out.read_text())
    assert [r["schedule"] for r in rows] == ["baseline", "s1", "s2", "auto"]
    assert rows[-1]["chosen"] in ("baseline", "s1", "s2")


def test_bench_lina_with_its_launcher_thread_exits_0(tmp_path):
    out = tmp_path / "lina.json"
    run = _torchrun(
        2,
        "bench_lina.py",
        "--num-layers",
        "2",
        "--hidden-size",
        "16",
        "--num-attention-heads",
        "2",
        "--ffn-hidden-size",
        "32",
        "--seq-length",
        "8",
        "--vocab-size",
        "64",
        "--micro-batch-size",
        "2",
        "--iters",
        "1",
        "--warmup",
        "0",
        "--rounds",
        "1",
        "--partitions",
        "0.001",
        "--modes",
        "no_lina,lina",
        "--measure-iters",
        "1",
        "--json",
        str(out),
        choose="lina=plain",
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert "terminate called" not in run.stderr
    rows = json.loads(out.read_text())
    assert [(r["mode"], r["partition_mb"]) for r in rows] == [("no_lina", None), ("lina", 0.001)]
    # mode lina went through the trainer's Lina trial (forced to pick the plain sync, both measured)
    lina = rows[1]
    assert (lina["lina_kept"], lina["lina_kept_rounds"], rows[0]["lina_kept"]) == (False, [False], None)
    assert lina["trial_lina_ms_median"] > 0 and lina["trial_plain_ms_median"] > 0
    assert lina["trial_ms_total"] == lina["trial_lina_ms_median"] + lina["trial_plain_ms_median"]  # K = 1
    assert "-> plain (forced" in lina["lina_trial"][0]["line"]
