"""Where a CPU decode step's time goes, by kind of work; the step before and after a change, side
by side (OpenMP's settings: ``bench.cpu_omp``).

    flock /tmp/lowbit-bench.lock python -m bench.cpu_overhead [--shapes smollm2-135m] [--code DIR]
        [--compare REV [--overlay PATHS]]

Models as ``bench.cpu_decode`` builds them (random weights, real shapes; float32, and W4 g64 through
the CPU kernels with bf16 embedding/lm_head), fp16 KV cache, 1 thread (``--threads``), process CPU
time (the step's own work, whatever else the shared machine runs). Two paths per model and batch
(1 and 8), after a 32-token prompt: ``decoder``, a greedy step of ``decoder(token, cache, pos)``
over a ``LockstepCache`` (what ``bench.cpu_decode`` and ``lowbit speed`` time), and ``engine``, one
``Engine.step`` decoding every sequence (scheduler, inputs, forward over a ``SequenceBatch``,
sampling). Breakdown: the median plain step over ``--repeats`` runs of ``--steps`` steps, then one
run with the runtime's functions wrapped (``bench/cpu_overhead_kinds.py``): each kind's own time per
step (Linears, lm_head, norms, RoPE, MLP activation, attention math, cache bookkeeping, each
module's glue, the engine's host work). ``--code DIR``: the runtime imported from DIR (a ``git
archive`` of a revision: the committed code of a tree others are editing). ``--compare REV``: the
same plain steps for the code at git revision REV (``git archive`` into a temporary folder, imported
first) and for this tree (with ``--overlay PATHS``: REV with those paths from this tree, one change
alone), in child processes alternating round by round, medians per configuration. ``--native-ops``: the decoder's small ops
on ``runtime/native/decode_ops.cpp`` (``runtime.load.use_native_ops``) against the PyTorch ops, switched on
the same models in one process, alternating round by round (plain decoder steps, medians; ``Engine.step``s
with ``--native-ops-path engine``), with the largest logit difference of a forward each way. Raw JSON with device, versions, commit, command and
the load average.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

if __name__ == "__main__":  # before torch loads: the CLI's OpenMP defaults; --code's runtime first
    import lowbit.cli_options  # noqa: F401  (importing it sets them)
    if "--code" in sys.argv:
        sys.path.insert(0, sys.argv[sys.argv.index("--code") + 1])

import torch  # noqa: E402

from bench.cpu_decode import SHAPES, random_model  # noqa: E402
from bench.results_file import write_result  # noqa: E402
from evals.provenance import commit, cpu_name, versions  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
PROMPT = 32


def decoder_steps(model, batch: int, steps: int, accounts=None) -> list[tuple[int, int]]:
    """(process CPU, wall) nanoseconds of each greedy ``decoder(token, cache, pos)`` step after a
    random prompt; ``accounts`` cleared after the prompt, so they hold the steps alone."""
    prompt = torch.randint(0, model.decoder.cfg.vocab_size, (batch, PROMPT), generator=torch.Generator().manual_seed(1))
    cache = model.new_cache(PROMPT + steps + 1, batch)
    times = []
    with torch.inference_mode():
        token = model.decoder(prompt, cache, 0)[:, -1].argmax(-1, keepdim=True)
        if accounts is not None:
            accounts.clear()
        for pos in range(PROMPT, PROMPT + steps):
            cpu, wall = time.process_time_ns(), time.perf_counter_ns()
            token = model.decoder(token, cache, pos)[:, -1].argmax(-1, keepdim=True)
            times.append((time.process_time_ns() - cpu, time.perf_counter_ns() - wall))
    return times


def engine_steps(model, batch: int, steps: int, accounts=None) -> list[tuple[int, int]]:
    """The same for ``Engine.step`` with ``batch`` greedy requests, once all of them decode."""
    from runtime.engine import Engine

    engine = Engine(model, max_batch=batch, max_len=PROMPT + steps + 8)
    g = torch.Generator().manual_seed(1)
    for _ in range(batch):
        engine.submit(torch.randint(0, model.decoder.cfg.vocab_size, (PROMPT,), generator=g).tolist(),
                      max_tokens=steps + 4, ignore_eos=True)
    while engine.decoding < batch or not engine.all_decoding:  # admission and prefill
        engine.step()
    engine.step()  # the first decode step of every sequence
    if accounts is not None:
        accounts.clear()
    times = []
    for _ in range(steps):
        cpu, wall = time.process_time_ns(), time.perf_counter_ns()
        engine.step()
        times.append((time.process_time_ns() - cpu, time.perf_counter_ns() - wall))
    engine.shutdown()
    return times


PATHS = {"decoder": decoder_steps, "engine": engine_steps}


def median_ms(times: list[tuple[int, int]], i: int) -> float:
    return statistics.median(t[i] for t in times) / 1e6


def breakdown(model, batch: int, path: str, steps: int, repeats: int) -> dict:
    """The median plain step (ms), then each kind's own time per step from one wrapped run."""
    from bench.cpu_overhead_kinds import accounting, per_step

    run = PATHS[path]
    run(model, batch, 2)  # warm-up: first calls allocate and pick kernels
    plain = [t for _ in range(repeats) for t in run(model, batch, steps)]
    with accounting(model.decoder) as accounts:
        wrapped = run(model, batch, steps, accounts)
        kinds = per_step(accounts, steps, sum(c for c, _ in wrapped), sum(w for _, w in wrapped))
    return {"step_cpu_ms": median_ms(plain, 0), "step_wall_ms": median_ms(plain, 1), "steps": len(plain),
            "wrapped_step_cpu_ms": sum(c for c, _ in wrapped) / steps / 1e6, "kinds": kinds}


