"""eval's own n-gram proposer (prompt lookup, no training) and n-gram + head (`ngram_first=true`): a chain copied
from the context when it has a match, the head's draft otherwise."""

from __future__ import annotations

from ...core import DraftsmithError
from ...core.engine import Engines
from ..decoder import Draft, DraftingConfig
from ...core.sampling import SamplingConfig

# prompt lookup in the engines (eval's own method: no folder, no row in draftsmith.core.methods)
NGRAM_ENGINES = Engines(vllm="ngram", sglang="NGRAM", draft_folder=False, llamacpp="ngram-simple")

NGRAM_MATCHES = ("latest", "earliest")  # which occurrence of the suffix a draft copies from (earliest = vLLM's)


class NgramProposer:
    """Prompt lookup: find an earlier occurrence of the last n tokens (n = ngram_max..ngram_min, longest first)
    and copy what followed it: the latest occurrence, or with match="earliest" the first one, as vLLM's
    `ngram` method does (vllm/v1/spec_decode/ngram_proposer.py). Always a chain (tree mode drafts the same
    chain), q one-hot."""

    needs_aux = False

    def __init__(self, ngram_max: int, ngram_min: int, match: str = "latest"):
        if not 1 <= ngram_min <= ngram_max:
            raise DraftsmithError(f"ngram: need 1 <= ngram_min ({ngram_min}) <= ngram_max ({ngram_max}).")
        if match not in NGRAM_MATCHES:
            raise DraftsmithError(f"ngram_match={match!r} is not one of {', '.join(NGRAM_MATCHES)}.")
        self.ngram_max, self.ngram_min, self.match = ngram_max, ngram_min, match
        self.seq: list[int] = []

    def reset(self, prompt_ids):
        self.seq = list(prompt_ids)

    def update(self, tokens, aux):
        self.seq.extend(tokens)

    def propose(self, drafting: DraftingConfig, sampling: SamplingConfig, generator=None) -> Draft:
        num_speculative_tokens, seq = drafting.num_speculative_tokens, self.seq
        for n in range(min(self.ngram_max, len(seq) - 1), self.ngram_min - 1, -1):
            pattern = seq[-n:]
            starts = range(len(seq) - n - 1, -1, -1)  # latest match first, never the suffix itself
            for j in (reversed(starts) if self.match == "earliest" else starts):
                if seq[j:j + n] == pattern:
                    cont = seq[j + n:j + n + num_speculative_tokens]
                    return Draft(cont, list(range(-1, len(cont) - 1)))
        return Draft.empty()


class NgramFirstProposer:
    """n-gram + head: a chain copied from the context (NgramProposer's suffix match) when the context has a
    match, the head's draft otherwise. Both see every emitted token (the head's cache must follow the sequence
    even in cycles it does not draft), so the head's `update` cost is paid every cycle. Lossless: which of the
    two drafts depends only on the committed sequence, and each draft carries its own q (n-gram: one-hot)."""

    def __init__(self, ngram: NgramProposer, head):
        self.ngram, self.head = ngram, head
        self.needs_aux = head.needs_aux
        self.drafted_by = {"ngram": 0, "head": 0}  # cycles drafted by each (for reports and benchmarks)

    def reset(self, prompt_ids):
        self.ngram.reset(prompt_ids)
        self.head.reset(prompt_ids)

    def update(self, tokens, aux):
        self.ngram.update(tokens, aux)
        self.head.update(tokens, aux)

    def propose(self, drafting: DraftingConfig, sampling: SamplingConfig, generator=None) -> Draft:
        draft = self.ngram.propose(drafting, sampling, generator)
        if draft.tokens:
            self.drafted_by["ngram"] += 1
            return draft
        self.drafted_by["head"] += 1
        return self.head.propose(drafting, sampling, generator)
