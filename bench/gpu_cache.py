"""The Triton cache of the quantized-matmul kernels bench/gpu_first.py compiles, built here without a
GPU (sm_90a, Triton 3.6: the lent machine's), packed to travel with the device call, unpacked there.

    make gpu-cache                                      # build: .venv-triton36, ~2 s CPU a kernel
    python -m bench.gpu_cache key                       # this machine's key parts (what a hit needs)
    python -m bench.gpu_cache check .gpu-cache/triton-sm90a.tar.xz   # unpack into a fresh dir, replay: hits?

Triton keys an on-disk cache entry by sha256 of ``triton_key()-src.hash()-backend.hash()-
options.hash()-env_vars`` (``triton/runtime/cache.py``, ``compiler.compile``):

* ``triton_key()``: sha256s of Triton's own compiler/backends/language Python files and of
  ``_C/libtriton.so``, which is built per Python ABI: a cache made under this machine's Python 3.11
  never hits under the lent machine's 3.12. So the build replaces ``triton_key`` with the one
  ``wheel_triton_key`` computes, by the same recipe, over the files of the cp312 wheel of the same
  release (downloaded by pip, never imported here). Assumed, checked only on the GPU (``key_parts``
  compared with the manifest by gpu_first's env step): the lent machine's Triton 3.6.0 is that wheel
  (torch 2.11's pin) and not a rebuild.
* ``src.hash()``: the kernel's source and the sources it calls, its constexprs, and each argument's
  specialization (dtype, 16-divisibility of integers and pointers): the launches are replayed as
  ``bench/gpu_compiles`` records them (quant_matmul's real launch code, meta tensors of the real
  shapes), so they match while ``runtime/kernels`` is the tree that built the cache (the manifest
  keeps its commit and a hash of the kernel sources).
* ``backend.hash()``: ``ptxas --version`` (the wheel's own ptxas, the same in every build of a
  release, unless TRITON_PTXAS_PATH names another there) and the arch, 90 (``GPUTarget("cuda", 90,
  32)``: an H100 or H200 reports capability 9.0).
* ``options.hash()``: num_warps/stages/ctas and the backend's defaults; libdevice by its contents,
  not its path. ``env_vars``: Triton's cache-invalidating TRITON_* variables that are set (none here).

A hit also needs the cache group's child paths, which Triton stores absolute: ``unpack`` rewrites
them to where it unpacks. Not covered here (they compile on the GPU, and gpu_first lists them by
name): attention, KV-write and the fused small-op kernels, whose launches need the runtime's CUDA
paths to replay.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import pkgutil
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CACHE_TAR = ROOT / ".gpu-cache" / "triton-sm90a.tar.xz"  # ignored by git: the device call carries .gpu-cache
GPU_PYTHON = "3.12"  # the lent machine's (KINDS.md), whose libtriton.so enters triton_key
TRITON_RELEASE = "3.6.0"  # torch 2.11's pin, the lent machine's
MANIFEST = "lowbit-manifest.json"


# ----------------------------------------------------------------------------------- the key


def wheel_triton_key(wheel: Path) -> str:
    """``triton.runtime.cache.triton_key()`` as Triton computes it where ``wheel`` is installed: its
    version, then sha256s of runtime/cache.py, every module under compiler/ and backends/ (the
    order of ``pkgutil.walk_packages``), libtriton.so, every module under language/; read from the
    wheel's files, nothing imported (the wheel's libtriton is another Python's)."""
    with tempfile.TemporaryDirectory() as tmp, zipfile.ZipFile(wheel) as z:
        wanted = [n for n in z.namelist() if n.startswith("triton/") and (n.endswith(".py") or
                                                                            n == "triton/_C/libtriton.so")]
        z.extractall(tmp, wanted)
        version = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        version = next(line.split(":", 1)[1].strip() for line in z.read(version).decode().splitlines()
                       if line.startswith("Version:"))
        return tree_triton_key(Path(tmp) / "triton", version)


