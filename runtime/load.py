"""``runtime.load``: a checkpoint directory (or alias) to a model that gives logits and streams tokens."""

from __future__ import annotations

from pathlib import Path

import torch

from kvquant import KVScheme, kv_scheme_from_dict, parse_kv
from quant import checkpoint, models
from quant.affine import QuantScheme
from runtime.cache import KVCache
from runtime.cache_lockstep import LockstepCache
from runtime.generate import Generation, check_prompt
from runtime.sampling import check_sampling
from runtime import cpu_linear, cpu_plan, linear_backends, native, selfcheck
from runtime.linear import QuantLinear
from quant.architectures import architecture
from runtime.model import MLP, Attention, Decoder, DecoderConfig, RMSNorm, plain_linear

# Any of these makes a directory's tokenizer loadable by AutoTokenizer.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def linear_factory(schemes: dict[str, QuantScheme]):
    def make_linear(name: str, in_features: int, out_features: int, bias: bool):
        if name in schemes:
            return QuantLinear(in_features, out_features, schemes[name], bias)
        return plain_linear(name, in_features, out_features, bias)

    return make_linear


def linear_names(cfg: DecoderConfig) -> list[str]:
    """Every Linear's name, known from the config alone (no weights needed)."""
    with torch.device("meta"):
        return [n for n, m in Decoder(cfg).named_modules() if isinstance(m, torch.nn.Linear)]


def load_tokenizer(path):
    from transformers import AutoTokenizer

    path = models.resolve(path)
    if not any((path / f).exists() for f in TOKENIZER_FILES):
        raise FileNotFoundError(f"{path} has no tokenizer files ({', '.join(TOKENIZER_FILES)})")
    return AutoTokenizer.from_pretrained(path, trust_remote_code=False)


class Model:
    """A loaded checkpoint: ``logits`` for evaluation, ``generate`` for streaming text."""

    def __init__(self, decoder: Decoder, config: dict, tokenizer, device: torch.device, dtype: torch.dtype, path: Path,
                 kv_scheme: KVScheme | None = None):
        self.decoder, self.config, self.tokenizer = decoder, config, tokenizer
        self.device, self.dtype, self.path = device, dtype, path
        self.kv_scheme = kv_scheme or KVScheme()
        self.kv_scheme.check_head_dim(decoder.cfg.head_dim)
        self.max_positions = decoder.cfg.max_positions
        eos = config.get("eos_token_id")
        self.eos_token_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))

    @property
    def num_parameters(self) -> int:
        """Parameters of the float model this represents (a quantized weight counts as in*out)."""
        total, seen = 0, set()
        for m in self.decoder.modules():
            if isinstance(m, QuantLinear):
                total += m.in_features * m.out_features
            for p in m.parameters(recurse=False):
                if id(p) not in seen:  # a tied lm_head shares the embedding: count it once
                    seen.add(id(p))
                    total += p.numel()
        return total

    def new_cache(self, max_len: int, batch: int = 1, scheme: KVScheme | None = None,
                  lockstep: bool = True) -> LockstepCache | KVCache:
        """A KV cache for ``batch`` sequences of up to ``max_len`` positions (default scheme: the model's):
        a ``LockstepCache`` for ``decoder(ids, cache, position)``, or with ``lockstep=False`` a
        ``KVCache`` of slots (``Model.generate``, through the engine's steps)."""
        cfg = self.decoder.cfg
        cls = LockstepCache if lockstep else KVCache
        return cls(cfg.num_layers, batch, cfg.num_kv_heads, cfg.head_dim, max_len, self.dtype, self.device,
                   scheme=scheme or self.kv_scheme, windows=cfg.sliding_windows)

    @torch.inference_mode()
    def logits(self, input_ids: torch.Tensor) -> torch.Tensor:
        """float32 logits [B, T, V] for token ids [B, T] (one forward, no cache)."""
        return self.decoder(input_ids.to(self.device, torch.long)).float()

    def generate(self, prompt: str | list[int], max_new_tokens: int = 64, temperature: float = 0.0,
                 top_p: float = 1.0, seed: int | None = None, stop_at_eos: bool = True,
                 prefill_chunk: int | None = None) -> Generation:
        """A lazy, iterable :class:`Generation`: the work happens while it is iterated.
        ``prefill_chunk``: prefill the prompt in pieces cut at its multiples (as the engine does)."""
        check_sampling(max_new_tokens, temperature, top_p)
        if prefill_chunk is not None and (isinstance(prefill_chunk, bool) or not isinstance(prefill_chunk, int)
                                          or prefill_chunk < 1):
            raise ValueError(f"prefill_chunk must be a positive integer or None, got {prefill_chunk!r}")
        ids = check_prompt(prompt, self.tokenizer, self.decoder.cfg.vocab_size, self.max_positions, self.path,
                           "the model's context (max_position_embeddings)")
        return Generation(self, ids, max_new_tokens, temperature, top_p, seed, stop_at_eos, prefill_chunk)


