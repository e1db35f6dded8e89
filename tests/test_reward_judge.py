"""LLM judges: an OpenAI-compatible server started here on 127.0.0.1, and a local model as its own Ray actor."""
from __future__ import annotations

import asyncio
import datetime
import json
import sys
import urllib.request
from pathlib import Path

import pytest

from factory.compiler.compile import stage_settings
from factory.reward import RewardStage
from factory.types import Placement
from tests.servers import free_port, http_server
from tests.test_reward_stage import make_spec, traj

REPO = Path(__file__).resolve().parents[1]
FNS = "tests.fixtures.reward_fns"


@pytest.fixture
def judge_server():
    port = free_port()
    with http_server([sys.executable, "-m", "tests.judge_server", str(port)], port, cwd=REPO):
        yield f"http://127.0.0.1:{port}/v1", lambda: json.load(urllib.request.urlopen(f"http://127.0.0.1:{port}/stats"))


def _score(spec, trajs, base_dir, peers=None):
    stage = RewardStage(stage_settings(spec, base_dir)["reward"])

    async def go():
        await stage.setup(Placement(peers=peers or {}))
        try:
            return await stage.score(trajs)
        finally:
            await stage.close()

    return asyncio.run(go())


def test_endpoint_judge_behind_a_gate_counts_every_failure(judge_server, tmp_path):
    url, stats = judge_server
    (tmp_path / "judge.jinja").write_text("Grade this answer to '{{ prompt }}' (truth {{ answer }}): {{ completion }}")
    spec = make_spec({
        "fmt": {"fn": f"{FNS}:starts_with_ok"},
        "judge": {"llm_judge": "judge.jinja", "endpoint": url, "model": "grader", "concurrency": 2, "retries": 1,
                  "max_tokens": 32},
        "graded": {"llm_judge": "judge.jinja", "endpoint": url, "json_field": "score", "concurrency": 2},
        "total": {"gate": "fmt", "then": "judge"},
    })
    completions = ["ok [good]", "ok [bad]", "ok [garble]", "ok [fail]", "ok [flaky]", "no [good]", "ok [json]"]
    trajs, m = _score(spec, [traj(c, i) for i, c in enumerate(completions)], tmp_path)
    judge = [t.rewards["judge"] for t in trajs]
    # good 1; bad 0; garble: no score -> 0 (on_missing zero); fail: HTTP 500 twice -> 0; flaky: 503 then
    # retried -> 1; "no ...": fmt fails, the judge is never asked; json: no "Score:" -> 0
    assert judge == [1.0, 0.0, 0.0, 0.0, 1.0, None, 0.0]
    assert [t.reward for t in trajs] == [1.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0]
    assert trajs[2].reward_details["judge"] == {"status": "parse_failure", "reply": "I refuse to grade this.",
                                                "error": "the reply does not match `parse`"}
    assert trajs[3].reward_details["judge"] == {"status": "error",
                                                "error": f'JudgeError: {url}/chat/completions: HTTP 500: '
                                                         '{"error": "judge down"}'}
    assert trajs[0].reward_details["judge"] == {"status": "ok", "reply": "The answer is right.\nScore: 1"}
    assert trajs[5].reward_details["judge"] == {"status": "skipped"}
    assert (m["rewards/judge/calls"], m["rewards/judge/errors"], m["rewards/judge/parse_failures"],
            m["rewards/judge/missing"], m["rewards/judge/skipped"]) == (6.0, 1.0, 2.0, 3.0, 1.0)
    # the ungated JSON judge reads `score` from the one reply that has JSON; the others fail to parse
    assert trajs[6].rewards["graded"] == 0.5 and m["rewards/graded/parse_failures"] == 5.0
    seen = stats()
    # the gated judge: 6 trajectories + 1 retry of [fail] + 1 retry of [flaky]; the JSON judge: 7 + 2 retries
    assert seen["by_marker"] == {"good": 3, "bad": 2, "garble": 2, "fail": 4, "flaky": 3, "json": 2}
    assert 2 <= seen["peak"] <= 4  # two judge nodes, each with at most `concurrency: 2` requests in flight
    body = next(b for b in seen["bodies"] if b.get("model") == "grader")
    assert body == {"model": "grader", "temperature": 0.0, "max_tokens": 32}
    # the JSON judge names no model: the body has none (not "default", which vLLM answers 404)
    assert {"temperature": 0.0, "max_tokens": 256} in seen["bodies"]


