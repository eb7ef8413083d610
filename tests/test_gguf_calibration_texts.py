"""The mixed calibration source and the held-out evaluation texts that bench/gguf_vs_llamacpp (and
any recipe with ``calibration: {text: mixed}``) relies on: three genres in equal parts, none of
the evaluation texts inside it."""

from evals.texts import load_text
from quant.calibration import MIXED_PARTS, load_calibration_text, mixed_text


def test_mixed_source_is_prose_code_and_docs_in_equal_parts():
    text = load_calibration_text("mixed")
    assert text == mixed_text()
    assert len(MIXED_PARTS) == 2
    third = len(text) // 3
    prose, code, docs = text[:third], text[third:2 * third], text[2 * third:]
    assert prose.startswith("EMMA") and "Emma Woodhouse" in prose  # Austen first
    assert "def " in code and "import " in code
    assert "*******" in docs and "statement" in docs  # the Python reference's topic headings
    assert abs(len(text) - 3 * 450_000) < 3_000


def test_evaluation_texts_are_held_out_of_the_mixed_source():
    text = load_calibration_text("mixed")
    assert "class ArgumentParser" not in text  # argparse.py, the code evaluation text
    assert "Anne Elliot" not in text  # Persuasion
    docs = load_text("docs")
    assert "PyTorch" in docs and "Transformers" in docs
    for line in docs.splitlines()[:400]:  # the README text is another source than the Python reference
        if len(line) > 60:
            assert line not in text, line
