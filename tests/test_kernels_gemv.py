"""The M=1 GEMV (runtime/kernels/gemv.py) against float64, in the Triton interpreter on CPU.

The interpreter runs the kernel's pure-Triton branch: the same 16-term chains per field, each
step rounded to the 16-bit pair type as the GPU's packed fma rounds it. The bound asserted is
the one the module docstring derives, per output ``n``:

    |y - y64| <= (γ16(u) + (K/16 + 4) * 2**-24) * Σ_k |x_k| |q_k - z| s_k
                 + K * 2**(bits - 25) * max s  +  u_out |y64|

with ``u`` the pair type's unit roundoff (fp16 2**-11, bf16 2**-8), γ16 = 16u / (1 - 16u), the
middle term for fp16 chains (they hold ``x (q - z) 2**-bits``: a rounding among fp16's
subnormals is off by up to 2**-25 absolute, not relative; 0 for bf16), and
``u_out`` the output type's (doubled for bf16: the interpreter's casts to bf16 truncate), plus
the bias' rounding. On random data the error is far inside it (the worst ratio is printed with
``-s``); a kernel that pairs a weight with the wrong activation is far outside
(``test_the_bound_catches_a_wrong_kernel``).
"""

import pytest
import torch

pytest.importorskip("triton")

from runtime.kernels import quant_matmul as qm  # noqa: E402

DEVICE = torch.device("cpu" if qm.interpreting() else "cuda")
if DEVICE.type == "cuda" and not torch.cuda.is_available():
    pytest.skip("no GPU, and triton was imported before TRITON_INTERPRET=1 was set", allow_module_level=True)

from quant.affine import QuantScheme  # noqa: E402
from runtime.kernels.weight_layout import kernel_weight_values, make_kernel_weight  # noqa: E402
from test_kernels_linear import checkpoint_tensors  # noqa: E402

Config = qm.MatmulConfig


def exact_terms(x: torch.Tensor, kw) -> tuple[torch.Tensor, torch.Tensor]:
    """(y64 without bias, Σ|x||q - z|s) in float64, from the kernel layout (inputs in kernel order)."""
    q = kernel_weight_values(kw).double()  # [N, K]
    group = kw.group_len
    scale = kw.scales.t().double().repeat_interleave(group, dim=1)[:, : kw.in_features]
    zero = 0.0 if kw.zeros is None else kw.zeros.t().double().repeat_interleave(group, dim=1)[:, : kw.in_features]
    if kw.perm is not None:
        x = x.index_select(-1, kw.perm)
    w = (q - zero) * scale
    x64 = x.double()
    return x64 @ w.t(), x64.abs() @ w.abs().t()


def assert_within_bound(out, x, kw, bias, dtype):
    y64, magnitude = exact_terms(x, kw)
    if bias is not None:
        y64 = y64 + bias.double()
    u = 2.0**-11 if dtype == torch.float16 else 2.0**-8
    if kw.bits == 8 and dtype == torch.bfloat16:
        u = 0.0  # fp32 chains
    gamma = 16 * u / (1 - 16 * u)
    u_out = 2.0**-11 if dtype == torch.float16 else 2.0**-7
    subnormal = kw.in_features * 2.0 ** (kw.bits - 25) * kw.scales.double().abs().max() if dtype == torch.float16 else 0
    bound = (gamma + (kw.in_features / 16 + 4) * 2.0**-24) * magnitude + subnormal + u_out * (y64.abs() + 1e-30)
    if bias is not None:
        bound = bound + u_out * bias.double().abs()
    err = (out.double() - y64).abs()
    worst = (err / bound).max().item()
    assert worst <= 1.0, f"error {worst:.3f} x the bound"
    return worst