def tree_triton_key(triton_dir: Path, version: str) -> str:
    """triton_key's recipe over an installed or unpacked ``triton`` folder (see wheel_triton_key)."""
    def digest(path) -> str:
        h = hashlib.sha256()
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
        return h.hexdigest()

    def walk(path: Path, prefix: str):  # walk_packages without importing: a package is a folder with __init__
        for info in pkgutil.iter_modules([str(path)], prefix):
            last = info.name.rsplit(".", 1)[-1]
            yield path / last / "__init__.py" if info.ispkg else path / f"{last}.py"
            if info.ispkg:
                yield from walk(path / last, info.name + ".")

    contents = [digest(triton_dir / "runtime" / "cache.py")]
    for sub in ("compiler", "backends"):
        contents += [digest(p) for p in walk(triton_dir / sub, f"triton.{sub}.")]
    contents.append(digest(triton_dir / "_C" / "libtriton.so"))
    contents += [digest(p) for p in walk(triton_dir / "language", "triton.language.")]
    return version + "-".join(contents)


def key_parts() -> dict:
    """The parts of Triton's cache key that depend on the machine, as this one computes them (no GPU
    needed): triton_key (sha256 of it), ptxas --version for sm_90, the cache-invalidating env vars."""
    import triton
    from triton._C.libtriton import get_cache_invalidating_env_vars
    from triton.backends.nvidia.compiler import get_ptxas_version
    from triton.runtime.cache import triton_key

    return {"triton": triton.__version__, "python": sys.version.split()[0],
            "triton_key_sha256": hashlib.sha256(triton_key().encode()).hexdigest(),
            "ptxas": get_ptxas_version(90).strip().splitlines()[-1],
            "env_vars": dict(sorted(get_cache_invalidating_env_vars().items()))}


def kernels_source_hash() -> str:
    """sha256 over runtime/kernels/*.py: a carried cache is for the kernel sources it was built from."""
    h = hashlib.sha256()
    for path in sorted((ROOT / "runtime" / "kernels").glob("*.py")):
        h.update(path.name.encode() + b"\0" + path.read_bytes())
    return h.hexdigest()


# ------------------------------------------------------------------------------ the entries


def entries(cache_dir: Path) -> dict:
    """Kernel name -> entries (one per compiled variant) in a Triton cache folder."""
    names: dict = {}
    for grp in Path(cache_dir).glob("*/__grp__*.json"):
        name = grp.name.removeprefix("__grp__").removesuffix(".json")
        names[name] = names.get(name, 0) + 1
    return dict(sorted(names.items()))


def count(cache_dir: Path) -> int:
    return sum(entries(cache_dir).values())


def unpack(tar: Path, cache_dir: Path) -> dict:
    """The carried cache into ``cache_dir`` (kept entries stay), each group's absolute child paths
    rewritten to it (Triton looks the files up there); returns entries before/after and the
    manifest."""
    cache_dir = Path(cache_dir)
    cache_dir.mkdir(parents=True, exist_ok=True)
    before = count(cache_dir)
    with tarfile.open(tar) as t:
        t.extractall(cache_dir, filter="data")
    for grp in cache_dir.glob("*/__grp__*.json"):
        data = json.loads(grp.read_text())
        data["child_paths"] = {name: str(grp.parent / Path(p).name) for name, p in data["child_paths"].items()}
        grp.write_text(json.dumps(data))
    manifest_path = cache_dir / MANIFEST
    manifest = json.loads(manifest_path.read_text()) if manifest_path.exists() else None
    return {"tar": str(tar), "tar_bytes": Path(tar).stat().st_size, "entries_before": before,
            "entries_after": count(cache_dir), "manifest": manifest}


