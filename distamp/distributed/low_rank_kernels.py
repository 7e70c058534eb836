"""PowerSGD's CPU passes as compiled C: build once per host, load with ctypes, split rows over threads.

On CPU the hook's time goes to memory traffic: with torch ops, widening a
BF16 gradient, adding the FP32 error (divided by the loss scale) and ``M Q``
are three sweeps over the matrix, ``P^T M``, the write-back and the error
update three more, and the thin products run below memory speed.
``low_rank_kernels.c`` does the work in three sweeps (see its header for the
exact order of operations; the bits do not depend on the host's vector
width or on the number of threads).

The library is compiled at first use with the system C compiler (``$CC``,
else ``cc``, ``gcc`` or ``clang``) into ``$DISTAMP_CACHE_DIR`` (default
``$XDG_CACHE_HOME/distamp`` or ``~/.cache/distamp``; where that cannot be
written, the temp directory), under a name hashed
from the source, the compiler, its flags and this CPU's feature flags, so
hosts sharing a home directory each get their own build. ``-march=native``
is safe for that reason (a compiler that refuses it builds without it);
``-ffp-contract=off`` keeps the arithmetic in the written order. Where
nothing can be built, :func:`load` says why and the hook uses torch ops
(same algorithm, other rounding of the products).
``DISTAMP_POWERSGD_KERNELS=torch`` skips the build.
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
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from distamp.distributed.low_rank import is_power_of_two

__all__ = ["KERNELS_ENV", "LowRankKernels", "find_compiler", "load"]

KERNELS_ENV = "DISTAMP_POWERSGD_KERNELS"
KERNEL_CHOICES = ("auto", "torch")
SOURCE = Path(__file__).with_name("low_rank_kernels.c")
COMPILERS = ("cc", "gcc", "clang")
_COMMON_FLAGS = ("-O3", "-ffp-contract=off", "-fPIC", "-shared", "-std=c11")
# Tried in order: this CPU's vector instructions, then (a compiler that refuses -march=native) the baseline.
FLAG_SETS = (("-march=native", *_COMMON_FLAGS), _COMMON_FLAGS)
# Below this many elements a matrix is one task: a thread hand-off costs more than it saves.
MIN_ELEMENTS_PER_THREAD = 1 << 17

_loaded: dict[str, LowRankKernels | str] = {}
_load_lock = threading.Lock()
_pools: dict[int, ThreadPoolExecutor] = {}


class LowRankKernels:
    """The compiled passes, with argument checks; see ``low_rank_kernels.c`` for the exact arithmetic.

    All tensors are contiguous CPU tensors: the gradient BF16 or FP32, the
    rest FP32. A call splits the matrix over ``torch.get_num_threads()``
    threads when it is large enough (the C code runs without the GIL).
    """

    def __init__(self, library: ctypes.CDLL, path: Path) -> None:
        self.path = path
        ptr, i64, f32, c_int = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int
        self._start = library.distamp_start
        self._start.argtypes = [c_int, ptr, ptr, ptr, ptr, ptr, i64, i64, i64, i64, f32, c_int]
        self._start.restype = None
        self._project = library.distamp_project
        self._project.argtypes = [ptr, ptr, ptr, i64, i64, i64, i64, i64]
        self._project.restype = None
        self._finish = library.distamp_finish
        self._finish.argtypes = [c_int, ptr, ptr, ptr, ptr, i64, i64, i64, i64, f32]
        self._finish.restype = None
        self._orthogonalize = library.distamp_orthogonalize
        self._orthogonalize.argtypes = [ptr, i64, i64, i64, i64]
        self._orthogonalize.restype = None

    def start(self, grad: torch.Tensor, error: torch.Tensor | None, m: torch.Tensor, qt: torch.Tensor,
              p: torch.Tensor, scale: float) -> None:
        """``m = grad / scale + error`` (``error`` None: no error) and ``p = m @ qt.t()``.

        ``grad`` is BF16 or FP32 (FP32 may be ``m`` itself), ``rows x cols``;
        ``qt`` is ``rank x cols``, ``p`` ``rows x rank``.
        """
        rows, cols = m.shape
        rank = qt.shape[0]
        _check(grad, (rows, cols), (torch.bfloat16, torch.float32), "grad")
        for name, t, shape in (("m", m, (rows, cols)), ("qt", qt, (rank, cols)), ("p", p, (rows, rank))):
            _check(t, shape, (torch.float32,), name)
        if error is not None:
            _check(error, (rows, cols), (torch.float32,), "error")
        by_inverse = int(is_power_of_two(scale))
        args = (int(grad.dtype == torch.bfloat16), grad.data_ptr(), 0 if error is None else error.data_ptr(),
                m.data_ptr(), qt.data_ptr(), p.data_ptr())
        _split(rows, cols, lambda r0, r1: self._start(*args, r0, r1, cols, rank, scale, by_inverse))

    def project(self, m: torch.Tensor, p: torch.Tensor, qt: torch.Tensor) -> None:
        """``qt = p.t() @ m`` (``m`` ``rows x cols``, ``p`` ``rows x rank``, ``qt`` ``rank x cols``)."""
        rows, cols = m.shape
        rank = p.shape[1]
        for name, t, shape in (("m", m, (rows, cols)), ("p", p, (rows, rank)), ("qt", qt, (rank, cols))):
            _check(t, shape, (torch.float32,), name)
        args = (m.data_ptr(), p.data_ptr(), qt.data_ptr(), rows, cols, rank)
        _split(cols, rows, lambda c0, c1: self._project(*args, c0, c1))

    def finish(self, out: torch.Tensor, m: torch.Tensor | None, p: torch.Tensor, qt: torch.Tensor,
               scale: float) -> None:
        """``a = p @ qt``; ``out = a * scale`` (BF16 rounded to nearest even, or FP32); ``m -= a`` unless None."""
        rows, rank = p.shape
        cols = qt.shape[1]
        _check(out, (rows, cols), (torch.bfloat16, torch.float32), "out")
        _check(p, (rows, rank), (torch.float32,), "p")
        _check(qt, (rank, cols), (torch.float32,), "qt")
        if m is not None:
            _check(m, (rows, cols), (torch.float32,), "m")
        args = (int(out.dtype == torch.bfloat16), out.data_ptr(), 0 if m is None else m.data_ptr(),
                p.data_ptr(), qt.data_ptr())
        _split(rows, cols, lambda r0, r1: self._finish(*args, r0, r1, cols, rank, scale))

    def orthogonalize_columns_(self, matrix: torch.Tensor) -> torch.Tensor:
        """Gram-Schmidt on the columns of an FP32 ``rows x rank`` matrix (P) in place; returns it.

        As :func:`~distamp.distributed.low_rank.orthogonalize_`: a zero column
        stays zero, non-finite input stays non-finite.
        """
        rows, rank = matrix.shape
        _check(matrix, (rows, rank), (torch.float32,), "matrix")
        self._orthogonalize(matrix.data_ptr(), rank, rows, 1, rank)
        return matrix

    def orthogonalize_rows_(self, matrix: torch.Tensor) -> torch.Tensor:
        """Gram-Schmidt on the rows of an FP32 ``rank x cols`` matrix (Q^T) in place; returns it."""
        rank, cols = matrix.shape
        _check(matrix, (rank, cols), (torch.float32,), "matrix")
        self._orthogonalize(matrix.data_ptr(), rank, cols, cols, 1)
        return matrix


def load() -> LowRankKernels | str:
    """The kernels, built on first use; or a sentence saying why there are none (the hook then uses torch ops).

    Raises:
        ValueError: ``DISTAMP_POWERSGD_KERNELS`` is set to something other
            than ``auto`` or ``torch``.
    """
    choice = os.environ.get(KERNELS_ENV, "auto")
    if choice not in KERNEL_CHOICES:
        raise ValueError(f"{KERNELS_ENV}={choice!r} is not a choice; use one of {', '.join(KERNEL_CHOICES)} "
                         "(auto: build PowerSGD's CPU kernels with the C compiler; torch: use torch ops)")
    if choice == "torch":
        return f"{KERNELS_ENV}=torch"
    with _load_lock:
        if "kernels" not in _loaded:
            _loaded["kernels"] = _build_and_load()
        return _loaded["kernels"]


def find_compiler() -> str | None:
    """``$CC`` if set (None if it is not on PATH), else the first of ``cc``, ``gcc``, ``clang`` on PATH."""
    if os.environ.get("CC"):
        return os.environ["CC"] if shutil.which(os.environ["CC"]) else None
    return next((name for name in COMPILERS if shutil.which(name)), None)


def _build_and_load() -> LowRankKernels | str:
    compiler = find_compiler()
    if compiler is None:
        wanted = os.environ.get("CC") or " or ".join(COMPILERS)
        return f"no C compiler ({wanted}) on PATH (set CC to one)"
    source = SOURCE.read_bytes()
    try:
        version = subprocess.run([compiler, "--version"], capture_output=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError) as err:
        return f"{compiler} --version failed: {err}"
    host = _cpu_flags()
    names = {flags: hashlib.sha256(b"\0".join([source, version, " ".join(flags).encode(), host])).hexdigest()[:16]
             for flags in FLAG_SETS}
    failures = []
    for cache in _cache_dirs():
        for flags in FLAG_SETS:
            target = cache / f"low_rank_kernels-{names[flags]}.so"
            if not target.exists():
                failure = _build(compiler, flags, cache, target)
                if failure:
                    failures.append(failure)
                    continue
            try:
                return LowRankKernels(ctypes.CDLL(str(target)), target)
            except OSError as err:
                failures.append(f"loading {target} failed: {err}")
    return "; ".join(failures)


def _build(compiler: str, flags: tuple[str, ...], cache: Path, target: Path) -> str | None:
    """Compile the library into ``target``; None, or what went wrong."""
    try:
        cache.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=cache) as tmp:
            built = Path(tmp) / target.name
            done = subprocess.run([compiler, *flags, "-o", str(built), str(SOURCE), "-lm"], capture_output=True,
                                  text=True, timeout=300)
            if done.returncode != 0:
                return f"{compiler} {' '.join(flags)} failed to compile {SOURCE.name}: {done.stderr.strip()[-500:]}"
            os.replace(built, target)  # atomic: processes building at once each install a whole file
    except (OSError, subprocess.SubprocessError) as err:
        return f"building {target} failed: {err}"
    return None


def _cache_dirs() -> list[Path]:
    """``$DISTAMP_CACHE_DIR`` alone if set; else the user's cache directory, then one under the temp directory."""
    if os.environ.get("DISTAMP_CACHE_DIR"):
        return [Path(os.environ["DISTAMP_CACHE_DIR"])]
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    user = os.getuid() if hasattr(os, "getuid") else os.getpid()
    return [Path(base) / "distamp", Path(tempfile.gettempdir()) / f"distamp-{user}"]


