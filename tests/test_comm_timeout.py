"""A stalled peer ends every surviving rank with one clear error instead of a hang.

Two processes; one of them is SIGSTOPped mid-training, the other must stop within
--comm-timeout (+ slack) with an error naming the collective, the group and the flag:

* EP2, a tiny MoE training loop under the spawn helper: the stalled rank stops itself between
  forward and backward, so the survivor is stuck in the backward all-to-all (the error crosses
  the autograd engine);
* DP2, the real trainer under torchrun, plain and with Lina (whose launcher thread waits for the
  gradient all-reduce): the test stops rank 1 from outside after an iteration was logged; rank 0
  must print exactly one `error: ...` line and exit 1, with no traceback of its own.

The bounds (spawn's timeout, the wait for rank 0's exit) make a hang fail the test; no test
asserts on how long anything took.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from datetime import timedelta

import pytest
import torch

from megatron_moe.config import Config
from megatron_moe.distributed.comm_errors import CommTimeoutError, translate
from megatron_moe.moe.layer import MoELayer
from megatron_moe.parallel_state import initialize_model_parallel
from megatron_moe.testing import free_port, spawn
from tiny_run import tiny_args

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TIMEOUT_S = 5  # --comm-timeout of every test here
SLACK_S = 30  # what the issue allows past the timeout


# ----------------------------------------------------------------------------- unit: the translation


def test_gloo_texts_become_errors_naming_collective_group_and_flag():
    timeout = translate(
        RuntimeError("[x/unbound_buffer.cc:78] Timed out waiting 5000ms for recv operation to complete"),
        "all_to_all",
        None,
    )
    assert isinstance(timeout, CommTimeoutError)
    assert str(timeout).startswith("all_to_all on group 'world' did not finish within --comm-timeout")
    lost = translate(RuntimeError("[x/pair.cc:553] Connection closed by peer [127.0.0.1]:1"), "all_gather", None)
    assert type(lost).__name__ == "CommPeerLostError" and "--comm-timeout" in str(lost)
    assert str(lost).startswith("all_gather on group 'world' failed: a peer rank closed its connection")
    assert translate(RuntimeError("shape mismatch"), "all_reduce", None) is None
    assert translate(ValueError("timed out"), "all_reduce", None) is None


# ----------------------------------------------------------------------------- EP2, tiny loop


def _moe_loop_with_stalled_peer(rank: int, world: int) -> None:
    """EP2 MoE layer, SGD; rank 1 stops itself after the forward of iteration 2."""
    ps = initialize_model_parallel(1, 2, 1, timeout_s=TIMEOUT_S)
    for kind in ("mp", "dp", "ep", "esp", "ep_esp", "expert_dp"):  # not torch's 30 minutes
        assert ps.group(kind)._get_backend(torch.device("cpu")).options._timeout == timedelta(seconds=TIMEOUT_S)
    cfg = Config()
    m, moe = cfg.model, cfg.moe
    m.hidden_size, m.ffn_hidden_size, m.num_attention_heads = 16, 32, 1
    m.seq_length = m.max_position_embeddings = 8
    moe.num_experts, moe.moe_router_topk, moe.moe_schedule = 4, 2, "baseline"
    cfg.train.micro_batch_size = 2
    device = torch.device("cpu")
    layer = MoELayer(cfg, ps, 1234, "t.moe", 1).to(device)
    opt = torch.optim.SGD(layer.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(rank)
    for it in range(4):
        x = torch.randn(2, 8, 16, generator=g).to(device)
        y, aux = layer(x)
        if it == 2 and rank == 1:
            os.kill(os.getpid(), signal.SIGSTOP)  # stalled peer: never comes back
        (y.square().mean() + aux).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


def test_ep2_stalled_peer_ends_the_other_rank_with_the_timeout_error():
    with pytest.raises(RuntimeError) as info:
        spawn(_moe_loop_with_stalled_peer, 2, timeout=60 + TIMEOUT_S + SLACK_S)  # start-up + bound
    text = str(info.value)
    assert text.startswith("rank 0 failed:"), text[-2000:]
    last = text.strip().splitlines()[-1]
    assert last.startswith(
        "megatron_moe.distributed.comm_errors.CommTimeoutError: all_to_all on group 'ep' "
        f"(global ranks [0, 1]) did not finish within --comm-timeout {TIMEOUT_S:g} s: "
        "a peer rank is stalled or dead"
    ), last


# ----------------------------------------------------------------------------- DP2, the trainer


def _children(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(c) for c in f.read().split()]


def _env_rank(pid: int) -> str | None:
    with open(f"/proc/{pid}/environ", "rb") as f:
        env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
    rank = env.get(b"RANK")
    return rank.decode() if rank is not None else None


def _alive(pid: int) -> bool:
    """Running or stopped (a zombie, or no process at all, is not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.parametrize("extra", [[], ["--lina", "--lina-partition-mb", "0.01"]], ids=["plain", "lina"])
def test_dp2_trainer_stalled_peer_prints_one_error_and_exits_1(sample_data, tmp_path, extra):
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "--master-port",
        str(free_port()),
        os.path.join(ROOT, "pretrain_gpt_moe.py"),
        *tiny_args(sample_data, 5000, "--log-interval", "1"),
        "--comm-timeout",
        str(TIMEOUT_S),
        *extra,
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="offline", HF_HUB_OFFLINE="1")
    out_path, err_path = tmp_path / "stdout", tmp_path / "stderr"
    with open(out_path, "w") as out, open(err_path, "w") as err:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=err, start_new_session=True)
    try:
        deadline = time.monotonic() + 120  # start-up on a loaded machine
        while "iteration      2/" not in out_path.read_text():
            assert proc.poll() is None and time.monotonic() < deadline, err_path.read_text()[-3000:]
            time.sleep(0.2)
        ranks = {_env_rank(p): p for p in _children(proc.pid)}
        os.kill(ranks["1"], signal.SIGSTOP)
        deadline = time.monotonic() + TIMEOUT_S + SLACK_S
        while _alive(ranks["0"]) and time.monotonic() < deadline:
            time.sleep(0.2)
        hung = _alive(ranks["0"])
        os.kill(ranks["1"], signal.SIGKILL)  # the stalled rank would never exit
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    stderr = err_path.read_text()
    assert not hung, f"rank 0 still running {TIMEOUT_S + SLACK_S} s after its peer stopped\n{stderr[-3000:]}"
    assert proc.returncode != 0
    assert re.search(rf"exitcode\s*:\s*1 \(pid: {ranks['0']}\)", stderr), stderr[-3000:]  # torchrun's report
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, stderr[-3000:]
    assert re.match(
        r"error: \[rank 0\] .*all_reduce.* on group '(dp|expert_dp|world|lina_dp|lina_expert_dp)' \(global ranks \[0, 1\]\) "
        rf"(\([^)]*\) )?did not finish within --comm-timeout {TIMEOUT_S:g} s",
        errors[0],
    ), errors[0]
    assert "CommTimeoutError" not in stderr and 'File "' + os.path.join(ROOT, "megatron_moe") not in stderr
