"""runtime.cpu_int4_gemm: lowbit's int4 matmul for few rows equals aten's int4 kernel on the same
packed weights, to bf16 rounding, on every path this CPU has, for full and partial output blocks,
every kernel group size and 1..MAX_ROWS rows."""

import pytest
import torch

from runtime import cpu_int4_gemm, native
from runtime.cpu_int4_layout import Int4Layout, int4_layout

pytestmark = pytest.mark.skipif(native.load("int4_gemm") is None, reason="the native kernel cannot be built here")


def paths_here() -> list[str]:
    return native.matmul_paths("int4_gemm")


def layer(n: int, k: int, group: int, seed: int = 0):
    """Random nibbles u [N, K], the aten kernel's packing of them, and bf16 (scale, zero) pairs."""
    gen = torch.Generator().manual_seed(seed)
    u = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.int32)
    scale = torch.rand(k // group, n, generator=gen) * 0.05 + 0.001
    zero = torch.randn(k // group, n, generator=gen) * 0.05
    scale_zeros = torch.stack([scale, zero], -1).to(torch.bfloat16)
    return u, torch.ops.aten._convert_weight_to_int4pack_for_cpu(u, 1), scale_zeros


def exact(a: torch.Tensor, u: torch.Tensor, scale_zeros: torch.Tensor, group: int) -> torch.Tensor:
    """a @ w.T in float64 from the nibbles themselves (not read back from the packing)."""
    sz = scale_zeros.double().repeat_interleave(group, 0)  # [K, N, 2]
    w = (u.double() - 8) * sz[..., 0].t() + sz[..., 1].t()
    return a.double() @ w.t()


def check_rounding(y: torch.Tensor, a: torch.Tensor, u, scale_zeros, group):
    """Within bf16 rounding of the exact product (plus float32 summation error, from |a| |w|)."""
    ref = exact(a, u, scale_zeros, group)
    sz = scale_zeros.double().repeat_interleave(group, 0)
    magnitude = a.double().abs() @ ((u.double() - 8) * sz[..., 0].t() + sz[..., 1].t()).abs().t()
    bound = ref.abs() * 2.0**-8 + magnitude * 2.0**-18
    assert y.dtype == torch.bfloat16 and y.shape == ref.shape
    assert ((y.double() - ref).abs() <= bound).all(), (y.double() - ref).abs().div(bound).max()


@pytest.mark.parametrize("n,k", [(576, 576), (112, 256), (48, 512), (192, 1024)])
@pytest.mark.parametrize("group", [32, 64, 128, 256])
def test_matches_aten_on_every_path(n, k, group):
    if k % group:
        pytest.skip("group does not divide K")
    u, packed, scale_zeros = layer(n, k, group)
    layout = int4_layout()
    for rows in (1, 2, 5, 16, 17, 33, cpu_int4_gemm.MAX_ROWS):
        a = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows), dtype=torch.float32).to(torch.bfloat16)
        aten = torch.ops.aten._weight_int4pack_mm_for_cpu(a, packed, group, scale_zeros)
        check_rounding(aten, a, u, scale_zeros, group)  # the bound holds for the reference kernel itself
        for path in paths_here():
            ours = cpu_int4_gemm.matmul(a, packed, group, scale_zeros, layout, path=path)
            check_rounding(ours, a, u, scale_zeros, group)
            # the same sums rounded the same way nearly everywhere: a misread nibble or scale would not be
            same = (ours == aten).float().mean().item()
            assert same > 0.9, (path, rows, same)


def test_declines_what_it_does_not_take():
    u, packed, scale_zeros = layer(64, 128, 64)
    layout = int4_layout()
    a = torch.randn(2, 128, dtype=torch.bfloat16)
    assert cpu_int4_gemm.matmul(a.float(), packed, 64, scale_zeros, layout) is None
    assert cpu_int4_gemm.matmul(a[None], packed, 64, scale_zeros, layout) is None
    assert cpu_int4_gemm.matmul(a, packed, 64, scale_zeros, None) is None
    big = torch.randn(cpu_int4_gemm.MAX_ROWS + 1, 128, dtype=torch.bfloat16)
    assert cpu_int4_gemm.matmul(big, packed, 64, scale_zeros, layout) is None
    pairs = Int4Layout(32, False)  # no CPU's full blocks: only the portable loop reads them
    assert cpu_int4_gemm.matmul(a, Int4Layout(32, False).pack(u), 64, scale_zeros, pairs) is None
    avx2_blocks = Int4Layout(32, True)  # AVX2's blocks: the avx2 path reads them (not AVX-512's paths)
    taken = cpu_int4_gemm.matmul(a, avx2_blocks.pack(u), 64, scale_zeros, avx2_blocks)
    assert (taken is None) == (cpu_int4_gemm.best_path() == "portable")
    if taken is not None:
        check_rounding(taken, a, u, scale_zeros, 64)
    if cpu_int4_gemm.best_path() == "portable":
        assert cpu_int4_gemm.matmul(a, packed, 64, scale_zeros, layout) is None  # aten is faster there
    else:
        assert cpu_int4_gemm.matmul(a, packed, 64, scale_zeros, layout) is not None


