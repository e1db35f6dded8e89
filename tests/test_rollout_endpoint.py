"""The endpoint engine (`factory eval --model URL`): a scripted OpenAI-compatible completions server on
127.0.0.1 stands in for vLLM. The prompt goes as token ids; token ids come back (vLLM's
return_tokens_as_token_ids) or text tokenized here; a stop the server left out is put back."""
from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from factory.endpoints import EndpointError
from factory.rollout.engine import Sampling
from factory.rollout.engine_endpoint import EndpointEngine

SEEN: list[dict] = []


class Handler(BaseHTTPRequestHandler):
    def log_message(self, *args: object) -> None:
        pass

    def _json(self, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:  # /v1/models
        self._json({"data": [{"id": "served-model"}]})

    def do_POST(self) -> None:  # /v1/completions
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        SEEN.append(body)
        if body["prompt"][0] == 4 and sum(b["prompt"][0] == 4 for b in SEEN) < 3:  # busy twice, then answers
            data = b"overloaded"
            self.send_response(503)
            self.send_header("Retry-After", "0")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        elif body["prompt"][0] == 1:  # a vLLM: ids, stopped at a stop token it left out
            self._json({"choices": [{"text": "ab", "finish_reason": "stop",
                                     "logprobs": {"tokens": ["token_id:7", "token_id:8"], "token_logprobs": [-0.5, -0.25]}}]})
        else:  # a server that answers text only, cut at max_tokens
            self._json({"choices": [{"text": "xyz", "finish_reason": "length"}]})


class Tokenizer:
    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [ord(c) for c in text]


@pytest.fixture
def server():
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}/v1"
    httpd.shutdown()


@pytest.mark.anyio
async def test_ids_in_ids_out_and_the_stop_put_back(server):
    SEEN.clear()
    engine = EndpointEngine(server, Tokenizer(), stop_token_ids=[2, 99], end_of_turn_id=99)
    out = await engine.generate([1, 5, 6], max_new_tokens=8, sampling=Sampling(greedy=True))
    assert (out.ids, out.finished, out.logprobs) == ([7, 8, 99], True, [-0.5, -0.25, 0.0])
    assert SEEN[0]["prompt"] == [1, 5, 6] and SEEN[0]["model"] == "served-model" and SEEN[0]["temperature"] == 0.0
    out = await engine.generate([3], max_new_tokens=3, sampling=Sampling(temperature=0.7, seed=11))
    # the text, tokenized here: no log-probs (0.0 each had said every token was certain, and were recorded)
    assert (out.ids, out.finished, out.logprobs) == ([120, 121, 122], False, [])
    assert (SEEN[1]["temperature"], SEEN[1]["seed"]) == (0.7, 11)
    # every setting a server would otherwise take from the model's generation_config.json (vLLM's default:
    # Qwen3's top_k 20 and top_p 0.95, a repetition penalty) is sent as the local engines sample, greedy too
    neutral = {"top_p": 1.0, "top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0, "presence_penalty": 0.0,
               "frequency_penalty": 0.0}
    assert all({k: body[k] for k in neutral} == neutral for body in SEEN)
    with pytest.raises(RuntimeError, match="takes no weights"):
        engine.load_weights({})


@pytest.mark.anyio
async def test_a_busy_server_is_retried_the_stop_tokens_sent_and_the_client_closed(server):
    """A 503 (vLLM's queue full) costs a wait, not the evaluation, as a judge's requests; the server is told
    the template's stop tokens, so it does not generate to max_tokens past an end of turn it does not know;
    the stage's close closes the HTTP client."""
    SEEN.clear()
    engine = EndpointEngine(server, Tokenizer(), stop_token_ids=[2, 99], end_of_turn_id=99)
    out = await engine.generate([4], max_new_tokens=3, sampling=Sampling(greedy=True))
    assert out.ids == [120, 121, 122] and len(SEEN) == 3  # two 503s, then the answer
    assert all(b["stop_token_ids"] == [2, 99] for b in SEEN)
    client = engine._client
    await engine.close()
    assert client.is_closed and engine._client is None
    few = EndpointEngine(server, Tokenizer(), stop_token_ids=[2], end_of_turn_id=None, retries=1)
    with pytest.raises(EndpointError, match="^HTTP 503: overloaded$"):
        SEEN.clear()
        await few.generate([4], max_new_tokens=3, sampling=Sampling(greedy=True))
    await few.close()


@pytest.mark.anyio
@pytest.mark.parametrize("listing", [b'{"data": []}', b'{"object": "list"}', b"<html>proxy</html>",
                                     b'{"data": [{"id": null}]}', b'{"data": [{"id": ""}]}'])
