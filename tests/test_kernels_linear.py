"""The Triton weight kernels (runtime/kernels/quant_matmul.py) against their PyTorch references,
run on CPU tensors in the Triton interpreter.

What the interpreter (triton 3.x) checks and what it cannot:

* indexing, masks, tile mapping, split-K, unpacking and dequantization, the fp32 accumulation
  and the epilogue run as written, in numpy;
* fp16 ``tl.dot`` is a numpy matmul: checked;
* bf16 tensors are raw uint16 there: ``tl.dot`` on bf16 operands multiplies integers, so the
  kernel upcasts bf16 operands to fp32 for the dot in the interpreter only (``DOT_IN_FP32``);
  the GPU's bf16 ``tl.dot`` itself is not exercised here. fp32 -> bf16 casts truncate in the
  interpreter (the GPU rounds to nearest): bf16 tolerances allow one unit in the last place.
* speed: nothing. See bench/kernels.py.
"""

import warnings

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from runtime.kernels import quant_matmul as qm  # noqa: E402

# tests/conftest.py turns the interpreter on where there is no GPU; with one, the same tests run
# the compiled kernels on CUDA tensors.
DEVICE = torch.device("cpu" if qm.interpreting() else "cuda")
if DEVICE.type == "cuda" and not torch.cuda.is_available():
    pytest.skip("no GPU, and triton was imported before TRITON_INTERPRET=1 was set (tests/conftest.py sets it)",
                allow_module_level=True)

from quant.affine import QuantScheme, choose_qparams, quantize  # noqa: E402
from quant.packing import pack, unpack  # noqa: E402
from runtime import linear as linear_module  # noqa: E402
from runtime.kernels import reference  # noqa: E402
from runtime.kernels.weight_layout import (  # noqa: E402
    dequantize_kernel_weight,
    interleave_word_rows,
    kernel_weight_values,
    make_kernel_weight,
    reference_matmul,
    unsupported_reason,
    word_rows,
)
from runtime.linear import QuantLinear, use_backend  # noqa: E402

Config = qm.MatmulConfig


