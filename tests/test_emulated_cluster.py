"""scripts/emulate_cluster.sh: real network namespaces, shaped links, cleanup.

Needs root and `ip netns`; otherwise the tests that build a cluster are
skipped (the argument checks still run). The probes are tests/cluster_probe.py
(torch, gloo) and tests/net_probe.py (plain sockets, no torch, fast).

The rate checks are the one place this project asserts on timing, on purpose:
the point of the emulator is that bytes between nodes really cross a link of
the configured rate. They use 200 Mbit/s, where a 2-core machine is idle
enough that the link, not the CPU, is the limit, and allow 30%.
"""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts/emulate_cluster.sh"
RATE_BPS = 200e6  # matches "200mbit" (tc: 1 mbit = 10^6 bit)
PROBE_RE = re.compile(r"^\[node (\d+)\] PROBE (.*)$")


def _netns_available() -> str | None:
    """Why cluster tests cannot run here, or None when they can."""
    if os.geteuid() != 0:
        return "needs root to create network namespaces"
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "iproute2 (ip, tc) is not installed"
    if subprocess.run(["ip", "netns", "list"], capture_output=True).returncode != 0:
        return "'ip netns' is not available"
    return None


NO_NETNS = _netns_available()
needs_netns = pytest.mark.skipif(NO_NETNS is not None, reason=str(NO_NETNS))


def _env(**extra: str) -> dict[str, str]:
    """This environment with the running interpreter's bin dir (torchrun) first on PATH."""
    env = dict(os.environ)
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    env.pop("OMP_NUM_THREADS", None)  # the script's default must apply
    env.update(extra)
    return env


def _our_namespaces(pid: int) -> list[str]:
    """Namespaces of the run whose script had process id `pid` (named mmoe-<pid>-*)."""
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in out.splitlines() if line.startswith(f"mmoe-{pid}-")]


def _cluster(args: list[str], timeout: float = 60) -> tuple[int, str, str, int]:
    """Run the emulator; on a hang send SIGTERM so its trap still cleans up."""
    proc = subprocess.Popen(
        [str(SCRIPT), *args], cwd=ROOT, env=_env(), text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=30)
        pytest.fail(f"emulate_cluster.sh hung; stdout:\n{out}\nstderr:\n{err}")
    return proc.returncode, out, err, proc.pid


def _probes(stdout: str, kind: str) -> dict[int, dict]:
    """{node: record} of the PROBE lines of one kind."""
    found = {}
    for line in stdout.splitlines():
        m = PROBE_RE.match(line)
        if m and json.loads(m.group(2))["probe"] == kind:
            found.setdefault(int(m.group(1)), []).append(json.loads(m.group(2)))
    return {node: recs[0] if len(recs) == 1 else recs for node, recs in found.items()}


def _goodput_bps(nbytes: int, seconds: list[float]) -> float:
    """Best rate over the repetitions: the link limit shows in the fastest one."""
    return nbytes * 8 / min(seconds)


@pytest.mark.parametrize(
    "args,message",
    [
        (["--nodes", "0", "--", "true"], "--nodes must be an integer in 1..250"),
        (["--procs-per-node", "x", "--", "true"], "--procs-per-node must be a positive integer"),
        (["--inter-node-rate", "fast", "--", "true"], "--inter-node-rate must look like"),
        (["--inter-node-delay", "soon", "--", "true"], "--inter-node-delay must look like"),
        (["--master-port", "70000", "--", "true"], "--master-port must be in 1..65535"),
        (["--mtu", "100", "--", "true"], "--mtu must be an integer in 576..65535"),
        (["--nodes", "2"], "no command given"),
        (["--nodes"], "--nodes needs a value"),
        (["--bogus", "--", "true"], "unknown option '--bogus'"),
    ],
)
def test_bad_arguments_exit_2_naming_the_flag(args: list[str], message: str) -> None:
    rc, _, err, _ = _cluster(args, timeout=20)
    assert rc == 2
    assert message in err


@pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("setpriv") is None,
    reason="needs root and setpriv to run the script as an unprivileged user",
)
def test_non_root_is_refused_with_exit_2() -> None:
    # The script is fed to bash on stdin from "/", so the unprivileged user never has to read the
    # checkout: the test holds wherever the repository is cloned (e.g. under a 0700 home directory).
    result = subprocess.run(
        ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "bash", "-s", "--", "--", "true"],
        input=SCRIPT.read_text(),
        cwd="/",
        capture_output=True,
        text=True,
        timeout=20,
    )
    assert result.returncode == 2
    assert "must run as root" in result.stderr


@needs_netns
def test_two_node_allreduce_and_link_rate() -> None:
    rc, out, err, pid = _cluster(
        [
            "--nodes",
            "2",
            "--procs-per-node",
            "1",
            "--inter-node-rate",
            "200mbit",
            "--master-port",
            "29611",
            "--timeout",
            "90",
            "--",
            "tests/cluster_probe.py",
            "--mbytes",
            "8",
            "--reps",
            "3",
        ],
        timeout=120,
    )
    assert rc == 0, out + err
    reduced = _probes(out, "allreduce")
    assert {n: (r["rank"], r["value"], r["ifname"]) for n, r in reduced.items()} == {
        0: (0, 3.0, "veth0"),
        1: (1, 3.0, "veth1"),
    }  # 1 + 2
    transfer = _probes(out, "sendrecv")[0]
    rate = _goodput_bps(transfer["bytes"], transfer["seconds"])
    assert 0.7 * RATE_BPS <= rate <= 1.3 * RATE_BPS, f"{rate / 1e6:.0f} Mbit/s, {transfer}"
    assert _our_namespaces(pid) == []


