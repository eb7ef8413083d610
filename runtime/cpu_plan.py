"""Which path a CPU Linear runs for a prefill's rows, chosen by measurement on the machine it runs on
(issue 42): the weight-only kernel with bf16 activations, the weight dequantized into a scratch for a
dense **bf16** GEMM, or into a **float32** scratch for the float32 GEMM (MKL/oneDNN sgemm: the float
model's own product).

Why: a bf16 GEMM is fast only where the CPU has AVX512-BF16 or AMX (2-3x float32's on Zen 4);
elsewhere ATen runs a generic bf16 loop, 3-6x *slower* than float32 (an AVX2-only EPYC prefilled a
W4 model 48x slower than its float model). So per weight kind (``int4``: ``Int4Slots``, ``int8``:
``Int8Channels``, ``narrow``: ``NarrowLinear``'s bf16 float leftovers), shape, group and rows bucket
(:data:`BUCKETS`) the candidates are timed once, at the first prefill of that shape, beside the
**float bar**: float32 ``F.linear`` on a dense float32 weight of the shape. The pick
(:func:`pick`): the fastest candidate not slower than the bar; when every candidate is slower, the
float32 scratch (the bar plus one dequantizing pass) unless another beats it by :data:`MARGIN`.

* Weights under :data:`MIN_TIMED_WEIGHTS` follow the capability rule (below) untimed.
* Decode's few rows (up to :data:`DECODE_ROWS`) are not timed: they stay on the 4-bit kernels (bf16
  product for ``narrow``), memory-bound, where reading 4 bits a weight is the lever.
* Timing runs on a random weight of the layer's inputs and at most :data:`TIMED_WEIGHTS` weights
  (outputs cut to fit, whole kernel blocks): GEMM time per weight is flat in the outputs, and the
  1B model's q/k/v, o and gate/up then share one timing. A few seconds per model, once.
* Int8 activations (``torch._int_mm`` with per-row scales) are not a candidate: they change the
  model's numbers (a W8A8 product, not the weight-only one within bf16/fp32 rounding), so they need
  an accuracy gate (``lowbit eval``) before a speed race, not a timing.

Kept on disk per machine: one JSON file per CPU model, ATen capability, oneDNN ISA limit, torch
version, thread count, native kernels on/off and these sources' hash, in ``$LOWBIT_CPU_PLAN_CACHE``
(default ``~/.cache/lowbit/cpu_plan``; ``=0`` turns the disk cache off, the plan then lives per process).

``LOWBIT_CPU_PLAN`` picks how: ``measure`` (default), ``rule`` (no timing: the capability rule,
bf16 scratch only where AVX512-BF16 or AMX serve ATen's GEMM, float32 elsewhere, from the rows the
kernels' thresholds give), ``bf16`` / ``fp32`` (the rule with that scratch forced: ``bf16`` is the
path before issue 42, what the benches time as "before").
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import threading
import time
import warnings
from dataclasses import asdict, dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Callable

import torch

MODE_ENV = "LOWBIT_CPU_PLAN"
CACHE_ENV = "LOWBIT_CPU_PLAN_CACHE"
MODES = ("measure", "rule", "bf16", "fp32")
KERNEL, BF16, FP32 = "kernel", "bf16", "fp32"  # the weight-only kernel, the bf16 / float32 scratch GEMM
KINDS = ("int4", "int8", "narrow")  # narrow: no kernel; BF16 is its product in the weight's dtype
DECODE_ROWS = 8  # up to here the 4-bit kernels (memory-bound): not timed
TIMED_WEIGHTS = 1 << 21  # weights of the timed product (outputs cut to fit): 16-60 ms a call at 256 rows
MIN_TIMED_WEIGHTS = 1 << 17  # smaller weights follow the capability rule: their products take microseconds
# (a shared machine's noise decides a timing) and little time or memory is at stake (tests' tiny models)
TIMED_BLOCK = 64  # the cut keeps whole blocks of the int4 layout (and int8's 16-input rows)
REPEATS = 5  # timed calls per candidate at least, alternating; the minimum is kept (the machine is shared)
MAX_REPEATS = 20  # cheap calls are repeated up to this many rounds, until a bucket has had SETTLE_MS of them
SETTLE_MS = 100.0  # (a busy machine's descheduling spikes last milliseconds: many short calls find a quiet one)
HOPELESS = 3.0  # a candidate this many times the fastest call so far is not timed again (AVX2's bf16 GEMM: 40x)
MARGIN = 0.9  # a candidate slower than the bar beats the float32 scratch only at this ratio or better
NARROW_TOLERANCE = 1.05  # bf16 float leftovers are kept where their product is within this of the bar
PLAN_VERSION = 1
# The weights the candidates are timed on: runtime.cpu_linear's ``timing_weight`` (a random weight of a
# kind and shape with that kind's ``paths`` and ``product``), handed in when that module loads: it
# imports this one, so this one cannot import it back
timing_weight: Callable | None = None
SOURCES = ("cpu_plan.py", "cpu_linear.py", "cpu_int4_gemm.py", "cpu_int8_gemm.py", "native/int4_weights.cpp",
           "native/int4_gemm.cpp", "native/int8_gemm.cpp")


@dataclass(frozen=True)
class Bucket:
    name: str
    low: int
    high: int | None  # None: no upper end
    rows: int  # the row count timed for the bucket


BUCKETS = (Bucket("9-31", DECODE_ROWS + 1, 31, 16), Bucket("32-127", 32, 127, 64), Bucket("128+", 128, None, 256))


def bucket_of(rows: int) -> Bucket | None:
    """The rows bucket, None for decode's few rows."""
    for b in BUCKETS:
        if rows >= b.low and (b.high is None or rows <= b.high):
            return b
    return None


