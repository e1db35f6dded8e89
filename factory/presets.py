"""The algorithm presets and `resolve()`: spec -> a frozen, fully resolved `Algorithm`.

Torch-free on purpose: `factory check` resolves the algorithm without importing torch. The tensor
functions live in factory/algorithms.py; NAMES lists their registry names, and a test keeps the two equal.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from factory.spelling import nearest


def did_you_mean(name: str, names: Any) -> str:
    """" (did you mean 'x'?)" for a registry name close to `name`, else ""."""
    near = nearest(name, names)
    return f" (did you mean '{near}'?)" if near else ""


class UnknownNameError(KeyError):
    """An unknown registry name; str() is the plain message (KeyError would quote it)."""

    def __str__(self) -> str:
        return str(self.args[0])



# Registry names of factory/algorithms.py, sorted (tests/test_algorithms.py checks they match the registries).
NAMES: dict[str, list[str]] = {
    "advantage": ["dr_grpo", "grpo", "mean_baseline", "reinforce_pp", "reinforce_pp_baseline", "rloo"],
    "policy loss": ["cispo", "dual_clip", "gspo", "ppo_clip"],
    "aggregation": ["seq_mean_token_mean", "seq_sum_norm", "token_mean"],
    "KL estimator": ["k1", "k2", "k3"],
}
# The advantages that compare a sample with the other samples of its prompt's group (a group of 1 has none).
GROUP_ADVANTAGES = frozenset({"dr_grpo", "grpo", "reinforce_pp_baseline", "rloo"})
# The policy losses that apply algorithm.dual_clip_c (tests/test_algorithms.py checks each loss's output).
DUAL_CLIP_LOSSES = frozenset({"dual_clip", "gspo", "ppo_clip"})


# ------------------------------------------------------------------------------ presets and resolve
@dataclass(frozen=True)
class Algorithm:
    """The fully resolved algorithm: what the update stage reads; no field is optional by accident."""

    name: str
    advantage: str
    loss: str
    aggregation: str
    clip_low: float
    clip_high: float
    dual_clip_c: float | None
    kl_coef: float
    kl_estimator: str
    kl_apply: str
    entropy_coef: float
    epochs: int
    mini_batches: int
    dynamic_sampling: bool
    overlong_filter: bool
    overlong_buffer: int
    overlong_penalty: float
    std_eps: float
    rollout_correction: str | None = None  # "tis", or None for no correction
    rollout_correction_cap: float = 2.0
    use_rollout_logprobs: bool = False
    credit: str = "trajectory"  # trajectory | turn: one advantage per trajectory, or per model turn
    gamma: float = 1.0  # credit "turn": discount of later turns in a turn's return
    train_per_group: int | None = None  # max-variance down-sampling: train this many of each group (None: all)

    @property
    def needs_reference(self) -> bool:
        """The frozen reference model is loaded only when KL is actually used."""
        return self.kl_coef > 0


_PPO = {"loss": "ppo_clip", "clip_low": 0.2, "clip_high": 0.2, "dual_clip_c": None, "dynamic_sampling": False}
PRESETS: dict[str, dict[str, Any]] = {
    # DeepSeekMath GRPO as TRL's loss_type="grpo": group-normalised advantage, per-sequence token mean.
    "grpo": {**_PPO, "advantage": "grpo", "aggregation": "seq_mean_token_mean"},
    # Dr.GRPO: no std scaling, no length normalisation (constant max_len), else as GRPO.
    "dr_grpo": {**_PPO, "advantage": "dr_grpo", "aggregation": "seq_sum_norm"},
    # DAPO: clip-higher 0.28, token mean over the batch, dynamic sampling. The soft overlong penalty
    # needs a buffer in tokens that depends on the budget, so it stays off until overlong.buffer is set.
    "dapo": {**_PPO, "advantage": "grpo", "aggregation": "token_mean", "clip_high": 0.28,
             "dynamic_sampling": True},
    # BNPO (TRL loss_type="bnpo"): GRPO with a token mean over the batch.
    "bnpo": {**_PPO, "advantage": "grpo", "aggregation": "token_mean"},
    # GSPO: sequence ratio, per-sequence mean; the paper's clip range is tiny because s_i is a mean.
    "gspo": {**_PPO, "advantage": "grpo", "loss": "gspo", "aggregation": "seq_mean_token_mean",
             "clip_low": 3e-4, "clip_high": 4e-4},
    # CISPO (MiniMax-M1 / ScaleRL): IS weight capped at 5 (= 1 + 4.0), no lower bound, token mean.
    "cispo": {**_PPO, "advantage": "grpo", "loss": "cispo", "aggregation": "token_mean",
              "clip_low": 1.0, "clip_high": 4.0},
    # RLOO: leave-one-out baseline; PPO-clip only matters when epochs/mini-batches go off-policy.
    "rloo": {**_PPO, "advantage": "rloo", "aggregation": "token_mean"},
    # REINFORCE++: batch-normalised reward, token mean; its KL goes in the reward (k1), per token as the paper:
    # each token pays the KL still to come, normalised over the batch's tokens (algorithms.kl_to_come_advantage).
    "reinforce_pp": {**_PPO, "advantage": "reinforce_pp", "aggregation": "token_mean",
                     "kl_apply": "reward", "kl_estimator": "k1"},
    "reinforce_pp_baseline": {**_PPO, "advantage": "reinforce_pp_baseline", "aggregation": "token_mean",
                              "kl_apply": "reward", "kl_estimator": "k1"},
    # Plain REINFORCE with a batch-mean baseline (works with group_size 1).
    "mean_baseline": {**_PPO, "advantage": "mean_baseline", "aggregation": "token_mean"},
}


@dataclass(frozen=True)
class PiOld:
    """Where a step's pi_old (the sampling policy's log-probs, the ratio's denominator) comes from."""

    from_rollout: bool  # the rollout engine's recorded log-probs
    own_pass: bool  # a no-grad pass of its own before the update (else: the update pass's own, detached)


