"""HFEngine on the built-in tiny-qwen3 (random weights, real Qwen3 tokenizer), plus its pure helpers."""
import asyncio

import pytest
import torch

from factory.assets import resolve_model
from factory.rollout.engine import Generation, HFEngine, Sampling, cut_at_stop, left_pad

GREEDY = Sampling(greedy=True)
IM_START, IM_END, NL = 151644, 151645, 198


def test_cut_at_stop():
    assert cut_at_stop([5, 6, 7, 2, 9], [2], limit=10) == Generation([5, 6, 7, 2], True)
    assert cut_at_stop([5, 6, 7, 2, 9], [2], limit=3) == Generation([5, 6, 7], False)
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
    e.load_state_dict({k: v * 15 if "proj" in k else v for k, v in e.model.state_dict().items()})
    return e


def prompts():
    """Chat-shaped prompts of different lengths (so the batch needs left padding)."""
    bodies = [[3838, 374, 220, 17, 10, 18, 30], [9707], [40451, 752, 264, 1293, 3364, 911, 264, 25105, 13], [13048, 0]]
    return [[IM_START, 872, NL, *b, IM_END, NL, IM_START, 77091, NL] for b in bodies]


async def gather(engine, requests, sampling=GREEDY):
    return await asyncio.gather(*(engine.generate(p, max_new_tokens=n, sampling=sampling) for p, n in requests))


def test_concurrent_requests_share_one_batch_and_keep_their_limits(engine):
    before = engine.batches_run
    limits = [12, 5, 12, 1]
    outs = asyncio.run(gather(engine, list(zip(prompts(), limits))))
    assert engine.batches_run - before == 1
    assert [len(o.ids) for o in outs] == limits and not any(o.finished for o in outs)


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
        early = [asyncio.create_task(engine.generate(p, max_new_tokens=40, sampling=GREEDY)) for p in prompts()]
        await asyncio.sleep(engine.max_batch_wait_s + 0.05)  # the first batch is running in the worker thread by now
        late = await asyncio.wait_for(engine.generate(prompts()[1], max_new_tokens=40, sampling=GREEDY), 30)
        return await asyncio.gather(*early), late

    before = engine.batches_run
    early, late = asyncio.run(early_and_late())
    assert engine.batches_run - before == 2 and late == early[1]


def test_stop_tokens_end_a_generation(model_path, engine):
    (first,) = asyncio.run(gather(engine, [(prompts()[0], 4)]))
    stopper = HFEngine(model_path, batch_size=8, seed=0, stop_token_ids=[first.ids[2]])
    stopper.load_state_dict(engine.model.state_dict())
    assert IM_END in stopper.stop_token_ids  # the model's own eos is always a stop token
    (out,) = asyncio.run(gather(stopper, [(prompts()[0], 4)]))
    assert out == Generation(first.ids[:3], finished=True)


def test_sampling_is_seeded(model_path, engine):
    def sample(seed):
        e = HFEngine(model_path, batch_size=8, seed=seed)
        e.load_state_dict(engine.model.state_dict())
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
    e.load_state_dict(engine.model.state_dict())
    greedy = asyncio.run(gather(e, [(prompts()[0], 6)]))[0].ids
    samples = asyncio.run(gather(e, [(prompts()[0], 6)] * 4, Sampling(temperature=1.0)))
    assert all(o.ids != greedy for o in samples)


def test_load_state_dict_checks_keys_and_changes_outputs(model_path):
    e = HFEngine(model_path, batch_size=8, seed=0)
    before = asyncio.run(gather(e, [(prompts()[0], 6)]))[0].ids
    sd = {k: v * 15 if "proj" in k else v.clone() for k, v in e.model.state_dict().items()}
    del sd["lm_head.weight"]  # tied to the embeddings: may be left out
    e.load_state_dict(sd)
    assert torch.equal(e.model.model.layers[0].mlp.up_proj.weight, sd["model.layers.0.mlp.up_proj.weight"])
    assert asyncio.run(gather(e, [(prompts()[0], 6)]))[0].ids != before
    with pytest.raises(KeyError, match="does not have"):
        e.load_state_dict({**sd, "extra.weight": torch.zeros(1)})
    with pytest.raises(KeyError, match="missing from the update"):
        e.load_state_dict({k: v for k, v in sd.items() if k != "model.norm.weight"})


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
