"""lm-eval through lowbit on the real default model: the offline tasks measure something."""

import pytest

pytest.importorskip("lm_eval")

from evals import lm_eval_tasks  # noqa: E402


@pytest.mark.slow
def test_smollm2_picks_the_next_sentence_well_above_chance_with_and_without_int8_kv():
    """40 items, four choices each (chance 0.25): a small model that reads English finds the sentence that
    follows far more often, and an INT8 KV cache (near lossless) keeps that score. Blocks of 16 tokens: with
    the default 128 these short items would sit whole in the unquantized residual block."""
    fp16 = lm_eval_tasks.run_tasks("smollm2-135m", ["lowbit_persuasion_cloze"], kv="fp16")
    int8 = lm_eval_tasks.run_tasks("smollm2-135m", ["lowbit_persuasion_cloze"], kv="int8-r16")
    acc = fp16["tasks"]["lowbit_persuasion_cloze"]["acc,none"]
    acc_int8 = int8["tasks"]["lowbit_persuasion_cloze"]["acc,none"]
    assert fp16["n_samples"]["lowbit_persuasion_cloze"] == 40
    assert acc >= 0.5, acc
    assert abs(acc_int8 - acc) <= 0.05, (acc, acc_int8)
