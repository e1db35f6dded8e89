"""Requests to an OpenAI-compatible server (vLLM, SGLang, a hosted API), for everything that calls one: an
LLM judge (factory.reward.judge) and the endpoint engine of `factory eval --model URL`
(factory.rollout.engine_endpoint).

`OPENAI_API_KEY` goes only where nobody between can read it: an https endpoint, or one on this machine's
loopback (factory.util.key_may_go_to). A request that fails for a reason that may pass (HTTP 429, a 5xx, a
transport error, a body that does not decode) is retried with backoff; a 429 or 503 that says when to come back
(`Retry-After`) is retried then, not sooner. Any other 4xx is our request's fault: retrying cannot help.
"""
from __future__ import annotations

import asyncio
import math
import os
from collections.abc import Awaitable, Callable
from typing import Any

from factory.util import TIMEOUTS, key_may_go_to


class EndpointError(RuntimeError):
    """A request that failed after its retries, saying why (`HTTP 503: ...`, `ConnectError: ...`)."""


class _Retryable(Exception):
    pass


def open_client(url: str, timeout_s: float) -> tuple[Any, bool]:
    """An httpx2 client for `url` carrying `OPENAI_API_KEY` where it may go, and whether a key was set but
    withheld (a 401 or 403 then says so)."""
    import httpx2

    key = os.environ.get("OPENAI_API_KEY")
    withheld = bool(key) and not key_may_go_to(url)
    headers = {"Authorization": f"Bearer {key}"} if key and not withheld else {}
    return httpx2.AsyncClient(timeout=timeout_s, headers=headers), withheld


async def request(client: Any, method: str, url: str, *, body: dict[str, Any] | None = None, retries: int,
                  cap_s: float, key_withheld: bool = False,
                  before_each: Callable[[], Awaitable[None]] | None = None) -> Any:
    """The response to `method url` (with `body` as JSON), retried up to `retries` times as the module doc
    says, waiting 0.25 s, 0.5 s, 1 s... or what `Retry-After` asks (each at most `cap_s`); `before_each` is awaited
    before every attempt (a rate limit). Raises EndpointError."""
    import httpx2

    for attempt in range(retries + 1):
        if before_each is not None:
            await before_each()
        # at most cap_s: uncapped, `retries: 14` slept 2048 s before its last try, holding the caller's slot
        # (a judge node's) far past any deadline that counts on timeout_s. The doubling stops at 2**1000 s, past
        # any cap: `retries` has no bound, and 2**1024 is past a float's range (OverflowError, no EndpointError).
        wait = min(0.25 * 2 ** min(attempt, 1000), cap_s)
        try:
            # the client's timeout bounds each read, not the request: a server that trickles its body, a byte
            # within each read's limit, was read for ever (and the reward stage with it)
            resp = await asyncio.wait_for(client.request(method, url, json=body), cap_s)
            if resp.status_code == 429 or resp.status_code >= 500:
                asked = retry_after(resp.headers.get("retry-after"), cap_s)
                wait = wait if asked is None else asked
                raise _Retryable(f"HTTP {resp.status_code}: {resp.text[:200]}")
            if resp.status_code >= 400:  # our request is wrong: retrying cannot help
                hint = (" (OPENAI_API_KEY is set but sent only to https or loopback endpoints)"
                        if resp.status_code in (401, 403) and key_withheld else "")
                raise EndpointError(f"HTTP {resp.status_code}: {resp.text[:200]}{hint}")
            return resp
        # RequestError, not only TransportError: a body marked gzip that is not (DecodingError) or a redirect loop
        # escaped as it was, not an EndpointError (a judge's then no JudgeError, and health missed the cause)
        except (_Retryable, httpx2.RequestError, *TIMEOUTS) as e:
            error = (f"no whole response within {cap_s:g} s" if isinstance(e, TIMEOUTS) else
                     f"{type(e).__name__}: {e}" if isinstance(e, httpx2.RequestError) else str(e))
            if attempt == retries:
                raise EndpointError(error) from None
            await asyncio.sleep(wait)
    raise AssertionError("unreachable")


def retry_after(value: str | None, cap_s: float) -> float | None:
    """Seconds a `Retry-After` header asks to wait (a number of seconds or an HTTP date), at most
    `cap_s`; None when absent or unreadable, as is a count of seconds that is not finite or is negative."""
    if not value:
        return None
    try:
        seconds = float(value)
    except ValueError:
        from email.utils import parsedate_to_datetime

        try:
            when = parsedate_to_datetime(value)
        except (TypeError, ValueError, OverflowError):  # Overflow: a year past what a C int holds
            return None
        import datetime

        if when.tzinfo is None:  # "-0000" (RFC 5322's "no zone said"): HTTP dates are in GMT
            when = when.replace(tzinfo=datetime.timezone.utc)
        seconds = (when - datetime.datetime.now(datetime.timezone.utc)).total_seconds()
    else:
        # "nan" passed min() and max() as nan, and asyncio.sleep(nan) held the request (and its node's
        # semaphore) far past timeout_s; a negative count is no wait either (a past date is: retry now)
        if not math.isfinite(seconds) or seconds < 0:
            return None
    return min(max(seconds, 0.0), cap_s)


JUDGE_PROBE_S = 10.0  # an endpoint that has not answered `GET /models` by then is reported


async def why_unreachable(url: str) -> str | None:
    """Why `url` (an OpenAI-compatible base) does not answer, or None when it answers at all: any HTTP
    status, a 404 or a 401 too, means a server is there (the run's requests say the rest)."""
    client, _ = open_client(url, JUDGE_PROBE_S)
    try:
        async with client:
            await client.get(url.rstrip("/") + "/models")
    except Exception as e:  # noqa: BLE001 -- whatever the transport raised is the answer
        return f"{type(e).__name__}: {e}"[:200] if str(e) else type(e).__name__
    return None


def judge_unanswered(url: str, why: str) -> str:
    """What `factory check --connect` and the reward stage's start say of a judge endpoint that did not answer."""
    return (f"no answer from {url} within {JUDGE_PROBE_S:.0f} s ({why}): is the judge's server up, and the URL its "
            "OpenAI-compatible base (ending in /v1)?")
