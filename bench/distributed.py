"""Calibration on 1 and on 2 ranks: SmolLM2-135M, GPTQ 4-bit g64 asymmetric, on CPU (gloo).

    python -m bench.distributed [--samples 128] [--seq-len 512] [--tokens 16384] [--out PATH]

Each world size runs as `torchrun --standalone --nproc-per-node R bench/distributed.py --rank-run`
would run `lowbit quantize` (the same pipeline, ``quant.distributed`` joining the ranks), one
thread per rank (OMP_NUM_THREADS=1), so two ranks use two cores and one rank one. Reported per
world size and rank:

* ``wall_s``: the pipeline from the recipe to the saved checkpoint (rank 0 saves);
* ``comm_s`` and ``comm_share``: time inside collectives (summing Hessians and AWQ statistics,
  broadcasting quantized Linears, barriers), waiting for slower ranks included, and its share of
  ``wall_s``: with more ranks the forward passes shrink and this part does not;
* ``peak_rss``: the rank's peak resident memory (getrusage).

Then the perplexity of each checkpoint on both bundled texts (Persuasion and Python source),
through ``lowbit eval``'s code. Two ranks sum the same statistics in another order, and GPTQ's
error feedback carries such differences through the layers, so the noise floor is measured too:
one rank with the calibration batches halved (``batch_size`` 4: the same samples, xᵀx summed in
another order), whose perplexity differs from the plain one-rank run by that noise alone.

The speed-up on this machine is bounded by its cores (and by other work on them); scaling to
more ranks or GPUs is a projection from ``comm_share``, not a measurement.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

from bench.results_file import write_result
from bench.scoring import commit

ROOT = Path(__file__).resolve().parent.parent


def recipe_for(out_dir: Path, samples: int, seq_len: int) -> dict:
    return {
        "model": "smollm2-135m", "output": str(out_dir / "ckpt"), "dtype": "bfloat16",
        "calibration": {"text": "default", "samples": samples, "seq_len": seq_len, "seed": 0},
        "weights": {"methods": ["gptq"], "bits": 4, "group_size": 64, "symmetric": False, "ignore": ["lm_head"]},
    }


def rank_run(recipe_path: Path, report_dir: Path, batch_size: int) -> None:
    """One rank under torchrun: quantize, then report its own time, communication and memory."""
    import functools

    import quant.quantize
    from lowbit import launch, pipeline
    from lowbit.recipe_files import load_recipe

    if batch_size != 8:  # the pipeline's own batch (no recipe key): only the noise-floor run changes it
        quant.quantize.quantize_sequential = functools.partial(quant.quantize.quantize_sequential,
                                                               batch_size=batch_size)

    recipe = load_recipe(str(recipe_path))
    with launch.this_rank("cpu") as (world, device):
        start = time.perf_counter()
        pipeline.quantize(recipe, overwrite=True, device=device, progress=False)
        wall = time.perf_counter() - start
        comm = world.comm_seconds
    row = {"rank": world.rank, "world_size": world.size, "wall_s": wall, "comm_s": comm, "comm_share": comm / wall,
           "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
    (report_dir / f"rank{world.rank}.json").write_text(json.dumps(row))


def run_world(ranks: int, work: Path, samples: int, seq_len: int, batch_size: int = 8) -> dict:
    out_dir = work / f"ranks{ranks}-batch{batch_size}"
    out_dir.mkdir(parents=True, exist_ok=True)
    recipe = out_dir / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(recipe_for(out_dir, samples, seq_len)))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}",
               "-m", "bench.distributed", "--rank-run", str(recipe), str(out_dir), str(batch_size)]
    start = time.perf_counter()
    subprocess.run(command, env=env, check=True)
    launched = time.perf_counter() - start
    rows = [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(ranks)]
    return {"ranks": ranks, "batch_size": batch_size, "wall_s": max(r["wall_s"] for r in rows), "launch_wall_s": launched, "per_rank": rows,
            "checkpoint": str(out_dir / "ckpt")}


def perplexities(ckpt: str, tokens: int) -> dict:
    from lowbit import pipeline

    protocol = pipeline.make_protocol(tokens=tokens)
    return {text: pipeline.evaluate(ckpt, use_baseline=False, text=text, protocol=protocol, progress=False)["ppl"]
            for text in ("default", "code")}


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--rank-run":
        rank_run(Path(sys.argv[2]), Path(sys.argv[3]), int(sys.argv[4]))
        return
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=128)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--tokens", type=int, default=16384, help="tokens of each text to score")
    parser.add_argument("--out", type=Path, default=None,
                        help="default: bench/results/distributed/calibration-ranks-COMMIT.json")
    args = parser.parse_args()
    from evals.provenance import provenance

    with tempfile.TemporaryDirectory(prefix="lowbit-distributed-") as tmp:
        runs = [run_world(r, Path(tmp), args.samples, args.seq_len) for r in (1, 2)]
        runs.append(run_world(1, Path(tmp), args.samples, args.seq_len, batch_size=4))  # the noise floor
        for run in runs:
            run["ppl"] = perplexities(run.pop("checkpoint"), args.tokens)
    one, two, floor = runs
    record = {
        "bench": "distributed",
        "protocol": {"model": "smollm2-135m", "methods": ["gptq"], "scheme": "w4 g64 asym", "samples": args.samples,
                     "seq_len": args.seq_len, "threads_per_rank": 1, "backend": "gloo", "ppl_tokens": args.tokens,
                     "note": "wall_s: the slowest rank's pipeline time; comm_s includes waiting for other ranks"},
        "runs": runs,
        "speedup_2_ranks": one["wall_s"] / two["wall_s"],
        "ppl_delta_pct": {t: 100 * (two["ppl"][t] / one["ppl"][t] - 1) for t in one["ppl"]},
        "ppl_noise_floor_pct": {t: 100 * (floor["ppl"][t] / one["ppl"][t] - 1) for t in one["ppl"]},
        **provenance(),
    }
    out = args.out or ROOT / "bench" / "results" / "distributed" / f"calibration-ranks-{commit()}.json"
    write_result(out, record)
    for run in runs:
        ranks = ", ".join(f"rank {r['rank']}: comm {100 * r['comm_share']:.1f}%, peak {r['peak_rss'] / 2**20:.0f} MiB"
                          for r in run["per_rank"])
        print(f"{run['ranks']} rank(s), batches of {run['batch_size']}: {run['wall_s']:.1f} s ({ranks}); "
              f"ppl {run['ppl']}")
    print(f"speed-up with 2 ranks: {record['speedup_2_ranks']:.2f}x")


if __name__ == "__main__":
    main()
