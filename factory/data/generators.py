"""Built-in task generators, named in specs by import path (`factory.data:arithmetic`)."""
from __future__ import annotations

import random
from collections.abc import Iterable
from typing import Any


def arithmetic(n: int, seed: int = 0, operands: tuple[int, int] = (2, 3), digits: tuple[int, int] = (2, 3),
               ops: str = "+-*") -> Iterable[dict[str, Any]]:
    """Integer arithmetic questions such as `47 * 83 - 215`, with the exact answer.

    2-3 operands of 2-3 digits: a 135M model cannot do these in its head, so reward needs the calculator.
    `ops`: the operators drawn from, some of `+-*` (division would give answers that are not integers).
    """
    if not ops or set(ops) - set("+-*"):
        raise ValueError(f"ops takes + - * (integer answers), got {ops!r}")
    for name, (low, high) in (("operands", operands), ("digits", digits)):
        if not 1 <= low <= high:  # (0 operands has no first term; 0 digits no smallest number)
            raise ValueError(f"{name} takes [low, high] with 1 <= low <= high, got {[low, high]}")
    rng = random.Random(seed)
    for _ in range(n):
        k = rng.randint(*operands)
        sizes = [rng.randint(*digits) for _ in range(k)]
        terms = [str(rng.randint(10 ** (d - 1), 10 ** d - 1)) for d in sizes]
        expr = terms[0]
        for term in terms[1:]:
            expr += f" {rng.choice(ops)} {term}"
        # eval is safe here: the expression is built above from digits and + - * only.
        yield {"question": f"What is {expr}?", "expression": expr, "answer": str(eval(expr))}
