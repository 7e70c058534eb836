"""PowerSGD's compiled CPU passes, bit for bit against the order of operations their source states.

The references below spell that order out with torch's elementwise FP32
ops (each op one IEEE rounding, no fused multiply-add), so every kernel
result must be bitwise equal to them, on any host and for any split over
threads.
"""

from __future__ import annotations

import math
import os
import pwd
import stat
import subprocess
from pathlib import Path

import pytest
import torch

from distamp.compression import low_rank_kernels
from distamp.compression.low_rank_kernels import LowRankKernels


def compiler_present() -> bool:
    """Whether this host has a C compiler the kernels can be built with."""
    return low_rank_kernels.find_compiler() is not None


@pytest.fixture(scope="module")
def kernels() -> LowRankKernels:
    if not compiler_present():
        pytest.skip("no C compiler: PowerSGD runs on torch ops here (tests/compression/test_powersgd.py covers them)")
    found = low_rank_kernels.load()
    if isinstance(found, str):
        pytest.fail(f"a C compiler is present, yet the kernels did not build: {found}")
    return found


def reference_start(g: torch.Tensor, e: torch.Tensor | None, qt: torch.Tensor, scale: float):
    """``M = G / scale + E``; ``P[i, k]``: 16 lane sums in column order, summed lane by lane, then the tail."""
    m = g.float() / scale
    if e is not None:
        m = m + e
    rows, cols = m.shape
    body = cols - cols % 16
    p = torch.empty(rows, qt.shape[0])
    for k in range(qt.shape[0]):
        products = m * qt[k]
        lanes = torch.zeros(rows, 16)
        for j in range(0, body, 16):
            lanes = lanes + products[:, j : j + 16]
        total = torch.zeros(rows)
        for lane in range(16):
            total = total + lanes[:, lane]
        for j in range(body, cols):
            total = total + products[:, j]
        p[:, k] = total
    return m, p


