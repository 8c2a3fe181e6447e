"""Multi-process support for tests and small tools: spawn N gloo ranks on localhost.

`spawn(fn, world_size, *args)` runs `fn(rank, world_size, *args)` in `world_size` processes with
torch.distributed initialized (gloo, a free port, one thread each; `backend="nccl"`: rank r on GPU
r) and returns their results in rank order. A child's exception is re-raised in the parent with its
traceback; a run past `timeout` seconds is killed and reported as a TimeoutError.
"""

from __future__ import annotations

import gc
import os
import pickle
import signal
import socket
import subprocess
import traceback
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megatron_moe.parallel_state import shutdown


def run_command(cmd: list[str], *, timeout: float, **kwargs: Any) -> subprocess.CompletedProcess:
    """`subprocess.run(cmd, capture_output=True, text=True, ...)` in a session of its own: on timeout the
    whole process group is killed (a launcher's workers included, which `subprocess.run` would orphan),
    then `subprocess.TimeoutExpired` is raised as by `subprocess.run`."""
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True, **kwargs
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise subprocess.TimeoutExpired(cmd, timeout, out, err) from None
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def free_port() -> int:
    """Return a TCP port that is free on localhost right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child(rank: int, world_size: int, port: int, fn: Callable, args: tuple, queue, backend: str = "gloo") -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    os.environ["RANK"] = str(rank)
    os.environ["WORLD_SIZE"] = str(world_size)
    os.environ["LOCAL_RANK"] = str(rank)
    torch.set_num_threads(1)
    ok = False
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timedelta(seconds=120))
        result = fn(rank, world_size, *args)
        queue.put((rank, "ok", pickle.dumps(result)))
        ok = True
    except BaseException:  # report everything, including assertion errors
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        try:
            shutdown(barrier=ok)  # the shared teardown (parallel_state.shutdown)
        except Exception:  # noqa: BLE001  (the result is reported already)
            pass


def spawn(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 300.0, backend: str = "gloo") -> list:
    """Run `fn(rank, world_size, *args)` on `world_size` ranks; return their results (`fn`: a
    module-level function, pickled to the children)."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_child, args=(r, world_size, port, fn, args, queue, backend), daemon=True)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors: list[str] = []
    import queue as _q
    import time

    deadline = time.monotonic() + timeout
    while len(results) + len(errors) < world_size:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            break
        try:
            rank, status, payload = queue.get(timeout=min(remaining, 1.0))
        except _q.Empty:
            # a child that died without reporting (segfault, os._exit) ends the wait
            dead = [p for p in procs if p.exitcode not in (None, 0)]
            if dead and queue.empty():
                errors.append(f"a child process exited with code {dead[0].exitcode} without a report")
                break
            continue
        if status == "ok":
            results[rank] = pickle.loads(payload)
        else:
            errors.append(f"rank {rank} failed:\n{payload}")
            break
    for p in procs:
        p.join(timeout=5 if not errors and len(results) == world_size else 0.5)
        if p.is_alive():
            p.kill()
            p.join()
    if errors:
        raise RuntimeError(errors[0])
    if len(results) < world_size:
        raise TimeoutError(
            f"spawn: {world_size - len(results)} of {world_size} ranks did not finish within {timeout:.0f} s"
        )
    return [results[r] for r in range(world_size)]


def live_cpu_tensors() -> tuple[int, int]:
    """(storages, bytes) of the CPU tensors Python can reach, after a full collection: flat from one
    training iteration to the next once a run is warm (tests of leaks)."""
    gc.collect()
    seen = {}
    for o in gc.get_objects():
        if isinstance(o, torch.Tensor) and o.device.type == "cpu":
            st = o.untyped_storage()
            seen[st.data_ptr()] = st.nbytes()
    return len(seen), sum(seen.values())