def test_a_judge_nodes_concurrency_bounds_concurrent_score_calls(judge_server, tmp_path):
    """A step's trajectories (or groups) are scored as they complete, several `score` calls at once: the
    node's one session (for the actor's life) keeps its `concurrency` over all of them, not per call."""
    url, stats = judge_server
    (tmp_path / "judge.jinja").write_text("{{ completion }}")
    stage = RewardStage(stage_settings(make_spec({"judge": {"llm_judge": "judge.jinja", "endpoint": url,
                                                            "concurrency": 2}}), tmp_path)["reward"])

    async def go():
        await stage.setup(Placement())
        try:  # 4 groups of 3 at once
            return await asyncio.gather(*(stage.score([traj("ok [good]", g, s) for s in range(3)]) for g in range(4)))
        finally:
            await stage.close()

    answers = asyncio.run(go())
    assert [t.reward for trajs, _ in answers for t in trajs] == [1.0] * 12
    assert stats()["peak"] == 2  # 12 requests of 4 calls, never more than 2 in flight (per-call sessions: 8)


def test_a_judge_template_may_render_chat_messages(judge_server, tmp_path):
    """A template that renders a JSON message list is sent as those messages (worked cases as real turns);
    one that renders broken JSON is an error of that trajectory's judge call, never sent."""
    url, stats = judge_server
    (tmp_path / "judge.jinja").write_text(
        '[{"role": "system", "content": "Grade."}, {"role": "user", "content": "x [bad]"},'
        ' {"role": "assistant", "content": "Score: 0"}, {"role": "user", "content": {{ completion | tojson }}}]')
    (tmp_path / "broken.jinja").write_text('[{"role": "user", "content": {{ completion }}}]')  # no tojson
    (tmp_path / "null.jinja").write_text("Gold: {{ answer }}\n{{ completion }}")  # the judge read "Gold: None"
    spec = make_spec({"judge": {"llm_judge": "judge.jinja", "endpoint": url},
                      "broken": {"llm_judge": "broken.jinja", "endpoint": url},
                      "null": {"llm_judge": "null.jinja", "endpoint": url},
                      "total": {"sum": {"judge": 1.0, "broken": 1.0, "null": 1.0}}})
    trajs, m = _score(spec, [traj("ok [good]", 0), traj("ok [bad]", 1, answer=None)], tmp_path)
    assert trajs[1].reward_details["null"]["error"].startswith("judge template: NullValueError: printed a null")
    assert m["rewards/null/errors"] == 1.0
    assert [t.rewards["judge"] for t in trajs] == [1.0, 0.0]  # the marker of the LAST message decides
    assert sorted(stats()["roles"]) == [["system", "user", "assistant", "user"]] * 2 + [["user"]]
    assert m["rewards/broken/errors"] == 2.0 and stats()["requests"] == 3
    assert trajs[0].reward_details["broken"]["error"].startswith("judge template: ValueError: rendered invalid JSON")
    # `/calls` counts the requests sent: the two templates that did not render sent none (it said 2 and 2)
    assert (m["rewards/judge/calls"], m["rewards/broken/calls"], m["rewards/null/calls"]) == (2.0, 0.0, 1.0)
    assert trajs[0].reward_details["broken"]["sent"] is False


def test_judge_messages_reads_a_message_list_or_wraps_text():
    from factory.data.sources import messages_from_text as judge_messages  # the one text-or-messages rule

    assert judge_messages("Grade: 4") == [{"role": "user", "content": "Grade: 4"}]
    assert judge_messages(' [{"role": "user", "content": "hi"}]') == [{"role": "user", "content": "hi"}]
    with pytest.raises(ValueError, match="role must be one of"):
        judge_messages('[{"role": "judge", "content": "hi"}]')


