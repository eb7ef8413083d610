"""Tuning the quantized matmul at first use (runtime/kernels/matmul_tuning.py), on CPU: candidates
that fail to compile or launch are skipped with their reasons, and named when none runs; the timed
winner is checked against the reference before it is used, and a wrong one gives way, with one
warning, to the next fastest that passes. The GPU's timer is replaced at its seam (``time_ms``) and
the launches by a stand-in that computes the reference or fails on purpose; the last test runs the
real kernels (the Triton interpreter) through the check."""

import warnings

import pytest
import torch
import torch.nn.functional as F

from kernel_device import DEVICE  # noqa: F401 (sets TRITON_INTERPRET before triton is imported)

from quant.affine import QuantScheme, choose_qparams, quantize  # noqa: E402
from quant.packing import pack  # noqa: E402
from runtime.linear_backends import triton as triton_backend  # noqa: E402
from runtime.kernels import matmul_tuning as tuning  # noqa: E402
from runtime.kernels import quant_matmul as qm  # noqa: E402
from runtime.kernels.matmul_configs import MatmulConfig, candidate_configs  # noqa: E402
from runtime.kernels.weight_layout import dequantize_kernel_weight, make_kernel_weight  # noqa: E402
from runtime.tolerances import SELF_CHECK_ENV, Mismatch, compare  # noqa: E402
from test_selfcheck import IDS, checkpoint  # noqa: E402, F401 (a tiny W4 checkpoint: the fixture)

N, K = 600, 128  # more outputs than the check reads (both ends of 256)
qm_launch = qm.launch  # the real launch, for stand-ins that count launches and then run it
FAST, MIDDLE, SLOW = MatmulConfig(16, 64), MatmulConfig(16, 32), MatmulConfig(32, 64)


@pytest.fixture(autouse=True)
def no_known_failures(monkeypatch):
    """Each test starts with no configuration known to fail (kept per process), and leaves none."""
    monkeypatch.setattr(tuning, "_FAILED", {})


def kernel_weight(act_order=False, n=N, seed=0):
    scheme = QuantScheme(4, 32, symmetric=False)
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(n, K, generator=g)
    scale, zero = choose_qparams(weight, scheme, scale_dtype=torch.float16)
    q = quantize(weight, scale, zero, scheme)
    g_idx = torch.randperm(K, generator=g).div(32, rounding_mode="floor").int() if act_order else None
    return make_kernel_weight(pack(q, 4, dim=1), scale, pack(zero, 4, dim=0), (n, K), scheme, g_idx)


class Candidates:
    """Stands in for the GPU: each configuration's time, and what its launch does (computes the
    reference, raises, writes a wrong last column, or writes nothing)."""

    def __init__(self, times: dict, raises: dict | None = None, wrong: set = frozenset(), unwritten=frozenset()):
        self.times, self.raises, self.wrong, self.unwritten = times, raises or {}, wrong, unwritten
        self.last = None

    def launch(self, x, kw, bias, out, config):
        self.last = config
        if config in self.raises:
            raise self.raises[config]
        if config in self.unwritten:
            return
        out.copy_(x.float() @ dequantize_kernel_weight(kw, x.dtype).float().T)
        if config in self.wrong:
            out[:, -1] += 1.0  # only the last tile: the check must read the far end too

    def time_ms(self, fn):
        fn()
        return self.times[self.last]


def tune(monkeypatch, stand_in, kw=None, M=5):
    monkeypatch.setattr(tuning, "time_ms", stand_in.time_ms)
    return tuning.tune(M, kw or kernel_weight(), torch.float16, torch.device("cpu"), list(stand_in.times),
                       stand_in.launch)


def test_candidates_that_fail_to_compile_are_skipped(monkeypatch):
    from triton.compiler.errors import CompilationError
    from triton.runtime.errors import OutOfResources

    stand_in = Candidates({FAST: 1.0, MIDDLE: 2.0, SLOW: 3.0},
                          raises={FAST: RuntimeError("ptxas fatal: Unresolved extern function"),
                                  SLOW: OutOfResources(300000, 232448, "shared memory")})
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a skipped candidate is not a warning: the next one runs
        assert tune(monkeypatch, stand_in) == MIDDLE
    stand_in = Candidates({FAST: 1.0, MIDDLE: 2.0},
                          raises={FAST: CompilationError("src", None, "tl.dot shape mismatch")})
    assert tune(monkeypatch, stand_in) == MIDDLE


