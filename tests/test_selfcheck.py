"""The self-check on first use (runtime/selfcheck.py), on CPU tensors in the Triton interpreter
(QuantLinear sent to the kernels as on a GPU, the way tests/test_kernels_linear.py does): a kernel
that raises and one that returns wrong numbers each send their configuration, and only it, to the
reference path with one warning that names it (a quantized Linear's failing launch configuration
gives way to its M regime's next candidate; a regime none passes runs the reference for its rows);
the model then computes what the reference path computes; `lowbit doctor` shows the fallback; the
real kernels pass; the switches turn it off.

Injected kernels stand in for the real ones (instant); only the passing test runs the real ones."""

import warnings

import pytest
import torch

from kernel_device import DEVICE  # noqa: F401 (sets TRITON_INTERPRET before triton is imported)

import runtime  # noqa: E402
from quant.affine import QuantScheme  # noqa: E402
from runtime import linear as linear_module  # noqa: E402
from runtime import kernel_checks, selfcheck  # noqa: E402
from runtime import selfcheck_cases as cases  # noqa: E402
from runtime.linear_backends import triton as triton_backend  # noqa: E402
from runtime.kernels import attention as attention_kernels  # noqa: E402
from runtime.kernels import matmul_tuning as tuning  # noqa: E402
from runtime.kernels import quant_matmul, small_ops  # noqa: E402
from runtime.kernels.weight_layout import reference_matmul  # noqa: E402
from runtime.tolerances import Mismatch  # noqa: E402

INT4 = "int4-g16-r16"
GATE_UP = 320  # out_features of the joined gate/up Linear of the tiny model (2 x 160)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A W4 g32 asymmetric checkpoint of a one-layer tiny Llama (four distinct Linear shapes)."""
    from quant import checkpoint_write
    from quant.plan import plan_layers
    from quant.quantize import quantize_model
    from tiny import tiny_llama

    model, tok = tiny_llama(hidden=64, layers=1, initializer_range=0.3)
    plan = plan_layers(model, QuantScheme(4, 32, symmetric=False), ["lm_head"])
    quantized, _ = quantize_model(model, plan, "rtn", progress=False)
    return checkpoint_write.save(model, quantized, tmp_path_factory.mktemp("selfcheck") / "w4", tokenizer=tok, dtype=torch.float16)


@pytest.fixture(autouse=True)
def fresh_outcomes(monkeypatch):
    """Each test starts with nothing checked (outcomes are kept per process), and its injected
    failures stay out of the other tests' process-wide outcomes."""
    monkeypatch.setattr(selfcheck, "_OUTCOMES", {})
    monkeypatch.setattr(selfcheck, "_PARTLY", {})
    monkeypatch.setattr(tuning, "_FAILED", {})


def load_on_kernels(path, kv=INT4, small_ops=True, **options):
    """Load as on a GPU: every kernel chosen, then checked (on CUDA ``prepare`` does both; here
    Linears choose Triton when the test lets it take CPU layers, ``kernels_on_cpu``)."""
    model = runtime.load(path, device=DEVICE, dtype=torch.float16, kv=kv, **options)
    if DEVICE.type == "cpu":
        model.decoder.use_kernels(small_ops)
        model.decoder.attention_kernels = small_ops
        selfcheck.check_decoder(model.decoder, model.dtype, model.kv_scheme)
    return model


def reference_logits(model, ids):
    """The model's logits on the reference path throughout."""
    linear_module.use_backend(model.decoder, "reference")
    model.decoder.use_kernels(False)
    model.decoder.attention_kernels = False
    return model.logits(ids)


def self_check_warnings(caught) -> list[str]:
    return [str(w.message) for w in caught if "self-check" in str(w.message)]


def quant_layers(model):
    return [m for m in model.decoder.modules() if isinstance(m, linear_module.QuantLinear)]


def rows_of(model, kernel):
    return [r for r in selfcheck.kernel_table(model.decoder, model.dtype, model.kv_scheme) if r["kernel"] == kernel]


