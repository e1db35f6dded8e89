"""Factory's losses against TRL's own GRPOTrainer code (trl 1.16.0), value and gradient.

TRL is called for real: a GRPOTrainer is made with object.__new__ (no model, no dataset) and given the
attributes its __init__ copies from a real GRPOConfig; only `_get_per_token_logps_and_entropies` (the
model forward) is replaced so that TRL sees the same log-probs, entropies and masks as Factory. If
either side's formula changes, these tests fail.
"""
from __future__ import annotations

from collections import defaultdict

import pytest
import torch

trl = pytest.importorskip("trl")
from accelerate import Accelerator
from transformers import TrainerState
from trl import GRPOConfig, GRPOTrainer

from factory.algorithms import policy_objective, resolve
from factory.schema import AlgorithmSpec, KLSpec

MAX_LEN = 8  # TRL's max_completion_length = Factory's max_len (the Dr.GRPO constant)


@pytest.fixture(autouse=True)
def _threads():
    torch.set_num_threads(1)


def make_batch(seed: int = 0, n: int = 6, t: int = 6):
    """Log-probs, old log-probs about 0.5 nats apart (so some ratios leave [0.8, 1.2]), mixed-sign advantages
    and ragged masks, in float64."""
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(n, t, generator=g, dtype=torch.float64) * 3  # [N, T]
    old = logp + 0.5 * torch.randn(n, t, generator=g, dtype=torch.float64)  # [N, T]
    ref = logp + 0.2 * torch.randn(n, t, generator=g, dtype=torch.float64)  # [N, T]
    entropy = torch.rand(n, t, generator=g, dtype=torch.float64) * 2  # [N, T]
    adv = torch.tensor([1.5, -0.7, 0.0, 0.9, -1.2, 0.4], dtype=torch.float64)[:n]  # [N]
    lengths = torch.tensor([6, 3, 5, 1, 4, 6])[:n]
    mask = (torch.arange(t)[None, :] < lengths[:, None]).long()  # [N, T]
    return logp, old, ref, entropy, adv, mask


def trl_trainer(loss_type: str, *, eps: float, eps_high: float, level: str = "token", beta: float = 0.0,
                entropy_coef: float = 0.0, accum: int = 1) -> GRPOTrainer:
    """A GRPOTrainer with just what compute_loss reads, copied from a real GRPOConfig the way
    GRPOTrainer.__init__ copies it."""
    args = GRPOConfig(
        output_dir="unused", report_to=[], use_cpu=True, loss_type=loss_type, epsilon=eps,
        epsilon_high=eps_high, importance_sampling_level=level, beta=beta, entropy_coef=entropy_coef,
        use_bias_correction_kl=False,  # TRL's DeepSeek-V3.2 KL correction; Factory's KL is the plain k3
        max_completion_length=MAX_LEN, gradient_accumulation_steps=accum, steps_per_generation=accum,
    )
    t = object.__new__(GRPOTrainer)
    t.args, t.accelerator, t.state = args, Accelerator(cpu=True), TrainerState()
    t.model = torch.nn.Module()  # only `.training` (True) is read: train mode
    t.loss_type, t.importance_sampling_level, t.beta = args.loss_type, args.importance_sampling_level, args.beta
    t.epsilon_low = args.epsilon
    t.epsilon_high = args.epsilon_high if args.epsilon_high is not None else args.epsilon
    t.max_completion_length = args.max_completion_length
    t.top_entropy_quantile, t.off_policy_mask_threshold = args.top_entropy_quantile, args.off_policy_mask_threshold
    t.use_vllm, t.vllm_importance_sampling_correction = args.use_vllm, args.vllm_importance_sampling_correction
    t.entropy_coef, t.use_adaptive_entropy = args.entropy_coef, args.use_adaptive_entropy
    t._entropy_bonus_enabled = t.entropy_coef != 0.0 or t.use_adaptive_entropy
    t.aux_loss_enabled = False
    t._metrics = {"train": defaultdict(list), "eval": defaultdict(list)}
    t.current_gradient_accumulation_steps = accum
    return t


def trl_loss(t: GRPOTrainer, logp, old, ref, entropy, adv, mask, *, num_items: int | None = None):
    """TRL's compute_loss on these tensors; returns (loss, d loss / d logp)."""
    leaf = logp.clone().requires_grad_()
    t._get_per_token_logps_and_entropies = lambda *a, **k: (leaf, entropy, None)
    n = logp.shape[0]
    inputs = {
        "prompt_ids": torch.zeros(n, 1, dtype=torch.long), "prompt_mask": torch.ones(n, 1, dtype=torch.long),
        "completion_ids": torch.zeros_like(mask), "completion_mask": mask,
        "advantages": adv, "old_per_token_logps": old, "ref_per_token_logps": ref,
        "num_items_in_batch": torch.tensor(float(mask.sum() if num_items is None else num_items)),
    }
    loss = t.compute_loss(None, inputs)
    loss.backward()
    return loss.detach(), leaf.grad