def _cpu_flags() -> bytes:
    """This CPU's feature flags (the build uses -march=native), or the platform's name where unreadable."""
    try:
        with open("/proc/cpuinfo", "rb") as f:
            for line in f:
                if line.startswith((b"flags", b"Features")):
                    return line
    except OSError:
        pass
    return f"{platform.machine()} {platform.processor()}".encode()


def _check(t: torch.Tensor, shape: tuple[int, ...], dtypes: tuple[torch.dtype, ...], name: str) -> None:
    if t.device.type != "cpu" or not t.is_contiguous() or t.dtype not in dtypes or tuple(t.shape) != shape:
        raise ValueError(f"low-rank kernel argument {name}: expected a contiguous CPU tensor of shape {shape} "
                         f"and dtype in {dtypes}; got {tuple(t.shape)} {t.dtype} on {t.device}"
                         f"{'' if t.is_contiguous() else ', not contiguous'}")


def _split(length: int, other: int, run: Callable[[int, int], None]) -> None:
    """``run(start, stop)`` over ``range(length)`` cut into one part per thread (this thread takes the first)."""
    parts = min(torch.get_num_threads(), max(1, length * other // MIN_ELEMENTS_PER_THREAD), length)
    if parts <= 1:
        run(0, length)
        return
    bounds = [length * i // parts for i in range(parts + 1)]
    pool = _pools.get(parts - 1)
    if pool is None:
        pool = _pools[parts - 1] = ThreadPoolExecutor(parts - 1, thread_name_prefix="distamp-low-rank")
    futures = [pool.submit(run, bounds[i], bounds[i + 1]) for i in range(1, parts)]
    run(bounds[0], bounds[1])
    for future in futures:
        future.result()