def checkpoint_tensors(out_features, in_features, scheme, seed, act_order=False, scale_dtype=torch.bfloat16):
    """A random Linear quantized with quant's own math, as a pack-quantized checkpoint stores it:
    (weight_packed, weight_scale, packed zero points or None, weight_g_idx or None)."""
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(out_features, in_features, generator=g)
    perm = torch.randperm(in_features, generator=g) if act_order else None
    if act_order:  # GPTQ act-order: group j holds columns perm[j*group:(j+1)*group]
        weight = weight[:, perm]
    scale, zero = choose_qparams(weight, scheme, scale_dtype=scale_dtype)
    q = quantize(weight, scale, zero, scheme)
    g_idx = None
    if act_order:
        inverse = torch.argsort(perm)
        q = q[:, inverse]  # columns back in model order
        g_idx = (torch.arange(in_features) // scheme.group_len(in_features))[inverse].to(torch.int32)
    zero_packed = None if zero is None else pack(zero, scheme.bits, dim=0)
    tensors = pack(q, scheme.bits, dim=1), scale, zero_packed, g_idx
    return tuple(None if t is None else t.to(DEVICE) for t in tensors)


def reference_output(x, tensors, shape, scheme, bias):
    """The checkpoint-level reference (what the CPU runtime computes), accumulated in fp32."""
    packed, scale, zero_packed, g_idx = tensors
    weight = reference.dequantize_weight(packed, scale, zero_packed, shape, scheme, x.dtype, g_idx)
    return F.linear(x.float(), weight.float(), None if bias is None else bias.float())


def assert_close_to_precision(actual, expected, dtype):
    """Tolerances from the output precision: half an ulp of rounding per output (one in the
    interpreter's truncating bf16 casts), plus accumulation-order noise in fp32."""
    eps = torch.finfo(dtype).eps
    rms = expected.pow(2).mean().sqrt().item()
    torch.testing.assert_close(actual.float(), expected, rtol=2 * eps, atol=4 * eps * rms)


# bits, group, symmetric, act-order, dtype, M, N (out), K (in), bias, config
CASES = [
    # decode: M=1 on the GEMV path, split-K, fp16 and bf16, asymmetric g128
    (4, 128, False, False, torch.float16, 1, 96, 512, True, Config(1, 32, split_k=3, use_dot=False)),
    (4, 128, False, False, torch.bfloat16, 1, 96, 512, False, Config(1, 64, split_k=2, use_dot=False)),
    # small M through the 16-row tensor-core tile, split-K, group (64) smaller than a K tile (128)
    (4, 64, False, False, torch.float16, 5, 80, 384, True, Config(16, 32, split_k=2)),
    # group 96 (a 576-wide layer at g128): not a power of two; K not a multiple of the tile;
    # M=33 not a multiple of the row tile
    (4, 96, True, False, torch.bfloat16, 33, 48, 576, True, Config(16, 32)),
    # 8 bits, asymmetric and symmetric, M just above the decode range
    (8, 32, False, False, torch.float16, 17, 64, 320, False, Config(32, 32, split_k=2)),
    (8, 64, True, False, torch.bfloat16, 1, 72, 192, True, Config(1, 32, use_dot=False)),
    # one group per row (per channel), K=200: a ragged tile; 4-bit K=100: a ragged packed word
    (8, -1, True, False, torch.bfloat16, 3, 40, 200, False, Config(16, 32)),
    (4, -1, False, False, torch.float16, 1, 40, 100, True, Config(1, 32, use_dot=False)),
    (4, -1, False, False, torch.float16, 2, 40, 100, False, Config(16, 64)),
    # act-order checkpoints (weight_g_idx): columns permuted at load, activations per call
    (4, 32, False, True, torch.float16, 7, 64, 256, True, Config(16, 32, split_k=2)),
    (4, 32, True, True, torch.bfloat16, 1, 64, 256, False, Config(1, 32, use_dot=False)),
    (8, 64, False, True, torch.float16, 3, 48, 256, False, Config(16, 32)),
    # several row and column tiles with the grouped program order (GROUP_M=2 of 3 row tiles)
    (4, 32, False, False, torch.float16, 70, 160, 256, True, Config(32, 64, group_m=2)),
    # two K tiles per loop iteration: 3 full tiles (a pair and one more); split-K whose last split
    # ends in a partial tile; 8 bits with groups smaller than a tile
    (4, 64, False, False, torch.float16, 5, 80, 384, True, Config(16, 32, step_tiles=2)),
    (4, 64, False, False, torch.bfloat16, 9, 48, 704, False, Config(16, 64, split_k=2, step_tiles=2)),
    (8, 32, True, False, torch.float16, 16, 40, 320, True, Config(16, 32, num_stages=2, step_tiles=2)),
    (4, 32, False, True, torch.float16, 12, 40, 640, False, Config(16, 32, step_tiles=4)),  # 5 tiles: 4 + 1
    # 8 bits, group 128: an iteration's two tiles share one group (STEP_GROUP); 10 tiles in 4
    # splits of 3 would start split 1 mid-group: the launcher makes them 3 splits of 4 tiles
    (8, 128, False, False, torch.float16, 16, 40, 640, False, Config(16, 32, split_k=4, step_tiles=2)),
    # prefill row tiles (>= 64 rows): activations by TMA descriptor, zero-filled past M and K (the
    # interpreter runs the same descriptor path); act-order with split-K; 8 bits
    (4, 64, False, False, torch.float16, 70, 64, 576, True, Config(64, 32)),
    (4, 64, True, True, torch.bfloat16, 65, 32, 384, False, Config(64, 32, split_k=2)),
    (8, 64, False, False, torch.float16, 64, 32, 320, False, Config(64, 32)),
    # a row stride TMA cannot take (100 fp16 = 200 bytes): the pointer path at the same tile
    (4, -1, False, False, torch.float16, 66, 40, 100, False, Config(64, 32)),
    # 2 bits rides along (same kernel, 16 values a word)
    (2, 32, False, False, torch.float16, 3, 40, 256, True, Config(16, 32)),
]


@pytest.mark.parametrize("bits,group,sym,act_order,dtype,M,N,K,with_bias,config", CASES)
def test_kernel_matches_the_checkpoint_reference(bits, group, sym, act_order, dtype, M, N, K, with_bias, config):
    seed = hash((bits, group, sym, act_order, M, N, K)) % 10_000
    scheme = QuantScheme(bits, group, sym, actorder="group" if act_order else None)
    tensors = checkpoint_tensors(N, K, scheme, seed, act_order)
    kw = make_kernel_weight(*tensors[:3], (N, K), scheme, tensors[3])
    assert (kw.perm is not None) == act_order
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(M, K, generator=g).to(DEVICE, dtype)
    bias = torch.randn(N, generator=g).to(DEVICE, dtype) if with_bias else None
    expected = reference_output(x, tensors, (N, K), scheme, bias)
    out = qm.quant_matmul(x, kw, bias, config)
    assert out.dtype == dtype and out.shape == (M, N)
    assert_close_to_precision(out, expected, dtype)
    # the layout's own reference agrees with the checkpoint's
    assert_close_to_precision(reference_matmul(x, kw, bias), expected, dtype)


@pytest.mark.parametrize("bits,group,sym", [(4, 32, False), (8, 64, True)])
def test_dequantization_inside_the_kernel_is_exact(bits, group, sym):
    """With identity activations the output is the dequantized weight itself: in fp16 the kernel
    must reproduce quant.affine's ``(q - zero) * scale`` bit for bit (one product per output)."""
    K, N = 128, 48
    scheme = QuantScheme(bits, group, sym)
    tensors = checkpoint_tensors(N, K, scheme, seed=bits)
    kw = make_kernel_weight(*tensors[:3], (N, K), scheme)
    eye = torch.eye(K, dtype=torch.float16, device=DEVICE)
    out = qm.quant_matmul(eye, kw, None, Config(64, 64))
    expected = reference.dequantize_weight(*tensors[:3], (N, K), scheme, torch.float16).t()
    assert torch.equal(out, expected)
    for k in (0, 77):  # GEMV path: one input at a time
        assert torch.equal(qm.quant_matmul(eye[k : k + 1], kw, None, Config(1, 16, use_dot=False))[0], expected[k])


@pytest.mark.parametrize("bits,group,sym,act_order,K",
                         [(4, 64, False, False, 576), (8, 96, True, True, 576), (2, -1, False, False, 100),
                          (4, 16, True, True, 48)])
def test_layout_encodes_exactly_the_checkpoint_weight(bits, group, sym, act_order, K):
    N = 37  # odd: the checkpoint's zero points end in a partial word
    scheme = QuantScheme(bits, group, sym, actorder="group" if act_order else None)
    tensors = checkpoint_tensors(N, K, scheme, seed=K + bits, act_order=act_order)
    kw = make_kernel_weight(*tensors[:3], (N, K), scheme, tensors[3])
    assert kw.qweight.shape == (-(-K // kw.tile_k) * kw.tile_k // kw.pack, N)
    dense = reference.dequantize_weight(*tensors[:3], (N, K), scheme, torch.float32, tensors[3])
    expected = dense if kw.perm is None else dense[:, kw.perm]
    assert torch.equal(dequantize_kernel_weight(kw, torch.float32), expected)
    # padding past K packs zeros (it multiplies masked-out activations)
    q_kn = unpack(kw.qweight, bits, kw.qweight.shape[0] * kw.pack, dim=0)
    assert int((q_kn != 0).sum()) == int((kernel_weight_values(kw) != 0).sum())


def test_word_rows_of_a_column_lie_side_by_side():
    """weight_layout's memory order: rows 4 a .. 4 a + 3 of a column are one 16-byte vector."""
    words = torch.arange(32 * 3, dtype=torch.int32).view(32, 3)  # 2 tiles of 16 word rows, N = 3
    stored = interleave_word_rows(words)
    assert stored.shape == words.shape and torch.equal(word_rows(stored), words)
    start = 16 * 3 + 2 * (4 * 3) + 4 * 1  # tile 1, a = 2, column 1
    assert stored.flatten()[start : start + 4].tolist() == words[16 + 8 : 16 + 12, 1].tolist()


@pytest.mark.parametrize("M", [1, 4, 16, 17, 100])
def test_default_configurations_by_rows(M):
    """Without a forced config the path is chosen by M (no timing in the interpreter)."""
    scheme = QuantScheme(4, 128, False)
    N, K = 64, 256
    tensors = checkpoint_tensors(N, K, scheme, seed=M)
    kw = make_kernel_weight(*tensors[:3], (N, K), scheme)
    config = qm.choose_config(M, kw, torch.float16, DEVICE)  # timed on a GPU, the default in the interpreter
    assert config in qm.candidate_configs(M, kw)
    if qm.interpreting():
        assert config == qm.candidate_configs(M, kw)[0] and config.use_dot == (M > 1)
    assert all(c.split_k <= 2 for c in qm.candidate_configs(M, kw))  # 2 K tiles: no empty split
    x = torch.randn(1, M, K, generator=torch.Generator().manual_seed(M)).to(DEVICE, torch.float16)
    out = qm.quant_matmul(x, kw)
    assert out.shape == (1, M, N)
    assert_close_to_precision(out[0], reference_output(x[0], tensors, (N, K), scheme, None), torch.float16)


def test_prefill_tiles_read_activations_by_tma_where_they_can():
    """TMA takes 16-byte aligned rows; 16-row tiles, and tensors not on a Hopper-class GPU
    (here: a CPU tensor outside the interpreter), keep the pointer path."""
    x = torch.zeros(70, 576, dtype=torch.float16)
    assert qm.activations_by_tma(x, 64, interpreted=True)
    assert not qm.activations_by_tma(x, 16, interpreted=True)
    assert not qm.activations_by_tma(torch.zeros(70, 100, dtype=torch.float16), 64, interpreted=True)
    assert not qm.activations_by_tma(x[:, 1:], 64, interpreted=True)  # base 2 bytes past alignment
    assert not qm.activations_by_tma(x, 64, interpreted=False)


def test_bad_inputs_are_refused():
    scheme = QuantScheme(4, 32, False)
    kw = make_kernel_weight(*checkpoint_tensors(16, 64, scheme, seed=0)[:3], (16, 64), scheme)
    x = torch.randn(2, 64, device=DEVICE)
    with pytest.raises(TypeError, match="fp16 or bf16"):
        qm.quant_matmul(x, kw)
    with pytest.raises(ValueError, match="expects 64"):
        qm.quant_matmul(x[:, :32].half(), kw)
    with pytest.raises(ValueError, match="one row"):
        qm.quant_matmul(x.half(), kw, config=Config(1, 16, use_dot=False))
    with pytest.raises(ValueError, match="powers of two"):
        Config(16, 48)
    assert qm.quant_matmul(x[:0].half(), kw).shape == (0, 16)
    assert "3-bit" in unsupported_reason(QuantScheme(3, 32), 64)
    assert "multiple of 16" in unsupported_reason(QuantScheme(4, 40), 80)
    assert unsupported_reason(QuantScheme(4, -1), 100) is None  # per channel: any width
    uneven = torch.tensor([0, 0, 0, 1], dtype=torch.int32)  # groups of 3 and 1 where 2 are declared
    assert "equal groups" in unsupported_reason(QuantScheme(4, 16, actorder="group"), 32, uneven.repeat(8))
    with pytest.raises(ValueError, match="no kernel layout"):
        make_kernel_weight(*checkpoint_tensors(16, 64, QuantScheme(3, 32), seed=0)[:3], (16, 64), QuantScheme(3, 32))


# -- QuantLinear and checkpoints through the kernels ---------------------------------------------------


def load_layer(scheme, N, K, seed, bias=True, act_order=False):
    packed, scale, zero_packed, g_idx = checkpoint_tensors(N, K, scheme, seed, act_order)
    layer = QuantLinear(K, N, scheme, bias=bias, scale_dtype=scale.dtype)
    state = {"weight_packed": packed, "weight_scale": scale, "weight_shape": torch.tensor([N, K])}
    if zero_packed is not None:
        state["weight_zero_point"] = zero_packed
    if g_idx is not None:
        state["weight_g_idx"] = g_idx
    if bias:
        state["bias"] = torch.randn(N, generator=torch.Generator().manual_seed(seed))
    layer.load_state_dict(state)
    return layer.to(DEVICE)


def test_quant_linear_dispatches_to_the_kernels(kernels_on_cpu):
    layer = load_layer(QuantScheme(4, 32, False, actorder="group"), 48, 128, seed=3, act_order=True).half()
    x = torch.randn(2, 3, 128, generator=torch.Generator().manual_seed(4)).to(DEVICE, torch.float16)
    through_kernels = layer(x)  # chosen at first use: Triton
    assert layer.backend_name == "triton" and layer.kernel_weight().perm is not None
    layer.use_backend("reference")
    through_reference = layer(x)
    assert through_kernels.shape == (2, 3, 48)
    assert_close_to_precision(through_kernels, through_reference.float(), torch.float16)


def test_quant_linear_keeps_the_reference_where_kernels_cannot_run(kernels_on_cpu, monkeypatch):
    monkeypatch.setattr(linear_module, "_REPORTED_REFERENCE", set())  # each reason warns once per process
    layer = load_layer(QuantScheme(3, 32, True), 16, 64, seed=5, bias=False).half()
    x = torch.randn(4, 64, device=DEVICE).half()
    with pytest.warns(UserWarning, match="3-bit"):
        out = layer(x)
    assert layer.backend_name == "reference" and "3-bit" in layer.fallback_reason
    torch.testing.assert_close(out, F.linear(x, layer.dequantized_weight(torch.float16)))
    fp32 = load_layer(QuantScheme(4, 32, True), 16, 64, seed=6, bias=False)
    with pytest.warns(UserWarning, match="float32 activations"):
        fp32(torch.randn(2, 64, device=DEVICE))


@pytest.mark.parametrize("method", ["rtn", "gptq", "awq"])
def test_checkpoints_run_through_the_kernels_unchanged(tmp_path, kernels_on_cpu, method):
    """RTN, GPTQ (act-order with g_idx) and AWQ checkpoints, saved by quant and loaded by runtime,
    give the same logits through the kernels (prefill and a one-token step) as through the reference."""
    if method != "rtn":  # calibration's lockstep pass; the lent GPU machine lacks greenlet (gpu_check says so)
        pytest.importorskip("greenlet", reason="GPTQ and AWQ calibrate through greenlet, absent here")
    import runtime
    from quant import checkpoint
    from quant import checkpoint_write
    from quant.awq import AWQConfig
    from quant.plan import plan_layers
    from quant.quantize import quantize_model
    from tiny import tiny_llama

    model, tok = tiny_llama(hidden=64, layers=1)
    calib = torch.randint(0, model.config.vocab_size, (8, 32), generator=torch.Generator().manual_seed(1))
    scheme = QuantScheme(4, 32, method == "gptq", actorder="group" if method == "gptq" else None)
    plan = plan_layers(model, scheme, ["lm_head"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        quantized, _ = quantize_model(model, plan, method, samples=None if method == "rtn" else calib,
                                      awq=AWQConfig(search_samples=4), progress=False)
    path = checkpoint_write.save(model, quantized, tmp_path / method, tokenizer=tok, dtype=torch.bfloat16)
    if method == "gptq":
        assert any(k.endswith("weight_g_idx") for k in checkpoint.read_tensors(path))
    ids = torch.randint(0, model.config.vocab_size, (1, 7), generator=torch.Generator().manual_seed(2))

    m = runtime.load(path, device=DEVICE, dtype=torch.float16)
    layers = [mod for mod in m.decoder.modules() if isinstance(mod, QuantLinear)]
    hf = dict(model.named_modules())  # q/k/v and gate/up are joined at load: count weights, not modules
    assert sum(m.in_features * m.out_features for m in layers) == sum(hf[n].weight.numel() for n in plan)
    prefill, step = m.logits(ids), m.logits(ids[:, :1])
    assert all(layer.backend_name == "triton" for layer in layers)
    use_backend(m.decoder, "reference")
    ref_prefill, ref_step = m.logits(ids), m.logits(ids[:, :1])
    for got, want in ((prefill, ref_prefill), (step, ref_step)):
        scale = want.abs().max().item()
        torch.testing.assert_close(got, want, rtol=0, atol=5e-3 * scale)  # fp16 through one layer
        assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.85


# -- compiled for GPUs, without one ------------------------------------------------------------------


def test_kernels_compile_for_nvidia_gpus_without_one(triton_release):
    """The interpreter never compiles: compile to cubin for sm_90 and sm_80 under each Triton release
    CI has (ptxas ships with triton) and check what the design relies on: no per-weight
    integer-to-float conversion, and on Hopper the dequantized weight enters wgmma from registers."""
    import json
    from pathlib import Path

    cases = [
        dict(arch=90, dtype="bf16", bits=4, group=128, zero=True, split=False, block_m=128, block_n=128, num_warps=8),
        dict(arch=90, dtype="fp16", bits=4, group=128, zero=True, split=False, block_m=128, block_n=64, num_warps=4,
             tma=True),
        dict(arch=90, dtype="fp16", bits=8, group=128, zero=True, split=False, block_m=64, block_n=64, num_warps=4,
             tma=True),
        dict(arch=90, dtype="fp16", bits=8, group=32, zero=False, split=True, block_m=16, block_n=64, num_warps=4),
        dict(arch=80, dtype="bf16", bits=4, group=128, zero=False, split=False, block_m=64, block_n=128, num_warps=4),
        dict(arch=90, dtype="fp16", bits=2, group=64, zero=True, split=False, block_m=128, block_n=64, num_warps=4),
        dict(arch=80, dtype="fp16", bits=8, group=128, zero=True, split=False, block_m=16, block_n=64, num_warps=4,
             step_tiles=2),
        dict(arch=90, dtype="bf16", bits=4, group=64, zero=True, split=True, block_m=16, block_n=64, num_warps=4,
             step_tiles=2),
    ]
    run = triton_release.run([Path(__file__).with_name("kernels_aot.py"), json.dumps(cases)], timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    results = json.loads(run.stdout.strip().splitlines()[-1])
    for case, got in zip(cases, results):
        assert got["int32_to_float"] == 0, (case, got)
        assert got["shared_bytes"] <= 227 * 1024, (case, got)
        if case["arch"] == 90:
            assert got["wgmma"] and got["wgmma_first_operand"] == ["registers"], (case, got)
        else:
            assert got["mma_sync"], (case, got)
        assert (got["tma_loads"] > 0) == case.get("tma", False), (case, got)
        # fp16 or 4-bit bf16: dequantized two weights per instruction (packed fma)
        assert (got["packed_half_fma"] > 0) == (case["dtype"] == "fp16" or case["bits"] <= 4)
