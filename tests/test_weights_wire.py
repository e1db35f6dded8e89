"""`factory.types.Weights`, what a full weight sync carries through Ray's object store: pickled as numpy
arrays out of band (one copy into the store, none out of it), every dtype and every tie kept."""
import pickle

import numpy as np
import torch

from factory.types import Weights


def test_weights_pickle_out_of_band_and_arrive_equal_tied_and_in_their_dtypes():
    torch.manual_seed(0)
    emb = torch.randn(64, 8)
    sent = {"model.embed_tokens.weight": emb, "lm_head.weight": emb,  # tied: one storage
            "norm.weight": torch.randn(8).to(torch.bfloat16),  # no numpy dtype
            "scale": torch.randn(4, 4).to(torch.float8_e4m3fn),  # nor this
            "half": torch.randn(3, 5).half(), "steps": torch.arange(6)}
    buffers = []
    data = pickle.dumps(Weights(sent), protocol=5, buffer_callback=buffers.append)
    assert len(buffers) == 5  # every distinct tensor out of band, the tied one once
    assert len(data) < 1024  # in band: names and dtypes only
    got = pickle.loads(data, buffers=buffers)
    assert isinstance(got, Weights) and list(got) == list(sent)
    for name, tensor in sent.items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name].view(torch.uint8), tensor.view(torch.uint8)), name
    assert got["lm_head.weight"].data_ptr() == got["model.embed_tokens.weight"].data_ptr()
    # received without a copy: the tensor is a view of the buffer it came in
    addresses = {np.frombuffer(b.raw(), dtype=np.uint8).ctypes.data for b in buffers}
    assert got["model.embed_tokens.weight"].data_ptr() in addresses


def test_weights_are_a_plain_dict_to_their_holder():
    w = Weights({"a": torch.ones(2)})
    assert isinstance(w, dict) and torch.equal(w["a"], torch.ones(2))
    assert torch.equal(pickle.loads(pickle.dumps(w))["a"], torch.ones(2))  # in-band pickling works too


def test_the_update_stage_answers_a_weight_sync_with_weights_and_passes_adapters_and_none_through():
    from types import SimpleNamespace

    from factory.lora import Adapters
    from factory.update.stage import UpdateStage

    stage = UpdateStage(settings=None)
    full = {"w": torch.ones(2)}
    adapters = Adapters({"a": torch.ones(1)}, scale=2.0)
    for answer, want in ((full, Weights), (adapters, Adapters), (None, type(None))):
        stage.learner = SimpleNamespace(state_dict=lambda every_rank, copy, answer=answer: answer)
        got = stage.state_dict()
        assert type(got) is want
    stage.learner = SimpleNamespace(state_dict=lambda every_rank, copy: full)
    assert stage.state_dict()["w"] is full["w"]  # the same tensors, not copies (Ray copies them once)