IDS = torch.tensor([[5, 17, 33, 2, 90, 41, 7]])


def test_a_wrong_linear_kernel_falls_back_and_the_model_computes_the_reference(checkpoint, kernels_on_cpu,
                                                                               monkeypatch):
    wrong = lambda x, kw, bias=None, config=None: reference_matmul(x, kw, bias) * 1.01  # noqa: E731 (1% off)
    monkeypatch.setattr(quant_matmul, "quant_matmul", wrong)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = load_on_kernels(checkpoint, small_ops=False)
        logits = model.logits(IDS)
    messages = self_check_warnings(caught)
    assert len(messages) == 4 == len(caught), [str(w.message) for w in caught]  # one per Linear shape, nothing else
    for shape in ("64->64", "64->128", "160->64", "64->320"):
        [message] = [m for m in messages if f"{shape}," in m]
        assert "quant_matmul" in message and "relative error" in message and "M=1" in message
        assert "Triton " in message and ("Triton interpreter" in message or "CUDA" in message)
    assert all(layer.fallback_reason and "relative error" in layer.fallback_reason for layer in quant_layers(model))
    assert torch.equal(logits, reference_logits(model, IDS))
    rows = rows_of(model, "quant_matmul")
    assert len(rows) == 4 and all(r["runs"] == "reference" and r["why"].startswith("fell back: ") for r in rows)

    with warnings.catch_warnings(record=True) as caught:  # the outcome is kept: a second model falls back silently
        warnings.simplefilter("always")
        again = load_on_kernels(checkpoint, small_ops=False)
    assert not caught and all(layer.fallback_reason for layer in quant_layers(again))


def test_a_failing_kernel_sends_only_its_configuration_to_the_reference(checkpoint, kernels_on_cpu, monkeypatch):
    """Every launch of the gate/up shape fails to compile (in every M regime, so the layer falls
    back whole); the other shapes (here: a stand-in that is right) stay on the kernels, and the
    gate/up layer computes the reference's output."""

    def kernel(x, kw, bias=None, config=None):
        if kw.out_features == GATE_UP:
            raise RuntimeError("PassManager::run failed (an injected compile error)")
        return reference_matmul(x, kw, bias)

    monkeypatch.setattr(quant_matmul, "quant_matmul", kernel)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = load_on_kernels(checkpoint, small_ops=False)
    [message] = self_check_warnings(caught)
    assert len(caught) == 1
    assert "quant_matmul [w4 g32 asym, 64->320, float16: gate_up_proj x1]" in message
    assert "RuntimeError: PassManager::run failed (an injected compile error)" in message
    assert "dequantize + matmul" in message
    [mlp] = [m for m in model.decoder.modules() if hasattr(m, "gate_up_proj")]
    assert mlp.gate_up_proj.fallback_reason and "PassManager" in mlp.gate_up_proj.fallback_reason
    others = [layer for layer in quant_layers(model) if layer is not mlp.gate_up_proj]
    assert len(others) == 3 and not any(layer.fallback_reason for layer in others)
    x = torch.randn(1, 3, 64, generator=torch.Generator().manual_seed(0)).to(DEVICE, torch.float16)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = mlp.gate_up_proj(x)
    assert not caught  # no second warning at each forward
    torch.testing.assert_close(out, torch.nn.functional.linear(x, mlp.gate_up_proj.dequantized_weight(torch.float16)))
    assert [r["runs"] for r in rows_of(model, "quant_matmul")].count("reference") == 1