def test_a_judge_reply_is_read_as_written_after_its_reasoning():
    """The default `parse` took the full stop after "Score: 1." and refused the reply (0 under on_missing:
    zero); a thinking judge's draft verdict was read before its last word, and a reply cut off while
    thinking as a verdict; `json_field` took the first `{` to the last `}`, so a reply with two objects, or
    braces in its prose, held none."""
    from factory.reward.graph import parse_score
    from factory.schema import JudgeNode

    node = JudgeNode(llm_judge="j.jinja", endpoint="http://127.0.0.1:1/v1")
    assert [parse_score(r, node) for r in ("Score: 1.", "score: 0.8.", "Score = 1.0.", "score: -1", "Score: .5")] == [
        1.0, 0.8, 1.0, -1.0, 0.5]
    # markdown bold, as chat models write a verdict (each was a parse failure)
    assert [parse_score(r, node) for r in ("Right.\n**Score:** 1", "**Score**: 0", "__score__ = .5")] == [1.0, 0.0, 0.5]
    strict = JudgeNode(llm_judge="j.jinja", endpoint="http://127.0.0.1:1/v1", parse=r"score\s*:\s*([01])")
    assert parse_score("<think>I would write score: 1, but Lyon is not Paris.</think> score: 0", strict) == 0.0
    with pytest.raises(ValueError, match="does not match"):
        parse_score("<think>score: 1, but let me che", strict)  # cut off while thinking: no verdict
    with pytest.raises(ValueError, match="does not match"):  # the same after a closed block
        parse_score("<think>ok</think> <think>score: 1, but let me che", strict)
    # a `<think>` the judge quotes after its own words opens nothing (it dropped the rest, the verdict too)
    assert parse_score("The answer wraps it in <think> tags, score: 1", strict) == 1.0
    fielded = JudgeNode(llm_judge="j.jinja", endpoint="http://127.0.0.1:1/v1", json_field="score")
    assert parse_score('ok {"note": "x"} then {"score": 1} and {"score": 0}', fielded) == 1.0
    assert parse_score('a set {1, 2} in prose, then {"score": ".5"}', fielded) == 0.5
    assert parse_score('<think>fine</think>{"reason": "it wrote <think> tags", "score": 1}', fielded) == 1.0
    with pytest.raises(ValueError, match="has no field 'score'"):
        parse_score('{"note": 1}', fielded)
    # an integer past Python's 4300 digits raised ValueError out of the reader: the object after it went unread
    assert parse_score('{"note": ' + "9" * 5000 + '} then {"score": 1}', fielded) == 1.0
    with pytest.raises(ValueError, match="no JSON object"):
        parse_score("{not json}", fielded)


def test_a_judge_score_is_a_whole_number_and_reasoning_closed_after_the_words_stays_out():
    """A field's string must be a number as a whole: "7/10" or "1 (of 5)" is not the score 7 or 1 on the
    node's scale but a parse failure. A `<think>` block closed after the judge's words is reasoning (only one
    left open is a quoted marker): a verdict drafted inside it is not read. Objects are read from the top
    level: one nested in an object without the field is not the reply's verdict."""
    from factory.reward.graph import parse_score
    from factory.schema import JudgeNode

    fielded = JudgeNode(llm_judge="j.jinja", endpoint="http://127.0.0.1:1/v1", json_field="score")
    for reply in ('{"score": "7/10"}', '{"score": "1 (of 5)"}'):
        with pytest.raises(ValueError, match="not a number"):
            parse_score(reply, fielded)
    assert parse_score('{"draft": {"score": 1}} final: {"score": 0}', fielded) == 0.0
    strict = JudgeNode(llm_judge="j.jinja", endpoint="http://127.0.0.1:1/v1", parse=r"score\s*:\s*([01])")
    with pytest.raises(ValueError, match="does not match"):
        parse_score("No verdict yet. <think>score: 1</think>", strict)


