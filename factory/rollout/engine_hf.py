"""The transformers engine: `model.generate`, batched across concurrent requests, with per-request seeds
and the sampled tokens' log-probs.

Requests waiting at a given moment become one batch (left-padded, one `model.generate` per batch) that
runs in a worker thread, so the event loop keeps serving tool calls while the model computes. A request
arriving while a batch runs waits for the next batch (continuous batching is what the vLLM engine adds).
A prompt that comes several times in a batch (a group's samples) runs once, its keys and values repeated for
its copies, where that saves enough prefill (`_prefill_once`: prefix caching, within a batch).
A request is answered at the decoding step its turn ends (a stop token, or its own token limit), not when the
batch's longest row ends: its trajectory's tool call, or its reward, then runs while the batch decodes on.
A batch ends with the last row still wanted: each row stops at its own token limit, and a request whose
caller was cancelled is dropped from the queue, or from the batch at the next step (`_rows_done`).

Sampling is done by `SeededSampler`, a logits processor handed to a greedy `generate`: for every row it
draws the token by inverse-CDF from log_softmax(logits / T) (after top-k/top-p) with a uniform number
that depends only on that request's seed and the token's position, and records the token's log-prob.
transformers' own sampling draws from one global generator for the whole batch, which would tie what a
request samples to the batch it landed in, and would leave us to recompute the log-probs afterwards.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from factory.assets import config_context
from factory.lora import Adapters
from factory.rollout.engine import Generation, Sampling, cut_at_stop

if TYPE_CHECKING:
    from factory.schema import LoraSpec

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_MASK64 = (1 << 64) - 1


def left_pad(prompts: Sequence[Sequence[int]], pad_id: int) -> tuple[Tensor, Tensor]:
    """Prompts of different lengths as one left-padded batch: ids [B, L] and attention mask [B, L]."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, p in enumerate(prompts):
        if p:
            ids[row, width - len(p):] = torch.tensor(p, dtype=torch.long)
            mask[row, width - len(p):] = 1
    return ids, mask


def uniform(seed: int, position: int) -> float:
    """A number in (0, 1] from (seed, position) alone: splitmix64 of the pair (counter-based, so no state
    to carry between turns or batches). Never 0, so the inverse CDF never lands on a zero-probability
    token."""
    z = (seed * 0x9E3779B97F4A7C15 + position + 1) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    z ^= z >> 31
    return ((z >> 11) + 1) / float(1 << 53)


