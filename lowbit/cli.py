"""The ``lowbit`` command line."""

from __future__ import annotations

import os

# OpenMP reads its settings once, when torch loads it: set before anything here imports torch (lowbit's
# __init__ does not), and only where the user has not. PASSIVE: a thread waiting for the next parallel
# region sleeps rather than spins; on a busy CPU the spinning threads took the cores the work needed
# (bench/cpu_decode.py --omp-policies: decode steps several times slower with 2 threads than with 1).
OPENMP_DEFAULTS = {"OMP_WAIT_POLICY": "PASSIVE"}
for _name, _value in OPENMP_DEFAULTS.items():
    os.environ.setdefault(_name, _value)

import json  # noqa: E402
import sys  # noqa: E402
import warnings  # noqa: E402
from pathlib import Path  # noqa: E402

import click  # noqa: E402

from kvquant import schemes as kv_families  # noqa: E402
from lowbit import pipeline  # noqa: E402
from lowbit.recipe import bundled_recipe_names, bundled_recipes_dir

# The demo scores the first 4,096 tokens (7 windows of 1,024 per model, not 31), a quarter of the
# evaluation's time; how far its perplexity change strays from 16,384 tokens' is not measured yet.
DEMO_TOKENS = 4096
DEVICE_HELP = "Where to run it: cpu, cuda or cuda:N (default: cuda if torch sees a GPU, else cpu)."
# Every --kv option names the schemes the KV-cache families list (kvquant/schemes/, one file each).
KV_HELP = (f"KV-cache scheme: {kv_families.names_text()}, optionally with -g<group_size> and -r<residual> "
           "(int4-g64-r128); default: the checkpoint's.")


def _fail_cleanly(fn):
    """Turn the errors a user can fix into one clear line and a non-zero exit."""
    import functools

    from lowbit.recipe import RecipeError
    from quant.checkpoint import CheckpointError
    from quant.plan import PlanError

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        import runtime

        try:
            return fn(*args, **kwargs)
        except KeyboardInterrupt:
            click.echo("interrupted: no checkpoint was written (a calibrated run can continue with --resume)", err=True)
            sys.exit(130)
        except (RecipeError, CheckpointError, PlanError, runtime.UnsupportedModelError,
                OSError, ValueError) as e:  # OSError: unreadable files (FileNotFoundError, a bad config, ...)
            raise click.ClickException(str(e)) from None

    return wrapper


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="lowbit")
@click.option("--no-self-check", is_flag=True,
              help="Skip the check of the GPU kernels against the reference at load (as LOWBIT_SELF_CHECK=0).")
def main(no_self_check):
    """Quantize LLMs into compressed checkpoints, run them, measure them."""
    if no_self_check:
        import os

        from runtime.selfcheck import ENV_SWITCH

        os.environ[ENV_SWITCH] = "0"  # every load in this process, and the processes it starts
    # a library warning (an unverified checkpoint, a refitted group) is one line for the user, not a source location
    warnings.formatwarning = lambda message, category, *rest: f"warning: {message}\n"


@main.command(epilog=f"Bundled recipes ({', '.join(bundled_recipe_names())}) are in {bundled_recipes_dir()}; "
              "give one by name: lowbit quantize w4g64-awq-gptq. `lowbit recipes` lists what each does.")
@click.argument("recipe")
@click.option("--model", help="Override the recipe's model: alias, local HF directory or hub id.")
@click.option("--output", type=click.Path(path_type=Path), help="Override the recipe's output directory.")
@click.option("--overwrite", is_flag=True, help="Replace the output if it is a lowbit checkpoint (never other files).")
@click.option("--resume", is_flag=True, help="Continue an interrupted calibrated run from its last finished layer.")
@click.option("--device", default=None, help="Compute device for calibration (default: cuda if available, else cpu).")
@click.option("--ranks", type=click.IntRange(min=1), default=1, show_default=True,
              help="Calibrate on N ranks on this machine (launches torchrun: one rank per GPU, or N CPU processes "
                   "with gloo). On several machines run torchrun yourself: torchrun ... -m lowbit quantize RECIPE.")
