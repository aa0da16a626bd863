"""Quality filters for self-written prompts and regenerated answers (Magpie-style clean-up).

A 135M target writing its own prompts often writes run-on nonsense, lists of names, text in a
mix of scripts, or one sentence again and again until the token limit. These cheap checks drop
such text without any model:

  duplicate    exact (normalised text) or near duplicate of a prompt already kept: word 3-gram
               Jaccard similarity >= near_dup, found by MinHash banding and then checked exactly
  unfinished   a self-written prompt that ran into max_prompt_tokens instead of ending its turn
  length       fewer than min_words words (or more than max_words)
  repetition   the share of repeated word n-grams is above max_repetition
  language     language=en: no undecodable bytes or control characters (at most 2 %), at least
               min_latin of the letters Latin and at least min_stopwords of the words English
               function words (code blocks are skipped)

Self-written prompts that fail are resampled (data_gen/prompts.py); a sample whose regenerated
answer fails is dropped (data_gen/run.py). The manifest's counts say how many each filter dropped:
`filtered_prompts_<reason>` and `filtered_answers_<reason>`.
"""

from __future__ import annotations

import random
import re
import unicodedata
import zlib

REASONS = ("duplicate", "unfinished", "length", "repetition", "language")
PROMPT_KEYS = tuple(f"filtered_prompts_{r}" for r in REASONS)
ANSWER_KEYS = tuple(f"filtered_answers_{r}" for r in REASONS if r not in ("duplicate", "unfinished"))

WORD = re.compile(r"\w+(?:'\w+)?", re.UNICODE)
CODE_BLOCK = re.compile(r"```.*?(?:```|\Z)", re.DOTALL)
# The 150 most common English function words: about half the words of ordinary English prose,
# few of a list of names, of code or of text in another language.
EN_STOPWORDS = frozenset("""
a about above after again against all also am an and any are as at be because been before being below
between both but by can could did do does doing down during each few for from further had has have having
he her here hers herself him himself his how i if in into is it its itself just let me more most my myself
no nor not now of off on once only or other our ours ourselves out over own please same she should so some
such than that the their theirs them themselves then there these they this those through to too under
until up very was we were what when where which while who whom why will with would you your yours
yourself yourselves i'm it's don't can't what's i'd i've you're let's there's that's need want help tell
give make write explain
""".split())


def words(text: str) -> list[str]:
    return WORD.findall(text.lower())


def prose(text: str) -> str:
    """The text without fenced code blocks (code repeats itself and has few English words by nature)."""
    return CODE_BLOCK.sub(" ", text)


def normalise(text: str) -> str:
    """Lower case, words only: `What is 2+2?` and `what is 2 + 2` are exact duplicates."""
    return " ".join(words(text))


def repeated_ngram_ratio(text: str, n: int = 3) -> float:
    """Share of the word n-grams that repeat an earlier one (0 = none; a sentence said 10 times ~0.9)."""
    w = words(text)
    grams = [tuple(w[i:i + n]) for i in range(len(w) - n + 1)]
    if not grams:
        return 0.0
    return 1.0 - len(set(grams)) / len(grams)


def latin_ratio(text: str) -> float:
    """Share of the letters that are Latin (ASCII or accented Latin); 1.0 for text without letters."""
    letters = [c for c in text if c.isalpha()]
    if not letters:
        return 1.0
    return sum(c.isascii() or "LATIN" in unicodedata.name(c, "") for c in letters) / len(letters)


def broken_ratio(text: str) -> float:
    """Share of the characters that are no text: undecodable bytes (U+FFFD), control or unassigned characters."""
    if not text:
        return 0.0
    bad = sum(c == "\ufffd" or (unicodedata.category(c) in ("Cc", "Cs", "Co", "Cn") and c not in "\n\r\t")
              for c in text)
    return bad / len(text)


def stopword_ratio(text: str) -> float:
    w = words(text)
    return sum(x in EN_STOPWORDS for x in w) / len(w) if w else 0.0