def pi_old_source(rollout_logprobs: bool, corrected: bool, *, stale: bool, updates: int, kl_in_reward: bool,
                  recorded: bool = True) -> PiOld:
    """With a single optimizer update (`updates` = epochs x mini-batches = 1) the sampling policy IS the
    current one: its log-probs are the update pass's own, detached, and a separate pass would only repeat
    that forward (25% of the step) -- unless a KL-in-reward needs them before the advantages exist.
    With use_rollout_logprobs (`rollout_logprobs`) the engine's log-probs are pi_old and no pass is needed
    either. With stale rollouts (train.max_staleness > 0) the current weights are not the sampling ones: no
    shortcut; pi_old is the engine's log-probs, or, under a rollout correction (`corrected`), the pass's (TIS
    then weighs each token by pi_old / pi_rollout, which carries the staleness). `recorded`: the rollout
    recorded log-probs for every trajectory. Torch-free, so that `factory check` (clipping that can never
    act, factory.compiler.settings) reads the same rule as the learner."""
    from_rollout = rollout_logprobs or (stale and not corrected)
    if from_rollout and not recorded:
        raise ValueError(f"{'train.max_staleness' if stale else 'algorithm.use_rollout_logprobs'}: pi_old "
                         "is the rollout's log-probs, but the rollout recorded no log-probs")
    on_policy = updates == 1 and not stale and not kl_in_reward
    return PiOld(from_rollout=from_rollout, own_pass=not (on_policy or from_rollout))


