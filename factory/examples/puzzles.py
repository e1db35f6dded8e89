"""Number puzzles for the code-execution example: easy to compute with a few lines of Python, beyond a
small model's mental arithmetic. `questions(n, seed)` yields rows `{question, answer, kind}`; the
answers are computed here, exactly."""
from __future__ import annotations

import random
from collections.abc import Callable, Iterator


def _digit_sum(rng: random.Random) -> tuple[str, int]:
    a, b = rng.randint(2, 9), rng.randint(20, 200)
    return f"What is the sum of the digits of {a}**{b}?", sum(map(int, str(a**b)))


def _primes_below(rng: random.Random) -> tuple[str, int]:
    n = rng.randint(100, 20000)
    sieve = bytearray([1]) * n
    sieve[:2] = b"\0\0"
    for i in range(2, int(n**0.5) + 1):
        if sieve[i]:
            sieve[i * i::i] = bytearray(len(range(i * i, n, i)))
    return f"How many prime numbers are smaller than {n}?", sum(sieve)


def _fibonacci_mod(rng: random.Random) -> tuple[str, int]:
    k, m = rng.randint(50, 500), rng.choice([97, 1000, 10007, 65537])
    a, b = 0, 1
    for _ in range(k):
        a, b = b, a + b
    return f"What is the {k}th Fibonacci number (F(0) = 0, F(1) = 1) modulo {m}?", a % m


def _trailing_zeros(rng: random.Random) -> tuple[str, int]:
    n = rng.randint(50, 5000)
    zeros, p = 0, 5
    while p <= n:
        zeros += n // p
        p *= 5
    return f"How many trailing zeros does {n}! have?", zeros


def _power_mod(rng: random.Random) -> tuple[str, int]:
    a, b, m = rng.randint(2, 999), rng.randint(100, 10**6), rng.randint(100, 10**4)
    return f"What is {a}**{b} modulo {m}?", pow(a, b, m)


KINDS: dict[str, Callable[[random.Random], tuple[str, int]]] = {
    "digit_sum": _digit_sum, "primes_below": _primes_below, "fibonacci_mod": _fibonacci_mod,
    "trailing_zeros": _trailing_zeros, "power_mod": _power_mod,
}


def questions(n: int, seed: int = 0, kinds: list[str] | None = None) -> Iterator[dict[str, str]]:
    """n puzzles of the given kinds (all by default), drawn in a seeded order."""
    names = list(kinds or KINDS)
    unknown = sorted(set(names) - set(KINDS))
    if unknown:
        raise ValueError(f"unknown puzzle kinds {unknown}; choose from {sorted(KINDS)}")
    rng = random.Random(seed)
    for _ in range(n):
        kind = rng.choice(names)
        question, answer = KINDS[kind](rng)
        yield {"question": question, "answer": str(answer), "kind": kind}