# bits, group, symmetric, act-order, dtype, N, K, bias, (block_n, warps, split)
CASES = [
    (4, 128, False, False, torch.float16, 200, 1024, True, (128, 4, 1)),  # N not a multiple of the tile
    (4, 32, False, False, torch.bfloat16, 96, 1120, False, (64, 4, 2)),  # K not a multiple of 128, split
    (4, 64, True, False, torch.float16, 64, 576, True, (64, 8, 3)),  # group 64 < tile, 8 warps, split
    (4, -1, False, False, torch.bfloat16, 72, 200, True, (64, 4, 1)),  # per channel, ragged K
    (4, 32, False, True, torch.float16, 64, 512, False, (128, 4, 2)),  # act-order
    (8, 128, False, False, torch.float16, 80, 640, True, (64, 4, 2)),
    (8, 64, True, True, torch.bfloat16, 48, 384, True, (64, 4, 1)),  # 8-bit bf16: fp32 chains
    (8, -1, False, False, torch.bfloat16, 40, 100, False, (64, 4, 1)),
    (2, 32, False, False, torch.float16, 40, 512, True, (64, 4, 1)),
    (4, 128, False, False, torch.float16, 64, 2048, True, (64, 4, 4)),  # 4 splits of 4 tiles
]


@pytest.mark.parametrize("bits,group,sym,act_order,dtype,N,K,with_bias,launch", CASES)
def test_gemv_is_within_its_error_bound(bits, group, sym, act_order, dtype, N, K, with_bias, launch):
    seed = hash((bits, group, sym, act_order, N, K)) % 10_000
    scheme = QuantScheme(bits, group, sym, actorder="group" if act_order else None)
    tensors = checkpoint_tensors(N, K, scheme, seed, act_order)
    kw = make_kernel_weight(*tensors[:3], (N, K), scheme, tensors[3])
    g = torch.Generator().manual_seed(seed + 1)
    x = (torch.randn(1, K, generator=g) * 3).to(DEVICE, dtype)
    bias = torch.randn(N, generator=g).to(DEVICE, dtype) if with_bias else None
    block_n, warps, split = launch
    out = qm.quant_matmul(x, kw, bias, Config(1, block_n, split, use_dot=False, group_m=1, num_warps=warps))
    assert out.dtype == dtype and out.shape == (1, N)
    print(f"error / bound: {assert_within_bound(out, x, kw, bias, dtype):.3f}")
    # deterministic: the split sums meet in a fixed order
    again = qm.quant_matmul(x, kw, bias, Config(1, block_n, split, use_dot=False, group_m=1, num_warps=warps))
    assert torch.equal(out, again)