def pack(cache_dir: Path, out: Path, manifest: dict | None = None, since: float | None = None,
         preset: int = 9) -> int:
    """``cache_dir``'s entries (those made from ``since``, a time, when given) and ``manifest`` as
    tar.xz at ``out``; returns its size in bytes."""
    cache_dir, out = Path(cache_dir), Path(out)
    if manifest is not None:
        (cache_dir / MANIFEST).write_text(json.dumps(manifest, indent=1, default=str) + "\n")
    out.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(out, "w:xz", preset=preset) as t:
        for path in sorted(cache_dir.iterdir()):
            if (path.is_dir() and (since is None or path.stat().st_mtime >= since)) or \
                    (path.name == MANIFEST and manifest is not None):
                t.add(path, arcname=path.name)
    return out.stat().st_size


def carried(folder: Path = CACHE_TAR.parent) -> list[Path]:
    """The caches to unpack: ``make gpu-cache``'s and any packed on a GPU by an earlier gpu_first run
    (``triton-*.tar.xz``, copied here from its $OUT)."""
    return sorted(Path(folder).glob("triton-*.tar.xz"))


# ------------------------------------------------------------------------------------ build


def build(tasks: list, out: Path, gpu_triton_key: str | None, workers: int) -> dict:
    """Compile ``tasks`` (``bench.gpu_compiles`` compile tasks) for sm_90a into a fresh cache, in
    ``workers`` processes, keyed with ``gpu_triton_key`` (the lent machine's triton_key; None: this
    machine's), and pack it at ``out``."""
    started, cpu = time.time(), time.process_time()
    with tempfile.TemporaryDirectory(prefix="lowbit-triton-cache-") as cache:
        env = {**os.environ, "TRITON_CACHE_DIR": cache, "PYTHONPATH": str(ROOT)}
        env.pop("TRITON_INTERPRET", None)
        parts = [tasks[i::workers] for i in range(workers)]
        procs = []
        for i, part in enumerate(parts):
            spec = Path(cache) / f"tasks-{i}.json"
            spec.write_text(json.dumps({"tasks": part, "triton_key": gpu_triton_key}))
            procs.append(subprocess.Popen([sys.executable, "-m", "bench.gpu_cache", "compile-part", str(spec)],
                                          env=env, cwd=ROOT, stdout=subprocess.PIPE, text=True))
        results = [json.loads(p.communicate()[0].strip().splitlines()[-1]) for p in procs]
        for spec in Path(cache).glob("tasks-*.json"):
            spec.unlink()
        from bench.gpu_stages import commit

        manifest = {"built_by": "bench/gpu_cache.py (make gpu-cache)", "commit": commit(),
                    "kernels_source_sha256": kernels_source_hash(), "target": "cuda sm_90a (GPUTarget cuda 90 32)",
                    "key_parts_here": key_parts(), "gpu_python": GPU_PYTHON,
                    "triton_key_sha256": hashlib.sha256(gpu_triton_key.encode()).hexdigest()
                    if gpu_triton_key else key_parts()["triton_key_sha256"], "triton_key": gpu_triton_key,
                    "tasks": len(tasks), "task_list": tasks, "compiled": sum(r["done"] for r in results),
                    "errors": [e for r in results for e in r["errors"]][:5], "entries": count(Path(cache)),
                    "by_kernel": entries(Path(cache)), "workers": workers,
                    "compile_cpu_s": round(sum(r["cpu_s"] for r in results), 1)}
        manifest["build_wall_s"] = round(time.time() - started, 1)
        manifest["tar_bytes"] = pack(Path(cache), out, manifest)
        manifest["pack_cpu_s"] = round(time.process_time() - cpu, 1)
    return manifest


def compile_part(spec_path: str) -> None:
    """A build worker: its tasks compiled through ``JITFunction.run``'s warmup (compile, no launch)
    for sm_90a with the stand-in driver, triton_key replaced by the GPU machine's."""
    import torch
    from unittest import mock

    import triton.runtime.cache as triton_cache
    from triton.runtime.driver import driver

    from bench.gpu_compiles import StandInDriver, compile_tasks

    spec = json.loads(Path(spec_path).read_text())
    if spec["triton_key"]:
        triton_cache.triton_key = lambda: spec["triton_key"]
    driver.set_active(StandInDriver())
    tasks = [(tuple(s), M, dtype, bias, _config(c)) for s, M, dtype, bias, c in spec["tasks"]]
    cpu = time.process_time()
    with mock.patch.object(torch.cuda, "get_device_capability", lambda *a: (9, 0)):
        done, errors = compile_tasks(tasks)
    print(json.dumps({"done": done, "errors": errors, "cpu_s": time.process_time() - cpu}))