def native_ops(shape: str, rounds: int, steps: int, path: str = "decoder") -> dict:
    """Plain steps of ``path`` (``PATHS``) with the native decode ops on and off, the same models, alternating."""
    from runtime import native
    from runtime.load import use_native_ops

    module = native.load("decode_ops")
    if module is None:
        raise SystemExit("--native-ops: runtime/native/decode_ops.cpp cannot be built here")
    models = {"float32": random_model(SHAPES[shape], quantized=False), "w4": random_model(SHAPES[shape], quantized=True)}
    ids = torch.randint(0, SHAPES[shape]["vocab_size"], (2, 9), generator=torch.Generator().manual_seed(2))
    out, samples, run = {"shape": shape, "path": path, "rounds": rounds, "steps": steps}, {}, PATHS[path]
    with torch.inference_mode():
        for name, model in models.items():
            logits = []
            for on in (None, module):
                use_native_ops(model.decoder, on, torch.float32)
                logits.append(model.decoder(ids))
            out[f"{name}_max_logit_difference"] = float((logits[0] - logits[1]).abs().max())
            out[f"{name}_largest_logit"] = float(logits[0].abs().max())
    for _ in range(rounds):
        for batch in (1, 8):
            for name, model in models.items():
                for label, on in (("torch", None), ("native", module)):
                    use_native_ops(model.decoder, on, torch.float32)
                    run(model, batch, 2)
                    samples.setdefault(f"{name}_b{batch}_{label}_cpu_ms", []).extend(
                        c / 1e6 for c, _ in run(model, batch, steps))
        print(shape, "round done, load", os.getloadavg()[0], flush=True)
    out["median_cpu_ms"] = {k: statistics.median(v) for k, v in samples.items()}
    m = out["median_cpu_ms"]
    ratios = {f"{name}_b{b}_native_over_torch": m[f"{name}_b{b}_native_cpu_ms"] / m[f"{name}_b{b}_torch_cpu_ms"]
              for name in models for b in (1, 8)}
    for b in (1, 8):
        for label in ("torch", "native"):
            ratios[f"w4_over_float32_b{b}_{label}"] = m[f"w4_b{b}_{label}_cpu_ms"] / m[f"float32_b{b}_{label}_cpu_ms"]
    out["ratios"] = ratios
    out["load_average_end"] = os.getloadavg()
    print(json.dumps({k: out[k] for k in ("median_cpu_ms", "ratios")}), flush=True)
    return out


def itl_child(shape: str, steps: int, repeats: int) -> dict:
    """In a --compare child: the median process CPU ms per step of each model, batch and path."""
    models = {"float32": random_model(SHAPES[shape], quantized=False), "w4": random_model(SHAPES[shape], quantized=True)}
    out = {}
    for path, run in PATHS.items():
        for batch in (1, 8):
            for name, model in models.items():
                run(model, batch, 2)
                times = [t for _ in range(repeats) for t in run(model, batch, steps)]
                out[f"{path}_{name}_b{batch}_cpu_ms"] = median_ms(times, 0)
    return out


