"""runtime/native at every instruction-set level (one build per level, runtime/native/__init__.py):
every ``.cpp`` compiles with every level's flags on any x86 machine (compiling needs no such CPU),
and every level this CPU runs computes what the reference computes, the lower levels' code run on
this CPU (an AVX-512 machine runs the AVX2 paths) through ``native.load(name, level=...)``.

What is measured where: levels this CPU runs (``native.cpu_levels()``, above ``portable``) are
built with their real flags (cached in the shared native cache) and run against PyTorch; the
others, and ``portable``, are compiled (``-c -O0``: the inliner is what rejects an AVX-512
intrinsic in an AVX2 build, which ``-fsyntax-only`` does not run). AArch64: the portable level is
cross-compiled where ``aarch64-linux-gnu-g++`` is installed (Debian's g++-aarch64-linux-gnu);
nothing runs there (no such machine here), so only that it compiles is checked."""

from __future__ import annotations

import os
import shutil
import subprocess
import sysconfig
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import torch.nn.functional as F

from runtime import native
from runtime.cpu_int4_layout import Int4Layout

SOURCES = sorted(native.SOURCES.glob("*.cpp"))
HERE = native.cpu_levels() if native.x86() else ()
RUN = [level for level in native.LEVELS[1:] if level in HERE]  # built with real flags and run below
COMPILE_ONLY = [level for level in native.LEVELS if level not in RUN]
CROSS = "aarch64-linux-gnu-g++"


def can_build() -> str | None:
    return "native kernels are off (LOWBIT_NATIVE=0)" if not native.enabled() else native._missing_tool()


def compile_check(sources, flags: list[str], compiler: str = "c++") -> dict[str, str]:
    """Each source compiled (not linked) with torch's headers and ``flags``, in parallel: the
    compiler's errors per source that failed."""
    from torch.utils.cpp_extension import include_paths

    includes = [f"-I{path}" for path in [*include_paths(), sysconfig.get_path("include")]]

    def one(source):
        command = [compiler, "-c", "-O0", "-w", "-std=c++20", "-fPIC", "-DTORCH_API_INCLUDE_EXTENSION_H",
                   "-DTORCH_EXTENSION_NAME=lowbit_level_check", *includes, *flags, str(source), "-o", os.devnull]
        done = subprocess.run(command, capture_output=True, text=True)
        return source.name, done.returncode, done.stderr

    with ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
        results = list(pool.map(one, sources))
    return {name: err[-2000:] for name, rc, err in results if rc}


# ---------------------------------------------------------------- levels, names, refusals

def test_levels_lowest_first_and_the_default_runs_here(monkeypatch):
    monkeypatch.delenv("LOWBIT_NATIVE_LEVEL", raising=False)
    here = native.cpu_levels()
    assert here == native.LEVELS[:len(here)] and here[0] == "portable"
    assert native.level() == here[-1]
    assert list(native.LEVEL_FLAGS) == list(native.LEVELS)
    for lower, higher in zip(native.LEVELS, native.LEVELS[1:]):  # each level's flags hold the one below's
        assert set(native.LEVEL_FLAGS[lower]) < set(native.LEVEL_FLAGS[higher])


def test_the_level_cap_and_bad_levels_are_named(monkeypatch):
    monkeypatch.setenv("LOWBIT_NATIVE_LEVEL", "portable")
    assert native.level() == "portable"
    monkeypatch.setenv("LOWBIT_NATIVE_LEVEL", "amx")  # a cap above this CPU's: this CPU's
    assert native.level() == native.cpu_levels()[-1]
    monkeypatch.setenv("LOWBIT_NATIVE_LEVEL", "avx9")
    with pytest.raises(ValueError, match="LOWBIT_NATIVE_LEVEL 'avx9' is none of"):
        native.level()
    monkeypatch.delenv("LOWBIT_NATIVE_LEVEL")
    with pytest.raises(ValueError, match="level 'sse9' is none of"):
        native.load("int4_gemm", level="sse9")
    above = [level for level in native.LEVELS if level not in native.cpu_levels()]
    if above:
        with pytest.raises(ValueError, match=f"native level '{above[0]}' cannot run on this CPU"):
            native.load("int4_gemm", level=above[0])


