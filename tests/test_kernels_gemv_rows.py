"""The few-row GEMV (runtime/kernels/gemv_rows.py) against float64, in the Triton interpreter on CPU.

Each row is held to the M=1 GEMV's bound (tests/test_kernels_gemv.py: 16-term chains in the 16-bit
pair type), row by row: the chains are as long, each weight pair is the same exact value, and each
row's chain sees only its own activations. A kernel that gave a row another row's activations,
or read a row past M, is far outside it (the rows are independent random vectors).
Compiled for sm_90a (no spills, no barriers, words an iteration ahead): tests/test_sass_budgets.py.
"""

import pytest
import torch

pytest.importorskip("triton")

from runtime.kernels import quant_matmul as qm  # noqa: E402

DEVICE = torch.device("cpu" if qm.interpreting() else "cuda")
if DEVICE.type == "cuda" and not torch.cuda.is_available():
    pytest.skip("no GPU, and triton was imported before TRITON_INTERPRET=1 was set", allow_module_level=True)

from quant.affine import QuantScheme  # noqa: E402
from runtime.kernels.matmul_configs import GEMV_ROWS_MAX_M, candidate_configs, few_row_gemvs  # noqa: E402
from runtime.kernels.weight_layout import KernelWeight, make_kernel_weight  # noqa: E402
from test_kernels_gemv import assert_within_bound  # noqa: E402
from test_kernels_linear import checkpoint_tensors  # noqa: E402

Config = qm.MatmulConfig


def rows_config(rows: int, block_n: int, warps: int, split: int) -> Config:
    return Config(rows, block_n, split, use_dot=False, group_m=1, num_warps=warps, num_stages=1)


# bits, group, symmetric, act-order, dtype, N, K, M, bias, (rows a program, block_n, warps, split)
CASES = [
    (4, 128, False, False, torch.float16, 40, 256, 3, True, (4, 32, 1, 2)),  # ragged N, M < rows, split
    (4, 32, False, False, torch.bfloat16, 32, 96, 5, False, (8, 32, 1, 1)),  # small groups, ragged K
    (8, 128, False, False, torch.float16, 40, 256, 2, True, (2, 32, 2, 2)),  # bytes under 0x64, split
    (2, 64, True, False, torch.float16, 32, 512, 2, True, (2, 32, 2, 1)),  # 8 slots: two chains per a
    (4, 128, False, True, torch.float16, 32, 256, 6, False, (4, 32, 2, 1)),  # act-order, two row blocks
    (4, -1, False, False, torch.bfloat16, 40, 72, 2, True, (2, 32, 1, 1)),  # per channel, ragged K
]


@pytest.mark.parametrize("bits,group,sym,act_order,dtype,N,K,M,with_bias,launch", CASES)
def test_each_row_is_within_the_gemv_error_bound(bits, group, sym, act_order, dtype, N, K, M, with_bias, launch):
    seed = hash((bits, group, sym, act_order, N, K, M)) % 10_000
    scheme = QuantScheme(bits, group, sym, actorder="group" if act_order else None)
    tensors = checkpoint_tensors(N, K, scheme, seed, act_order)
    kw = make_kernel_weight(*tensors[:3], (N, K), scheme, tensors[3])
    g = torch.Generator().manual_seed(seed + 1)
    x = (torch.randn(M, K, generator=g) * 3).to(DEVICE, dtype)
    bias = torch.randn(N, generator=g).to(DEVICE, dtype) if with_bias else None
    out = qm.quant_matmul(x, kw, bias, rows_config(*launch))
    assert out.dtype == dtype and out.shape == (M, N)
    for m in range(M):
        assert_within_bound(out[m : m + 1], x[m : m + 1], kw, bias, dtype)
    if launch[3] > 1:  # the split sums meet in a fixed order: the same result again
        assert torch.equal(out, qm.quant_matmul(x, kw, bias, rows_config(*launch)))


def test_large_activations_do_not_overflow_the_fp16_chains():
    """As for the GEMV: chains hold x (q - z) 2**-bits over 16 terms, finite for |x| <= 4000."""
    N, K = 32, 256
    scheme = QuantScheme(4, 128, False)
    kw = make_kernel_weight(*checkpoint_tensors(N, K, scheme, seed=4)[:3], (N, K), scheme)
    kw.qweight.fill_(-1)  # every stored value the largest code
    sign = 1 - 2 * (torch.arange(K) // 16 % 2)
    x = torch.stack([2000.0 * sign, -2000.0 * sign]).to(DEVICE, torch.float16)
    out = qm.quant_matmul(x, kw, None, rows_config(2, 32, 1, 1))
    assert torch.isfinite(out).all()
    for m in range(2):
        assert_within_bound(out[m : m + 1], x[m : m + 1], kw, None, torch.float16)


def test_offered_to_the_tuner_for_two_to_eight_rows_beside_the_dot_default():
    kw = KernelWeight(None, None, None, None, 8192, 8192, 4, 128)  # only shape fields are read
    for M in range(2, 17):
        configs = candidate_configs(M, kw, torch.float16)
        assert configs[0].use_dot  # the untimed default stays the 16-row tl.dot tile
        rows = [c for c in configs if not c.use_dot]
        if M <= GEMV_ROWS_MAX_M:
            assert rows and all(c.block_m == 1 << (M - 1).bit_length() >= M for c in rows), M
        else:
            assert not rows, M
    kw.bits = 8
    assert few_row_gemvs(4, kw, torch.float16) and not few_row_gemvs(4, kw, torch.bfloat16)
    assert not few_row_gemvs(4, kw, None)  # no dtype given: only what every activation dtype runs


def test_formats_it_does_not_take_are_refused_clearly():
    N, K = 32, 128
    scheme = QuantScheme(8, 128, False)
    kw = make_kernel_weight(*checkpoint_tensors(N, K, scheme, seed=5)[:3], (N, K), scheme)
    x = torch.randn(2, K).to(DEVICE, torch.bfloat16)
    with pytest.raises(ValueError, match="few-row GEMV takes no 8-bit"):
        qm.quant_matmul(x, kw, None, rows_config(2, 32, 1, 1))
    with pytest.raises(ValueError, match="at most 16 rows"):
        rows_config(32, 32, 1, 1)
    with pytest.raises(ValueError, match="computes one row"):
        qm.quant_matmul(x.half(), kw, None, Config(1, 32, use_dot=False))
