"""Benchmark prompts: the shipped Spec-Bench-style set, a ShareGPT JSON file, a JSONL file of
prompts, or vLLM's random dataset.

The shipped set (`data/prompts.jsonl`, written for this project) has 18 prompts in each
of Spec-Bench's six categories plus code. One JSON object per line:
`{"id", "category", "prompt"}`, or for a multi-turn conversation `{"id", "category",
"turns"}` where `turns` alternates user / assistant and ends with a user message (sent
as one chat with all those messages).

A ShareGPT file is a JSON list of `{"conversations": [{"from": "human", "value": ...},
{"from": "gpt", "value": ...}, ...]}`; each entry contributes its first human turn ("from":
"human", or "user" as some exports write it), labelled with the category "sharegpt", and every
request generates `--max-tokens`. Not vLLM's sharegpt dataset, which takes each request's output
length from the gpt reply and drops conversations of one turn, pieces under 4 tokens and prompts
over 1,024 tokens: the same file is another workload there.

A `.jsonl` file is vLLM's custom dataset: one `{"prompt": ...}` object per line (an
optional "category" labels it, else "custom"; other keys are ignored).

`random` is vLLM's random dataset (`--random-input-len`, `--random-output-len`,
`--random-range-ratio`, `--random-prefix-len`): prompts of uniform random token ids (a shared
random prefix, then each request's own ids), sent as ids without a chat template, each with
its own output length. Text nobody wrote: the worst case for a drafter, whose acceptance is
then near its floor.
"""

from __future__ import annotations

import functools
import json
import os
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

SHIPPED = "specbench"
RANDOM = "random"
SHIPPED_PATH = Path(__file__).resolve().parent / "data" / "prompts.jsonl"
SHAREGPT = "sharegpt"
_USER_ROLES = ("human", "user")  # ShareGPT exports write either
CUSTOM = "custom"

CATEGORIES = {
    "multi_turn": "multi-turn conversation",
    "translation": "translation",
    "summarization": "summarization",
    "qa": "question answering",
    "math_reasoning": "math reasoning",
    "rag": "retrieval-augmented answering",
    "code": "code",
}


@dataclass(frozen=True)
class BenchPrompt:
    id: str
    category: str
    messages: tuple[str, ...]  # user, assistant, user, ...: odd length, the last one is the user's
    token_ids: tuple[int, ...] | None = None  # the random dataset's: sent as ids, no template
    max_tokens: int | None = None  # the random dataset's output length (else the run's --max-tokens)

    @property
    def text(self) -> str:
        """The prompt as plain text (without a chat template)."""
        if len(self.messages) == 1:
            return self.messages[0]
        roles = ("User", "Assistant")
        lines = [f"{roles[i % 2]}: {m}" for i, m in enumerate(self.messages)]
        return "\n".join(lines) + "\nAssistant:"

    def chat_messages(self) -> list[dict[str, str]]:
        roles = ("user", "assistant")
        return [{"role": roles[i % 2], "content": m} for i, m in enumerate(self.messages)]


def load_shipped(path: Path = SHIPPED_PATH) -> list[BenchPrompt]:
    prompts = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            row = json.loads(line)
            turns = row.get("turns") or [row["prompt"]]
            if len(turns) % 2 != 1:
                raise ValueError(f"{path}:{n}: 'turns' must alternate user/assistant and end with a user message")
            if row["category"] not in CATEGORIES:
                raise ValueError(f"{path}:{n}: unknown category {row['category']!r}; known: {', '.join(CATEGORIES)}")
            prompts.append(BenchPrompt(id=row["id"], category=row["category"], messages=tuple(turns)))
    return prompts


def load_sharegpt(path: str | Path) -> list[BenchPrompt]:
    with open(path, encoding="utf-8") as f:
        try:
            data = json.load(f)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}: not a JSON file ({exc}); one JSON object per line needs a .jsonl name") from exc
    if not isinstance(data, list):
        raise ValueError(f"{path}: a ShareGPT file is a JSON list of {{'conversations': [...]}} entries")
    prompts = []
    for i, entry in enumerate(data):
        turns = entry.get("conversations") if isinstance(entry, dict) else None
        turns = turns if isinstance(turns, list) else []  # a malformed entry has no human turn: skipped
        first = next((t.get("value", "") for t in turns if isinstance(t, dict) and t.get("from") in _USER_ROLES), "")
        if isinstance(first, str) and first.strip():
            prompts.append(BenchPrompt(id=str(entry.get("id", i)), category=SHAREGPT, messages=(first,)))
    if not prompts:
        raise ValueError(f"{path}: no conversation with a non-empty human turn")
    return prompts


