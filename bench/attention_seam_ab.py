"""Two trees' CPU decode steps past the residual block, where decode attention is a backend call per
layer: the attention backend seam's (issue 42) host cost against the tree before it.

    flock /tmp/lowbit-bench.lock python -m bench.attention_seam_ab --before DIR --after DIR
        [--prompts 32,160] [--rounds 8] [--steps 12] [--configs decoder:w4:1,...] [--labels BEFORE,AFTER]

``bench.cpu_step_ab``'s protocol (one persistent worker per tree, SmolLM2-shaped random models built
once, trees alternated config by config within every round, order flipped each round, process CPU
time of each step at one thread, per-round medians paired), with the prompt length a parameter:
``bench.cpu_overhead``'s 32-token prompt keeps every step inside the residual block (one SDPA per
layer, no backend call), 160 tokens (fp16 KV, residual 128) puts every step's attention on the
chosen backend (``cpu-native`` on float32 models: ``runtime/native/kv_attention.cpp``). Raw JSON
with device, versions, the trees, command, protocol and load averages.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.cpu_step_ab import paired, summary

ROOT = Path(__file__).resolve().parent.parent


def worker(tree: str, threads: int) -> None:
    """Read ``path model batch steps prompt`` lines, answer each with the steps' (CPU, wall) ns."""
    sys.path.insert(0, tree)
    import torch

    torch.set_num_threads(threads)
    import bench.cpu_overhead as overhead
    import runtime
    from bench.cpu_decode import SHAPES, random_model

    if not runtime.__file__.startswith(tree):
        raise SystemExit(f"runtime imported from {runtime.__file__}, not from {tree}")
    models = {"float32": random_model(SHAPES["smollm2-135m"], quantized=False),
              "w4": random_model(SHAPES["smollm2-135m"], quantized=True)}
    print("ready", flush=True)
    for line in sys.stdin:
        path, name, batch, steps, prompt = line.split()
        overhead.PROMPT = int(prompt)  # read at each call
        print(json.dumps(overhead.PATHS[path](models[name], int(batch), int(steps))), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", help="the tree before the change (required)")
    ap.add_argument("--after", help="the tree after it (required)")
    ap.add_argument("--labels", default="", help="what the two trees are")
    ap.add_argument("--prompts", default="32,160")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--configs", default="decoder:float32:1,decoder:w4:1,engine:w4:1,engine:w4:8")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "cpu" / "attention-seam-ab.json")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args.worker, args.threads)
    if not (args.before and args.after):
        ap.error("--before and --after name the two trees")
    from bench.results_file import write_result
    from evals.provenance import commit, cpu_name, versions

    env = {**os.environ, "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "PASSIVE")}
    trees = {"before": str(Path(args.before).resolve()), "after": str(Path(args.after).resolve())}
    # each tree its own native build folder (cpu_step_ab), under $LOWBIT_NATIVE_CACHE when set (kept
    # between runs: a cold build of every kernel takes minutes on a loaded machine), else a temporary one
    native_builds = os.environ.get("LOWBIT_NATIVE_CACHE") or tempfile.TemporaryDirectory(prefix="lowbit-seam-ab-").name
    workers = {name: subprocess.Popen([sys.executable, "-m", "bench.attention_seam_ab", "--worker", tree,
                                       "--threads", str(args.threads)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                      text=True, cwd=ROOT,
                                      env={**env, "LOWBIT_NATIVE_CACHE": str(Path(native_builds) / name)})
               for name, tree in trees.items()}
    for name, w in workers.items():
        if w.stdout.readline().strip() != "ready":
            raise SystemExit(f"the {name} worker did not start")
    configs = [c.split(":") + [p] for p in args.prompts.split(",") for c in args.configs.split(",")]
    samples, loads = {}, [os.getloadavg()]
    for r in range(args.rounds):
        for config in configs:
            for name in (list(workers) if r % 2 == 0 else list(workers)[::-1]):
                path, model, batch, prompt = config
                workers[name].stdin.write(f"{path} {model} {batch} {args.steps} {prompt}\n")
                workers[name].stdin.flush()
                samples.setdefault(":".join(config), {}).setdefault(name, []).extend(
                    json.loads(workers[name].stdout.readline()))
        loads.append(os.getloadavg())
    for w in workers.values():
        w.stdin.close()
        w.wait()
    results = {}
    for config, by_tree in samples.items():
        row = {name: summary(times) for name, times in by_tree.items()}
        for stat in ("median_cpu_ms", "p10_cpu_ms", "median_wall_ms"):
            row[f"after_over_before_{stat}"] = row["after"][stat] / row["before"][stat]
        row["paired"] = paired(by_tree["before"], by_tree["after"], args.steps)
        results[config] = row
        print(config, json.dumps({k: row[k] for k in row if k.startswith("after_over")} | {
            "paired": row["paired"]["median_of_round_ratios"], "faster": row["paired"]["after_faster_rounds"]}),
            flush=True)
    write_result(args.out, {
        "device": f"cpu: {cpu_name()}", "versions": versions(), "threads": args.threads,
        "commit": commit(), "trees": {name: {"path": tree, "label": label} for (name, tree), label in
                                      zip(trees.items(), (args.labels.split(",") + ["", ""])[:2])},
        "command": "python -m bench.attention_seam_ab " + " ".join(sys.argv[1:]), "protocol": __doc__.strip(),
        "configs": "path:model:batch:prompt", "rounds": args.rounds, "steps_per_turn": args.steps,
        "load_average_per_round": loads, "results": results, "step_times_ns": samples})


if __name__ == "__main__":
    main()
