"""The C tanh-GELU for CPU float32 tensors (`megatron_moe/kernels/cpu_gelu.py`): agreement with aten,
the cases that fall back to aten, the build (cache, temporary names, no compiler), and the experts on it."""

from __future__ import annotations

import json
import os
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from megatron_moe.kernels import cpu_gelu
from megatron_moe.layers.fused import gelu_tanh, gelu_tanh_backward, gelu_tanh_out, kernel_report
from megatron_moe.testing import run_command

ROOT = Path(__file__).resolve().parents[1]

# only a missing compiler skips: a kernel that fails to build or fails its check fails these tests
needs_kernel = pytest.mark.skipif("no C compiler" in cpu_gelu.status(), reason=cpu_gelu.status())


@needs_kernel
def test_the_kernel_builds_and_passes_its_check_where_a_compiler_is():
    assert cpu_gelu.library() is not None, cpu_gelu.status()


def _values() -> torch.Tensor:
    """Every regime: the tails where sigmoid saturates, around 0, and an odd length (the vector loop's remainder)."""
    g = torch.Generator(device="cpu").manual_seed(0)
    x = torch.cat([torch.linspace(-30, 30, 6001), torch.randn(1237, generator=g) * 4, torch.tensor([0.0, -0.0, 1e-30])])
    return x.to(torch.float32)


@needs_kernel
def test_forward_and_backward_agree_with_aten_to_its_own_rounding():
    x = _values()
    grad = torch.randn(x.shape, generator=torch.Generator(device="cpu").manual_seed(1))
    y, dx = torch.empty_like(x), torch.empty_like(x)
    cpu_gelu.forward(x, y)
    cpu_gelu.backward(grad, x, dx)
    exact_y = F.gelu(x.double(), approximate="tanh")
    exact_dx = torch.ops.aten.gelu_backward(grad.double(), x.double(), approximate="tanh")
    err_y = float((y.double() - exact_y).abs().max())
    err_dx = float((dx.double() - exact_dx).abs().max())
    aten_err_y = float((F.gelu(x, approximate="tanh").double() - exact_y).abs().max())
    aten_err_dx = float((torch.ops.aten.gelu_backward(grad, x, approximate="tanh").double() - exact_dx).abs().max())
    # within 2x aten's own float32 error (and both tiny): the kernel is as exact as the kernel it replaces
    assert err_y <= max(2 * aten_err_y, 1e-6), (err_y, aten_err_y)
    assert err_dx <= max(2 * aten_err_dx, 1e-6), (err_dx, aten_err_dx)
    # the saturated tails are exact: 0 (or -0) far left, x far right; the gradient 0 and 1
    assert torch.equal(y[:100], torch.zeros(100)) and torch.equal(y[5901:6001], x[5901:6001])
    assert torch.equal(dx[:100], torch.zeros(100))


@needs_kernel
def test_extremes_match_aten():
    x = torch.tensor([-1e30, -100.0, 100.0, 1e30, float("inf"), float("-inf"), float("nan"), 0.0])
    y = torch.empty_like(x)
    cpu_gelu.forward(x, y)
    want = F.gelu(x, approximate="tanh")
    assert torch.equal(torch.isnan(y), torch.isnan(want))
    finite = ~torch.isnan(want)
    assert torch.equal(y[finite], want[finite])


@needs_kernel
def test_autograd_function_equals_aten_and_refuses_double_backward(monkeypatch):
    x = (torch.randn(37, 129) * 3).requires_grad_()
    grad = torch.randn(37, 129)
    y = gelu_tanh(x)
    assert type(y.grad_fn).__name__ == "_GeluTanhBackward"  # the kernel ran, not aten
    y.backward(grad)
    x_ref = x.detach().clone().requires_grad_()
    y_ref = F.gelu(x_ref, approximate="tanh")
    y_ref.backward(grad)
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-5, atol=1e-5)
    # a non-contiguous incoming gradient is made contiguous for the kernel
    x.grad = None
    gelu_tanh(x).backward(grad.t().contiguous().t())
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-5, atol=1e-5)
    (gx,) = torch.autograd.grad(gelu_tanh(x).sum(), x, create_graph=True)
    with pytest.raises(RuntimeError):
        gx.sum().backward()  # differentiable once: a second derivative fails loudly instead of being wrong


@needs_kernel
def test_out_and_in_place_backward():
    x = torch.randn(64, 33) * 2
    out = torch.empty_like(x)
    assert gelu_tanh_out(x, out) is out
    torch.testing.assert_close(out, F.gelu(x, approximate="tanh"), rtol=1e-5, atol=1e-6)
    g = torch.randn(64, 33)
    want = torch.ops.aten.gelu_backward(g, x, approximate="tanh")
    got = gelu_tanh_backward(g, x, out=g)  # in place
    assert got is g
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@needs_kernel
@pytest.mark.parametrize("case", ["disabled", "float64", "strided", "threads"])
def test_aten_runs_where_the_kernel_does_not_apply(case, monkeypatch):
    x = torch.randn(16, 24)
    if case == "disabled":
        monkeypatch.setenv("MEGATRON_MOE_NO_CPU_KERNELS", "1")
    elif case == "float64":
        x = x.double()
    elif case == "strided":
        x = x.t()
    else:
        monkeypatch.setattr(torch, "get_num_threads", lambda: cpu_gelu.MAX_THREADS + 1)
    assert not cpu_gelu.applies(x)
    x.requires_grad_()
    y = gelu_tanh(x)
    assert "Gelu" in type(y.grad_fn).__name__ and type(y.grad_fn).__name__ != "_GeluTanhBackward"
    assert torch.equal(y, F.gelu(x, approximate="tanh"))


