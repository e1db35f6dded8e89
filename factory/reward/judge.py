"""LLM judges: an OpenAI-compatible endpoint, or a model Factory runs itself as its own Ray actor.

A judge node's requests -- from every `score` call of the reward actor, concurrent ones too -- go through
one session: `EndpointSession` sends them as concurrent HTTP requests (at most `concurrency` in flight,
failed ones retried with backoff); `LocalSession` gathers the requests waiting at a moment into batches of
up to `concurrency` prompts for the `JudgeModel` actor, whose engine generates each batch together. Either
way `reply(messages)` (from factory.data.sources.messages_from_text) returns the reply's text or raises `JudgeError` saying what
failed.
"""
from __future__ import annotations

import asyncio
import logging
from typing import Any

from factory.allocator import running_allocator
from factory.contract import Call, Contract, StageActor
from factory.endpoints import EndpointError, open_client, request
from factory.plan import JudgeSettings
from factory.schema import JudgeNode
from factory.types import Placement
from factory.util import TIMEOUTS, enter_workdir, node_id

log = logging.getLogger(__name__)


class JudgeError(RuntimeError):
    """A judge request that failed (after its retries): no reply to parse."""


class EndpointSession:
    """Chat completions from an OpenAI-compatible server (vLLM, SGLang, a hosted API), greedy.

    The API key, the retries and `Retry-After` as every endpoint request (factory.endpoints); `rpm` and `tpm`
    cap the requests and (estimated) tokens sent per minute (aiolimiter's leaky buckets)."""

    def __init__(self, node: JudgeNode):
        self.node = node
        self.url = (node.endpoint or "").rstrip("/") + "/chat/completions"

    async def __aenter__(self) -> EndpointSession:
        self._client, self.key_withheld = open_client(self.url, self.node.timeout_s)
        self._slots = asyncio.Semaphore(self.node.concurrency)
        self._rpm = self._tpm = None
        if self.node.rpm or self.node.tpm:
            from aiolimiter import AsyncLimiter

            # rpm as a bucket of one second's worth (at least one request): never more than rpm in any
            # minute, and no burst of a whole minute's requests at once
            period = max(1.0, 60.0 / self.node.rpm) if self.node.rpm else 1.0
            self._rpm = AsyncLimiter(self.node.rpm * period / 60.0, period) if self.node.rpm else None
            self._tpm = AsyncLimiter(self.node.tpm, 60) if self.node.tpm else None
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._client.aclose()

    async def reply(self, messages: list[dict[str, str]]) -> str:
        body: dict[str, Any] = {"temperature": 0.0, "max_tokens": self.node.max_tokens, "messages": messages}
        if self.node.model:  # unset: no name at all, which a server of one model answers (vLLM 404s "default")
            body["model"] = self.node.model
        async with self._slots:
            try:
                resp = await request(self._client, "POST", self.url, body=body, retries=self.node.retries,
                                     cap_s=self.node.timeout_s, key_withheld=self.key_withheld,
                                     before_each=lambda: self._within_limits(messages))
            except EndpointError as e:  # (named: a spec may hold several judges, and a down one is found here)
                raise JudgeError(f"{self.url}: {e}") from None
        return _content(resp)

    async def _within_limits(self, messages: list[dict[str, str]]) -> None:
        if self._rpm is not None:
            await self._rpm.acquire()
        if self._tpm is not None:
            # what the request may cost: its text at ~4 characters a token, and the whole reply budget
            cost = sum(len(str(m.get("content", ""))) for m in messages) / 4 + self.node.max_tokens
            await self._tpm.acquire(min(cost, self.node.tpm))


def _content(resp: Any) -> str:
    try:
        content = resp.json()["choices"][0]["message"]["content"]
    except (ValueError, KeyError, IndexError, TypeError, RecursionError) as e:
        raise JudgeError(f"not a chat completion: {type(e).__name__}: {resp.text[:200]}") from None
    if isinstance(content, list):  # content parts (the API's other form): their text, in order
        content = "".join(p.get("text") or "" for p in content if isinstance(p, dict) and p.get("type") == "text")
    if content is not None and not isinstance(content, str):
        raise JudgeError(f"not a chat completion: its message content is a {type(content).__name__}, not text: "
                         f"{resp.text[:200]}")
    return content or ""  # a reply without text (a refusal, a tool call) parses as nothing


