"""Synthetic recall corpus: facts stated in filler text, queried later at chosen distances.

A document reads like

    The old sailor painted the river at dawn. The code for bravo-17 is 48213. Then the baker
    opened a wooden box. [... filler ...] Recall that the code for bravo-17 is 48213. [...]

Each fact "the code for KEY is VALUE" is stated once and queried once, `distance` units later
(characters, which are tokens for the byte tokenizer, or tokens of a given tokenizer). The
filler (`synthetic.FillerGrammar`) has no digits and never says "code for", so the digits of the
queried value can only be predicted by recalling the statement; everything else is predictable
from local context or the grammar.

`recall_answers(text, tokenizer)` recomputes, from the text alone, the positions of those answer
tokens and each one's distance to the statement, so that

- evaluation scores predictions "near" (`distance < window`: the statement is inside a sliding
  window of `window` keys) and "far" (`distance >= window`);
- retrieval probes bucket them with `distance_bucket` (inside, 1-4x, 4-16x, beyond the window).

Distance convention: the answer token at position `p` is predicted from position `p - 1`; the
statement's copy of that token is at `f`; `distance = (p - 1) - f`, the number of positions the
prediction must look back. A causal window of `w` keys (query `i` sees keys `i - w < j <= i`)
contains the statement exactly when `distance < w`.

Everything is reproducible from `seed`: document `i` depends only on `(seed, i)`.
"""

from __future__ import annotations

import bisect
import os
import random
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from transformers import PreTrainedTokenizerBase

from .buckets import WINDOW_BUCKETS, window_bucket
from .synthetic import FillerGrammar, write_fineweb_files

KEY_WORDS = (
    "alpha",
    "bravo",
    "charlie",
    "delta",
    "echo",
    "foxtrot",
    "golf",
    "hotel",
    "india",
    "juliet",
    "kilo",
    "lima",
    "mike",
    "november",
    "oscar",
    "papa",
    "quebec",
    "romeo",
    "sierra",
    "tango",
    "uniform",
    "victor",
    "whiskey",
    "xray",
    "yankee",
    "zulu",
)
STATEMENT = "The code for {key} is {value}."
QUERY_LEADS = (
    "Recall that the code for {key} is ",
    "As noted before, the code for {key} is ",
    "Remember: the code for {key} is ",
)
FACT_PATTERN = re.compile(r"code for ([a-z]+-\d+) is (\d+)")
DEFAULT_DISTANCES = (16, 64, 256, 1024)
#: the window-relative buckets, defined once in `buckets.py` (names kept for this module's users)
DISTANCE_BUCKETS = WINDOW_BUCKETS
distance_bucket = window_bucket


@dataclass(frozen=True)
class RecallFact:
    """A fact of a generated document; offsets are characters in the document's text."""

    key: str
    value: str
    statement_start: int  # where the value starts in the statement
    query_start: int  # where the value starts in the query
    target_distance: int  # the distance asked for, in generation units


@dataclass(frozen=True)
class RecallDocument:
    text: str
    facts: tuple[RecallFact, ...]


@dataclass(frozen=True)
class RecallAnswer:
    """One token that only recall can predict (positions index the tokenised document)."""

    key: str
    position: int  # the answer token (a label position)
    fact_position: int  # the statement's token holding the same part of the value
    distance: int  # (position - 1) - fact_position

    def bucket(self, window: int) -> str:
        return distance_bucket(self.distance, window)


def _length_fn(tokenizer: PreTrainedTokenizerBase | None) -> Callable[[str], int]:
    if tokenizer is None:
        return len
    return lambda s: len(
        tokenizer(s, add_special_tokens=False, split_special_tokens=True)["input_ids"]
    )


def _filler(grammar: FillerGrammar, units: int, length: Callable[[str], int]) -> str:
    """Filler sentences whose length (with a leading space each) is closest to `units`."""
    parts: list[str] = []
    total = 0
    while total < units:
        sentence = grammar.sentence()
        n = length(" " + sentence)
        if total + n - units > units - total:  # overshooting by more than we are short
            break
        parts.append(sentence)
        total += n
    return "".join(" " + p for p in parts)


def generate_recall_document(
    index: int,
    *,
    seed: int = 0,
    distances: Sequence[int] = DEFAULT_DISTANCES,
    facts_per_doc: int = 4,
    tokenizer: PreTrainedTokenizerBase | None = None,
    prefix_units: int = 64,
    gap_units: int = 48,
) -> RecallDocument:
    """Document `index` of the corpus with `seed` (see `generate_recall_documents`)."""
    if not distances or min(distances) < 0:
        raise ValueError(f"distances={distances!r} must be non-empty and >= 0")
    if facts_per_doc < 1:
        raise ValueError(f"facts_per_doc={facts_per_doc!r} must be >= 1")
    rng = random.Random(f"hedgecats-recall/{seed}/{index}")
    grammar = FillerGrammar(rng.randrange(2**32))
    length = _length_fn(tokenizer)
    text = grammar.text(1)
    text += _filler(grammar, prefix_units, length)
    facts = []
    keys: set[str] = set()
    start = rng.randrange(len(distances))
    for j in range(facts_per_doc):
        target = distances[(start + j) % len(distances)]
        while (key := f"{rng.choice(KEY_WORDS)}-{rng.randrange(10, 100)}") in keys:
            pass
        keys.add(key)
        value = str(rng.randrange(10_000, 100_000))
        statement = " " + STATEMENT.format(key=key, value=value)
        statement_start = len(text) + statement.index(f" is {value}") + 4
        text += statement
        lead = " " + rng.choice(QUERY_LEADS).format(key=key)
        # units from the statement's value to the query's value = target + 1
        fixed = length(value + ".") + length(lead)
        text += _filler(grammar, target + 1 - fixed, length)
        query_start = len(text) + len(lead)
        text += lead + value + "."
        facts.append(RecallFact(key, value, statement_start, query_start, target))
        text += _filler(grammar, gap_units, length)
    return RecallDocument(text, tuple(facts))