def test_when_no_candidate_runs_the_error_names_the_kernel_the_shape_and_every_reason(monkeypatch):
    stand_in = Candidates({FAST: 1.0, SLOW: 2.0},
                          raises={FAST: RuntimeError("CUDA driver error: invalid argument"),
                                  SLOW: ValueError("ptxas error: too many resources")})
    with pytest.raises(tuning.NoConfiguration) as caught:
        tune(monkeypatch, stand_in, M=3)
    text = str(caught.value)
    assert "quant_matmul" in text and "M=3, 128->600, W4 asymmetric g32, float16" in text
    assert "CUDA driver error: invalid argument" in text and "ptxas error: too many resources" in text
    assert str(FAST) in text and str(SLOW) in text


@pytest.mark.parametrize("act_order", [False, True])
def test_a_wrong_winner_gives_way_to_the_next_fastest_with_one_warning(monkeypatch, act_order):
    stand_in = Candidates({FAST: 1.0, MIDDLE: 2.0, SLOW: 3.0}, wrong={FAST})
    with pytest.warns(UserWarning) as caught:
        chosen = tune(monkeypatch, stand_in, kw=kernel_weight(act_order))
    assert chosen == MIDDLE
    assert len(caught) == 1
    message = str(caught[0].message)
    assert f"the fastest configuration {FAST} failed its check" in message and "relative error" in message
    assert f"{MIDDLE} runs instead" in message and "M=5, 128->600" in message


def test_an_unwritten_output_fails_the_check(monkeypatch):
    stand_in = Candidates({FAST: 1.0, SLOW: 2.0}, unwritten={FAST})
    with pytest.warns(UserWarning, match="failed its check"):
        assert tune(monkeypatch, stand_in) == SLOW


def test_when_nothing_matches_the_reference_it_is_an_error(monkeypatch):
    stand_in = Candidates({FAST: 1.0, SLOW: 2.0}, raises={MIDDLE: RuntimeError("compile failed")},
                          wrong={FAST, SLOW})
    stand_in.times[MIDDLE] = 0.5
    with pytest.raises(tuning.NoConfiguration, match="no configuration that ran matches the reference") as caught:
        tune(monkeypatch, stand_in)
    assert "compile failed" in str(caught.value) and str(SLOW) in str(caught.value)


def test_the_check_reads_the_last_rows_of_a_long_input():
    """More rows than the reference computes (M=600, both ends of 256): a wrong last row still fails."""
    kw = kernel_weight(n=48)

    def last_row_wrong(x, kw, bias, out, config):
        Candidates({FAST: 1.0}).launch(x, kw, bias, out, config)
        out[-1] += 1.0

    tuning.check(600, kw, torch.float16, torch.device("cpu"), FAST, Candidates({FAST: 1.0}).launch)
    with pytest.raises(AssertionError, match="relative error"):
        tuning.check(600, kw, torch.float16, torch.device("cpu"), FAST, last_row_wrong)


def test_the_switch_skips_the_check_not_the_timing(monkeypatch):
    monkeypatch.setenv(SELF_CHECK_ENV, "0")
    stand_in = Candidates({FAST: 2.0, SLOW: 1.0}, wrong={SLOW})
    assert tune(monkeypatch, stand_in) == SLOW


def test_a_configuration_that_failed_is_not_timed_again_for_that_weight(monkeypatch):
    """The fastest is wrong at M=5: at another M of the same weight it is left out before timing
    (never launched), and when nothing else is left the error says why it was left out."""
    stand_in = Candidates({FAST: 1.0, MIDDLE: 2.0, SLOW: 3.0}, wrong={FAST})
    with pytest.warns(UserWarning, match="failed its check"):
        assert tune(monkeypatch, stand_in) == MIDDLE
    launched = []
    counting = Candidates({FAST: 1.0, MIDDLE: 2.0, SLOW: 3.0})
    real_launch = counting.launch
    counting.launch = lambda x, kw, bias, out, config: launched.append(config) or real_launch(x, kw, bias, out, config)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert tune(monkeypatch, counting, M=40) == MIDDLE
    assert FAST not in launched and MIDDLE in launched
    assert tune(monkeypatch, Candidates({FAST: 1.0, SLOW: 2.0}), kw=kernel_weight(n=48)) == FAST  # another weight
    with pytest.raises(tuning.NoConfiguration, match="known to give wrong results") as caught:
        tune(monkeypatch, Candidates({FAST: 1.0}), M=7)
    assert "failed its check earlier in this process" in str(caught.value) and "relative error" in str(caught.value)


