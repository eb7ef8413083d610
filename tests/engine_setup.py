"""What the engine tests share: a tiny random Llama saved once per module, loaded with an fp16
and an INT4 cache, prompts of different lengths, and the plain runtime's tokens to compare with
(``Model.generate`` for one request alone)."""

import pytest
import torch

import runtime
from runtime.sampling import SamplingParams
from tiny import save_model, tiny_llama

FP16 = "fp16-r16"  # blocks of 16 tokens: short prompts already fill and page blocks
INT4 = "int4-g16-r16"
LENGTHS = (5, 21, 9, 34, 14)  # prompts of different lengths, several crossing block boundaries


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    # initializer_range 0.3: outputs that change with the context (HF's 0.02 repeats one token),
    # so a request that attended to the wrong sequence or position would show
    model, tok = tiny_llama(hidden=64, layers=2, initializer_range=0.3)  # head_dim 16: the kernels take it
    return save_model(model, tok, tmp_path_factory.mktemp("engine") / "m")


@pytest.fixture(scope="module")
def models(model_dir):
    return {kv: runtime.load(model_dir, kv=kv) for kv in (FP16, INT4)}


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, 150, (n,), generator=g).tolist() for n in LENGTHS]


_plain_cache = {}


def plain(model, prompt, n, **kwargs):
    """The plain runtime's tokens for one request alone (memoized: the reference is slow on 2 cores).
    An entry keeps its model alive, so no later model (another module's fixture) reuses its id."""
    key = (id(model), tuple(prompt), n, tuple(sorted(kwargs.items())))
    if key not in _plain_cache:
        tokens = [t.id for t in model.generate(prompt, max_new_tokens=n, stop_at_eos=False, **kwargs)]
        _plain_cache[key] = (model, tokens)
    return _plain_cache[key][1]


def greedy(n):
    return SamplingParams(max_tokens=n, ignore_eos=True)