@_fail_cleanly
def quantize(recipe, model, output, overwrite, resume, device, ranks):
    """Quantize a model as RECIPE says and save the checkpoint.

    RECIPE is a YAML file (see the bundled ones for every key), or the name of a bundled recipe.
    """
    from lowbit import launch
    from lowbit.inspection import inspect_text
    from lowbit.recipe import load_recipe

    if ranks > 1:
        options = {"--model": model, "--output": output, "--device": device, "--overwrite": overwrite, "--resume": resume}
        sys.exit(launch.launch_ranks(ranks, [recipe, *launch.as_arguments(options)], device))
    with launch.this_rank(device) as (world, device):  # a rank's bad recipe is reported to the others too
        r = load_recipe(recipe, model=model, output=str(output) if output else None)
        path = pipeline.quantize(r, overwrite=overwrite, resume=resume, device=device)
    if world.main:
        click.echo(inspect_text(path))
        click.echo(f"saved {path}" + (f" (calibrated on {world.size} ranks)" if world.size > 1 else ""))


@main.command("eval")
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
@_fail_cleanly
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


@main.command()
@click.argument("ckpt")
@click.option("--prompt", required=True, help="Text to continue.")
@click.option("--max-new-tokens", type=int, default=64, show_default=True)
@click.option("--temperature", type=float, default=0.0, show_default=True, help="0 = greedy.")
@click.option("--top-p", type=float, default=1.0, show_default=True)
@click.option("--seed", type=int, default=None, help="Seed for sampling.")
@click.option("--chat", is_flag=True, help="Wrap the prompt in the tokenizer's chat template.")
@click.option("--kv", default=None, help=KV_HELP)
@click.option("--device", default=None, help=DEVICE_HELP)
@_fail_cleanly
def generate(ckpt, prompt, max_new_tokens, temperature, top_p, seed, chat, kv, device):
    """Stream a continuation of PROMPT, then print TTFT and mean ITL."""
    import runtime

    model = runtime.load(ckpt, device=pipeline.default_device(device), kv=kv)
    if chat:
        from lowbit.chat_template import TemplateTimeout, render_chat

        try:
            prompt = render_chat(model.tokenizer, [{"role": "user", "content": prompt}])
        except TemplateTimeout as e:
            raise click.ClickException(str(e)) from None
    gen = model.generate(prompt, max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, seed=seed)
    for token in gen:
        click.echo(token.text, nl=False)
    click.echo()
    n = len(gen.itl_s) + 1
    click.echo(f"[{n} tokens, TTFT {gen.ttft_s * 1000:.1f} ms, mean ITL {gen.mean_itl_s * 1000:.1f} ms, "
               f"KV cache {model.kv_scheme.name}]", err=True)


@main.command()
@click.argument("ckpt")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on (0.0.0.0: every interface).")
@click.option("--port", type=int, default=8000, show_default=True, help="Port to listen on (0: any free one).")
@click.option("--kv", default=None, help=KV_HELP)
@click.option("--kv-memory", default=None, help="KV-cache budget (20GB, 512MiB); default: --max-batch full contexts, at most 80% "
              "of the free GPU memory (CUDA) or half the available memory (CPU).")
@click.option("--max-batch", type=int, default=32, show_default=True, help="Requests decoding at once.")
@click.option("--max-queue", type=int, default=256, show_default=True,
              help="Requests waiting beyond --max-batch; more are answered 503.")
@click.option("--api-key", default=None, envvar="LOWBIT_API_KEY",
              help="Require 'Authorization: Bearer KEY' on /v1. Prefer setting LOWBIT_API_KEY: a flag's value "
                   "shows in ps to every user of the machine. /health and /metrics stay open.")
@click.option("--max-body", default="4MiB", show_default=True,
              help="Largest request body (413 beyond it, before it is read).")
@click.option("--device", default=None, help=DEVICE_HELP)
@_fail_cleanly
def serve(ckpt, host, port, kv, kv_memory, max_batch, max_queue, api_key, max_body, device):
    """Serve CKPT over the OpenAI API (/v1/completions, /v1/chat/completions, /v1/models), with /health and
    /metrics. SIGTERM or Ctrl-C finishes the running requests, then exits."""
    try:
        from lowbit.serve import serve as run_server
    except ImportError as e:
        raise click.ClickException(f"lowbit serve needs the serve extra ({e.name} is missing): "
                                   "pip install 'lowbit[serve]'") from None
    from runtime.units import parse_bytes

    run_server(ckpt, host=host, port=port, kv=kv, kv_memory=kv_memory, max_batch=max_batch, max_queue=max_queue,
               api_key=api_key, max_body_bytes=parse_bytes(max_body), device=pipeline.default_device(device))


