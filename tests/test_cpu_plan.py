"""The CPU plan (runtime/cpu_plan.py): which path a CPU Linear runs for a prefill's rows, from timings
(faked here: the choice, the float bar, the cache) and from the capability rule; and every path's
values against the reference, through the real kernels."""

import json

import pytest
import torch
import torch.nn.functional as F

from quant.affine import QuantScheme
from runtime import cpu_int4_gemm, cpu_linear, cpu_plan
from runtime.cpu_int4_layout import int4_layout
from runtime.cpu_plan import BF16, FP32, KERNEL
from runtime.linear import plan_keys
from tests.test_cpu_linear import BF16_EPS, quant_layer, reference_out

BIG = (512, 512)  # at MIN_TIMED_WEIGHTS or more: planned by timing


@pytest.fixture(autouse=True)
def fresh_plan(tmp_path, monkeypatch):
    """Each test its own cache folder and an empty per-process plan, in the measuring mode; quantized
    Linears on the CPU kernels (tests/conftest.py switches them off for the rest of the suite)."""
    monkeypatch.setenv("LOWBIT_CPU_KERNELS", "1")
    monkeypatch.setenv(cpu_plan.CACHE_ENV, str(tmp_path / "plans"))
    monkeypatch.delenv(cpu_plan.MODE_ENV, raising=False)
    monkeypatch.setattr(cpu_plan, "_PLANS", {})
    assert BIG[0] * BIG[1] >= cpu_plan.MIN_TIMED_WEIGHTS


class FakeTimer:
    """Times per candidate (and ``bar``) by rows, counting calls; runs nothing."""

    def __init__(self, by_rows: dict[int, dict[str, float]]):
        self.by_rows, self.calls = by_rows, 0

    def __call__(self, runs, floors=None):
        self.calls += 1
        rows = cpu_plan.BUCKETS[(self.calls - 1) % len(cpu_plan.BUCKETS)].rows
        return {name: self.by_rows[rows][name] for name in runs}, set()


def cpu_weight(layer):
    """The CPU kernels' weight of a loaded (not yet materialized) layer, built from its checkpoint
    buffers as the layer builds its own (same bytes: the same products, bit for bit)."""
    return cpu_linear.build(layer.weight_packed, layer.weight_scale, getattr(layer, "weight_zero_point", None),
                            (layer.out_features, layer.in_features), layer.scheme, getattr(layer, "weight_g_idx", None))


def timer(kernel, bf16, fp32, bar, narrow=False):
    times = {BF16: bf16, FP32: fp32, "bar": bar} | ({} if narrow else {KERNEL: kernel})
    return FakeTimer({b.rows: times for b in cpu_plan.BUCKETS})


def test_the_plan_picks_the_fastest_candidate():
    assert cpu_plan.pick({KERNEL: 3.0, BF16: 1.0, FP32: 2.0}, bar=2.5) == BF16
    assert cpu_plan.pick({KERNEL: 0.5, BF16: 1.0, FP32: 2.0}, bar=2.5) == KERNEL


def test_no_candidate_slower_than_the_float_bar_beats_the_float32_scratch_within_the_margin():
    # the bf16 GEMM of an AVX2-only CPU: slower than the float model's product, a little faster than fp32
    assert cpu_plan.pick({KERNEL: 9.0, BF16: 1.05, FP32: 1.1}, bar=1.0) == FP32
    # every path slower than the bar, bf16 clearly faster than the float32 scratch: bf16
    assert cpu_plan.pick({KERNEL: 9.0, BF16: 1.2, FP32: 2.0}, bar=1.0) == BF16
    # under the bar wins over a faster-looking float32 scratch never: fp32 is above the bar by construction
    assert cpu_plan.pick({KERNEL: 0.9, BF16: 3.0, FP32: 1.2}, bar=1.0) == KERNEL
    # a candidate only bounded at these rows (not timed: hopeless at fewer rows) is not picked
    assert cpu_plan.pick({KERNEL: 1.3, BF16: 9.0, FP32: 1.35}, bar=1.0, bounds={FP32}) == KERNEL


