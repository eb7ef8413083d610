"""The ``lowbit`` commands that measure: eval, speed, diagnose, plan, report, bench (``lowbit.cli`` adds
them to the command group)."""

from __future__ import annotations

import json
from pathlib import Path

import click

from kvquant import schemes as kv_families
from lowbit import pipeline
from lowbit.cli_options import DEVICE_HELP, KV_HELP, fail_cleanly


@click.command("eval")
@click.argument("ckpt")
@click.option("--baseline", help="Model to compare with (default: the one the checkpoint was made from).")
@click.option("--no-baseline", is_flag=True, help="Skip the baseline.")
@click.option("--text", default="default", show_default=True, help="Bundled 'default' (Persuasion) or 'code' (Python source), or a .txt/.jsonl path.")
@click.option("--tokens", type=int, default=pipeline.DEFAULT_PROTOCOL.tokens, show_default=True, help="Tokens of the text to score.")
@click.option("--window", type=int, default=pipeline.DEFAULT_PROTOCOL.window, show_default=True)
@click.option("--stride", type=int, default=pipeline.DEFAULT_PROTOCOL.stride, show_default=True)
@click.option("--bos", type=click.Choice(["auto", "on", "off"]), default="auto", show_default=True,
              help="Begin each window with the tokenizer's BOS: auto when the tokenizer adds one to what it encodes "
                   "(as the model is used: Gemma, Llama), on, off. With BOS, --stride equal to --window gives "
                   "disjoint windows.")
@click.option("--json", "json_out", type=click.Path(dir_okay=False, path_type=Path), help="Write the results as JSON.")
@click.option("--report", type=click.Path(dir_okay=False, path_type=Path), help="Write a Markdown report.")
@click.option("--tasks", help="Also run lm-eval tasks, comma-separated (offline: lowbit_offline).")
@click.option("--limit", type=float, help="lm-eval: documents per task (or a fraction below 1).")
@click.option("--speed", "speed_batches", help="Also time prefill and decode at these batch sizes, e.g. 1,2,4.")
@click.option("--speed-prompt-len", default="128", show_default=True, help="Prompt lengths for --speed (comma-separated).")
@click.option("--speed-output-len", default="32", show_default=True, help="Output lengths for --speed (comma-separated).")
@click.option("--kv", default=None, help=KV_HELP + " A quantized scheme adds KV-perplexity next to an fp16 cache's.")
@click.option("--kv-chunk", type=int, default=32, show_default=True,
              help="KV-perplexity: tokens per forward after each window's prefill.")
@click.option("--device", default=None, help=DEVICE_HELP)
@fail_cleanly
def eval_(ckpt, baseline, no_baseline, text, tokens, window, stride, bos, json_out, report, tasks, limit,
          speed_batches, speed_prompt_len, speed_output_len, kv, kv_chunk, device):
    """Perplexity of CKPT (and its baseline), bytes on disk, bits per weight; KV-perplexity with a quantized
    cache; optionally tasks and speed."""
    from evals.kv import ChunkProtocol

    # checked as if a BOS may come (disjoint windows need one); evaluate decides it on the tokenizer
    protocol = pipeline.make_protocol(window=window, stride=stride, tokens=tokens, bos=bos != "off")
    kv_chunks = ChunkProtocol(chunk=kv_chunk)
    device = pipeline.default_device(device)
    if tasks:  # a mistyped task or an unreachable dataset fails now, not after the perplexity run
        from evals.lm_eval_adapter import run_tasks
        from evals.lm_eval_tasks import prepare_tasks, tasks_table

        prepare_tasks(_names(tasks))
    result = pipeline.evaluate(ckpt, baseline=baseline, use_baseline=not no_baseline, text=text, protocol=protocol,
                               kv=kv, kv_chunks=kv_chunks, bos=bos, device=device)
    md = pipeline.report_markdown(result)
    task_result = speed = None
    if tasks:
        task_result = run_tasks(ckpt, _names(tasks), kv=kv, limit=int(limit) if limit and limit >= 1 else limit,
                                device=device)
        md += "\n\n" + tasks_table(task_result)
    if speed_batches:
        speed = _speed_sweep(ckpt, kv, speed_batches, speed_prompt_len, speed_output_len, device)
        md += "\n\n" + speed["table"]
    click.echo(md)
    if json_out:
        from evals.report import complete_run

        json_out.write_text(json.dumps(complete_run(result, ckpt, speed=speed, tasks=task_result), indent=2))
    if report:
        report.write_text(md)


