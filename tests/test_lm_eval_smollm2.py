"""lm-eval through lowbit on the real default model: the offline tasks measure the model, and the KV cache."""

import pytest

pytest.importorskip("lm_eval")

from evals.lm_eval_adapter import run_tasks  # noqa: E402

TASK = "lowbit_persuasion_ppl"


@pytest.mark.slow
def test_smollm2_scores_austen_like_a_language_model_and_int8_kv_keeps_it():
    """Ten paragraphs of Persuasion scored whole (loglikelihood_rolling). SmolLM2 needs about 1.3 bits per byte
    (a random model needs 8); an INT8 KV cache, read through the runtime's cache in blocks of 16 tokens (so that
    quantized blocks really are read), moves that by well under 1%."""
    fp16 = run_tasks("smollm2-135m", [TASK], kv="fp16", limit=10)
    int8 = run_tasks("smollm2-135m", [TASK], kv="int8-r16", limit=10)
    bpb = fp16["tasks"][TASK]["bits_per_byte,none"]
    bpb_int8 = int8["tasks"][TASK]["bits_per_byte,none"]
    print(f"SmolLM2-135M {TASK} bits/byte (10 docs): fp16 KV {bpb:.4f}, int8-r16 KV {bpb_int8:.4f}")
    assert fp16["n_samples"][TASK] == 10 and int8["settings"]["kv"] == "int8"
    assert 0.8 < bpb < 1.6, bpb
    assert bpb_int8 != bpb and abs(bpb_int8 / bpb - 1) < 0.005, (bpb, bpb_int8)
