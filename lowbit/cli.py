"""The ``lowbit`` command line."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from lowbit import pipeline

DEFAULT_RECIPE = Path(__file__).parent.parent / "recipes" / "default.yaml"


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
                FileNotFoundError, FileExistsError, ValueError) as e:
            raise click.ClickException(str(e)) from None

    return wrapper


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="lowbit")
def main():
    """Quantize LLMs into compressed checkpoints, run them, measure them."""


@main.command()
@click.argument("recipe", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--model", help="Override the recipe's model: alias, local HF directory or hub id.")
@click.option("--output", type=click.Path(path_type=Path), help="Override the recipe's output directory.")
@click.option("--overwrite", is_flag=True, help="Replace the output directory if it exists.")
@click.option("--resume", is_flag=True, help="Continue an interrupted calibrated run from its last finished layer.")
@click.option("--device", default=None, help="Compute device for calibration (default: cuda if available, else cpu).")
@_fail_cleanly
def quantize(recipe, model, output, overwrite, resume, device):
    """Quantize a model as RECIPE.yaml says and save the checkpoint."""
    from lowbit.recipe import load_recipe

    r = load_recipe(recipe, model=model, output=str(output) if output else None)
    path = pipeline.quantize(r, overwrite=overwrite, resume=resume, device=device)
    click.echo(pipeline.inspect_text(path))
    click.echo(f"saved {path}")


@main.command("eval")
@click.argument("ckpt")
@click.option("--baseline", help="Model to compare with (default: the one the checkpoint was made from).")
@click.option("--no-baseline", is_flag=True, help="Skip the baseline.")
@click.option("--text", default="default", show_default=True, help="Bundled 'default' (Persuasion) or 'code' (Python source), or a .txt/.jsonl path.")
@click.option("--tokens", type=int, default=pipeline.DEFAULT_PROTOCOL.tokens, show_default=True, help="Tokens of the text to score.")
@click.option("--window", type=int, default=pipeline.DEFAULT_PROTOCOL.window, show_default=True)
@click.option("--stride", type=int, default=pipeline.DEFAULT_PROTOCOL.stride, show_default=True)
@click.option("--json", "json_out", type=click.Path(dir_okay=False, path_type=Path), help="Write the results as JSON.")
@click.option("--report", type=click.Path(dir_okay=False, path_type=Path), help="Write a Markdown report.")
@_fail_cleanly
def eval_(ckpt, baseline, no_baseline, text, tokens, window, stride, json_out, report):
    """Perplexity of CKPT (and its baseline), bytes on disk, bits per weight."""
    protocol = pipeline.make_protocol(window=window, stride=stride, tokens=tokens)
    result = pipeline.evaluate(ckpt, baseline=baseline, use_baseline=not no_baseline, text=text, protocol=protocol)
    md = pipeline.report_markdown(result)
    click.echo(md)
    if json_out:
        json_out.write_text(json.dumps(result, indent=2))
    if report:
        report.write_text(md)


@main.command()
@click.argument("ckpt")
@click.option("--prompt", required=True, help="Text to continue.")
@click.option("--max-new-tokens", type=int, default=64, show_default=True)
@click.option("--temperature", type=float, default=0.0, show_default=True, help="0 = greedy.")
@click.option("--top-p", type=float, default=1.0, show_default=True)
@click.option("--seed", type=int, default=None, help="Seed for sampling.")
@click.option("--chat", is_flag=True, help="Wrap the prompt in the tokenizer's chat template.")
@_fail_cleanly
def generate(ckpt, prompt, max_new_tokens, temperature, top_p, seed, chat):
    """Stream a continuation of PROMPT, then print TTFT and mean ITL."""
    import runtime

    model = runtime.load(ckpt)
    if chat:
        prompt = model.tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
        )
    gen = model.generate(prompt, max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, seed=seed)
    for token in gen:
        click.echo(token.text, nl=False)
    click.echo()
    n = len(gen.itl_s) + 1
    click.echo(f"[{n} tokens, TTFT {gen.ttft_s * 1000:.1f} ms, mean ITL {gen.mean_itl_s * 1000:.1f} ms]", err=True)


@main.command()
@click.argument("ckpt")
@_fail_cleanly
def inspect(ckpt):
    """Scheme per layer, sizes, bits per weight, and what produced CKPT."""
    click.echo(pipeline.inspect_text(ckpt))


@main.command()
@click.option("--recipe", type=click.Path(dir_okay=False, path_type=Path), default=DEFAULT_RECIPE, show_default=True)
@click.option("--tokens", type=int, default=pipeline.DEFAULT_PROTOCOL.tokens, show_default=True)
@click.option("--overwrite", is_flag=True, help="Re-quantize even if the output exists.")
@_fail_cleanly
def demo(recipe, tokens, overwrite):
    """The main job on the bundled default: quantize, evaluate against the float model, report."""
    from lowbit.recipe import load_recipe

    r = load_recipe(recipe)
    output = Path(r.output)
    if output.exists() and not overwrite:
        click.echo(f"reusing the checkpoint in {output} (pass --overwrite to quantize again)")
    else:
        pipeline.quantize(r, overwrite=overwrite)
    result = pipeline.evaluate(str(output), protocol=pipeline.make_protocol(tokens=tokens))
    click.echo(pipeline.report_markdown(result))


if __name__ == "__main__":
    main()
