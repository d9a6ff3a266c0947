"""Prompt text cut from the public-domain prose shipped in `data/corpus.txt` (see data/SOURCE.txt).

Each prompt starts at a random place in the corpus, so unrelated requests share no prefix by
accident; with an exact tokenizer it holds exactly the asked number of tokens.
"""

from __future__ import annotations

from importlib import resources

import numpy as np

from tailserve.bench.tokenizers import CHARS_PER_TOKEN, PromptTokenizer

_MAX_FIXUP_ROUNDS = 8


def load_corpus() -> str:
    """The shipped corpus text."""
    return resources.files("tailserve.bench").joinpath("data/corpus.txt").read_text(encoding="utf-8")


class PromptSource:
    """Cuts prompts of a given token length out of a corpus with one tokenizer."""

    def __init__(self, tokenizer: PromptTokenizer, corpus: str | None = None) -> None:
        self.tokenizer = tokenizer
        self._text = corpus if corpus is not None else load_corpus()
        self._ids = tokenizer.encode(self._text)
        self._word_starts = [0] + [i + 1 for i, c in enumerate(self._text) if c.isspace()]

    def cut(self, num_tokens: int, rng: np.random.Generator) -> str:
        """A prompt of `num_tokens` tokens starting at a random place (wrapping around the end)."""
        if self.tokenizer.exact:
            return self._cut_exact(int(rng.integers(len(self._ids))), num_tokens)
        start = self._word_starts[int(rng.integers(len(self._word_starts)))]
        return self._cycle_text(start, num_tokens * CHARS_PER_TOKEN)

    def fixed(self, num_tokens: int) -> str:
        """The same text every call: the shared prefix (system prompt) of a run."""
        if self.tokenizer.exact:
            return self._cut_exact(0, num_tokens)
        return self._cycle_text(0, num_tokens * CHARS_PER_TOKEN)

    def _cycle_text(self, start: int, length: int) -> str:
        text = self._text
        out = text[start : start + length]
        while len(out) < length:
            out += "\n\n" + text[: length - len(out) - 2]
        return out[:length]

    def _cut_exact(self, start: int, num_tokens: int) -> str:
        """Decode a slice of the corpus ids, then nudge its length until it re-encodes to exactly n."""
        take = num_tokens
        text = self._decode_cyclic(start, take)
        for _ in range(_MAX_FIXUP_ROUNDS):
            got = self.tokenizer.count(text)
            if got == num_tokens or take < 1:
                break
            take = max(1, take + (num_tokens - got))
            text = self._decode_cyclic(start, take)
        return text

    def _decode_cyclic(self, start: int, count: int) -> str:
        ids = self._ids
        picked: list[int] = []
        pos = start
        while len(picked) < count:
            chunk = ids[pos : pos + count - len(picked)]
            picked.extend(chunk)
            pos = 0
        return self.tokenizer.decode(picked)