def text_reason(text: str, cfg, min_words: int, max_words=None) -> str | None:
    """Why `text` fails the length, repetition or language filter of `cfg` (a FiltersConfig), or None."""
    body = prose(text)
    n_words = len(words(text))
    if n_words < min_words or (max_words is not None and n_words > max_words):
        return "length"
    if cfg.max_repetition is not None and repeated_ngram_ratio(body, cfg.repetition_n) > cfg.max_repetition:
        return "repetition"
    if cfg.language == "en":
        # (short texts say too little about their language: only their letters are checked)
        if broken_ratio(body) > 0.02 or latin_ratio(body) < cfg.min_latin or (len(words(body)) >= 8 and stopword_ratio(body) < cfg.min_stopwords):
            return "language"
    return None


# --- near duplicates: MinHash over word 3-grams, banded ---------------------------------------

_PRIME = (1 << 61) - 1
_BANDS, _ROWS = 8, 4  # 32 hashes; pairs with Jaccard >= ~0.6 very likely share a band


def shingles(text: str, n: int = 3) -> set[str]:
    w = words(text)
    return {" ".join(w[i:i + n]) for i in range(max(len(w) - n + 1, 1))} if w else set()


def jaccard(a: set, b: set) -> float:
    return len(a & b) / len(a | b) if a or b else 1.0


class Deduper:
    """Remembers the kept texts; `check(text)` says duplicate / near duplicate or keeps the text.

    Near duplicates are found by MinHash banding (candidates) and confirmed by their exact Jaccard
    similarity, so no pair below `near_dup` is ever called a duplicate. Deterministic (crc32, a fixed
    seed), so a rerun keeps the same prompts.
    """

    def __init__(self, near_dup: float | None):
        self.near_dup = near_dup
        self.exact: set[str] = set()
        self.kept: list[set[str]] = []
        self.bands: dict[tuple, list[int]] = {}
        rng = random.Random(0)
        self.hashes = [(rng.randrange(1, _PRIME), rng.randrange(_PRIME)) for _ in range(_BANDS * _ROWS)]

    def _signature(self, grams: set[str]) -> list[int]:
        x = [zlib.crc32(g.encode()) for g in sorted(grams)]
        return [min((a * v + b) % _PRIME for v in x) for a, b in self.hashes]

    def check(self, text: str) -> bool:
        """True (and remembered) when `text` is new; False for a duplicate of a kept text."""
        key = normalise(text)
        if key in self.exact:
            return False
        grams = shingles(text)
        band_keys = []
        if self.near_dup is not None and grams:
            sig = self._signature(grams)
            band_keys = [(k, tuple(sig[k * _ROWS:(k + 1) * _ROWS])) for k in range(_BANDS)]
            candidates = {i for bk in band_keys for i in self.bands.get(bk, ())}
            if any(jaccard(grams, self.kept[i]) >= self.near_dup for i in candidates):
                return False
        self.exact.add(key)
        for bk in band_keys:
            self.bands.setdefault(bk, []).append(len(self.kept))
        self.kept.append(grams)
        return True


# --- the two uses --------------------------------------------------------------------------------

class PromptFilter:
    """Self-written prompts: `reason(text, finished)` is None for a prompt to keep (and remembers it)."""

    def __init__(self, cfg):
        self.cfg = cfg
        self.dedup = Deduper(cfg.near_dup)
        self.dropped = {k: 0 for k in PROMPT_KEYS}

    def reason(self, text: str, finished: bool) -> str | None:
        why = None
        if not text.strip():
            why = "length"
        elif self.cfg.drop_unfinished and not finished:
            why = "unfinished"
        else:
            why = text_reason(text, self.cfg, self.cfg.min_words, self.cfg.max_words)
        if why is None and not self.dedup.check(text):
            why = "duplicate"
        if why is not None:
            self.dropped[f"filtered_prompts_{why}"] += 1
        return why


def answer_reason(text: str, cfg) -> str | None:
    """Why a regenerated answer fails (length, repetition, language), or None."""
    return text_reason(text, cfg, cfg.min_answer_words)


def filter_answers(samples: list[dict], cfg) -> tuple[list[dict], dict]:
    """The samples whose every assistant turn passes `cfg`; and how many each filter dropped."""
    dropped = {k: 0 for k in ANSWER_KEYS}
    kept = []
    for s in samples:
        why = next((r for m in s["messages"] if m["role"] == "assistant"
                    for r in [answer_reason(m["content"], cfg)] if r), None)
        if why is None:
            kept.append(s)
        else:
            dropped[f"filtered_answers_{why}"] += 1
    return kept, dropped