@pytest.mark.parametrize("act_order", [False, True])
def test_the_real_kernels_pass_the_check(act_order):
    """The kernels themselves (interpreter), each M regime's default launch: the check's reference
    reads the inputs in the order the launch takes them (act-order: the weight's column order). That
    the check fails a wrong result is the stand-ins' tests above."""
    kw = kernel_weight(act_order, n=48, seed=1)
    for M in (1, 5):
        tuning.check(M, kw, torch.float16, DEVICE, candidate_configs(M, kw)[0], qm.launch)



@pytest.mark.parametrize("a, b", [(0, 256), (344, 600), (3, 5)])
def test_a_cut_of_columns_is_those_columns_of_the_weight(a, b):
    kw = kernel_weight()
    cut = tuning.columns(kw, a, b)
    assert torch.equal(dequantize_kernel_weight(cut, torch.float16), dequantize_kernel_weight(kw, torch.float16)[a:b])


def test_a_shape_is_tuned_through_the_check_once_per_process(monkeypatch):
    """``choose_config`` on a GPU (its guards stubbed) hands tuning to ``tune`` with the real launch,
    and keeps what it returns for the shape's M bucket."""
    asked = []
    monkeypatch.setattr(qm, "interpreting", lambda: False)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(tuning, "tune", lambda M, kw, dtype, device, candidates, launch:
                        asked.append((M, launch)) or candidates[-1])
    monkeypatch.setattr(qm, "_TUNED", {})
    kw, gpu = kernel_weight(n=48), torch.device("cuda")
    first = qm.choose_config(20, kw, torch.float16, gpu)
    assert first == candidate_configs(20, kw)[-1] and asked == [(32, qm.launch)]
    assert qm.choose_config(30, kw, torch.float16, gpu) is first and len(asked) == 1  # the same bucket



# -- a shape with no configuration: its rows run the reference (runtime/linear.py decides) -----------


@pytest.fixture
def tuning_on_cpu(monkeypatch, kernels_on_cpu):
    """``choose_config`` tunes CPU tensors (in the interpreter) as it tunes on a GPU, from empty
    outcomes, and QuantLinear chooses the Triton backend for CPU layers (``kernels_on_cpu``); nothing
    injected outlives the test."""
    monkeypatch.setattr(qm, "tunes_on", lambda device: True)
    monkeypatch.setattr(qm, "_TUNED", {})
    monkeypatch.setattr(qm, "_NO_CONFIGURATION", {})
    monkeypatch.setattr(triton_backend, "_REPORTED_UNTUNED", set())


def failing_tuning(monkeypatch, how: str, failing_bucket: int) -> list[int]:
    """The real ``tune`` for ``failing_bucket``, where every candidate fails (``how``: to launch, or
    its check); the default configuration for other buckets. Returns the buckets asked, in order."""
    asked, real_tune = [], tuning.tune

    def launch_fails(fn):
        raise RuntimeError("CUDA driver error: invalid argument")

    def check_fails(M, kw, dtype, device, config, launch):
        raise Mismatch(f"{config} at columns 0..48: relative error 1.00e+00 against the reference")

    def tune(M, kw, dtype, device, candidates, launch):
        asked.append(M)
        return real_tune(M, kw, dtype, device, candidates, launch) if M == failing_bucket else candidates[0]

    if how == "launch":
        monkeypatch.setattr(tuning, "time_ms", launch_fails)
    else:
        monkeypatch.setattr(tuning, "time_ms", lambda fn: 1.0)
        monkeypatch.setattr(tuning, "check", check_fails)
    monkeypatch.setattr(tuning, "tune", tune)
    return asked


def quant_layer():
    from test_kernels_linear import load_layer

    return load_layer(QuantScheme(4, 32, symmetric=False), 48, 128, seed=3).half()


def rows(M):
    return torch.randn(M, 128, generator=torch.Generator().manual_seed(M)).to(DEVICE, torch.float16)


@pytest.mark.parametrize("how, reason", [("launch", "CUDA driver error: invalid argument"),
                                         ("check", "no configuration that ran matches the reference")])
