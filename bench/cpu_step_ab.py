"""Two trees' CPU decode steps side by side, interleaved finely: one change's effect on a shared machine.

    flock /tmp/lowbit-bench.lock python -m bench.cpu_step_ab --before DIR --after DIR [--rounds 8]
        [--steps 12] [--threads 1] [--configs decoder:w4:1,engine:w4:8,...] [--prompts 32,160]
        [--labels BEFORE,AFTER] [--out FILE]

``DIR``: a tree holding ``runtime`` and ``bench`` (``git archive REV | tar -x -C DIR``; the after
tree: the same with the changed files copied over; ``--labels`` says which, for the record). One persistent worker process per tree builds
``bench.cpu_decode``'s SmolLM2-shaped random models once (float32, and W4 g64 through the CPU
kernels), then the driver alternates them config by config within every round (the order flipped
each round), each turn a fresh cache, a prompt of each ``--prompts`` length (32: every step inside
the fp16 residual block, one SDPA per layer; 160: every layer's decode attention on the chosen
``runtime/attention_backends`` backend) and ``--steps`` greedy steps of
``bench.cpu_overhead``'s ``decoder`` or ``engine`` path, timed per step in process CPU time (the
step's own work with one thread) and wall time. A slow spell of the machine so lands on both trees
within seconds, where ``cpu_overhead --compare`` starts a process per round and tree minutes apart.
Per config: median and 10th percentile of every step of every round, after over before, and each
round's two medians paired (the median of their ratios, the rounds the after tree was faster). Raw JSON
with device, versions, the trees' commits, command, protocol and load averages.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_PROMPT = 32  # bench.cpu_overhead's


def worker(tree: str, threads: int) -> None:
    """Read ``path model batch steps [prompt]`` lines, answer each with the steps' (CPU, wall) nanoseconds."""
    sys.path.insert(0, tree)
    import torch

    torch.set_num_threads(threads)
    import bench.cpu_overhead as overhead
    from bench.cpu_decode import SHAPES, random_model

    import runtime

    if not runtime.__file__.startswith(tree):
        raise SystemExit(f"runtime imported from {runtime.__file__}, not from {tree}")
    models = {"float32": random_model(SHAPES["smollm2-135m"], quantized=False),
              "w4": random_model(SHAPES["smollm2-135m"], quantized=True)}
    print("ready", flush=True)
    for line in sys.stdin:
        path, name, batch, steps, *prompt = line.split()
        overhead.PROMPT = int(prompt[0]) if prompt else DEFAULT_PROMPT  # read at each call
        print(json.dumps(overhead.PATHS[path](models[name], int(batch), int(steps))), flush=True)


def summary(times: list) -> dict:
    cpu, wall = sorted(c / 1e6 for c, _ in times), sorted(w / 1e6 for _, w in times)
    return {"median_cpu_ms": statistics.median(cpu), "p10_cpu_ms": cpu[len(cpu) // 10],
            "median_wall_ms": statistics.median(wall), "steps": len(cpu)}


def paired(before: list, after: list, steps: int) -> dict:
    """Each round's median CPU ms of the two trees, and the median of their ratios: the machine's
    slow and fast spells (2x apart on a shared machine) cancel within a round."""
    rounds = [(statistics.median(c / 1e6 for c, _ in before[i:i + steps]),
               statistics.median(c / 1e6 for c, _ in after[i:i + steps])) for i in range(0, len(before), steps)]
    return {"round_medians_cpu_ms": rounds, "after_faster_rounds": sum(a < b for b, a in rounds),
            "median_of_round_ratios": statistics.median(a / b for b, a in rounds)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", help="the tree before the change (required)")
    ap.add_argument("--after", help="the tree after it (required)")
    ap.add_argument("--labels", default="", help="what the two trees are, e.g. 'REV,REV + the changed files'")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--configs", default="decoder:float32:1,decoder:w4:1,decoder:float32:8,decoder:w4:8,"
                                         "engine:float32:1,engine:w4:1,engine:w4:8")
    ap.add_argument("--prompts", default="32", help="prompt lengths, comma-separated (a config per length)")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "cpu" / "cpu-step-ab.json")
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
    native_builds = tempfile.TemporaryDirectory(prefix="lowbit-step-ab-native-")  # removed at exit
    # each tree its own native build folder: a git archive's old file times make ninja keep whichever
    # tree's kernels were built last in a shared one, and time them for both
    workers = {name: subprocess.Popen([sys.executable, "-m", "bench.cpu_step_ab", "--worker", tree, "--threads",
                                       str(args.threads)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                      cwd=tree, env={**env, "LOWBIT_NATIVE_CACHE": str(Path(native_builds.name) / name)})
               for name, tree in trees.items()}
    for name, w in workers.items():
        if w.stdout.readline().strip() != "ready":
            raise SystemExit(f"the {name} worker did not start")
    prompts = args.prompts.split(",")
    configs = [c.split(":") + [p] for p in prompts for c in args.configs.split(",")]
    samples, loads = {}, [os.getloadavg()]
    for r in range(args.rounds):
        for config in configs:
            for name in (list(workers) if r % 2 == 0 else list(workers)[::-1]):
                path, model, batch, prompt = config
                # the default length unsaid: a tree from before --prompts runs its worker at it
                said = "" if prompt == str(DEFAULT_PROMPT) else f" {prompt}"
                workers[name].stdin.write(f"{path} {model} {batch} {args.steps}{said}\n")
                workers[name].stdin.flush()
                key = ":".join(config if len(prompts) > 1 else config[:3])  # path:model:batch[:prompt]
                answer = workers[name].stdout.readline()
                if not answer:
                    raise SystemExit(f"the {name} worker stopped at {key} (a tree from before --prompts "
                                     "runs the default prompt length only)")
                samples.setdefault(key, {}).setdefault(name, []).extend(json.loads(answer))
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
        print(config, json.dumps(row), flush=True)
    write_result(args.out, {
        "device": f"cpu: {cpu_name()}", "versions": versions(), "threads": args.threads,
        "commit": commit(), "trees": {name: {"path": tree, "label": label} for (name, tree), label in
                                      zip(trees.items(), (args.labels.split(",") + ["", ""])[:2])},
        "command": "python -m bench.cpu_step_ab " + " ".join(sys.argv[1:]), "protocol": __doc__.strip(),
        "configs": "path:model:batch" + (":prompt" if len(prompts) > 1 else f" (prompt {prompts[0]})"),
        "rounds": args.rounds, "steps_per_turn": args.steps, "load_average_per_round": loads,
        "results": results, "step_times_ns": samples})


if __name__ == "__main__":
    main()
