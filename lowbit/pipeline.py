"""Recipe -> quantize -> save, and checkpoint -> evaluate: the jobs behind the CLI."""

from __future__ import annotations

import json
import math
import shutil
import warnings
from pathlib import Path

import torch

from lowbit.recipe import Recipe, RecipeError
from quant import checkpoint, distributed, engines, models
from quant import checkpoint_write
from quant.calibration import calibration_samples, load_calibration_text
from quant.plan import plan_layers
from quant.quantize import quantize_model

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32, "auto": None}


def versions() -> dict[str, str]:
    from evals.provenance import versions as library_versions  # one definition, shared with every eval result

    return library_versions()


def work_dir_for(output: Path) -> Path:
    """Where a calibrated run keeps per-layer progress until the checkpoint is saved."""
    return output.parent / f".{output.name}.work"


def default_device(device: str | None = None) -> str:
    """Where a command runs: ``device`` when given (checked), else CUDA when torch sees a GPU, else the
    CPU. The one rule of every subcommand that loads or calibrates a model (their ``--device``)."""
    if device is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        kind = torch.device(device).type
    except RuntimeError:
        raise ValueError(f"--device {device!r} is not a device torch knows: use cpu, cuda or cuda:N") from None
    if kind == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {device}: torch {torch.__version__} sees no CUDA GPU here; use --device cpu")
    return device


def quantize(recipe: Recipe, overwrite: bool = False, resume: bool = False, device: str | None = None,
             progress: bool = True) -> Path:
    """Run a recipe end to end and return the checkpoint directory. Under torchrun (the world set
    with ``quant.distributed.use``) every rank runs this with the same recipe; rank 0 writes, and
    holds the output for the whole run (a second run to it fails at once, naming this one)."""
    if not distributed.current().main:
        return _quantize(recipe, overwrite, resume, device, progress)
    with checkpoint_write.claim_output(Path(recipe.output)):
        return _quantize(recipe, overwrite, resume, device, progress)