def _how(n: int, k: int) -> str:
    """The mode for a weight [n, k]: ``measure`` becomes ``rule`` under :data:`MIN_TIMED_WEIGHTS`."""
    how = mode()
    return "rule" if how == "measure" and n * k < MIN_TIMED_WEIGHTS else how


def mode() -> str:
    value = os.environ.get(MODE_ENV, "measure").strip().lower() or "measure"
    if value not in MODES:
        raise ValueError(f"{MODE_ENV}={value!r}: use one of {', '.join(MODES)}")
    return value


# ---------------------------------------------------------------- what the CPU reports


@lru_cache(maxsize=1)
def cpu_info() -> tuple[str, frozenset[str]]:
    """The CPU's model name and flags from /proc/cpuinfo (lscpu's source); empty where absent."""
    name, flags = "", frozenset()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and not name:
                name = value.strip()
            elif key.strip() in ("flags", "Features") and not flags:
                flags = frozenset(value.split())
    except OSError:
        pass
    import platform

    return name or platform.processor() or platform.machine(), flags


def onednn_isa() -> str:
    return os.environ.get("ONEDNN_MAX_CPU_ISA", os.environ.get("DNNL_MAX_CPU_ISA", "")).strip().upper()


def fast_bf16() -> bool:
    """Whether ATen's bf16 GEMM runs on bf16 hardware here: AVX512-BF16 or AMX in the CPU's flags, ATen
    dispatching at AVX512 and oneDNN not held below its bf16 ISA (``ONEDNN_MAX_CPU_ISA``, as the AVX2
    emulation sets)."""
    flags = cpu_info()[1]
    isa = onednn_isa()
    isa_ok = isa in ("", "ALL", "DEFAULT") or any(w in isa for w in ("BF16", "AMX", "FP16", "AVX10"))
    return bool(flags & {"avx512_bf16", "amx_bf16"}) and torch.backends.cpu.get_cpu_capability() != "AVX2" \
        and isa_ok


@lru_cache(maxsize=1)
def _static_machine() -> tuple:
    root = Path(__file__).resolve().parent
    digest = hashlib.sha256()
    for name in SOURCES:
        path = root / name
        digest.update(name.encode() + b"\0" + (path.read_bytes() if path.exists() else b"") + b"\0")
    name, flags = cpu_info()
    return (("cpu", name), ("capability", torch.backends.cpu.get_cpu_capability()),
            ("avx512_bf16", "avx512_bf16" in flags), ("amx", "amx_bf16" in flags), ("onednn_max_isa", onednn_isa()),
            ("torch", torch.__version__), ("sources", digest.hexdigest()[:16]), ("version", PLAN_VERSION))


def machine() -> dict:
    """Everything a plan depends on: the key of its cache file."""
    from runtime import native

    return dict(_static_machine(), threads=torch.get_num_threads(), native=native.enabled())


def machine_id(m: dict) -> str:
    return hashlib.sha256(json.dumps(m, sort_keys=True).encode()).hexdigest()[:16]