def test_the_default_parse_reads_a_whole_number_or_none():
    """The default `parse` read the start of a number: "Score: 8/10" scored 8 (on a node's 0-1 scale),
    "score: 1e-3" 1.0, and "score: 1e39" 1.0 where a number too large for float32 has no value."""
    from factory.reward.graph import parse_score
    from factory.reward.stage import usable
    from factory.schema import JudgeNode

    node = JudgeNode(llm_judge="j.jinja", endpoint="http://127.0.0.1:1/v1")
    assert [parse_score(r, node) for r in ("score: 1e-3", "Score: 0.5E1.", "score: -2.5e+0", "__Score: 1__")] == [
        0.001, 5.0, -2.5, 1.0]
    assert parse_score("score: 1e39", node) == 1e39 and not usable(1e39)  # the stage's non_finite
    for reply in ("Score: 8/10", "score: 80%", "score: 7a", "score: 1.2.3", "score: 3e"):
        with pytest.raises(ValueError, match="does not match"):
            parse_score(reply, node)
    # a later verdict written whole is still read
    assert parse_score("Score: 8/10 on their scale; on ours, score: 0.8", node) == 0.8


def test_unreachable_endpoint_is_an_error_per_request_that_names_its_url(tmp_path):
    """(The error said `ConnectError: All connection attempts failed`, not which endpoint.)"""
    (tmp_path / "judge.jinja").write_text("{{ completion }}")
    url = f"http://127.0.0.1:{free_port()}/v1"
    spec = make_spec({"judge": {"llm_judge": "judge.jinja", "endpoint": url, "retries": 0,
                                "on_missing": "drop_sample"}})
    trajs, m = _score(spec, [traj("a", 0), traj("b", 1)], tmp_path)
    assert m["rewards/judge/errors"] == 2.0 and m["reward/dropped"] == 2.0
    said = f"JudgeError: {url}/chat/completions: ConnectError"
    assert all(t.reward_details["judge"]["error"].startswith(said) for t in trajs)
    assert all(t.dropped.startswith(f"rewards.judge: error: {said}") for t in trajs)


def test_a_judge_endpoint_that_does_not_answer_is_said_when_the_stage_starts(judge_server, tmp_path, caplog):
    """A judge that was down was found only once scoring began, one error per trajectory (`factory run` and
    `rescore` do not probe as `check --connect` does): the stage says so at its start, and goes on."""
    import time

    url, _ = judge_server
    down = f"http://127.0.0.1:{free_port()}/v1"
    (tmp_path / "judge.jinja").write_text("{{ completion }}")
    spec = make_spec({"up": {"llm_judge": "judge.jinja", "endpoint": url},
                      "down": {"llm_judge": "judge.jinja", "endpoint": down, "on_missing": "drop_sample"},
                      "total": {"sum": {"up": 1.0, "down": 1.0}}})
    stage = RewardStage(stage_settings(spec, tmp_path)["reward"])

    async def go():
        started = time.perf_counter()
        await stage.setup(Placement())
        took = time.perf_counter() - started
        await stage.close()
        return took

    took = asyncio.run(go())
    said = [r.getMessage() for r in caplog.records if "no answer from" in r.getMessage()]
    assert len(said) == 1 and said[0].startswith(f"reward node down: no answer from {down} within 10 s (ConnectError")
    assert said[0].endswith("Until it answers, each of its requests fails and has no value (on_missing: drop_sample)")
    assert took < 2.0  # an up server answers at once, a closed port refuses at once