@main.command()
@click.argument("ckpt")
@click.option("--layers", is_flag=True, help="Also list every quantized layer with its scheme and errors.")
@_fail_cleanly
def inspect(ckpt, layers):
    """Verify CKPT as a load does, then: what produced it, sizes, and per scheme its layers and their
    mean and worst weight error."""
    from lowbit.inspection import inspect_text

    click.echo(inspect_text(ckpt, layers=layers))


@main.command()
@click.argument("ckpt")
@click.option("--gguf", "gguf_type", required=True,
              help="GGUF type for llama.cpp / Ollama: Q4_0, Q4_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K (a Linear on "
                   "that type's grid is copied, any other re-fitted by RTN), exact (each Linear to the type its "
                   "grid is; anything else an error), or F16/BF16/F32.")
@click.option("-o", "--output", type=click.Path(dir_okay=False, path_type=Path), required=True, help="The .gguf file.")
@click.option("--overwrite", is_flag=True, help="Replace the output if it is a GGUF file (never other files).")
@_fail_cleanly
def export(ckpt, gguf_type, output, overwrite):
    """Write CKPT (a lowbit checkpoint, float model or alias) as a GGUF file llama.cpp loads."""
    from quant.gguf.export import export as export_gguf

    report = export_gguf(ckpt, gguf_type, output, overwrite=overwrite)
    for line in report.lines():
        click.echo(line)
    click.echo(f"saved {output}")


@main.command()
def recipes():
    """List the bundled recipes (each usable by name in `lowbit quantize` and `lowbit demo --recipe`)."""
    from lowbit.recipe import load_recipe

    click.echo(f"bundled recipes in {bundled_recipes_dir()}:")
    for name in bundled_recipe_names():
        w = load_recipe(name).weights
        group = "per-channel" if w.group_size == -1 else f"g{w.group_size}"
        click.echo(f"  {name:<18} {w.method:<9} w{w.bits} {group} {'sym' if w.symmetric else 'asym'}")


@main.command()
@click.option("--recipe", default="default", show_default=True, help="A recipe file or a bundled recipe's name.")
@click.option("--tokens", type=int, default=DEMO_TOKENS, show_default=True,
              help=f"Tokens to score (`lowbit eval` scores {pipeline.DEFAULT_PROTOCOL.tokens} by default).")
@click.option("--overwrite", is_flag=True, help="Re-quantize even if the output exists.")
@_fail_cleanly
def demo(recipe, tokens, overwrite):
    """The main job on the bundled default: quantize, evaluate against the float model, report.
    A checkpoint already at the recipe's output is reused (--overwrite quantizes again)."""
    from lowbit.recipe import load_recipe

    r = load_recipe(recipe)
    output = Path(r.output)
    if output.exists() and not overwrite:
        click.echo(f"reusing the checkpoint in {output} (pass --overwrite to quantize again)")
    else:
        pipeline.quantize(r, overwrite=overwrite)
    result = pipeline.evaluate(str(output), protocol=pipeline.make_protocol(tokens=tokens))
    click.echo(pipeline.report_markdown(result))


@main.command()
@click.argument("model")
@click.option("--memory", required=True, help="Memory budget: 24GB, 24GiB, 512MB or bytes.")
@click.option("--context", type=int, default=8192, show_default=True, help="Tokens per sequence.")
@click.option("--reserve", default="0", show_default=True, help="Memory held back for activations and the framework.")
@click.option("--kv", "schemes", multiple=True,
              help=f"KV schemes to plan (repeatable; default {', '.join(kv_families.listed_names())}); any name --kv "
                   "takes elsewhere, with -g<group_size> and -r<residual> (int4-g64-r128).")
@click.option("--json", "json_out", type=click.Path(dir_okay=False, path_type=Path), help="Write the plan as JSON.")
@_fail_cleanly
def plan(model, memory, context, reserve, schemes, json_out):
    """How many sequences of --context tokens fit in --memory beside MODEL's weights, per KV scheme (config only)."""
    from evals import planner
    from evals.provenance import commit, versions

    result = planner.plan(model, planner.parse_memory(memory), context, schemes or planner.DEFAULT_SCHEMES,
                          planner.parse_memory(reserve))
    click.echo(planner.plan_text(result))
    if json_out:
        json_out.write_text(json.dumps({**result, "versions": versions(), "commit": commit()}, indent=2))


