"""``lowbit inspect``: what a checkpoint is, verified as a load would verify it, summary first."""

from __future__ import annotations

from collections import defaultdict

from quant import checkpoint, models
from quant.affine import QuantScheme
from quant.format import config_groups

WEIGHT_ERROR = "weight error = ‖W-Ŵ‖/‖W‖, the relative Frobenius norm of a layer's rounding error"
OUTPUT_ERROR = ("output error = ‖X(W-Ŵ)ᵀ‖/‖XWᵀ‖ on the calibration inputs, for round-to-nearest and for "
                "this method")


def _mb(n: int) -> str:
    return f"{n / 1e6:.1f} MB"


def _num(x) -> str:
    return "-" if x is None else f"{x:.4f}"


def _natural_key(name: str):
    """Sort model.layers.2 before model.layers.10."""
    return [int(part) if part.isdigit() else part for part in name.split(".")]


def scheme_label(scheme: QuantScheme) -> str:
    """``w4 g64 asym``: a layer's scheme in one word per setting."""
    label = f"w{scheme.bits} " + ("per-channel" if scheme.group_size == -1 else f"g{scheme.group_size}")
    label += " sym" if scheme.symmetric else " asym"
    return label + (f" actorder={scheme.actorder}" if scheme.actorder else "")


def layer_schemes(config: dict, packed: list[str] = ()) -> dict[str, str]:
    """Layer name -> scheme label, read from config.json as a load reads it (the same checks, the same
    errors); a group that targets every ``Linear`` (llm-compressor's way) is listed under that name.
    ``packed``: the Linears the safetensors hold packed, which ``re:`` targets (a MoE block's
    experts) name only as patterns."""
    groups = config_groups(config["quantization_config"])
    targets = [t for group in groups.values() for t in group.get("targets", [])]
    return {name: scheme_label(s) for name, s in checkpoint.linear_schemes(config, [*targets, *packed]).items()}


def packed_linears(path) -> list[str]:
    """The Linears whose ``weight_packed`` the checkpoint's safetensors headers list."""
    return [k.removesuffix(".weight_packed") for f in checkpoint.safetensors_files(path)
            for k in checkpoint.read_header(f) if k.endswith(".weight_packed")]


def stored_plan(path, config: dict) -> tuple[dict, dict]:
    """({Linear: QuantScheme}, {Linear: (out, in)}) of a checkpoint: its config's schemes and the shapes
    stored beside each packed weight."""
    from safetensors import safe_open

    shapes = {}
    for file in checkpoint.safetensors_files(path):
        with safe_open(file, "pt") as f:
            shapes.update({k.removesuffix(".weight_shape"): tuple(int(v) for v in f.get_tensor(k))
                           for k in f.keys() if k.endswith(".weight_shape")})
    return checkpoint.linear_schemes(config, list(shapes)), shapes


def serving_lines(path, config: dict) -> list[str]:
    """Which engines serve the checkpoint (``quant.engines``), from its schemes and stored shapes."""
    from quant import engines

    return engines.serving_lines(*stored_plan(path, config), config)


def summary_lines(schemes: dict[str, str], layer_stats: dict) -> list[str]:
    """One row per scheme: layers, mean and worst weight error (and output error when calibrated)."""
    calibrated = any("output_rel_error" in st for st in layer_stats.values())
    by_scheme = defaultdict(list)
    for name, scheme in schemes.items():
        by_scheme[scheme].append(name)
    head = f"{'scheme':<28} {'layers':>6} {'mean weight err':>16} {'worst weight err (layer)':<40}"
    lines = [head + (f" {'mean output err: rtn -> this':>29}" if calibrated else "")]
    for scheme, names in sorted(by_scheme.items(), key=lambda kv: -len(kv[1])):
        errors = {n: layer_stats[n]["weight_rel_error"] for n in names if "weight_rel_error" in layer_stats.get(n, {})}
        mean = sum(errors.values()) / len(errors) if errors else None
        worst = max(errors, key=errors.get) if errors else None
        worst_text = f"{errors[worst]:.4f} ({worst})" if worst else "-"
        line = f"{scheme:<28} {len(names):>6} {_num(mean):>16} {worst_text:<40}"
        if calibrated:
            line += f" {_num(_mean(layer_stats, names, 'output_rel_error_rtn')):>17} -> " \
                    f"{_num(_mean(layer_stats, names, 'output_rel_error')):<8}"
        lines.append(line)
    lines.append(WEIGHT_ERROR)
    if calibrated:
        lines.append(OUTPUT_ERROR)
    return lines


def _mean(layer_stats: dict, names: list[str], key: str) -> float | None:
    values = [layer_stats[n][key] for n in names if key in layer_stats.get(n, {})]
    return sum(values) / len(values) if values else None


