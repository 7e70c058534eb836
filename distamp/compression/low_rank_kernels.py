"""PowerSGD's CPU passes as compiled C: build once per host, load with ctypes, split rows over threads.

On CPU the hook's time goes to memory traffic: with torch ops, widening a
BF16 gradient, adding the FP32 error (divided by the loss scale) and ``M Q``
are three sweeps over the matrix, ``P^T M``, the write-back and the error
update three more, and the thin products run below memory speed.
``low_rank_kernels.c`` does the work in three sweeps (see its header for the
exact order of operations; the bits do not depend on the host's vector
width or on the number of threads).

The library is compiled at first use with the system C compiler (``$CC``,
split as the shell would, so ``CC="ccache gcc"`` works; else ``cc``, ``gcc``
or ``clang``) into ``$DISTAMP_CACHE_DIR`` (default ``$XDG_CACHE_HOME/distamp``
or ``~/.cache/distamp``; where that cannot be created, a fresh private
temporary directory, removed once the library is loaded), under a name hashed
from the source, the compiler command, its version, its flags and this CPU's
feature flags, so hosts sharing a home directory each get their own build.
``-march=native`` is safe for that reason (a compiler that refuses it builds
without it); ``-ffp-contract=off`` keeps the arithmetic in the written order.

Loading compiled code is loading code: the cache directory is created with
mode 0700, and one not owned by this user or writable by group or others is
refused (no kernels: the hook uses torch ops, with a warning saying why);
the library is built under a temporary name in that directory and renamed
into place, and its owner and mode are checked again just before ``dlopen``
(a file failing the check is never loaded: it is rebuilt over).

Where nothing can be built, :func:`load` says why and the hook uses torch
ops (same algorithm, other rounding of the products).
``DISTAMP_POWERSGD_KERNELS=torch`` skips the build.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import logging
import os
import platform
import shlex
import shutil
import stat
import subprocess
import tempfile
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from distamp.compression.low_rank import is_power_of_two

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

logger = logging.getLogger("distamp")

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

        As :func:`~distamp.compression.low_rank.orthogonalize_`: a zero column
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

    @functools.cached_property
    def fingerprint(self) -> int:
        """A 60-bit checksum of every pass's output on a fixed input: equal for builds that compute the same bits.

        Ranks compare it rather than "has kernels": a compiler that defaults
        to ``-ffast-math`` or ``-ffp-contract=fast`` builds kernels that load
        and run but round otherwise. The input is made from integers (no
        random draw, whose bits depend on torch's vector kernels), with a
        tail after the 16-lane body, a scale that is not a power of two, and
        rank 3.
        """
        rows, cols, rank = 37, 70, 3

        def fixed(n: int, salt: int) -> torch.Tensor:
            return (((torch.arange(n, dtype=torch.int64) * 7919 + salt) % 1009) - 504).to(torch.float32) / 256

        grad = fixed(rows * cols, 1).view(rows, cols).to(torch.bfloat16)
        error = fixed(rows * cols, 2).view(rows, cols) / 64
        qt = self.orthogonalize_rows_(fixed(rank * cols, 3).view(rank, cols))
        m, p, q_new = torch.empty(rows, cols), torch.empty(rows, rank), torch.empty(rank, cols)
        out16, out32 = torch.empty(rows, cols, dtype=torch.bfloat16), torch.empty(rows, cols)
        self.start(grad, error, m, qt, p, 3.0)
        self.orthogonalize_columns_(p)
        self.project(m, p, q_new)
        self.finish(out32, None, p, q_new, 3.0)
        self.finish(out16, m, p, q_new, 3.0)
        digest = hashlib.sha256()
        for t in (qt, p, q_new, out32, m, out16.view(torch.int16)):
            digest.update(t.numpy().tobytes())
        return int(digest.hexdigest()[:15], 16)


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


def find_compiler() -> list[str] | None:
    """The compiler command: ``$CC`` split as the shell would (None if its program is not on PATH or it
    does not parse), else the first of ``cc``, ``gcc``, ``clang`` on PATH."""
    if os.environ.get("CC", "").strip():
        try:
            command = shlex.split(os.environ["CC"])
        except ValueError:
            return None
        return command if shutil.which(command[0]) else None
    found = next((name for name in COMPILERS if shutil.which(name)), None)
    return [found] if found else None


def _build_and_load() -> LowRankKernels | str:
    compiler = find_compiler()
    if compiler is None:
        wanted = os.environ.get("CC") or " or ".join(COMPILERS)
        return f"no C compiler ({wanted}) on PATH (set CC to one)"
    try:
        names = _library_names(compiler)
    except (OSError, subprocess.SubprocessError) as err:
        return f"{shlex.join(compiler)} --version failed: {err}"
    cache, temporary, problem = _cache_dir()
    if cache is None:
        return problem or "no cache directory"
    failures = []
    try:
        for flags in FLAG_SETS:
            target = cache / names[flags]
            unsafe = _unsafe_file(target) if os.path.lexists(target) else "absent"
            if unsafe:
                if unsafe != "absent":
                    logger.warning("distamp: not loading %s (%s); building it again", target, unsafe)
                failure = _build(compiler, flags, cache, target)
                if failure:
                    failures.append(failure)
                    continue  # e.g. a compiler that refuses -march=native: try the next flags
                unsafe = _unsafe_file(target)
                if unsafe:
                    return f"refusing to load {target}: {unsafe}"
            try:
                return LowRankKernels(ctypes.CDLL(str(target)), target)
            except OSError as err:
                # Not the flags' fault (a noexec directory, another architecture): no other build would load.
                failures.append(f"loading {target} failed: {err}")
                break
    finally:
        if temporary:
            shutil.rmtree(cache, ignore_errors=True)  # a loaded library stays mapped
    return "; ".join(failures)


def _library_names(compiler: list[str]) -> dict[tuple[str, ...], str]:
    """The library's file name per flag set: a hash of the source, the compiler command, its version, the flags
    and this CPU's feature flags."""
    version = subprocess.run([*compiler, "--version"], capture_output=True, timeout=60).stdout
    parts = [SOURCE.read_bytes(), shlex.join(compiler).encode(), version, _cpu_flags()]
    names: dict[tuple[str, ...], str] = {}
    for flags in FLAG_SETS:
        digest = hashlib.sha256(b"\0".join([*parts, " ".join(flags).encode()])).hexdigest()[:16]
        names[flags] = f"low_rank_kernels-{digest}.so"
    return names


def _build(compiler: list[str], flags: tuple[str, ...], cache: Path, target: Path) -> str | None:
    """Compile the library into ``target`` (built under a temporary name, then renamed); None, or what went wrong."""
    try:
        with tempfile.TemporaryDirectory(dir=cache) as tmp:
            built = Path(tmp) / target.name
            done = subprocess.run([*compiler, *flags, "-o", str(built), str(SOURCE), "-lm"], capture_output=True,
                                  text=True, timeout=300)
            if done.returncode != 0:
                return (f"{shlex.join(compiler)} {' '.join(flags)} failed to compile {SOURCE.name}: "
                        f"{done.stderr.strip()[-500:]}")
            os.chmod(built, 0o700)  # whatever the umask: no group or other write, or the load check refuses it
            os.replace(built, target)  # atomic: processes building at once each install a whole file
    except (OSError, subprocess.SubprocessError) as err:
        return f"building {target} failed: {err}"
    return None


def _cache_path() -> Path:
    """The kernels' cache: ``$DISTAMP_CACHE_DIR``, else ``$XDG_CACHE_HOME/distamp`` or ``~/.cache/distamp``."""
    if os.environ.get("DISTAMP_CACHE_DIR"):
        return Path(os.environ["DISTAMP_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "distamp"


def _cache_dir() -> tuple[Path | None, bool, str | None]:
    """``(directory, temporary, why none)``: the private cache directory, created with mode 0700 if absent.

    Where the default one cannot be created (a read-only home), a fresh
    ``mkdtemp`` directory of this process (``temporary``); never a
    predictable shared path. An existing directory that another user owns
    or that group or others can write is refused.
    """
    path = _cache_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileExistsError):
            path.mkdir(mode=0o700)
    except OSError as err:
        if os.environ.get("DISTAMP_CACHE_DIR"):
            return None, False, f"cannot create the kernel cache DISTAMP_CACHE_DIR={str(path)!r}: {err}"
        try:
            return Path(tempfile.mkdtemp(prefix="distamp-kernels-")), True, None
        except OSError as temp_err:
            return None, False, f"cannot create {path} ({err}) nor a temporary directory ({temp_err})"
    unsafe = _unsafe_dir(path)
    if unsafe:
        return None, False, (f"refusing the kernel cache {path}: {unsafe}, so another user could plant code "
                             "there; make it yours with mode 0700 (chmod 700), or set DISTAMP_CACHE_DIR to a "
                             "private directory")
    return path, False, None


def _unsafe_dir(path: Path) -> str | None:
    """Why ``path`` may not hold code this process loads, or None."""
    try:
        st = os.stat(path)
    except OSError as err:
        return f"cannot stat it ({err})"
    if not stat.S_ISDIR(st.st_mode):
        return "not a directory"
    return _foreign(st)


def _unsafe_file(path: Path) -> str | None:
    """Why the library file ``path`` may not be loaded, or None (checked with lstat: a symlink is refused)."""
    try:
        st = os.lstat(path)
    except OSError as err:
        return f"cannot stat it ({err})"
    if not stat.S_ISREG(st.st_mode):
        return "not a regular file"
    return _foreign(st)


def _foreign(st: os.stat_result) -> str | None:
    uid = os.geteuid() if hasattr(os, "geteuid") else None
    if uid is not None and st.st_uid != uid:
        return f"owned by uid {st.st_uid}, not by this user (uid {uid})"
    if st.st_mode & 0o022:
        return f"writable by group or others (mode {stat.S_IMODE(st.st_mode):o})"
    return None


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