def _names(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


def _speed_sweep(ckpt, kv, batches, prompt_lens, output_lens, device: str, repeats: int = 1) -> dict:
    """Time both phases of every (batch, prompt, output) combination; a JSON-ready dict with its protocol."""
    import runtime
    from evals import speed as sp
    from evals.provenance import describe_device, device_info

    model = runtime.load(ckpt, device=device, kv=kv)
    loads = sp.workloads(sp.parse_lengths(prompt_lens), sp.parse_lengths(output_lens), sp.parse_lengths(batches))
    timings = sp.sweep(model, loads, repeats=repeats)
    device = device_info(model.device)
    return {"protocol": sp.PROTOCOL, "device": device, "rows": [t.to_dict() for t in timings],
            "table": f"Speed on {describe_device(device)} ({sp.PROTOCOL}):\n" + sp.timing_table(timings)}


@click.command()
@click.argument("model")
@click.option("--memory", required=True, help="Memory budget: 24GB, 24GiB, 512MB or bytes.")
@click.option("--context", type=int, default=8192, show_default=True, help="Tokens per sequence.")
@click.option("--reserve", default="0", show_default=True, help="Memory held back for activations and the framework.")
@click.option("--kv", "schemes", multiple=True,
              help=f"KV schemes to plan (repeatable; default {', '.join(kv_families.listed_names())}); any name --kv "
                   "takes elsewhere, with -g<group_size> and -r<residual> (int4-g64-r128).")
@click.option("--json", "json_out", type=click.Path(dir_okay=False, path_type=Path), help="Write the plan as JSON.")
@fail_cleanly
def plan(model, memory, context, reserve, schemes, json_out):
    """How many sequences of --context tokens fit in --memory beside MODEL's weights, per KV scheme (config only)."""
    from evals import planner
    from evals.provenance import commit, versions

    result = planner.plan(model, planner.parse_memory(memory), context, schemes or planner.DEFAULT_SCHEMES,
                          planner.parse_memory(reserve))
    click.echo(planner.plan_text(result))
    if json_out:
        json_out.write_text(json.dumps({**result, "versions": versions(), "commit": commit()}, indent=2))


@click.command()
@click.argument("ckpt")
@click.option("--batch", "batches", default="1,2,4", show_default=True, help="Batch sizes (comma-separated).")
@click.option("--prompt-len", default="128,512", show_default=True, help="Prompt lengths (comma-separated).")
@click.option("--output-len", default="32", show_default=True, help="Output lengths (comma-separated).")
@click.option("--kv", help=KV_HELP)
@click.option("--repeats", type=int, default=1, show_default=True)
@click.option("--json", "json_out", type=click.Path(dir_okay=False, path_type=Path), help="Write the timings as JSON.")
@click.option("--device", default=None, help=DEVICE_HELP)
@fail_cleanly
def speed(ckpt, batches, prompt_len, output_len, kv, repeats, json_out, device):
    """Prefill (TTFT, prompt tokens/s) and decode (ITL, tokens/s) of CKPT on this device."""
    from evals.provenance import provenance

    device = pipeline.default_device(device)
    result = _speed_sweep(ckpt, kv, batches, prompt_len, output_len, device, repeats)
    click.echo(result.pop("table"))
    if json_out:
        json_out.write_text(json.dumps({"model": ckpt, **result, **provenance(device)}, indent=2))


@click.command()
@click.argument("ckpt")
@click.option("--prompt-len", type=int, default=512, show_default=True)
@click.option("--output-len", type=int, default=64, show_default=True)
@click.option("--batch", type=int, default=1, show_default=True)
@click.option("--kv", help=KV_HELP)
@click.option("--json", "json_out", type=click.Path(dir_okay=False, path_type=Path), help="Write the diagnosis as JSON.")
@click.option("--device", default=None, help=DEVICE_HELP)
@fail_cleanly
def diagnose(ckpt, prompt_len, output_len, batch, kv, json_out, device):
    """Measure both phases here, compare with this device's measured ceilings, say what dominates and what helps."""
    import runtime
    from evals import diagnose as dg
    from evals.provenance import describe_device, provenance
    from evals.speed import Workload

    model = runtime.load(ckpt, device=pipeline.default_device(device), kv=kv)
    result = dg.diagnose(model, Workload(prompt_len, output_len, batch))
    prov = provenance(model.device)
    click.echo(dg.diagnose_text(result, describe_device(prov["device"])))
    if json_out:
        json_out.write_text(json.dumps({"model": ckpt, **result, **prov}, indent=2))


@click.command()
@click.argument("runs", nargs=-1, required=True)
@click.option("--out", "out_dir", required=True, type=click.Path(file_okay=False, path_type=Path), help="Output directory.")
@fail_cleanly
def report(runs, out_dir):
    """Put eval runs (JSON from `lowbit eval --json`, or directories of them) side by side: JSON, Markdown, HTML."""
    from evals.report import write_report

    files = write_report(runs, out_dir)
    click.echo(Path(files["markdown"]).read_text())
    click.echo("wrote " + ", ".join(str(f) for f in files.values()))


@click.command()
@click.option("--smoke", is_flag=True, help="Run the benchmark's code on a tiny CPU model at fixed tiny sizes "
              "(checks the script; its timings mean nothing).")
@click.option("--configs", default="fp16,w4g128,w4g128+kv-int4", show_default=True,
              help="Engine configurations (comma-separated).")
@click.option("--batch", "batches", default="1,8,32", show_default=True, help="Batch sizes (comma-separated).")
@click.option("--prompt-len", "prompt_lens", default="512,4096", show_default=True, help="Prompt lengths.")
@click.option("--output-len", type=int, default=256, show_default=True)
@click.option("--arrivals", type=int, default=64, show_default=True,
              help="Requests in the continuous-batching run (Poisson arrivals); 0 skips that run.")
@click.option("--rate", type=float, default=4.0, show_default=True, help="Arrivals per second in that run.")
@click.option("--prefill-chunk", type=int, default=4096, show_default=True,
              help="Prompt tokens the engine prefills per step.")
@click.option("--no-baseline", is_flag=True, help="Skip transformers generate (fp16).")
@click.option("--json", "json_out", type=click.Path(dir_okay=False, path_type=Path),
              help="Default: bench/results/engine/<device>-<commit>.json (smoke: not written unless given).")
@fail_cleanly
def bench(smoke, configs, batches, prompt_lens, output_len, arrivals, rate, prefill_chunk, no_baseline, json_out):
    """Serving speed of the engine (fp16, W4 g128, W4 + INT4 KV cache) against transformers generate, on a
    Llama-3-8B-shaped model with random weights, on this CUDA GPU. Refuses without one (see --smoke)."""
    import re

    from evals import serving
    from evals.speed import parse_lengths

    names = [c.strip() for c in configs.split(",") if c.strip()]
    unknown = [c for c in names if c not in serving.CONFIGS]
    if unknown:
        raise click.BadParameter(f"unknown {unknown}; choose from {', '.join(serving.CONFIGS)}", param_hint="--configs")
    try:
        record = serving.run(smoke=smoke, configs=names, batches=parse_lengths(batches),
                             prompt_lens=parse_lengths(prompt_lens), output_len=output_len, arrivals=arrivals,
                             rate=rate, baseline=not no_baseline, prefill_chunk=prefill_chunk,
                             progress=lambda m: click.echo(m, err=True))
    except serving.NoGPUError as e:
        raise click.ClickException(str(e)) from None
    click.echo(serving.table(record))
    if json_out is None and not smoke:
        prov = record["provenance"]
        slug = re.sub(r"[^a-z0-9]+", "-", prov["device"]["name"].lower()).strip("-")
        results = Path(__file__).resolve().parent.parent / "bench" / "results"
        json_out = results / "engine" / f"{slug}-{prov['commit']}.json"
    if json_out:
        json_out.parent.mkdir(parents=True, exist_ok=True)
        json_out.write_text(json.dumps(record, indent=2, default=str))
        click.echo(f"wrote {json_out}", err=True)


COMMANDS = (eval_, plan, speed, diagnose, report, bench)
