"""A ``transformers`` Cache that stores keys and values with a :class:`kvquant.KVScheme`.

    from kvquant import parse_kv
    from kvquant.hf import QuantizedKVCache

    cache = QuantizedKVCache(model.config, parse_kv("int4"))
    model.generate(input_ids, past_key_values=cache, max_new_tokens=64)

Each layer keeps the newest partial block (fewer than ``residual`` tokens)
unquantized and quantizes a block when it fills, with the same functions, the
same block layout and the same reading rule as the runtime's cache
(``runtime/cache.py``: a prefill or chunk sees its own tokens fresh and earlier
ones as stored; a decode step reads the cache), so both give attention the same
keys and values. Unlike transformers' own
``QuantizedCache`` (quanto/HQQ backends), a filled block is quantized once and
never again: the older blocks are not re-quantized at every flush, and keys are
grouped per channel over tokens (KIVI) rather than per token.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, DynamicLayer

from kvquant.quantize import QuantizedKV, dequantize_blocks, quantize_blocks
from kvquant.scheme import KVScheme
from quant.architectures import attention_shape


def _cat_blocks(a: QuantizedKV | None, b: QuantizedKV) -> QuantizedKV:
    if a is None:
        return b
    return QuantizedKV(*(None if x is None else torch.cat([x, y], dim=1) for x, y in zip(a, b)))


class QuantizedKVLayer(DynamicLayer):
    """One decoder layer's cache: quantized blocks [S, n, H, ...] plus the unquantized residual in
    ``self.keys``/``self.values`` [S, H, r, D] (r < residual)."""

    is_croppable = False

    def __init__(self, scheme: KVScheme, kv_heads: int, head_dim: int, layer_idx: int):
        super().__init__()
        self.scheme, self.kv_heads, self.head_dim, self.layer_idx = scheme, kv_heads, head_dim, layer_idx
        self.cumulative_length = 0
        self.quantized_keys: QuantizedKV | None = None
        self.quantized_values: QuantizedKV | None = None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        batch = key_states.shape[0]
        self.keys = key_states.new_zeros(batch, self.kv_heads, 0, self.head_dim)
        self.values = value_states.new_zeros(batch, self.kv_heads, 0, self.head_dim)
        self.is_initialized = True

    def _check(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        ok = key_states.ndim == 4 and key_states.shape == value_states.shape
        ok = ok and tuple(key_states.shape[1::2]) == (self.kv_heads, self.head_dim)
        if ok and self.is_initialized:
            ok = key_states.shape[0] == self.keys.shape[0]
        if not ok:
            raise ValueError(
                f"this KV cache was built for layers of {self.kv_heads} KV heads x head_dim {self.head_dim}; layer "
                f"{self.layer_idx} got keys {tuple(key_states.shape)} and values {tuple(value_states.shape)}: a cache "
                "cannot be shared across models (or batches) of different shapes"
            )

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Append ``[S, H, T, D]`` states; return every key and value so far as attention reads them."""
        self._check(key_states, value_states)
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.cumulative_length += key_states.shape[-2]
        keys = torch.cat([self.keys, key_states], dim=-2)
        values = torch.cat([self.values, value_states], dim=-2)
        filled = keys.shape[-2] // self.scheme.block_size * self.scheme.block_size
        if filled:
            self.quantized_keys = _cat_blocks(self.quantized_keys, quantize_blocks(keys[:, :, :filled], self.scheme, True))
            self.quantized_values = _cat_blocks(
                self.quantized_values, quantize_blocks(values[:, :, :filled], self.scheme, False)
            )
        self.keys, self.values = keys[:, :, filled:], values[:, :, filled:]
        keys, values = self._read()
        new = key_states.shape[-2]
        if new > 1 and self.quantized_keys is not None:
            # several tokens (prefill, chunk): earlier positions as stored, the new ones fresh (a decode
            # step reads its token from the cache, like the runtime's decode kernel)
            keys[:, :, -new:], values[:, :, -new:] = key_states, value_states
        return keys, values

    def _read(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Every position as stored; the quantized blocks dequantized into one new buffer each."""
        if self.quantized_keys is None:
            return self.keys, self.values
        out = []
        for blocks, residual, keys in ((self.quantized_keys, self.keys, True),
                                       (self.quantized_values, self.values, False)):
            held = blocks.data.shape[1] * self.scheme.block_size
            x = residual.new_empty(*residual.shape[:2], held + residual.shape[2], self.head_dim)
            dequantize_blocks(blocks, self.scheme, keys, self.head_dim, self.dtype, out=x[:, :, :held])
            x[:, :, held:] = residual
            out.append(x)
        return out[0], out[1]

    def get_seq_length(self) -> int:
        return self.cumulative_length

    def reset(self) -> None:
        super().reset()
        self.quantized_keys = self.quantized_values = None

    def nbytes(self) -> int:
        tensors = [t for q in (self.quantized_keys, self.quantized_values) if q is not None for t in q if t is not None]
        if self.is_initialized:
            tensors += [self.keys, self.values]
        return sum(t.numel() * t.element_size() for t in tensors)

    def _select(self, fn) -> None:
        """Apply ``fn`` to the batch dimension of every stored tensor (beam search, batch expansion)."""
        if not self.is_initialized:
            return
        self.keys, self.values = fn(self.keys), fn(self.values)
        if self.quantized_keys is not None:
            self.quantized_keys, self.quantized_values = self.quantized_keys.map(fn), self.quantized_values.map(fn)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._select(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._select(lambda t: t[indices])

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._select(lambda t: t.repeat_interleave(repeats, dim=0))

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("a quantized KV cache cannot be cropped: its blocks are quantized as a whole")


def _attention_shape(config) -> tuple[int, int, int]:
    """(layers, KV heads, head_dim) of a transformers config (its text part, for multimodal ones)."""
    config = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    return attention_shape(config)


class QuantizedKVCache(Cache):
    """A transformers ``Cache`` quantized with ``scheme`` for the model that ``config`` describes."""

    def __init__(self, config, scheme: KVScheme):
        num_layers, kv_heads, head_dim = _attention_shape(config)
        scheme.check_head_dim(head_dim)
        self.scheme = scheme
        super().__init__(layers=[QuantizedKVLayer(scheme, kv_heads, head_dim, i) for i in range(num_layers)])

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        if not 0 <= layer_idx < len(self.layers):
            raise ValueError(
                f"this KV cache was built for a model of {len(self.layers)} layers, got layer {layer_idx}: "
                "a cache cannot be shared across models of different shapes"
            )
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    def nbytes(self) -> int:
        """Bytes held: quantized blocks with their scales, and the unquantized residual blocks."""
        return sum(layer.nbytes() for layer in self.layers)