def resolve(spec: Any) -> Algorithm:
    """Preset `spec.name` filled in, then every field the spec sets explicitly on top (a field counts as
    set when it is in pydantic's model_fields_set, or not None for the preset-filled ones). Raises
    KeyError/ValueError naming the bad value and the known names."""
    if spec.name not in PRESETS:
        raise UnknownNameError(f"unknown algorithm {spec.name!r}{did_you_mean(spec.name, PRESETS)}; known: "
                               f"{', '.join(sorted(PRESETS))}")
    s: dict[str, Any] = {"kl_apply": spec.kl.apply, "kl_estimator": spec.kl.estimator, **PRESETS[spec.name]}
    for key in ("advantage", "loss", "aggregation", "dual_clip_c", "dynamic_sampling"):
        if getattr(spec, key) is not None:
            s[key] = getattr(spec, key)
    if spec.clip is not None:
        s["clip_low"], s["clip_high"] = spec.clip
    for key in ("apply", "estimator"):  # explicit kl settings beat the preset's
        if key in spec.kl.model_fields_set:
            s[f"kl_{key}"] = getattr(spec.kl, key)
    for field, kind in (("advantage", "advantage"), ("loss", "policy loss"), ("aggregation", "aggregation"),
                        ("kl_estimator", "KL estimator")):
        if s[field] not in NAMES[kind]:
            # import paths name rewards, generators and tools; an algorithm's parts are registry names
            how = (f" (algorithm.{field} takes a registry name, not an import path: a new {kind} is a function in "
                   "factory/algorithms.py, docs/algorithms.md#a-new-algorithm)" if ":" in str(s[field]) else "")
            raise UnknownNameError(f"algorithm.{field}: unknown {kind} {s[field]!r}"
                                   f"{did_you_mean(str(s[field]), NAMES[kind])}; known: {', '.join(NAMES[kind])}{how}")
    if s["loss"] == "dual_clip" and s["dual_clip_c"] is None:
        s["dual_clip_c"] = 3.0  # verl's clip_ratio_c default
    alg = Algorithm(
        name=spec.name, **s, kl_coef=spec.kl.coef, entropy_coef=spec.entropy_coef, epochs=spec.epochs,
        mini_batches=spec.mini_batches, overlong_filter=spec.overlong.filter,
        overlong_buffer=spec.overlong.buffer, overlong_penalty=spec.overlong.penalty, std_eps=spec.std_eps,
        rollout_correction=spec.rollout_correction.kind if spec.rollout_correction else None,
        rollout_correction_cap=spec.rollout_correction.cap if spec.rollout_correction else 2.0,
        use_rollout_logprobs=spec.use_rollout_logprobs, credit=spec.credit, gamma=spec.gamma,
        train_per_group=spec.train_per_group,
    )
    _check(alg)
    return alg


def filled(algorithm: dict[str, Any], alg: Algorithm) -> dict[str, Any]:
    """The spec's `algorithm` section (as a dict) with what its preset decided in place of what it left
    unset (null, or kl's defaults that the preset overrides): the section as the run uses it."""
    kl = {**algorithm.get("kl", {}), "apply": alg.kl_apply, "estimator": alg.kl_estimator}
    return {**algorithm, "advantage": alg.advantage, "loss": alg.loss, "aggregation": alg.aggregation,
            "clip": [alg.clip_low, alg.clip_high], "dual_clip_c": alg.dual_clip_c,
            "dynamic_sampling": alg.dynamic_sampling, "kl": kl}


def _check(a: Algorithm) -> None:
    problems = []
    if a.clip_low < 0 or a.clip_high < 0:
        problems.append(f"algorithm.clip: bounds must be >= 0, got ({a.clip_low}, {a.clip_high})")
    if a.dual_clip_c is not None and a.dual_clip_c <= 1:
        problems.append(f"algorithm.dual_clip_c: must be > 1, got {a.dual_clip_c}")
    if a.kl_coef < 0:
        problems.append(f"algorithm.kl.coef: must be >= 0, got {a.kl_coef}")
    for key in ("epochs", "mini_batches"):
        if getattr(a, key) < 1:
            problems.append(f"algorithm.{key}: must be >= 1, got {getattr(a, key)}")
    if a.overlong_buffer < 0:
        problems.append(f"algorithm.overlong.buffer: must be >= 0, got {a.overlong_buffer}")
    if a.rollout_correction and a.use_rollout_logprobs:
        problems.append("algorithm.rollout_correction: with use_rollout_logprobs the ratio's denominator is "
                        "already the rollout's probability, so the correction weight would always be 1; "
                        "drop one of the two")
    if a.std_eps <= 0:
        problems.append(f"algorithm.std_eps: must be > 0, got {a.std_eps}")
    if problems:
        raise ValueError("; ".join(problems))