def _quantize(recipe: Recipe, overwrite: bool, resume: bool, device: str | None, progress: bool) -> Path:
    import runtime

    world = distributed.current()
    w = recipe.weights
    output = Path(recipe.output)
    if recipe.gguf:  # one GGUF file for llama.cpp, each Linear rounded on its type's grid (quant.gguf_quantize)
        from quant.gguf_quantize import quantize_to_file

        if world.size > 1:
            raise ValueError("a GGUF target runs in one process only: run this recipe without torchrun / --ranks")
        if not (overwrite and output.is_file()):  # replacing a file: the writer replaces only a GGUF file
            checkpoint_write.check_output(output, overwrite)
        return quantize_to_file(recipe.model, recipe.gguf, w.methods, w.settings, recipe.calibration, output,
                                overwrite, device or default_device(), progress)
    run_id = json.dumps(recipe.to_dict(), sort_keys=True)
    world.agree("the recipe", json.dumps([run_id, overwrite, resume]))
    if world.main:
        checkpoint_write.check_output(output, overwrite)  # fail before the slow work, and again at the final move
    with world.rank0_first():  # a download or conversion into the shared cache happens once
        source = models.resolve(recipe.model)
    checkpoint.check_contained(source)  # its index and links name only files inside it (no manifest needed)
    chain = w.chain
    single = [m.name for m in chain if not m.ranks]
    if world.size > 1 and single:
        raise ValueError(f"{', '.join(single)} runs in one process only (its statistics are not summed across "
                         f"ranks yet): run this recipe without torchrun / --ranks")
    calibrated = any(m.needs_data for m in chain)
    budgeted = w.target_bits is not None  # its sensitivities read calibration data whatever the method
    if world.size > 1 and budgeted:
        raise ValueError("weights.target_bits runs in one process only (its sensitivity pass is not summed across "
                         "ranks yet): run this recipe without torchrun / --ranks")
    if world.main:  # a calibrated run also keeps its finished layers in a work directory beside the output
        need = checkpoint_size_estimate(source, recipe) * (2 if calibrated else 1)
        checkpoint_write.check_output(output, overwrite, need_bytes=need)
    source_config = checkpoint.read_config(source)
    cfg = runtime.check_supported(source_config)
    try:
        recipe.kv_cache.check_head_dim(cfg.head_dim)
    except ValueError as e:
        raise RecipeError(f"kv_cache: {e}") from None
    # the calibrated pipeline reads each decoder layer from disk when it reaches it: the float
    # model is never in memory whole (a format transformers converts on load is read whole)
    loaded = models.load_lazily(source) if calibrated else None
    model, tokenizer, lazy = loaded or (*models.load_float_model(source), None)
    default = w.scheme  # the rounding method's act-order (GPTQ's) is each layer's scheme.actorder
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plan = plan_layers(model, default, w.ignore, w.overrides)
    notes = [str(c.message) for c in caught]
    for note in notes if world.main else ():
        print(f"warning: {note}")
    shapes = {n: tuple(model.get_submodule(n).weight.shape) for n in plan}  # (out, in); meta tensors too
    serve = engines.resolve(recipe.serve_with)
    try:  # before any work: every Linear as planned (a budget's choices are held to them as they are made)
        engines.check_plan(serve, plan, shapes, source_config)
    except engines.EngineError as e:
        raise RecipeError(str(e)) from None

    samples = None
    if calibrated or budgeted:
        c = recipe.calibration
        samples = calibration_samples(tokenizer, load_calibration_text(c.text), c.samples, c.seq_len, c.seed, c.bos)
    work_dir = work_dir_for(output) if calibrated else None
    if work_dir is not None and work_dir.exists():
        if resume:
            if world.main:
                print(f"resuming from {work_dir}")
        else:
            print(f"note: {work_dir} holds progress of an interrupted run; starting over (--resume continues it)")
            shutil.rmtree(work_dir, ignore_errors=world.size > 1)  # ranks sharing a file system race to it
    store_dtype = DTYPES[recipe.dtype]
    scale_dtype = store_dtype or next(model.parameters()).dtype
    manifest_recipe, budget = recipe.to_dict(), None
    if budgeted:
        plan, budget, manifest_recipe = _spend_budget(recipe, model, plan, samples, scale_dtype, lazy,
                                                      device or default_device(), progress, serve)
    quantized, layer_stats = quantize_model(
        model, plan, w.methods, samples=samples, **w.settings,
        scale_dtype=scale_dtype, device=device or default_device(),
        work_dir=work_dir, resume=resume, run_id=run_id, progress=progress and world.main, lazy=lazy,
    )
    manifest = {
        "producer": "lowbit",
        "versions": versions(),
        "recipe": manifest_recipe,
        "kv_cache": recipe.kv_cache.to_dict(),  # the runtime's default KV scheme for this checkpoint
        "source_model": {"spec": recipe.model, "path": str(source)},
        "layers": layer_stats,
        "notes": notes,
        "world_size": world.size,  # ranks that calibrated it (the result is the same up to summation order)
    }
    if budget is not None:
        manifest["budget"] = budget
    if world.main:
        checkpoint_write.save(model, quantized, output, tokenizer=tokenizer, dtype=store_dtype, manifest=manifest,
                        overwrite=overwrite)
        if progress:
            print("\n".join(engines.serving_lines(plan, shapes, source_config)))
    world.barrier()  # the checkpoint is in place before any rank drops its share of the progress
    if work_dir is not None:
        shutil.rmtree(work_dir, ignore_errors=True)
    return output


def _spend_budget(recipe: Recipe, model, plan, samples, scale_dtype, lazy, device, progress, serve=()):
    """``weights.target_bits``: the plan with each Linear's scheme chosen by its sensitivity
    (``quant.budget``), the record for the manifest, and the recipe the manifest keeps: the
    choice as one override per Linear, so re-running it makes the same checkpoint without the pass."""
    from quant import budget
    from quant.plan import matches

    w = recipe.weights
    # Linears an override gives bits or a group size keep them; their bits count against the budget
    pinned = {n for n in plan for o in w.overrides
              if matches(n, o.match) and (o.bits is not None or o.group_size is not None)}
    try:
        plan, record = budget.choose_schemes(model, plan, pinned, w.target_bits, w.budget_candidates, samples,
                                             scale_dtype, device, lazy, progress,
                                             (lambda n, s: engines.linear_refusal(serve, n, s)) if serve else None,
                                             engines.fused_groups(serve, plan))
    except budget.BudgetError as e:
        raise RecipeError(str(e)) from None
    if progress:
        from lowbit.inspection import budget_lines

        print("\n".join(budget_lines(record, layers=False)[:2]))
    data = recipe.to_dict()
    data["weights"]["overrides"] += [{"match": n, "bits": plan[n].bits, "group_size": plan[n].group_size,
                                      "symmetric": None, "skip": False} for n in sorted(record["layers"])]
    for key in ("target_bits", "candidates"):  # the record keeps them (manifest["budget"])
        data["weights"].pop(key)
    return plan, record, data


DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "I64": 8, "I32": 4, "I8": 1, "U8": 1}


def checkpoint_size_estimate(source: Path, recipe: Recipe) -> int:
    """About how many bytes the checkpoint takes, from the source's safetensors headers (no tensor
    read): 2-D ``.weight`` tensors the recipe does not ignore at its widest bits plus a 16-bit scale
    and zero point per group, the rest at the stored dtype."""
    from quant.plan import Patterns

    w = recipe.weights
    ignore = Patterns(w.ignore)
    bits = max([w.bits] + [o.bits for o in w.overrides if o.bits]
               + ([c.bits for c in w.budget_candidates] if w.target_bits is not None else []))
    group = w.group_size if w.group_size > 0 else 4096  # per channel: one scale per row, a small share
    total = 0
    for file in checkpoint.safetensors_files(source):
        for name, info in checkpoint.read_header(file).items():
            numel = math.prod(info["shape"])
            module = name.removesuffix(".weight")
            if len(info["shape"]) == 2 and name != module and "embed" not in name and \
                    module not in ignore:
                total += numel * bits // 8 + numel // group * 4
            else:
                stored = DTYPES[recipe.dtype]
                total += numel * (stored.itemsize if stored else DTYPE_BYTES.get(info["dtype"], 4))
    return total


# ---------------------------------------------------------------- evaluation

def make_protocol(**changes):
    from evals.perplexity import Protocol

    return Protocol(**{k: v for k, v in changes.items() if v is not None})


def _default_protocol():
    from evals.perplexity import Protocol

    return Protocol()


DEFAULT_PROTOCOL = _default_protocol()


def _perplexity(model_dir: Path, token_ids, protocol, bos_id, label: str, progress: bool, device: str) -> float:
    import runtime
    from evals.perplexity import perplexity

    model = runtime.load(model_dir, device=device)
    if progress:
        print(f"perplexity of {label}")
    return perplexity(model.logits, token_ids, protocol, bos_id=bos_id, progress=progress).ppl


def _kv_results(ckpt_dir: Path, scheme, token_ids, protocol, bos_id, chunks, progress: bool, device: str) -> dict:
    """KV-perplexity of the checkpoint with ``scheme`` and with an fp16 cache, through the same chunked path."""
    import runtime
    from evals.kv import kv_perplexity, runtime_session
    from kvquant import KVScheme, bytes_per_token

    model = runtime.load(ckpt_dir, device=device, kv=scheme)
    ppl = {}
    for label, s in (("kv", scheme), ("kv_baseline", KVScheme())):
        if progress:
            print(f"KV-perplexity with a {s.name} cache")
        ppl[label] = kv_perplexity(runtime_session(model, s), token_ids, protocol, chunks, bos_id=bos_id,
                                   progress=progress).ppl
    cfg = model.decoder.cfg
    size = lambda s: bytes_per_token(s, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, torch.float16)  # noqa: E731
    return {
        "kv_cache": {**scheme.to_dict(), "name": scheme.name},
        "kv_protocol": {**chunks.to_dict(), "description": chunks.describe(protocol)},
        "kv_ppl": ppl["kv"],
        "kv_baseline_ppl": ppl["kv_baseline"],
        "kv_delta_ppl_pct": 100.0 * (ppl["kv"] / ppl["kv_baseline"] - 1.0),
        "kv_bytes_per_token": size(scheme),
        "kv_baseline_bytes_per_token": size(KVScheme()),
    }


KV_KEYS = ("kv_cache", "kv_protocol", "kv_ppl", "kv_baseline_ppl", "kv_delta_ppl_pct", "kv_bytes_per_token",
           "kv_baseline_bytes_per_token")


