"""How many floating-point operations an update does: the numerator of `perf/update_flops_per_s`.

Counted the usual way (Kaplan et al. 2020, PaLM's MFU appendix): a forward pass costs 2 FLOPs per weight
per token for every matrix the token goes through, plus causal attention's score and value products;
a backward pass costs twice its forward. Only useful work counts: real tokens, never padding, and the
vocabulary projection only where a logit is read (the positions that predict response tokens, which
is all the learner computes). So padding, recomputation and kernels that are slower than their FLOPs
show up as a lower FLOP/s, which is what the number is for.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ModelShape:
    """What the count needs from a causal LM."""

    body_params: int  # weights of the matrices a token passes through (embeddings and lm_head excluded)
    layers: int
    attention_dim: int  # query heads x head size
    hidden: int
    vocab: int

    @classmethod
    def of(cls, model: torch.nn.Module) -> ModelShape:
        """The body is every 2-D weight (Linear, GPT-2's Conv1D, a MoE router) outside an embedding table (a
        lookup: the input's, GPT-2's positions wpe) and the output head, plus each layer's experts. transformers
        stores those as 3-D stacks [E, out, in] (mlp.experts.gate_up_proj), of which a token goes through
        `num_experts_per_tok`: they count that share of E."""
        cfg = model.config
        head = model.get_output_embeddings()
        skip = {id(model.get_input_embeddings().weight), id(head.weight) if head is not None else None}
        top_k = getattr(cfg, "num_experts_per_tok", None)
        names = ("num_local_experts", "num_experts", "n_routed_experts")  # E as Mixtral, Qwen3-MoE, DeepSeek name it
        experts = next((n for k in names if (n := getattr(cfg, k, None))), None)
        body = 0.0
        for module in model.modules():
            if isinstance(module, torch.nn.Embedding):
                continue
            for name, p in module.named_parameters(recurse=False):
                # ZeRO-3 partitions parameters (numel() is then 0 on this rank); ds_shape keeps the full shape.
                shape = tuple(getattr(p, "ds_shape", p.shape))
                if id(p) in skip or name.endswith("bias"):  # a bias (GPT-OSS's experts' are [E, out]) is no matmul
                    continue
                if len(shape) == 2:
                    body += math.prod(shape)
                elif len(shape) == 3 and top_k and shape[0] == experts:
                    body += math.prod(shape) * top_k / experts
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        return cls(round(body), cfg.num_hidden_layers, cfg.num_attention_heads * head_dim, cfg.hidden_size,
                   cfg.vocab_size)


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
