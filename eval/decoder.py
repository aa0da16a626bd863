"""The lossless draft/verify loop: prefill -> (propose -> verify -> accept)* with a static KV cache.

A draft is a tree of target-vocab tokens (a chain is a tree whose node i has parent i-1); the
root is the last emitted token, which the target has not processed yet. One verification runs
[root, draft nodes] through the target with a tree mask and walks down the tree:

  greedy   accept a child iff it equals the target's argmax; the argmax is the correction/bonus.
  sampling accept a child x ~ q with prob min(1, p(x)/q(x)); on rejection p <- norm(max(p-q, 0))
           and the next sibling is tried (recursive rejection sampling); when every child is
           rejected, the correction is sampled from the last residual.

Trees and n-gram drafts are deterministic, so their q is one-hot at the drafted token (q = None):
accept with prob p(x), residual = p with x removed, renormalised; still exactly p.
τ (acceptance length) = tokens emitted per target verification, bonus included.

A proposer (eval/proposers/) is anything with the `Proposer` methods; `proposer=None` is
target-only decoding. The target runner's committed length moves only through `runner.commit`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Optional, Protocol

import torch

from ..core import DraftsmithError
from ..core.engine import NUM_SPECULATIVE_TOKENS
from ..core.sampling import SamplingConfig, process_logits


@dataclass
class DraftingConfig:
    mode: str = "chain"  # chain | tree
    num_speculative_tokens: int = NUM_SPECULATIVE_TOKENS  # K: chain length / tree depth
    tree_top_k: int = 4  # branching
    tree_budget: int = 32  # max draft tokens per step
    # Dynamic draft length (chain mode): a chain ends with its first token whose drafter probability is below
    # this (a DSpark drafter: its confidence head's predicted acceptance, as llama.cpp's draft-dspark); 0 = off,
    # always num_speculative_tokens. Lossless: a sampled token keeps the q it was drawn from.
    stop_below: float = 0.0  # chain drafting: stop before a depth whose top drafter probability is below this (0 = off)

    def __post_init__(self):
        if self.mode not in ("chain", "tree"):
            raise DraftsmithError(f"drafting.mode={self.mode!r} must be 'chain' or 'tree'.")
        if not 1 <= self.num_speculative_tokens <= 64:
            raise DraftsmithError(f"drafting.num_speculative_tokens={self.num_speculative_tokens} must be in 1..64.")
        if self.mode == "tree":
            if not 1 <= self.tree_top_k <= 64:
                raise DraftsmithError(f"drafting.tree_top_k={self.tree_top_k} must be in 1..64.")
            if not 1 <= self.tree_budget <= 512:
                raise DraftsmithError(f"drafting.tree_budget={self.tree_budget} must be in 1..512.")
        if not 0.0 <= self.stop_below < 1.0:
            raise DraftsmithError(f"drafting.stop_below={self.stop_below} must be in [0, 1) (0 = fixed draft length).")
        if self.stop_below > 0 and self.mode == "tree":
            raise DraftsmithError(f"drafting.stop_below={self.stop_below} applies to chain drafting only; with "
                                  f"drafting.mode=tree set it to 0.")

    def stops_at(self, prob: float) -> bool:
        """Dynamic draft length (llama.cpp's --spec-draft-p-min): does a chain stop before a depth whose drafter's top
        probability is `prob`?"""
        return prob < self.stop_below


@dataclass
class Draft:
    """Draft tokens in topological order; parents[i] = -1 for children of the root."""
    tokens: list[int]
    parents: list[int]
    q: Optional[torch.Tensor] = None  # (N, V) draft probs over the target vocab; None = one-hot

    @staticmethod
    def empty() -> "Draft":
        return Draft([], [])


class Proposer(Protocol):
    """What drafts tokens for the decoder (eval/proposers/); the loop never asks which kind it is."""

    needs_aux: bool  # update() reads the target's EAGLE-3 features of the verified positions

    def reset(self, prompt_ids: list[int]) -> None:
        """Forget the last prompt; the next update() follows `prompt_ids`."""

    def update(self, tokens: list[int], aux: Optional[torch.Tensor]) -> None:
        """The target emitted `tokens`; aux (T, 3H) = its features of the positions just verified."""

    def propose(self, drafting: DraftingConfig, sampling: SamplingConfig,
                generator: Optional[torch.Generator] = None) -> Draft:
        """A draft tree (a chain: parents = -1, 0, 1, ...) after everything seen so far."""


@dataclass
class GenerationResult:
    tokens: list[int]  # new tokens only
    n_verifications: int  # target forward passes after prefill
    accepted_per_position: list[int]
    proposed_per_position: list[int]
    prefill_s: float
    decode_s: float
    emitted_per_verification: list[int] = field(default_factory=list)  # of `tokens` (cut at EOS / the cap)
    draft_s: float = 0.0  # of decode_s: seconds in the proposer (propose + update), the cost model's drafting time
    verify_s: float = 0.0  # of decode_s: seconds in `verify` (the target pass, the acceptance walk, the cache commit)
    draft_sizes: list[int] = field(default_factory=list)  # draft nodes sent to each verification (the root excluded)
    prompt_ids: list[int] = field(default_factory=list)  # the prompt this result continues (eval's divergence check)

    @property
    def tau(self) -> float:
        """Tokens emitted per verification, bonus included (the prefill token is not counted)."""
        return sum(self.emitted_per_verification) / max(self.n_verifications, 1)


# ---- the accept rule ------------------------------------------------------------------------

def residual_distribution(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """norm(max(p - q, 0)): what to sample from after a rejection (falls back to p if p == q)."""
    r = (p - q).clamp_min(0)
    s = r.sum()
    return r / s if s > 0 else p


def accept_probability(p: torch.Tensor, q: torch.Tensor, x: int) -> float:
    # x ~ q is kept with prob min(1, p(x)/q(x)); together with the residual on rejection,
    # P(out = y) = min(q(y), p(y)) + (1 - Σ min(p, q)) · norm(max(p - q, 0))(y) = p(y).
    return min(1.0, float(p[x] / q[x])) if q[x] > 0 else 0.0


def _one_hot(x: int, like: torch.Tensor) -> torch.Tensor:
    return torch.zeros_like(like).index_fill_(0, torch.tensor([x], device=like.device), 1.0)


def _sample(p: torch.Tensor, generator: Optional[torch.Generator]) -> int:
    return int(torch.multinomial(p.float() if p.device.type != "cpu" else p, 1, generator=generator))


def _uniform(generator: Optional[torch.Generator]) -> float:
    # on the generator's device: a CUDA generator refuses to fill a CPU tensor
    device = generator.device if generator is not None else None
    return float(torch.rand((), generator=generator, dtype=torch.float64, device=device))


# ---- tree bookkeeping -----------------------------------------------------------------------

def tree_mask(parents: list[int], prefix_len: int, device=None) -> torch.Tensor:
    """(N+1, prefix_len+N+1) bool: the root and N nodes attend to the prefix and their ancestors."""
    n = len(parents)
    anc = torch.zeros(n + 1, n + 1, dtype=torch.bool)
    anc[0, 0] = True
    for i, par in enumerate(parents):  # parents precede children: copy the parent's row, add self
        anc[i + 1] = anc[par + 1]
        anc[i + 1, i + 1] = True
    prefix = torch.ones(n + 1, prefix_len, dtype=torch.bool)
    return torch.cat([prefix, anc], dim=1).to(device)


def node_depths(parents: list[int]) -> list[int]:
    """Depth of each node (children of the root have depth 1)."""
    depth: list[int] = []
    for par in parents:
        depth.append(1 if par < 0 else depth[par] + 1)
    return depth


def _children(parents: list[int]) -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for i, par in enumerate(parents):
        kids.setdefault(par, []).append(i)
    return kids


# ---- the loop -------------------------------------------------------------------------------

def prefill(runner, prompt: torch.Tensor, sampling: SamplingConfig, generator, want_aux: bool):
    """Run the prompt; return (first token, aux features of the prompt or None)."""
    runner.reset()
    positions = torch.arange(prompt.numel(), device=runner.device)
    logits, aux = runner.forward(prompt, positions, 0, logits_rows="last", want_aux=want_aux)
    runner.commit(prompt.numel())
    return _pick(logits[0], sampling, generator), aux


def _pick(logits: torch.Tensor, sampling: SamplingConfig, generator) -> int:
    if sampling.greedy:
        return int(logits.argmax())
    return _sample(process_logits(logits, sampling), generator)


def verify(runner, last_token: int, draft: Draft, sampling: SamplingConfig, generator, want_aux: bool):
    """One target pass over [last_token, draft]; returns (emitted tokens, accepted node path, aux rows)."""
    n = runner.length
    tokens = torch.tensor([last_token] + draft.tokens, device=runner.device)
    depth = [0] + node_depths(draft.parents)
    positions = n + torch.tensor(depth, device=runner.device)
    is_chain = draft.parents == list(range(-1, len(draft.parents) - 1))
    mask = None if is_chain else tree_mask(draft.parents, n, runner.device)
    logits, aux = runner.forward(tokens, positions, n, attn_mask=mask, want_aux=want_aux)
    path, last = _walk(logits, draft, sampling, generator)
    runner.gather([n + 1 + i for i in path], n + 1)  # accepted K/V into place (no-op for chains)
    runner.commit(n + 1 + len(path))  # the root and the accepted path
    emitted = [draft.tokens[i] for i in path] + [last]
    rows = [0] + [i + 1 for i in path]
    return emitted, path, (aux[rows] if aux is not None else None)


def _walk(logits: torch.Tensor, draft: Draft, sampling: SamplingConfig, generator):
    """Walk the tree from the root; return (accepted node indices, correction/bonus token)."""
    kids = _children(draft.parents)
    path: list[int] = []
    if sampling.greedy:
        best = logits.argmax(-1).tolist()  # the target's token after the root / after each node
        cur = -1
        while True:
            nxt = next((c for c in kids.get(cur, []) if draft.tokens[c] == best[cur + 1]), None)
            if nxt is None:
                return path, best[cur + 1]
            path.append(nxt)
            cur = nxt
    probs = process_logits(logits, sampling)  # (N+1, V)
    cur = -1
    while True:
        p = probs[cur + 1]
        for c in kids.get(cur, []):
            x = draft.tokens[c]
            q = draft.q[c] if draft.q is not None else _one_hot(x, p)
            if _uniform(generator) < accept_probability(p, q, x):
                path.append(c)
                break
            p = residual_distribution(p, q)
        else:
            return path, _sample(p, generator)
        cur = path[-1]


def speculative_generate(target_runner, proposer: Optional[Proposer], prompt_ids: torch.Tensor,
                         max_new_tokens: int, sampling: SamplingConfig, drafting: DraftingConfig,
                         eos_token_ids: list[int], generator: Optional[torch.Generator] = None) -> GenerationResult:
    """Generate up to `max_new_tokens` after `prompt_ids` (1-D); proposer None = target-only decoding."""
    runner = target_runner
    prompt = prompt_ids.to(runner.device).long().flatten()
    if max_new_tokens < 1:
        raise DraftsmithError(f"max_new_tokens={max_new_tokens} must be >= 1.")
    if prompt.numel() < 1 or prompt.numel() + max_new_tokens > runner.max_len:
        raise DraftsmithError(f"prompt ({prompt.numel()} tokens) + max_new_tokens ({max_new_tokens}) must fit "
                              f"the runner's max_len={runner.max_len}; raise max_len.")
    want_aux = proposer is not None and proposer.needs_aux
    if want_aux and not runner.aux_layer_ids:
        raise DraftsmithError("this proposer reads EAGLE-3 features: build the TargetRunner with aux_layer_ids "
                              "(Target.aux_layer_ids).")
    eos = set(eos_token_ids)
    num_speculative_tokens = drafting.num_speculative_tokens
    accepted, proposed = [0] * num_speculative_tokens, [0] * num_speculative_tokens

    t0 = time.perf_counter()
    first, aux = prefill(runner, prompt, sampling, generator, want_aux)
    out = [first]
    if proposer is not None:
        proposer.reset(prompt.tolist())
        proposer.update([first], aux)
    t1 = time.perf_counter()

    n_ver, per_ver, sizes, draft_s, verify_s = 0, [], [], 0.0, 0.0
    while out[-1] not in eos and len(out) < max_new_tokens:
        room = min(max_new_tokens - len(out) - 1, runner.max_len - runner.length - 1)
        td = time.perf_counter()
        draft = _propose(proposer, drafting, sampling, generator, room)
        draft_s += time.perf_counter() - td
        tv = time.perf_counter()
        emitted, path, aux = verify(runner, out[-1], draft, sampling, generator, want_aux)
        verify_s += time.perf_counter() - tv
        n_ver += 1
        per_ver.append(len(emitted))
        sizes.append(len(draft.tokens))
        depths = node_depths(draft.parents)
        for d in set(depths):
            proposed[d - 1] += 1
        for d in range(len(path)):
            accepted[d] += 1
        out.extend(emitted)
        if any(t in eos for t in emitted) or len(out) >= max_new_tokens:
            break
        if proposer is not None:
            td = time.perf_counter()
            proposer.update(emitted, aux)
            draft_s += time.perf_counter() - td
    t2 = time.perf_counter()

    out = _truncate(out, eos, max_new_tokens)
    if per_ver:  # only the last verification can run past EOS / the cap
        per_ver[-1] -= 1 + sum(per_ver) - len(out)
    return GenerationResult(tokens=out, n_verifications=n_ver, accepted_per_position=accepted,
                            proposed_per_position=proposed, prefill_s=t1 - t0, decode_s=t2 - t1,
                            emitted_per_verification=per_ver, draft_s=draft_s, verify_s=verify_s, draft_sizes=sizes,
                            prompt_ids=prompt.tolist())


def _propose(proposer: Optional[Proposer], drafting: DraftingConfig, sampling: SamplingConfig, generator,
             room: int) -> Draft:
    if proposer is None or room < 1:
        return Draft.empty()
    draft = proposer.propose(drafting, sampling, generator)
    if len(draft.tokens) > room:  # near the end of the budget: keep only the nodes that fit
        keep = [i for i, dep in enumerate(node_depths(draft.parents)) if dep <= room][:room]
        new_index = {old: new for new, old in enumerate(keep)} | {-1: -1}  # parents precede children
        draft = Draft([draft.tokens[i] for i in keep], [new_index[draft.parents[i]] for i in keep],
                      draft.q[keep] if draft.q is not None else None)
    return draft


def _truncate(out: list[int], eos: set[int], max_new_tokens: int) -> list[int]:
    for i, t in enumerate(out):
        if t in eos:
            out = out[: i + 1]
            break
    return out[:max_new_tokens]
