"""Sequence packing (train.packing): a micro-batch's rows end to end in one row, each with its own
positions, attention never crossing rows. Exact against the padded layout: log-probs and gradients within
1e-5, with and without the shared prefix, and so the learner's update."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from factory.types import Trajectory
from factory.update.batch import collate, collate_packed, padding_fraction, shared_prefix, should_pack
from factory.attention import use_packed_attention
from factory.update.logprobs import response_logprobs
from tests.test_update import (  # noqa: F401  (fixtures)
    assert_same_delta,
    batch,
    learners,
    make_spec,
    model_path,
    one_step_delta,
)


def _traj(prompt, response, mask=None):
    return Trajectory(prompt_index=0, sample_index=0, prompt_ids=prompt, response_ids=response,
                      loss_mask=mask or [1] * len(response), turns=[], stop_reason="no_call", row={}, reward=0.0)


def test_packed_layout_by_hand():
    a, b = _traj([1, 2, 3], [4, 5]), _traj([1, 2, 6, 7], [8], [0])
    p = collate_packed([a, b])
    assert p.input_ids.tolist() == [[1, 2, 3, 4, 5, 1, 2, 6, 7, 8]] and p.lengths == [5, 5]
    assert p.position_ids.tolist() == [[0, 1, 2, 3, 4, 0, 1, 2, 3, 4]]
    # row a's response tokens 4, 5 are predicted at positions 2, 3; row b's 8 at 5 + 3 = 8
    assert p.keep.tolist() == [2, 3, 8] and p.targets.tolist() == [4, 5, 8]
    assert p.gather.tolist() == [[0, 1], [2, 2]] and p.mask.tolist() == [[1, 1], [0, 0]]
    # the first 2 tokens shared and run once: rows start at position 2 (row b's 8 predicted at 3 + 1)
    s = collate_packed([a, b], shared=2)
    assert s.prefix.tolist() == [[1, 2]] and s.input_ids.tolist() == [[3, 4, 5, 6, 7, 8]]
    assert s.position_ids.tolist() == [[2, 3, 4, 2, 3, 4]] and s.keep.tolist() == [0, 1, 4]
    with pytest.raises(ValueError, match="swallow"):
        collate_packed([a, b], shared=3)


def test_padding_fraction_and_the_auto_rule():
    assert padding_fraction([10, 10]) == 0.0
    assert padding_fraction([10, 5]) == pytest.approx(0.25)  # 5 pads of 20 slots
    assert not should_pack("auto", [100, 96]) and should_pack("auto", [100, 50])
    assert should_pack("on", [10, 10]) and not should_pack("off", [100, 10]) and not should_pack("on", [9])


@pytest.fixture(scope="module")
def model(small_path):  # noqa: F811
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(small_path, dtype=torch.float32)
    use_packed_attention(m)
    return m


@pytest.mark.parametrize("prefix", [0, 20])
def test_packed_logprobs_and_gradients_equal_the_padded_ones(model, prefix):
    """Rows of lengths varying 3x; with `prefix`, a common block run once (share_prefix) in both layouts."""
    system = [7 + i for i in range(prefix)]
    trajs = [replace(t, prompt_ids=system + t.prompt_ids) for t in batch(seed=21, groups=3)]
    shared = shared_prefix(trajs) if prefix else 0

    def run(mb):
        model.zero_grad()
        logp, ent = response_logprobs(model, mb, amp=None, temperature=0.7, entropy=True, share_prefix=bool(prefix))
        ((logp * mb.mask).sum() + (ent * mb.mask).sum() * 0.1).backward()
        grads = {k: p.grad.clone() for k, p in model.named_parameters()}
        return (logp * mb.mask).detach(), (ent * mb.mask).detach(), grads

    padded, packed = run(collate(trajs)), run(collate_packed(trajs, shared))
    torch.testing.assert_close(packed[0], padded[0], atol=1e-5, rtol=0)
    torch.testing.assert_close(packed[1], padded[1], atol=1e-5, rtol=0)
    for k, g in padded[2].items():
        torch.testing.assert_close(packed[2][k], g, atol=1e-5, rtol=1e-5, msg=k)


@pytest.mark.parametrize("prefix", [0, 20])
def test_packed_rows_keep_a_sliding_window(prefix):
    """A sliding-window model (a tiny Mistral, window 8, rows of 6-20 response tokens): packed rows see what
    padded rows see, the window included (a packed call has no mask to carry it; before, every token saw
    its whole row: log-probs off by 0.23)."""
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    config = MistralConfig(vocab_size=5000, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, sliding_window=8, max_position_embeddings=256)
    m = MistralForCausalLM(config)
    use_packed_attention(m)
    system = [7 + i for i in range(prefix)]
    trajs = [replace(t, prompt_ids=system + t.prompt_ids) for t in batch(seed=23, groups=2)]
    shared = shared_prefix(trajs) if prefix else 0

    def run(mb):
        m.zero_grad()
        logp, _ = response_logprobs(m, mb, amp=None, share_prefix=bool(prefix))
        (logp * mb.mask).sum().backward()
        return (logp * mb.mask).detach(), {k: p.grad.clone() for k, p in m.named_parameters()}

    padded, packed = run(collate(trajs)), run(collate_packed(trajs, shared))
    torch.testing.assert_close(packed[0], padded[0], atol=1e-5, rtol=0)
    for k, g in padded[1].items():
        torch.testing.assert_close(packed[1][k], g, atol=1e-5, rtol=1e-5, msg=k)


def test_a_packed_update_is_the_padded_update(small_path, learners):  # noqa: F811
    """The learner with packing on moves the weights as with it off: plain, with the shared prefix, with the
    zero-advantage skip (its rows are never packed), under ZeRO-2."""
    system = [7 + i for i in range(20)]
    trajs = [replace(t, prompt_ids=system + t.prompt_ids) for t in batch(seed=22, groups=3)]
    flat = [replace(t, reward=1.0) if t.prompt_index == 1 else t for t in trajs]  # group 1: zero advantage
    for rows, extra in ((trajs, {}), (flat, {"deepspeed": {"zero_stage": 2}})):
        base, base_stats = one_step_delta(learners(make_spec(small_path, train={"packing": "off", **extra})), rows)
        learner = learners(make_spec(small_path, train={"packing": "on", **extra}))
        assert learner.resolved()["packing"] == "on" and learner.resolved()["share_prefix"] == "on"
        packed, stats = one_step_delta(learner, rows)
        assert_same_delta(base, packed)
        assert stats["actor/packed_frac"] == 1.0 and base_stats["actor/packed_frac"] == 0.0
        assert stats["actor/padding_frac"] == base_stats["actor/padding_frac"] > 0
        assert stats["actor/pg_loss"] == pytest.approx(base_stats["actor/pg_loss"], abs=1e-6)
    assert stats["actor/skipped_zero_adv"] == 4


def test_a_micro_batch_of_empty_responses_is_not_packed(small_path, learners):  # noqa: F811
    """A group whose episodes all timed out in the first generate has no response tokens
    (`rollout.drop_infra_errors: false` keeps it): packed, its micro-batch had nothing to gather and the
    log-probs raised IndexError; the learner now takes the padded layout, where such rows are all-0 mask (and
    actor/packed_frac, which counted it packed, counts it padded)."""
    empty = [_traj([5, 6, 7, 8], []) for _ in range(2)]
    with pytest.raises(ValueError, match="no response token"):
        collate_packed(empty)
    trajs = batch(seed=24, groups=2) + [replace(t, prompt_index=2, sample_index=s, reward=float(s % 2))
                                        for s, t in enumerate(empty * 2)]
    base, _ = one_step_delta(learners(make_spec(small_path, train={"packing": "off"})), trajs)
    learner = learners(make_spec(small_path, train={"packing": "on"}))
    packed_delta, stats = one_step_delta(learner, trajs)
    assert_same_delta(base, packed_delta)
    assert 0 < stats["actor/packed_frac"] < 1  # the all-empty micro-batch was padded, and is counted so


def test_packed_attention_after_a_prefix_is_plain_attention_row_by_row_with_grouped_keys():
    # 9 query heads over 3 key heads, as SmolLM2: the CPU path lets sdpa read the grouped keys itself.
    # Reference: each row's attention written out by hand, keys repeated per head, prefix all visible.
    import torch.nn.functional as F

    from factory.attention import packed_attention

    class Layer(torch.nn.Module):
        num_key_value_groups = 3

    torch.manual_seed(0)
    prefix, lengths, heads, groups, dim = 5, [3, 1, 4], 9, 3, 8
    q = torch.randn(1, heads, sum(lengths), dim, requires_grad=True)
    k = torch.randn(1, groups, prefix + sum(lengths), dim, requires_grad=True)
    v = torch.randn(1, groups, prefix + sum(lengths), dim, requires_grad=True)
    out, _ = packed_attention(Layer(), q, k, v, None, scaling=dim ** -0.5, packed_lengths=lengths)
    grads = torch.autograd.grad(out.square().sum(), (q, k, v))

    refs, start = [], 0
    for n in lengths:
        keep = list(range(prefix)) + list(range(prefix + start, prefix + start + n))
        kk, vv = k[:, :, keep].repeat_interleave(3, 1), v[:, :, keep].repeat_interleave(3, 1)
        scores = q[:, :, start:start + n] @ kk.transpose(-1, -2) * dim ** -0.5
        visible = torch.ones(n, prefix + n, dtype=torch.bool).tril(prefix)
        refs.append((F.softmax(scores.masked_fill(~visible, float("-inf")), -1) @ vv).transpose(1, 2))
        start += n
    ref = torch.cat(refs, 1)
    ref_grads = torch.autograd.grad(ref.square().sum(), (q, k, v))
    assert out.shape == ref.shape == (1, sum(lengths), heads, dim)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_a_padded_masked_call_on_cpu_reads_grouped_keys_and_equals_transformers_sdpa(monkeypatch):
    # Right-padded rows after a shared prefix (the padded layout's masked call): torch's sdpa on the grouped
    # keys must give transformers' sdpa (keys copied out to every query head) to 1e-5, outputs and gradients.
    import transformers.integrations.sdpa_attention as hf_sdpa

    from factory.attention import packed_attention

    class Layer(torch.nn.Module):
        num_key_value_groups = 3
        is_causal = True

    torch.manual_seed(0)
    rows, prefix, length, heads, groups, dim = 3, 5, 4, 9, 3, 8
    q = torch.randn(rows, heads, length, dim, requires_grad=True)
    k = torch.randn(rows, groups, prefix + length, dim, requires_grad=True)
    v = torch.randn(rows, groups, prefix + length, dim, requires_grad=True)
    real = [length, 2, 3]  # rows 2 and 3 padded on the right
    mask = torch.ones(rows, 1, length, prefix + length, dtype=torch.bool).tril(prefix)
    for r, n in enumerate(real):
        mask[r, :, :, prefix + n:] = False
    repeats = []
    monkeypatch.setattr(hf_sdpa, "repeat_kv", lambda t, n: repeats.append(n) or t.repeat_interleave(n, 1))
    out, _ = packed_attention(Layer(), q, k, v, mask, scaling=dim ** -0.5)
    assert not repeats, "the CPU path copied the keys out per head"
    grads = torch.autograd.grad(out[:, :2].square().sum(), (q, k, v))  # row 3's padded query positions unused
    ref, _ = hf_sdpa.sdpa_attention_forward(Layer(), q, k, v, mask, scaling=dim ** -0.5)
    assert repeats == [3, 3]
    ref_grads = torch.autograd.grad(ref[:, :2].square().sum(), (q, k, v))
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("packed", [True, False])
def test_attention_on_cpu_under_bf16_autocast_is_computed_in_float32(packed):
    # bf16 q/k/v (what the projections give under autocast): the attention is the float32 one of the same
    # values, rounded to bf16 once at the end -- not torch's bf16 kernel (slower on CPU, and coarser). Both
    # CPU paths: the packed rows after a prefix, and the padded layout's masked call.
    from factory.attention import packed_attention

    class Layer(torch.nn.Module):
        num_key_value_groups = 3
        is_causal = True

    torch.manual_seed(0)
    prefix, lengths, heads, groups, dim = 40, [30, 7, 19], 9, 3, 64
    rows, keys = (1, sum(lengths)) if packed else (3, 30)
    q = torch.randn(rows, heads, keys, dim).bfloat16().requires_grad_()
    k = torch.randn(rows, groups, prefix + keys, dim).bfloat16().requires_grad_()
    v = torch.randn(rows, groups, prefix + keys, dim).bfloat16().requires_grad_()
    mask = None if packed else torch.ones(rows, 1, keys, prefix + keys, dtype=torch.bool).tril(prefix)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, _ = packed_attention(Layer(), q, k, v, mask, scaling=dim ** -0.5,
                                  packed_lengths=lengths if packed else None)
        grads = torch.autograd.grad(out.float().square().sum(), (q, k, v))
    want, _ = packed_attention(Layer(), q.float(), k.float(), v.float(), mask, scaling=dim ** -0.5,
                               packed_lengths=lengths if packed else None)
    want_grads = torch.autograd.grad(want.bfloat16().float().square().sum(), (q, k, v))
    assert out.dtype == torch.bfloat16 and torch.equal(out, want.bfloat16())
    for got, ref in zip(grads, want_grads):
        torch.testing.assert_close(got, ref, atol=1e-2, rtol=1e-2)


def test_cpu_attention_takes_an_additive_mask_in_the_inputs_dtype():
    # a floating mask (0 where seen, -inf where not) in bf16, as a model building its mask in its own dtype
    # would pass: the float32 attention reads it as the boolean one, not a dtype error
    from factory.attention import _cpu_sdpa

    torch.manual_seed(0)
    q, k, v = torch.randn(2, 9, 5, 64).bfloat16(), torch.randn(2, 3, 8, 64).bfloat16(), torch.randn(2, 3, 8, 64).bfloat16()
    seen = torch.ones(2, 1, 5, 8, dtype=torch.bool).tril(3)
    additive = torch.zeros(seen.shape).masked_fill(~seen, float("-inf")).bfloat16()
    out = _cpu_sdpa(q, k, v, additive, 0.0, None)
    assert out.dtype == torch.bfloat16 and torch.equal(out, _cpu_sdpa(q, k, v, seen, 0.0, None))


def test_cpu_attention_runs_in_the_inputs_dtype_in_inference_mode_only():
    # the rollout engine (generate under inference mode): bf16 stays bf16, where a float32 copy of the whole KV cache
    # per layer per step cost more than the attention; elsewhere (the update, its no-grad passes) float32
    from factory.attention import _cpu_sdpa

    sdpa = torch.nn.functional.scaled_dot_product_attention
    torch.manual_seed(0)
    k, v = torch.randn(2, 3, 40, 64).bfloat16(), torch.randn(2, 3, 40, 64).bfloat16()
    for queries in (1, 5):
        q = torch.randn(2, 9, queries, 64).bfloat16()
        mask = torch.ones(2, 1, queries, 40, dtype=torch.bool)
        mask[0, ..., :7] = False  # a left-padded row
        native = sdpa(q, k, v, attn_mask=mask, enable_gqa=True)
        exact = sdpa(q.float(), k.float(), v.float(), attn_mask=mask, enable_gqa=True).bfloat16()
        assert not torch.equal(native, exact)  # the two differ on these inputs: the checks below can tell them apart
        with torch.inference_mode():
            assert torch.equal(_cpu_sdpa(q, k, v, mask, 0.0, None), native)
        with torch.no_grad():
            assert torch.equal(_cpu_sdpa(q, k, v, mask, 0.0, None), exact)