def test_local_judge_model_runs_as_its_own_ray_actor(tmp_path, local_ray):
    """A tiny model cannot really grade; the point is the plumbing: each prompt goes through the judge
    model's chat template to its own Ray actor, the greedy reply comes back raw with its trajectory, and
    what does not parse is counted."""
    import ray
    from transformers import AutoTokenizer

    from factory.assets import resolve_model
    from factory.reward.graph import parse_score
    from factory.rollout.chat import ChatFormat
    from factory.rollout.engine import Sampling
    from factory.rollout.engine_hf import HFEngine

    template = "What is {{ completion }}? The expected answer is {{ answer }}. Use the calculator."
    (tmp_path / "judge.jinja").write_text(template)
    # float32 like the engine built below (auto would pick bf16 on a bf16-capable CPU)
    judge = {"path": "factory:tiny-qwen3-calc", "dtype": "float32"}
    spec = make_spec({"judge": {"llm_judge": "judge.jinja", "local": judge, "parse": r"(\d+)", "max_tokens": 24,
                                "concurrency": 1}})
    trajs = [traj("2 + 3", 0, answer="5"), traj("100 - 1", 1, answer="99"), traj("hello", 2, answer="world"),
             traj("What is the capital of France", 3, answer="Paris")]
    # the plan's judge.judge stage, placed as the driver places it, then called along its call edge
    from factory.reward.judge import JudgeModel

    settings = stage_settings(spec, tmp_path)
    judge = ray.remote(JudgeModel).options(num_cpus=0).remote(settings["judge.judge"])
    try:
        info = ray.get(judge.setup.remote())
        # what the run's params record for the stage (resolved.judge.judge.*); placed here without the plan's
        # environment, its process runs the allocator this one does (Ray's workers inherit it)
        from factory.allocator import running_allocator

        assert info["resolved"] == {"engine": "hf", "device": "cpu", "dtype": "float32",
                                    "allocator": running_allocator()}
        trajs, m = _score(spec, trajs, tmp_path, {settings["reward"].judge_peers["judge"]: judge})  # by its role
    finally:
        ray.kill(judge)
    # The same prompts, greedily, through the same engine in this process.
    path = resolve_model("factory:tiny-qwen3-calc")
    tokenizer = AutoTokenizer.from_pretrained(path)
    chat = ChatFormat(tokenizer)
    engine = HFEngine(path, stop_token_ids=chat.stop_token_ids)
    prompts = [template.replace("{{ completion }}", t.completion).replace("{{ answer }}", t.row["answer"])
               for t in trajs]

    async def replies():  # one at a time, as `concurrency: 1` sends them (padding never differs)
        gens = [await engine.generate(chat.prompt_ids([{"role": "user", "content": p}], None), max_new_tokens=24,
                                      sampling=Sampling(greedy=True)) for p in prompts]
        return [tokenizer.decode(g.ids, skip_special_tokens=True) for g in gens]

    expected = asyncio.run(replies())
    assert len(set(expected)) >= 2  # different replies: trajectories' replies cannot be swapped unnoticed
    assert [t.reward_details["judge"]["reply"] for t in trajs] == expected
    node = spec.rewards["judge"]
    for t, reply in zip(trajs, expected):
        try:
            assert t.rewards["judge"] == parse_score(reply, node)
        except ValueError:  # no digits in the reply: a counted parse failure, 0 by on_missing: zero
            assert t.rewards["judge"] == 0.0 and t.reward_details["judge"]["status"] == "parse_failure"
    assert m["rewards/judge/calls"] == 4.0 and m["rewards/judge/errors"] == 0.0
    assert m["rewards/judge/parse_failures"] == float(
        sum(t.reward_details["judge"]["status"] == "parse_failure" for t in trajs))


def test_a_local_judge_models_close_closes_its_engine(tmp_path, monkeypatch):
    """JudgeModel had no close of its own: its engine was never closed, and a vLLM judge left its rendezvous
    file (/tmp/vllm_dist_*) behind every run. Its close is safe before setup and twice, as every stage's."""
    from factory.reward.judge import JudgeModel
    from factory.rollout import engine as engines

    closes = []

    class Engine:
        name = "fake"

        async def close(self):
            closes.append(1)

    monkeypatch.setattr(engines, "make_engine", lambda *a, **k: Engine())
    monkeypatch.chdir(tmp_path)  # (setup enters its workdir, as a stage process does: put back after the test)
    (tmp_path / "judge.jinja").write_text("Is {{ completion }} right? Score: ")
    spec = make_spec({"judge": {"llm_judge": "judge.jinja", "parse": r"(\d+)",
                                "local": {"path": "factory:tiny-qwen3-calc"}}})
    judge = JudgeModel(stage_settings(spec, tmp_path)["judge.judge"])

    async def go():
        await judge.close()  # before setup: nothing to close
        await judge.setup(Placement(workdir=str(tmp_path)))
        await judge.close()

    asyncio.run(go())
    assert closes == [1]


