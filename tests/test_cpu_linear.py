"""Quantized Linears on CPU through PyTorch's weight-only kernels (runtime/cpu_linear.py): the values
they compute against the dense reference, the codes they keep, and what falls back and why."""

import warnings

import pytest
import torch
import torch.nn.functional as F

from quant.affine import QuantScheme, choose_qparams, quantize
from quant.packing import pack
from runtime import cpu_int4_layout, cpu_int8_gemm, cpu_linear
from runtime import linear as linear_module
from runtime.linear import QuantLinear

BF16_EPS = 2.0 ** -8


@pytest.fixture(autouse=True)
def kernels_thresholds(monkeypatch):
    """These tests are about each path and its thresholds, so they run the fixed rule with the bf16
    scratch (the paths before runtime/cpu_plan.py); tests/test_cpu_plan.py covers the plan."""
    monkeypatch.setenv("LOWBIT_CPU_PLAN", "bf16")


def quant_layer(n: int, k: int, scheme: QuantScheme, seed: int, bias: bool = True, act_order: bool = False):
    """A QuantLinear loaded with a random weight rounded by quant's own math (as a checkpoint stores it)."""
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(n, k, generator=g)
    g_idx = None
    if act_order:  # columns of group j are perm[j*group : (j+1)*group]
        perm = torch.randperm(k, generator=g)
        g_idx = torch.empty(k, dtype=torch.int32)
        g_idx[perm] = (torch.arange(k) // scheme.group_size).int()
    plain = QuantScheme(scheme.bits, scheme.group_size, scheme.symmetric)
    ordered = weight if g_idx is None else weight[:, perm]
    scale, zero = choose_qparams(ordered, plain)
    q = quantize(ordered, scale, zero, plain)
    if g_idx is not None:
        q = q[:, torch.argsort(perm)]  # codes back in model column order
    state = {"weight_packed": pack(q, scheme.bits, dim=1), "weight_scale": scale,
             "weight_shape": torch.tensor([n, k])}
    if zero is not None:
        state["weight_zero_point"] = pack(zero, scheme.bits, dim=0)
    if g_idx is not None:
        state["weight_g_idx"] = g_idx
    if bias:
        state["bias"] = torch.randn(n, generator=g)
    layer = QuantLinear(k, n, scheme, bias=bias)
    layer.load_state_dict(state)
    return layer


def reference_out(layer: QuantLinear, x: torch.Tensor) -> torch.Tensor:
    """The dense reference on the bf16-rounded activations the kernels read."""
    return F.linear(x.bfloat16().float(), layer.dequantized_weight(torch.float32), layer.bias)


SCHEMES = [QuantScheme(b, g, s) for b in (2, 3, 4) for g in (32, 96, 512, -1) for s in (True, False)] + [
    QuantScheme(8, -1, True), QuantScheme(8, -1, False)]


@pytest.mark.parametrize("scheme", SCHEMES, ids=lambda s: s.describe().replace(" ", "-"))
def test_cpu_kernels_compute_the_reference_to_bf16_rounding(scheme):
    k = 960 if scheme.group_size == 96 else 1024
    layer = quant_layer(48, k, scheme, seed=scheme.bits)
    x = torch.randn(2, 5, k, generator=torch.Generator().manual_seed(1))
    layer.materialize(torch.float32)
    assert layer.backend_name == ("cpu-int8" if scheme.bits == 8 else "cpu-int4")
    out = layer(x)
    assert out.dtype == torch.float32 and out.shape == (2, 5, 48)
    ref = reference_out(layer, x)
    # bf16 output (and stored scale/zero) rounding: a few bf16 steps of the largest output
    torch.testing.assert_close(out, ref, rtol=0, atol=4 * BF16_EPS * float(ref.detach().abs().max()))
    torch.testing.assert_close(layer(x[:, :1]), ref[:, :1], rtol=0, atol=4 * BF16_EPS * float(ref.detach().abs().max()))


@pytest.mark.parametrize("bits,symmetric", [(4, False), (3, True), (2, False)])
def test_int4_slots_dequantize_to_the_reference_weight(bits, symmetric):
    """The int4 kernel's weight, read through an identity input, is the reference weight at bf16
    precision: 2/3-bit codes in 4-bit slots with the adjusted zero mean the same values, up to the
    bf16 rounding of each group's scale and zero (``- z s``: a zero code is off by a step of ``z s``)."""
    scheme = QuantScheme(bits, 64, symmetric)
    layer = quant_layer(32, 128, scheme, seed=7, bias=False)
    layer.materialize(torch.float32)
    through_kernel = layer(torch.eye(128)).t()  # [N, K]
    expected = layer.dequantized_weight(torch.float32)
    torch.testing.assert_close(through_kernel, expected, rtol=0, atol=2 * BF16_EPS * float(expected.abs().max()))


def test_the_kernel_copy_replaces_the_checkpoint_codes_which_read_back_exactly():
    layer = quant_layer(80, 256, QuantScheme(4, 64, False), seed=3)  # 80 outputs: a full block and a partial one
    stored = {k: v.clone() for k, v in layer.state_dict().items()}
    layer.materialize(torch.float32)
    assert "weight_packed" not in layer._buffers  # one packed copy in memory: the kernel's
    assert layer.backend_weight.packed.nbytes == 80 * 256 // 2
    assert torch.equal(layer.weight_packed, stored["weight_packed"])
    saved = layer.state_dict()
    assert saved.keys() == stored.keys() and all(torch.equal(saved[k], stored[k]) for k in stored)
    again = QuantLinear(256, 80, QuantScheme(4, 64, False), bias=True)
    again.load_state_dict(saved)
    again.use_backend("reference")  # exact, to compare at float32 precision
    x = torch.randn(3, 256)
    torch.testing.assert_close(again(x), F.linear(x, layer.dequantized_weight(torch.float32), layer.bias))


def test_fall_back_on_cpu_switches_to_the_exact_dense_reference():
    layer = quant_layer(64, 128, QuantScheme(4, 32, True), seed=4)
    x = torch.randn(4, 128)
    exact = F.linear(x, layer.dequantized_weight(torch.float32), layer.bias)
    layer.materialize(torch.float32)
    assert not torch.equal(layer(x), exact)  # bf16 activations
    layer.fall_back("disagreed with the reference")
    assert layer.backend_name == "reference" and layer.fallback_reason == "disagreed with the reference"
    assert [(r.name, r.reason) for r in layer.choice.rejected][1:] == [
        ("cpu-int4", "disagreed with the reference"), ("cpu-int8", "4-bit codes (this kernel takes 8 bits)")]
    layer.materialize(torch.float32)  # (at a new load: the backend it left is not chosen again)
    assert layer.backend_name == "reference"
    torch.testing.assert_close(layer(x), exact, rtol=1e-6, atol=1e-6)


def test_act_order_groups_run_the_kernel_through_a_permutation():
    layer = quant_layer(32, 256, QuantScheme(4, 64, False, actorder="group"), seed=5, act_order=True)
    x = torch.randn(3, 256)
    layer.materialize(torch.float32)
    assert layer.backend_name == "cpu-int4" and layer.backend_weight.perm is not None
    ref = reference_out(layer, x)
    torch.testing.assert_close(layer(x), ref, rtol=0, atol=4 * BF16_EPS * float(ref.detach().abs().max()))
    assert torch.equal(layer.weight_packed, quant_layer(32, 256, layer.scheme, seed=5, act_order=True).weight_packed)


def test_layers_no_kernel_takes_keep_the_reference_and_say_why_once(monkeypatch):
    monkeypatch.setattr(linear_module, "_REPORTED_REFERENCE", set())
    layers = [quant_layer(32, 128, QuantScheme(8, 32, True), seed=s) for s in range(2)]
    odd = quant_layer(40, 128, QuantScheme(4, 32, True), seed=3)  # 40 outputs: not whole int4 blocks
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for layer in layers + [odd]:
            layer.materialize(torch.float32)
    messages = [str(w.message) for w in caught]
    assert len(messages) == 2, messages  # one per reason, not one per layer
    assert "per-channel scales only" in messages[0] and "multiple of 16" in messages[1]
    for layer in layers + [odd]:
        assert layer.backend_name == "reference" and layer.fallback_reason
        x = torch.randn(2, 128)
        torch.testing.assert_close(layer(x), F.linear(x, layer.dequantized_weight(torch.float32), layer.bias))


def test_unsupported_reasons_name_what_the_kernels_refuse():
    assert cpu_linear.unsupported_reason(QuantScheme(4, 16), 256, 64) == (
        "groups of 16 inputs (the CPU int4 kernel takes multiples of 32)")
    assert "inputs not a multiple of 16" in cpu_linear.unsupported_reason(QuantScheme(8, -1), 40, 64)
    assert cpu_linear.unsupported_reason(QuantScheme(4, -1), 576, 64) is None  # per channel: 576 = 9 x 64
    assert cpu_linear.kernel_group(576) == 64 and cpu_linear.kernel_group(96) == 32


def test_int4_layout_reads_back_every_block_shape():
    assert cpu_int4_layout.int4_layout() is not None
    for n in (16, 48, 64, 112, 960):
        u = torch.randint(0, 16, (n, 64), dtype=torch.int32)
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(u, 1)
        assert torch.equal(cpu_int4_layout.unpack_int4(packed, n, 64), u.to(torch.uint8))


def test_a_loaded_checkpoint_runs_the_cpu_kernels_close_to_the_reference(tmp_path):
    import runtime
    from lowbit_testing.tiny_models import quantized_checkpoint

    path, _, _ = quantized_checkpoint("llama", tmp_path)  # W4 g32 asym, hidden 96
    kernels = runtime.load(path, cpu_kernels=True)
    reference = runtime.load(path, cpu_kernels=False)
    quantized = [m for m in kernels.decoder.modules() if isinstance(m, QuantLinear)]
    assert quantized and all(m.backend_name == "cpu-int4" and isinstance(m.backend_weight, cpu_linear.Int4Slots)
                             for m in quantized)
    ids = torch.randint(0, kernels.decoder.cfg.vocab_size, (1, 24), generator=torch.Generator().manual_seed(0))
    got, want = kernels.logits(ids), reference.logits(ids)
    assert float((got - want).abs().max()) < 0.02 * float(want.abs().max())
    tokens = [t for t in kernels.generate(ids[0].tolist(), max_new_tokens=4)]
    assert len(tokens) == 4


@pytest.mark.parametrize("bits,symmetric", [(b, s) for b in (2, 3, 4) for s in (True, False)])
@pytest.mark.parametrize("group", cpu_linear.INT4_GROUPS)
def test_prefill_scratch_weight_is_the_kernels_weight(bits, symmetric, group):
    """From DEQUANTIZE_ROWS rows an int4 layer runs a dense bf16 matmul on its dequantized weight: that
    weight is the kernel's (read through an identity input) and both paths agree below and above."""
    act_order = group == 64
    layer = quant_layer(128, 512, QuantScheme(bits, group, symmetric, actorder="group" if act_order else None),
                        seed=bits + group, bias=False, act_order=act_order)
    layer.materialize(torch.float32)
    slots = layer.backend_weight
    assert (slots.perm is not None) == act_order
    eye = torch.eye(512, dtype=torch.bfloat16)
    through_kernel = torch.ops.aten._weight_int4pack_mm_for_cpu(eye, slots.packed, slots.group, slots.scale_zeros)
    torch.testing.assert_close(slots.dequantized(), through_kernel.t(), rtol=2 * BF16_EPS, atol=0)
    threshold = slots.dequantize_rows()
    for rows in (threshold - 1, threshold, 3 * threshold):
        x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(rows))
        a = x.bfloat16() if slots.perm is None else x.bfloat16().index_select(1, slots.perm)
        kernel = torch.ops.aten._weight_int4pack_mm_for_cpu(a, slots.packed, slots.group, slots.scale_zeros).float()
        torch.testing.assert_close(layer(x), kernel, rtol=0, atol=4 * BF16_EPS * float(kernel.abs().max()))


