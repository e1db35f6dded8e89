"""Log-probabilities (and entropy) of response tokens under a causal LM, memory-aware.

One forward over prompt+response per sequence. The lm_head runs only on the window of positions that
predict response tokens (`logits_to_keep`), so a long prompt never costs [B, L, V] logits; the
log-softmax is taken in fp32 whatever the autocast dtype (bf16 log-probs are too coarse for ratios).

The log-probs are those of the distribution the rollout sampled from, softmax(logits / temperature), as
the rollout engines report them (factory.rollout.engine) and as TRL and verl compute them: at any
temperature other than 1, log_softmax(logits) would be another policy than the one that sampled.
"""
from __future__ import annotations

import torch
from torch import Tensor

from factory.update.batch import MicroBatch
from factory.update.engine import autocast


def response_logprobs(model: torch.nn.Module, mb: MicroBatch, *, amp: torch.dtype | None, temperature: float = 1.0,
                      entropy: bool = False, entropy_grad: bool = False) -> tuple[Tensor, Tensor | None]:
    """logp [B, R] of each response token given everything before it, under softmax(logits /
    temperature), and its entropy [B, R] when asked (with grad only if `entropy_grad`: the bonus term
    needs it, the reported stat does not). Positions past a row's response hold values of a
    neighbouring column: callers mask them."""
    keep = torch.arange(mb.start, mb.end, device=mb.input_ids.device)  # [W]
    with autocast(mb.input_ids.device.type, amp):
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