def test_a_judge_waits_as_retry_after_asks_and_keeps_to_its_rpm(judge_server, tmp_path):
    """A 429 with `Retry-After: 1` is retried a second later, not after the 0.25 s backoff; `rpm: 120` sends
    6 requests at no more than 2 a second (a bucket of one second's worth: two at once, then one per 0.5 s)."""
    url, stats = judge_server
    (tmp_path / "judge.jinja").write_text("{{ completion }}")
    spec = make_spec({"judge": {"llm_judge": "judge.jinja", "endpoint": url, "retries": 1}})
    trajs, m = _score(spec, [traj("ok [limited]", 0)], tmp_path)
    assert trajs[0].rewards["judge"] == 1.0 and m["rewards/judge/errors"] == 0.0
    first, second = stats()["times"]["limited"]
    assert second - first >= 0.95, (first, second)  # as asked; before: 0.25 s later

    spec = make_spec({"judge": {"llm_judge": "judge.jinja", "endpoint": url, "rpm": 120, "concurrency": 8}})
    trajs, m = _score(spec, [traj("ok [good]", i) for i in range(6)], tmp_path)
    assert [t.reward for t in trajs] == [1.0] * 6
    times = stats()["times"]["good"]
    # paced 0, 0, 0.5, 1.0, 1.5, 2.0 s; without rpm all 6 arrive within 0.1 s. Measured at the server, a stall of the
    # scoring process after the first sends (a loaded 2-core CI machine: the first 4 arrived together, 1.0 s late)
    # can only bunch the early ones later, so the bound leaves a second for it
    assert len(times) == 6 and max(times) - min(times) >= 0.9, times


def test_the_api_key_goes_only_to_https_or_loopback(monkeypatch):
    from factory.util import key_may_go_to

    assert key_may_go_to("https://api.example.com/v1/chat/completions")
    assert key_may_go_to("http://127.0.0.1:8000/v1/chat/completions")
    assert key_may_go_to("http://[::1]:8000/v1/chat/completions") and key_may_go_to("http://localhost/v1")
    assert not key_may_go_to("http://judge.internal:8000/v1/chat/completions")
    assert not key_may_go_to("http://10.0.0.5/v1")


def test_retry_after_is_seconds_or_a_date_within_the_cap_and_what_is_no_wait_is_ignored():
    from email.utils import format_datetime

    from factory.endpoints import retry_after

    assert retry_after("3", 60) == 3.0 and retry_after("600", 60) == 60 and retry_after(None, 60) is None
    assert retry_after("Wed, 21 Oct 2015 07:28:00 GMT", 60) == 0.0 and retry_after("soon", 60) is None
    # a date with no zone said ("-0000") was a naive datetime, and the subtraction raised out of the retry loop
    assert retry_after("Wed, 21 Oct 2015 07:28:00 -0000", 60) == 0.0
    later = format_datetime(datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(seconds=30))
    assert 25 <= retry_after(later, 60) <= 30
    assert retry_after("Fri, 31 Dec 9999 23:59:59 GMT", 60) == 60
    # "nan" was nan (min and max pass it through), and asyncio.sleep(nan) held the request, and the node's
    # semaphore, far past timeout_s; an infinite or negative count of seconds is no wait a server can ask for
    for bad in ("nan", "NaN", "inf", "-inf", "Infinity", "1e400", "-1", "-0.5"):
        assert retry_after(bad, 60) is None, bad
    assert retry_after("0", 60) == 0.0 and retry_after("1.5", 60) == 1.5
    # a year past datetime's raised OverflowError (not ValueError) out of the retry loop
    assert retry_after("1 Jan 9999999999 00:00 GMT", 60) is None


def test_a_reply_that_does_not_decode_is_a_judge_failure_and_an_unreadable_retry_after_is_retried(judge_server,
                                                                                                  tmp_path):
    """A body marked gzip that is not (httpx2's DecodingError, a RequestError but no TransportError) and a 503
    whose Retry-After date overflowed escaped the request as they were: no retry, and not a JudgeError, so
    health's infra causes missed them."""
    url, stats = judge_server
    (tmp_path / "judge.jinja").write_text("{{ completion }}")
    spec = make_spec({"judge": {"llm_judge": "judge.jinja", "endpoint": url, "retries": 1}})
    trajs, m = _score(spec, [traj("ok [gzip]", 0), traj("ok [farday]", 1)], tmp_path)
    assert trajs[0].reward_details["judge"]["error"].startswith(f"JudgeError: {url}/chat/completions: DecodingError")
    assert trajs[1].rewards["judge"] == 1.0 and m["rewards/judge/errors"] == 1.0
    assert stats()["by_marker"] == {"gzip": 2, "farday": 2}  # each retried once


