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


def test_model_shape_counts_the_experts_a_token_goes_through():
    """transformers 5 stores a layer's experts as 3-D tensors (mlp.experts.gate_up_proj [E, 2I, H]), which a count
    of 2-D weights left out: a mixture-of-experts body was its attention and router alone. A token goes through
    top_k of the E experts, so the stacks count top_k / E of their weights (Mixtral names E num_local_experts,
    Qwen3-MoE num_experts)."""
    from transformers import MixtralConfig, MixtralForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    cfg = MixtralConfig(vocab_size=50, hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2)
    # per layer: attention 256 + 128 + 128 + 256 as Llama's; router 8 experts x 16; 2 experts of gate/up/down 16x24
    assert ModelShape.of(MixtralForCausalLM(cfg)).body_params == 2 * (768 + 8 * 16 + 2 * 3 * 16 * 24)
    cfg = Qwen3MoeConfig(vocab_size=50, hidden_size=16, intermediate_size=32, moe_intermediate_size=8,
                         num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=4, num_experts=6,
                         num_experts_per_tok=2)
    # attention 768 (q_norm, k_norm are vectors); router 6 x 16; 2 experts of gate/up/down 16x8
    assert ModelShape.of(Qwen3MoeForCausalLM(cfg)).body_params == 768 + 6 * 16 + 2 * 3 * 16 * 8


def test_model_shape_leaves_out_position_embeddings():
    """GPT-2's learned position table wpe is a lookup, not a matrix a token is multiplied by; being 2-D and not
    the input embedding, it was counted as body. Its Conv1D layers are matrix products and count."""
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(vocab_size=50, n_embd=16, n_layer=2, n_head=4, n_positions=64))
    per_layer = 16 * 48 + 16 * 16 + 16 * 64 + 64 * 16  # attn c_attn (q, k, v), attn c_proj, mlp c_fc, mlp c_proj
    assert ModelShape.of(model).body_params == 2 * per_layer