@needs_netns
def test_both_directions_of_each_link_are_shaped_and_env_is_set() -> None:
    rc, out, err, pid = _cluster(
        [
            "--nodes",
            "3",
            "--inter-node-rate",
            "200mbit",
            "--master-port",
            "29612",
            "--no-torchrun",
            "--timeout",
            "40",
            "--",
            sys.executable,
            "tests/net_probe.py",
            "--mbytes",
            "4",
            "--reps",
            "2",
        ]
    )
    assert rc == 0, out + err
    env = _probes(out, "env")
    assert env == {
        i: {
            "probe": "env",
            "NODE_RANK": str(i),
            "NNODES": "3",
            "NPROC_PER_NODE": "1",
            "MASTER_ADDR": "10.77.0.1",
            "MASTER_PORT": "29612",
            "GLOO_SOCKET_IFNAME": f"veth{i}",
            "OMP_NUM_THREADS": "1",
        }
        for i in range(3)
    }
    # Two peers x 4 MiB cross node 0's receive link (incast) or send link
    # (outcast); each would run at 2x the rate if that side were unshaped.
    for kind in ("incast", "outcast"):
        rec = _probes(out, kind)[0]
        rate = _goodput_bps(rec["peers"] * rec["bytes_per_peer"], rec["seconds"])
        assert 0.7 * RATE_BPS <= rate <= 1.3 * RATE_BPS, f"{kind}: {rate / 1e6:.0f} Mbit/s"
    assert _our_namespaces(pid) == []


@needs_netns
def test_failing_node_fails_the_run_and_stops_the_others() -> None:
    start = time.monotonic()
    rc, out, err, pid = _cluster(
        [
            "--nodes",
            "2",
            "--no-torchrun",
            "--grace",
            "1",
            "--",
            "sh",
            "-c",
            'echo up; [ "$NODE_RANK" = 1 ] && exit 7; exec sleep 60',
        ]
    )
    assert rc == 7, out + err
    assert time.monotonic() - start < 30  # node 0's sleep 60 was cut short
    assert "node 1 exited with status 7" in err
    assert sorted(line for line in out.splitlines() if line.endswith("up")) == ["[node 0] up", "[node 1] up"]
    assert _our_namespaces(pid) == []


@needs_netns
def test_timeout_stops_the_run_with_124() -> None:
    rc, _, err, pid = _cluster(["--nodes", "2", "--no-torchrun", "--timeout", "1", "--", "sleep", "60"])
    assert rc == 124, err
    assert _our_namespaces(pid) == []


@needs_netns
def test_sigint_kills_the_nodes_and_removes_the_namespaces() -> None:
    proc = subprocess.Popen(
        [str(SCRIPT), "--nodes", "2", "--no-torchrun", "--", "sleep", "60"],
        cwd=ROOT,
        env=_env(),
        # the output is not checked here
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        # a shell cannot trap a signal ignored when it started: under a launcher that ignores SIGINT
        # (a background job of a non-interactive shell, nohup ... &) the script must still get it
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    node_pids: list[int] = []
    deadline = time.monotonic() + 15
    while not node_pids and time.monotonic() < deadline:
        if f"mmoe-{proc.pid}-n1" in _our_namespaces(proc.pid):
            pids = subprocess.run(["ip", "netns", "pids", f"mmoe-{proc.pid}-n1"], capture_output=True, text=True).stdout
            node_pids = [int(p) for p in pids.split()]
        time.sleep(0.1)
    assert node_pids, "node 1 never started"
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=60) == 130
    assert [p for p in node_pids if os.path.exists(f"/proc/{p}")] == []
    assert _our_namespaces(proc.pid) == []


def _netem_available() -> bool:
    """Whether this kernel has tc netem, tried in a throwaway namespace."""
    name = f"mmoe-netem-check-{os.getpid()}"
    subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        return (
            subprocess.run(
                ["tc", "-n", name, "qdisc", "add", "dev", "lo", "root", "netem", "delay", "1ms"], capture_output=True
            ).returncode
            == 0
        )
    finally:
        subprocess.run(["ip", "netns", "del", name], check=True)


@needs_netns
def test_delay_is_applied_or_warned_about() -> None:
    rc, out, err, _ = _cluster(
        [
            "--nodes",
            "2",
            "--inter-node-delay",
            "0.1ms",
            "--no-torchrun",
            "--",
            "sh",
            "-c",
            'tc qdisc show dev "veth$NODE_RANK"',
        ]
    )
    assert rc == 0, err
    warned = "--inter-node-delay 0.1ms ignored" in err
    if _netem_available():
        assert not warned and out.count("netem") == 2, out
    else:
        assert warned and "netem" not in out, out + err
