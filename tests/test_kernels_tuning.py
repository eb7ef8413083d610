"""Tuning the quantized matmul at first use (runtime/kernels/matmul_tuning.py), on CPU: candidates
that fail to compile or launch are skipped with their reasons, and named when none runs; the timed
winner is checked against the reference before it is used, and a wrong one gives way, with one
warning, to the next fastest that passes. The GPU's timer is replaced at its seam (``time_ms``) and
the launches by a stand-in that computes the reference or fails on purpose; the last test runs the
real kernels (the Triton interpreter) through the check."""

import warnings

import pytest
import torch

from kernel_device import DEVICE  # noqa: F401 (sets TRITON_INTERPRET before triton is imported)

from quant.affine import QuantScheme, choose_qparams, quantize  # noqa: E402
from quant.packing import pack  # noqa: E402
from runtime.kernels import matmul_tuning as tuning  # noqa: E402
from runtime.kernels import quant_matmul as qm  # noqa: E402
from runtime.kernels.matmul_configs import MatmulConfig, candidate_configs  # noqa: E402
from runtime.kernels.weight_layout import dequantize_kernel_weight, make_kernel_weight  # noqa: E402
from runtime.tolerances import SELF_CHECK_ENV  # noqa: E402

N, K = 600, 128  # more outputs than the check reads (both ends of 256)
FAST, MIDDLE, SLOW = MatmulConfig(16, 64), MatmulConfig(16, 32), MatmulConfig(32, 64)


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
