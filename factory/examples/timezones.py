"""Time-zone questions for the third-party tool example (the PyPI server `mcp-server-time`, used
unchanged): "It is 09:30 in Asia/Tokyo. What time is it in America/Bogota?" -> "19:30".

Only zones without daylight saving time are used, so the answer does not depend on the day the server
converts on (it converts on today's date). Rows are `{question, answer, source, target, time}`.
"""
from __future__ import annotations

import random
from collections.abc import Iterator
from datetime import datetime
from zoneinfo import ZoneInfo

# Fixed offsets (no DST since at least 2022), a spread of whole, half and three-quarter hours.
ZONES = ("UTC", "Asia/Tokyo", "Asia/Kolkata", "Asia/Shanghai", "Asia/Dubai", "Asia/Singapore", "Asia/Kathmandu",
         "Africa/Nairobi", "America/Bogota", "America/Lima", "Asia/Karachi", "Asia/Bangkok", "Africa/Lagos",
         "Pacific/Honolulu", "America/Argentina/Buenos_Aires", "Asia/Seoul", "Asia/Dhaka", "Asia/Tehran")


def convert(time: str, source: str, target: str) -> str:
    """HH:MM in `source` as HH:MM in `target` (the zones have fixed offsets: any date gives the same)."""
    hour, minute = map(int, time.split(":"))
    start = datetime(2026, 1, 15, hour, minute, tzinfo=ZoneInfo(source))
    return start.astimezone(ZoneInfo(target)).strftime("%H:%M")


def questions(n: int, seed: int = 0) -> Iterator[dict[str, str]]:
    """n conversion questions between two different zones, at a random quarter hour."""
    rng = random.Random(seed)
    for _ in range(n):
        source, target = rng.sample(ZONES, 2)
        time = f"{rng.randint(0, 23):02d}:{rng.choice((0, 15, 30, 45)):02d}"
        yield {"question": f"It is {time} in {source}. What time is it in {target}?",
               "answer": convert(time, source, target), "source": source, "target": target, "time": time}
