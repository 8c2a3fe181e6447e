"""GPT-2's tanh-GELU on CPU float32 tensors: the vectorized C loops of `gelu_tanh.c` (which also
holds the MoE combine's weighted gather, `combine_forward` / `combine_backward`).

Built once per machine with the system C compiler (``$CC``, else ``cc`` or ``gcc``) into the
kernel cache (``$MEGATRON_MOE_KERNEL_CACHE``, else ``~/.cache/megatron_moe/kernels``; the
file name hashes the source, the flags, the compiler and the CPU, so a cache shared between
machines never hands one a library built for another), and loaded with ctypes. The library is
checked against aten on load. Whenever it cannot be used (no compiler, a failed build or
check, ``MEGATRON_MOE_NO_CPU_KERNELS=1``, a tensor that is not a contiguous CPU float32 one,
or more than `MAX_THREADS` intra-op threads, where aten's parallel kernel wins) the callers
in `layers/fused.py` run aten's kernel; `status()` says which and why.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Optional

import torch

SOURCE = Path(__file__).with_name("gelu_tanh.c")
FLAGS = ("-O3", "-fPIC", "-shared")
NATIVE = "-march=native"
# the loops run on one thread: with more intra-op threads than this, aten's parallel kernel is the faster
MAX_THREADS = 2

_lock = threading.Lock()
_lib: Optional[ctypes.CDLL] = None
_status = ""  # "" until the first use tries to load the library


def disabled() -> bool:
    return os.environ.get("MEGATRON_MOE_NO_CPU_KERNELS", "0") == "1"


def status() -> str:
    """Which implementation runs on contiguous CPU float32 tensors now, and why (loads the library if
    not tried yet)."""
    if disabled():
        return "aten (MEGATRON_MOE_NO_CPU_KERNELS=1)"
    lib = library()
    threads = torch.get_num_threads()
    if lib is not None and threads > MAX_THREADS:
        return f"aten ({threads} intra-op threads, more than {MAX_THREADS}; the C kernel is loaded)"
    return _status


def applies(*tensors: torch.Tensor) -> bool:
    """True when the C loops run for these tensors (every one a contiguous CPU float32 tensor)."""
    if disabled() or torch.get_num_threads() > MAX_THREADS:
        return False
    if not all(t.device.type == "cpu" and t.dtype == torch.float32 and t.is_contiguous() for t in tensors):
        return False
    return library() is not None


def forward(x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out = gelu_tanh(x); `applies(x, out)` must hold and the shapes match."""
    _check(x, out)
    _lib.gelu_tanh_fwd(x.data_ptr(), out.data_ptr(), x.numel())  # type: ignore[union-attr]
    return out


