"""bench/plot.py: one valid SVG per (protocol, text), one point per quantized row, log-y, the budget as its curve."""

import json
import math
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from bench.budget_curve import points
from bench.plot import series_name, svg

ROOT = Path(__file__).resolve().parent.parent
PROTOCOLS = {"sliding": {"persuasion": "p", "code": "c"}, "bos": {"persuasion": "p", "code": "c"}}


def row(method, bits, bpw, ppl, tool="lowbit", budget=None):
    scores = {p: {t: {"ppl": ppl * (2 if t == "code" else 1) * (1.1 if p == "bos" else 1)} for t in ("persuasion", "code")}
              for p in PROTOCOLS}
    out = {"tool": tool, "method": method, "bits": bits, "quantize_s": 1.0, "scores": scores}
    if bpw is not None:
        out["bits_per_weight"] = bpw
    if budget is not None:
        out["budget"] = {"target_bits": budget, "estimated_loss": 1.0,
                         "layers": {"a": {"choice": "w3 g64", "loss": {"w3 g64": 1.0}}}}
    return out


@pytest.fixture
def files(tmp_path):
    w3 = {"commit": "abc", "protocols": PROTOCOLS, "rows": [
        row("float", 3, 32.0, 30.0), row("rtn", 3, 3.297, 90.0), row("gptq", 3, 3.297, 55.0),
        row("gptq", 3, None, 54.0, tool="llm-compressor 0.14"),  # a peer records no bits/weight
    ]}
    w4 = {"commit": "abc", "protocols": PROTOCOLS, "rows": [
        row("rtn", 4, 4.312, 40.0), row("rtn", 2, 2.25, 90000.0),
        row("rtn:weights.target_bits=3.297,weights.sensitivity=fisher", 4, 3.297, 70.0, budget=3.297),
        row("rtn:weights.target_bits=4.312,weights.sensitivity=fisher", 4, 4.312, 38.0, budget=4.312),
    ]}
    paths = [tmp_path / "w3.json", tmp_path / "w4.json"]
    for path, data in zip(paths, (w3, w4)):
        path.write_text(json.dumps(data))
    return paths


def _y(element) -> float:
    return float(element.get("cy") or float(element.get("y")) + 4)


def test_one_point_per_quantized_row_on_a_log_axis(files):
    pts, _ = points(files)
    assert [p for p in pts if p["tool"].startswith("llm")][0]["bits_per_weight"] == 3.297  # lowbit's W3 figure
    tree = ET.fromstring(svg(pts, "bos", "code"))  # raises on malformed XML
    marks = [e for e in tree.iter() if e.get("class") == "point"]
    assert len(marks) == 7  # every row but the float one
    titles = [e.find("{http://www.w3.org/2000/svg}title").text for e in marks]
    assert sum("bits budget" in t for t in titles) == 2
    by_ppl = {float(re.search(r": ([\d.]+) at", t).group(1)): _y(e) for t, e in zip(titles, marks)}
    # log scale: equal ratios are equal distances (90 -> 9000 vs 90000 -> ... is checked on three points)
    ppl = sorted(by_ppl)
    a, b, c = 40.0 * 2 * 1.1, 90.0 * 2 * 1.1, 90000.0 * 2 * 1.1
    assert {round(v, 3) for v in (a, b, c)} <= {round(v, 3) for v in ppl}
    ya, yb, yc = (by_ppl[min(ppl, key=lambda v: abs(v - x))] for x in (a, b, c))
    assert (ya - yb) / (yb - yc) == pytest.approx(math.log(b / a) / math.log(c / b), rel=1e-2)


def test_budget_rows_of_one_method_form_one_series():
    a = {"tool": "lowbit", "kind": "budget", "method": "rtn:weights.target_bits=3.297,weights.sensitivity=fisher"}
    b = dict(a, method="rtn:weights.sensitivity=fisher,weights.target_bits=4.3125")
    assert series_name(a) == series_name(b) == "lowbit rtn:weights.sensitivity=fisher (bits budget)"
    assert series_name(dict(a, estimator="output")) == "lowbit rtn:weights.sensitivity=fisher (bits budget, output)"
    assert series_name(dict(a, kind="uniform", method="gptq")) == "lowbit gptq"


def test_the_script_writes_one_svg_per_protocol_and_text(files, tmp_path):
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "plot.py"), *map(str, files),
                           "--out-prefix", str(tmp_path / "chart")], capture_output=True, text=True,
                          env={"PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr
    written = sorted(p.name for p in tmp_path.glob("chart-*.svg"))
    assert written == ["chart-bos-code.svg", "chart-bos-persuasion.svg", "chart-sliding-code.svg",
                       "chart-sliding-persuasion.svg"]
    for name in written:
        assert ET.parse(tmp_path / name).getroot().tag == "{http://www.w3.org/2000/svg}svg"


def test_files_scored_on_other_tokens_are_refused(files):
    other = json.loads(files[1].read_text())
    other["protocols"] = {"sliding": {"persuasion": "other"}}
    files[1].write_text(json.dumps(other))
    with pytest.raises(SystemExit, match="scored on other tokens"):
        points(files)