class Launches:
    """Stands in for ``quant_matmul.launch`` (and so for the GPU) in the self-check and in tuning:
    the reference's output, except for the gate/up shape's configurations ``fails`` picks, which
    raise an injected compile error. Tuning runs on CPU tensors as on a GPU, its timer replaced."""

    def __init__(self, monkeypatch, fails):
        self.fails, self.launched = fails, []
        monkeypatch.setattr(quant_matmul, "launch", self.launch)
        monkeypatch.setattr(quant_matmul, "tunes_on", lambda device: True)
        monkeypatch.setattr(quant_matmul, "_TUNED", {})
        monkeypatch.setattr(quant_matmul, "_NO_CONFIGURATION", {})
        monkeypatch.setattr(tuning, "time_ms", lambda fn: fn() or 1.0)
        monkeypatch.setattr(triton_backend, "_REPORTED_UNTUNED", set())

    def launch(self, x2, kw, bias, out, config):
        if kw.out_features == GATE_UP:
            self.launched.append((x2.shape[0], config))
            if self.fails(config):
                raise RuntimeError("PassManager::run failed (an injected compile error)")
        out.copy_(reference_matmul(x2, kw, bias))

    def gate_up(self, M):
        return [config for rows, config in self.launched if rows == M]


def gate_up_layer(model):
    [mlp] = [m for m in model.decoder.modules() if hasattr(m, "gate_up_proj")]
    return mlp.gate_up_proj


def test_a_failing_launch_configuration_gives_way_to_the_regimes_next_candidate(checkpoint, kernels_on_cpu,
                                                                                monkeypatch):
    """The untimed default of M=5's regime fails for the gate/up shape: the self-check checks the
    next candidate, which passes; the layer stays on the kernels in every regime, one warning names
    both, and the tuner never launches the failed configuration again in this process."""
    from runtime.kernels.matmul_configs import candidate_configs

    kw = None

    def default_of_m5(config):
        return config == candidate_configs(5, kw)[0]

    launches = Launches(monkeypatch, default_of_m5)
    kw = linear_module.QuantLinear(64, GATE_UP, QuantScheme(4, 32, symmetric=False)).kernel_weight()
    first, second = candidate_configs(5, kw)[:2]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = load_on_kernels(checkpoint, small_ops=False)
    [message] = [str(w.message) for w in caught]
    assert message.startswith("self-check: quant_matmul [w4 g32 asym, 64->320, float16: gate_up_proj x1] on ")
    assert f"M=5 ({cases.launch_name(first)}): RuntimeError: PassManager::run failed" in message
    assert f"the tuner leaves it out in this process, {cases.launch_name(second)} passed" in message
    assert launches.gate_up(5) == [first, second]
    layer = gate_up_layer(model)
    assert not any(m.fallback_reason for m in quant_layers(model))
    [row] = [r for r in rows_of(model, "quant_matmul") if "gate_up" in r["configuration"]]
    assert row["runs"] == "triton" and "PassManager" in row["why"]

    launches.launched.clear()
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(0)).to(DEVICE, torch.float16)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the next fastest runs: no warning at the forward
        out = layer(x)
    tuned = launches.gate_up(5)
    assert set(tuned) == set(candidate_configs(5, kw)) - {first}  # timed (and the winner checked, then run)
    torch.testing.assert_close(out, torch.nn.functional.linear(x, layer.dequantized_weight(torch.float16)))


def test_a_regime_no_candidate_passes_runs_the_reference_for_its_rows_only(checkpoint, kernels_on_cpu, monkeypatch):
    """Every GEMV (M=1's regime) of the gate/up shape fails: the layer keeps the kernels for more
    rows; one row runs dequantize + matmul, found when M=1 is tuned (nothing left to time)."""
    launches = Launches(monkeypatch, lambda config: not config.use_dot and config.block_m == 1)  # the one-row GEMV
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = load_on_kernels(checkpoint, small_ops=False)
    [message] = [str(w.message) for w in caught]
    assert "gate_up_proj x1" in message and "M=1 (GEMV x128" in message and "PassManager" in message
    assert "no configuration passed for M=1: those rows run dequantize + matmul" in message
    gemvs = launches.gate_up(1)
    assert gemvs and all(not c.use_dot for c in gemvs) and len(set(gemvs)) == len(gemvs)  # each checked once
    layer = gate_up_layer(model)
    assert layer.fallback_reason is None
    launches.launched.clear()
    one, three = (torch.randn(M, 64, generator=torch.Generator().manual_seed(M)).to(DEVICE, torch.float16)
                  for M in (1, 3))
    with pytest.warns(UserWarning, match="known to give wrong results here.*run the dense reference"):
        out = layer(one)
    assert launches.gate_up(1) == []  # nothing launched: every candidate is known to fail
    torch.testing.assert_close(out, torch.nn.functional.linear(one, layer.dequantized_weight(torch.float16)))
    layer(three)
    assert launches.gate_up(3) and all(c.block_m > 1 for c in launches.gate_up(3))  # more rows: the kernels