class SeededSampler:
    """A transformers logits processor (`__call__(input_ids, scores) -> scores`) that picks every row's
    next token itself and returns scores whose argmax is that token, so a greedy `generate` emits it.

    Row b's token at new-token position t is drawn with `uniform(seeds[b], t)` when the request has a
    seed, else with one draw of `generator`. `logprobs` collects, per step, the [B] log-probs of the
    chosen tokens under the distribution they were drawn from (greedy: log_softmax(logits))."""

    def __init__(self, sampling: Sampling, seeds: list[int | None], prompt_width: int,
                 generator: torch.Generator | None = None):
        from transformers import TopKLogitsWarper, TopPLogitsWarper

        self.sampling, self.seeds, self.prompt_width, self.generator = sampling, seeds, prompt_width, generator
        self.warpers = []
        if not sampling.greedy and sampling.top_k > 0:
            self.warpers.append(TopKLogitsWarper(sampling.top_k))
        if not sampling.greedy and sampling.top_p < 1.0:
            self.warpers.append(TopPLogitsWarper(sampling.top_p))
        self.logprobs: list[Tensor] = []  # per step: [B]
        self.tokens: list[Tensor] = []  # per step: [B], the chosen ids
        self.on_step: Callable[[], None] | None = None  # called after each step (the engine counts them)

    def __call__(self, input_ids: Tensor, scores: Tensor) -> Tensor:
        logits = scores.float()  # [B, V]
        if self.sampling.greedy:
            logp = torch.log_softmax(logits, dim=-1)
            chosen = logp.argmax(dim=-1)  # [B]
        else:
            logits = logits / self.sampling.temperature
            for warp in self.warpers:
                logits = warp(input_ids, logits)
            logp = torch.log_softmax(logits, dim=-1)  # [B, V]
            chosen = self._draw(logp, input_ids.shape[1] - self.prompt_width)
        self.logprobs.append(logp.gather(1, chosen[:, None])[:, 0].cpu())
        self.tokens.append(chosen.cpu())
        if self.on_step is not None:
            self.on_step()
        out = torch.full_like(scores, float("-inf"))
        return out.scatter_(1, chosen[:, None], 0.0)

    def _draw(self, logp: Tensor, position: int) -> Tensor:
        """Inverse CDF: the first token whose cumulative probability reaches u (scaled by the total, so
        float rounding of the sum never leaves u past the end)."""
        u = torch.tensor([uniform(s, position) if s is not None else 0.0 for s in self.seeds], dtype=torch.float64)
        unseeded = torch.tensor([s is None for s in self.seeds])
        if unseeded.any():
            draws = 1.0 - torch.rand(int(unseeded.sum()), generator=self.generator, dtype=torch.float64)  # (0, 1]
            u[unseeded] = draws
        cdf = logp.exp().double().cumsum(dim=-1)  # [B, V]
        target = (u.to(cdf.device) * cdf[:, -1])[:, None]
        return torch.searchsorted(cdf, target)[:, 0].clamp(max=logp.shape[1] - 1)


def _as_list(x: Any) -> list[int]:
    if x is None:
        return []
    return list(x) if isinstance(x, (list, tuple)) else [int(x)]


@dataclass
class _Request:
    prompt_ids: list[int]
    max_new_tokens: int
    sampling: Sampling
    future: asyncio.Future = field(repr=False)

    @property
    def abandoned(self) -> bool:
        """Nobody waits for the answer: the caller was cancelled (an episode's timeout, a stage stopped)."""
        return self.future.cancelled()


def _rows_done(batch: list[_Request], width: int, closing: Callable[[], bool]) -> Any:
    """`generate`'s per-row stop (a transformers StoppingCriteria): a row is done at its own request's
    `max_new_tokens` -- `generate` itself knows only the batch's largest -- or once nobody waits for it, so a
    batch ends with its last row still wanted. Without it a batch mixing limits (a later turn's limit is what
    is left of `max_total_tokens`) decoded every row to the largest one, and its last rows were answered
    only then."""
    from transformers import StoppingCriteria

    class RowsDone(StoppingCriteria):
        def __call__(self, input_ids: Tensor, scores: Any, **kwargs: Any) -> Tensor:
            n, stop = input_ids.shape[1] - width, closing()
            return torch.tensor([stop or n >= r.max_new_tokens or r.abandoned for r in batch], device=input_ids.device)

    return RowsDone()


