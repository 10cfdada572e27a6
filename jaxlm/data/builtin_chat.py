"""The built-in chat set, `data.corpus=builtin_chat`: short conversations a tiny model can learn the
format of in minutes on a CPU (arithmetic, capitals, unit conversions, reversing and spelling
words, comparing numbers; some with a system message, some with two turns).

Written by this script, deterministically (a fixed seed, no download), into `builtin_chat.jsonl`
beside it; `python -m jaxlm.data.builtin_chat` writes it again (the tests check that it is unchanged).
"""

import json
import pathlib
import random

NUM_CONVERSATIONS = 600
SEED = 0
PATH = pathlib.Path(__file__).resolve().with_name("builtin_chat.jsonl")

CAPITALS = {
    "France": "Paris", "Germany": "Berlin", "Italy": "Rome", "Spain": "Madrid", "Portugal": "Lisbon",
    "Japan": "Tokyo", "China": "Beijing", "India": "New Delhi", "Canada": "Ottawa", "Mexico": "Mexico City",
    "Brazil": "Brasilia", "Argentina": "Buenos Aires", "Egypt": "Cairo", "Kenya": "Nairobi", "Norway": "Oslo",
    "Sweden": "Stockholm", "Finland": "Helsinki", "Poland": "Warsaw", "Greece": "Athens", "Turkey": "Ankara",
    "Russia": "Moscow", "Australia": "Canberra", "Peru": "Lima", "Chile": "Santiago", "Ireland": "Dublin",
    "Austria": "Vienna", "Hungary": "Budapest", "Belgium": "Brussels", "Netherlands": "Amsterdam",
    "Denmark": "Copenhagen", "Thailand": "Bangkok", "Vietnam": "Hanoi", "Morocco": "Rabat", "Cuba": "Havana",
}
WORDS = ("apple", "river", "planet", "garden", "window", "silver", "rocket", "yellow", "castle", "forest",
         "pencil", "bridge", "dragon", "summer", "winter", "orange", "guitar", "island", "jacket", "marble",
         "candle", "shadow", "button", "tomato", "spider", "letter", "mirror", "monkey", "rabbit", "violet")
UNITS = (  # (question unit, answer unit, factor)
    ("meters", "centimeters", 100), ("kilometers", "meters", 1000), ("kilograms", "grams", 1000),
    ("hours", "minutes", 60), ("minutes", "seconds", 60), ("liters", "milliliters", 1000),
    ("days", "hours", 24), ("weeks", "days", 7),
)
SYSTEM_PROMPTS = ("You are a helpful assistant.", "Answer briefly.", "You are a concise assistant.")


def _arithmetic(rng: random.Random) -> tuple[str, str]:
    a, b = rng.randint(2, 99), rng.randint(2, 99)
    op = rng.choice("+-*")
    if op == "-" and b > a:
        a, b = b, a
    result = {"+": a + b, "-": a - b, "*": a * b}[op]
    word = {"+": "plus", "-": "minus", "*": "times"}[op]
    question = rng.choice([f"What is {a} {op} {b}?", f"What is {a} {word} {b}?", f"Compute {a} {op} {b}."])
    return question, f"{a} {op} {b} = {result}."


def _capital(rng: random.Random) -> tuple[str, str]:
    country = rng.choice(sorted(CAPITALS))
    question = rng.choice([f"What is the capital of {country}?", f"Which city is the capital of {country}?"])
    return question, f"The capital of {country} is {CAPITALS[country]}."


def _units(rng: random.Random) -> tuple[str, str]:
    big, small, factor = rng.choice(UNITS)
    n = rng.randint(2, 12)
    return f"How many {small} are in {n} {big}?", f"{n} {big} is {n * factor} {small}."


def _reverse(rng: random.Random) -> tuple[str, str]:
    word = rng.choice(WORDS)
    return rng.choice([f"Reverse the word '{word}'.", f"Write '{word}' backwards."]), word[::-1]


def _spell(rng: random.Random) -> tuple[str, str]:
    word = rng.choice(WORDS)
    return f"Spell '{word}' letter by letter.", "-".join(word.upper())


def _compare(rng: random.Random) -> tuple[str, str]:
    a, b = rng.sample(range(1, 200), 2)
    return f"Which is larger, {a} or {b}?", f"{max(a, b)} is larger than {min(a, b)}."


TASKS = (_arithmetic, _capital, _units, _reverse, _spell, _compare)


def conversations(n: int = NUM_CONVERSATIONS, seed: int = SEED) -> list[dict]:
    """`n` conversations in the chat format: {"messages": [{"role": ..., "content": ...}, ...]}."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        messages = []
        if rng.random() < 0.25:
            messages.append({"role": "system", "content": rng.choice(SYSTEM_PROMPTS)})
        for _ in range(2 if rng.random() < 0.2 else 1):
            question, answer = rng.choice(TASKS)(rng)
            messages += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
        out.append({"messages": messages})
    return out


def text(n: int = NUM_CONVERSATIONS, seed: int = SEED) -> str:
    """The JSONL file's contents."""
    return "".join(json.dumps(c, ensure_ascii=False) + "\n" for c in conversations(n, seed))


def main() -> None:
    PATH.write_text(text(), encoding="utf-8")
    print(f"wrote {NUM_CONVERSATIONS} conversations to {PATH}")


if __name__ == "__main__":
    main()