def default_dtype(device: torch.device, config: dict) -> torch.dtype:
    if device.type == "cpu":
        # float32 norms, attention and float Linears; the quantized Linears' CPU kernels take bf16
        # activations themselves (runtime/cpu_linear.py), where the int4 kernel is fast
        return torch.float32
    name = config.get("dtype") or config.get("torch_dtype") or "bfloat16"
    return {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}.get(name, torch.bfloat16)


def read_checked_tensors(path: Path, decoder: Decoder, config: dict, tied: bool) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors, exactly the ones ``decoder`` needs (an error names any other)."""
    if not list(path.glob("*.safetensors")):
        raise FileNotFoundError(f"no *.safetensors weights in {path} (lowbit reads safetensors only, never pickle)")
    tensors = text_decoder_tensors(checkpoint.read_tensors(path), config)
    # Older checkpoints store RoPE frequencies; we compute them from the config.
    tensors = {k: t for k, t in tensors.items() if not k.endswith("rotary_emb.inv_freq")}
    if tied:
        tensors.setdefault("lm_head.weight", tensors.get("model.embed_tokens.weight"))
    expected = set(decoder.state_dict())
    missing = sorted(expected - tensors.keys())
    unexpected = sorted(tensors.keys() - expected)
    if missing or unexpected:
        raise checkpoint.CheckpointError(
            f"{path}: tensors do not match a {config.get('model_type')} model with this config; "
            f"missing {missing[:5]}{' ...' if len(missing) > 5 else ''}, "
            f"unexpected {unexpected[:5]}{' ...' if len(unexpected) > 5 else ''}"
        )
    return tensors


def text_decoder_tensors(tensors: dict[str, torch.Tensor], config: dict) -> dict[str, torch.Tensor]:
    """A multimodal checkpoint's text decoder under the names the runtime uses (its family's
    ``text_part`` prefixes); the other parts' tensors (Gemma 3's vision tower and projector) are not
    read, as lowbit runs text prompts only. Other checkpoints: ``tensors`` as they are."""
    text_part = architecture(config.get("model_type")).text_part
    if text_part is None:
        return tensors
    out = {}
    for name, tensor in tensors.items():
        for stored, ours in text_part[2]:
            if name.startswith(stored):
                out[ours + name[len(stored):]] = tensor
                break
        else:
            if name.startswith("lm_head."):
                out[name] = tensor
    return out


def stored_linear_schemes(config: dict, names: list[str]) -> dict[str, QuantScheme]:
    """Which of the runtime's Linears ``names`` the checkpoint quantizes: its quantization_config names
    them as stored, so a multimodal checkpoint's text Linears are looked up under their stored prefixes."""
    text_part = architecture(config.get("model_type")).text_part
    stored = {}  # stored name -> runtime name
    for name in names:
        for prefix, ours in text_part[2] if text_part else ():
            if name.startswith(ours):
                stored[prefix + name[len(ours):]] = name
        stored.setdefault(name, name)
    return {stored[n]: scheme for n, scheme in checkpoint.linear_schemes(config, list(stored)).items()}


