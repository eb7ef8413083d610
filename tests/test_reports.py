"""`lowbit report`: runs side by side as JSON, Markdown and a self-contained HTML page that renders in Chromium."""

import json
import re
import shutil
import subprocess

import pytest
import yaml

from evals.provenance import RUN_FORMAT
from cli_runner import run
from tiny import save_model, tiny_llama

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
EVAL_ARGS = ["--tokens", "200", "--window", "64", "--stride", "32", "--speed", "1,2", "--speed-prompt-len", "8",
             "--speed-output-len", "3"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Two real runs: a float tiny model and its RTN 4-bit checkpoint (evaluated against it)."""
    root = tmp_path_factory.mktemp("report")
    model, tokenizer = tiny_llama(hidden=64)
    model_dir = save_model(model, tokenizer, root / "float")
    recipe = root / "r.yaml"
    recipe.write_text(yaml.safe_dump({"model": str(model_dir), "output": str(root / "rtn"), "dtype": "float32",
                                      "weights": {"method": "rtn", "bits": 4, "group_size": 32, "ignore": ["lm_head"]}}))
    assert run("quantize", recipe).exit_code == 0
    files = []
    for name, extra in (("float", ["--no-baseline"]), ("rtn", [])):
        out = root / f"{name}.json"
        result = run("eval", root / name, *extra, *EVAL_ARGS, "--json", out)
        assert result.exit_code == 0, result.output
        files.append(out)
    return files


def test_eval_json_is_a_complete_run(runs):
    rtn = json.loads(runs[1].read_text())
    assert rtn["format"] == RUN_FORMAT and rtn["commit"] and rtn["device"]["type"] == "cpu"
    assert rtn["versions"]["torch"] and rtn["protocol"]["description"]
    assert rtn["baseline_ppl"] and rtn["baseline_bits_per_weight"] == 32.0 and rtn["bits_per_weight"] < 6
    mem = rtn["memory"]
    assert mem["quantized_weight_bytes"] > 0 and mem["kv_scheme"] == "fp16" and mem["kv_bytes_per_token"]["int8"] > 0
    assert [(r["batch"], r["prompt_len"]) for r in rtn["speed"]["rows"]] == [(1, 8), (2, 8)]


@pytest.fixture(scope="module")
def report_dir(runs, tmp_path_factory):
    out = tmp_path_factory.mktemp("out")
    result = run("report", *runs, "--out", out)
    assert result.exit_code == 0, result.output
    return out


def test_report_puts_runs_side_by_side(report_dir, runs):
    rep = json.loads((report_dir / "report.json").read_text())
    assert [s["label"] for s in rep["summary"]] == ["float", "rtn"]
    assert all(r["commit"] and r["device"] and r["versions"] for r in rep["runs"])
    md = (report_dir / "report.md").read_text()
    float_run, rtn_run = (json.loads(f.read_text()) for f in runs)
    assert f"| rtn | {rtn_run['ppl']:.4f} | {rtn_run['delta_ppl_pct']:+.2f}% |" in md
    assert f"| float | {float_run['ppl']:.4f} | - |" in md
    assert "## Speed by phase" in md and "Speed protocol:" in md and "## Provenance" in md


def test_html_is_self_contained_with_four_plots(report_dir):
    page = (report_dir / "report.html").read_text()
    plots = re.findall(r'<svg [^>]*data-plot="([^"]+)"', page)
    assert plots == ["ppl-vs-bits", "memory", "ttft_s", "itl_s"]
    assert page.count("<circle") >= 3 + 4  # two runs and the baseline; two batches x two runs per speed plot
    assert page.count('class="bar"') == 6 and page.count("<polyline") == 4
    # nothing fetched, nothing run: a page that opens offline and from an attachment
    assert not re.search(r"<script|<link|src=|@import|url\(", page)


@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (make test installs it on Debian as root)")
def test_page_renders_in_headless_chromium(report_dir, tmp_path):
    page = report_dir / "report.html"
    flags = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--window-size=1200,1400"]
    dom = subprocess.run(flags + ["--dump-dom", page.as_uri()], capture_output=True, text=True, timeout=120).stdout
    assert len(re.findall(r"<svg[^>]*class=\"plot\"", dom)) == 4
    assert dom.count("<tr>") >= 1 + 2 + 4 + 2  # header, two runs, speed rows, provenance rows
    blank = tmp_path / "blank.html"
    blank.write_text("<!DOCTYPE html><html><body></body></html>")
    sizes = []
    for source, shot in ((page, tmp_path / "report.png"), (blank, tmp_path / "blank.png")):
        subprocess.run(flags + [f"--screenshot={shot}", source.as_uri()], capture_output=True, timeout=120)
        assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        sizes.append(shot.stat().st_size)
    # an empty page compresses to almost nothing; text, tables and plots do not
    assert sizes[0] > 10 * sizes[1]


def test_older_runs_and_non_runs_are_refused_with_what_to_do(runs, tmp_path):
    old = json.loads(runs[0].read_text())
    for key in ("format", "device", "commit"):
        old.pop(key)
    (tmp_path / "old.json").write_text(json.dumps(old))
    result = run("report", tmp_path / "old.json", "--out", tmp_path / "o")
    assert result.exit_code != 0
    assert "old.json: a run in an older format" in result.output and "missing format, device, commit" in result.output
    assert "lowbit eval" in result.output
    (tmp_path / "bench.json").write_text(json.dumps({"results": []}))
    result = run("report", tmp_path / "bench.json", "--out", tmp_path / "o")
    assert result.exit_code != 0 and "not a lowbit eval run" in result.output
    empty = tmp_path / "empty"
    empty.mkdir()
    result = run("report", empty, "--out", tmp_path / "o")
    assert result.exit_code != 0 and "no run JSON in this directory" in result.output
    (tmp_path / "bad.json").write_text("{ not json")
    result = run("report", tmp_path / "bad.json", "--out", tmp_path / "o")
    assert result.exit_code != 0 and "bad.json: not JSON" in result.output


def test_a_run_directory_is_read_whole(runs, tmp_path):
    folder = tmp_path / "runs"
    folder.mkdir()
    for f in runs:
        shutil.copy(f, folder / f.name)
    result = run("report", folder, "--out", tmp_path / "o")
    assert result.exit_code == 0, result.output
    assert len(json.loads((tmp_path / "o" / "report.json").read_text())["runs"]) == 2


def test_a_checkpoint_that_fails_to_load_names_the_file(tmp_path):
    model, tokenizer = tiny_llama(hidden=64)
    broken = save_model(model, tokenizer, tmp_path / "broken")
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    result = run("eval", broken, "--no-baseline", "--tokens", "100", "--window", "64", "--stride", "32")
    assert result.exit_code != 0 and "model.safetensors" in result.output
    (broken / "config.json").write_text('{"model_type": "llama"')
    result = run("eval", broken, "--no-baseline")
    assert result.exit_code != 0 and "config.json" in result.output and "Traceback" not in result.output


def test_a_kv_quantized_run_shows_its_kv_scheme(tmp_path):
    model, tokenizer = tiny_llama(hidden=64)
    model_dir = save_model(model, tokenizer, tmp_path / "tiny")
    out = tmp_path / "kv.json"
    result = run("eval", model_dir, "--no-baseline", "--tokens", "200", "--window", "64", "--stride", "32",
                 "--kv", "int8-r16", "--json", out)
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    assert data["memory"]["kv_scheme"] == "int8"
    rep = run("report", out, "--out", tmp_path / "o")
    assert rep.exit_code == 0 and "| tiny |" in rep.output and "| int8 |" in rep.output
