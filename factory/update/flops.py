"""How many floating-point operations an update does: the numerator of `perf/update_flops_per_s`.

Counted the usual way (Kaplan et al. 2020, PaLM's MFU appendix): a forward pass costs 2 FLOPs per weight
per token for every matrix the token goes through, plus causal attention's score and value products;
a backward pass costs twice its forward. Only useful work counts: real tokens, never padding, and the
vocabulary projection only where a logit is read (the positions that predict response tokens, which
is all the learner computes). So padding, recomputation and kernels that are slower than their FLOPs
show up as a lower FLOP/s, which is what the number is for.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ModelShape:
    """What the count needs from a causal LM."""

    body_params: int  # weights of the matrices every token passes through (embeddings and lm_head excluded)
    layers: int
    attention_dim: int  # query heads x head size
    hidden: int
    vocab: int

    @classmethod
    def of(cls, model: torch.nn.Module) -> ModelShape:
        cfg = model.config
        # ZeRO-3 partitions parameters (numel() is then 0 on this rank); ds_numel keeps the full size.
        head = model.get_output_embeddings()
        skip = {id(model.get_input_embeddings().weight), id(head.weight) if head is not None else None}
        body = sum(int(getattr(p, "ds_numel", p.numel())) for p in model.parameters() if len(getattr(p, "ds_shape", p.shape)) == 2
                   and id(p) not in skip)
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        return cls(body, cfg.num_hidden_layers, cfg.num_attention_heads * head_dim, cfg.hidden_size, cfg.vocab_size)


def forward_flops(shape: ModelShape, lengths: Sequence[tuple[int, int]], shared: int = 0) -> float:
    """FLOPs of one forward pass over sequences given as (prompt length, response length): every token
    through the body, causal attention over each sequence, and the vocabulary projection on the
    positions that predict response tokens. `shared`: the sequences' first `shared` tokens are the same
    and run once for all of them (factory.update.logprobs), so they count once."""
    total = 0.0
    for prompt, response in lengths:
        n = prompt + response
        total += 2.0 * shape.body_params * (n - shared)                 # matmuls with the layers' weights
        total += 2.0 * shape.layers * shape.attention_dim * (n * n - shared * shared)  # QK^T and AV, causal
        total += 2.0 * shape.hidden * shape.vocab * response  # lm_head on the logits window
    if shared and lengths:
        total += 2.0 * shape.body_params * shared + 2.0 * shape.layers * shape.attention_dim * shared * shared
    return total