def check_quantized_shapes(decoder: Decoder, path: Path) -> None:
    for name, m in decoder.named_modules():
        if isinstance(m, QuantLinear) and m.weight_shape.tolist() != [m.out_features, m.in_features]:
            raise checkpoint.CheckpointError(
                f"{path}: {name}.weight_shape is {m.weight_shape.tolist()}, "
                f"the config says [{m.out_features}, {m.in_features}]"
            )


def narrow_float_weights(decoder: Decoder, device: torch.device, cpu_kernels: bool | None,
                         linear_backend: str | None = None) -> set[str]:
    """The float weights a quantized model keeps in bf16 (``cpu_linear.FLOAT_WEIGHTS``) rather than
    its compute dtype: on CPU with the quantized Linears on the CPU kernels, the embedding, lm_head and
    the decoder's unquantized Linears (not a mixture's router: its top-k picks are precision-sensitive).
    They would otherwise be float32, SmolLM2's and Llama-3.2-1B's tied embedding a third of the W4
    model's memory and of the bytes read per token. A Linear's weight stays float32 where its bf16
    product (or its widening) is slower than float32's on this CPU (``cpu_plan.keeps_narrow``: speed
    before memory, issue 42); a tied embedding follows lm_head. Empty elsewhere (float models, the reference)."""
    if device.type != "cpu" or not use_cpu_kernels(cpu_kernels, linear_backend) or not any(
            isinstance(m, QuantLinear) for m in decoder.modules()):
        return set()
    linears = {"lm_head": decoder.lm_head} if type(decoder.lm_head) is torch.nn.Linear else {}
    for owner_name, owner in decoder.named_modules():
        if isinstance(owner, (Attention, MLP)):
            linears |= {f"{owner_name}.{n}": m for n, m in owner.named_children() if type(m) is torch.nn.Linear}
    # bf16 only where that product is no slower than float32's on this CPU: measured (cpu_plan.keeps_narrow),
    # not assumed (a bf16 GEMM without AVX512-BF16/AMX is 3-6x slower than float32's); else float32
    names = {f"{n}.weight" for n, m in linears.items() if cpu_plan.keeps_narrow(m.out_features, m.in_features)}
    if not (decoder.cfg.tie_embeddings and "lm_head" in linears) or "lm_head.weight" in names:
        names.add("model.embed_tokens.weight")  # a gather, no product; tied, it is lm_head's tensor
    return names


def to_compute_dtype(tensors: dict[str, torch.Tensor], dtype: torch.dtype, tied: bool,
                     narrow: set[str] = frozenset()) -> dict[str, torch.Tensor]:
    """Float tensors in the compute dtype (scales keep the stored one: dequantize upcasts them),
    converted in place one at a time, so the stored copy of each is freed before the next is made
    (peak memory: the model once, plus one tensor); ``narrow`` ones stored in bf16 stay so
    (``narrow_float_weights``; never rounded: other stored dtypes go to ``dtype``). A tied lm_head
    is the embedding's tensor again. Everything but the packed codes owns its memory (see below)."""
    for name, t in tensors.items():
        if name in narrow and t.dtype == cpu_linear.FLOAT_WEIGHTS:
            tensors[name] = t.clone()
        elif t.is_floating_point() and not name.endswith("weight_scale") and not (tied and name == "lm_head.weight"):
            tensors[name] = t.to(dtype)
        elif not name.endswith("weight_packed"):
            # Tensors read from safetensors can be views of one mapping of the whole file, resident
            # while any view lives: the small ones kept (scales, zero points) get their own memory,
            # so the file is let go once the CPU kernels' copies replace the packed codes.
            tensors[name] = t.clone()
    if tied:
        tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"]
    return tensors