def _backoff(monkeypatch, retries: int, cap_s: float) -> list[float]:
    """The waits of `endpoints.request` between tries of a server that answers every request 500, to its end in
    the EndpointError."""
    from types import SimpleNamespace

    from factory import endpoints

    waits = []

    async def sleep(s):
        waits.append(s)

    class Failing:
        async def request(self, method, url, json=None):
            return SimpleNamespace(status_code=500, headers={}, text="down")

    monkeypatch.setattr(endpoints.asyncio, "sleep", sleep)
    with pytest.raises(endpoints.EndpointError, match="^HTTP 500: down$"):
        asyncio.run(endpoints.request(Failing(), "POST", "http://127.0.0.1:1/v1", body={}, retries=retries,
                                      cap_s=cap_s))
    return waits


def test_the_backoff_between_retries_waits_at_most_timeout_s(monkeypatch):
    """`retries: 14` slept 0.25 s, 0.5 s, ... 2048 s (over an hour in all for a 60 s timeout), holding the judge
    node's slot until the reward stage's deadline called the step hung. And `retries` has no upper bound: at
    attempt 1024, 0.25 * 2**attempt overflowed a float before its cap, an OverflowError in place of the
    EndpointError."""
    assert _backoff(monkeypatch, 14, 60) == [0.25, 0.5, 1, 2, 4, 8, 16, 32] + [60] * 6
    waits = _backoff(monkeypatch, 1100, 60)
    assert len(waits) == 1100 and waits[-300:] == [60] * 300


def test_the_api_key_is_withheld_from_a_plain_http_endpoint_elsewhere(monkeypatch, tmp_path):
    """Sent over http to a non-loopback host, the key would cross the network in clear text. The request
    goes to a host that does not resolve: what matters is the header the session built."""
    import asyncio as aio

    from factory.reward.judge import EndpointSession
    from factory.schema import JudgeNode

    monkeypatch.setenv("OPENAI_API_KEY", "sk-test")

    async def headers(endpoint: str) -> dict:
        async with EndpointSession(JudgeNode(llm_judge="j.jinja", endpoint=endpoint)) as s:
            return dict(s._client.headers)

    assert aio.run(headers("http://judge.internal:8000/v1")).get("authorization") is None
    assert aio.run(headers("https://judge.internal/v1"))["authorization"] == "Bearer sk-test"
    assert aio.run(headers("http://127.0.0.1:8000/v1"))["authorization"] == "Bearer sk-test"


def test_a_judge_that_replies_nan_or_infinity_gives_no_value(judge_server, tmp_path):
    """Python's json reads `NaN` and `Infinity`: such a score was taken as it came."""
    url, _ = judge_server
    (tmp_path / "judge.jinja").write_text("{{ completion }}")
    spec = make_spec({"judge": {"llm_judge": "judge.jinja", "endpoint": url, "json_field": "score"}})
    trajs, m = _score(spec, [traj("ok [nan]", 0), traj("ok [inf]", 1), traj("ok [json]", 2)], tmp_path)
    assert [t.reward for t in trajs] == [0.0, 0.0, 0.5]
    assert trajs[0].reward_details["judge"] == {"status": "non_finite", "reply": '{"score": NaN}',
                                                "error": "the value is not finite: nan"}
    assert m["rewards/judge/non_finite"] == 2.0 and m["rewards/judge/missing"] == 2.0