def forward_bias(a: torch.Tensor, bias: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """a += bias (broadcast over a's rows, in place), out = gelu_tanh(a), in one pass; `applies(a, bias, out)`
    must hold, a and out [rows, cols], bias [cols]."""
    _check(a, out)
    if a.dim() != 2 or bias.shape != (a.size(1),):
        raise ValueError(f"cpu_gelu: bias {tuple(bias.shape)} does not fit the rows of {tuple(a.shape)}")
    _lib.gelu_tanh_bias_fwd(a.data_ptr(), bias.data_ptr(), out.data_ptr(), a.size(0), a.size(1))  # type: ignore[union-attr]
    return out


def combine_applies(buf: torch.Tensor, weight: torch.Tensor, *index: Optional[torch.Tensor]) -> bool:
    """True when `combine_forward` / `combine_backward` run for these tensors: float32 rows of a 2-D buffer and
    weights, int64 indices (None: the identity), all contiguous on CPU, and the library loaded."""
    idx = [t for t in index if t is not None]
    if buf.dim() != 2 or not all(t.dtype == torch.int64 and t.device.type == "cpu" and t.is_contiguous() for t in idx):
        return False
    return applies(buf, weight)


def combine_forward(
    buf: torch.Tensor, row: Optional[torch.Tensor], token: torch.Tensor, weight: torch.Tensor, num_tokens: int
) -> torch.Tensor:
    """y [num_tokens, M]: row token[i] of y sums weight[i] * buf[row[i]] over the kept choices i (row None:
    buf row i); `combine_applies` must hold."""
    K, M = token.numel(), buf.size(1)
    if weight.numel() != K or (row is not None and row.numel() != K) or (row is None and buf.size(0) != K):
        raise ValueError("cpu_gelu: the combine's rows, tokens and weights differ in length")
    y = buf.new_empty(num_tokens, M)
    rp = None if row is None else row.data_ptr()
    _lib.moe_combine_fwd(buf.data_ptr(), rp, token.data_ptr(), weight.data_ptr(), y.data_ptr(), K, num_tokens, M)  # type: ignore[union-attr]
    return y


def combine_backward(
    g: torch.Tensor,
    buf: torch.Tensor,
    row: Optional[torch.Tensor],
    token: torch.Tensor,
    weight: torch.Tensor,
    d_buf: torch.Tensor,
) -> torch.Tensor:
    """The combine's gradient from g [T, M]: writes weight[i] * g[token[i]] into row row[i] of d_buf (buf's
    shape; its other rows untouched) and returns the weights' gradient [K]."""
    if d_buf.shape != buf.shape or g.size(1) != buf.size(1) or not d_buf.is_contiguous():
        raise ValueError("cpu_gelu: the combine's gradient buffers do not match")
    K = token.numel()
    dw = weight.new_empty(K)
    rp = None if row is None else row.data_ptr()
    _lib.moe_combine_bwd(  # type: ignore[union-attr]
        g.data_ptr(),
        buf.data_ptr(),
        rp,
        token.data_ptr(),
        weight.data_ptr(),
        d_buf.data_ptr(),
        dw.data_ptr(),
        K,
        buf.size(1),
    )
    return dw


def backward(grad: torch.Tensor, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out = grad * gelu_tanh'(x); `out` may be `grad` (in place)."""
    _check(grad, x, out)
    _lib.gelu_tanh_bwd(grad.data_ptr(), x.data_ptr(), out.data_ptr(), x.numel())  # type: ignore[union-attr]
    return out


def _check(*tensors: torch.Tensor) -> None:
    shape = tensors[0].shape
    if _lib is None or not all(t.shape == shape for t in tensors):
        raise ValueError("cpu_gelu: the library is not loaded, or the tensors' shapes differ")


def library() -> Optional[ctypes.CDLL]:
    """The loaded library, or None (the reason in `status()`); built and checked on the first call."""
    global _lib, _status
    if _status:  # decided: no lock on the hot path
        return _lib
    with _lock:
        if not _status:
            try:
                _lib = _load(_build())
                _status = f"C kernel {Path(_lib._name).name} (CPU float32, at most {MAX_THREADS} threads)"
            except Exception as e:  # noqa: BLE001  any failure: aten's kernel runs
                _lib, _status = None, f"aten (the C kernel is unavailable: {type(e).__name__}: {e})"
    return _lib


def _compiler() -> str:
    for name in (os.environ.get("CC"), "cc", "gcc"):
        if name and shutil.which(name):
            return name
    raise RuntimeError("no C compiler ($CC, cc or gcc) on PATH")


def _cpu_id() -> str:
    """What the -march=native code depends on: the machine and the CPU's feature flags."""
    flags = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                flags = line
                break
    except OSError:
        pass
    return f"{platform.machine()} {platform.processor()} {flags}"


def _cache_dir() -> Path:
    env = os.environ.get("MEGATRON_MOE_KERNEL_CACHE")
    d = Path(env) if env else Path.home() / ".cache" / "megatron_moe" / "kernels"
    try:
        d.mkdir(parents=True, exist_ok=True)
        if os.access(d, os.W_OK):
            return d
    except OSError:
        pass
    d = Path(tempfile.gettempdir()) / f"megatron_moe_kernels_{os.getuid()}"
    d.mkdir(parents=True, exist_ok=True)
    return d


def _build() -> Path:
    """The library's path, compiled unless the cache has it. Written under a temporary name and
    renamed when complete, so concurrent ranks never load a half-written file."""
    cc = _compiler()
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    source = SOURCE.read_bytes()
    for flags in ((*FLAGS, NATIVE), FLAGS):  # -march=native first; some compilers or CPUs refuse it
        key = hashlib.sha256(b"\0".join([source, " ".join(flags).encode(), version.encode(), _cpu_id().encode()]))
        path = _cache_dir() / f"gelu_tanh-{key.hexdigest()[:16]}.so"
        if path.exists():
            return path
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
        os.close(fd)
        try:
            done = subprocess.run([cc, *flags, str(SOURCE), "-o", tmp], capture_output=True, text=True, timeout=120)
            if done.returncode == 0:
                os.replace(tmp, path)
                return path
            error = done.stderr.strip().splitlines()[-1:] or [f"exit status {done.returncode}"]
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    raise RuntimeError(f"{cc} could not build {SOURCE.name}: {error[0]}")


def _load(path: Path) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(path))
    lib.gelu_tanh_fwd.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
    lib.gelu_tanh_fwd.restype = None
    lib.gelu_tanh_bwd.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
    lib.gelu_tanh_bwd.restype = None
    lib.gelu_tanh_bias_fwd.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 2
    lib.gelu_tanh_bias_fwd.restype = None
    lib.moe_combine_fwd.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_int64] * 3
    lib.moe_combine_fwd.restype = None
    lib.moe_combine_bwd.argtypes = [ctypes.c_void_p] * 7 + [ctypes.c_int64] * 2
    lib.moe_combine_bwd.restype = None
    # against aten on values across the whole range; an odd length runs the vector loops' remainder too
    x = torch.linspace(-12.0, 12.0, 4099, dtype=torch.float32, device="cpu")
    g = torch.linspace(-2.0, 3.0, 4099, dtype=torch.float32, device="cpu")
    y, dx = torch.empty_like(x), torch.empty_like(x)
    lib.gelu_tanh_fwd(x.data_ptr(), y.data_ptr(), x.numel())
    lib.gelu_tanh_bwd(g.data_ptr(), x.data_ptr(), dx.data_ptr(), x.numel())
    a, b, yb = x[:4096].reshape(64, 64).clone(), g[:64].clone(), torch.empty(64, 64, device="cpu")
    lib.gelu_tanh_bias_fwd(a.data_ptr(), b.data_ptr(), yb.data_ptr(), 64, 64)
    want_y = torch.nn.functional.gelu(x.double(), approximate="tanh")
    want_dx = torch.ops.aten.gelu_backward(g.double(), x.double(), approximate="tanh")
    want_a = x[:4096].reshape(64, 64).double() + g[:64].double()
    want_yb = torch.nn.functional.gelu(want_a, approximate="tanh")
    _check_combine(lib, path)
    for got, want, what in (
        (y, want_y, "forward"),
        (dx, want_dx, "backward"),
        (a, want_a, "bias"),
        (yb, want_yb, "bias forward"),
    ):
        err = float((got.double() - want).abs().max())
        if not err <= 1e-5:  # aten's own float32 error here: 4e-7 forward, 3e-6 backward
            raise RuntimeError(f"{path.name} failed its check ({what} off by {err:.3g})")
    return lib


