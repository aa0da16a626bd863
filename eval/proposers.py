"""Proposers: what drafts tokens for the decoder. One small interface, so the loop never branches:

    reset(prompt_ids)            forget the last prompt
    update(tokens, aux)          the target emitted `tokens`; aux = its EAGLE-3 features (T, 3H) of the
                                 positions just verified and accepted (the prompt after prefill)
    propose(drafting, sampling, generator) -> Draft (target ids, parents, q or None = one-hot)

Model proposers (EAGLE-3, draft model) share one chain/tree builder: chain = top-1 (greedy) or one
sample from q per depth; tree = top-k children of the best `tree_top_k` frontier nodes per depth,
ranked by cumulative draft log-prob, until `tree_budget` nodes. Tree drafts are deterministic, so
their q is one-hot (None); sampled chains carry the exact q they were drawn from.
"""

from __future__ import annotations

from typing import Optional

import torch

from draftsmith import DraftsmithError
from draftsmith.eval.decoder import Draft, DraftingConfig, SamplingConfig, process_logits
from draftsmith.eval.target_runner import TargetRunner
from draftsmith.heads.eagle3 import StaticKVCache


class Proposer:
    """The interface; also the "none" proposer (target-only decoding)."""

    needs_aux = False
    is_null = True

    def reset(self, prompt_ids: list[int]) -> None:
        pass

    def update(self, tokens: list[int], aux: Optional[torch.Tensor]) -> None:
        pass

    def propose(self, drafting: DraftingConfig, sampling: SamplingConfig, generator=None) -> Draft:
        return Draft.empty()


class NgramProposer(Proposer):
    """Prompt lookup: find the latest earlier occurrence of the last n tokens (n = max..min) and copy
    what followed it. Always a chain (tree mode drafts the same chain), q one-hot."""

    is_null = False

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        if not 1 <= min_ngram <= max_ngram:
            raise DraftsmithError(f"ngram: need 1 <= min_ngram ({min_ngram}) <= max_ngram ({max_ngram}).")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.seq: list[int] = []

    def reset(self, prompt_ids):
        self.seq = list(prompt_ids)

    def update(self, tokens, aux):
        self.seq.extend(tokens)

    def propose(self, drafting, sampling, generator=None):
        k, seq = drafting.num_speculative_tokens, self.seq
        for n in range(min(self.max_ngram, len(seq) - 1), self.min_ngram - 1, -1):
            pattern = seq[-n:]
            for j in range(len(seq) - n - 1, -1, -1):  # latest match first, never the suffix itself
                if seq[j:j + n] == pattern:
                    cont = seq[j + n:j + n + k]
                    return Draft(cont, list(range(-1, len(cont) - 1)))
        return Draft.empty()