def test_a_partial_block_of_outputs_keeps_the_kernel_at_prefill_without_the_native_dequantizer(monkeypatch):
    """80 outputs: a full block and a partial one, which the PyTorch scratch path does not read."""
    monkeypatch.setenv("LOWBIT_NATIVE", "0")
    layer = quant_layer(80, 256, QuantScheme(4, 64, False), seed=9)
    layer.materialize(torch.float32)
    assert not layer.backend_weight.scratch_ok
    x = torch.randn(cpu_linear.DEQUANTIZE_ROWS, 256)  # the PyTorch path's threshold
    ref = reference_out(layer, x)
    torch.testing.assert_close(layer(x), ref, rtol=0, atol=4 * BF16_EPS * float(ref.detach().abs().max()))


@pytest.mark.parametrize("symmetric", [True, False])
def test_int8_prefill_scratch_agrees_with_the_kernel(symmetric):
    layer = quant_layer(48, 256, QuantScheme(8, -1, symmetric), seed=11, bias=False)
    layer.materialize(torch.float32)
    w = layer.backend_weight
    for rows in (cpu_linear.INT8_DEQUANTIZE_ROWS - 1, cpu_linear.INT8_DEQUANTIZE_ROWS, cpu_int8_gemm.MAX_ROWS + 1):
        x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(rows))
        a = x.bfloat16()
        kernel = torch.ops.aten._weight_int8pack_mm(a, w.q, w.scales).float()
        if w.zero_scales is not None:
            kernel = kernel - a.float().sum(-1, keepdim=True) * w.zero_scales.float()
        torch.testing.assert_close(layer(x), kernel, rtol=0, atol=4 * BF16_EPS * float(kernel.abs().max()))


