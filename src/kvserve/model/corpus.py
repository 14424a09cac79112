"""Deterministic English-ish training text for the preset tokenizers.

Expands the word lists and passages in ``data/words.txt`` with a small seeded grammar into a
few hundred KB of varied text (prose, dialogue, numbers, lists, code, some non-ASCII), so a
byte-level BPE trained on it is the same on every machine and every run.
"""

from __future__ import annotations

import random
from functools import cache
from importlib import resources

MONTHS = ["January", "February", "March", "April", "May", "June", "July", "August"]
DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]


@cache
def word_lists() -> dict[str, list[str]]:
    text = resources.files("kvserve.model").joinpath("data/words.txt").read_text("utf-8")
    sections: dict[str, list[str]] = {}
    current = None
    for line in text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        if line.startswith("[") and line.endswith("]"):
            current = sections.setdefault(line[1:-1], [])
        elif current is not None:
            current.append(line)
    return sections


def _sentence(rng: random.Random, w: dict[str, list[str]]) -> str:
    def pick(kind: str) -> str:
        return rng.choice(w[kind])

    forms = [
        lambda: f"{pick('name')} {pick('verb')} the {pick('adjective')} {pick('noun')}.",
        lambda: f"The {pick('noun')} {pick('verb')} {pick('adverb')} in {pick('place')}.",
        lambda: (
            f"In {pick('place')}, {pick('name')} {pick('verb')} a {pick('noun')} "
            f"near the {pick('adjective')} {pick('noun')}."
        ),
        lambda: (
            f"Every {rng.choice(DAYS)}, the {pick('noun')} {pick('verb')} the "
            f"{pick('noun')} {pick('adverb')}."
        ),
        lambda: (
            f"There were {rng.randint(2, 999)} {pick('noun')}s in {pick('place')} on "
            f"{rng.randint(1, 28)} {rng.choice(MONTHS)} {rng.randint(1900, 2030)}."
        ),
        lambda: (
            f"{pick('name')} said that {pick('topic')} was {pick('adjective')}, "
            f"but {pick('name')} {pick('adverb')} disagreed."
        ),
        lambda: (
            f"Why is the {pick('noun')} so {pick('adjective')}? "
            f"Because it {pick('verb')} the {pick('noun')}."
        ),
        lambda: (
            f"{pick('name')} and {pick('name')} talked about {pick('topic')} "
            f"until the {pick('noun')} was {pick('adjective')}."
        ),
        lambda: (
            f"{rng.randint(1, 9)}.{rng.randint(0, 99):02d} % of the {pick('noun')}s "
            f"are {pick('adjective')}."
        ),
        lambda: pick("passage"),
    ]
    return rng.choice(forms)()


def _paragraph(rng: random.Random, w: dict[str, list[str]]) -> str:
    kind = rng.random()
    if kind < 0.6:
        return " ".join(_sentence(rng, w) for _ in range(rng.randint(2, 7)))
    if kind < 0.8:
        topic = rng.choice(w["topic"])
        reply = " ".join(_sentence(rng, w) for _ in range(rng.randint(1, 4)))
        return f"User: Tell me about {topic}.\nAssistant: {reply}"
    if kind < 0.9:
        items = [
            f"- {rng.choice(w['noun'])}: {rng.randint(0, 10000)}" for _ in range(rng.randint(2, 6))
        ]
        return f"{rng.choice(w['topic']).capitalize()}:\n" + "\n".join(items)
    a, b = rng.choice(w["noun"]), rng.choice(w["noun"])
    return f"def {a}_{b}(x):\n    return x * {rng.randint(2, 99)} + {rng.randint(0, 9)}"


def training_text(num_bytes: int = 300_000, seed: int = 0) -> list[str]:
    """Paragraphs totalling about ``num_bytes`` bytes of UTF-8 text (deterministic)."""
    rng = random.Random(seed)
    w = word_lists()
    out, size = list(w["passage"]), 0
    while size < num_bytes:
        p = _paragraph(rng, w)
        out.append(p)
        size += len(p.encode("utf-8")) + 2
    return out