def generate_recall_documents(
    n_docs: int,
    *,
    seed: int = 0,
    distances: Sequence[int] = DEFAULT_DISTANCES,
    facts_per_doc: int = 4,
    tokenizer: PreTrainedTokenizerBase | None = None,
    prefix_units: int = 64,
    gap_units: int = 48,
) -> list[RecallDocument]:
    """`n_docs` recall documents, reproducible from `seed`.

    Each document has `facts_per_doc` facts, each stated then queried about `distance` units
    later, with distances taken in turn from `distances` (starting at a random one). Units are
    characters (= byte-tokenizer tokens for this ASCII text) or tokens of `tokenizer`; the filler
    is cut at sentence boundaries, so actual distances are near the targets, and
    `recall_answers` gives the exact ones. The query's own words ("Recall that the code for
    KEY is ") set a floor: targets below about 40-55 characters (15-20 BPE tokens) come out
    at that floor. `prefix_units` of filler open the document and `gap_units` follow each query.
    """
    return [
        generate_recall_document(
            i,
            seed=seed,
            distances=distances,
            facts_per_doc=facts_per_doc,
            tokenizer=tokenizer,
            prefix_units=prefix_units,
            gap_units=gap_units,
        )
        for i in range(n_docs)
    ]


def recall_answers(
    text: str, tokenizer: PreTrainedTokenizerBase | None = None, add_special_tokens: bool = False
) -> list[RecallAnswer]:
    """The answer tokens of a recall document and their distances, recomputed from the text.

    The first "code for KEY is VALUE" of a key is its statement, a later one its query. With no
    tokenizer, positions are characters (byte-tokenizer tokens for ASCII text). With a (fast)
    tokenizer, the document is tokenised as `tokenizer(text, add_special_tokens=...)` would, and
    positions index those tokens; an answer token is any token overlapping the queried value.
    """
    statements: dict[str, tuple[int, str]] = {}
    queries: list[tuple[str, int, int]] = []  # key, start, end of the queried value (chars)
    for m in FACT_PATTERN.finditer(text):
        key, value, start = m.group(1), m.group(2), m.start(2)
        if key not in statements:
            statements[key] = (start, value)
        elif statements[key][1] != value:
            raise ValueError(
                f"key {key!r} is stated as {statements[key][1]!r} but queried as {value!r}"
            )
        else:
            queries.append((key, start, m.end(2)))
    answers = []
    if tokenizer is None:
        for key, q_start, q_end in queries:
            f_start = statements[key][0]
            for c in range(q_start, q_end):
                f = f_start + (c - q_start)
                answers.append(RecallAnswer(key, c, f, (c - 1) - f))
        return answers
    if not tokenizer.is_fast:
        raise ValueError("recall_answers needs a fast tokenizer (it uses offset mappings)")
    offsets = tokenizer(
        text,
        return_offsets_mapping=True,
        add_special_tokens=add_special_tokens,
        split_special_tokens=True,
    )["offset_mapping"]
    spans = [(s, e, i) for i, (s, e) in enumerate(offsets) if e > s]  # skip special tokens
    starts = [s for s, _, _ in spans]

    def token_at(char: int) -> int:
        k = bisect.bisect_right(starts, char) - 1
        return spans[k][2]

    for key, q_start, q_end in queries:
        f_start = statements[key][0]
        k = bisect.bisect_right(starts, q_start) - 1
        while k < len(spans) and spans[k][0] < q_end:
            s, e, i = spans[k]
            if e > q_start:
                f = token_at(f_start + (max(s, q_start) - q_start))
                answers.append(RecallAnswer(key, i, f, (i - 1) - f))
            k += 1
    return answers


def write_recall_corpus(
    out_dir: str | os.PathLike,
    n_docs: int,
    *,
    n_files: int = 1,
    file_format: str = "parquet",
    seed: int = 0,
    **kwargs,
) -> list[Path]:
    """Generate `n_docs` recall documents and write them with FineWeb-Edu's columns.

    The files are read by `FineWebEduDataModule(data_files=...)`; the annotations are not stored
    (the columns stay FineWeb-Edu's): `recall_answers(text, tokenizer)` recomputes them. Extra
    keyword arguments go to `generate_recall_documents`.
    """
    docs = generate_recall_documents(n_docs, seed=seed, **kwargs)
    return write_fineweb_files(
        (d.text for d in docs),
        out_dir,
        n_files=n_files,
        file_format=file_format,
        source=f"recall-{seed}",
        prefix="recall",
    )