def evaluate(
    ckpt: str,
    baseline: str | None = None,
    use_baseline: bool = True,
    text: str = "default",
    protocol=None,
    progress: bool = True,
    kv: str | None = None,
    kv_chunks=None,
    bos: str = "auto",
    device: str | None = None,
) -> dict:
    """Perplexity of ``ckpt`` and of its baseline on the same tokens, plus sizes.

    ``bos`` (``auto``, ``on``, ``off``: :func:`evals.perplexity.bos_for` on the checkpoint's
    tokenizer) decides whether each window begins with the BOS; it sets ``protocol.bos``.

    With a quantized KV scheme (``kv``, e.g. ``"int4"``, else the one saved with the checkpoint),
    also the KV-perplexity of ``ckpt`` with that cache and with an fp16 cache, same tokens, same path.
    ``device``: where the models run (default: :func:`default_device`'s choice).
    """
    import runtime
    from dataclasses import replace

    from evals import size
    from evals.perplexity import bos_for, tokenize_text
    from evals.texts import load_text

    protocol = protocol or DEFAULT_PROTOCOL
    device = default_device(device)
    ckpt_dir = models.resolve(ckpt)
    manifest = checkpoint.verify(ckpt_dir)
    if use_baseline and baseline is None and manifest is not None:
        baseline = manifest.get("source_model", {}).get("spec")
    tokenizer = runtime.load_tokenizer(ckpt_dir)
    bos_id = bos_for(tokenizer, bos)
    protocol = replace(protocol, bos=bos_id is not None)
    token_ids = tokenize_text(tokenizer, load_text(text), protocol)

    stats = size.weight_stats(ckpt_dir)
    result = {
        "model": str(ckpt),
        "text": text,
        "protocol": {**protocol.to_dict(), "bos_mode": bos, "bos_token_id": bos_id, "description": protocol.describe()},
        "tokens": int(token_ids.numel()),
        "ppl": _perplexity(ckpt_dir, token_ids, protocol, bos_id, str(ckpt), progress, device),
        "bytes_on_disk": size.bytes_on_disk(ckpt_dir),
        "bits_per_weight": stats.bits_per_weight,
        "quantized_params": stats.quantized_params,
        "baseline": None,
        "baseline_ppl": None,
        "baseline_bytes_on_disk": None,
        "delta_ppl_pct": None,
        "versions": versions(),
    }
    from evals.kv import ChunkProtocol
    from runtime.load import kv_scheme_of

    kv_scheme = kv_scheme_of(manifest, kv)
    result.update(dict.fromkeys(KV_KEYS))
    if kv_scheme.quantized:
        result.update(_kv_results(ckpt_dir, kv_scheme, token_ids, protocol, bos_id, kv_chunks or ChunkProtocol(),
                                  progress, device))
    if use_baseline and baseline:
        base_dir = models.resolve(baseline)
        base_ppl = _perplexity(base_dir, token_ids, protocol, bos_id, f"baseline {baseline}", progress, device)
        result.update(
            baseline=str(baseline),
            baseline_ppl=base_ppl,
            baseline_bytes_on_disk=size.bytes_on_disk(base_dir),
            delta_ppl_pct=100.0 * (result["ppl"] / base_ppl - 1.0),
        )
    return result


def _mb(n: int | None) -> str:
    return "-" if n is None else f"{n / 1e6:.1f} MB"


def report_markdown(r: dict) -> str:
    lines = [
        f"## lowbit eval: {r['model']}",
        "",
        f"Protocol: {r['protocol']['description']} ({r['tokens']} tokens"
        + (f"; --bos {r['protocol']['bos_mode']}" if r["protocol"].get("bos_mode") else "") + ").",
        "",
        "| model | perplexity | Δ vs baseline | bytes on disk | bits/weight |",
        "|---|---|---|---|---|",
        f"| {r['model']} | {r['ppl']:.4f} | "
        + ("-" if r["delta_ppl_pct"] is None else f"{r['delta_ppl_pct']:+.2f}%")
        + f" | {_mb(r['bytes_on_disk'])} | {r['bits_per_weight']:.2f} |",
    ]
    if r["baseline"]:
        lines.append(f"| {r['baseline']} (baseline) | {r['baseline_ppl']:.4f} | | {_mb(r['baseline_bytes_on_disk'])} | |")
    lines += ["", "bits/weight counts packed weights, scales and zero points of the quantized Linear layers."]
    if r.get("kv_ppl") is not None:
        ratio = r["kv_bytes_per_token"] / r["kv_baseline_bytes_per_token"]
        lines += [
            "",
            f"KV cache: {r['kv_protocol']['description']}.",
            "",
            "| KV cache | perplexity | Δ vs fp16 cache | bytes/token (fp16 scales) |",
            "|---|---|---|---|",
            f"| {r['kv_cache']['name']} | {r['kv_ppl']:.4f} | {r['kv_delta_ppl_pct']:+.2f}% | "
            f"{r['kv_bytes_per_token']:.0f} ({ratio:.2f}x) |",
            f"| fp16 | {r['kv_baseline_ppl']:.4f} | | {r['kv_baseline_bytes_per_token']:.0f} |",
        ]
    return "\n".join(lines)
