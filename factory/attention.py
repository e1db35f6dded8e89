"""The attention Factory gives transformers models on CPU (registered through transformers' AttentionInterface,
the library's own extension point): the learner's packed rows (factory.update.batch.PackedBatch), and, in the
learner and the transformers rollout engine alike, a model's grouped key/value heads handed to torch's SDPA as
they are under a mask, where transformers' `sdpa` copies them out to every query head first (`repeat_kv`)."""
from __future__ import annotations

import torch
from torch import Tensor

PACKED_ATTENTION = "factory_packed"


def packed_attention(module: torch.nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
                     dropout: float = 0.0, scaling: float | None = None, packed_lengths: list[int] | None = None,
                     **kwargs) -> tuple[Tensor, None]:
    """transformers' sdpa attention, per row of a packed call: query [1, H, T, D] holds rows of
    `packed_lengths` tokens end to end; key/value [1, Hkv, P + T, D] the same after P cached prefix tokens
    (the shared prefix), which every row attends to. Any other call: transformers' sdpa, except a masked call
    on CPU, which torch's sdpa computes on the grouped keys (the same result, without copying them out)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if packed_lengths is None:
        if (query.device.type == "cpu" and attention_mask is not None and key.shape[1] < query.shape[1]
                and kwargs.get("position_bias") is None and kwargs.get("cache") is None):
            # A padded call with a mask on CPU (right-padded rows, the shared prefix's keys before them): torch's
            # sdpa reads the grouped keys itself, where transformers' wrapper would copy them out to every query
            # head first (repeat_kv) and its backward would fill and sum gradients that size (on the quickstart's
            # short-row micro-batch, about 45% of that attention's time on a real AVX2 Zen 3).
            out = _cpu_sdpa(query, key, value, attention_mask, dropout, scaling)
            return out.transpose(1, 2).contiguous(), None
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    prefix = key.shape[2] - query.shape[2]
    # split, not slices: a slice's backward writes its gradient into a zero-filled tensor the size of the
    # whole key (per row, per layer) and adds those up; split's backward is one cat (15% of this attention's
    # time on CPU, docs/performance.md#on-a-real-avx2-only-cpu-2026-12-02)
    queries = query.split(packed_lengths, 2)
    key_prefix, *keys = key.split([prefix, *packed_lengths], 2)
    value_prefix, *values = value.split([prefix, *packed_lengths], 2)
    outs = []
    # A sliding-window layer (Mistral, Phi-3, Gemma's local layers) passes its window: a padded call's mask
    # carries it, a packed call has no mask, so the band is built here (the model's own rule: a query sees
    # the keys less than `window` positions before it)
    window = kwargs.get("sliding_window")
    for q, k, v, n in zip(queries, keys, values, packed_lengths):
        if not prefix and window is None:
            out, _ = sdpa_attention_forward(module, q, k, v, None, dropout=dropout, scaling=scaling, is_causal=True)
            outs.append(out)  # [1, n, H, D]
            continue
        if prefix:
            k, v = torch.cat([key_prefix, k], 2), torch.cat([value_prefix, v], 2)
        # causal within the row, everything of the prefix visible: row token i sees keys 0 .. prefix + i
        causal = torch.ones(n, prefix + n, dtype=torch.bool, device=query.device).tril(prefix)
        if window is not None:  # ... and none `window` or more positions before it
            causal = causal.triu(prefix - window + 1)
        causal = causal[None, None]
        if query.device.type == "cpu":
            # torch's sdpa reads grouped keys itself (enable_gqa); with a mask, transformers' wrapper would
            # first copy them out to every query head (repeat_kv): another 20% of this attention on CPU
            out = _cpu_sdpa(q, k, v, causal, dropout, scaling).transpose(1, 2)
        else:  # elsewhere (CUDA) transformers' path, as before: not measured there
            out, _ = sdpa_attention_forward(module, q, k, v, causal, dropout=dropout, scaling=scaling, is_causal=False)
        outs.append(out)
    return torch.cat(outs, 1), None


def _cpu_sdpa(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, dropout: float, scale: float | None) -> Tensor:
    """torch's sdpa on CPU with a mask, on the grouped keys (`enable_gqa`): in float32 whatever the inputs' dtype
    (the output in theirs) where gradients may follow -- the update, and its no-grad passes, whose log-probs must be
    the update's own bit for bit -- and in the inputs' dtype in inference mode (the rollout engine and local
    judges: `generate` under torch.inference_mode). Under bf16 autocast the update's inputs are bf16, and torch's
    bf16 CPU kernel took 1.16-1.2x the time of casting them to float32 and back around the float32 kernel, on the
    quickstart's rows, forward and backward (AVX512-bf16 Zen 4:
    docs/performance.md#on-the-avx-512-kind-again-2026-12-04; about even on the AMX Xeon); float32 is also the
    more exact of the two. Forward only it is the other way: a decoding step reads a whole KV cache for one query
    a row, so the cast -- a float32 copy of the cache, per layer, per step -- cost more than the attention
    (SmolLM2-135M, 32 rows of ~350-450 keys: 9.4 ms a layer cast against 2.9-3.6 ms in bf16), and a prefill of
    32 rows of 300 tokens took 72 ms a layer cast against 21 ms (bf16, the AMX Xeon, 2026-12-06;
    docs/performance.md, "The rollout engine's attention in its own dtype").
    CPU autocast lists sdpa among its bf16 ops: it would cast the float32 inputs back, so it is off here.
    An additive (floating) mask goes to the computing dtype with them: sdpa wants a float mask in the query's."""
    dtype = q.dtype if torch.is_inference_mode_enabled() else torch.float32
    if mask is not None and mask.dtype != torch.bool:
        mask = mask.to(dtype)
    with torch.autocast("cpu", enabled=False):
        out = torch.nn.functional.scaled_dot_product_attention(q.to(dtype), k.to(dtype), v.to(dtype), attn_mask=mask,
                                                               dropout_p=dropout, scale=scale, enable_gqa=True)
    return out.to(q.dtype)


def use_packed_attention(model: torch.nn.Module) -> None:
    """Give `model` the `factory_packed` attention (registered once; its mask is sdpa's)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(PACKED_ATTENTION, packed_attention)
    AttentionMaskInterface.register(PACKED_ATTENTION, sdpa_mask)
    model.set_attn_implementation(PACKED_ATTENTION)