def test_a_wrong_small_op_falls_back_alone(checkpoint, monkeypatch):
    monkeypatch.setattr(small_ops, "silu_mul", lambda gate_up: torch.zeros_like(gate_up[..., ::2]))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = load_on_kernels(checkpoint, linear_backend="reference")  # compared at float32 precision below
        logits = model.logits(IDS)
    [message] = self_check_warnings(caught)
    assert "silu_mul [width 160, float16]" in message and "relative error inf" not in message
    assert "PyTorch ops" in message
    kinds = {type(m).__name__: m.kernels for m in model.decoder.modules() if hasattr(m, "kernels")}
    assert kinds == {"MLP": False, "Attention": True, "RMSNorm": True}  # add + norm and RoPE passed
    want = reference_logits(model, IDS)
    torch.testing.assert_close(logits, want, rtol=0, atol=2e-3 * want.abs().max().item())


def test_a_failing_attention_kernel_falls_back_to_sdpa_at_load_and_in_the_engine(checkpoint, monkeypatch):
    """Decode attention over INT4 caches raises (as decode_folded did under Triton 3.6): a model
    whose cache is INT4 takes the reference at load; an engine on an fp16 model asked for an INT4
    cache checks that one at start-up and takes SDPA, or refuses when attention='triton' was asked."""
    real = attention_kernels.KERNEL_OPS.decode_attention

    def decode(q, paged, *args, **kwargs):
        if paged.scheme.bits == 4:
            raise TypeError("Both operands must be same dtype. Got fp16 and fp32")
        return real(q, paged, *args, **kwargs)

    monkeypatch.setattr(attention_kernels, "KERNEL_OPS", attention_kernels.KERNEL_OPS._replace(decode_attention=decode))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = load_on_kernels(checkpoint, kv=INT4)
        tokens = [t.id for t in model.generate(IDS[0].tolist(), max_new_tokens=4, stop_at_eos=False)]
    [message] = self_check_warnings(caught)
    assert "attention (write, decode, prefill) [int4-g16-r16 cache, 4 query / 2 KV heads x 16, float16]" in message
    assert "Both operands must be same dtype" in message and "SDPA over the dequantized cache" in message
    assert model.decoder.attention_kernels is False
    [row] = rows_of(model, "attention (write, decode, prefill)")
    assert row["runs"] == "reference" and "Both operands" in row["why"]
    model.decoder.use_kernels(False)
    assert tokens == [t.id for t in model.generate(IDS[0].tolist(), max_new_tokens=4, stop_at_eos=False)]

    from runtime.engine import Engine

    fp16 = load_on_kernels(checkpoint, kv="fp16-r16")
    assert fp16.decoder.attention_kernels is True  # its own cache's kernels passed
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine = Engine(fp16, max_batch=2, max_len=32, kv=INT4)
    assert engine.kernels is False and engine.stats()["attention"] == "reference"
    assert fp16.decoder.attention_kernels is True  # another scheme's failure leaves the model's own choice
    assert not caught  # the INT4 outcome is kept from the load above: no second warning
    with pytest.raises(selfcheck.SelfCheckError, match="Both operands must be same dtype"):
        Engine(fp16, max_batch=2, max_len=32, kv=INT4, attention="triton")


