"""Writes ``questions.jsonl``: arithmetic questions for the calculator environment, one chat
prompt a row with the ``calculator`` tool's schema in ``tools`` and the answer in ``metadata``.

    python examples/calculator/make_questions.py [--rows 16] [--seed 0] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from calculator.environment import TOOL, evaluate  # noqa: E402

SYSTEM = (
    "You can use a calculator: write <calc>EXPRESSION</calc> and its result comes back. "
    "When you know the answer, write <answer>NUMBER</answer>."
)
SHAPES = ("{a} * {b} + {c}", "({a} + {b}) * {c}", "{a} * {b} - {c} * {d}", "{a} ** 2 - {b}")


def rows(n: int, seed: int) -> list[dict[str, object]]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        numbers = {k: rng.randint(2, 99) for k in "abcd"}
        expression = SHAPES[i % len(SHAPES)].format(**numbers)
        out.append(
            {
                "id": f"calc-{i}",
                "messages": [
                    {"role": "system", "content": SYSTEM},
                    {"role": "user", "content": f"What is {expression}?"},
                ],
                "tools": [TOOL],
                "metadata": {"answer": evaluate(expression), "expression": expression},
            }
        )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=HERE / "questions.jsonl")
    args = parser.parse_args()
    args.out.write_text("".join(json.dumps(r) + "\n" for r in rows(args.rows, args.seed)))
    print(f"wrote {args.rows} questions to {args.out}")


if __name__ == "__main__":
    main()
