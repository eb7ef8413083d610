"""lowbit checkpoints as an lm-eval model type: ``--model lowbit --model_args pretrained=CKPT,kv=int4``.

Importing this module registers the ``lowbit`` model with lm-eval. lm-eval 0.4
has no plugin discovery, so its own ``lm_eval`` command does not import it:
``lowbit-lm-eval`` is that command with the model registered (same arguments),
and ``lowbit eval CKPT --tasks ...`` runs tasks from lowbit's CLI (:func:`run_tasks`; the tasks
themselves, offline ones included: ``evals.lm_eval_tasks``).

Scoring runs on :func:`runtime.load`'s model:

* ``kv``: the KV-cache scheme (``fp16``, ``int8``, ``int4``, ``int2``, ``fp8``, with
  ``-g``/``-r`` settings); default: the one saved with the checkpoint;
* an unquantized cache: plain forwards (``Model.logits``), several requests per
  batch, right-padded (causal attention: padding after a request cannot change it);
* a quantized cache: one request at a time through the runtime's KV cache, as
  serving runs it (``evals.kv``'s chunked path): the context is prefilled in one
  forward, then the continuation goes in chunks of ``kv_chunk`` tokens, so
  attention reads the quantized keys and values of every full block before it.

``generate_until`` is the runtime's streaming generation (through the model's KV
cache; greedy unless the task asks for sampling), cut at the task's ``until`` strings.
"""

from __future__ import annotations

import sys
import warnings

import torch
import torch.nn.functional as F
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
from tqdm.auto import tqdm

import runtime
from evals.kv import chunked_logits_fn, runtime_session
from evals.lm_eval_tasks import build_offline_tasks, prepare_tasks
from kvquant import KVScheme

DEFAULT_MAX_LENGTH = 2048  # CPU-friendly default window for rolling log-likelihoods


def _bool(value) -> bool:
    return str(value).lower() in ("1", "true", "yes")