@pytest.mark.parametrize("bits", [4, 8])
def test_large_activations_do_not_overflow_the_fp16_chains(bits):
    """Sixteen inputs of 2000 against the largest codes: a chain of 16 * 2000 * (q - z) (up to 15 at
    4 bits, 255 at 8) is far past fp16's 65504; the chains hold x (q - z) 2**-bits and stay finite.
    The 16-input fields alternate in sign, so the exact output is 0 (an overflowed chain gives
    inf - inf = nan)."""
    N, K = 64, 256
    scheme = QuantScheme(bits, 128, False)
    kw = make_kernel_weight(*checkpoint_tensors(N, K, scheme, seed=bits)[:3], (N, K), scheme)
    kw.qweight.fill_(-1)  # every stored value the largest code
    sign = 1 - 2 * (torch.arange(K) // 16 % 2)
    x = (2000.0 * sign).to(DEVICE, torch.float16)[None, :]
    out = qm.quant_matmul(x, kw, None, Config(1, 64, 1, use_dot=False, group_m=1))
    assert torch.isfinite(out).all()
    assert_within_bound(out, x, kw, None, torch.float16)


def test_the_bound_catches_a_wrong_kernel():
    """The bound is tight enough that a misplaced field or a lost zero point fails it."""
    scheme = QuantScheme(4, 128, False)
    tensors = checkpoint_tensors(64, 512, scheme, seed=7)
    kw = make_kernel_weight(*tensors[:3], (64, 512), scheme)
    x = torch.randn(1, 512, generator=torch.Generator().manual_seed(8)).to(DEVICE, torch.float16)
    out = qm.quant_matmul(x, kw, None, Config(1, 64, 1, use_dot=False, group_m=1))
    assert_within_bound(out, x, kw, None, torch.float16)
    shifted = torch.roll(x, 1, dims=1)  # every weight meets its neighbour's activation
    with pytest.raises(AssertionError, match="the bound"):
        assert_within_bound(qm.quant_matmul(shifted, kw, None, Config(1, 64, 1, use_dot=False, group_m=1)),
                            x, kw, None, torch.float16)


def test_m1_launches_the_gemv_by_default():
    scheme = QuantScheme(4, 128, False)
    kw = make_kernel_weight(*checkpoint_tensors(64, 4096, scheme, seed=1)[:3], (64, 4096), scheme)
    configs = qm.candidate_configs(1, kw)
    assert configs and all(not c.use_dot and c.block_m == 1 for c in configs)
    assert configs[0].split_k > 1  # 64 columns alone cannot fill a GPU


COMPILE_SCRIPT = """
import json, sys
import triton.language as tl
from bench.sass import static_report
from runtime.kernels.gemv import _gemv_kernel, pair_type
from runtime.kernels.quant_matmul import TORCH_DTYPES
out = []
for c in json.loads(sys.argv[1]):
    dtype = c["dtype"]
    signature = {"x_ptr": f"*{dtype}", "qw_ptr": "*i32", "s_ptr": f"*{dtype}", "z_ptr": "*i8", "bias_ptr": f"*{dtype}",
                 "out_ptr": f"*{dtype}", "part_ptr": "*fp32", "count_ptr": "*i32", "K": "i32", "tiles_per_split": "i32"}
    constexprs = dict(N=c["N"], BITS=c["bits"], GROUP=c["group"], HAS_ZERO=c["zero"], HAS_BIAS=True, SPLIT=c["split"],
                      PAIR=pair_type(c["bits"], TORCH_DTYPES[dtype]), ASM=True, EVEN_K=c["even_k"],
                      BLOCK_N=c["block_n"], WARPS=c["warps"])
    # what Triton specializes for the launcher's tensors (fresh allocations: 16-byte aligned), as
    # bench/sass_weights.py compiles it: the aligned scale loads decide the word tiles' layout
    aligned = ("x_ptr", "qw_ptr", "s_ptr", "z_ptr", "bias_ptr", "out_ptr", "part_ptr", "count_ptr", "K")
    r = static_report(_gemv_kernel, signature, constexprs, c["warps"], 1, "sm_90a", None, aligned)
    loop = r["main_loop"]
    out.append({"spills": r["spill_instructions"], "barriers": loop["barriers"], "shared_stores": loop["shared_stores"],
                "packed_fma": loop["opcodes"].get("HFMA2", 0), "prefetched": loop["prefetched_loads"]})
print(json.dumps(out))
"""


def test_gemv_compiles_for_hopper_in_every_variant(triton_release):
    """What the interpreter never compiles: the inline-assembly path for sm_90a in the variants the
    launcher can pick (bf16 and 8 bits, small groups, ragged K and N, K splits): no spills, no
    shared memory or barriers in the main loop, words loaded an iteration ahead."""
    import json

    cases = [
        dict(dtype="fp16", bits=4, group=64, zero=True, split=True, even_k=False, N=200, block_n=64, warps=4),
        dict(dtype="bf16", bits=8, group=128, zero=True, split=False, even_k=True, N=4096, block_n=128, warps=4),
        dict(dtype="bf16", bits=4, group=640, zero=False, split=True, even_k=False, N=1000, block_n=128, warps=8),
        dict(dtype="fp16", bits=2, group=32, zero=True, split=False, even_k=True, N=512, block_n=64, warps=4),
        dict(dtype="fp16", bits=8, group=128, zero=False, split=True, even_k=True, N=28672, block_n=128, warps=8),
    ]
    run = triton_release.run(["-c", COMPILE_SCRIPT, json.dumps(cases)], timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    for case, got in zip(cases, json.loads(run.stdout.strip().splitlines()[-1])):
        assert got["spills"] == 0 and got["barriers"] == 0 and got["shared_stores"] == 0, (case, got)
        # every word of the next tile ahead: one 16-byte load per column a thread owns and per a
        # (rows 4 a .. 4 a + 3 lie side by side), 4 * BLOCK_N / 32 loads
        assert got["prefetched"] >= 4 * case["block_n"] // 32, (case, got)
        # (ptxas also uses HFMA2 to set constants: a few are no packed path)
        assert (got["packed_fma"] > 32) == (case["dtype"] == "fp16" or case["bits"] <= 4), (case, got)