def test_measured_entries_record_the_times_and_the_bar(monkeypatch):
    fake = timer(kernel=5.0, bf16=4.0, fp32=2.2, bar=2.0)
    monkeypatch.setattr(cpu_plan, "TIMER", fake)
    plan = cpu_plan.plan_for("int4", *BIG, 64)
    assert fake.calls == len(cpu_plan.BUCKETS)
    for b in cpu_plan.BUCKETS:
        e = plan[b.name]
        assert e.path == FP32 and e.bar_ms == 2.0 and e.times_ms == {KERNEL: 5.0, BF16: 4.0, FP32: 2.2}
        assert e.over_bar == pytest.approx(1.1) and e.rows == b.rows and e.timed_shape == BIG


def test_the_plan_is_kept_on_disk_and_read_back_by_a_later_process(monkeypatch, tmp_path):
    monkeypatch.setattr(cpu_plan, "TIMER", timer(kernel=5.0, bf16=1.0, fp32=2.2, bar=2.0))
    first = cpu_plan.plan_for("int8", *BIG, 0)
    files = list((tmp_path / "plans").glob("*.json"))
    assert len(files) == 1
    body = json.loads(files[0].read_text())
    assert body["machine"]["threads"] == torch.get_num_threads() and body["machine"]["torch"] == torch.__version__
    assert body["machine"]["cpu"] == cpu_plan.cpu_info()[0]
    monkeypatch.setattr(cpu_plan, "_PLANS", {})  # a new process

    def no_timing(runs):
        raise AssertionError("timed again although the cache holds the plan")

    monkeypatch.setattr(cpu_plan, "TIMER", no_timing)
    again = cpu_plan.plan_for("int8", *BIG, 0)
    assert again == first and again["128+"].path == BF16


def test_another_thread_count_or_cpu_is_timed_afresh_into_its_own_file(monkeypatch, tmp_path):
    fake = timer(kernel=5.0, bf16=1.0, fp32=2.2, bar=2.0)
    monkeypatch.setattr(cpu_plan, "TIMER", fake)
    cpu_plan.plan_for("int4", *BIG, 64)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(threads + 1)
        cpu_plan.plan_for("int4", *BIG, 64)
    finally:
        torch.set_num_threads(threads)
    assert fake.calls == 2 * len(cpu_plan.BUCKETS)
    monkeypatch.setattr(cpu_plan, "_static_machine", lambda: (("cpu", "Another CPU"), ("torch", torch.__version__)))
    cpu_plan.plan_for("int4", *BIG, 64)
    assert fake.calls == 3 * len(cpu_plan.BUCKETS)
    assert len(list((tmp_path / "plans").glob("*.json"))) == 3


def test_a_cache_file_of_another_key_or_corrupt_is_ignored_and_rewritten(monkeypatch, tmp_path):
    monkeypatch.setattr(cpu_plan, "TIMER", timer(kernel=5.0, bf16=1.0, fp32=2.2, bar=2.0))
    path = cpu_plan._file(cpu_plan.machine())
    path.parent.mkdir(parents=True)
    path.write_text("{not json")
    with pytest.warns(UserWarning, match="ignored"):
        cpu_plan.plan_for("int4", *BIG, 64)
    assert json.loads(path.read_text())["entries"]


def test_cache_off_writes_nothing_and_the_plan_lives_per_process(monkeypatch, tmp_path):
    monkeypatch.setenv(cpu_plan.CACHE_ENV, "0")
    fake = timer(kernel=5.0, bf16=1.0, fp32=2.2, bar=2.0)
    monkeypatch.setattr(cpu_plan, "TIMER", fake)
    cpu_plan.plan_for("int4", *BIG, 64)
    cpu_plan.plan_for("int4", *BIG, 64)
    assert fake.calls == len(cpu_plan.BUCKETS) and not (tmp_path / "plans").exists()


def test_shapes_cut_to_the_same_timed_shape_share_one_timing(monkeypatch):
    fake = timer(kernel=5.0, bf16=1.0, fp32=2.2, bar=2.0)
    monkeypatch.setattr(cpu_plan, "TIMER", fake)
    k = 2048
    cut = cpu_plan.timed_shape(16384, k)
    assert cut[0] * k <= cpu_plan.TIMED_WEIGHTS and cut[0] % cpu_plan.TIMED_BLOCK == 0
    cpu_plan.plan_for("int4", 3072, k, 32)
    cpu_plan.plan_for("int4", 16384, k, 32)
    assert fake.calls == len(cpu_plan.BUCKETS)