def test_build_folders_are_per_level():
    folders = {native.build_directory(level) for level in native.LEVELS}
    assert len(folders) == len(native.LEVELS)
    assert all(level in native.build_directory(level).name for level in native.LEVELS)


# ---------------------------------------------------------------- every source at every level compiles

@pytest.mark.skipif(not native.x86(), reason="the x86 levels' flags need an x86 compiler")
@pytest.mark.parametrize("level", COMPILE_ONLY)
def test_every_source_compiles_at_levels_not_run_here(level):
    """The levels this CPU does not run (and portable, the AArch64 stand-in); the ones it runs are
    built with their real flags by the tests below."""
    if native._missing_tool() is not None:
        pytest.skip(native._missing_tool())
    failed = compile_check(SOURCES, native.flags(level))
    assert not failed, f"level {level}: " + "\n".join(f"{name}:\n{err}" for name, err in failed.items())


@pytest.mark.skipif(shutil.which(CROSS) is None, reason=f"no AArch64 cross compiler ({CROSS}: apt-get install "
                    "g++-aarch64-linux-gnu)")
def test_the_portable_level_cross_compiles_for_aarch64():
    flags = native.flags("portable")  # no x86 flag in it: portable's are -O3 and OpenMP only
    assert not any(flag.startswith("-m") for flag in flags)
    failed = compile_check(SOURCES, flags, compiler=CROSS)
    assert not failed, "\n".join(f"{name}:\n{err}" for name, err in failed.items())


# ---------------------------------------------------------------- every level this CPU runs, run

def module_at(name: str, level: str):
    reason = can_build()
    if reason is not None:
        pytest.skip(reason)
    module = native.load(name, level=level)
    assert module is not None, f"{name} did not build at level {level} (see the warning)"
    assert module.level() == level
    return module