def reference_project(m: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """``Q^T = P^T M`` summed row by row from zero."""
    qt = torch.zeros(p.shape[1], m.shape[1])
    for i in range(m.shape[0]):
        qt = qt + p[i][:, None] * m[i][None, :]
    return qt


def reference_product(p: torch.Tensor, qt: torch.Tensor) -> torch.Tensor:
    """``P Q^T`` summed over the rank in order, from the first term."""
    a = p[:, :1] * qt[:1]
    for k in range(1, p.shape[1]):
        a = a + p[:, k : k + 1] * qt[k : k + 1]
    return a


def reference_orthogonalize(vectors: list[torch.Tensor]) -> torch.Tensor:
    """Gram-Schmidt on FP32 vectors: norms and dots summed in double in order, rounded once, FP32 updates."""
    vectors = [v.clone() for v in vectors]
    for i, v in enumerate(vectors):
        squares = 0.0
        for value in v.double().tolist():
            squares += value * value
        norm = torch.tensor(math.sqrt(squares), dtype=torch.float32)
        if norm > 0:
            v = vectors[i] = v / norm
        for c in range(i + 1, len(vectors)):
            dot = 0.0
            for a, b in zip(v.double().tolist(), vectors[c].double().tolist(), strict=True):
                dot += a * b
            vectors[c] = vectors[c] - torch.tensor(dot, dtype=torch.float32) * v
    return torch.stack(vectors)


SHAPES = [(37, 53, 3), (40, 96, 6), (5, 7, 1), (64, 48, 4), (3, 200, 9), (16, 16, 5)]


@pytest.mark.parametrize(("rows", "cols", "rank"), SHAPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("scale", [1.0, 1024.0, 3.0])
def test_each_pass_is_bitwise_its_stated_order_of_operations(kernels, rows, cols, rank, dtype, scale):
    gen = torch.Generator().manual_seed(rows * cols + rank)
    g = torch.randn(rows, cols, generator=gen).to(dtype) * scale
    e = torch.randn(rows, cols, generator=gen) * 1e-2
    qt = torch.randn(rank, cols, generator=gen)
    for error in (e, None):
        m, p = torch.empty(rows, cols), torch.empty(rows, rank)
        kernels.start(g, error, m, qt, p, scale)
        m_ref, p_ref = reference_start(g, error, qt, scale)
        assert torch.equal(m, m_ref)
        assert torch.equal(p, p_ref)
    q_new = torch.empty(rank, cols)
    kernels.project(m, p, q_new)
    assert torch.equal(q_new, reference_project(m, p))
    out, m_after = torch.empty(rows, cols, dtype=dtype), m.clone()
    kernels.finish(out, m_after, p, q_new, scale)
    approx = reference_product(p, q_new)
    assert torch.equal(out, (approx * scale).to(dtype))  # torch's own rounding to BF16
    assert torch.equal(m_after, m - approx)
    kept = m.clone()
    kernels.finish(out, None, p, q_new, scale)
    assert torch.equal(m, kept)


@pytest.mark.parametrize(("length", "count"), [(50, 4), (7, 1), (33, 6)])
def test_gram_schmidt_is_bitwise_its_stated_order_and_matches_torch_ops(kernels, length, count):
    from distamp.compression.low_rank import orthogonalize_

    a = torch.randn(length, count, generator=torch.Generator().manual_seed(length))
    columns = kernels.orthogonalize_columns_(a.clone())
    assert torch.equal(columns, reference_orthogonalize(list(a.t())).t())
    rows = kernels.orthogonalize_rows_(a.t().contiguous())
    assert torch.equal(rows, columns.t())
    torch.testing.assert_close(columns, orthogonalize_(a.clone()), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(columns.t() @ columns, torch.eye(count), rtol=0, atol=1e-5)


def test_gram_schmidt_keeps_a_zero_column_zero_and_non_finite_non_finite(kernels):
    a = torch.randn(10, 3, generator=torch.Generator().manual_seed(1))
    a[:, 1] = 0
    out = kernels.orthogonalize_columns_(a.clone())
    assert torch.isfinite(out).all()
    assert torch.equal(out[:, 1], torch.zeros(10))
    assert torch.equal(kernels.orthogonalize_columns_(torch.zeros(6, 2)), torch.zeros(6, 2))
    a[3, 0] = float("inf")
    assert not torch.isfinite(kernels.orthogonalize_columns_(a.clone())).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_gradient_at_any_offset_in_a_bucket_gets_the_same_bits(kernels, dtype):
    gen = torch.Generator().manual_seed(9)
    rows, cols, rank = 24, 64, 3
    g, e = torch.randn(rows, cols, generator=gen).to(dtype), torch.randn(rows, cols, generator=gen)
    qt = torch.randn(rank, cols, generator=gen)
    m, p = torch.empty(rows, cols), torch.empty(rows, rank)
    kernels.start(g, e, m, qt, p, 4.0)
    out = torch.empty(rows, cols, dtype=dtype)
    kernels.finish(out, m.clone(), p, qt, 4.0)
    for offset in (1, 3, 8):
        bucket = torch.zeros(offset + rows * cols + 5, dtype=dtype)
        view = bucket[offset : offset + rows * cols].view(rows, cols)
        view.copy_(g)
        m_view, p_view = torch.empty(rows, cols), torch.empty(rows, rank)
        kernels.start(view, e, m_view, qt, p_view, 4.0)
        assert torch.equal(m_view, m)
        assert torch.equal(p_view, p)
        kernels.finish(view, m_view, p, qt, 4.0)
        assert torch.equal(view, out)
        assert not bucket[:offset].any()
        assert not bucket[offset + rows * cols :].any()  # nothing written outside the gradient


def test_an_fp32_gradient_may_be_m_itself(kernels):
    gen = torch.Generator().manual_seed(7)
    m, e, qt = torch.randn(33, 70, generator=gen), torch.randn(33, 70, generator=gen), torch.randn(2, 70, generator=gen)
    expected_m, expected_p = reference_start(m, e, qt, 8.0)
    p = torch.empty(33, 2)
    kernels.start(m, e, m, qt, p, 8.0)
    assert torch.equal(m, expected_m)
    assert torch.equal(p, expected_p)


def test_the_bits_do_not_depend_on_the_threads(kernels, monkeypatch):
    gen = torch.Generator().manual_seed(8)
    rows, cols, rank = 301, 517, 4
    g = torch.randn(rows, cols, generator=gen).bfloat16()
    e, qt = torch.randn(rows, cols, generator=gen), torch.randn(rank, cols, generator=gen)

    def run():
        m, p, q, out = torch.empty(rows, cols), torch.empty(rows, rank), torch.empty(rank, cols), torch.empty_like(g)
        kernels.start(g, e, m, qt, p, 512.0)
        kernels.project(m, p, q)
        kernels.finish(out, m, p, q, 512.0)
        return m, p, q, out

    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = run()
        monkeypatch.setattr(low_rank_kernels, "MIN_ELEMENTS_PER_THREAD", 1000)
        torch.set_num_threads(3)
        three = run()
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(a, b) for a, b in zip(one, three, strict=True))


def test_inf_and_nan_propagate_and_round_as_torch_rounds(kernels):
    g = torch.ones(4, 32, dtype=torch.bfloat16)
    g[1, 3] = float("inf")
    g[2, 20] = float("nan")
    m, p = torch.empty(4, 32), torch.empty(4, 1)
    kernels.start(g, None, m, torch.ones(1, 32), p, 2.0)
    assert torch.isinf(m[1, 3])
    assert torch.isnan(m[2, 20])
    assert torch.isinf(p[1, 0])
    assert torch.isnan(p[2, 0])
    assert torch.equal(p[[0, 3]], torch.full((2, 1), 16.0))
    out = torch.empty(4, 32, dtype=torch.bfloat16)
    kernels.finish(out, None, p, torch.ones(1, 32), 1.0)
    expected = p.expand(4, 32).to(torch.bfloat16)
    assert torch.equal(out.view(torch.int16), expected.view(torch.int16))  # NaN bits included


def test_wrong_arguments_name_what_is_wrong(kernels):
    m, p, qt = torch.empty(4, 8), torch.empty(4, 2), torch.empty(2, 8)
    with pytest.raises(ValueError, match=r"argument grad.*float16"):
        kernels.start(torch.empty(4, 8, dtype=torch.float16), None, m, qt, p, 1.0)
    with pytest.raises(ValueError, match=r"argument qt.*not contiguous"):
        kernels.start(m, None, m, torch.empty(8, 2).t(), p, 1.0)
    with pytest.raises(ValueError, match=r"argument p: expected .*\(4, 2\)"):
        kernels.project(m, torch.empty(3, 2), qt)


def test_the_build_reports_why_it_has_no_kernels(monkeypatch, tmp_path):
    monkeypatch.setattr(low_rank_kernels, "_loaded", {})
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    found = low_rank_kernels.load()
    assert isinstance(found, str)
    assert "no C compiler" in found
    assert "no-such-cc" in found
    monkeypatch.setattr(low_rank_kernels, "_loaded", {})
    monkeypatch.setenv(low_rank_kernels.KERNELS_ENV, "torch")
    assert low_rank_kernels.load() == "DISTAMP_POWERSGD_KERNELS=torch"
    monkeypatch.setenv(low_rank_kernels.KERNELS_ENV, "fast")
    with pytest.raises(ValueError, match="DISTAMP_POWERSGD_KERNELS='fast' is not a choice; use one of auto, torch"):
        low_rank_kernels.load()


def _load_with_compiler(monkeypatch, tmp_path, script: str, cc_args: str = "") -> LowRankKernels | str:
    """``load()`` with ``$CC`` a shell script of ``script`` (then ``cc_args``) and a fresh cache under ``tmp_path``."""
    compiler = tmp_path / "test-cc"
    compiler.write_text(f"#!/bin/sh\n{script}\n")
    compiler.chmod(0o755)
    monkeypatch.setattr(low_rank_kernels, "_loaded", {})
    monkeypatch.setenv("CC", f"{compiler} {cc_args}".strip())
    monkeypatch.setenv("DISTAMP_CACHE_DIR", str(tmp_path / "cache"))
    return low_rank_kernels.load()


def real_compiler() -> str:
    """The host's compiler command, for wrapper scripts."""
    return " ".join(low_rank_kernels.find_compiler() or ["cc"])


def test_a_compile_error_is_reported_with_the_compilers_words(monkeypatch, tmp_path):
    found = _load_with_compiler(monkeypatch, tmp_path, "echo 'test-cc: cannot compile today' >&2\nexit 1")
    assert isinstance(found, str)
    assert "failed to compile low_rank_kernels.c: test-cc: cannot compile today" in found


def test_a_compiler_that_refuses_march_native_builds_without_it(kernels, monkeypatch, tmp_path):
    refuse = '[ "$a" = -march=native ] && { echo "no native" >&2; exit 1; }'
    script = f'for a in "$@"; do {refuse}; done\nexec {real_compiler()} "$@"'
    found = _load_with_compiler(monkeypatch, tmp_path, script)
    assert isinstance(found, LowRankKernels)
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [found.path.name]
    m, p = torch.empty(5, 40), torch.empty(5, 2)
    g, qt = torch.randn(5, 40), torch.randn(2, 40)
    found.start(g, None, m, qt, p, 2.0)
    assert torch.equal(p, reference_start(g, None, qt, 2.0)[1])  # the same bits without the host's vector ISA


def test_an_unwritable_cache_falls_back_to_the_temp_directory(kernels, monkeypatch, tmp_path):
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("")
    monkeypatch.setattr(low_rank_kernels, "_loaded", {})
    monkeypatch.delenv("DISTAMP_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(not_a_dir))
    monkeypatch.setenv("TMPDIR", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    monkeypatch.setattr(low_rank_kernels.tempfile, "tempdir", None)  # re-read TMPDIR
    found = low_rank_kernels.load()
    assert isinstance(found, LowRankKernels)
    assert found.path.parent.parent == tmp_path / "tmp"
    assert found.path.parent.name.startswith("distamp-kernels-")  # a fresh mkdtemp, not a predictable name
    assert list((tmp_path / "tmp").iterdir()) == []  # removed once loaded (the library stays mapped)


def test_a_build_goes_to_the_cache_dir_and_is_reused(kernels, monkeypatch, tmp_path):
    monkeypatch.setattr(low_rank_kernels, "_loaded", {})
    monkeypatch.setenv("DISTAMP_CACHE_DIR", str(tmp_path))
    found = low_rank_kernels.load()
    assert isinstance(found, LowRankKernels)
    assert found.path.parent == tmp_path
    assert [p.name for p in tmp_path.iterdir()] == [found.path.name]  # no temporary left behind
    monkeypatch.setattr(low_rank_kernels, "_loaded", {})
    built = found.path.stat().st_mtime_ns
    again = low_rank_kernels.load()
    assert isinstance(again, LowRankKernels)
    assert again.path == found.path
    assert found.path.stat().st_mtime_ns == built


def test_cc_with_arguments_is_split_as_the_shell_would(kernels, monkeypatch, tmp_path):
    log = tmp_path / "argv.log"
    host = real_compiler()
    script = f'echo "$@" >> {log}\nexec {host} "$@"'
    found = _load_with_compiler(monkeypatch, tmp_path, script, cc_args="-m64 -DDISTAMP_TEST='a b'")
    assert isinstance(found, LowRankKernels), found
    assert log.read_text().splitlines()[-1].startswith("-m64 -DDISTAMP_TEST=a b -march=native")
    monkeypatch.setenv("CC", "ccache-not-installed gcc")
    assert low_rank_kernels.find_compiler() is None
    monkeypatch.setenv("CC", f"{host} -m64")
    assert low_rank_kernels.find_compiler() == [*host.split(), "-m64"]


def test_a_build_that_cannot_be_loaded_is_tried_once(kernels, monkeypatch, tmp_path):
    """As in a noexec directory: dlopen fails, and building with the other flags would not help."""
    log = tmp_path / "builds.log"
    script = f'case "$*" in *-o*) echo build >> {log};; esac\nexec {real_compiler()} "$@"'

    def noexec(path, *args, **kwargs):
        raise OSError(f"{path}: failed to map segment from shared object")

    monkeypatch.setattr(low_rank_kernels.ctypes, "CDLL", noexec)
    found = _load_with_compiler(monkeypatch, tmp_path, script)
    assert isinstance(found, str)
    assert "failed to map segment" in found
    assert log.read_text().splitlines() == ["build"]


PLANTED = r"""
#include <fcntl.h>
#include <unistd.h>
__attribute__((constructor)) static void planted(void) { close(open("MARKER", O_CREAT | O_WRONLY, 0600)); }
"""


def _plant(tmp_path, target) -> Path:
    """Compile a library whose constructor creates a marker file, at ``target``; returns the marker's path."""
    marker = tmp_path / "planted-constructor-ran"
    source = tmp_path / "planted.c"
    source.write_text(PLANTED.replace("MARKER", str(marker)))
    subprocess.run([*real_compiler().split(), "-shared", "-fPIC", "-o", str(target), str(source)], check=True)
    return marker


def _expected_target(monkeypatch, tmp_path) -> Path:
    """The library the loader will look for in a fresh cache ``tmp_path / 'cache'`` (nothing loaded yet:
    a path this process already dlopen'ed would not be read again)."""
    monkeypatch.setattr(low_rank_kernels, "_loaded", {})
    monkeypatch.setenv("DISTAMP_CACHE_DIR", str(tmp_path / "cache"))
    (tmp_path / "cache").mkdir(mode=0o700)
    names = low_rank_kernels._library_names(low_rank_kernels.find_compiler())
    return tmp_path / "cache" / names[low_rank_kernels.FLAG_SETS[0]]


@pytest.mark.parametrize("flaw", ["group-writable", "world-writable", "another owner", "a symlink"])
def test_a_library_planted_in_the_cache_is_never_loaded(kernels, monkeypatch, tmp_path, flaw):
    target = _expected_target(monkeypatch, tmp_path)
    planted = tmp_path / "elsewhere.so" if flaw == "a symlink" else target
    marker = _plant(tmp_path, planted)
    if flaw == "group-writable":
        planted.chmod(0o775)
    elif flaw == "world-writable":
        planted.chmod(0o777)
    elif flaw == "another owner":
        if os.geteuid() != 0:
            pytest.skip("chown to another user needs root")
        os.chown(planted, pwd.getpwnam("nobody").pw_uid, -1)
    else:
        target.symlink_to(planted)
    found = low_rank_kernels.load()
    assert not marker.exists(), "the planted library's constructor ran"
    assert isinstance(found, LowRankKernels)  # rebuilt over it
    assert found.path == target
    assert not target.is_symlink()
    st = target.stat()
    assert st.st_uid == os.geteuid()
    assert stat.S_IMODE(st.st_mode) & 0o022 == 0


@pytest.mark.parametrize("flaw", ["group-writable", "world-writable", "another owner"])
def test_a_cache_directory_others_can_write_or_own_is_refused(kernels, monkeypatch, tmp_path, flaw):
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o700)
    if flaw == "another owner":
        if os.geteuid() != 0:
            pytest.skip("chown to another user needs root")
        os.chown(cache, pwd.getpwnam("nobody").pw_uid, -1)
    else:
        cache.chmod(0o770 if flaw == "group-writable" else 0o777)
    monkeypatch.setattr(low_rank_kernels, "_loaded", {})
    monkeypatch.setenv("DISTAMP_CACHE_DIR", str(cache))
    found = low_rank_kernels.load()
    assert isinstance(found, str)
    assert f"refusing the kernel cache {cache}" in found
    assert ("owned by uid" if flaw == "another owner" else "writable by group or others") in found
    assert list(cache.iterdir()) == []  # nothing built there either


def test_a_new_cache_directory_is_private(kernels, monkeypatch, tmp_path):
    monkeypatch.setattr(low_rank_kernels, "_loaded", {})
    monkeypatch.delenv("DISTAMP_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    old = os.umask(0)
    try:
        found = low_rank_kernels.load()
    finally:
        os.umask(old)
    assert isinstance(found, LowRankKernels)
    assert found.path.parent == tmp_path / "xdg" / "distamp"
    assert stat.S_IMODE(found.path.parent.stat().st_mode) == 0o700
    assert stat.S_IMODE(found.path.stat().st_mode) & 0o022 == 0  # even with umask 0


def test_the_fingerprint_tells_builds_that_round_otherwise_apart(kernels, monkeypatch, tmp_path):
    contracted = _load_with_compiler(monkeypatch, tmp_path, f'exec {real_compiler()} "$@" -ffp-contract=fast')
    assert isinstance(contracted, LowRankKernels)
    assert contracted.path != kernels.path
    assert kernels.fingerprint == kernels.fingerprint
    if contracted.fingerprint == kernels.fingerprint:
        pytest.skip("this CPU or compiler has no fused multiply-add: -ffp-contract=fast builds the same bits")