@pytest.mark.parametrize("fast", [True, False])
def test_the_skip_option_gives_the_capability_rule_without_timing(monkeypatch, fast):
    monkeypatch.setenv(cpu_plan.MODE_ENV, "rule")
    monkeypatch.setattr(cpu_plan, "fast_bf16", lambda: fast)
    monkeypatch.setattr(cpu_plan, "TIMER", lambda runs: pytest.fail("timed under the rule"))
    scratch = BF16 if fast else FP32
    assert cpu_plan.path("int4", *BIG, 64, 300, threshold_reached=True) == scratch
    assert cpu_plan.path("int4", *BIG, 64, 12, threshold_reached=False) == KERNEL
    assert cpu_plan.path("narrow", *BIG, 0, 300, threshold_reached=True) == scratch
    assert cpu_plan.keeps_narrow(*BIG) is fast


def test_fast_bf16_reads_the_cpu_flags_and_the_isa_limits(monkeypatch):
    monkeypatch.setattr(cpu_plan, "cpu_info", lambda: ("x", frozenset({"avx2", "avx512f"})))
    assert not cpu_plan.fast_bf16()
    monkeypatch.setattr(cpu_plan, "cpu_info", lambda: ("x", frozenset({"avx512f", "avx512_bf16"})))
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    monkeypatch.delenv("DNNL_MAX_CPU_ISA", raising=False)
    assert cpu_plan.fast_bf16()
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")  # the AVX2 emulation
    assert not cpu_plan.fast_bf16()
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_BF16")
    assert cpu_plan.fast_bf16()
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    assert not cpu_plan.fast_bf16()


def test_an_unknown_mode_is_refused_with_the_choices(monkeypatch):
    monkeypatch.setenv(cpu_plan.MODE_ENV, "fastest")
    with pytest.raises(ValueError, match="measure, rule, bf16, fp32"):
        cpu_plan.mode()


def test_float_leftovers_stay_bf16_only_where_their_product_keeps_up_with_float32(monkeypatch):
    monkeypatch.setattr(cpu_plan, "TIMER", timer(None, bf16=3.0, fp32=1.3, bar=1.0, narrow=True))
    assert not cpu_plan.keeps_narrow(*BIG)  # an AVX2-only CPU: float32 weights
    monkeypatch.setattr(cpu_plan, "_PLANS", {})
    monkeypatch.setenv(cpu_plan.CACHE_ENV, "0")
    monkeypatch.setattr(cpu_plan, "TIMER", timer(None, bf16=0.5, fp32=1.3, bar=1.0, narrow=True))
    assert cpu_plan.keeps_narrow(*BIG)


def test_decode_rows_are_never_timed_and_stay_on_the_kernels(monkeypatch):
    monkeypatch.setattr(cpu_plan, "TIMER", lambda runs: pytest.fail("decode timed"))
    for rows in range(1, cpu_plan.DECODE_ROWS + 1):
        assert cpu_plan.path("int4", *BIG, 64, rows, threshold_reached=False) == KERNEL
        assert cpu_plan.path("narrow", *BIG, 0, rows, threshold_reached=True) == BF16


def test_a_hopeless_candidate_is_timed_twice_and_not_at_all_where_fewer_rows_bound_it(monkeypatch):
    monkeypatch.setattr(cpu_plan, "_call_ms", lambda run: run())
    monkeypatch.setattr(cpu_plan, "SETTLE_MS", 0.0)  # exactly ``repeats`` rounds
    calls = {"bar": 0, BF16: 0, FP32: 0}

    def run(name, ms):
        return lambda: calls.__setitem__(name, calls[name] + 1) or ms

    times, bounds = cpu_plan.time_paths({"bar": run("bar", 1.0), BF16: run(BF16, 40.0), FP32: run(FP32, 1.2)},
                                        repeats=3)
    assert times == {"bar": 1.0, BF16: 40.0, FP32: 1.2} and bounds == set()
    assert calls == {"bar": 4, BF16: 2, FP32: 4}  # one call may meet a busy machine: bf16 gets a second
    times, bounds = cpu_plan.time_paths({"bar": run("bar", 4.0), BF16: run(BF16, 160.0), FP32: run(FP32, 4.5)},
                                        floors={BF16: 40.0, FP32: 1.2}, repeats=3)
    assert times[BF16] == 40.0 and bounds == {BF16} and calls[BF16] == 2  # its floor already 9x fp32's time
    # however slow their floors, the candidate with the lowest is timed (a spike at fewer rows prunes no more)
    times, bounds = cpu_plan.time_paths({"bar": run("bar", 1.0), BF16: run(BF16, 2.0), FP32: run(FP32, 1.2)},
                                        floors={BF16: 30.0, FP32: 20.0}, repeats=3)
    assert times == {"bar": 1.0, BF16: 30.0, FP32: 1.2} and bounds == {BF16}