def test_the_int8_scratch_is_reused_and_exact():
    layer = quant_layer(48, 256, QuantScheme(8, -1, True), seed=12, bias=False)
    layer.materialize(torch.float32)
    rows = max(cpu_linear.INT8_DEQUANTIZE_ROWS, cpu_int8_gemm.MAX_ROWS + 1)  # past lowbit's AMX matmul's rows
    layer(torch.randn(rows, 256))
    buffer = cpu_linear._SCRATCH.weight
    assert buffer is not None and buffer.numel() >= 48 * 256
    x = torch.randn(rows, 256)
    assert torch.equal(layer(x), F.linear(x.bfloat16(), layer.backend_weight.q.bfloat16()).mul(layer.backend_weight.scales).float())
    assert cpu_linear._SCRATCH.weight is buffer  # no new allocation for a layer no larger


def test_the_scratch_grows_to_the_largest_layer_and_is_one_buffer():
    small = cpu_linear.scratch(4, 8)
    big = cpu_linear.scratch(64, 32)
    assert big.shape == (64, 32) and cpu_linear._SCRATCH.weight.numel() >= 64 * 32
    again = cpu_linear.scratch(8, 4)
    assert again.data_ptr() == big.data_ptr()  # the smaller layer reuses the grown buffer
    assert small.dtype == big.dtype == torch.bfloat16