def kv_scheme_of(manifest: dict | None, kv: KVScheme | str | None) -> KVScheme:
    """``kv`` when given (a scheme or a name such as ``int4``), else the one saved with the checkpoint
    (its manifest's ``kv_cache``), else unquantized."""
    saved = kv_scheme_from_dict((manifest or {}).get("kv_cache"))
    if isinstance(kv, str):
        return parse_kv(kv, default=saved)  # group and residual not named: the saved ones
    return kv or saved


def use_cpu_kernels(cpu_kernels: bool | None, linear_backend: str | None = None) -> bool:
    """Whether quantized Linears on CPU may run a CPU kernel backend: not switched off
    (``cpu_kernels=False``, ``LOWBIT_DISABLE=cpu``, ``LOWBIT_CPU_KERNELS=0``) nor another backend
    asked for by name (``linear_backend``)."""
    return linear_backends.may_choose("cpu", linear_backends.switched_off(cpu_kernels), linear_backend)


def prepare(decoder: Decoder, device: torch.device, dtype: torch.dtype, kv_scheme: KVScheme | None = None,
            self_check: bool = True, cpu_kernels: bool | None = None, linear_backend: str | None = None) -> None:
    """A decoder whose weights are in, made ready to run on ``device``: what every runtime model
    goes through (``load``, and the benchmarks' random models). ``self_check``: run each kernel
    configuration it chose once against the reference (attention over ``kv_scheme``) and send
    the failed ones to the reference path (``runtime/selfcheck.py``; nothing to do on CPU).
    Each quantized Linear's backend is chosen here (``QuantLinear.materialize``: the first of
    ``runtime.linear_backends.PRIORITY`` that is not switched off and takes the layer).
    ``linear_backend``: one backend by name (``"reference"``: the dense float weight, what tests compare
    at float32 precision; a layer it refuses raises). ``cpu_kernels=False``: the CPU kernel backends
    switched off (as ``LOWBIT_DISABLE=cpu``), True: on whatever the environment says."""
    decoder.to(device).eval()
    decoder.join_projections()  # q/k/v and gate/up as one GEMM each: built here, never stored
    decoder.activation_dtype = dtype
    run_narrow_linears(decoder, dtype)
    decoder.use_kernels(device.type == "cuda")  # the fused small ops where Triton runs
    # on CPU their native counterparts where they build (None with LOWBIT_NATIVE=0: PyTorch)
    use_native_ops(decoder, native.load("decode_ops") if device.type == "cpu" else None, dtype)
    # the attention backend over the model's cache, chosen once here (runtime.attention.model_attention:
    # the priority list of runtime/attention_backends/; the choice is Decoder.attention)
    decoder.kv_scheme = kv_scheme
    decoder.attention  # noqa: B018 (chosen now: a native kernel is built at load, not at the first request)
    off = linear_backends.switched_off(cpu_kernels)
    for module in decoder.modules():
        if isinstance(module, QuantLinear):  # chosen and built at load, so the first request does not pay for it
            if linear_backend is None:
                module.materialize(dtype, off)
            else:
                module.use_backend(linear_backend, dtype)
    for mlp in (m for m in decoder.modules() if isinstance(m, MLP) and hasattr(m, "gate_up_proj")):
        both = [mlp.gate_up_proj, getattr(mlp, mlp.names[2])]
        on_kernels = all(isinstance(p, QuantLinear) and p.on_cpu_kernel for p in both)
        mlp.cpu_kernel_dtype = cpu_linear.ACTIVATIONS if on_kernels and dtype != cpu_linear.ACTIVATIONS else None
    decoder.self_check = self_check  # an Engine's start-up check reads it too
    if device.type == "cuda":  # elsewhere nothing runs on Triton (tests that send it to the interpreter check it)
        selfcheck.check_decoder(decoder, dtype, kv_scheme)