async def test_a_server_that_lists_no_model_is_an_endpoint_error_naming_it(listing):
    """A `/models` answer with no model (a proxy with none configured) or not JSON was a bare IndexError or
    JSONDecodeError, naming neither the server nor the cause."""
    class Listing(Handler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Length", str(len(listing)))
            self.end_headers()
            self.wfile.write(listing)

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Listing)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{httpd.server_address[1]}/v1"
    engine = EndpointEngine(url, Tokenizer(), stop_token_ids=[2], end_of_turn_id=None)
    try:
        for _ in range(2):  # and again: not a half-started engine that sends model None
            with pytest.raises(EndpointError, match=f"^{url}/models lists no model"):
                await engine.generate([1], max_new_tokens=3, sampling=Sampling(greedy=True))
    finally:
        await engine.close()
        httpd.shutdown()


def test_an_evaluation_plan_generates_through_the_endpoint(monkeypatch, server):
    """Its rollout stage evaluates through the server. It had only been set up here: the stage's evaluation
    read the engine's `batches_run` and its progress `forward_steps`, which the endpoint engine lacked, so
    `factory eval --model URL` failed on its first prompt (AttributeError)."""
    from pathlib import Path

    import pyarrow as pa

    import factory
    from factory.commands.api import with_endpoint
    from factory.plan import RolloutSettings

    monkeypatch.chdir(Path(__file__).resolve().parents[1])
    plan = with_endpoint(factory.compile("specs/tiny.yaml"), server)
    (rollout,) = [s.settings for s in plan.stages if isinstance(s.settings, RolloutSettings)]
    assert rollout.endpoint == server
    # its stage stops on the chat's and the model's eos ids, as a local engine does (it had the chat's alone)
    import asyncio

    from factory.assets import resolve_model
    from factory.rollout.engine import model_eos
    from factory.rollout.stage import RolloutStage

    stage = RolloutStage(rollout.model_copy(update={"tool_peer": None}))  # (its calls are not made here)
    batch = pa.table({"messages": [json.dumps([{"role": "user", "content": "2+2?"}])], "row": [json.dumps({})]})

    async def evaluate():
        await stage.setup()
        try:
            return await stage.evaluate(batch), await stage.progress()
        finally:
            await stage.close()

    SEEN.clear()
    part, progress = asyncio.run(evaluate())
    assert stage.engine.stop_token_ids == sorted({*stage.chat.stop_token_ids, *model_eos(resolve_model(rollout.model.path))})
    assert len(stage.engine.stop_token_ids) > len(stage.chat.stop_token_ids)
    (traj,) = part.trajs
    assert len(SEEN) == 1 and traj.turns[0].text == "xyz" and traj.sampler_logprobs == []  # (text: tokenized here)
    assert stage.engine.batches_run == 1 and stage.engine.forward_steps == len(traj.response_ids)


def test_a_served_model_says_which_settings_of_the_spec_only_a_local_engine_reads(monkeypatch):
    from pathlib import Path

    import factory
    from factory.commands.api import served_elsewhere

    monkeypatch.chdir(Path(__file__).resolve().parents[1])
    spec = factory.load("specs/tiny.yaml", ["rollout.kv_cache_gb=4", "rollout.dtype=bfloat16", "model.lora.r=8"])
    assert served_elsewhere(spec) == ["rollout.dtype", "rollout.kv_cache_gb", "model.lora"]
    assert served_elsewhere(factory.load("specs/tiny.yaml")) == []  # (the sampling settings are sent: not moot)


def test_the_endpoint_stops_on_the_models_eos_as_the_local_engines_do(tmp_path):
    """It was given the chat's stop ids alone: a turn that ended at the model's eos (<|endoftext|> beside
    Qwen's <|im_end|>) got a second stop token put after it, and the eos stayed in the text the reward reads."""
    from factory.rollout.engine import model_eos

    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 151645}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [151645, 151643]}))
    stops = sorted({151645, *model_eos(tmp_path)})
    assert stops == [151643, 151645]
    engine = EndpointEngine("http://127.0.0.1:1/v1", Tokenizer(), stop_token_ids=stops, end_of_turn_id=151645)
    out = engine.answer({"finish_reason": "stop", "logprobs": {"tokens": ["token_id:9707", "token_id:151643"],
                                                              "token_logprobs": [-0.5, -0.1]}}, 8)
    assert (out.ids, out.finished) == ([9707, 151643], True)