def factory_loss(alg, logp, old, ref, entropy, adv, mask, *, num_tokens=None, num_seqs=None):
    leaf = logp.clone().requires_grad_()
    loss, stats = policy_objective(
        alg, leaf, old, adv, mask, ref_logp=ref, entropy=entropy,
        num_tokens=float(mask.sum()) if num_tokens is None else num_tokens,
        num_seqs=float(mask.shape[0]) if num_seqs is None else num_seqs, max_len=MAX_LEN,
    )
    loss.backward()
    return loss.detach(), leaf.grad, stats


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo"])
def test_clip_losses_match_trl(loss_type):
    batch = make_batch(seed=1)  # a seed whose ratios leave [0.8, 1.28] on both sides
    t = trl_trainer(loss_type, eps=0.2, eps_high=0.28)
    want, want_grad = trl_loss(t, *batch)
    # Factory's preset of the same name, with TRL's clip range.
    alg = resolve(AlgorithmSpec(name=loss_type, clip=(0.2, 0.28)))
    got, got_grad, stats = factory_loss(alg, *batch)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    torch.testing.assert_close(got_grad, want_grad, rtol=0, atol=1e-6)
    m = t._metrics["train"]
    # The batch exercises both clip sides (else parity would say little about clipping).
    assert m["clip_ratio/low_mean"][0] > 0 and m["clip_ratio/high_mean"][0] > 0
    assert stats["clip_frac_low"].item() == pytest.approx(m["clip_ratio/low_mean"][0], abs=1e-6)
    assert stats["clip_frac_high"].item() == pytest.approx(m["clip_ratio/high_mean"][0], abs=1e-6)
    assert stats["entropy"].item() == pytest.approx(m["entropy"][0], abs=1e-6)


def test_gspo_matches_trl_sequence_level_importance_sampling():
    batch = make_batch(seed=1)
    t = trl_trainer("grpo", eps=0.05, eps_high=0.08, level="sequence")
    want, want_grad = trl_loss(t, *batch)
    got, got_grad, _ = factory_loss(resolve(AlgorithmSpec(name="gspo", clip=(0.05, 0.08))), *batch)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    # The stop-gradient trick gives the gradient of the true sequence-level ratio.
    torch.testing.assert_close(got_grad, want_grad, rtol=0, atol=1e-6)
    m = t._metrics["train"]
    assert m["clip_ratio/low_mean"][0] + m["clip_ratio/high_mean"][0] > 0  # some sequences clipped
    assert (want_grad != 0).any()  # and some not


def test_cispo_matches_trl():
    batch = make_batch(seed=2)
    t = trl_trainer("cispo", eps=0.2, eps_high=1.25)  # TRL: IS weight clamped to at most 1.25
    want, want_grad = trl_loss(t, *batch)
    # Factory: [1 - 1.0, 1 + 0.25] = [0, 1.25]
    got, got_grad, _ = factory_loss(resolve(AlgorithmSpec(name="cispo", clip=(1.0, 0.25))), *batch)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    torch.testing.assert_close(got_grad, want_grad, rtol=0, atol=1e-6)
    assert t._metrics["train"]["cispo_clip_ratio"][0] > 0


@pytest.mark.parametrize("loss_type", ["grpo", "dapo"])
def test_kl_loss_and_entropy_bonus_match_trl(loss_type):
    batch = make_batch(seed=3)
    t = trl_trainer(loss_type, eps=0.2, eps_high=0.2, beta=0.04, entropy_coef=0.01)
    want, want_grad = trl_loss(t, *batch)
    spec = AlgorithmSpec(name=loss_type, clip=(0.2, 0.2), kl=KLSpec(coef=0.04, estimator="k3", apply="loss"),
                         entropy_coef=0.01)
    got, got_grad, stats = factory_loss(resolve(spec), *batch)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    torch.testing.assert_close(got_grad, want_grad, rtol=0, atol=1e-6)
    assert stats["kl"].item() > 0  # a token mean whatever the loss's aggregation, as TRL logs it
    assert stats["kl"].item() == pytest.approx(t._metrics["train"]["kl"][0], abs=1e-6)


@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo", "dapo"])
def test_micro_batches_sum_to_trl_gradient_accumulation(loss_type):
    """Two micro-batches of 3 sequences: TRL with gradient accumulation 2 and Factory with the mini-batch
    totals give the same summed loss and gradient, and both equal Factory's one-micro-batch loss."""
    logp, old, ref, ent, adv, mask = make_batch(seed=4)
    halves = [slice(0, 3), slice(3, 6)]
    alg = resolve(AlgorithmSpec(name=loss_type, clip=(0.2, 0.28)))
    want = got = 0.0
    for h in halves:
        t = trl_trainer(loss_type, eps=0.2, eps_high=0.28, accum=2)
        want += trl_loss(t, logp[h], old[h], ref[h], ent[h], adv[h], mask[h], num_items=int(mask.sum()))[0]
        got += factory_loss(alg, logp[h], old[h], ref[h], ent[h], adv[h], mask[h],
                            num_tokens=float(mask.sum()), num_seqs=6.0)[0]
    whole = factory_loss(alg, logp, old, ref, ent, adv, mask)[0]
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    torch.testing.assert_close(whole, want, rtol=0, atol=1e-6)