@main.command()
@click.argument("ckpt")
@click.option("--batch", "batches", default="1,2,4", show_default=True, help="Batch sizes (comma-separated).")
@click.option("--prompt-len", default="128,512", show_default=True, help="Prompt lengths (comma-separated).")
@click.option("--output-len", default="32", show_default=True, help="Output lengths (comma-separated).")
@click.option("--kv", help=KV_HELP)
@click.option("--repeats", type=int, default=1, show_default=True)
@click.option("--json", "json_out", type=click.Path(dir_okay=False, path_type=Path), help="Write the timings as JSON.")
@click.option("--device", default=None, help=DEVICE_HELP)
@_fail_cleanly
def speed(ckpt, batches, prompt_len, output_len, kv, repeats, json_out, device):
    """Prefill (TTFT, prompt tokens/s) and decode (ITL, tokens/s) of CKPT on this device."""
    from evals.provenance import provenance

    device = pipeline.default_device(device)
    result = _speed_sweep(ckpt, kv, batches, prompt_len, output_len, device, repeats)
    click.echo(result.pop("table"))
    if json_out:
        json_out.write_text(json.dumps({"model": ckpt, **result, **provenance(device)}, indent=2))


@main.command()
@click.argument("ckpt")
@click.option("--prompt-len", type=int, default=512, show_default=True)
@click.option("--output-len", type=int, default=64, show_default=True)
@click.option("--batch", type=int, default=1, show_default=True)
@click.option("--kv", help=KV_HELP)
@click.option("--json", "json_out", type=click.Path(dir_okay=False, path_type=Path), help="Write the diagnosis as JSON.")
@click.option("--device", default=None, help=DEVICE_HELP)
@_fail_cleanly
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


@main.command()
@click.argument("ckpt")
@click.option("--device", default=None, help=DEVICE_HELP)
@click.option("--dtype", type=click.Choice(["float16", "bfloat16", "float32"]),
              help="Compute dtype (default: the checkpoint's on a GPU, float32 on CPU).")
@click.option("--kv", help=KV_HELP)
@click.option("--json", "json_out", type=click.Path(dir_okay=False, path_type=Path), help="Write the table as JSON.")
@_fail_cleanly
def doctor(ckpt, device, dtype, kv, json_out):
    """Which kernels run CKPT here: fused, or the reference path and why (the load-time self-check's table)."""
    import torch

    import runtime
    from evals.provenance import describe_device, provenance
    from runtime import selfcheck

    model = runtime.load(ckpt, device=pipeline.default_device(device), kv=kv, dtype=getattr(torch, dtype) if dtype else None)
    selfcheck.check_decoder(model.decoder, model.dtype, model.kv_scheme)  # done at load on CUDA: kept outcomes
    rows = selfcheck.kernel_table(model.decoder, model.dtype, model.kv_scheme)
    prov = provenance(model.device)
    on_triton = any(r["runs"] == "fused" or (r["why"] or "").startswith("fell back") for r in rows)
    checked = "no kernel runs on Triton here" if not on_triton else \
        "fused kernels checked against the reference at load" if selfcheck.enabled(model.decoder) else \
        f"fused kernels NOT checked ({selfcheck.ENV_SWITCH}=0 or --no-self-check)"
    click.echo(f"{ckpt} on {describe_device(prov['device'])}, torch {torch.__version__}, Triton "
               f"{selfcheck.triton_version()}; {checked}:")
    click.echo(selfcheck.table_text(rows))
    if json_out:
        json_out.write_text(json.dumps({"model": ckpt, "kernels": rows, "triton": selfcheck.triton_version(),
                                        "self_check": selfcheck.enabled(model.decoder), **prov}, indent=2))


@main.command()
@click.argument("runs", nargs=-1, required=True)
@click.option("--out", "out_dir", required=True, type=click.Path(file_okay=False, path_type=Path), help="Output directory.")
@_fail_cleanly
def report(runs, out_dir):
    """Put eval runs (JSON from `lowbit eval --json`, or directories of them) side by side: JSON, Markdown, HTML."""
    from evals.report import write_report

    files = write_report(runs, out_dir)
    click.echo(Path(files["markdown"]).read_text())
    click.echo("wrote " + ", ".join(str(f) for f in files.values()))


@main.command()
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
@_fail_cleanly
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


if __name__ == "__main__":
    main()
