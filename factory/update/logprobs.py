"""Log-probabilities (and entropy) of response tokens under a causal LM, memory-aware.

One forward over prompt+response per sequence. The lm_head runs only on the window of positions that
predict response tokens (`logits_to_keep`), so a long prompt never costs [B, L, V] logits; the
log-softmax is taken in fp32 whatever the autocast dtype (bf16 log-probs are too coarse for ratios).

Shared prefix: when every sequence of a micro-batch starts with the same tokens (a system prompt, the
quickstart's ~280 tokens of few-shot turns), those are run once, for one row, and their keys and values
are repeated for the batch; the rest of each sequence attends to them through the KV cache. The result
is the same function of the weights (gradients flow back through the repeated cache into the one prefix
pass), computed with B-1 fewer passes over the prefix: for the quickstart, ~2.5x fewer update FLOPs,
which is what makes its float32 update fit on CPUs without bf16.

Packing (`train.packing`, factory.update.batch.PackedBatch): a micro-batch's rows end to end in one row,
so the linear layers -- most of the compute -- see no padding. Attention must not cross rows: the model
runs with the `factory_packed` attention (factory.attention, registered through transformers' AttentionInterface,
the library's own extension point), which for a packed call runs torch's sdpa once per row (after the shared
prefix's keys, when there is one) and for any other call is transformers' sdpa (on CPU under a mask, torch's
sdpa on the grouped keys). On CUDA a varlen kernel (flash-attention's) would do the per-row loop in one
launch; on CPU sdpa per row is exact and its cost is the rows' own attention, as in the padded layout
(measured: docs/performance.md#sequence-packing).

The log-probs are those of the distribution the rollout sampled from, softmax(logits / temperature), as
the rollout engines report them (factory.rollout.engine) and as TRL and verl compute them: at any
temperature other than 1, log_softmax(logits) would be another policy than the one that sampled.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor

from factory.update.batch import MicroBatch, PackedBatch, run_once
from factory.update.engine import autocast


def disable_dropout(model: torch.nn.Module) -> list[str]:
    """Turn off the base model's dropout (`train.disable_dropout`, TRL's option of that name) and say what was
    on: nn.Dropout modules, the config's rates, and the rates modules copied from it when built (Hugging
    Face attention keeps `attention_dropout` as a float and applies it functionally). Call it before adapters
    are added: LoRA's own dropout is `model.lora.dropout`'s to set."""
    found = active_dropout(model)
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
        for key, value in list(vars(module).items()):
            if _is_rate(key, value):
                setattr(module, key, 0.0)
    for key in config_rates(model):
        setattr(model.config, key, 0.0)
    return found


def config_rates(model: torch.nn.Module) -> dict[str, float]:
    """The dropout rates above 0 in the model's config, as loaded (before `disable_dropout` zeroes them)."""
    config = getattr(model, "config", None)
    return {k: v for k, v in (config.to_dict() if config is not None else {}).items() if _is_rate(k, v)}


@contextlib.contextmanager
def rates_as_built(config: Any, rates: dict[str, float]) -> Iterator[None]:
    """The config with the model's own dropout rates while a checkpoint's config.json is written, zeroed again
    after: the exported folder is the model as trained, and training it again gets the dropout it was built
    with (`train.disable_dropout` is this run's choice, not the model's)."""
    now = {k: getattr(config, k) for k in rates}
    for k, v in rates.items():
        setattr(config, k, v)
    try:
        yield
    finally:
        for k, v in now.items():
            setattr(config, k, v)


def _is_rate(key: str, value: object) -> bool:
    return (("dropout" in key or "pdrop" in key) and isinstance(value, (int, float)) and not isinstance(value, bool)
            and value > 0)


def active_dropout(model: torch.nn.Module) -> list[str]:
    """Where `model` drops out in training mode: nn.Dropout modules with p > 0 and config rates above 0
    (`attention_dropout`, `hidden_dropout`, `resid_pdrop`, ...: Hugging Face attention applies its rate
    functionally, with no module to find). Prefix sharing runs the prefix once for all rows, so under
    dropout every row would share one mask there, where separate passes draw one mask per row: the update
    would no longer be the same function, so the learner does not share a prefix then."""
    found = [f"{name or 'model'}.p={m.p}" for name, m in model.named_modules()
             if isinstance(m, torch.nn.Dropout) and m.p > 0]
    config = getattr(model, "config", None)
    for key, value in (config.to_dict() if config is not None else {}).items():
        if _is_rate(key, value):
            found.append(f"config.{key}={value}")
    return found


