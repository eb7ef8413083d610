"""lowbit on the CPU it runs on: W4 against the float model, and against llama.cpp on the same weights
(issue 42, items 4-6).

    flock /tmp/lowbit-bench.lock .venv/bin/python -m bench.cpu_everywhere [--quick | --smoke] [--shapes smollm2-135m,llama-1b]
    # results: bench/results/cpu/<cpu-kind>/cpu-everywhere.json (<cpu-kind> e.g. amd-epyc-zen4-avx512)

Models: SmolLM2-135M (its real weights, as lowbit resolves the bundled model) and the Llama-3.2-1B shape
(``bench.cpu_decode.SHAPES``, random bf16 weights written by ``bench.load_memory.write_checkpoint``, SmolLM2's
tokenizer beside them); ``--smoke`` a tiny random Llama (``lowbit_testing``). Each float model is quantized by
the CLI (``lowbit quantize``, RTN) to W4 g32 symmetric and W4 g64 asymmetric, lm_head left float; the g32 sym
checkpoint is exported by ``lowbit export --gguf exact`` (Q4_0, its codes copied). Written once under
``out/cpu-everywhere/`` and reused.

1. Bandwidth: a float tensor (1 GB; --quick 512 MB) copied into another (``Tensor.copy_``, ATen's parallel
   copy at ``--threads``; GB/s counts bytes read plus written, STREAM's copy) and read (a sum), median
   and best of 7; again at the start of part 3 for its bound.
2. W4 against float (the targets of item 4): each model loaded by ``runtime.load`` (CPU, float32 for the
   float model; W4 through the CPU kernels) in this process at ``--threads``; prefill of 64, 256 and 1,024
   tokens (batch 1, ``bench.cpu_decode.prefill_seconds``, wall) and decode ITL at batch 1 and 8 after a
   32-token prompt (``bench.cpu_decode.side_by_side``), the three models alternating round by round;
   medians; W4/float ratios against the targets prefill <= 1.0x, ITL <= 0.5x.
3. The peer: llama.cpp's ``llama-bench -m Q4_0 -p 512 -n 128 -t THREADS -r 1 -o json`` (each build found:
   ``make llama-cpp``'s AVX2 build; ``make llama-cpp-native``'s CPU backend built -DGGML_NATIVE=ON, which the
   same llama-bench loads first) against lowbit's own pp512 (one 512-token prefill, tokens/s, after one
   untimed) and tg128 (128 decode steps at batch 1 after a 1-token prompt, 128 / their summed wall time,
   after one untimed step) of the W4 g32 sym checkpoint the GGUF file was exported from. Every contender
   runs in a fresh child process, one after another in each round (medians reported, every round kept).
   llama-bench runs with lowbit's CLI's OpenMP settings by default (``--llama-env user``: without them, as
   a user runs it; on a quiet machine only). A child's peak resident memory is its ``ru_maxrss``
   (GNU time's ``%M``: llama.cpp maps the file, so its touched pages count; lowbit's includes the Python
   interpreter and torch); the lowbit child imports ``lowbit.cli_options`` as the CLI does. Beside each
   decode figure the memory bound: (the GGUF file's tensor bytes + the fp16 KV bytes read at the
   run's mean context) / the best read bandwidth measured at the part's start -> the most tokens/s a
   step that reads every weight once could reach, and each engine's fraction of it (above 1 where the
   load eased after the measurement).

The machine's CPU (lscpu's model name, family/model, the ISA flags that matter, torch's
``get_cpu_capability()``), torch's version, the commit, the threads and the load average before and after
each part are recorded. ``--quick``: one round, fewer steps; ``--smoke``: the tiny model, seconds (CI).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

if __name__ == "__main__":  # OpenMP as the lowbit CLI sets it: importing cli_options does, before torch loads
    import lowbit.cli_options  # noqa: F401

import torch  # noqa: E402

from bench.results_file import write_result  # noqa: E402
from evals.provenance import commit, cpu_name, versions  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
CHECKPOINTS = ROOT / "out" / "cpu-everywhere"
LLAMA_BIN = ROOT / ".llama-cpp" / "build" / "bin"  # make llama-cpp: the tests' AVX2-only build, llama-bench
# Each build: the folders its shared libraries load from, first found first. make llama-cpp-native rebuilds
# only the CPU backend (libggml-cpu.so) with -DGGML_NATIVE=ON; the AVX2 build's llama-bench loads it from there.
LLAMA_BUILDS = {"avx2": [LLAMA_BIN], "native": [ROOT / ".llama-cpp" / "build-native" / "bin", LLAMA_BIN]}
TIME = "/usr/bin/time"  # GNU time: a child's peak resident memory (run_child)
SCHEMES = {"w4g32sym": dict(bits=4, group_size=32, symmetric=True),
           "w4g64asym": dict(bits=4, group_size=64, symmetric=False)}
TARGETS = {"prefill": 1.0, "itl": 0.5}  # W4 / float: issue 42, item 4
FLAGS = ("avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16",
         "avx512_vnni", "avx_vnni", "amx_tile", "amx_bf16", "amx_int8", "asimd", "sve")
SMOKE_SHAPE = dict(hidden=128, layers=2, intermediate_size=256)
MODES = {  # prefill lengths, decode batches and steps, in-process rounds, peer rounds, peer -p/-n, bandwidth MB
    "full": dict(prefill=(64, 256, 1024), batches=(1, 8), steps=16, rounds=3, peer_rounds=3, pp=512, tg=128, mb=1024),
    "quick": dict(prefill=(64, 256, 1024), batches=(1, 8), steps=8, rounds=1, peer_rounds=1, pp=512, tg=128, mb=512),
    "smoke": dict(prefill=(8, 16), batches=(1, 2), steps=2, rounds=1, peer_rounds=1, pp=16, tg=8, mb=32),
}


# ---- the machine ----

def cpu_facts() -> dict:
    """What the result depends on: the CPU's model, family/model, ISA flags and torch's capability."""
    info = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            info.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    flags = set(info.get("flags", info.get("Features", "")).split())
    return {"model_name": cpu_name(), "vendor": info.get("vendor_id"), "family": info.get("cpu family"),
            "model": info.get("model"), "flags": sorted(f for f in FLAGS if f in flags),
            "torch_capability": torch.backends.cpu.get_cpu_capability(), "cores": os.cpu_count()}


def cpu_kind(facts: dict) -> str:
    """The folder name of a CPU kind: vendor line, microarchitecture where known, widest ISA level
    (amd-epyc-zen4-avx512, intel-xeon-amx, ...). Two machines of one kind should time alike."""
    name = facts["model_name"].lower()
    words = [w for w in re.sub(r"\(r\)|\(tm\)|cpu|processor|@.*", " ", name).split() if w.isalpha()][:2]
    parts = words or [facts.get("vendor") or "cpu"]
    arch = amd_zen(facts)
    if arch:
        parts.append(arch)
    flags = set(facts["flags"])
    level = ("amx" if "amx_tile" in flags else "avx512" if "avx512f" in flags else "avx2" if "avx2" in flags
             else "sve" if "sve" in flags else "neon" if "asimd" in flags else "base")
    return "-".join([*parts, level])


def amd_zen(facts: dict) -> str | None:
    """AMD's Zen generation from family/model (AMD's published ranges), None for other vendors."""
    if facts.get("vendor") != "AuthenticAMD" or not facts.get("family"):
        return None
    family, model = int(facts["family"]), int(facts["model"] or 0)
    if family == 23:
        return "zen2" if model >= 0x30 else "zen1"
    if family == 25:
        return "zen4" if 0x10 <= model <= 0x1F or 0x60 <= model <= 0xAF else "zen3"
    if family == 26:
        return "zen5"
    return None


def copy_bandwidth(megabytes: int, repeats: int = 7) -> dict:
    """GB/s of one large tensor copy at torch's thread count, bytes read + bytes written (STREAM's copy),
    and of reading it (a sum: the bytes a decode step's weights cost)."""
    n = megabytes * (1 << 20) // 4
    src, dst = torch.rand(n), torch.empty(n)
    dst.copy_(src)  # both touched: no page faults in the timed copies
    copies, reads = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        dst.copy_(src)
        copies.append(time.perf_counter() - start)
        start = time.perf_counter()
        src.sum()
        reads.append(time.perf_counter() - start)
    return {"megabytes": megabytes, "threads": torch.get_num_threads(), "median_s": statistics.median(copies),
            "copy_gb_per_s": 2 * 4 * n / statistics.median(copies) / 1e9, "best_gb_per_s": 2 * 4 * n / min(copies) / 1e9,
            "read_gb_per_s": 4 * n / statistics.median(reads) / 1e9, "best_read_gb_per_s": 4 * n / min(reads) / 1e9}


# ---- checkpoints (written once, by the CLI) ----

def lowbit_cli(*args: str) -> None:
    subprocess.run([str(Path(sys.executable).parent / "lowbit"), *args], check=True, cwd=ROOT,
                   stdout=subprocess.DEVNULL)


def float_checkpoint(shape: str, base: Path) -> Path:
    """The float model of ``shape``: SmolLM2-135M's own weights; the 1B shape and the smoke model random."""
    if shape == "smollm2-135m":
        from quant.models import resolve

        return Path(resolve("smollm2-135m"))
    target = base / f"{shape}-float"
    if (target / "config.json").exists():
        return target
    tmp = Path(tempfile.mkdtemp(prefix=f"{shape}-", dir=base))
    if shape == "smoke":
        from lowbit_testing.tiny_models import tiny_llama, tiny_tokenizer

        tokenizer = tiny_tokenizer(vocab_size=400)  # one with BPE merges, which llama.cpp needs
        model, _ = tiny_llama(hidden=SMOKE_SHAPE["hidden"], layers=SMOKE_SHAPE["layers"], vocab=len(tokenizer),
                              intermediate_size=SMOKE_SHAPE["intermediate_size"])
        model.to(torch.bfloat16).save_pretrained(tmp / "ckpt")
        tokenizer.save_pretrained(tmp / "ckpt")
    else:
        from bench.cpu_decode import SHAPES
        from bench.load_memory import write_checkpoint
        from quant.models import resolve

        write_checkpoint(tmp / "ckpt", SHAPES[shape], quantized=False)
        write_index(tmp / "ckpt")
        for name in ("tokenizer.json", "tokenizer_config.json"):  # SmolLM2's: GGUF export writes its vocabulary
            shutil.copy(Path(resolve("smollm2-135m")) / name, tmp / "ckpt" / name)
    (tmp / "ckpt").rename(target)
    shutil.rmtree(tmp)
    return target


def write_index(path: Path) -> None:
    """The shards' model.safetensors.index.json, which Hugging Face's loader (the quantizer's) needs."""
    from safetensors import safe_open

    weight_map = {}
    for shard in sorted(path.glob("*.safetensors")):
        with safe_open(shard, "pt") as f:
            weight_map.update(dict.fromkeys(f.keys(), shard.name))
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}, indent=1))


