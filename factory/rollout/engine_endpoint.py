"""Generation by an OpenAI-compatible server (vLLM, SGLang, ...), for `factory eval --model URL`: the model is
not loaded here and takes no weight syncs, so it scores, it never trains.

Each request goes to the completions API with the prompt as token ids (the conversation so far, rendered
and tokenized here as with a local engine), so nothing already generated is tokenized again; the answer
comes back as token ids where the server gives them (vLLM's `return_tokens_as_token_ids`), else as text
that is tokenized here (the one place Factory re-tokenizes, and only for a server that cannot do better).
A turn the server ended at a stop token that it left out of its answer gets the end-of-turn token back, as
a local engine's turn ends. The API key, retries and `Retry-After` as a judge's requests (factory.endpoints).
"""
from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from factory.endpoints import EndpointError, open_client, request
from factory.rollout.engine import Generation, Sampling, cut_at_stop

_TOKEN_ID = "token_id:"  # vLLM's form of a token in `logprobs.tokens` with return_tokens_as_token_ids
RETRIES = 4  # a request failed for a reason that may pass (429, 5xx, transport) is tried again: 3.75 s of backoff


def served_model(url: str, listed: Any) -> str:
    """The first model a server's `/models` answer lists (an EndpointError naming the server if none)."""
    try:
        model = listed.json()["data"][0]["id"]
        if isinstance(model, str) and model:
            return model
    except (ValueError, LookupError, TypeError, AttributeError):  # not JSON, no data, an empty list, no id
        pass
    raise EndpointError(f"{url} lists no model: {listed.text[:200]!r} (the server's /models must name the model "
                            "it serves)") from None


class EndpointEngine:
    name = "endpoint"
    weight_sync = "none (an endpoint: evaluation only)"
    fallback_reason: str | None = None
    choice_reason: str | None = None
    max_model_len: int | None = None  # the server's to enforce

    def __init__(self, url: str, tokenizer: Any, stop_token_ids: Sequence[int], end_of_turn_id: int | None,
                 timeout_s: float = 300.0, retries: int = RETRIES):
        self.url = url.rstrip("/")
        self.tokenizer = tokenizer
        self.stop_token_ids = list(stop_token_ids)
        self.end_of_turn_id = end_of_turn_id
        self.timeout_s, self.retries = timeout_s, retries
        self._client: Any = None
        self._key_withheld = False
        self._model: str | None = None
        self._lock: asyncio.Lock | None = None
        # the stage's metrics and heartbeat (the Engine protocol): requests answered, and tokens generated,
        # each one a forward of the server's
        self.batches_run = 0
        self.forward_steps = 0

    async def _start(self) -> tuple[Any, str]:
        """The HTTP client and the served model's name (the server's first, from /models), made once."""
        self._lock = self._lock or asyncio.Lock()
        async with self._lock:
            if self._model is None:
                if self._client is None:
                    self._client, self._key_withheld = open_client(self.url, self.timeout_s)
                self._model = served_model(f"{self.url}/models", await self._send("GET", f"{self.url}/models"))
        return self._client, self._model

    async def _send(self, method: str, url: str, body: dict[str, Any] | None = None) -> Any:
        """One request, retried as a judge's are (factory.endpoints): a busy server (429, 503) or a dropped
        connection costs a wait, not the evaluation."""
        return await request(self._client, method, url, body=body, retries=self.retries, cap_s=self.timeout_s,
                             key_withheld=self._key_withheld)

    async def generate(self, prompt_ids: list[int], *, max_new_tokens: int, sampling: Sampling) -> Generation:
        _, model = await self._start()
        # stop_token_ids (a vLLM / SGLang extension): the server stops at the template's end of turn too,
        # not only at its model's EOS, instead of generating to max_tokens for cut_at_stop to throw away
        body: dict[str, Any] = {"model": model, "prompt": prompt_ids, "max_tokens": max_new_tokens, "logprobs": 1,
                                "return_tokens_as_token_ids": True, "skip_special_tokens": False,
                                "stop_token_ids": self.stop_token_ids}
        # Every setting the server would otherwise fill from the model's generation_config.json (vLLM's default
        # `--generation-config auto`: Qwen3 ships top_k 20, top_p 0.95; Qwen2.5 a repetition penalty), as the
        # local engines leave those out: the same spec then scores the same policy on any engine
        body.update(top_p=1.0, top_k=-1, min_p=0.0, repetition_penalty=1.0, presence_penalty=0.0,
                    frequency_penalty=0.0)
        if sampling.greedy:
            body["temperature"] = 0.0
        else:
            body.update(temperature=sampling.temperature, top_p=sampling.top_p)
            if sampling.top_k:
                body["top_k"] = sampling.top_k
            if sampling.seed is not None:
                body["seed"] = sampling.seed
        reply = await self._send("POST", f"{self.url}/completions", body)
        out = self.answer(reply.json()["choices"][0], max_new_tokens)
        self.batches_run += 1
        self.forward_steps += len(out.ids)
        return out

    def answer(self, choice: dict[str, Any], limit: int) -> Generation:
        """One completion choice as the turn's ids and log-probs (see the module doc)."""
        logprobs = choice.get("logprobs") or {}
        tokens = logprobs.get("tokens") or []
        if tokens and all(isinstance(t, str) and t.startswith(_TOKEN_ID) for t in tokens):
            ids = [int(t[len(_TOKEN_ID):]) for t in tokens]
            given = logprobs.get("token_logprobs") or []
            lps = [float(x) for x in given] if len(given) == len(ids) and None not in given else []
        else:
            ids = self.tokenizer.encode(choice.get("text") or "", add_special_tokens=False)
            # none: the text was tokenized here, so these are not the sampler's tokens (0.0 each said every token
            # was certain, and the agent loop recorded them as the sampler's)
            lps = []
        if choice.get("finish_reason") == "stop" and not set(ids[-1:]) & set(self.stop_token_ids):
            stop = self.end_of_turn_id if self.end_of_turn_id is not None else self.stop_token_ids[0]
            ids, lps = [*ids, stop], [*lps, 0.0] if lps else []
        return cut_at_stop(ids, self.stop_token_ids, limit + 1, lps)

    def load_weights(self, state_dict: Any) -> None:
        raise RuntimeError("an endpoint's model takes no weights: it evaluates (factory eval), it does not train")

    async def close(self) -> None:
        """The HTTP client's connections closed (the stage's close)."""
        if self._client is not None:
            client, self._client = self._client, None
            await client.aclose()
