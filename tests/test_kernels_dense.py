"""The matmul's dense configurations (runtime/kernels/dequantize_weight.py): the KernelWeight
dequantized into a scratch [N, K] weight by the fused kernel's own code, then one torch GEMM
(cuBLAS on a GPU). Run in the Triton interpreter on CPU (compiled on CUDA where a GPU is present),
as tests/test_kernels_linear.py; the compiled code is read in tests/test_sass_budgets.py."""

import inspect

import pytest
import torch

from kernel_device import DEVICE  # noqa: F401 (sets TRITON_INTERPRET before triton is imported)

from quant.affine import QuantScheme  # noqa: E402
from runtime.execution import DecodeGraphs  # noqa: E402
from runtime.kernels import dequantize_weight as dq  # noqa: E402
from runtime.kernels import matmul_tuning as tuning  # noqa: E402
from runtime.kernels import quant_matmul as qm  # noqa: E402
from runtime.kernels.matmul_configs import DENSE_MIN_M, MatmulConfig, candidate_configs, dense_config  # noqa: E402
from runtime.kernels.weight_layout import dequantize_kernel_weight, make_kernel_weight  # noqa: E402
from test_kernels_linear import assert_close_to_precision, checkpoint_tensors, reference_output  # noqa: E402


def layer(bits, group, sym, act_order, N, K, seed=0):
    scheme = QuantScheme(bits, group, sym, actorder="group" if act_order else None)
    tensors = checkpoint_tensors(N, K, scheme, seed, act_order)
    return make_kernel_weight(*tensors[:3], (N, K), scheme, tensors[3]), tensors, scheme


def within_one_bf16_ulp(a, b):
    steps = (a.view(torch.int16).int() - b.view(torch.int16).int()).abs()
    return bool((steps <= 1).all())


# bits, group, symmetric, act-order, N (not a multiple of the column tile: masked), K (ragged: padding)
LAYERS = [(4, 128, False, False, 80, 384), (4, 32, True, True, 72, 256), (8, 64, False, False, 40, 320),
          (8, -1, True, False, 48, 200), (2, 32, False, False, 40, 256), (4, -1, False, False, 64, 100)]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("bits,group,sym,act_order,N,K", LAYERS)
def test_the_dense_weight_is_what_the_fused_kernel_feeds_its_dot(bits, group, sym, act_order, N, K, dtype):
    """Bit for bit the fused kernel's dequantized tile (identity activations: its output is that
    tile), and quant.affine's ``(q - zero) * scale`` rounded to the dtype; every element of the
    [N, K] weight written, nothing past it."""
    kw, _, _ = layer(bits, group, sym, act_order, N, K)
    buffer = torch.full((N * K + 64,), float("nan"), dtype=dtype, device=DEVICE)
    dense = buffer[: N * K].view(N, K)
    qm.dense_weight(kw, dense, dense_config(64, 4))
    assert buffer[N * K :].isnan().all()
    fed_to_dot = torch.empty(K, N, dtype=dtype, device=DEVICE)  # launch takes inputs in the weight's order
    qm.launch(torch.eye(K, dtype=dtype, device=DEVICE), kw, None, fed_to_dot, MatmulConfig(64, 32))
    fed_to_dot = fed_to_dot.t()
    assert torch.equal(dense, fed_to_dot)
    reference = dequantize_kernel_weight(kw, dtype)
    if dtype == torch.float16 or not qm.interpreting():
        assert torch.equal(dense, reference)
    else:  # the interpreter's fp32 -> bf16 casts truncate; the GPU rounds to nearest, as the reference
        assert within_one_bf16_ulp(dense, reference)