def w4_checkpoint(float_path: Path, shape: str, scheme: str, base: Path) -> Path:
    """``lowbit quantize`` (RTN, ``SCHEMES[scheme]``, lm_head float) of the float model, once."""
    target = base / f"{shape}-{scheme}"
    if not (target / "config.json").exists():
        s = SCHEMES[scheme]
        recipe = base / f"{scheme}.yaml"
        recipe.write_text(f"model: {float_path}\noutput: {target}\ndtype: bfloat16\nweights:\n  method: rtn\n"
                          f"  bits: {s['bits']}\n  group_size: {s['group_size']}\n"
                          f"  symmetric: {str(s['symmetric']).lower()}\n  ignore: [lm_head]\n")
        lowbit_cli("quantize", str(recipe), "--overwrite")
    return target


def gguf_file(checkpoint: Path) -> Path:
    """``lowbit export --gguf exact`` of a W4 g32 sym checkpoint: Q4_0 with its codes copied, once."""
    target = checkpoint.with_suffix(".gguf")
    if not target.exists():
        lowbit_cli("export", str(checkpoint), "--gguf", "exact", "-o", str(target))
    return target


# ---- part 2: W4 against the float model, in this process ----

def against_float(paths: dict[str, Path], mode: dict) -> dict:
    """Prefill seconds and decode ITL of every model, alternating; W4/float ratios and the targets."""
    import runtime
    from bench.cpu_decode import prefill_seconds, side_by_side

    models = {name: runtime.load(path) for name, path in paths.items()}
    out = {"load_average_start": os.getloadavg(), "prefill": [], "decode": []}
    for model in models.values():  # warm-up: the scratch grows, kernels are picked
        prefill_seconds(model, max(mode["prefill"]))
    for tokens in mode["prefill"]:
        samples = {name: [] for name in models}
        for _ in range(mode["rounds"]):
            for name, model in models.items():
                samples[name].append(prefill_seconds(model, tokens))
        row = {"tokens": tokens, **{f"{n}_s": statistics.median(s) for n, s in samples.items()},
               "rounds_s": samples, "load_average": os.getloadavg()[0]}
        out["prefill"].append(ratios(row, "_s", "prefill"))
        print(json.dumps(row), flush=True)
    for batch in mode["batches"]:
        timed = side_by_side(models, batch, 32, mode["steps"], mode["rounds"])
        row = {"batch": batch, **{f"{n}_itl_ms": t["median_itl_ms"] for n, t in timed.items()},
               "steps": timed, "load_average": os.getloadavg()[0]}
        out["decode"].append(ratios(row, "_itl_ms", "itl"))
        print(json.dumps({k: v for k, v in row.items() if k != "steps"}), flush=True)
    del models
    gc.collect()
    out["load_average_end"] = os.getloadavg()
    return out