def use_native_ops(decoder: Decoder, module, dtype: torch.dtype) -> None:
    """On CPU, the decode step's small ops as ``runtime/native/decode_ops.cpp`` (``module``, from
    ``runtime.native.load``; None: PyTorch): add + RMSNorm and RoPE of q and k where activations
    are float32 (the kernels' dtype), SiLU-and-multiply of silu MLPs, lm_head's bf16 product for
    few rows (``cpu_linear.NarrowLinear``). One call each where PyTorch ran several ops of a few
    microseconds on a decode step's one row (bench/results/cpu/NOTES.md)."""
    float32 = module if dtype == torch.float32 else None
    taken = module if dtype in (torch.float32, torch.bfloat16) else None  # SiLU's and the gemv's dtypes
    for m in decoder.modules():
        if type(m) is RMSNorm or isinstance(m, Attention):
            m.native = float32
        elif isinstance(m, MLP):
            m.native = taken if m.act_name == "silu" else None
        elif isinstance(m, cpu_linear.NarrowLinear):
            m.native = taken if taken is not None and taken.gemv_usable() else None


def run_narrow_linears(decoder: Decoder, dtype: torch.dtype) -> None:
    """Plain Linears whose weight is narrower than ``dtype`` (``narrow_float_weights``) become
    ``cpu_linear.NarrowLinear``s, which multiply in the weight's dtype."""
    for owner in list(decoder.modules()):
        for name, child in list(owner.named_children()):
            if type(child) is torch.nn.Linear and child.weight.dtype != dtype:
                setattr(owner, name, cpu_linear.NarrowLinear(child))


def load(path, device: str | torch.device = "cpu", dtype: torch.dtype | None = None,
         kv: KVScheme | str | None = None, self_check: bool = True, cpu_kernels: bool | None = None,
         linear_backend: str | None = None) -> Model:
    """Load a Hugging Face directory, a lowbit/compressed-tensors checkpoint, or an alias.

    ``kv`` overrides the KV-cache scheme saved with the checkpoint (``"int4"``, ``"fp16"``, a KVScheme).
    ``self_check=False`` skips this model's load-time and Engine start-up checks of the kernels against
    the reference (``runtime/selfcheck.py``); a GEMM configuration tuned at first use is still checked
    (it is kept per process for every model of its shape: ``runtime/kernels/matmul_tuning.py``). Only
    ``LOWBIT_SELF_CHECK=0`` (``lowbit --no-self-check``) skips every check.
    ``cpu_kernels=False``: quantized Linears on CPU run the dense float reference; ``linear_backend``:
    every quantized Linear on the backend of that name (``prepare``).
    """
    path = models.resolve(path)
    manifest = checkpoint.verify(path)  # a manifest, when present, must match every file
    kv_scheme = kv_scheme_of(manifest, kv)
    config = checkpoint.read_config(path)
    cfg = DecoderConfig.from_hf(config)
    device = torch.device(device)
    dtype = dtype or default_dtype(device, config)
    schemes = stored_linear_schemes(config, linear_names(cfg))
    tied = cfg.tie_embeddings and "lm_head" not in schemes

    # Build on the meta device: no memory is spent on weights that are replaced right away.
    with torch.device("meta"):
        decoder = Decoder(cfg, linear_factory(schemes))
    narrow = narrow_float_weights(decoder, device, cpu_kernels, linear_backend)
    tensors = to_compute_dtype(read_checked_tensors(path, decoder, config, tied), dtype, tied, narrow)
    decoder.load_state_dict(tensors, assign=True)
    del tensors  # the modules hold them now, so prepare frees what a layer's kernel copy replaces
    check_quantized_shapes(decoder, path)
    if tied:
        decoder.lm_head.weight = decoder.model.embed_tokens.weight
    prepare(decoder, device, dtype, kv_scheme, self_check, cpu_kernels, linear_backend)
    tokenizer = load_tokenizer(path) if any((path / f).exists() for f in TOKENIZER_FILES) else None
    return Model(decoder, config, tokenizer, device, dtype, path, kv_scheme)