def test_a_hostile_judge_reply_is_a_failure_of_its_node_not_of_the_run(judge_server, tmp_path):
    """A score of 400 digits (OverflowError), content parts or a number for content (TypeError), a reply nested
    past the JSON parser's depth (RecursionError) escaped `score` and ended the run, at the same step again on
    --resume; a body trickled a byte at a time, each read within httpx's timeout, was read for ever."""
    url, _ = judge_server
    (tmp_path / "judge.jinja").write_text("{{ completion }}")
    spec = make_spec({"judge": {"llm_judge": "judge.jinja", "endpoint": url, "json_field": "score", "timeout_s": 1.0,
                                "retries": 0}})
    markers = ["huge", "parts", "number", "deep", "trickle"]
    trajs, _ = _score(spec, [traj(f"ok [{m}]", i) for i, m in enumerate(markers)], tmp_path)
    got = {m: t.reward_details["judge"] for m, t in zip(markers, trajs)}
    assert got["huge"]["status"] == "non_finite" and got["huge"]["error"] == "the value is not finite: inf"
    assert got["parts"]["status"] == "ok" and trajs[1].rewards["judge"] == 1.0  # the parts' text, joined
    assert got["number"]["status"] == "error" and "its message content is a int, not text" in got["number"]["error"]
    assert got["deep"] == {"status": "parse_failure", "reply": got["deep"]["reply"], "error": "no JSON object in the reply"}
    assert got["trickle"]["status"] == "error" and "no whole response within 1 s" in got["trickle"]["error"]


def test_one_prompt_the_local_judge_refuses_fails_only_its_own_request():
    """The engine refuses one prompt (past the model's context, a template that rejects its row): every prompt
    batched with it failed too, and under on_missing: zero each trained as 0."""
    import types

    from factory.reward.judge import JudgeError, JudgeModel, LocalSession

    class Engine:  # as engine_vllm fails one request whose prompt is past the model's context
        async def generate(self, ids, max_new_tokens, sampling):
            if len(ids) > 10:
                raise ValueError("prompt longer than the model's context")
            return types.SimpleNamespace(ids=[1])

    def prompt_ids(messages, tools):
        if messages[0]["content"] == "bad row":
            raise TypeError("the template rejects this row")
        return [0] * len(messages[0]["content"])

    judge = JudgeModel.__new__(JudgeModel)  # (no model: the engine and chat format stubbed)
    judge.engine = Engine()
    judge.chat = types.SimpleNamespace(prompt_ids=prompt_ids)
    judge.tokenizer = types.SimpleNamespace(decode=lambda ids, skip_special_tokens: "Score: 1")

    class Complete:  # the actor's call, in this process
        @staticmethod
        def remote(prompts, max_tokens):
            return asyncio.ensure_future(judge.complete(prompts, max_tokens))

    async def go():
        session = LocalSession(types.SimpleNamespace(concurrency=8, timeout_s=5, max_tokens=8),
                               types.SimpleNamespace(complete=Complete))
        return await asyncio.gather(*(session.reply([{"role": "user", "content": c}])
                                      for c in ["ok", "x" * 50, "fine", "bad row"]), return_exceptions=True)

    out = asyncio.run(go())
    assert out[0] == out[2] == "Score: 1", out
    assert isinstance(out[1], JudgeError) and "ValueError: prompt longer" in str(out[1]), out
    assert isinstance(out[3], JudgeError) and "TypeError: the template rejects" in str(out[3]), out


def test_a_local_judge_batch_that_timed_out_is_cancelled_on_its_actor(monkeypatch):
    """Its requests failed, but the actor went on generating them, and the next batches queued behind that
    abandoned work and timed out too: a slow step lost the judge's values for the rest of the step."""
    import types

    import ray

    from factory.reward.judge import JudgeError, LocalSession

    cancelled = []
    monkeypatch.setattr(ray, "cancel", cancelled.append)

    class Complete:
        @staticmethod
        def remote(prompts, max_tokens):
            return asyncio.ensure_future(asyncio.sleep(10))  # stands in for the ObjectRef of a slow batch

    async def go():
        session = LocalSession(types.SimpleNamespace(concurrency=4, timeout_s=0.2, max_tokens=8),
                               types.SimpleNamespace(complete=Complete))
        with pytest.raises(JudgeError, match="TimeoutError"):
            await session.reply([{"role": "user", "content": "grade"}])

    asyncio.run(go())
    assert len(cancelled) == 1