def test_a_scratch_grown_under_inference_mode_is_written_outside_it(monkeypatch):
    """A prefill under inference_mode grows it; a later forward under no_grad writes it again."""
    monkeypatch.setattr(cpu_linear._SCRATCH, "weight", None)
    layer = quant_layer(64, 256, QuantScheme(4, 64, False), seed=13, bias=False)
    layer.materialize(torch.float32)
    x = torch.randn(2 * cpu_linear.DEQUANTIZE_ROWS, 256)
    with torch.inference_mode():
        first = layer(x)
    with torch.no_grad():
        assert torch.equal(layer(x), first)
        cpu_linear.scratch(64, 64).copy_(torch.ones(64, 64))


# ---------------------------------------------------------------- the native dequantizer (runtime/native)

LAYOUTS = [cpu_int4_layout.Int4Layout(b, h) for b in (64, 32) for h in (True, False)]


def native_weights():
    module = cpu_linear._native_weights()
    if module is None:  # tests/test_native.py fails where a compiler exists and the build does not
        pytest.skip("runtime/native/int4_weights.cpp is not built here")
    return module


def random_slots(n: int, k: int, group: int, layout: cpu_int4_layout.Int4Layout, seed: int):
    """Int4Slots packed in ``layout`` (any of the orders torch uses on some CPU) and its nibbles [N, K]."""
    g = torch.Generator().manual_seed(seed)
    u = torch.randint(0, 16, (n, k), dtype=torch.int32, generator=g)
    scale_zeros = (torch.randn(k // group, n, 2, generator=g) * torch.logspace(-4, 1, n)[:, None]).bfloat16()
    return cpu_linear.Int4Slots(layout.pack(u), scale_zeros, group, None, 4), u


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda l: f"{l.block_n}-{'halves' if l.halves else 'pairs'}")
@pytest.mark.parametrize("group", cpu_linear.INT4_GROUPS)
def test_native_dequantizer_is_the_pytorch_path_bit_for_bit(layout, group):
    module = native_weights()
    slots, _ = random_slots(192, 512, group, layout, seed=group)
    out = torch.empty(512, 192, dtype=torch.bfloat16)
    module.dequantize_int4(slots.packed, slots.scale_zeros, group, layout.block_n, layout.halves, out)
    reference = slots._dequantized_by_torch(layout, torch.empty(512, 192, dtype=torch.bfloat16))
    assert torch.equal(out.t(), reference)


@pytest.mark.parametrize("n", [16, 32, 48, 80, 1104])  # partial last blocks; 1104: past one chunk of 1024
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda l: f"{l.block_n}-{'halves' if l.halves else 'pairs'}")
def test_native_dequantizer_reads_partial_blocks(n, layout):
    module = native_weights()
    slots, u = random_slots(n, 128, 32, layout, seed=n)
    out = torch.empty(128, n, dtype=torch.bfloat16)
    module.dequantize_int4(slots.packed, slots.scale_zeros, 32, layout.block_n, layout.halves, out)
    sz = slots.scale_zeros.float().repeat_interleave(32, 0)  # [K, N, 2]
    expected = (u.t().float() * sz[..., 0] + (sz[..., 1] - 8 * sz[..., 0])).bfloat16()  # one rounding
    assert torch.equal(out, expected)