# ---------------------------------------------------------------- the choice


@dataclass
class Entry:
    """One (kind, shape, group, bucket)'s choice and the times it was made from."""

    path: str
    rows: int  # timed at
    times_ms: dict[str, float] = field(default_factory=dict)
    bar_ms: float | None = None  # float32 F.linear on a dense float32 weight of the timed shape
    timed_shape: tuple[int, int] | None = None
    bounds: list[str] = field(default_factory=list)  # candidates whose time is a lower bound (not timed here)

    @property
    def over_bar(self) -> float | None:
        """The chosen path's time over the bar (1.0: the float model's product)."""
        return self.times_ms[self.path] / self.bar_ms if self.bar_ms and self.path in self.times_ms else None


def pick(times: dict[str, float], bar: float, bounds=()) -> str:
    """The fastest candidate not slower than the bar; when all are slower, the float32 scratch (the
    bar plus one dequantizing pass, a cost that holds on every CPU) unless another is faster than it
    by :data:`MARGIN` (more than a shared machine's noise). ``bounds``: candidates not timed at these
    rows (their times are lower bounds, already hopeless): never picked while a timed one is left."""
    timed = {p: t for p, t in times.items() if p not in bounds}
    times = timed or times
    under = {p: t for p, t in times.items() if t <= bar}
    if under:
        return min(under, key=under.get)
    best = min(times, key=times.get)
    if FP32 in times and times[best] > MARGIN * times[FP32]:
        return FP32
    return best


def rule(threshold_reached: bool, kind: str, forced: str | None = None) -> str:
    """The capability rule: the scratch from the kernels' own thresholds (``threshold_reached``), in
    bf16 where the CPU has a bf16 GEMM, float32 elsewhere (``forced``: ``bf16``/``fp32``)."""
    scratch = forced or (BF16 if fast_bf16() else FP32)
    if kind == "narrow":
        return scratch
    return scratch if threshold_reached else KERNEL


def time_paths(runs: dict[str, Callable[[], object]], floors: dict[str, float] | None = None,
               repeats: int = REPEATS) -> tuple[dict[str, float], set[str]]:
    """Milliseconds per call of each run (wall: the products use every thread): the minimum of a first
    call and ``repeats`` more, alternating (other work on the machine only adds). A run already
    :data:`HOPELESS` times the fastest first call is not repeated, and one whose ``floors`` (its time
    at fewer rows: a lower bound) is, is not run at all; those come back in the set, the latter with
    the floor as its time. So a bf16 GEMM without bf16 hardware costs one call, not seven."""
    floors = floors or {}
    times: dict[str, float] = {}
    skipped: set[str] = set()
    for name in sorted(runs, key=lambda n: floors.get(n, 0.0)):  # likely fastest first: the best sets the bar
        timed = [t for n, t in times.items() if n in floors and n not in skipped]  # candidates timed here
        if name in floors and timed and floors[name] > HOPELESS * min(timed):
            times[name] = floors[name]
            skipped.add(name)
            continue
        best = min(times.values(), default=float("inf"))
        times[name] = _call_ms(runs[name])
        if times[name] > HOPELESS * best:  # a second chance: one call may have met a busy machine
            times[name] = min(times[name], _call_ms(runs[name]))
            if times[name] > HOPELESS * best:
                skipped.add(name)
    spent, rounds = 0.0, 0
    while rounds < repeats or (rounds < MAX_REPEATS and spent < SETTLE_MS):
        rounds += 1
        for name in runs:
            if name not in skipped:
                t = _call_ms(runs[name])
                spent += t
                times[name] = min(times[name], t)
    return times, {n for n in skipped if n in floors and times[n] == floors[n]}


def _call_ms(run: Callable[[], object]) -> float:
    start = time.perf_counter()
    run()
    return 1e3 * (time.perf_counter() - start)