def test_cheap_calls_are_repeated_until_the_bucket_settles(monkeypatch):
    monkeypatch.setattr(cpu_plan, "_call_ms", lambda run: run())
    calls = []
    cpu_plan.time_paths({"bar": lambda: calls.append(1) or 1.0}, repeats=3)
    assert len(calls) == 1 + cpu_plan.MAX_REPEATS  # 1 ms calls: 20 rounds do not reach SETTLE_MS


def test_a_real_timing_runs_every_candidate_and_the_bar():
    plan = cpu_plan.plan_for("int4", *BIG, 64)
    assert set(plan) == {b.name for b in cpu_plan.BUCKETS}
    for e in plan.values():
        assert set(e.times_ms) == {KERNEL, BF16, FP32} and e.bar_ms > 0 and e.path in e.times_ms


# ---------------------------------------------------------------- every path's values (the real kernels)

ROWS = (12, 40, 200)


@pytest.mark.parametrize("scheme", [QuantScheme(4, 64, False), QuantScheme(4, 32, True), QuantScheme(3, 128, False),
                                    QuantScheme(4, 64, False, actorder="group")], ids=lambda s: s.describe())
def test_every_int4_path_computes_the_reference(scheme):
    layer = quant_layer(192, 512, scheme, seed=5, bias=False, act_order=scheme.actorder is not None)
    slots = cpu_weight(layer)
    assert slots.scratch_ok
    kernel_weight = slots._dequantized_by_torch(int4_layout(), torch.empty(512, 192))  # [N, K], PyTorch's, float32
    if slots.perm is not None:
        kernel_weight = kernel_weight[:, torch.argsort(slots.perm)]
    for rows in ROWS:
        x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(rows))
        want = reference_out(layer, x)
        for path in slots.paths:
            got = slots.product(x, path).float()
            torch.testing.assert_close(got, want, rtol=0, atol=4 * BF16_EPS * float(want.abs().max()))
        # float32: the float32 weight (native dequantizer) and unrounded activations: sgemm's rounding only
        torch.testing.assert_close(slots.product(x, FP32), F.linear(x, kernel_weight), rtol=1e-5, atol=1e-4)
        assert slots.product(x, FP32).dtype == torch.float32 and slots.product(x, BF16).dtype == torch.bfloat16


@pytest.mark.parametrize("symmetric", [True, False])
def test_every_int8_path_computes_the_reference(symmetric):
    layer = quant_layer(64, 256, QuantScheme(8, -1, symmetric), seed=6, bias=False)
    w = cpu_weight(layer)
    for rows in ROWS:
        x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(rows))
        want = reference_out(layer, x)
        for path in w.paths:
            torch.testing.assert_close(w.product(x, path).float(), want, rtol=0,
                                       atol=4 * BF16_EPS * float(want.abs().max()))
        exact = F.linear(x, w.q.float() * w.scales.float()[:, None])
        if w.zero_scales is not None:
            exact = exact - x.sum(-1, keepdim=True) * w.zero_scales.float()
        torch.testing.assert_close(w.product(x, FP32), exact, rtol=1e-5, atol=1e-4)