def test_native_dequantizer_splits_rows_across_threads_mid_group():
    """7 groups of 32 rows over 2 threads: a thread's range ends inside a group."""
    module, layout = native_weights(), cpu_int4_layout.int4_layout()
    slots, _ = random_slots(128, 224, 32, layout, seed=1)
    outs = []
    threads = torch.get_num_threads()
    try:
        for t in (1, 2, 3):
            torch.set_num_threads(t)
            outs.append(slots.dequantized(torch.empty(224, 128, dtype=torch.bfloat16)))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


def test_native_dequantizer_refuses_wrong_buffers():
    module, layout = native_weights(), cpu_int4_layout.int4_layout()
    slots, _ = random_slots(64, 128, 32, layout, seed=2)
    with pytest.raises(RuntimeError, match="out: a contiguous bf16 \\[K, N\\]"):
        module.dequantize_int4(slots.packed, slots.scale_zeros, 32, layout.block_n, layout.halves,
                               torch.empty(64, 128, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="scale_zeros"):
        module.dequantize_int4(slots.packed, slots.scale_zeros.float(), 32, layout.block_n, layout.halves,
                               torch.empty(128, 64, dtype=torch.bfloat16))


def test_prefill_with_and_without_the_native_dequantizer_scores_the_same_perplexity(tmp_path, monkeypatch):
    """A W4 checkpoint's perplexity on the CPU kernels, windows long enough for the scratch path on both
    sides: native dequantizer against LOWBIT_NATIVE=0 (the PyTorch ops, the kernel for partial blocks)
    and the dense reference."""
    import runtime
    from evals.perplexity import Protocol, perplexity
    from lowbit_testing.tiny_models import quantized_checkpoint

    native_weights()
    path, _, _ = quantized_checkpoint("llama", tmp_path)
    ids = torch.randint(0, 200, (1024,), generator=torch.Generator().manual_seed(3))
    protocol = Protocol(window=cpu_linear.DEQUANTIZE_ROWS + 16, stride=128, tokens=1024)

    def score(**load) -> float:
        model = runtime.load(path, **load)
        return perplexity(model.logits, ids, protocol, progress=False).ppl

    monkeypatch.setattr(cpu_linear._SCRATCH, "weight", None)
    native = score(cpu_kernels=True)
    assert cpu_linear._SCRATCH.weight is not None  # the windows ran the scratch path
    reference = score(cpu_kernels=False)
    monkeypatch.setenv("LOWBIT_NATIVE", "0")
    pytorch = score(cpu_kernels=True)
    assert abs(native / reference - 1) < 2e-3 and abs(native / pytorch - 1) < 2e-3, (native, pytorch, reference)


def record_results(module, name: str, monkeypatch) -> list:
    """Every result of ``module.name`` from now on (None: it declined and the caller fell back)."""
    results, real = [], getattr(module, name)
    monkeypatch.setattr(module, name, lambda *a, **k: results.append(real(*a, **k)) or results[-1])
    return results


def assert_bf16_close(y: torch.Tensor, ref: torch.Tensor) -> None:
    """Equal to a few bf16 steps of the largest output (bf16 outputs, stored scales and zeros)."""
    torch.testing.assert_close(y, ref, rtol=0, atol=4 * BF16_EPS * float(ref.abs().max()))


@pytest.mark.parametrize("rows", [1, 8, 40])
def test_few_rows_run_lowbits_matmul_where_built_and_agree_with_aten(rows, monkeypatch):
    """Decode and short prompts go through runtime/cpu_int4_gemm on this CPU when it takes them (AMX /
    AVX512-BF16), else aten's kernel; both read the same bytes and agree to bf16 rounding."""
    from runtime import cpu_int4_gemm

    layer = quant_layer(96, 512, QuantScheme(4, 64, False), seed=5)
    layer.materialize(torch.float32)
    x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(2))
    entry = "linear" if rows < cpu_linear.NATIVE_DEQUANTIZE_ROWS else "matmul"  # decode's rows: one call from x
    served = record_results(cpu_int4_gemm, entry, monkeypatch)
    out = layer(x)
    if cpu_int4_gemm.best_path() in ("avx512", "amx") and rows < cpu_linear.Int4Slots.dequantize_rows():
        assert served and (served[-1] is not None) == (rows >= cpu_int4_gemm.MIN_ROWS)
        # the decode call is the bf16 product of x.to(bf16), widened: equal to converting around matmul
        a = x.to(cpu_linear.ACTIVATIONS)
        w = layer.backend_weight
        before = cpu_int4_gemm.matmul(a, w.packed, w.group, w.scale_zeros,
                                      cpu_int4_layout.int4_layout()).float() + layer.bias
        assert torch.equal(out, before)
        assert w.dequantize_rows() == (cpu_linear.AMX_DEQUANTIZE_ROWS if cpu_int4_gemm.best_path() == "amx"
                                                else cpu_linear.NATIVE_DEQUANTIZE_ROWS)
    monkeypatch.setenv("LOWBIT_NATIVE", "0")
    aten = layer(x)
    assert served[-1] is None  # switched off: aten's kernel ran
    ref = reference_out(layer, x).detach()
    for y in (out, aten):
        assert_bf16_close(y, ref)


@pytest.mark.parametrize("rows", [2, 8, 100])
@pytest.mark.parametrize("symmetric", [True, False])
def test_w8_rows_run_lowbits_amx_matmul_where_built_and_agree_with_the_reference(rows, symmetric, monkeypatch):
    from runtime import cpu_int8_gemm

    layer = quant_layer(96, 512, QuantScheme(8, -1, symmetric), seed=6)
    layer.materialize(torch.float32)
    x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(3))
    served = record_results(cpu_int8_gemm, "matmul", monkeypatch)
    out = layer(x)
    # from INT8_DEQUANTIZE_ROWS the scratch, unless lowbit's AMX matmul takes the rows
    amx = cpu_int8_gemm.best_path() == "amx" and rows <= cpu_int8_gemm.MAX_ROWS
    assert bool(served) == (rows >= cpu_int8_gemm.AMX_MIN_ROWS and (rows < cpu_linear.INT8_DEQUANTIZE_ROWS or amx))
    monkeypatch.setenv("LOWBIT_NATIVE", "0")
    fallback = layer(x)
    ref = reference_out(layer, x).detach()
    for y in (out, fallback):
        assert_bf16_close(y, ref)