def _status_in_fresh_process(env: dict) -> str:
    code = "from megatron_moe.kernels import cpu_gelu; print(cpu_gelu.status())"
    full = {**os.environ, "PYTHONPATH": str(ROOT), **env}
    done = run_command([sys.executable, "-c", code], env=full, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


@needs_kernel
def test_build_goes_through_a_temporary_name_into_the_cache(tmp_path):
    status = _status_in_fresh_process({"MEGATRON_MOE_KERNEL_CACHE": str(tmp_path)})
    built = sorted(p.name for p in tmp_path.iterdir())
    assert status.startswith("C kernel gelu_tanh-"), status
    assert len(built) == 1 and built[0].endswith(".so") and built[0] in status, built  # no .tmp left behind
    mtime = (tmp_path / built[0]).stat().st_mtime_ns
    assert _status_in_fresh_process({"MEGATRON_MOE_KERNEL_CACHE": str(tmp_path)}) == status
    assert (tmp_path / built[0]).stat().st_mtime_ns == mtime  # the second process loaded it, built nothing


def test_without_a_compiler_aten_runs_and_the_report_says_why(tmp_path):
    status = _status_in_fresh_process(
        {"MEGATRON_MOE_KERNEL_CACHE": str(tmp_path), "CC": "no-such-cc", "PATH": str(tmp_path)}
    )
    assert status.startswith("aten (the C kernel is unavailable: RuntimeError: no C compiler"), status
    assert list(tmp_path.iterdir()) == []


def test_a_failing_compiler_leaves_no_file_and_aten_runs(tmp_path):
    cc = tmp_path / "bin" / "badcc"
    cc.parent.mkdir()
    cc.write_text(
        textwrap.dedent("""\
            #!/bin/sh
            if [ "$1" = --version ]; then echo badcc 1.0; exit 0; fi
            for a; do case "$a" in -o) out=1;; *) if [ -n "$out" ]; then echo partial > "$a"; out=; fi;; esac; done
            echo "badcc: error: nothing compiles here" >&2
            exit 1
        """)
    )
    cc.chmod(0o755)
    cache = tmp_path / "cache"
    status = _status_in_fresh_process({"MEGATRON_MOE_KERNEL_CACHE": str(cache), "CC": str(cc)})
    assert "could not build gelu_tanh.c: badcc: error: nothing compiles here" in status, status
    assert list(cache.iterdir()) == []  # the partial output under its temporary name was removed


def test_kernel_report_names_the_cpu_gelu(monkeypatch):
    report = kernel_report()
    assert report["gelu_cpu"] == cpu_gelu.status()
    assert report["gelu_cpu"].startswith(("C kernel gelu_tanh-", "aten ("))
    monkeypatch.setattr(torch, "get_num_threads", lambda: cpu_gelu.MAX_THREADS + 1)
    if cpu_gelu.library() is not None:
        assert kernel_report()["gelu_cpu"].startswith(f"aten ({cpu_gelu.MAX_THREADS + 1} intra-op threads")
    monkeypatch.setenv("MEGATRON_MOE_NO_CPU_KERNELS", "1")
    assert kernel_report()["gelu_cpu"] == "aten (MEGATRON_MOE_NO_CPU_KERNELS=1)"


@needs_kernel
def test_the_experts_on_the_kernel_equal_the_experts_on_aten(monkeypatch):
    """The grouped expert MLP (hand-written forward and backward) with the C kernel against aten's."""
    from megatron_moe.moe.experts import Experts
    from megatron_moe.parallel_state import local_state

    ps = local_state()
    results = []
    for disable in ("0", "1"):
        monkeypatch.setenv("MEGATRON_MOE_NO_CPU_KERNELS", disable)
        experts = Experts(4, 32, 128, ps, 7, "test.gelu", device=torch.device("cpu"))
        g = torch.Generator(device="cpu").manual_seed(3)
        x = torch.randn(50, 32, generator=g).requires_grad_()
        gy = torch.randn(50, 32, generator=g)
        y = experts.forward_ragged(x, [20, 0, 17, 13])
        (y * gy).sum().backward()
        results.append([y.detach(), x.grad] + [p.grad for p in experts.parameters()])
    for got, want in zip(*results):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@needs_kernel
def test_bench_gelu_times_both_kernels_on_the_same_results(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "tools"))
    import bench_gelu

    threads = torch.get_num_threads()
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    out = tmp_path / "gelu.json"
    try:
        assert (
            bench_gelu.main(
                [
                    "--rows",
                    "7",
                    "40",
                    "--hidden-size",
                    "8",
                    "--ffn-hidden-size",
                    "24",
                    "--iters",
                    "2",
                    "--json",
                    str(out),
                ]
            )
            == 0
        )
    finally:
        torch.set_num_threads(threads)
    rows = json.loads(out.read_text())
    assert [(r["rows"], r["what"]) for r in rows] == [
        (R, w) for R in (7, 40) for w in ("forward", "backward", "expert MLPs fwd+bwd")
    ]
    for r in rows:  # both implementations ran, on results that agree
        assert r["aten_ms"] > 0 and r["c_ms"] > 0 and r["speedup"] == r["aten_ms"] / r["c_ms"]
        assert r["max_abs_diff"] <= 1e-5, r
    assert [p.name for p in tmp_path.iterdir()] == ["gelu.json"]  # no temporary file left