def layer_lines(schemes: dict[str, str], layer_stats: dict) -> list[str]:
    """Every quantized layer in model order, with its scheme and errors."""
    calibrated = any("output_rel_error" in st for st in layer_stats.values())
    head = f"{'layer':<40} {'scheme':<28} {'weight err':>10}"
    lines = [head + (f" {'output err: rtn -> this':>24}" if calibrated else "")]
    for name in sorted(schemes, key=_natural_key):
        st = layer_stats.get(name, {})
        line = f"{name:<40} {schemes[name]:<28} {_num(st.get('weight_rel_error')):>10}"
        if calibrated:
            line += f" {_num(st.get('output_rel_error_rtn')):>12} -> {_num(st.get('output_rel_error')):<8}"
        lines.append(line)
    return lines


def budget_lines(budget: dict, layers: bool) -> list[str]:
    """A bits budget's outcome (``weights.target_bits``, manifest ``budget``): target, result, how many
    Linears took each candidate, and with ``layers`` every Linear's sensitivities, its choice starred."""
    counts = defaultdict(int)
    for entry in budget["layers"].values():
        counts[entry["choice"]] += 1
    candidates = budget["candidates"]
    lines = [f"bits budget: target {budget['target_bits']:g} bits/weight, assigned {budget['bits_per_weight']:.3f}; "
             f"estimated loss {budget['estimated_loss']:.4g} (no assignment below {budget['lower_bound']:.4g})",
             "assignment: " + ", ".join(f"{c} x{counts[c]}" for c in candidates if counts[c])
             + (f"; {len(budget['pinned'])} Linears set by overrides" if budget.get("pinned") else ""),
             f"sensitivity = {budget['sensitivity']}"]
    if budget.get("checked"):  # manifests from before the check have none
        lines.append("checked (estimated -> measured nats): " + ", ".join(
            f"{n} {c['estimated']:.3g} -> {c['measured']:.3g}" for n, c in sorted(budget["checked"].items(),
                                                                             key=lambda kv: _natural_key(kv[0]))))
    if layers:
        lines += ["", f"{'layer':<40} " + " ".join(f"{c:>11}" for c in candidates) + "   (* chosen)"]
        for name in sorted(budget["layers"], key=_natural_key):
            entry = budget["layers"][name]
            cells = [f"{entry['loss'][c]:>10.4g}" + ("*" if c == entry["choice"] else " ") for c in candidates]
            lines.append(f"{name:<40} " + " ".join(cells))
    return lines


def inspect_text(ckpt, layers: bool = False) -> str:
    """What ``ckpt`` is: integrity, producer, sizes, a summary per scheme, and with ``layers`` every layer."""
    from evals import size

    path = models.resolve(ckpt)
    manifest = checkpoint.verify(path)  # as a load does: a damaged or tampered checkpoint is an error
    config = checkpoint.read_config(path)  # its sizes checked against the stored tensors
    checkpoint.check_scales(path)  # a NaN scale the manifest was rewritten around
    stats = size.weight_stats(path)
    lines = [f"checkpoint: {path}",
             f"verified: every file matches {checkpoint.MANIFEST}" if manifest
             else f"NOT VERIFIED: no {checkpoint.MANIFEST}, the files are read as they are",
             f"architecture: {config.get('model_type')} ({config.get('num_hidden_layers')} layers)"]
    manifest = manifest or {}
    if manifest.get("producer") == "lowbit" and "recipe" in manifest:
        v = manifest.get("versions", {})
        src = manifest.get("source_model", {}).get("spec")
        weights = manifest.get("recipe", {}).get("weights", {})
        method = "+".join(weights["methods"]) if "methods" in weights else weights.get("method")  # older manifests
        lines.append(f"produced by: lowbit {v.get('lowbit')} ({method}) from {src} on {manifest.get('created')}")
    lines.append(
        f"size: {_mb(size.bytes_on_disk(path))} on disk; {stats.quantized_params / 1e6:.1f}M quantized weights at "
        f"{stats.bits_per_weight:.2f} bits/weight; {stats.other_params / 1e6:.1f}M other parameters"
    )
    if not config.get("quantization_config"):
        return "\n".join(lines + ["not quantized"])
    schemes = layer_schemes(config, packed_linears(path))
    layer_stats = manifest.get("layers") or {}
    lines += ["", *summary_lines(schemes, layer_stats)]
    ignored = config["quantization_config"].get("ignore")
    if ignored:
        lines.append(f"left in floating point: {', '.join(ignored)}")
    lines += ["", *serving_lines(path, config)]
    if manifest.get("budget"):
        lines += ["", *budget_lines(manifest["budget"], layers)]
    if layers:
        lines += ["", *layer_lines(schemes, layer_stats)]
    else:
        lines.append(f"(each of the {len(schemes)} layers: lowbit inspect --layers)")
    return "\n".join(lines)