@pytest.mark.parametrize("bits,group,sym,act_order,dtype,M,N,K,with_bias", [
    (4, 128, False, False, torch.float16, 300, 80, 384, True),
    (4, 32, True, True, torch.bfloat16, 257, 72, 256, False),  # act-order: activations permuted per call
    (8, 64, False, True, torch.float16, 260, 40, 320, True),
])
def test_quant_matmul_through_a_dense_configuration(bits, group, sym, act_order, dtype, M, N, K, with_bias):
    kw, tensors, scheme = layer(bits, group, sym, act_order, N, K, seed=M)
    g = torch.Generator().manual_seed(M + 1)
    x = torch.randn(2, M // 2, K, generator=g).to(DEVICE, dtype)
    bias = torch.randn(N, generator=g).to(DEVICE, dtype) if with_bias else None
    for config in (dense_config(64, 4), dense_config(128, 8)):
        out = qm.quant_matmul(x, kw, bias, config)
        assert out.shape == (2, M // 2, N) and out.dtype == dtype
        assert_close_to_precision(out, reference_output(x, tensors, (N, K), scheme, bias), dtype)


@pytest.mark.parametrize("act_order", [False, True])
def test_the_tuners_check_passes_a_dense_configuration(act_order, monkeypatch):
    """matmul_tuning's check and timing take a dense configuration as any other: with the dense one
    timed fastest, the tuner returns it after its check against the reference."""
    kw, _, _ = layer(4, 32, False, act_order, 600, 128)  # more outputs than the check reads (both ends)
    tuning.check(DENSE_MIN_M, kw, torch.float16, DEVICE, dense_config(), qm.launch)
    times = iter([2.0, 1.0])
    monkeypatch.setattr(tuning, "time_ms", lambda fn: (fn(), next(times))[1])
    chosen = tuning.tune(DENSE_MIN_M, kw, torch.float16, DEVICE, [MatmulConfig(64, 64), dense_config()], qm.launch)
    assert chosen == dense_config()


def test_dense_configurations_only_for_rows_no_cuda_graph_captures():
    """Offered from DENSE_MIN_M rows on, never first (the untimed default stays the fused kernel), and
    never in an M bucket a captured decode step can fall in (DecodeGraphs' batches)."""
    kw, _, _ = layer(4, 128, False, False, 64, 256)
    captured = inspect.signature(DecodeGraphs).parameters["buckets"].default
    assert max(captured) < DENSE_MIN_M
    for M in (1, 16, 17, 64, 65, 128, 256, 257, 300, 512, 4096):
        candidates = candidate_configs(M, kw)
        assert any(c.dense for c in candidates) == (M >= DENSE_MIN_M) == (qm.m_bucket(M) > max(captured))
        assert not candidates[0].dense


def test_the_scratch_is_one_buffer_grown_to_the_largest_weight(monkeypatch):
    monkeypatch.setattr(dq, "_SCRATCH", {})

    def view(N, K, dtype=torch.float16):
        with dq.scratch(N, K, dtype, torch.device("cpu")) as buffer:
            assert dq._SCRATCH_LOCK.locked()  # held while the caller writes and reads it
            return buffer

    small, large, again = view(8, 16), view(32, 16), view(8, 16)
    assert small.shape == again.shape == (8, 16) and large.shape == (32, 16)
    assert again.data_ptr() == large.data_ptr() and len(dq._SCRATCH) == 1  # grown once, then reused
    view(8, 16, torch.bfloat16)
    assert len(dq._SCRATCH) == 2 and not dq._SCRATCH_LOCK.locked()  # one per (device, dtype)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with pytest.raises(RuntimeError, match="CUDA-graph capture"):
        with dq.scratch(8, 16, torch.float16, torch.device("cuda")):
            pass


def test_bad_dense_launches_are_refused():
    with pytest.raises(ValueError, match="no row tile"):
        MatmulConfig(16, 64, dense=True)
    kw, _, _ = layer(4, 128, False, False, 64, 256)
    with pytest.raises(ValueError, match=r"contiguous \[64, 256\]"):
        dq.dequantize_into(kw, torch.empty(256, 64, dtype=torch.float16, device=DEVICE), 64, 4, None, False)


# Variants bench/sass.py's cases (4/8-bit g128, whole tiles) leave out: a group smaller than a tile
# (one scale per field), one group per row, 2 bits, columns past N and a ragged last K tile (masks).
COMPILE_SCRIPT = """
import json, sys
from bench.sass import static_report
from runtime.kernels.dequantize_weight import _dequantize_kernel
from runtime.kernels.quant_matmul import TORCH_DTYPES, dequant_type
reports = []
for bits, dtype, group, tile_group, even_n, even_k, aligned in json.loads(sys.argv[1]):
    constexprs = dict(BITS=bits, GROUP=group, HAS_ZERO=True, SCALE_PER_TILE=tile_group,
                      DEQUANT=dequant_type(bits, TORCH_DTYPES[dtype], False), DEQUANT_ASM=True, BLOCK_N=64,
                      EVEN_N=even_n, EVEN_K=even_k)
    signature = {"qw_ptr": "*i32", "s_ptr": "*" + dtype, "z_ptr": "*i8", "out_ptr": "*" + dtype, "N": "i32", "K": "i32"}
    reports.append(static_report(_dequantize_kernel, signature, constexprs, 4, 1, "sm_90a",
                                 divisible_by_16=("qw_ptr", "s_ptr", "z_ptr", "out_ptr", *aligned)))
print(json.dumps([{k: r[k] for k in ("registers", "spill_instructions", "local_bytes", "global_stores")} for r in reports]))
"""


def test_the_dequantization_compiles_for_sm_90a_in_every_variant(triton_release):
    """No spills anywhere; 16-byte stores wherever K is a multiple of 16 (Triton specializes such
    sizes at launch: output rows start 16-byte aligned), masked or not."""
    import json

    # bits, dtype, group, one group a tile, no column past N, no ragged K tile (as launch passes them),
    # the sizes Triton sees divisible by 16
    variants = [(4, "fp16", 32, False, True, True, ["N", "K"]), (8, "bf16", 4096, True, False, True, ["K"]),
                (2, "fp16", 64, False, True, False, ["N", "K"]), (4, "bf16", 128, True, False, False, [])]
    run = triton_release.run(["-c", COMPILE_SCRIPT, json.dumps(variants)], timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    for variant, report in zip(variants, json.loads(run.stdout.strip().splitlines()[-1])):
        assert report["spill_instructions"] == 0 and report["local_bytes"] == 0, (variant, report)
        if "K" in variant[-1]:
            assert set(report["global_stores"]) == {"STG.E.128"}, (variant, report)