def _check_combine(lib: ctypes.CDLL, path: Path) -> None:
    """The combine's kernels against aten's index ops on a small case (some tokens with two choices)."""
    cpu = torch.device("cpu")
    gen = torch.Generator(device=cpu).manual_seed(0)
    buf, g = torch.randn(12, 20, generator=gen, device=cpu), torch.randn(5, 20, generator=gen, device=cpu)
    row = torch.tensor([3, 0, 7, 8, 11, 2, 5], dtype=torch.int64, device=cpu)
    token = torch.tensor([0, 0, 1, 2, 2, 3, 4], dtype=torch.int64, device=cpu)
    w = torch.rand(7, generator=gen, device=cpu)
    y, dbuf, dw = torch.empty(5, 20, device=cpu), torch.zeros(12, 20, device=cpu), torch.empty(7, device=cpu)
    lib.moe_combine_fwd(buf.data_ptr(), row.data_ptr(), token.data_ptr(), w.data_ptr(), y.data_ptr(), 7, 5, 20)
    lib.moe_combine_bwd(
        g.data_ptr(),
        buf.data_ptr(),
        row.data_ptr(),
        token.data_ptr(),
        w.data_ptr(),
        dbuf.data_ptr(),
        dw.data_ptr(),
        7,
        20,
    )
    want_y = torch.zeros(5, 20, device=cpu).index_add_(0, token, buf[row] * w[:, None])
    want_dbuf = torch.zeros(12, 20, device=cpu).index_copy_(0, row, g[token] * w[:, None])
    want_dw = (g[token].double() * buf[row].double()).sum(1)
    if not (
        torch.equal(y, want_y) and torch.equal(dbuf, want_dbuf) and float((dw.double() - want_dw).abs().max()) <= 1e-4
    ):
        raise RuntimeError(f"{path.name} failed its check (the combine)")