def response_logprobs(model: torch.nn.Module, mb: MicroBatch | PackedBatch, *, amp: torch.dtype | None, temperature: float = 1.0,
                      entropy: bool = False, entropy_grad: bool = False,
                      share_prefix: bool = False) -> tuple[Tensor, Tensor | None]:
    """logp [B, R] of each response token given everything before it, under softmax(logits /
    temperature), and its entropy [B, R] when asked (with grad only if `entropy_grad`: the bonus term
    needs it, the reported stat does not). Positions past a row's response hold values of a
    neighbouring column: callers mask them. `share_prefix`: run the rows' common prefix once (see the
    module's docstring); the caller says when the model allows it (not under gradient checkpointing).
    A PackedBatch (the model must have `use_packed_attention`) carries its own prefix decision."""
    if isinstance(mb, PackedBatch):
        return _packed_logprobs(model, mb, amp=amp, temperature=temperature, entropy=entropy,
                                entropy_grad=entropy_grad)
    keep = torch.arange(mb.start, mb.end, device=mb.input_ids.device)  # [W]
    shared = run_once(len(mb.input_ids), mb.shared) if share_prefix else 0
    with autocast(mb.input_ids.device.type, amp):
        if shared:
            # keys/values of the prefix, with grad; logits only for its last position (not used)
            cache = model(input_ids=mb.input_ids[:1, :shared], use_cache=True, logits_to_keep=1).past_key_values
            cache.batch_repeat_interleave(len(mb.input_ids))
            out = model(input_ids=mb.input_ids[:, shared:], attention_mask=mb.attention_mask,
                        past_key_values=cache, logits_to_keep=keep - shared, use_cache=False)
        else:
            out = model(input_ids=mb.input_ids, attention_mask=mb.attention_mask, logits_to_keep=keep,
                        use_cache=False)
    logits = out.logits.float()
    logsm = torch.log_softmax(logits / temperature if temperature != 1.0 else logits, dim=-1)  # [B, W, V]
    logp = logsm.gather(-1, mb.targets[..., None]).squeeze(-1).gather(1, mb.gather)  # [B, R]
    ent = None
    if entropy:
        with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
            # -sum p log p as a batched dot product: no [B, W, V] product temporary (~30% faster here)
            ent_w = -(logsm.exp().unsqueeze(-2) @ logsm.unsqueeze(-1))[..., 0, 0]  # [B, W]
            ent = ent_w.gather(1, mb.gather)  # [B, R]
    return logp, ent


def _packed_logprobs(model: torch.nn.Module, mb: PackedBatch, *, amp: torch.dtype | None, temperature: float,
                     entropy: bool, entropy_grad: bool) -> tuple[Tensor, Tensor | None]:
    """response_logprobs of a packed micro-batch: the logits of the `keep` positions only, [1, K, V]."""
    device = mb.input_ids.device
    cache = None
    with autocast(device.type, amp):
        if mb.shared:  # the prefix once, for one row: the packed row is one row
            cache = model(input_ids=mb.prefix, use_cache=True, logits_to_keep=1).past_key_values
        # an all-ones mask: transformers then builds no [T, T] mask (packed_attention needs none)
        ones = torch.ones(1, mb.shared + mb.input_ids.shape[1], dtype=torch.long, device=device)
        out = model(input_ids=mb.input_ids, position_ids=mb.position_ids, attention_mask=ones, past_key_values=cache,
                    logits_to_keep=mb.keep, use_cache=False, packed_lengths=mb.lengths)
    logits = out.logits[0].float()  # [K, V]
    logsm = torch.log_softmax(logits / temperature if temperature != 1.0 else logits, dim=-1)  # [K, V]
    logp = logsm.gather(-1, mb.targets[:, None])[:, 0][mb.gather]  # [B, R]
    ent = None
    if entropy:
        with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
            ent = -(logsm.exp().unsqueeze(-2) @ logsm.unsqueeze(-1))[..., 0, 0][mb.gather]  # [B, R]
    return logp, ent
