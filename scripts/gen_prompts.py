"""Regenerates the bundled prompt set service/rolloutd/data/arithmetic.jsonl (deterministic)."""

from __future__ import annotations

import json
import random
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "service" / "rolloutd" / "data" / "arithmetic.jsonl"
NAMES = [
    "Ada",
    "Ben",
    "Chen",
    "Dara",
    "Eli",
    "Fatima",
    "Goro",
    "Hana",
    "Ivan",
    "Jun",
    "Kofi",
    "Lena",
]
ITEMS = ["apples", "marbles", "stamps", "books", "coins", "pencils", "shells", "cards", "eggs"]


def problem(rng: random.Random) -> tuple[str, int]:
    name, other = rng.sample(NAMES, 2)
    item = rng.choice(ITEMS)
    a, b = rng.randint(2, 60), rng.randint(2, 40)
    kind = rng.randrange(4)
    if kind == 0:
        return (
            f"{name} has {a} {item} and {other} gives {name} {b} more. How many {item} does {name} have now?",
            a + b,
        )
    if kind == 1:
        a = a + b
        return (
            f"{name} had {a} {item} and gave {b} to {other}. How many {item} does {name} have left?",
            a - b,
        )
    if kind == 2:
        a, b = rng.randint(2, 12), rng.randint(2, 12)
        return (
            f"{name} buys {a} boxes with {b} {item} in each box. How many {item} is that in total?",
            a * b,
        )
    b = rng.randint(2, 9)
    total = b * rng.randint(2, 12)
    return (
        f"{name} shares {total} {item} equally among {b} friends. How many {item} does each friend get?",
        total // b,
    )


def main() -> None:
    rng = random.Random(20261129)
    with OUT.open("w") as f:
        for i in range(320):
            text, answer = problem(rng)
            row = {
                "id": f"arith-{i:04d}",
                "prompt": f"Question: {text}\nAnswer:",
                "metadata": {"answer": answer},
            }
            f.write(json.dumps(row) + "\n")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