def timed_shape(n: int, k: int) -> tuple[int, int]:
    """The outputs cut so that at most :data:`TIMED_WEIGHTS` weights are timed (whole blocks)."""
    fit = max(TIMED_BLOCK, (TIMED_WEIGHTS // k) // TIMED_BLOCK * TIMED_BLOCK)
    return (min(n, fit), k)


def measure(kind: str, n: int, k: int, group: int) -> dict[str, Entry]:
    """Times every bucket's candidates and the float bar on a random weight of (a cut of) the shape."""
    tn, tk = timed_shape(n, k)
    g = torch.Generator().manual_seed(tn * 7919 + tk)
    weight = timing_weight(kind, tn, tk, group, g)
    dense = torch.randn(tn, tk, generator=g)
    with torch.no_grad():
        return _measure_buckets(weight, dense, g)


def _measure_buckets(weight, dense: torch.Tensor, g: torch.Generator) -> dict[str, Entry]:
    plan, (tn, tk), floors = {}, tuple(dense.shape), {}
    few = torch.randn(2, tk, generator=g)
    for p in weight.paths:  # untimed: a native kernel's first use builds or loads it, the scratch grows
        weight.product(few, p)
    for b in BUCKETS:  # fewest rows first: each bucket's times are lower bounds for the next
        a = torch.randn(b.rows, tk, generator=g)
        runs = {"bar": lambda: torch.nn.functional.linear(a, dense)}  # first: the fastest call decides what is hopeless
        runs |= {p: (lambda p=p: weight.product(a, p)) for p in weight.paths}
        times, bounds = TIMER(runs, floors)
        bar = times.pop("bar")
        plan[b.name] = Entry(pick(times, bar, bounds), b.rows, times, bar, (tn, tk), sorted(bounds))
        floors = dict(times)
    return plan


TIMER = time_paths  # tests give fake timings here


# ---------------------------------------------------------------- the plan, per process and on disk


def cache_directory() -> Path | None:
    value = os.environ.get(CACHE_ENV, "").strip()
    if value.lower() in ("0", "off", "false", "no"):
        return None
    return Path(value).expanduser() if value else Path.home() / ".cache" / "lowbit" / "cpu_plan"


def entry_name(kind: str, n: int, k: int, group: int) -> str:
    """An entry's name: kind, the *timed* shape (shapes that share it share the entry), group."""
    tn, tk = timed_shape(n, k)
    return f"{kind} {tn}x{tk} g{group}"


_PLANS: dict[str, dict[str, dict[str, Entry]]] = {}  # machine id -> entry name -> bucket -> Entry
_LOCK = threading.Lock()
_WARNED: set[str] = set()


def _file(m: dict) -> Path | None:
    root = cache_directory()
    return None if root is None else root / f"{machine_id(m)}.json"


def _read(path: Path | None, m: dict) -> dict[str, dict[str, Entry]]:
    if path is None or not path.exists():
        return {}
    try:
        data = json.loads(path.read_text())
        if data.get("machine") != json.loads(json.dumps(m)):
            raise ValueError("written for another machine key")
        return {name: {b: Entry(**{**e, "timed_shape": tuple(e["timed_shape"]) if e.get("timed_shape") else None})
                       for b, e in buckets.items()} for name, buckets in data["entries"].items()}
    except (OSError, ValueError, KeyError, TypeError) as e:
        _warn_once(str(path), f"CPU plan cache {path} ignored ({e}); it is timed again and rewritten")
        return {}


def _write(path: Path | None, m: dict, plan: dict[str, dict[str, Entry]]) -> None:
    """Merges into what another process may have written meanwhile; a temporary file renamed into
    place, so a reader never sees half a file."""
    if path is None:
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        merged = {**_read(path, m), **plan}
        body = {"machine": m, "entries": {name: {b: asdict(e) for b, e in buckets.items()}
                                          for name, buckets in merged.items()}}
        with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False, suffix=".tmp") as f:
            json.dump(body, f, indent=1, sort_keys=True)
        os.replace(f.name, path)
    except OSError as e:
        _warn_once(str(path.parent), f"CPU plan cache {path.parent} not written ({e}); the plan is kept per process")


def _warn_once(key: str, message: str) -> None:
    if key not in _WARNED:
        _WARNED.add(key)
        warnings.warn(message, stacklevel=3)


def plan_for(kind: str, n: int, k: int, group: int) -> dict[str, Entry]:
    """Every bucket's entry for this weight on this machine: kept in this process, else read from the
    cache file, else measured now (and written there)."""
    m = machine()
    mid = machine_id(m)
    name = entry_name(kind, n, k, group)
    plans = _PLANS.get(mid)
    if plans is not None and name in plans:
        return plans[name]
    with _LOCK:
        if plans is None:
            plans = _PLANS.setdefault(mid, _read(_file(m), m))
        if name not in plans:
            plans[name] = measure(kind, n, k, group)
            _write(_file(m), m, {name: plans[name]})
        return plans[name]


def path(kind: str, n: int, k: int, group: int, rows: int, threshold_reached: bool) -> str:
    """The path for ``rows`` rows of this weight (``threshold_reached``: the kernels' own row threshold
    for the scratch, which the rule modes keep)."""
    how = _how(n, k)
    if how != "measure":
        return rule(threshold_reached, kind, None if how == "rule" else how)
    b = bucket_of(rows)
    if b is None:
        return BF16 if kind == "narrow" else KERNEL
    return plan_for(kind, n, k, group)[b.name].path


def keeps_narrow(n: int, k: int) -> bool:
    """Whether a float Linear's weight [n, k] is kept in bf16 (half the memory and bytes per decode
    step) rather than float32: where its product (bf16, or widened into a float32 scratch) is within
    :data:`NARROW_TOLERANCE` of the float32 bar at every prefill bucket; under the rule modes, where
    the CPU has a bf16 GEMM (``bf16``: always, ``fp32``: never)."""
    how = _how(n, k)
    if how != "measure":
        return how == "bf16" or (how == "rule" and fast_bf16())
    plan = plan_for("narrow", n, k, 0)
    return all(e.over_bar is not None and e.over_bar <= NARROW_TOLERANCE for e in plan.values())


# ---------------------------------------------------------------- lowbit doctor


def describe_machine() -> str:
    m = machine()
    where = _file(m)
    return (f"CPU plan ({MODE_ENV}={mode()}): {m['cpu']}, ATen {m['capability']}, bf16 GEMM "
            f"{'fast (AVX512-BF16/AMX)' if fast_bf16() else 'slow (no AVX512-BF16/AMX here)'}, "
            f"{m['threads']} threads, torch {m['torch']}; cache {where if where else 'off'}")


def table_rows(keys) -> list[dict]:
    """One row per distinct CPU weight of ``keys`` ((kind, outputs, inputs, group) of a model's quantized
    Linears on the CPU kernels and bf16 float leftovers: ``runtime.linear.plan_keys``) and rows bucket:
    the path, the candidates' times and the float bar (timed now if this machine has no plan for it yet)."""
    seen, rows = set(), []
    for key in keys:
        if key in seen:
            continue
        seen.add(key)
        kind, n, k, group = key
        decode = KERNEL if kind != "narrow" else BF16
        rows.append({"kind": kind, "shape": f"{n}x{k}", "group": group, "rows": f"1-{DECODE_ROWS}",
                     "path": decode, "times_ms": {}, "bar_ms": None, "note": "decode: not timed"})
        how = _how(n, k)
        for b in BUCKETS:
            if how != "measure":
                rows.append({"kind": kind, "shape": f"{n}x{k}", "group": group, "rows": b.name,
                             "path": rule(True, kind, None if how == "rule" else how) + " (from the kernels' threshold)",
                             "times_ms": {}, "bar_ms": None, "note": f"{how}: not timed"})
                continue
            e = plan_for(kind, n, k, group)[b.name]
            rows.append({"kind": kind, "shape": f"{n}x{k}", "group": group, "rows": b.name, "path": e.path,
                         "times_ms": e.times_ms, "bar_ms": e.bar_ms, "bounds": e.bounds,
                         "note": f"timed {e.timed_shape[0]}x{e.timed_shape[1]} at {e.rows} rows"})
    return rows


def table_text(rows: list[dict]) -> str:
    if not rows:
        return "  no quantized Linear on the CPU kernels and no bf16 float leftovers: nothing to plan"
    lines = [f"{'kind':7} {'shape':>11} {'group':>5} {'rows':>7}  {'path':7} {'float bar':>10}  candidates (ms)"]
    for r in rows:
        bar = f"{r['bar_ms']:.2f} ms" if r["bar_ms"] else "-"
        times = ", ".join(f"{p} {'>' if p in r.get('bounds', ()) else ''}{t:.2f}"
                          for p, t in sorted(r["times_ms"].items(), key=lambda kv: kv[1]))
        lines.append(f"{r['kind']:7} {r['shape']:>11} {r['group']:>5} {r['rows']:>7}  {r['path']:7} {bar:>10}  "
                     f"{times or r['note']}")
    return "\n".join(lines)