def ratios(row: dict, suffix: str, target: str) -> dict:
    for scheme in SCHEMES:
        ratio = row[f"{scheme}{suffix}"] / row[f"float{suffix}"]
        row[f"{scheme}_over_float"] = ratio
        row[f"{scheme}_meets_target"] = ratio <= TARGETS[target]
    row["target"] = f"W4/float <= {TARGETS[target]}"
    return row


# ---- part 3: the peer, each contender a fresh child process ----

def run_child(command: list[str], env: dict) -> tuple[str, int]:
    """A child's stdout and its peak resident memory in bytes. GNU time's ``%M`` (its child's ``ru_maxrss``):
    a child forked from this process directly would report this process's resident memory too, which
    ``ru_maxrss`` keeps across ``exec``; forked from ``time`` it starts from time's few hundred KB."""
    with tempfile.TemporaryDirectory() as tmp:
        peak_file = Path(tmp) / "peak_kb"
        proc = subprocess.run([TIME, "-f", "%M", "-o", str(peak_file), *command], capture_output=True, text=True,
                              env=env, cwd=ROOT)
        if proc.returncode != 0:
            raise RuntimeError(f"{command[0]} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
        return proc.stdout, int(peak_file.read_text().split()[-1]) * 1024


def llama_env(kind: str) -> dict:
    """llama-bench's environment: OpenMP as lowbit's CLI sets it (``lowbit``: the same settings for both
    engines), or none of lowbit's OpenMP variables (``user``: as a user runs llama.cpp). llama.cpp's CPU
    backend is built with OpenMP; with its default spinning, a loaded 2-core machine made its 2-thread
    tg 50-100x slower (SmolLM2 Q4_0 tg16 0.53 against 53 tokens/s with PASSIVE, load 17)."""
    from lowbit.cli_options import OPENMP_DEFAULTS

    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMP_", "GOMP_", "KMP_"))}
    return {**env, **OPENMP_DEFAULTS} if kind == "lowbit" else env


def llama_bench(libraries: list[Path], gguf: Path, threads: int, pp: int, tg: int, env_kind: str) -> dict:
    env = llama_env(env_kind)
    env["LD_LIBRARY_PATH"] = ":".join(map(str, libraries))
    stdout, peak = run_child([str(LLAMA_BIN / "llama-bench"), "-m", str(gguf), "-p", str(pp), "-n", str(tg),
                              "-t", str(threads), "-r", "1", "-o", "json"], env)
    tests = json.loads(stdout)
    pp_row = next(t for t in tests if t["n_prompt"] == pp and t["n_gen"] == 0)
    tg_row = next(t for t in tests if t["n_gen"] == tg and t["n_prompt"] == 0)
    return {"pp_tokens_per_s": pp_row["avg_ts"], "tg_tokens_per_s": tg_row["avg_ts"], "peak_rss_bytes": peak,
            "llama_cpp": {k: tg_row.get(k) for k in ("build_commit", "build_number", "cpu_info", "backends",
                                                     "type_k", "type_v", "n_batch", "n_ubatch", "use_mmap")}}


def lowbit_child(checkpoint: Path, threads: int, pp: int, tg: int) -> dict:
    stdout, peak = run_child([sys.executable, "-m", "bench.cpu_everywhere", "--lowbit-one", str(checkpoint),
                              "--threads", str(threads), "--pp", str(pp), "--tg", str(tg)], dict(os.environ))
    return {**json.loads(stdout.strip().splitlines()[-1]), "peak_rss_bytes": peak}


def lowbit_one(checkpoint: Path, pp: int, tg: int) -> dict:
    """In the child: load, then pp (prefill of ``pp`` tokens) and tg (``tg`` decode steps at batch 1) as
    llama-bench times them, each after an untimed one."""
    import warnings

    import runtime
    from bench.cpu_decode import prefill_seconds, step_times

    warnings.simplefilter("ignore")
    rss_before = resident_bytes()
    model = runtime.load(checkpoint)
    rss_loaded = resident_bytes()
    prefill_seconds(model, pp)
    pp_s = prefill_seconds(model, pp)
    step_times(model, 1, 1, 1)
    steps = sorted(wall for wall, _ in step_times(model, 1, 1, tg))
    # llama-bench's figure is tokens / the run's time; on a loaded machine a few stalled steps sink it, so
    # 1 / the median step (lowbit speed's decode tokens/s) and the step-time spread are kept beside it
    return {"pp_tokens_per_s": pp / pp_s, "tg_tokens_per_s": tg / sum(steps),
            "tg_median_step_tokens_per_s": 1 / statistics.median(steps),
            "tg_step_ms": {"p10": 1e3 * steps[len(steps) // 10], "median": 1e3 * statistics.median(steps),
                           "p90": 1e3 * steps[9 * len(steps) // 10], "max": 1e3 * steps[-1]},
            "rss_before_load_bytes": rss_before, "rss_loaded_bytes": rss_loaded, "threads": torch.get_num_threads()}


def resident_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def memory_bound(gguf: Path, config: dict, context: float, bandwidth: float) -> dict:
    """The most decode tokens/s at batch 1 if a step reads every weight and its KV once at ``bandwidth``."""
    from gguf import GGUFReader

    weights = sum(int(t.n_bytes) for t in GGUFReader(gguf).tensors)
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    kv = 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * head_dim * 2 * context  # K and V, fp16
    return {"weight_bytes": weights, "kv_bytes_mean": kv, "bandwidth_gb_per_s": bandwidth / 1e9,
            "max_tokens_per_s": bandwidth / (weights + kv)}


def against_llama_cpp(checkpoint: Path, gguf: Path, mode: dict, threads: int, env_kind: str) -> dict:
    builds = {name: libs for name, libs in LLAMA_BUILDS.items()
              if (LLAMA_BIN / "llama-bench").exists() and (libs[0] / "libggml-cpu.so").exists()}
    out = {"load_average_start": os.getloadavg(),
           "builds": {n: {"library_path": [str(d.relative_to(ROOT)) for d in libs],
                          "libggml_cpu": resolved_cpu_backend(libs)} for n, libs in builds.items()},
           "gguf_bytes": gguf.stat().st_size, "llama_bench_env": env_kind,
           "llama_bench_omp": {k: v for k, v in llama_env(env_kind).items() if k.startswith(("OMP_", "GOMP_", "KMP_"))},
           "rounds": [], "bandwidth": copy_bandwidth(mode["mb"])}  # the bound's, at this part's own load
    if not builds:
        out["skipped"] = "no llama-bench: `make llama-cpp` (AVX2) and/or `make llama-cpp-native` build it"
    contenders = {**{f"llama.cpp-{n}": (lambda libs=libs: llama_bench(libs, gguf, threads, mode["pp"], mode["tg"], env_kind))
                     for n, libs in builds.items()},
                  "lowbit": lambda: lowbit_child(checkpoint, threads, mode["pp"], mode["tg"])}
    for _ in range(mode["peer_rounds"]):
        row = {"load_average": os.getloadavg()[0]}
        for name, run in contenders.items():
            row[name] = run()
            print(json.dumps({name: {k: v for k, v in row[name].items() if k != "llama_cpp"}}), flush=True)
        out["rounds"].append(row)
    config = json.loads((checkpoint / "config.json").read_text())
    # the best read of the part's start: a loaded machine's median understates what a step can read
    bound = memory_bound(gguf, config, mode["tg"] / 2, out["bandwidth"]["best_read_gb_per_s"] * 1e9)
    out["tg_memory_bound"] = bound
    out["median"] = {}
    for name in contenders:
        rounds = [r[name] for r in out["rounds"]]
        m = {k: statistics.median(r[k] for r in rounds) for k in ("pp_tokens_per_s", "tg_tokens_per_s", "peak_rss_bytes")}
        m["tg_fraction_of_bound"] = m["tg_tokens_per_s"] / bound["max_tokens_per_s"]
        out["median"][name] = m
    for name in builds:
        peer = out["median"][f"llama.cpp-{name}"]
        out[f"lowbit_over_llama.cpp-{name}"] = {
            k: out["median"]["lowbit"][k] / peer[k] for k in ("pp_tokens_per_s", "tg_tokens_per_s", "peak_rss_bytes")}
    out["load_average_end"] = os.getloadavg()
    return out


def resolved_cpu_backend(libraries: list[Path]) -> str | None:
    """Which libggml-cpu.so llama-bench loads with ``libraries`` first (ldd): the proof of a build's figures."""
    env = {**os.environ, "LD_LIBRARY_PATH": ":".join(map(str, libraries))}
    try:
        found = subprocess.run(["ldd", str(LLAMA_BIN / "llama-bench")], capture_output=True, text=True, env=env).stdout
    except OSError:
        return None
    line = next((l for l in found.splitlines() if "libggml-cpu" in l), None)
    return line.split("=>")[-1].split("(")[0].strip() if line else None


def llama_build_flags() -> dict:
    """Each llama.cpp build's CPU options as its CMakeCache.txt holds them (which build gave which figure)."""
    out = {}
    for name, libraries in LLAMA_BUILDS.items():
        cache = libraries[0].parent / "CMakeCache.txt"
        if cache.exists():
            out[name] = dict(re.findall(r"^(GGML_(?:NATIVE|AVX\w*|FMA|F16C|BMI2|AMX\w*|CPU_ALL_VARIANTS|BACKEND_DL|"
                                        r"OPENMP)):\w+=(\S*)$", cache.read_text(), re.M))
    return out


# ---- the run ----

def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="smollm2-135m,llama-1b")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="one round, fewer decode steps")
    ap.add_argument("--smoke", action="store_true", help="a tiny random model, seconds (the test)")
    ap.add_argument("--skip-peer", action="store_true", help="no llama.cpp part")
    ap.add_argument("--rounds", type=int, help="rounds of both parts (default: the mode's, 3; --quick 1)")
    ap.add_argument("--llama-env", choices=("lowbit", "user"), default="lowbit",
                    help="llama-bench's OpenMP settings: lowbit's CLI's (default: both engines alike) or none (as a "
                         "user runs it; on a quiet machine only: spinning threads collapse under load)")
    ap.add_argument("--add", action="store_true",
                    help="keep the other shapes of an existing result file (each shape's row has its own commit, settings, load)")
    ap.add_argument("--commit", help="the commit of the tree that runs, where it is no git checkout (a git archive of it)")
    ap.add_argument("--checkpoints", type=Path, default=CHECKPOINTS)
    ap.add_argument("--out", type=Path, help="default: bench/results/cpu/<cpu-kind>/cpu-everywhere.json")
    ap.add_argument("--lowbit-one", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--pp", type=int, default=512, help=argparse.SUPPRESS)
    ap.add_argument("--tg", type=int, default=128, help=argparse.SUPPRESS)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.lowbit_one:
        print(json.dumps(lowbit_one(args.lowbit_one, args.pp, args.tg)))
        return
    mode = dict(MODES["smoke" if args.smoke else "quick" if args.quick else "full"])
    if args.rounds:
        mode.update(rounds=args.rounds, peer_rounds=args.rounds)
    shapes = ["smoke"] if args.smoke else args.shapes.split(",")
    facts = cpu_facts()
    kind = cpu_kind(facts)
    out = args.out or ROOT / "bench" / "results" / "cpu" / kind / "cpu-everywhere.json"
    result = {"commit": args.commit or commit(), "device": f"cpu: {facts['model_name']}", "cpu_kind": kind, "cpu": facts,
              "threads": torch.get_num_threads(), "versions": versions(),
              "omp_env": {k: v for k, v in os.environ.items() if k.startswith(("OMP_", "GOMP_", "KMP_"))},
              "mode": "smoke" if args.smoke else "quick" if args.quick else "full", "settings": mode,
              "targets": TARGETS, "llama_cpp_builds": llama_build_flags(),
              "protocol": __doc__.split("\n\n", 2)[2].strip(),
              "note": "a shared 2-core machine: other sessions' jobs may have run at the same time; ratios are "
                      "between contenders timed in alternating rounds of one run",
              "command": "python -m bench.cpu_everywhere " + " ".join(sys.argv[1:]),
              "load_average_start": os.getloadavg(), "shapes": {}}
    if args.add and out.exists():
        result["shapes"] = {k: v for k, v in json.loads(out.read_text())["shapes"].items() if k not in shapes}
    result["bandwidth"] = copy_bandwidth(mode["mb"])
    print(json.dumps(result["bandwidth"]), flush=True)
    args.checkpoints.mkdir(parents=True, exist_ok=True)
    for shape in shapes:
        base = args.checkpoints / ("smoke" if args.smoke else "")
        base.mkdir(parents=True, exist_ok=True)
        float_path = float_checkpoint(shape, base)
        paths = {"float": float_path, **{s: w4_checkpoint(float_path, shape, s, base) for s in SCHEMES}}
        row = {"commit": result["commit"], "command": result["command"], "settings": mode,
               "bandwidth": result["bandwidth"], "llama_cpp_builds": result["llama_cpp_builds"],
               "checkpoints": {n: str(p) for n, p in paths.items()}, "vs_float": against_float(paths, mode)}
        if not args.skip_peer:
            gguf = gguf_file(paths["w4g32sym"])
            row["vs_llama_cpp"] = against_llama_cpp(paths["w4g32sym"], gguf, mode, args.threads, args.llama_env)
        result["shapes"][shape] = row
        write_result(out, result)  # after each shape: a long run keeps what it measured


if __name__ == "__main__":
    main()