class _ModelProposer(Proposer):
    """Chain/tree building on top of three hooks: `_root_logits`, `_expand`, `_to_target`/`_q_target`."""

    is_null = False

    def propose(self, drafting, sampling, generator=None):
        chain = drafting.mode == "chain"
        k = 1 if chain else drafting.tree_top_k
        budget = drafting.num_speculative_tokens if chain else drafting.tree_budget
        sample = chain and not sampling.greedy
        tokens, parents, qs = [], [], []
        self._anc: list[list[int]] = []
        frontier, fscore = [-1], torch.zeros(1, dtype=torch.float64)
        logits = self._root_logits[None]  # (1, Vo)
        for depth in range(1, drafting.num_speculative_tokens + 1):
            if sample:
                probs = process_logits(logits[0], sampling)
                own = torch.multinomial(probs.float(), 1, generator=generator)
                par, score, qs = [frontier[0]], fscore, qs + [self._q_target(probs)]
            else:
                lp = logits.double().log_softmax(-1)  # (m, Vo)
                top = torch.topk(lp, min(k, lp.shape[-1]), dim=-1)
                cand = (fscore[:, None] + top.values).flatten()
                best = torch.topk(cand, min(k, budget - len(tokens), cand.numel())).indices
                own = top.indices.flatten()[best]
                par = [frontier[i] for i in (best // top.values.shape[1]).tolist()]
                score = cand[best]
            new = list(range(len(tokens), len(tokens) + len(par)))
            tokens += self._to_target(own).tolist()
            parents += par
            self._anc += [(self._anc[p] if p >= 0 else []) + [i] for i, p in zip(new, par)]
            if len(tokens) >= budget or depth == drafting.num_speculative_tokens:
                break
            logits = self._expand(new, tokens, parents, depth)
            frontier, fscore = new, score
        return Draft(tokens, parents, torch.stack(qs) if qs else None)

    def _tree_mask(self, nodes: list[int], prefix: int, width: int, device) -> torch.Tensor:
        """(m, width) bool: each node sees the committed prefix [0, prefix) and its ancestors' slots."""
        mask = torch.zeros(len(nodes), width, dtype=torch.bool, device=device)
        mask[:, :prefix] = True
        for r, i in enumerate(nodes):
            mask[r, [prefix + a for a in self._anc[i]]] = True
        return mask


class Eagle3Proposer(_ModelProposer):
    """EAGLE-3: step 0 reads fused target features of accepted positions; deeper steps feed the
    head's own pre-norm outputs. Entry j (position j) consumes (h_j, x_{j+1}) and predicts x_{j+2}."""

    needs_aux = True

    def __init__(self, head, target_vocab_size: int, max_len: int = 2048):
        cfg = head.config
        if cfg.vocab_size != target_vocab_size:
            raise DraftsmithError(f"EAGLE-3 head was built for a vocab of {cfg.vocab_size}, the target has "
                                  f"{target_vocab_size}; use a head trained for this target.")
        self.head = head.eval()
        p = next(head.parameters())
        self.device, self.dtype = p.device, p.dtype
        self.max_len = max_len
        self.V = target_vocab_size
        self.cache = StaticKVCache(1, max_len, cfg.num_key_value_heads, cfg.head_dim, dtype=p.dtype, device=p.device)
        self.draft_ids = head.draft_to_target(torch.arange(cfg.draft_vocab_size, device=p.device))
        self.seq: list[int] = []
        self.n_entries = 0

    def reset(self, prompt_ids):
        self.seq, self.n_entries = list(prompt_ids), 0

    @torch.inference_mode()
    def update(self, tokens, aux):
        self.seq.extend(tokens)
        T = aux.shape[0]
        start = len(self.seq) - 1 - T  # aux rows are positions [start, len(seq)-1)
        pos = torch.arange(start, start + T, device=self.device)
        ids = torch.tensor(self.seq[start + 1:], device=self.device)[None]  # (1, T)
        slots = torch.arange(self.max_len, device=self.device)
        mask = (slots[None, :] <= pos[:, None])[None, None]  # (1, 1, T, S) causal over the cache
        h, logits = self.head(ids, self.head.fuse(aux[None].to(self.device)), pos[None], mask, self.cache, pos)
        self.n_entries = start + T
        self._root_logits, self._root_h = logits[0, -1], h[0, -1]  # entry n-1: predicts x_{n+1}
        self._h_nodes: dict[int, torch.Tensor] = {}  # tree node -> its pre-norm output

    @torch.inference_mode()
    def _expand(self, nodes, tokens, parents, depth):
        base = self.n_entries
        if base + nodes[-1] + 1 > self.max_len:
            raise DraftsmithError(f"EAGLE-3 proposer cache is full (max_len={self.max_len}); raise max_len.")
        hidden = torch.stack([self._h_nodes[parents[i]] if parents[i] >= 0 else self._root_h for i in nodes])[None]
        ids = torch.tensor([tokens[i] for i in nodes], device=self.device)[None]
        pos = torch.full((1, len(nodes)), base - 1 + depth, device=self.device)
        slots = torch.tensor([base + i for i in nodes], device=self.device)
        mask = self._tree_mask(nodes, base, self.max_len, self.device)[None, None]
        h, logits = self.head(ids, hidden, pos, mask, self.cache, slots)
        self._h_nodes.update({i: h[0, r] for r, i in enumerate(nodes)})
        return logits[0]

    def _to_target(self, own_ids):
        return self.head.draft_to_target(own_ids)

    def _q_target(self, probs):
        # the draft softmax scattered through d2t; zero outside the draft vocab
        return torch.zeros(self.V, dtype=probs.dtype, device=probs.device).index_copy_(0, self.draft_ids, probs)


class DraftModelProposer(_ModelProposer):
    """A small HF causal LM sharing the tokenizer, with its own static cache (a TargetRunner)."""

    def __init__(self, model, target_vocab_size: int, max_len: int = 2048):
        self.runner = TargetRunner(model, max_len, None)
        self.V = target_vocab_size
        self.seq: list[int] = []
        self._chain_fed: list[int] = []  # chain tokens whose K/V sit at slot == position already

    def reset(self, prompt_ids):
        self.seq = list(prompt_ids)
        self.runner.reset()
        self._chain_fed = []

    @torch.inference_mode()
    def update(self, tokens, aux):
        reuse = 0  # accepted chain drafts whose K/V already sit at slot == position
        while reuse < min(len(self._chain_fed), len(tokens) - 1) and self._chain_fed[reuse] == tokens[reuse]:
            reuse += 1
        self.seq.extend(tokens)
        start = self.runner.length + reuse
        new = torch.tensor(self.seq[start:], device=self.runner.device)
        pos = torch.arange(start, len(self.seq), device=self.runner.device)
        logits, _ = self.runner.forward(new, pos, start, logits_rows="last")
        self.runner.length = len(self.seq)  # slots [0, len(seq)) hold seq
        self._root_logits = self._fit(logits[0])
        self._chain_fed = []

    @torch.inference_mode()
    def _expand(self, nodes, tokens, parents, depth):
        base = self.runner.length  # committed slots [0, base); node i at slot base + i
        start, width = base + nodes[0], base + nodes[-1] + 1
        if width > self.runner.max_len:
            raise DraftsmithError(f"draft model cache is full (max_len={self.runner.max_len}); raise max_len.")
        mask = self._tree_mask(nodes, base, width, self.runner.device)
        ids = torch.tensor([tokens[i] for i in nodes], device=self.runner.device)
        pos = torch.full((len(nodes),), base - 1 + depth, device=self.runner.device)
        logits, _ = self.runner.forward(ids, pos, start, attn_mask=mask)
        if parents == list(range(-1, len(parents) - 1)):
            self._chain_fed = list(tokens)
        return torch.stack([self._fit(row) for row in logits])

    def _fit(self, logits):
        """The draft model's logits cut or padded (with -inf) to the target vocab."""
        if logits.shape[-1] >= self.V:
            return logits[: self.V]
        return torch.cat([logits, logits.new_full((self.V - logits.shape[-1],), float("-inf"))])

    def _to_target(self, own_ids):
        return own_ids

    def _q_target(self, probs):
        return probs


def make_proposer(kind: str, target, **kw) -> Proposer:
    """kind: "eagle3" (head=Eagle3Head), "draft_model" (model=HF causal LM), "ngram" (max_ngram=3), "none".

    `target` is a Target, a TargetRunner or an HF model (only its vocab size is read). Model proposers
    take max_len=4096: their cache must hold prompt + new tokens + one tree.
    """
    vocab = _vocab_size(target)
    if kind == "none":
        return Proposer()
    if kind == "ngram":
        return NgramProposer(**kw)
    if kind == "eagle3":
        if "head" not in kw:
            raise DraftsmithError("make_proposer('eagle3') needs head=<Eagle3Head>.")
        return Eagle3Proposer(kw["head"], vocab, kw.get("max_len", 4096))
    if kind == "draft_model":
        if "model" not in kw:
            raise DraftsmithError("make_proposer('draft_model') needs model=<HF causal LM>.")
        return DraftModelProposer(kw["model"], vocab, kw.get("max_len", 4096))
    raise DraftsmithError(f"proposer kind {kind!r} is not one of eagle3, draft_model, ngram, none.")


def _vocab_size(target) -> int:
    if hasattr(target, "vocab_size"):
        return int(target.vocab_size)
    return int(target.config.vocab_size)