def test_a_shape_without_a_configuration_runs_the_reference_with_one_warning(tuning_on_cpu, monkeypatch, how,
                                                                             reason):
    asked = failing_tuning(monkeypatch, how, failing_bucket=5)
    layer, x = quant_layer(), rows(5)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = layer(x)
        again = layer(x)
        quant_layer()(x)  # another layer of the shape: the same outcome, no second warning
    assert asked == [5], "the shape is tuned once"
    [message] = [str(w.message) for w in caught]
    assert "quant_matmul (M=5, 128->48, W4 asymmetric g32, float16)" in message and reason in message
    assert "run the dense reference (dequantize + matmul)" in message
    expected = F.linear(x, layer.dequantized_weight(torch.float16), layer.bias)
    assert torch.equal(out, expected) and torch.equal(again, expected)


def test_other_row_counts_of_that_layer_keep_the_kernels(tuning_on_cpu, monkeypatch):
    asked = failing_tuning(monkeypatch, "launch", failing_bucket=5)
    layer = quant_layer()
    with pytest.warns(UserWarning, match="M=5"):
        layer(rows(5))
    launched = []
    monkeypatch.setattr(qm, "launch", lambda *args: launched.append(args[-1]) or qm_launch(*args))
    with torch.inference_mode():
        one = layer(rows(1))
    assert asked == [5, 1] and launched == [candidate_configs(1, layer.kernel_weight())[0]]
    reference = F.linear(rows(1).double(), layer.dequantized_weight(torch.float16).double(), layer.bias.detach().double())
    compare(one, reference, torch.float16, "M=1 on the kernels")


def test_the_engine_start_up_leaves_an_untuned_bucket_to_the_reference(tuning_on_cpu, monkeypatch):
    """``warm_matmul_tuning`` and the Engine's check of its tuned GEMMs skip the bucket (the layer's
    forward runs the reference for it) instead of failing the start-up or the whole layer."""
    from runtime import selfcheck_cases
    from runtime.execution import warm_matmul_tuning

    asked = failing_tuning(monkeypatch, "launch", failing_bucket=5)
    layer = quant_layer()
    layer.use_backend("triton")  # as materialize chooses it on a GPU
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the forward warns, at first use, not the start-up
        assert warm_matmul_tuning(torch.nn.Sequential(layer), 5) == 5
        selfcheck_cases.check_linear(layer, layer.kernel_weight(), torch.float16, (5,), tuned=True)
    assert asked == [1, 2, 3, 4, 5]
    with pytest.warns(UserWarning, match="dense reference"):
        layer(rows(5))


def test_load_without_the_self_check_still_checks_what_is_tuned(checkpoint, kernels_on_cpu, monkeypatch):
    """``runtime.load(..., self_check=False)`` skips the model's load-time check, not the check of a
    configuration tuned at first use (kept per process for every model of the shape); only
    ``LOWBIT_SELF_CHECK=0`` skips that."""
    import runtime

    checked = []
    for switched_off in (False, True):
        if switched_off:
            monkeypatch.setenv(SELF_CHECK_ENV, "0")
        for name, value in (("tunes_on", lambda device: True), ("_TUNED", {}), ("_NO_CONFIGURATION", {})):
            monkeypatch.setattr(qm, name, value)
        monkeypatch.setattr(tuning, "time_ms", lambda fn: 1.0)
        monkeypatch.setattr(tuning, "check", lambda M, kw, *rest: checked.append((switched_off, M)))
        model = runtime.load(checkpoint, device=DEVICE, dtype=torch.float16, self_check=False)
        model.logits(IDS)
    assert {M for off, M in checked if not off} == {len(IDS[0])} and not [c for c in checked if c[0]]


def test_untuned_choice_skips_a_configuration_known_to_fail(monkeypatch):
    """Where nothing is timed (the interpreter here; a bucket first met during a CUDA-graph capture
    on a GPU) the first candidate not known to fail runs, and none left is an error, not a wrong one."""
    monkeypatch.setattr(qm, "_TUNED", {})
    monkeypatch.setattr(qm, "_NO_CONFIGURATION", {})
    kw, cpu = kernel_weight(), torch.device("cpu")
    first, second = candidate_configs(5, kw)[:2]
    assert qm.choose_config(5, kw, torch.float16, cpu) == first
    tuning.remember_failure(kw, torch.float16, cpu, first, "wrong on purpose")
    assert qm.choose_config(5, kw, torch.float16, cpu) == second
    for config in candidate_configs(5, kw):
        tuning.remember_failure(kw, torch.float16, cpu, config, "wrong on purpose")
    with pytest.raises(tuning.NoConfiguration, match="every candidate is known to fail"):
        qm.choose_config(5, kw, torch.float16, cpu)
