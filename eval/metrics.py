"""Pure metric functions: acceptance length, per-position acceptance, tokens/s, speedup, aggregation.

Conventions (stated in every report, see CONVENTIONS):
  tau = tokens emitted / target verifications, the bonus token included (EAGLE / Spec-Bench);
  per-position acceptance[i] = drafts accepted at draft position i / drafts proposed there;
  accepted-length histogram = {tokens emitted by a verification: how many verifications emitted that many};
  speedup = speculative tokens/s / target-only tokens/s, same target, prompts and decoder code.
"""

from __future__ import annotations

import statistics
from collections import Counter
from dataclasses import dataclass, field
from typing import Iterable, Optional, Sequence

CONVENTIONS = (
    "tau (acceptance length) = tokens emitted / target verifications, bonus token included "
    "(EAGLE / Spec-Bench convention; target-only decoding has tau = 1; the prefill and its first token "
    "are not counted). "
    "Per-position acceptance[i] = drafts accepted at draft position i / drafts proposed at position i. "
    "Accepted-length histogram = {tokens emitted by one verification, bonus included: number of verifications}. "
    "Speedup = speculative tokens/s / target-only tokens/s (> 1 is faster), with the same target, the same "
    "prompts and the same decoder code (target-only = the decoder with no proposer). "
    "Tokens/s = new tokens / wall seconds of prefill + decode. "
    "Warm-up prompts are excluded; each prompt's time is the median of the repeated runs. "
    "Cost model: predicted speedup(K) = tau(K) * t_step / (t_verify(K+1) + t_draft(K)), tau(K) = 1 + the sum of "
    "the first K per-position acceptances, t_step and t_verify timed target passes, t_draft the drafter's "
    "seconds per verification in the decode. Greedy divergences from target-only decoding are reported with "
    "the target's top-2 logit margin at the first differing token; below near_tie_eps it is a near-tie."
)


def tau(emitted_tokens: int, verifications: int) -> float:
    """Acceptance length: tokens emitted per target verification (bonus token included)."""
    return emitted_tokens / verifications if verifications else 0.0


def sum_positions(rows: Iterable[Sequence[int]]) -> list[int]:
    """Element-wise sum of per-position counts of possibly different lengths."""
    total: list[int] = []
    for row in rows:
        if len(row) > len(total):
            total += [0] * (len(row) - len(total))
        for i, v in enumerate(row):
            total[i] += v
    return total


def per_position_acceptance(accepted: Sequence[int], proposed: Sequence[int]) -> list[float]:
    """accepted[i] / proposed[i] at each draft position (0.0 where nothing was proposed)."""
    return [a / p if p else 0.0 for a, p in zip(accepted, proposed)]


def tokens_per_s(tokens: int, seconds: float) -> float:
    return tokens / seconds if seconds > 0 else 0.0


def speedup(speculative_tokens_per_s: float, target_only_tokens_per_s: float) -> float:
    """How many times faster the speculative decoder is than target-only decoding."""
    return speculative_tokens_per_s / target_only_tokens_per_s if target_only_tokens_per_s > 0 else 0.0


def median(xs: Sequence[float]) -> float:
    return float(statistics.median(xs)) if xs else 0.0


