"""The gallery's task generators (number puzzles, time zones), the QA rewards, and the real third-party
time server answering the time-zone questions."""
from __future__ import annotations

from pathlib import Path

import pytest

from factory.examples import puzzles, timezones
from factory.schema import StdioServer
from factory.tools import ToolBox
from factory.types import ToolCall
from factory.rewards import qa

ROOT = Path(__file__).resolve().parents[1]
TIME_SERVER = ROOT / ".factory/tool-venvs/mcp-server-time/bin/mcp-server-time"


# ------------------------------------------------------------------------------------------ puzzles
def test_puzzle_answers_by_hand():
    import random

    class Fixed(random.Random):
        """randint returns the values queued, in order."""

        def __new__(cls, *values):  # (Python 3.10's Random.__new__ takes one seed at most)
            return super().__new__(cls)

        def __init__(self, *values):
            super().__init__(0)
            self.values = list(values)

        def randint(self, a, b):
            return self.values.pop(0)

        def choice(self, seq):
            return self.values.pop(0)

    assert puzzles._digit_sum(Fixed(2, 10)) == ("What is the sum of the digits of 2**10?", 7)  # 1024
    assert puzzles._primes_below(Fixed(30))[1] == 10  # 2 3 5 7 11 13 17 19 23 29
    assert puzzles._fibonacci_mod(Fixed(10, 1000))[1] == 55
    assert puzzles._trailing_zeros(Fixed(100))[1] == 24  # 20 + 4
    assert puzzles._power_mod(Fixed(3, 4, 50))[1] == 31  # 81 mod 50


def test_puzzles_are_seeded_and_kinds_checked():
    assert list(puzzles.questions(5, seed=1)) == list(puzzles.questions(5, seed=1))
    assert {r["kind"] for r in puzzles.questions(20, kinds=["power_mod"])} == {"power_mod"}
    with pytest.raises(ValueError, match="unknown puzzle kinds"):
        list(puzzles.questions(1, kinds=["sudoku"]))


# ------------------------------------------------------------------------------------------ time zones
def test_time_zone_conversion_by_hand():
    assert timezones.convert("09:30", "Asia/Tokyo", "America/Bogota") == "19:30"  # +9 -> -5: 14 h back
    assert timezones.convert("15:00", "Asia/Kathmandu", "Asia/Shanghai") == "17:15"  # +5:45 -> +8


@pytest.mark.anyio
@pytest.mark.skipif(not TIME_SERVER.exists(), reason="bin/install-tool-servers installs mcp-server-time")
async def test_the_unchanged_time_server_agrees_with_every_answer_today():
    rows = list(timezones.questions(12, seed=3))
    server = StdioServer(command=str(TIME_SERVER), args=["--local-timezone", "UTC"], timeout_s=10)
    async with ToolBox.from_spec({"time": server}, base_dir=ROOT) as box:
        for row in rows:
            result = await box.call(ToolCall("convert_time", {"source_timezone": row["source"], "time": row["time"],
                                                              "target_timezone": row["target"]}, raw=""))
            assert result.status == "ok", result.text
            assert f"T{row['answer']}:00" in result.text, (row, result.text)


# ------------------------------------------------------------------------------------------ QA rewards
def test_exact_match_normalises_like_squad():
    assert qa.exact_match("", "<answer>The Bronze.</answer>", answer="Bronze") == 1.0
    assert qa.exact_match("", "<answer>bronze age</answer>", answer="Bronze") == 0.0
    assert qa.exact_match("", "Bronze", answer="Bronze") == 0.0  # no tag, no answer
    assert qa.exact_match("", "<answer>Paris</answer>", answer=["Lyon", "paris"]) == 1.0  # any accepted answer
    # an answer inside a tool response is not the model's
    assert qa.exact_match("", "<tool_response><answer>Bronze</answer></tool_response>", answer="Bronze") == 0.0
    from factory.types import Turn

    turns = [Turn(text="<answer>Brass</answer>", num_tokens=3)]  # the model's own turns decide, whatever the text
    assert qa.exact_match("", "<answer>Bronze</answer>", answer="Bronze", turns=turns) == 0.0


def test_f1_gives_partial_credit():
    assert qa.f1("", "<answer>Mercury planet</answer>", answer="Mercury") == pytest.approx(2 / 3)  # P 1/2, R 1
    assert qa.f1("", "<answer>the Leonardo da Vinci</answer>", answer="Leonardo da Vinci") == 1.0
    assert qa.f1("", "<answer>Venus</answer>", answer="Mercury") == 0.0
    assert qa.f1("", "no tag", answer="Mercury") == 0.0


def test_near_miss_is_a_rejected_answer_that_shares_words():
    assert qa.near_miss("", "<answer>Srinivasa Ramanujan Iyengar</answer>", answer="Srinivasa Ramanujan") == 1.0
    assert qa.near_miss("", "<answer>The Ramanujan</answer>", answer=["Hardy", "Ramanujan"]) == 0.0  # exact
    assert qa.near_miss("", "<answer>Venus</answer>", answer="Mercury") == 0.0  # no word in common
    assert qa.near_miss("", "Ramanujan", answer="Ramanujan") == 0.0  # no answer tag


def test_a_ground_truth_that_squad_normalises_to_nothing_keeps_its_articles_and_punctuation():
    # "A" (a multiple-choice letter), "The", "?" were normalised to "": an empty tag matched them, the answer not.
    for truth, right, wrong in (("A", "a.", "the"), ("The", "THE", "a"), ("?", "?", "!")):
        assert qa.exact_match("", f"<answer>{right}</answer>", answer=truth) == 1.0
        assert qa.f1("", f"<answer>{right}</answer>", answer=truth) == 1.0
        for said in ("", wrong):
            assert qa.exact_match("", f"<answer>{said}</answer>", answer=truth) == 0.0
            assert qa.f1("", f"<answer>{said}</answer>", answer=truth) == 0.0
    assert qa.f1("", "<answer>option A</answer>", answer="A") == pytest.approx(2 / 3)
    assert qa.exact_match("", "<answer>the Bronze</answer>", answer=["A", "Bronze"]) == 1.0  # each truth on its own


def test_an_empty_list_of_accepted_answers_scores_0_in_every_qa_checker():
    # f1 took max() of no scores and raised (near_miss through it): the reward stage counted an error per sample.
    for fn in (qa.exact_match, qa.f1, qa.near_miss):
        assert fn("", "<answer>Paris</answer>", answer=[]) == 0.0