def load_jsonl(path: str | Path) -> list[BenchPrompt]:
    """vLLM's custom dataset: one {"prompt": str} object per line (blank lines skipped)."""
    prompts = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{n}: not a JSON object ({exc})") from exc
            prompt = row.get("prompt") if isinstance(row, dict) else None
            if not isinstance(prompt, str) or not prompt.strip():
                raise ValueError(f"{path}:{n}: each line needs a non-empty string 'prompt'")
            category = row.get("category")
            prompts.append(BenchPrompt(id=str(row.get("id", n)), category=str(category) if category else CUSTOM,
                                       messages=(prompt,)))
    if not prompts:
        raise ValueError(f"{path}: no prompt in the file")
    return prompts


@dataclass(frozen=True)
class RandomDataset:
    """vLLM's random dataset: lengths drawn uniformly in [len·(1 - ratio), len·(1 + ratio)]."""

    input_len: int = 1024
    output_len: int = 128
    range_ratio: float = 0.0
    prefix_len: int = 0

    def __post_init__(self) -> None:
        if self.input_len < 1 or self.output_len < 1 or self.prefix_len < 0:
            raise ValueError("--random-input-len and --random-output-len must be >= 1, --random-prefix-len >= 0")
        if not 0.0 <= self.range_ratio < 1.0:
            raise ValueError(f"--random-range-ratio must be in [0, 1), got {self.range_ratio}")

    def longest(self) -> int:
        """The most tokens one request can need: its prompt and its output."""
        return self.prefix_len + int(self.input_len * (1 + self.range_ratio)) + int(self.output_len * (1 + self.range_ratio))

    def prompts(self, num: int, vocab_size: int, seed: int) -> list[BenchPrompt]:
        """num prompts; their lengths depend on the seed alone, not on the vocabulary."""
        lengths, tokens = random.Random(seed), random.Random(seed + 1)

        def length(n: int) -> int:
            return lengths.randint(max(1, int(n * (1 - self.range_ratio))), int(n * (1 + self.range_ratio)))

        sizes = [(length(self.input_len), length(self.output_len)) for _ in range(num)]
        prefix = [tokens.randrange(vocab_size) for _ in range(self.prefix_len)]
        return [BenchPrompt(id=f"random-{i}", category=RANDOM, messages=("",), max_tokens=out,
                            token_ids=tuple(prefix + [tokens.randrange(vocab_size) for _ in range(n)]))
                for i, (n, out) in enumerate(sizes)]


def load_dataset(dataset: str) -> list[BenchPrompt]:
    """`specbench` (the shipped set), a `.jsonl` file of {"prompt"} lines, or a ShareGPT JSON file
    (`random` needs the model's vocabulary: RandomDataset.prompts)."""
    if dataset == SHIPPED:
        return load_shipped()
    if dataset == RANDOM:
        raise ValueError("--dataset random is generated from the target's vocabulary: `bench serve` and `bench "
                         "sweep` with the specdec backend take it")
    if not Path(dataset).is_file():
        why = "a directory" if Path(dataset).is_dir() else "no such file"
        raise ValueError(f"--dataset must be '{SHIPPED}', a .jsonl file or a ShareGPT JSON file, got {dataset!r} "
                         f"({why})")
    stat = os.stat(dataset)
    return list(_load_file(dataset, stat.st_mtime_ns, stat.st_size))


@functools.lru_cache(maxsize=2)
def _load_file(path: str, mtime_ns: int, size: int) -> tuple[BenchPrompt, ...]:
    """A file's prompts, parsed once per version of it: the flag's check and the run both load
    it (a ShareGPT dump is hundreds of MB of JSON)."""
    try:
        return tuple(load_jsonl(path) if path.endswith(".jsonl") else load_sharegpt(path))
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path}: not UTF-8 text ({exc})") from None


def interleave(prompts: Sequence[BenchPrompt], seed: int) -> list[BenchPrompt]:
    """All prompts in a seeded order that cycles through the categories, so that the
    first k prompts of the order cover min(k, #categories) categories evenly."""
    rng = random.Random(seed)
    by_cat: dict[str, list[BenchPrompt]] = {}
    for p in prompts:
        by_cat.setdefault(p.category, []).append(p)
    queues = []
    for cat in sorted(by_cat):
        items = list(by_cat[cat])
        rng.shuffle(items)
        queues.append(items)
    out = []
    while any(queues):
        for q in queues:
            if q:
                out.append(q.pop())
    return out
