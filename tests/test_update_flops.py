"""The update's FLOP count (perf/update_flops_per_s), by hand."""
from __future__ import annotations

import torch

from factory.update.flops import ModelShape, forward_flops


def test_forward_flops_by_hand():
    shape = ModelShape(body_params=10, layers=2, attention_dim=4, hidden=3, vocab=5)
    # one sequence of 2 prompt + 1 response tokens (n = 3):
    #   body 2 * 10 * 3 = 60; attention 2 * 2 layers * 4 * 3^2 = 144; lm_head 2 * 3 * 5 * 1 response token = 30
    assert forward_flops(shape, [(2, 1)]) == 234
    # sequences add up; an empty batch costs nothing
    assert forward_flops(shape, [(2, 1), (2, 1)]) == 468
    assert forward_flops(shape, []) == 0
    # a shared first token runs once: two sequences of 3 cost 2 x 234 minus one token's body (2 * 10) and
    # one 1^2 attention (2 * 2 * 4 * 1)
    assert forward_flops(shape, [(2, 1), (2, 1)], shared=1) == 468 - 20 - 16
    assert forward_flops(shape, [(2, 1)], shared=1) == 234


def test_model_shape_counts_the_body_not_the_embeddings():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    for tied in (True, False):
        cfg = LlamaConfig(vocab_size=50, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied)
        model = LlamaForCausalLM(cfg)
        shape = ModelShape.of(model)
        # per layer: q 16x16, k and v 16x8 (2 kv heads of 4), o 16x16, gate/up/down 16x24 each
        per_layer = 256 + 128 + 128 + 256 + 3 * 16 * 24
        assert shape.body_params == 2 * per_layer
        assert (shape.layers, shape.attention_dim, shape.hidden, shape.vocab) == (2, 16, 16, 50)