class LocalSession:
    """Batches one judge node's prompts for its `JudgeModel` actor."""

    window_s = 0.005  # requests arriving this close together join one batch

    def __init__(self, node: JudgeNode, actor: Any):
        self.node, self.actor = node, actor
        self._pending: list[tuple[list[dict[str, str]], asyncio.Future]] = []
        self._sender: asyncio.Task | None = None

    async def __aenter__(self) -> LocalSession:
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._sender is not None:
            self._sender.cancel()

    async def reply(self, messages: list[dict[str, str]]) -> str:
        future = asyncio.get_running_loop().create_future()
        self._pending.append((messages, future))
        if self._sender is None or self._sender.done():
            self._sender = asyncio.create_task(self._send())
        return await future

    async def _send(self) -> None:
        seen = -1
        while len(self._pending) != seen:  # wait until requests stop arriving
            seen = len(self._pending)
            await asyncio.sleep(self.window_s)
        while self._pending:
            batch, self._pending = self._pending[: self.node.concurrency], self._pending[self.node.concurrency:]
            try:
                call = self.actor.complete.remote([p for p, _ in batch], self.node.max_tokens)
                replies = await asyncio.wait_for(call, self.node.timeout_s)
            except Exception as e:  # the actor died, timed out or raised: these requests failed
                if isinstance(e, TIMEOUTS):  # stop its work too: later batches would queue behind it
                    _cancel(call)
                error = _judge_error(e)
                for _, future in batch:
                    if not future.done():
                        future.set_exception(error)
                continue
            for (_, future), reply in zip(batch, replies):  # a prompt the judge refused fails only its request
                if not future.done():
                    if isinstance(reply, BaseException):
                        future.set_exception(reply)
                    else:
                        future.set_result(reply)


def _judge_error(e: BaseException) -> JudgeError:
    return JudgeError(f"local judge: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")


def _cancel(call: Any) -> None:
    """Cancel a Ray call that is no longer awaited (its actor's coroutine gets CancelledError); best effort."""
    import ray

    try:
        ray.cancel(call)
    except Exception as e:  # noqa: BLE001 -- already done, or its actor gone: nothing left to stop
        log.debug("cancelling a timed-out judge call: %r", e)


class JudgeModel(StageActor):
    """A judge model in its own Ray actor (with its own CPUs/GPUs): chat-formats each prompt's messages with
    the model's own chat template and answers greedily. The driver places it as a stage of its own; the
    reward stage calls it along the plan's call edge.

    The constructor has no side effects; `setup()` loads the model."""

    CONTRACT = Contract(calls={"complete": Call("one")})

    def __init__(self, settings: JudgeSettings):
        self.settings = settings
        self.cfg, self.seed = settings.judge, settings.seed
        self.engine: Any = None  # setup's

    async def setup(self, placement: Placement | None = None) -> dict[str, Any]:
        from transformers import AutoTokenizer

        from factory.assets import resolve_model
        from factory.rollout.chat import ChatFormat

        enter_workdir((placement or Placement()).workdir)
        path = resolve_model(self.cfg.path)
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.chat = ChatFormat(self.tokenizer)
        from factory.device import resolve_dtype
        from factory.rollout.engine import gpu_share, make_engine

        s = self.settings
        device, dtype = s.compute.device, resolve_dtype(s.compute)
        self.engine = make_engine(s.engine, path, device=device, dtype=dtype, seed=self.seed,
                                  stop_token_ids=self.chat.stop_token_ids, gpu_share=gpu_share(s.judge.num_gpus))
        return {"node": node_id(), "model": path,
                "resolved": {"engine": self.engine.name, "device": device, "dtype": dtype,
                             "allocator": running_allocator()}}

    async def complete(self, prompts: list[list[dict[str, str]]], max_tokens: int) -> list[str | JudgeError]:
        """Each prompt's reply, or the JudgeError of a prompt the template or engine refused (one past the
        model's context): that prompt fails alone, not every prompt batched with it."""
        from factory.rollout.engine import Sampling

        greedy = Sampling(greedy=True)

        async def one(messages: list[dict[str, str]]) -> str | JudgeError:
            try:
                ids = self.chat.prompt_ids(messages, None)
                gen = await self.engine.generate(ids, max_new_tokens=max_tokens, sampling=greedy)
                return self.tokenizer.decode(gen.ids, skip_special_tokens=True)
            except Exception as e:  # noqa: BLE001 -- its own request's error, returned for its caller
                return _judge_error(e)

        # All at once: the engine batches concurrent requests into one generate call.
        return list(await asyncio.gather(*(one(m) for m in prompts)))

    async def close(self) -> None:
        """The engine's close: vLLM's removes its rendezvous file (/tmp/vllm_dist_*), left behind otherwise
        (teardown then kills the actor: no destructor runs). Every engine's close may run twice."""
        if self.engine is not None:
            await self.engine.close()