@dataclass
class Sample:
    """One decoded turn by one method: what it emitted, how it was verified, its median time."""

    category: str
    new_tokens: int  # tokens returned (tokens/s counts these)
    verifications: int  # target forwards after the prefill
    seconds: float
    accepted: list[int] = field(default_factory=list)
    proposed: list[int] = field(default_factory=list)
    # tokens each verification emitted, bonus included (tau counts them); None = one each (target-only)
    emitted_per_verification: Optional[list[int]] = None
    identical: Optional[bool] = None  # greedy: same tokens as target-only decoding
    # greedy, not identical: where the two first differ and the target's top-2 logit margin there (target_runner.divergence)
    divergence: Optional[dict] = None
    draft_seconds: float = 0.0  # median over repeats of the seconds spent in the proposer (the cost model's t_draft)
    # medians over repeats, of `seconds`: the prefill (the prompt pass, the drafter's too), then every step after it,
    # and of those the target's verifications (eval/cost.py's in-decode timings); 0 where not measured (engines)
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    verify_seconds: float = 0.0
    draft_sizes: list[int] = field(default_factory=list)  # draft nodes per verification (first run)
    tokens: list[int] = field(default_factory=list)  # what was emitted (first run): engine=vllm compares outputs
    prompt_ids: list[int] = field(default_factory=list)  # the prompt it answered: engine=vllm decodes the same ids

    @property
    def emitted_tokens(self) -> int:
        if self.emitted_per_verification is None:
            return max(self.new_tokens - 1, 0)
        return sum(self.emitted_per_verification)

    def emitted_counts(self) -> Counter:
        """tokens emitted by a verification -> how many of this sample's verifications emitted that many."""
        if self.emitted_per_verification is None:
            return Counter({1: self.verifications} if self.verifications else {})
        return Counter(self.emitted_per_verification)


def identical_up_to_near_ties(samples: Sequence[Sample], eps: float) -> Optional[float]:
    """Greedy: the fraction of samples identical to target-only decoding or whose first divergence is at a
    near-tie (the target's top-2 logits closer than eps there); None when no sample was compared."""
    checked = [s for s in samples if s.identical is not None]
    if not checked:
        return None
    ok = [s.identical or (s.divergence is not None and s.divergence["margin"] < eps) for s in checked]
    return sum(ok) / len(ok)


def histogram(samples: Sequence[Sample]) -> dict[str, int]:
    """The accepted-length histogram {"n": verifications that emitted n tokens}, n ascending (JSON keys)."""
    total = sum((s.emitted_counts() for s in samples), Counter())
    return {str(n): total[n] for n in sorted(total)}


def aggregate(samples: Sequence[Sample]) -> dict:
    """Totals over samples: tau, per-position acceptance (and counts), tokens/s."""
    tokens = sum(s.new_tokens for s in samples)
    emitted = sum(s.emitted_tokens for s in samples)
    verifications = sum(s.verifications for s in samples)
    seconds = sum(s.seconds for s in samples)
    accepted = sum_positions(s.accepted for s in samples)
    proposed = sum_positions(s.proposed for s in samples)
    return {
        "n": len(samples),
        "new_tokens": tokens,
        "verifications": verifications,
        "seconds": seconds,
        "tau": tau(emitted, verifications),
        "tokens_per_s": tokens_per_s(tokens, seconds),
        "accepted_per_position": accepted,
        "proposed_per_position": proposed,
        "per_position_acceptance": per_position_acceptance(accepted, proposed),
        "accepted_length_histogram": histogram(samples),
    }


def compare(speculative: Sequence[Sample], target_only: Sequence[Sample]) -> dict:
    """Speculative vs target-only on the same samples: tau, tokens/s of both, speedup."""
    spec, base = aggregate(speculative), aggregate(target_only)
    return {
        "n": spec["n"],
        "tau": spec["tau"],
        "new_tokens": spec["new_tokens"],
        "speculative_tokens_per_s": spec["tokens_per_s"],
        "target_only_tokens_per_s": base["tokens_per_s"],
        "speedup": speedup(spec["tokens_per_s"], base["tokens_per_s"]),
        "per_position_acceptance": spec["per_position_acceptance"],
        "accepted_per_position": spec["accepted_per_position"],
        "proposed_per_position": spec["proposed_per_position"],
        "accepted_length_histogram": spec["accepted_length_histogram"],
    }


def by_category(speculative: Sequence[Sample], target_only: Sequence[Sample],
                order: Optional[Sequence[str]] = None) -> dict[str, dict]:
    """`compare` per category; samples are paired by index (same prompt, same turn)."""
    if len(speculative) != len(target_only):
        raise ValueError("speculative and target-only samples must be paired one to one")
    cats = list(order) if order else list(dict.fromkeys(s.category for s in speculative))
    return {c: compare([s for s in speculative if s.category == c], [b for b in target_only if b.category == c])
            for c in cats}