def test_the_real_kernels_pass_their_check(checkpoint, kernels_on_cpu, monkeypatch):
    monkeypatch.setattr(cases, "LINEAR_ROWS", (5,))  # the interpreter is slow: one regime here (all on a GPU)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = load_on_kernels(checkpoint)
    assert not self_check_warnings(caught)
    rows = selfcheck.kernel_table(model.decoder, model.dtype, model.kv_scheme)
    assert [r["kernel"] for r in rows] == ["quant_matmul"] * 4 + ["add_rmsnorm", "rope_qkv", "silu_mul",
                                                                   "attention (write, decode, prefill)"]
    assert [r["runs"] for r in rows] == ["triton"] * 4 + ["fused"] * 4 and all(r["why"] is None for r in rows), rows
    assert all(error is None for error in selfcheck._OUTCOMES.values()) and len(selfcheck._OUTCOMES) == 8


def test_a_large_linear_is_checked_at_both_ends_of_its_outputs(monkeypatch):
    """Past 512 outputs the reference computes the first and last 256 rows only: a kernel wrong in
    the last tile alone (its masking) is still caught."""
    from test_kernels_linear import checkpoint_tensors

    scheme = QuantScheme(4, 32, symmetric=False, actorder="group")
    packed, scale, zero, g_idx = checkpoint_tensors(600, 64, scheme, seed=1, act_order=True)
    layer = linear_module.QuantLinear(64, 600, scheme, bias=True, scale_dtype=scale.dtype)
    layer.load_state_dict({"weight_packed": packed, "weight_scale": scale, "weight_zero_point": zero,
                           "weight_g_idx": g_idx, "weight_shape": torch.tensor([600, 64]),
                           "bias": torch.randn(600)})
    layer = layer.to(DEVICE).half()
    assert kernel_checks._checked_outputs(600, 8) == [(0, 256), (344, 600)]
    kernel_checks.check_linear(layer, layer.kernel_weight(), torch.float16, (5,), tuned=False)  # the real kernels, act-order and bias: pass

    def last_tile_wrong(x, kw, bias=None, config=None):
        out = reference_matmul(x, kw, bias)
        out[..., -3:] += 1.0
        return out

    monkeypatch.setattr(quant_matmul, "quant_matmul", last_tile_wrong)
    with pytest.raises(Mismatch, match="M=1 \\(GEMV"):
        kernel_checks.check_linear(layer, layer.kernel_weight(), torch.float16, (1,), tuned=False)


def test_the_switches_skip_it(checkpoint, kernels_on_cpu, monkeypatch):
    wrong = lambda x, kw, bias=None, config=None: reference_matmul(x, kw, bias) * 2  # noqa: E731
    monkeypatch.setattr(quant_matmul, "quant_matmul", wrong)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        skipped = load_on_kernels(checkpoint, small_ops=False, self_check=False)
        monkeypatch.setenv(selfcheck.ENV_SWITCH, "0")
        by_env = load_on_kernels(checkpoint, small_ops=False)
    assert not caught and not selfcheck._OUTCOMES
    assert not any(layer.fallback_reason for m in (skipped, by_env) for layer in quant_layers(m))


def test_doctor_prints_what_runs_fused_and_what_fell_back(checkpoint, kernels_on_cpu, monkeypatch):
    from click.testing import CliRunner

    from lowbit.cli import main

    wrong = lambda x, kw, bias=None, config=None: reference_matmul(x, kw, bias) * 1.01  # noqa: E731
    monkeypatch.setattr(quant_matmul, "quant_matmul", wrong)
    with pytest.warns(UserWarning, match="self-check: quant_matmul"):
        result = CliRunner().invoke(main, ["doctor", str(checkpoint), "--device", str(DEVICE), "--dtype", "float16",
                                           "--kv", INT4])
    assert result.exit_code == 0, result.output
    table = [line for line in result.output.splitlines() if line.startswith("quant_matmul")]
    assert len(table) == 4 and all(" reference " in line and "fell back: M=1" in line for line in table)
    assert "Triton" in result.output and "checked against the reference at load" in result.output