class HFEngine:
    """transformers `generate`, batched across concurrent requests.

    Stop tokens: the model's eos ids (config and generation config) plus `stop_token_ids` (pass
    `ChatFormat.stop_token_ids`, which holds the tokenizer's eos and the template's end-of-turn token).
    Requests in one batch share their sampling settings except the seed; their `max_new_tokens` may
    differ: the batch generates to the largest and each result is cut to its own limit. Its longest prompt and
    largest limit fit the model's context together (`context`, from its config; see _take_batch).
    """

    name = "hf"

    def __init__(self, model_path: str, *, dtype: str | torch.dtype = "float32", batch_size: int = 64, seed: int = 0,
                 device: str = "cpu", stop_token_ids: Sequence[int] = (), lora: LoraSpec | None = None):
        from transformers import GenerationConfig

        self.device = torch.device(device)
        # One worker thread runs every torch operation of this engine: batches never overlap a weight load,
        # and the process has one OpenMP thread team. libgomp counts every team's threads; once they outnumber
        # the cores (a second thread running one parallel op, such as a weight load's copy, is enough) it
        # cuts its workers' spin-wait to ~100 polls, and every op of a decoding step then wakes them from
        # sleep: generation ran ~25% slower, on 1.55 of 2 cores, from the first weight sync on
        # (docs/performance.md, "One thread for torch").
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hf-generate")
        torch_dtype = _DTYPES[dtype] if isinstance(dtype, str) else dtype
        self.model = self._executor.submit(self._load_model, model_path, torch_dtype, lora).result()
        self.weight_sync = "lora adapters (peft)" if lora is not None else "full weights"  # for the resolved params
        self.batch_size = batch_size
        self.params = sum(p.numel() for p in self.model.parameters())
        # a batch's repeated prompts run once when that saves this much prefill (tokens x parameters), see
        # _prefill_once: ~0.1 TFLOP, a few tenths of a second on 2 CPU cores; below it the extra forward call
        # costs more than it saves (the tiny spec's ~1e10: its steps took 9-18% longer with it)
        self.prefill_once_min = 5e10
        self.fallback_reason: str | None = None  # set by make_engine when `auto` could not use vLLM
        self.choice_reason: str | None = None  # set by make_engine when `auto` weighed vLLM's start-up
        self.max_model_len: int | None = None  # none of its own: the rollout cuts at the model's context
        cfg, gen_cfg = self.model.config, self.model.generation_config
        # the positions a batch may reach: every row decodes as long as the batch's largest limit (see _take_batch)
        self.context = config_context(cfg.to_dict())  # the loaded config: what config.json said
        self.stop_token_ids = sorted({*_as_list(cfg.eos_token_id), *_as_list(gen_cfg.eos_token_id), *stop_token_ids})
        if not self.stop_token_ids:
            raise ValueError(f"{model_path}: no eos token in the model config; pass stop_token_ids")
        pad = gen_cfg.pad_token_id if gen_cfg.pad_token_id is not None else cfg.pad_token_id
        self.pad_token_id = int(_as_list(pad)[0]) if pad is not None else self.stop_token_ids[0]
        # generate() fills every field we leave unset from the model's saved generation_config (Qwen
        # checkpoints ship top_k, top_p, repetition_penalty...). RL needs samples from exactly the
        # distribution the spec names (the learner's ratios assume it), so those saved defaults go.
        self.model.generation_config = GenerationConfig(eos_token_id=self.stop_token_ids, pad_token_id=self.pad_token_id)
        self.generator = torch.Generator().manual_seed(seed)  # for requests without a seed of their own
        self._pending: list[_Request] = []
        self._wakeup: asyncio.Event | None = None
        self._worker: asyncio.Task | None = None
        self._closing = False  # close() was called: a batch in flight ends at its next step
        self.batches_run = 0  # for tests and metrics: how many model.generate calls were made
        self.forward_steps = 0  # decoding steps over all batches: the rollout's heartbeat (RolloutStage.progress)
        self.batch_window_s, self.max_batch_wait_s = 0.02, 0.25

    # ------------------------------------------------------------------------------------ Engine API
    async def generate(self, prompt_ids: list[int], *, max_new_tokens: int, sampling: Sampling) -> Generation:
        if max_new_tokens < 1:
            return Generation([], finished=False)
        loop = asyncio.get_running_loop()
        request = _Request(list(prompt_ids), max_new_tokens, sampling, loop.create_future())
        self._pending.append(request)
        self._ensure_worker(loop).set()
        return await request.future

    async def close(self) -> None:
        """Stop batching: a batch in flight ends at its next decoding step, and every request not answered
        yet is cancelled (its caller sees CancelledError instead of waiting forever). The worker thread ends
        after that step (not waited for here: the event loop goes on); work queued behind it is cancelled. The
        model is memory of this process, freed with it. A stage's close may run twice: the second does nothing."""
        self._closing = True
        if self._worker is not None:
            self._worker.cancel()
        for r in self._pending:
            r.future.cancel()
        self._pending = []
        self._executor.shutdown(wait=False, cancel_futures=True)

    def load_weights(self, state_dict: dict[str, Tensor] | Adapters) -> None:
        """Copy the learner's weights in place, on the engine's thread, after the batch it runs. Keys missing
        from `state_dict` are accepted only when they share storage with a key that is present (tied
        embeddings / lm_head). LoRA: the adapters replace peft's, every one of them."""
        self._executor.submit(self._load_weights, state_dict).result()

    def _load_model(self, model_path: str, torch_dtype: torch.dtype, lora: LoraSpec | None) -> Any:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch_dtype).to(self.device).eval()
        if self.device.type == "cpu" and model.config._attn_implementation == "sdpa":
            # the learner's attention (factory.attention): a left-padded batch's grouped KV heads without
            # transformers' copy of the whole KV cache per layer per step; the same samples, SmolLM2-135M's
            # batch in 7.6-8.0 s instead of 9.0-9.2 (docs/performance.md, "Grouped KV heads")
            from factory.attention import use_packed_attention

            use_packed_attention(model)
        if lora is None:
            return model
        # the learner's adapters, through peft: a sync sets A and B (B starts at 0: the base model)
        from peft import get_peft_model

        from factory.lora import peft_config

        return get_peft_model(model, peft_config(lora)).eval()

    def _load_weights(self, state_dict: dict[str, Tensor] | Adapters) -> None:
        if isinstance(state_dict, Adapters):
            from peft import set_peft_model_state_dict

            result = set_peft_model_state_dict(self.model, state_dict.tensors)
            if result.unexpected_keys or any("lora_" in k for k in result.missing_keys):
                raise KeyError(f"adapters that do not fit this model: {sorted(result.unexpected_keys)[:5]} "
                               f"unexpected, {[k for k in result.missing_keys if 'lora_' in k][:5]} missing")
            return
        missing, unexpected = self.model.load_state_dict(state_dict, strict=False)
        if unexpected:
            raise KeyError(f"weights the rollout model does not have: {sorted(unexpected)[:5]}")
        by_key = dict(self.model.state_dict(keep_vars=True))
        loaded = {by_key[k].data_ptr() for k in state_dict if k in by_key}
        untied = [k for k in missing if by_key[k].data_ptr() not in loaded]
        if untied:
            raise KeyError(f"weights missing from the update: {sorted(untied)[:5]}")

    # ------------------------------------------------------------------------------------- batching
    def _ensure_worker(self, loop: asyncio.AbstractEventLoop) -> asyncio.Event:
        # The worker belongs to the running loop; a new loop (a new asyncio.run) gets a new worker.
        if self._worker is None or self._worker.done() or self._worker.get_loop() is not loop:
            self._wakeup, self._closing = asyncio.Event(), False
            self._worker = loop.create_task(self._serve(), name="hf-engine-batcher")
        assert self._wakeup is not None
        return self._wakeup

    async def _serve(self) -> None:
        loop = asyncio.get_running_loop()
        assert self._wakeup is not None
        while True:
            await self._wakeup.wait()
            self._wakeup.clear()
            await self._gather_requests()
            while self._pending:
                batch = self._take_batch()
                if not batch:
                    continue
                try:
                    results = await loop.run_in_executor(self._executor, self._generate_batch, batch, loop)
                except asyncio.CancelledError:  # close(), or the loop's end: nobody will answer these requests
                    for r in batch:
                        r.future.cancel()
                    raise
                except Exception as e:  # an engine failure fails the requests of this batch, not the loop
                    for r in batch:
                        if not r.future.done():
                            r.future.set_exception(e)
                    continue
                if self.device.type == "cuda" and not self._pending:
                    # Nothing queued: hand the batches' cached blocks (their KV caches) back to the GPU before
                    # answering. PyTorch's caching allocator keeps them reserved for this process otherwise,
                    # where a colocated update in another process (DeepSpeed's actor on the same GPU) cannot
                    # have them.
                    try:
                        await loop.run_in_executor(self._executor, torch.cuda.empty_cache)
                    except Exception as e:  # the batch's answers are good: its callers get them all the same
                        log.warning("torch.cuda.empty_cache after a batch failed (%s): its cached blocks stay "
                                    "reserved to this process", e)
                for r, g in zip(batch, results):
                    if not r.future.done():  # answered early (_answer_ended), or the caller was cancelled
                        r.future.set_result(g)
                if self._pending:  # next turns that came while this batch ran, and those on their way
                    await self._gather_requests()

    async def _gather_requests(self) -> None:
        """Wait briefly for more requests before cutting a batch. After a tool round the trajectories'
        next-turn requests arrive a few milliseconds apart (their calls finish at different times);
        cutting at the first one ran turn 2 as several small `generate` calls, each paying the whole
        per-token loop. We wait while requests keep arriving (`batch_window_s` of quiet), at most
        `max_batch_wait_s`: cheap next to a batch that takes seconds."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.max_batch_wait_s
        seen = -1
        while len(self._pending) != seen and len(self._pending) < self.batch_size and loop.time() < deadline:
            seen = len(self._pending)
            await asyncio.sleep(self.batch_window_s)

    def _take_batch(self) -> list[_Request]:
        """Up to batch_size pending requests that share the first one's sampling settings, oldest first. A request
        nobody waits for any more (`abandoned`) is dropped, not run: a stage's cancelled requests would
        otherwise fill the next batches ahead of live ones. A batch decodes every row to (longest prompt + largest
        limit) positions: a request joins only while that stays within the model's context, else it waits for a
        later batch (requests that each fit it overflowed it together: an IndexError in a model with learned
        positions, GPT-2's, and wasted steps past the context in the others)."""
        self._pending = [r for r in self._pending if not r.abandoned]
        if not self._pending:
            return []
        shared = self._pending[0].sampling.shared()
        batch: list[_Request] = []
        prompt = limit = 0
        for r in self._pending:
            if len(batch) == self.batch_size:
                break
            if r.sampling.shared() != shared:
                continue
            wider, longer = max(prompt, len(r.prompt_ids)), max(limit, r.max_new_tokens)
            if batch and self.context is not None and wider + longer > self.context:
                continue  # (the first request always runs: alone, it is what it asked for)
            batch.append(r)
            prompt, limit = wider, longer
        taken = {id(r) for r in batch}
        self._pending = [r for r in self._pending if id(r) not in taken]
        return batch

    def _prefill_once(self, ids: Tensor, mask: Tensor) -> Any:
        """The keys and values of a left-padded batch's prompts but their last token, computed once for each
        distinct prompt and repeated for its copies; None where none repeats. A training rollout's first turn
        is `group_size` requests of each prompt: without this every copy ran the whole prompt (the
        quickstart's ~280 tokens of few-shot turns, 8 times over; its float32 rollout steps took 15.4-18.3 s
        instead of 22.0-26.4 on the AMX Xeon, bench/engines.py). `generate` then runs the last token."""
        rows = [tuple(row) for row in ids.tolist()]
        first: dict[tuple[int, ...], int] = {}  # each distinct prompt -> its first row, in order of appearance
        for i, row in enumerate(rows):
            first.setdefault(row, i)
        saved = (len(rows) - len(first)) * (ids.shape[1] - 1) * self.params  # prefill tokens x parameters
        if not saved or saved < self.prefill_once_min:
            return None
        pick = torch.tensor(list(first.values()))
        u_ids, u_mask = ids[pick, :-1].to(self.device), mask[pick, :-1].to(self.device)
        # the positions generate gives a left-padded row (transformers' _prepare_position_ids_for_generation)
        positions = (u_mask.cumsum(-1) - 1).masked_fill(u_mask == 0, 0)
        cache = self.model(input_ids=u_ids, attention_mask=u_mask, position_ids=positions, use_cache=True,
                           logits_to_keep=1).past_key_values
        slot = {row: k for k, row in enumerate(first)}  # the cache row of each distinct prompt
        cache.reorder_cache(torch.tensor([slot[row] for row in rows], device=self.device))
        return cache

    def _answer_ended(self, batch: list[_Request], sampler: SeededSampler,
                      loop: asyncio.AbstractEventLoop | None) -> Callable[[], None]:
        """The sampler's per-step hook: count the step, and answer each request whose turn ended at it (its
        stop token, or its own `max_new_tokens`) with what the batch's end would give it (`cut_at_stop` of its
        tokens so far). A batch decodes until its longest row ends; a trajectory whose turn ended early
        meanwhile runs its tool call or gets its reward, and its next turn waits in the queue for the next
        batch, instead of idling until the longest row ends."""
        stops, answered = set(self.stop_token_ids), [False] * len(batch)

        def settle(future: asyncio.Future, generation: Generation) -> None:
            if not future.done():  # the caller may have been cancelled
                future.set_result(generation)

        def stepped() -> None:
            self.forward_steps += 1
            if loop is None:
                return
            n = len(sampler.tokens)
            for i, r in enumerate(batch):
                if not answered[i] and r.abandoned:  # nobody to answer; the row is done for `generate` too
                    answered[i] = True
            ended = [i for i, (r, tok) in enumerate(zip(batch, sampler.tokens[-1].tolist()))
                     if not answered[i] and (tok in stops or n >= r.max_new_tokens)]
            if sum(answered) + len(ended) == len(batch):
                return  # the batch's last rows: answered when `generate` has returned, so the batch is over then
            for i in ended:
                answered[i] = True
                row = cut_at_stop([int(t[i]) for t in sampler.tokens], stops, batch[i].max_new_tokens,
                                  [float(lp[i]) for lp in sampler.logprobs])
                with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits for this answer
                    loop.call_soon_threadsafe(settle, batch[i].future, row)

        return stepped

    def _generate_batch(self, batch: list[_Request], loop: asyncio.AbstractEventLoop | None = None) -> list[Generation]:
        """One `generate` over `batch`: each request's Generation. With `loop` (the requests' event loop), each
        request is also answered there as soon as its turn ends (_answer_ended)."""
        from transformers import GenerationConfig, LogitsProcessorList, StoppingCriteriaList

        ids, mask = left_pad([r.prompt_ids for r in batch], self.pad_token_id)
        sampler = SeededSampler(batch[0].sampling, [r.sampling.seed for r in batch], ids.shape[1], self.generator)
        sampler.on_step = self._answer_ended(batch, sampler, loop)
        # Greedy decoding over the sampler's scores: the sampler has already chosen each token.
        config = GenerationConfig(do_sample=False, max_new_tokens=max(r.max_new_tokens for r in batch),
                                  eos_token_id=self.stop_token_ids, pad_token_id=self.pad_token_id)
        with torch.inference_mode():
            out = self.model.generate(input_ids=ids.to(self.device), attention_mask=mask.to(self.device),
                                      past_key_values=self._prefill_once(ids, mask), generation_config=config,
                                      logits_processor=LogitsProcessorList([sampler]),
                                      stopping_criteria=StoppingCriteriaList([_rows_done(batch, ids.shape[1],
                                                                                         lambda: self._closing)]))
        self.batches_run += 1
        new = out[:, ids.shape[1]:].tolist()  # [B, T_new]
        logprobs = torch.stack(sampler.logprobs, dim=1).tolist() if sampler.logprobs else [[] for _ in batch]  # [B, T]
        return [cut_at_stop(row, self.stop_token_ids, r.max_new_tokens, lp)
                for row, lp, r in zip(new, logprobs, batch)]