def tree_at(rev: str, into: str, overlay: list[str] = ()) -> str:
    """The files of git revision ``rev`` under ``into`` (``git archive``), with the paths ``overlay``
    copied over from this working tree (one change measured alone in a tree others also edit)."""
    archive = subprocess.run(["git", "archive", rev], cwd=ROOT, capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", into], input=archive, check=True)
    for path in overlay:
        (Path(into) / path).parent.mkdir(parents=True, exist_ok=True)
        (Path(into) / path).write_bytes((ROOT / path).read_bytes())
    return into


def compare(rev: str, overlay: list[str], shape: str, rounds: int, steps: int, threads: int) -> dict:
    """Plain step times of revision ``rev`` and of this tree (or of ``rev`` with ``overlay`` from
    this tree), child processes alternating per round."""
    with tempfile.TemporaryDirectory(prefix="lowbit-before-") as before, \
            tempfile.TemporaryDirectory(prefix="lowbit-after-") as after:
        codes = {f"before ({rev})": tree_at(rev, before),
                 "after" + (f" ({rev} + {', '.join(overlay)})" if overlay else " (this tree)"):
                     tree_at(rev, after, overlay) if overlay else str(ROOT)}
        samples = {name: [] for name in codes}
        # each tree its own native build folder: git archive writes old file times, so in a shared one
        # ninja keeps whichever tree's kernels were built last and times them for both
        envs = {name: {**os.environ, "LOWBIT_NATIVE_CACHE": str(Path(before if i == 0 else after) / ".native")}
                for i, name in enumerate(codes)}
        for _ in range(rounds):
            for name, code in codes.items():
                out = subprocess.run([sys.executable, "-m", "bench.cpu_overhead", "--itl-child", shape, "--code", code,
                                      "--steps", str(steps), "--threads", str(threads)],
                                     cwd=ROOT, capture_output=True, text=True, check=True, env=envs[name]).stdout
                samples[name].append({**json.loads(out.strip().splitlines()[-1]), "load_average": os.getloadavg()[0]})
                print(name, json.dumps(samples[name][-1]), flush=True)
    medians = {name: {k: statistics.median(r[k] for r in rows) for k in rows[0] if k != "code"}
               for name, rows in samples.items()}
    # another job slows a round, never speeds it: the fastest round is each code's own cost
    minima = {name: {k: min(r[k] for r in rows) for k in rows[0] if k.endswith("_cpu_ms")} for name, rows in samples.items()}
    return {"shape": shape, "revision": rev, "overlay": overlay, "median_of_rounds": medians, "min_of_rounds": minima,
            "after_over_before": ratios(*medians.values()), "after_over_before_min": ratios(*minima.values()),
            "rounds": samples}


def ratios(first: dict, second: dict) -> dict:
    """After over before per configuration, and W4 over float32 of each."""
    out = {k: second[k] / first[k] for k in first if k.endswith("_cpu_ms")}
    for path in PATHS:
        for batch in (1, 8):
            for name, m in (("before", first), ("after", second)):
                out[f"{path}_w4_over_float32_b{batch}_{name}"] = (m[f"{path}_w4_b{batch}_cpu_ms"]
                                                                  / m[f"{path}_float32_b{batch}_cpu_ms"])
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="smollm2-135m")
    ap.add_argument("--paths", default="decoder,engine", help="the breakdown's paths ('' to skip it)")
    ap.add_argument("--compare", metavar="REV", help="also time the code at git revision REV against this tree")
    ap.add_argument("--overlay", default="", help="with --compare: the after tree is REV with these paths "
                                                   "(comma-separated) from this tree, not the whole tree")
    ap.add_argument("--rounds", type=int, default=3, help="rounds of --compare and --native-ops")
    ap.add_argument("--native-ops", action="store_true", help="time the native decode ops against PyTorch's")
    ap.add_argument("--native-ops-path", default="decoder", choices=sorted(PATHS), help="the steps --native-ops times")
    ap.add_argument("--repeats", type=int, default=3, help="plain runs per breakdown row / per --compare child")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (breakdown and --compare)")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "cpu" / "cpu-overhead.json")
    ap.add_argument("--itl-child", help=argparse.SUPPRESS)
    ap.add_argument("--code", metavar="DIR", help="import the runtime from DIR (e.g. a git archive of a revision: "
                                                  "a tree others are editing measured as committed); read at the top")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    import runtime

    if args.itl_child:
        print(json.dumps({"code": str(Path(runtime.__file__).parent.parent),
                          **itl_child(args.itl_child, args.steps, args.repeats)}))
        return
    result = {"commit": commit(), "device": f"cpu: {cpu_name()}", "threads": torch.get_num_threads(),
              "omp_env": {k: v for k, v in os.environ.items() if k.startswith(("OMP_", "GOMP_", "KMP_"))},
              "versions": versions(), "protocol": __doc__.split("\n\n", 2)[2].strip(),
              "command": "python -m bench.cpu_overhead " + " ".join(sys.argv[1:]),
              "note": "a shared 2-core machine: other sessions' jobs may have run at the same time (load_average "
                      "per row); process CPU time with 1 thread is the step's own work",
              "runtime_from": str(Path(runtime.__file__).parent.parent),  # commit: that tree's (unknown: no .git)
              "tree_commit": subprocess.run(["git", "describe", "--always", "--dirty"], cwd=ROOT, capture_output=True,
                                            text=True).stdout.strip(),
              "load_average_start": os.getloadavg(), "breakdown": [], "compare": [], "native_ops": []}
    for shape in args.shapes.split(","):
        paths = list(filter(None, args.paths.split(",")))
        models = {"float32": random_model(SHAPES[shape], quantized=False),
                  "w4": random_model(SHAPES[shape], quantized=True)} if paths else {}
        for path in paths:
            for batch in (1, 8):
                for name, model in models.items():
                    row = {"shape": shape, "model": name, "batch": batch, "path": path,
                           **breakdown(model, batch, path, args.steps, args.repeats), "load_average": os.getloadavg()[0]}
                    result["breakdown"].append(row)
                    print(json.dumps(row), flush=True)
        del models
        if args.compare:
            overlay = list(filter(None, args.overlay.split(",")))
            result["compare"].append(compare(args.compare, overlay, shape, args.rounds, args.steps, args.threads))
        if args.native_ops:
            result["native_ops"].append(native_ops(shape, args.rounds, args.steps, args.native_ops_path))
    write_result(args.out, result)


if __name__ == "__main__":
    main()
