"""runtime.native: the C++ CPU kernels are optional; when one cannot be built, the caller is told
once why and keeps its PyTorch path (None), and nothing is half-built into the cache."""

import os
import warnings

import pytest
import torch

from runtime import native

SHARED_CACHE = os.environ.get("LOWBIT_NATIVE_CACHE")  # before the fixture points it at a fresh folder


@pytest.fixture(autouse=True)
def fresh_builds(tmp_path, monkeypatch):
    monkeypatch.setenv("LOWBIT_NATIVE_CACHE", str(tmp_path / "cache"))
    native._build.cache_clear()
    native._cpu_level.cache_clear()
    yield
    native._build.cache_clear()
    native._cpu_level.cache_clear()


def test_switched_off_returns_none_without_building(monkeypatch, tmp_path):
    monkeypatch.setenv("LOWBIT_NATIVE", "0")
    assert native.load("does_not_matter") is None
    assert not (tmp_path / "cache").exists()


def test_no_compiler_is_named_once_and_falls_back(monkeypatch):
    monkeypatch.setenv("CXX", "no-such-compiler-lowbit")
    with pytest.warns(RuntimeWarning, match="no C\\+\\+ compiler .*no-such-compiler-lowbit.*PyTorch path"):
        assert native.load("int4_weights") is None
    assert native.load("int4_weights") is None  # cached: no second warning (pytest would not fail on one,
    assert native._build.cache_info().hits == 1  # so the cache hit is what is asserted)


def test_failed_build_names_the_error(monkeypatch, tmp_path):
    bad = tmp_path / "src"
    bad.mkdir()
    (bad / "broken.cpp").write_text("#include <torch/extension.h>\nthis is not C++;\n")
    monkeypatch.setattr(native, "SOURCES", bad)
    with pytest.warns(RuntimeWarning, match="'broken' is not used: building it at level [a-z0-9]+ failed"):
        assert native.load("broken") is None


def test_build_directory_depends_on_torch_and_flags(monkeypatch):
    first = native.build_directory()
    monkeypatch.setattr(native, "flags", lambda level=None: ["-O2"])
    assert native.build_directory() != first
    assert first.parent.name == "cache"


def test_the_int4_dequantizer_builds_where_a_compiler_is(monkeypatch):
    """runtime/native/int4_weights.cpp compiles with this CPU's flags (tests/test_cpu_linear.py checks
    what it computes); in the shared cache, as the other tests use it: a fresh build takes a minute."""
    if native._missing_tool() is not None:
        pytest.skip(native._missing_tool())
    monkeypatch.delenv("LOWBIT_NATIVE", raising=False)
    if SHARED_CACHE is None:
        monkeypatch.delenv("LOWBIT_NATIVE_CACHE")
    else:
        monkeypatch.setenv("LOWBIT_NATIVE_CACHE", SHARED_CACHE)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "is not used" warning
        module = native.load("int4_weights")
    assert module is not None and callable(module.dequantize_int4)


def test_build_directory_follows_the_shared_headers(monkeypatch, tmp_path):
    """torch's JIT hashes only the .cpp it is given: a changed header must land in another folder."""
    sources = tmp_path / "src"
    sources.mkdir()
    (sources / "common.h").write_text("// one\n")
    monkeypatch.setattr(native, "SOURCES", sources)
    first = native.build_directory()
    (sources / "common.h").write_text("// two\n")
    assert native.build_directory() != first


@pytest.mark.parametrize("n, block_n, halves", [(192, 64, True), (112, 32, False), (80, 64, True)])
def test_the_int4_dequantizer_writes_float32_unrounded(monkeypatch, n, block_n, halves):
    """out float32: u * scale + (zero - 8 scale) in float32, the bf16 path's value before its one
    rounding (so the bf16 output is this one rounded); partial last blocks included."""
    if native._missing_tool() is not None:
        pytest.skip(native._missing_tool())
    if SHARED_CACHE is not None:
        monkeypatch.setenv("LOWBIT_NATIVE_CACHE", SHARED_CACHE)
    else:
        monkeypatch.delenv("LOWBIT_NATIVE_CACHE")
    from runtime.cpu_int4_layout import Int4Layout

    module = native.load("int4_weights")
    k, group = 256, 64
    g = torch.Generator().manual_seed(n)
    u = torch.randint(0, 16, (n, k), dtype=torch.int32, generator=g)
    scale_zeros = (torch.randn(k // group, n, 2, generator=g) * torch.logspace(-4, 1, n)[:, None]).bfloat16()
    packed = Int4Layout(block_n, halves).pack(u)
    out = torch.empty(k, n, dtype=torch.float32)
    module.dequantize_int4(packed, scale_zeros, group, block_n, halves, out)
    sz = scale_zeros.float().repeat_interleave(group, 0)  # [K, N, 2]
    assert torch.equal(out, u.t().float() * sz[..., 0] + (sz[..., 1] - 8 * sz[..., 0]))
    rounded = torch.empty(k, n, dtype=torch.bfloat16)
    module.dequantize_int4(packed, scale_zeros, group, block_n, halves, rounded)
    assert torch.equal(rounded, out.bfloat16())