def test_doctor_on_cpu_says_the_reference_runs(checkpoint):
    from click.testing import CliRunner

    from lowbit.cli import main

    if DEVICE.type != "cpu":
        pytest.skip("a GPU runs the kernels")
    result = CliRunner().invoke(main, ["doctor", str(checkpoint), "--device", "cpu"])
    assert result.exit_code == 0, result.output
    assert "no kernel runs on Triton here" in result.output
    kernels = ("quant_matmul", "add_rmsnorm", "rope_qkv", "silu_mul", "attention")
    lines = [line for line in result.output.splitlines()[2:] if line.startswith(kernels)]  # (a CPU plan follows)
    assert len(lines) == 8
    linears = [line for line in lines if line.startswith("quant_matmul")]  # the CPU kernels, from each choice
    assert len(linears) == 4 and all(" cpu-int4 " in line and "triton: runs on cuda only" in line for line in linears)
    assert all(" reference " in line and "kernels run on CUDA only" in line for line in lines if line not in linears)
    from runtime import native

    assert f"native kernels: level {native.level()} (this CPU runs " in result.output  # what built, for bug reports


def test_cuda_graphs_that_fail_or_disagree_leave_the_engine_on_eager_steps():
    """An Engine's captured decode steps are each replayed once against the same step run eagerly
    (no GPU here: stand-in executors); a capture that raises or a replay that disagrees gives an
    executor without graphs and one warning."""
    from types import SimpleNamespace

    class Graph:
        batch = 2

        def __init__(self, replayed):
            self.replayed = replayed

        def run(self, tokens, starts):
            return self.replayed

        def step(self):
            return torch.ones(2, 1, 8)

    def maker(replayed=None, capture_error=None):
        made = []

        def make(graphs):
            made.append(graphs)
            if graphs and capture_error:
                raise capture_error
            return SimpleNamespace(graphs=SimpleNamespace(graphs={(2, False): Graph(replayed)}) if graphs else None)

        return make, made

    decoder = torch.nn.Linear(4, 4)
    for make, made, error in [(*maker(replayed=torch.full((2, 1, 8), 1.5)), "relative error"),
                              (*maker(capture_error=RuntimeError("operation not permitted when stream is capturing")),
                               "RuntimeError: operation not permitted")]:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            executor = selfcheck.checked_capture(make, True, decoder)
        [message] = self_check_warnings(caught)
        assert made == [True, False] and executor.graphs is None
        assert "CUDA graphs of the decode step" in message and error in message and "run eagerly" in message
    make, made = maker(replayed=torch.ones(2, 1, 8))
    assert selfcheck.checked_capture(make, True, decoder).graphs is not None and made == [True]


def test_a_decode_graph_replay_is_compared_with_its_eager_step(checkpoint):
    """The replay check on the engine's own DecodeGraph objects (run eagerly here: capture=False)."""
    from runtime.engine import Engine
    from runtime.execution import DecodeGraphs

    model = load_on_kernels(checkpoint, kv="fp16-r16")
    engine = Engine(model, max_batch=2, max_len=32, attention="triton")
    graphs = DecodeGraphs(model.decoder, engine.cache, capture=False, buckets=(2,))
    for graph in graphs.graphs.values():
        selfcheck.check_replay(graph, model.dtype)


def test_the_cli_flag_switches_it_off(checkpoint, kernels_on_cpu, monkeypatch):
    from click.testing import CliRunner

    from lowbit.cli import main

    monkeypatch.setenv(selfcheck.ENV_SWITCH, "1")  # restored after the test: the flag sets it for the process
    wrong = lambda x, kw, bias=None, config=None: reference_matmul(x, kw, bias) * 2  # noqa: E731
    monkeypatch.setattr(quant_matmul, "quant_matmul", wrong)
    result = CliRunner().invoke(main, ["--no-self-check", "doctor", str(checkpoint), "--device", str(DEVICE),
                                       "--dtype", "float16"])
    assert result.exit_code == 0, result.output
    assert "fused kernels NOT checked" in result.output and not selfcheck.enabled()
    assert [line.split()[-1] for line in result.output.splitlines() if line.startswith("quant_matmul")] == ["triton"] * 4