@register_model("lowbit")
class LowbitLM(TemplateLM):
    """An lm-eval model over a lowbit (or any compressed-tensors / float HF) checkpoint."""

    def __init__(self, pretrained: str = "smollm2-135m", kv: str | None = None, device: str = "cpu",
                 batch_size: int | str = 8, max_length: int | None = None, kv_chunk: int = 32,
                 model: runtime.Model | None = None, **kwargs):
        super().__init__()
        if str(device).startswith("cuda") and not torch.cuda.is_available():
            # lm-eval's command line asks for cuda unless told otherwise: run where we can, and say so
            warnings.warn(f"device {device!r} is not available here; running on cpu")
            device = "cpu"
        self.model = model or runtime.load(pretrained, device=device, kv=kv)
        if self.model.tokenizer is None:
            raise ValueError(f"{self.model.path} has no tokenizer: lm-eval tasks are text")
        self.tokenizer = self.model.tokenizer
        self.pretrained = str(pretrained)
        self.kv: KVScheme = self.model.kv_scheme
        self.batch_size = int(batch_size) if str(batch_size).isdigit() else 8  # "auto" is a GPU notion
        self.max_length = min(int(max_length or DEFAULT_MAX_LENGTH), self.model.max_positions)
        self.kv_chunk = int(kv_chunk)
        if self.kv_chunk < 1:
            raise ValueError(f"kv_chunk must be at least 1, got {kv_chunk}")
        self.add_bos = _bool(kwargs.pop("add_bos_token", False))
        kwargs.pop("max_batch_size", None)  # lm-eval passes it to every model; batches here are fixed
        if kwargs:
            warnings.warn(f"the lowbit model ignores {', '.join(sorted(kwargs))}; it takes pretrained, kv, device, "
                          "batch_size, max_length, kv_chunk, add_bos_token")

    # ------------------------------------------------------------ tokens

    @property
    def eot_token_id(self) -> int:
        eos = self.tokenizer.eos_token_id
        return eos if eos is not None else (self.model.eos_token_ids or [0])[0]

    @property
    def prefix_token_id(self) -> int:
        bos = self.tokenizer.bos_token_id
        return bos if bos is not None else self.eot_token_id

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        special = self.add_bos if add_special_tokens is None else add_special_tokens
        return self.tokenizer(string, add_special_tokens=special).input_ids

    def tok_decode(self, tokens) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=True)

    # ------------------------------------------------------------ scoring

    def _window(self, context: list[int], continuation: list[int]) -> tuple[list[int], int]:
        """The input ids (context + continuation minus its last token), cut from the left to
        ``max_length``, and how many continuation tokens they score (all of them)."""
        if not continuation:
            raise ValueError("lm-eval asked to score an empty continuation")
        ids = (context + continuation)[-(self.max_length + 1):][:-1]
        return ids, min(len(continuation), len(ids))

    def _score_plain(self, batch: list[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
        """One right-padded forward for several (input ids, continuation) pairs."""
        width = max(len(ids) for ids, _ in batch)
        inputs = torch.zeros(len(batch), width, dtype=torch.long)
        for row, (ids, _) in enumerate(batch):
            inputs[row, : len(ids)] = torch.tensor(ids)
        logits = self.model.logits(inputs)
        out = []
        for row, (ids, cont) in enumerate(batch):
            scored = logits[row, len(ids) - len(cont): len(ids)]
            out.append(_score(scored, cont))
        return out

    def _score_cached(self, ids: list[int], cont: list[int]) -> tuple[float, bool]:
        """Prefill the context through the quantized cache, then feed the continuation in chunks."""
        split = len(ids) - len(cont) + 1  # the context; the logits at its last position score cont[0]
        logits_fn = chunked_logits_fn(runtime_session(self.model, self.kv), split, self.kv_chunk)
        logits = logits_fn(torch.tensor([ids]))[0]
        return _score(logits[split - 1:], cont)

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        windows = [self._window(ctx, cont) for _, ctx, cont in requests]
        pairs = [(ids, cont[-n:]) for (ids, n), (_, _, cont) in zip(windows, requests)]
        results: list[tuple[float, bool] | None] = [None] * len(pairs)
        # longest first: a batch's padding stays small, and an out-of-memory shows up at once
        order = sorted(range(len(pairs)), key=lambda i: -len(pairs[i][0]))
        step = self.batch_size if not self.kv.quantized else 1
        for start in tqdm(range(0, len(order), step), desc="lowbit loglikelihood", disable=disable_tqdm):
            chunk = order[start: start + step]
            if self.kv.quantized:
                scores = [self._score_cached(*pairs[i]) for i in chunk]
            else:
                scores = self._score_plain([pairs[i] for i in chunk])
            for i, s in zip(chunk, scores):
                results[i] = s
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Each document scored whole, in disjoint windows of ``max_length`` tokens (lm-eval's rolling scheme)."""
        out = []
        for (text,) in tqdm([r.args for r in requests], desc="lowbit rolling", disable=disable_tqdm):
            windows = [make_disjoint_window(w) for w in get_rolling_token_windows(
                token_list=self.tok_encode(text, add_special_tokens=False), prefix_token=self.prefix_token_id,
                max_seq_len=self.max_length, context_len=1)]
            scores = self._loglikelihood_tokens([(None, ctx, cont) for ctx, cont in windows], disable_tqdm=True)
            out.append(sum(logprob for logprob, _ in scores))
        return out

    # ------------------------------------------------------------ generation

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        out = []
        for context, gen_kwargs in tqdm([r.args for r in requests], desc="lowbit generate", disable=disable_tqdm):
            out.append(self._generate(context, dict(gen_kwargs or {})))
        return out

    def _generate(self, context: str, kwargs: dict) -> str:
        """The runtime's own streaming generation (through the model's KV cache), cut at the first stop string."""
        until = kwargs.pop("until", None) or []
        until = [stop for stop in ([until] if isinstance(until, str) else until) if stop]
        max_new = int(kwargs.pop("max_gen_toks", 256))
        temperature = float(kwargs.pop("temperature", 0.0)) if _bool(kwargs.pop("do_sample", False)) else 0.0
        room = self.max_length - max_new  # the answer must fit in the window too: cut the prompt from the left
        if room < 1:
            raise ValueError(f"max_gen_toks {max_new} leaves no room for a prompt in max_length {self.max_length}")
        ids = (self.tok_encode(context) or [self.prefix_token_id])[-room:]
        text = ""
        for token in self.model.generate(ids, max_new_tokens=max_new, temperature=temperature,
                                         top_p=float(kwargs.pop("top_p", 1.0)), seed=int(kwargs.pop("seed", 1234))):
            text += token.text
            if any(stop in text for stop in until):
                break
        for stop in until:
            text = text.split(stop)[0]
        return text


def _score(logits: torch.Tensor, continuation: list[int]) -> tuple[float, bool]:
    """Sum of log-probabilities of ``continuation`` under ``logits`` [n, V], and whether greedy picks it."""
    target = torch.tensor(continuation, device=logits.device)
    logprobs = F.log_softmax(logits.double(), dim=-1)
    total = float(logprobs.gather(1, target[:, None]).sum())
    return total, bool((logits.argmax(-1) == target).all())


def run_tasks(ckpt: str, tasks: list[str], kv: str | None = None, limit: int | float | None = None,
              num_fewshot: int | None = None, batch_size: int = 8, device: str = "cpu", model=None) -> dict:
    """Evaluate ``tasks`` on ``ckpt`` through lm-eval; per task its metrics, plus the settings that produced them."""
    import lm_eval

    manager = prepare_tasks(tasks)
    lm = LowbitLM(pretrained=ckpt, kv=kv, device=device, batch_size=batch_size, model=model)
    out = lm_eval.simple_evaluate(model=lm, tasks=tasks, num_fewshot=num_fewshot,
                                  limit=limit, task_manager=manager, bootstrap_iters=0, log_samples=False)
    results = {name: {k: v for k, v in metrics.items() if k != "alias" and not isinstance(v, str)}
               for name, metrics in out["results"].items()}
    return {
        "tasks": results,
        "settings": {"tasks": tasks, "kv": lm.kv.name, "limit": limit, "num_fewshot": num_fewshot,
                     "max_length": lm.max_length, "lm_eval": lm_eval.__version__ if hasattr(lm_eval, "__version__")
                     else _lm_eval_version()},
        "n_samples": {k: v.get("effective", v.get("original")) if isinstance(v, dict) else v
                      for k, v in (out.get("n-samples") or {}).items()},
    }


def _lm_eval_version() -> str:
    from importlib.metadata import version

    return version("lm_eval")


def main() -> None:
    """``lowbit-lm-eval``: lm-eval's own command line, with the ``lowbit`` model registered."""
    from lm_eval.__main__ import cli_evaluate

    if "--include_path" not in sys.argv:  # the offline tasks are always there to be named
        sys.argv += ["--include_path", str(build_offline_tasks())]
    cli_evaluate()
