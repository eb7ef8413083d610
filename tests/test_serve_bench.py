"""bench/serve.py cannot rot: its whole path (a ``lowbit serve`` process, the openai client
streaming, the in-process engine, the JSON) runs here on a tiny checkpoint at tiny sizes; its
timings mean nothing."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("starlette")
pytest.importorskip("openai")

from served import tiny_checkpoint  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def test_bench_serve_runs_both_sides_and_writes_its_json(tmp_path):
    ckpt = tiny_checkpoint(tmp_path / "tiny")
    out = tmp_path / "serve.json"
    run = subprocess.run([sys.executable, str(ROOT / "bench" / "serve.py"), "--model", str(ckpt), "--kv", "fp16-r16",
                          "--kv-memory", "4MB", "--clients", "1,3", "--requests", "2", "--prompt-len", "8",
                          "--output-len", "5", "--json", str(out)], capture_output=True, text=True, timeout=300,
                         cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert run.returncode == 0, run.stderr[-3000:]
    record = json.loads(out.read_text())
    assert [level["clients"] for level in record["levels"]] == [1, 3]
    for level in record["levels"]:
        for side in ("in_process", "http"):
            s = level[side]
            assert s["requests"] == 2 * level["clients"] and s["output_tokens_per_s"] > 0
            assert s["output_tokens_per_s"] * s["wall_s"] == pytest.approx(5 * s["requests"])  # every token counted
            assert 0 < s["ttft_s"]["p50"] <= s["ttft_s"]["p99"] and s["itl_s"]["p50"] > 0
        assert level["http_over_in_process"]["requests_per_s"] > 0
    assert record["commit"] and record["device"]["type"] == "cpu" and "closed loop" in record["protocol"]