def _config(fields: dict):
    from runtime.kernels.matmul_configs import MatmulConfig

    return MatmulConfig(**fields)


def task_json(task) -> list:
    """A compile task (``gpu_compiles``: spec, rows, dtype, bias, MatmulConfig) as JSON."""
    spec, M, dtype, bias, config = task
    return [list(spec), M, dtype, bias, config.__dict__]


def check(tar: Path) -> dict:
    """Unpack ``tar`` into a fresh folder, then replay its manifest's first tasks' launches through
    warmup here (stand-in driver): every kernel must come from the cache (no new entry)."""
    with tempfile.TemporaryDirectory() as cache:
        unpacked = unpack(tar, Path(cache))
        env = {**os.environ, "TRITON_CACHE_DIR": cache, "PYTHONPATH": str(ROOT)}
        spec = Path(cache) / "replay.json"
        manifest = json.loads((Path(cache) / MANIFEST).read_text())
        tasks = manifest["task_list"]
        spec.write_text(json.dumps({"tasks": tasks, "triton_key": manifest["triton_key"]}))
        proc = subprocess.run([sys.executable, "-m", "bench.gpu_cache", "compile-part", str(spec)], env=env,
                              cwd=ROOT, capture_output=True, text=True)
        if proc.returncode:
            raise RuntimeError(proc.stderr[-2000:])
        replay = json.loads(proc.stdout.strip().splitlines()[-1])
        return {**{k: v for k, v in unpacked.items() if k != "manifest"}, "replayed": len(tasks),
                "replay_errors": replay["errors"][:3], "replay_cpu_s": round(replay["cpu_s"], 1),
                "compile_cpu_s_at_build": manifest.get("compile_cpu_s"), "entries_after_replay": count(Path(cache))}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="verb", required=True)
    b = sub.add_parser("build", help="compile gpu_first's quantized-matmul kernels for sm_90a and pack them")
    b.add_argument("--wheel", type=Path, help=f"the cp{GPU_PYTHON.replace('.', '')} triton {TRITON_RELEASE} wheel "
                   "(its triton_key is the GPU machine's); without: this machine's key (hits only under this Python)")
    b.add_argument("--out", type=Path, default=CACHE_TAR)
    b.add_argument("--workers", type=int, default=max(1, min(os.cpu_count() or 1, 8)))
    sub.add_parser("key", help="print this machine's key parts")
    c = sub.add_parser("check", help="unpack into a fresh folder and replay the tasks here: all hits?")
    c.add_argument("tar", type=Path, nargs="?", default=CACHE_TAR)
    p = sub.add_parser("compile-part", help=argparse.SUPPRESS)
    p.add_argument("spec")
    args = ap.parse_args(argv)
    if args.verb == "compile-part":
        compile_part(args.spec)
    elif args.verb == "key":
        print(json.dumps(key_parts(), indent=1))
    elif args.verb == "check":
        print(json.dumps(check(args.tar), indent=1))
    else:
        from bench.gpu_first_plan import compile_tasks_of_run

        gpu_key = wheel_triton_key(args.wheel) if args.wheel else None
        tasks = [task_json(t) for t in compile_tasks_of_run()]
        manifest = build(tasks, args.out, gpu_key, args.workers)
        print(json.dumps({k: v for k, v in manifest.items() if k not in ("by_kernel", "task_list", "triton_key")},
                         indent=1))
        print(f"{args.out}: {manifest['tar_bytes'] / 2**20:.1f} MiB, {manifest['entries']} entries, "
              f"built in {manifest['build_wall_s']} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
