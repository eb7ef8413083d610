"""Writing a bench's raw result: the load average when it ended (the machine is shared, so every
result says how busy it was), the folder made, indented JSON, and where it went. A value JSON
cannot hold (a dtype, a device) is written as its ``str``, so a long run never loses its result
at the last step."""

from __future__ import annotations

import json
import os
from pathlib import Path


def write_result(path: Path, result: dict) -> None:
    result["load_average_end"] = os.getloadavg()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2, default=str) + "\n")
    print(f"wrote {path}")
