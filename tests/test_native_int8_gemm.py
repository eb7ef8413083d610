"""runtime.cpu_int8_gemm: lowbit's 8-bit per-channel matmul for few rows equals aten's int8 kernel on
the same codes and scales, to bf16 rounding, on every path this CPU has, for K a multiple of 16 but
not of 32, N not a multiple of 16, 1..33 rows and MAX_ROWS; and any K aten does not take."""

import pytest
import torch

from runtime import cpu_int8_gemm, native

pytestmark = pytest.mark.skipif(native.load("int8_gemm") is None, reason="the native kernel cannot be built here")


def paths_here() -> list[str]:
    return native.matmul_paths("int8_gemm")


def layer(n: int, k: int, seed: int = 0):
    """Random int8 codes [N, K] (the full range, -128 included) and bf16 scales [N]."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(-128, 128, (n, k), generator=gen, dtype=torch.int8)
    q[0, 0] = -128  # the one code whose magnitude is 128
    scales = (torch.rand(n, generator=gen) * 0.05 + 0.001).to(torch.bfloat16)
    return q, scales


def check_rounding(y: torch.Tensor, a: torch.Tensor, q: torch.Tensor, scales: torch.Tensor):
    """Within bf16 rounding of the exact product (plus float32 summation error, from |a| |w|)."""
    w = q.double() * scales.double()[:, None]
    ref = a.double() @ w.t()
    bound = ref.abs() * 2.0**-8 + (a.double().abs() @ w.abs().t()) * 2.0**-18
    assert y.dtype == torch.bfloat16 and y.shape == ref.shape
    assert ((y.double() - ref).abs() <= bound).all(), (y.double() - ref).abs().div(bound).max()


def rows_of(rows: int, k: int) -> torch.Tensor:
    return torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).to(torch.bfloat16)


# K: 48 and 208 are multiples of 16 but not 32 (a partial AMX step, a masked tail); N: 100 and 33
# leave partial blocks of 64 and tiles of 16, 7 fewer than one tile
@pytest.mark.parametrize("n,k", [(576, 576), (100, 48), (33, 208), (7, 256), (130, 1040)])
def test_matches_aten_on_every_path(n, k):
    q, scales = layer(n, k)
    for rows in [*range(1, 34), cpu_int8_gemm.MAX_ROWS]:
        a = rows_of(rows, k)
        aten = torch.ops.aten._weight_int8pack_mm(a, q, scales)
        check_rounding(aten, a, q, scales)  # the bound holds for the reference kernel itself
        for path in paths_here():
            ours = cpu_int8_gemm.matmul(a, q, scales, path=path)
            check_rounding(ours, a, q, scales)
            # the same sums rounded the same way nearly everywhere: a misread code or scale would not be
            same = (ours == aten).float().mean().item()
            assert same > 0.9, (path, rows, same)


@pytest.mark.parametrize("k", [1, 17, 33, 100])
def test_any_input_count(k):
    """K that aten's kernel does not take (not a multiple of 16) against the exact product."""
    q, scales = layer(70, k)
    for rows in (1, 3, 17):
        a = rows_of(rows, k)
        for path in paths_here():
            check_rounding(cpu_int8_gemm.matmul(a, q, scales, path=path), a, q, scales)


def test_declines_what_it_does_not_take():
    q, scales = layer(64, 128)
    a = torch.randn(2, 128, dtype=torch.bfloat16)
    assert cpu_int8_gemm.matmul(a.float(), q, scales) is None
    assert cpu_int8_gemm.matmul(a[None], q, scales) is None
    assert cpu_int8_gemm.matmul(a, q.to(torch.int16), scales) is None
    assert cpu_int8_gemm.matmul(a, q, scales.float()) is None
    big = torch.randn(cpu_int8_gemm.MAX_ROWS + 1, 128, dtype=torch.bfloat16)
    assert cpu_int8_gemm.matmul(big, q, scales) is None
    few = torch.randn(cpu_int8_gemm.AMX_MIN_ROWS - 1, 128, dtype=torch.bfloat16)
    assert cpu_int8_gemm.matmul(few, q, scales) is None  # aten's kernel is as fast there
    enough = torch.randn(cpu_int8_gemm.AMX_MIN_ROWS, 128, dtype=torch.bfloat16)
    if cpu_int8_gemm.best_path() == "amx":
        assert torch.equal(cpu_int8_gemm.matmul(enough, q, scales), cpu_int8_gemm.matmul(enough, q, scales, path="amx"))
    else:
        assert cpu_int8_gemm.matmul(enough, q, scales) is None  # aten is as fast or faster without AMX


def test_bad_input_is_named():
    q, scales = layer(64, 128)
    a = torch.randn(2, 128, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="scales"):
        cpu_int8_gemm.matmul(a, q, scales[:10], path="portable")
    with pytest.raises(RuntimeError, match="inputs"):
        cpu_int8_gemm.matmul(a[:, :64].contiguous(), q, scales, path="portable")
    with pytest.raises(RuntimeError, match="contiguous int8"):
        cpu_int8_gemm.matmul(a, q.t(), scales, path="portable")
    with pytest.raises(ValueError, match="cannot run here"):
        cpu_int8_gemm.matmul(a, q, scales, path="no-such-path")