def test_bad_input_is_named():
    u, packed, scale_zeros = layer(64, 128, 64)
    layout = int4_layout()
    a = torch.randn(2, 128, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="scale_zeros"):
        cpu_int4_gemm.matmul(a, packed, 64, scale_zeros[:1], layout, path="portable")
    with pytest.raises(RuntimeError, match="inputs"):
        cpu_int4_gemm.matmul(a[:, :64].contiguous(), packed, 64, scale_zeros, layout, path="portable")
    with pytest.raises(ValueError, match="cannot run here"):
        cpu_int4_gemm.matmul(a, packed, 64, scale_zeros, layout, path="no-such-path")


@pytest.mark.parametrize("layout", [Int4Layout(32, True), Int4Layout(32, False), Int4Layout(64, False)])
def test_other_layouts_read_by_the_portable_loop(layout):
    """The orders aten packs in on other CPUs (AVX2's blocks of 32): every path asked reads them right
    (AVX-512's paths fall back to the avx2 path for blocks of 32 in halves, to the portable loop for
    the rest and every partial last block: 112 = 64 + 48, 3.5 x 32)."""
    u, _, scale_zeros = layer(112, 256, 32)
    packed = layout.pack(u)
    a = torch.randn(3, 256, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    for path in paths_here():
        check_rounding(cpu_int4_gemm.matmul(a, packed, 32, scale_zeros, layout, path=path), a, u, scale_zeros, 32)


@pytest.mark.parametrize("n", [576, 112])
def test_float32_activations_give_the_bf16_product_widened(n):
    """linear() on float32 [..., K] equals matmul() on x.to(bf16) widened back, bit for bit (the path a
    decode step took before: convert, multiply, convert back), on every path, full and partial blocks,
    whether or not the blocks split across threads; bf16 input returns matmul's bf16 exactly."""
    k = 256
    u, packed, scale_zeros = layer(n, k, 64, seed=3)
    layout = int4_layout()
    threads = torch.get_num_threads()
    try:
        for rows in (1, 2, 3, 8, 17):
            x = torch.randn(rows, 1, k, generator=torch.Generator().manual_seed(rows)) * 3
            a = x.reshape(rows, k).to(torch.bfloat16)
            for path in paths_here():
                before = cpu_int4_gemm.matmul(a, packed, 64, scale_zeros, layout, path=path).float().view(rows, 1, n)
                module = native.matmul_kernel("int4_gemm")[0]
                for parallel_bytes, nthreads in ((0, 2), (1 << 30, 2), (0, 1)):
                    torch.set_num_threads(nthreads)
                    y = module.int4_linear(x, packed, 64, scale_zeros, layout.block_n, layout.halves,
                                           native.MATMUL_PATHS.index(path), parallel_bytes)
                    assert y.dtype == torch.float32 and y.shape == (rows, 1, n)
                    assert torch.equal(y, before), (rows, path, parallel_bytes)
                    y16 = module.int4_linear(a.view(rows, 1, k), packed, 64, scale_zeros, layout.block_n,
                                             layout.halves, native.MATMUL_PATHS.index(path), parallel_bytes)
                    assert y16.dtype == torch.bfloat16 and torch.equal(y16.float(), before)
            if cpu_int4_gemm.best_path() != "portable":
                assert torch.equal(cpu_int4_gemm.linear(x, packed, 64, scale_zeros, layout),
                                   cpu_int4_gemm.matmul(a, packed, 64, scale_zeros, layout).float().view(rows, 1, n))
    finally:
        torch.set_num_threads(threads)


def test_linear_declines_what_matmul_declines_and_names_bad_input():
    u, packed, scale_zeros = layer(64, 128, 64)
    layout = int4_layout()
    x = torch.randn(2, 128)
    assert cpu_int4_gemm.linear(x.double(), packed, 64, scale_zeros, layout) is None
    assert cpu_int4_gemm.linear(x, packed, 64, scale_zeros, None) is None
    assert cpu_int4_gemm.linear(x, Int4Layout(32, False).pack(u), 64, scale_zeros, Int4Layout(32, False)) is None
    assert cpu_int4_gemm.linear(torch.randn(cpu_int4_gemm.MAX_ROWS + 1, 128), packed, 64, scale_zeros, layout) is None
    if cpu_int4_gemm.best_path() == "portable":
        assert cpu_int4_gemm.linear(x, packed, 64, scale_zeros, layout) is None  # aten is faster there
        return
    with pytest.raises(RuntimeError, match="inputs"):
        cpu_int4_gemm.linear(torch.randn(2, 64), packed, 64, scale_zeros, layout)