def test_both_narrow_paths_compute_the_float_product_and_widen_in_pieces(monkeypatch):
    g = torch.Generator().manual_seed(7)
    linear = torch.nn.Linear(128, 300, bias=True)
    linear.weight = torch.nn.Parameter(torch.randn(300, 128, generator=g).bfloat16(), requires_grad=False)
    linear.bias = torch.nn.Parameter(torch.randn(300, generator=g), requires_grad=False)
    narrow = cpu_linear.NarrowLinear(linear)
    x = torch.randn(40, 128, generator=g)
    exact = F.linear(x, linear.weight.float())
    bf16 = narrow.product(x, BF16).float()
    torch.testing.assert_close(bf16, exact, rtol=0, atol=4 * BF16_EPS * float(exact.abs().max()))
    whole = narrow.product(x, FP32)
    monkeypatch.setattr(cpu_linear.NarrowLinear, "WIDEN_WEIGHTS", 128 * 7)  # 7 outputs a piece
    pieces = narrow.product(x, FP32)
    torch.testing.assert_close(whole, exact, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(pieces, whole, rtol=1e-5, atol=1e-5)  # sgemm blocks the pieces its own way


def forced_paths(monkeypatch, path: str):
    """Every timed entry picks ``path`` (the bar above every candidate: the fastest is picked)."""
    times = {KERNEL: 1.0, BF16: 1.0, FP32: 1.0}
    times[path] = 0.5
    monkeypatch.setattr(cpu_plan, "TIMER", timer(times[KERNEL], times[BF16], times[FP32], bar=0.75))


@pytest.mark.parametrize("path", [KERNEL, BF16, FP32])
def test_a_layer_runs_the_planned_path(monkeypatch, path):
    forced_paths(monkeypatch, path)
    layer = quant_layer(*BIG, QuantScheme(4, 64, False), seed=8, bias=True)
    slots = cpu_weight(layer)
    layer.materialize(torch.float32)
    assert layer.on_cpu_kernel
    for rows in (16, 300):
        x = torch.randn(rows, BIG[1], generator=torch.Generator().manual_seed(rows))
        want = slots.product(x, path).float() + layer.bias
        assert torch.equal(layer(x), want)


def test_the_forced_bf16_mode_is_the_path_before_the_plan_bit_for_bit(monkeypatch):
    """LOWBIT_CPU_PLAN=bf16 (what the benches time as "before"): the scratch from the kernels' own
    threshold, a bf16 F.linear on the bf16 dequantized weight, as before the plan."""
    monkeypatch.setenv(cpu_plan.MODE_ENV, "bf16")
    layer = quant_layer(*BIG, QuantScheme(4, 64, False), seed=9, bias=False)
    slots = cpu_weight(layer)
    layer.materialize(torch.float32)
    rows = max(slots.dequantize_rows(), cpu_linear.NATIVE_DEQUANTIZE_ROWS)
    x = torch.randn(rows, BIG[1])
    assert torch.equal(layer(x), F.linear(x.bfloat16(), slots.dequantized()).float())


def test_decode_rows_give_the_kernels_bits_whatever_the_plan(monkeypatch):
    forced_paths(monkeypatch, FP32)
    layer = quant_layer(*BIG, QuantScheme(4, 32, True), seed=10, bias=False)
    slots = cpu_weight(layer)
    layer.materialize(torch.float32)
    for rows in (1, 4, cpu_plan.DECODE_ROWS):
        x = torch.randn(rows, BIG[1])
        a = x.bfloat16()
        want = cpu_int4_gemm.linear(x, slots.packed, slots.group, slots.scale_zeros, int4_layout())
        if want is None:
            want = torch.ops.aten._weight_int4pack_mm_for_cpu(a, slots.packed, slots.group, slots.scale_zeros).float()
        assert torch.equal(layer(x), want)


def test_doctor_table_names_each_shape_bucket_path_and_the_bar(monkeypatch):
    monkeypatch.setattr(cpu_plan, "TIMER", timer(kernel=5.0, bf16=4.0, fp32=2.2, bar=2.0))
    decoder = torch.nn.Sequential(quant_layer(*BIG, QuantScheme(4, 64, False), seed=11),
                                  quant_layer(*BIG, QuantScheme(4, 64, True), seed=12))
    for m in decoder:
        m.materialize(torch.float32)
    rows = cpu_plan.table_rows(plan_keys(decoder))
    assert [r["rows"] for r in rows] == [f"1-{cpu_plan.DECODE_ROWS}"] + [b.name for b in cpu_plan.BUCKETS]
    assert rows[0]["path"] == KERNEL and all(r["path"] == FP32 and r["bar_ms"] == 2.0 for r in rows[1:])
    text = cpu_plan.table_text(rows)
    assert "512x512" in text and "2.00 ms" in text and "fp32 2.20" in text
