"""The ``lowbit`` command line: the group and the commands that make and run checkpoints; the measuring
commands live in ``lowbit.cli_measure``."""

from __future__ import annotations

# first: lowbit.cli_options sets OpenMP's defaults before anything imports torch
from lowbit.cli_options import DEVICE_HELP, KV_HELP, fail_cleanly  # isort: skip

import json
import sys
import warnings
from pathlib import Path

import click

from lowbit import cli_measure, pipeline
from lowbit.recipe_files import bundled_recipe_names, bundled_recipes_dir

# The demo scores the first 4,096 tokens (7 windows of 1,024 per model, not 31), a quarter of the
# evaluation's time; how far its perplexity change strays from 16,384 tokens' is not measured yet.
DEMO_TOKENS = 4096


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="lowbit")
@click.option("--no-self-check", is_flag=True,
              help="Skip the checks of the GPU kernels against the reference: at load, at an Engine's start-up and of "
                   "GEMM configurations tuned at first use (as LOWBIT_SELF_CHECK=0).")
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
@fail_cleanly
def quantize(recipe, model, output, overwrite, resume, device, ranks):
    """Quantize a model as RECIPE says and save the checkpoint.

    RECIPE is a YAML file (see the bundled ones for every key), or the name of a bundled recipe.
    """
    from lowbit import launch
    from lowbit.inspection import inspect_text
    from lowbit.recipe_files import load_recipe

    if ranks > 1:
        options = {"--model": model, "--output": output, "--device": device, "--overwrite": overwrite, "--resume": resume}
        sys.exit(launch.launch_ranks(ranks, [recipe, *launch.as_arguments(options)], device))
    with launch.this_rank(device) as (world, device):  # a rank's bad recipe is reported to the others too
        r = load_recipe(recipe, model=model, output=str(output) if output else None)
        path = pipeline.quantize(r, overwrite=overwrite, resume=resume, device=device)
    if world.main:
        click.echo(inspect_text(path))
        click.echo(f"saved {path}" + (f" (calibrated on {world.size} ranks)" if world.size > 1 else ""))


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
@fail_cleanly
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
@fail_cleanly
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
@fail_cleanly
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
@fail_cleanly
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
    from lowbit.recipe_files import load_recipe

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
@fail_cleanly
def demo(recipe, tokens, overwrite):
    """The main job on the bundled default: quantize, evaluate against the float model, report.
    A checkpoint already at the recipe's output is reused (--overwrite quantizes again)."""
    from lowbit.recipe_files import load_recipe

    r = load_recipe(recipe)
    output = Path(r.output)
    if output.exists() and not overwrite:
        click.echo(f"reusing the checkpoint in {output} (pass --overwrite to quantize again)")
    else:
        pipeline.quantize(r, overwrite=overwrite)
    result = pipeline.evaluate(str(output), protocol=pipeline.make_protocol(tokens=tokens))
    click.echo(pipeline.report_markdown(result))


@main.command()
@click.argument("ckpt")
@click.option("--device", default=None, help=DEVICE_HELP)
@click.option("--dtype", type=click.Choice(["float16", "bfloat16", "float32"]),
              help="Compute dtype (default: the checkpoint's on a GPU, float32 on CPU).")
@click.option("--kv", help=KV_HELP)
@click.option("--json", "json_out", type=click.Path(dir_okay=False, path_type=Path), help="Write the table as JSON.")
@fail_cleanly
def doctor(ckpt, device, dtype, kv, json_out):
    """Which kernels run CKPT here: each quantized Linear kind's backend and every backend it passed over,
    with why (from the choice made at load); the small ops and attention fused, or the reference and why."""
    import torch

    import runtime
    from evals.provenance import describe_device, provenance
    from runtime import selfcheck

    model = runtime.load(ckpt, device=pipeline.default_device(device), kv=kv, dtype=getattr(torch, dtype) if dtype else None)
    selfcheck.check_decoder(model.decoder, model.dtype, model.kv_scheme)  # done at load on CUDA: kept outcomes
    rows = selfcheck.kernel_table(model.decoder, model.dtype, model.kv_scheme)
    prov = provenance(model.device)
    on_triton = any(r["runs"] in ("fused", "triton") or (r["why"] or "").startswith("fell back") for r in rows)
    checked = "no kernel runs on Triton here" if not on_triton else \
        "fused kernels checked against the reference at load" if selfcheck.enabled(model.decoder) else \
        f"fused kernels NOT checked ({selfcheck.ENV_SWITCH}=0 or --no-self-check)"
    click.echo(f"{ckpt} on {describe_device(prov['device'])}, torch {torch.__version__}, Triton "
               f"{selfcheck.triton_version()}; {checked}:")
    click.echo(selfcheck.table_text(rows))
    plan = None
    if model.device.type == "cpu":  # which path each CPU weight runs per rows bucket, and the float bar
        from runtime import cpu_plan
        from runtime.linear import plan_keys

        from runtime import native

        plan = cpu_plan.table_rows(plan_keys(model.decoder))
        levels = native.cpu_levels()  # the native kernels' build level, and what this CPU could run
        click.echo(f"native kernels: level {native.level()} (this CPU runs {', '.join(levels)}; "
                   "LOWBIT_NATIVE_LEVEL caps it)" if native.enabled() else "native kernels: off (LOWBIT_NATIVE=0)")
        prov["device"]["native_level"] = native.level() if native.enabled() else None
        click.echo(cpu_plan.describe_machine() + ":")
        click.echo(cpu_plan.table_text(plan))
    if json_out:
        json_out.write_text(json.dumps({"model": ckpt, "kernels": rows, "triton": selfcheck.triton_version(),
                                        "self_check": selfcheck.enabled(model.decoder), "cpu_plan": plan, **prov},
                                       indent=2))


for _command in cli_measure.COMMANDS:
    main.add_command(_command)


if __name__ == "__main__":
    main()