def int4_layer(n: int, k: int, group: int, layout: Int4Layout, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    u = torch.randint(0, 16, (n, k), generator=g, dtype=torch.int32)
    scale_zeros = torch.stack([torch.rand(k // group, n, generator=g) * 0.05 + 0.001,
                               torch.randn(k // group, n, generator=g) * 0.05], -1).to(torch.bfloat16)
    return u, layout.pack(u), scale_zeros


def int4_bound_holds(y, a, u, scale_zeros, group) -> bool:
    """Within bf16 rounding of the float64 product (plus float32 summation error)."""
    sz = scale_zeros.double().repeat_interleave(group, 0)
    w = (u.double() - 8) * sz[..., 0].t() + sz[..., 1].t()
    ref = a.double() @ w.t()
    bound = ref.abs() * 2.0**-8 + (a.double().abs() @ w.abs().t()) * 2.0**-18
    return bool(((y.double() - ref).abs() <= bound).all())


@pytest.mark.parametrize("level", RUN)
def test_int4_gemm_at_every_level(level):
    """Every path of the level's build, AVX-512's blocks of 64 and AVX2's of 32 (a partial last block:
    112 = 3.5 x 32), 1..17 rows: within bf16 rounding of the exact product. The avx2 path gives the
    same bits in every level's build (the same operations per row; only the rows per pass differ)."""
    module = module_at("int4_gemm", level)
    best = module.best_path()
    assert native.MATMUL_PATHS[best] == {"avx2": "avx2", "avx512": "avx2", "avx512bf16": "avx512",
                                         "amx": "amx"}[level]
    reference = module_at("int4_gemm", "avx2")
    for layout in (Int4Layout(64, True), Int4Layout(32, True)):
        for n, k, group in ((192, 256, 64), (112, 512, 32)):
            u, packed, scale_zeros = int4_layer(n, k, group, layout)
            for rows in (1, 2, 3, 5, 8, 17):
                a = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).to(torch.bfloat16)
                for path in range(best + 1):
                    y = module.int4_linear(a, packed, group, scale_zeros, layout.block_n, layout.halves, path, 0)
                    assert int4_bound_holds(y, a, u, scale_zeros, group), (level, layout, n, rows, path)
                avx2 = native.MATMUL_PATHS.index("avx2")
                if rows > 1:  # a row's sums do not depend on the rows beside it (unpacked once for many)
                    alone = module.int4_linear(a[-1:], packed, group, scale_zeros, layout.block_n, layout.halves, avx2, 0)
                    together = module.int4_linear(a, packed, group, scale_zeros, layout.block_n, layout.halves, avx2, 0)
                    assert torch.equal(alone, together[-1:]), (level, layout, rows)
                assert torch.equal(
                    module.int4_linear(a, packed, group, scale_zeros, layout.block_n, layout.halves, avx2, 0),
                    reference.int4_linear(a, packed, group, scale_zeros, layout.block_n, layout.halves, avx2, 0))


@pytest.mark.parametrize("level", RUN)
def test_int8_gemm_at_every_level(level):
    """Every path of the level's build against the exact product (K with a tail past 8 and 16, N not a
    multiple of 4), 1..9 rows."""
    module = module_at("int8_gemm", level)
    for n, k in ((70, 100), (33, 208)):
        g = torch.Generator().manual_seed(n)
        q = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
        scales = (torch.rand(n, generator=g) * 0.05 + 0.001).to(torch.bfloat16)
        w = q.double() * scales.double()[:, None]
        for rows in (1, 2, 3, 5, 9):
            a = torch.randn(rows, k, generator=g).to(torch.bfloat16)
            ref = a.double() @ w.t()
            bound = ref.abs() * 2.0**-8 + (a.double().abs() @ w.abs().t()) * 2.0**-18
            for path in range(module.best_path() + 1):
                y = module.int8_matmul(a, q, scales, path)
                assert ((y.double() - ref).abs() <= bound).all(), (level, n, k, rows, path)


@pytest.mark.parametrize("level", RUN)
def test_decode_ops_at_every_level(level):
    """silu_mul (vectorized at avx2 and up: the same operations, so the same bits at every level),
    add + RMSNorm and RoPE against PyTorch; bf16_gemv where the level has it."""
    ops = module_at("decode_ops", level)
    top = module_at("decode_ops", RUN[-1])
    g = torch.Generator().manual_seed(0)
    for width in (1536, 37):
        gate_up = torch.randn(3, 1, 2 * width, generator=g) * 4
        gate, up = gate_up.chunk(2, dim=-1)
        got = ops.silu_mul(gate_up)
        torch.testing.assert_close(got, F.silu(gate) * up, rtol=1e-6, atol=1e-7)
        assert torch.equal(got, top.silu_mul(gate_up))
        g16 = gate_up.bfloat16()
        want = F.silu(g16[..., :width]) * g16[..., width:]
        got16 = ops.silu_mul(g16)
        steps = (got16.float() - want.float()).abs() / want.float().abs().clamp_min(1e-30) * 128
        assert float(steps.max()) <= 1.0 and float((got16 != want).float().mean()) < 0.02
        assert torch.equal(got16, top.silu_mul(g16))
    x, residual, weight = (torch.randn(2, 1, 576, generator=g) for _ in range(3))
    out, total = ops.add_rms_norm(x, residual, weight[0, 0], 1e-5)
    assert torch.equal(total, x + residual)
    torch.testing.assert_close(out, F.rms_norm(x + residual, (576,), weight[0, 0], 1e-5), rtol=4e-7 * 8, atol=1e-6)
    assert ops.gemv_usable() == (native.LEVELS.index(level) >= native.LEVELS.index("avx512bf16"))
    if not ops.gemv_usable():
        with pytest.raises(RuntimeError, match="bf16_gemv needs AVX512-BF16"):
            ops.bf16_gemv(torch.randn(8, 64).bfloat16(), torch.randn(1, 64))


@pytest.mark.parametrize("level", RUN)
def test_int4_weights_at_every_level(level):
    """The dequantizer's bf16 and float32 outputs are the same bits at every level (scalar code the
    compiler vectorizes; u * scale is exact, so a fused multiply-add changes nothing)."""
    module = module_at("int4_weights", level)
    top = module_at("int4_weights", RUN[-1])
    for layout in (Int4Layout(64, True), Int4Layout(32, False)):
        u, packed, scale_zeros = int4_layer(112, 256, 64, layout, seed=5)
        for dtype in (torch.bfloat16, torch.float32):
            outs = []
            for m in (module, top):
                outs.append(torch.empty(256, 112, dtype=dtype))
                m.dequantize_int4(packed, scale_zeros, 64, layout.block_n, layout.halves, outs[-1])
            assert torch.equal(*outs)
    sz = scale_zeros.float().repeat_interleave(64, 0)
    assert torch.equal(outs[0].t(), u.float() * sz[..., 0].t() + (sz[..., 1] - 8 * sz[..., 0]).t())


@pytest.mark.parametrize("level", RUN)
def test_kv_attention_at_every_level(level):
    """Decode attention over an INT4 and an fp16 cache (ragged lengths, GQA) against the folded PyTorch
    path, to float32 rounding."""
    from kvquant import parse_kv
    from runtime.cache import KVCache
    from runtime.cpu_attention import native_attention
    from runtime.attention_backends import CPU_FOLDED
    from runtime.kernels.kv_reference import PagedKV

    kernel = module_at("kv_attention", level)
    heads, query_heads, head_dim, lengths = 2, 6, 64, [3, 40, 97]
    for spec in ("int4-g32-r64", "fp16-r32"):
        g = torch.Generator().manual_seed(7)
        cache = KVCache(1, len(lengths), heads, head_dim, max(lengths) + 8, torch.float32, "cpu", parse_kv(spec))
        for slot, n in enumerate(lengths):
            cache.add_sequence(slot)
            cache.write_sequence(0, slot, 0, *(torch.randn(heads, n, head_dim, generator=g) * 2 for _ in range(2)))
            cache.advance(slot, n)
        paged = PagedKV.from_cache(cache, 0)
        q = torch.randn(len(lengths), query_heads, 1, head_dim, generator=g)
        got = native_attention(kernel, paged, q, lengths)
        torch.testing.assert_close(got, CPU_FOLDED.decode(paged, q, lengths), rtol=2e-5, atol=2e-5)


@pytest.mark.skipif("avx2" not in HERE, reason="this CPU does not run the avx2 level")
def test_an_avx2_cpu_decodes_int4_with_the_avx2_path(monkeypatch):
    """LOWBIT_NATIVE_LEVEL=avx2 (an AVX2-only CPU's kernels): cpu_int4_gemm.linear takes 1..AVX2_MAX_ROWS
    rows on the avx2 path, AVX-512's blocks and AVX2's alike, and leaves more rows to aten's kernel."""
    from runtime import cpu_int4_gemm

    module = module_at("int4_gemm", "avx2")
    monkeypatch.setenv("LOWBIT_NATIVE_LEVEL", "avx2")
    native.matmul_kernel.cache_clear()
    cpu_int4_gemm._paths.cache_clear()
    try:
        assert cpu_int4_gemm.best_path() == "avx2"
        for layout in (Int4Layout(64, True), Int4Layout(32, True)):
            u, packed, scale_zeros = int4_layer(128, 256, 64, layout, seed=9)
            x = torch.randn(cpu_int4_gemm.AVX2_MAX_ROWS + 1, 256, generator=torch.Generator().manual_seed(9))
            for rows in (1, cpu_int4_gemm.AVX2_MAX_ROWS):
                want = module.int4_linear(x[:rows], packed, 64, scale_zeros, layout.block_n, layout.halves,
                                          native.MATMUL_PATHS.index("avx2"), 0)
                assert torch.equal(cpu_int4_gemm.linear(x[:rows], packed, 64, scale_zeros, layout), want)
            assert cpu_int4_gemm.linear(x, packed, 64, scale_zeros, layout) is None
    finally:
        native.matmul_kernel.cache_clear()
        cpu_int4_gemm._paths.cache_clear()
