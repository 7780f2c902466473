"""A deterministic English-like corpus for the demo, generated rather than shipped."""

from __future__ import annotations

import random

_SUBJECTS = [
    "the cat",
    "a dog",
    "the old sailor",
    "my sister",
    "the young doctor",
    "a tired farmer",
    "the teacher",
    "our neighbour",
    "the small child",
    "a quiet student",
    "the baker",
    "the king",
]
_VERBS = [
    "finds",
    "paints",
    "carries",
    "watches",
    "follows",
    "builds",
    "sells",
    "remembers",
    "opens",
    "drops",
    "cleans",
    "borrows",
]
_OBJECTS = [
    "a red ball",
    "the heavy box",
    "an old map",
    "the blue door",
    "a wooden chair",
    "the letter",
    "a silver key",
    "the green apple",
    "a long rope",
    "the broken clock",
    "a warm coat",
    "the book",
]
_PLACES = [
    "near the river",
    "in the garden",
    "at the market",
    "under the bridge",
    "by the sea",
    "behind the school",
    "on the hill",
    "in the kitchen",
    "at the station",
    "inside the barn",
]
_TIMES = ["every morning", "at night", "on sunday", "after lunch", "in winter", "before dawn"]


def sentence(rng: random.Random) -> str:
    """One sentence from a small grammar: subject verb object [place] [time]."""
    words = [rng.choice(_SUBJECTS), rng.choice(_VERBS), rng.choice(_OBJECTS)]
    if rng.random() < 0.7:
        words.append(rng.choice(_PLACES))
    if rng.random() < 0.4:
        words.append(rng.choice(_TIMES))
    return " ".join(words) + "."


def generate(num_bytes: int = 400_000, seed: int = 1234) -> bytes:
    """The corpus: sentences joined by spaces, newline-separated paragraphs, ASCII bytes."""
    rng = random.Random(seed)
    parts: list[str] = []
    size = 0
    while size < num_bytes:
        paragraph = " ".join(sentence(rng) for _ in range(rng.randint(3, 7))) + "\n"
        parts.append(paragraph)
        size += len(paragraph)
    return "".join(parts).encode("ascii")[:num_bytes]
