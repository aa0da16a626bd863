"""Proposers: what drafts tokens for the decoder. Each implements `Proposer` (eval/decoder.py):

    reset(prompt_ids)            forget the last prompt
    update(tokens, aux)          the target emitted `tokens`; aux = its EAGLE-3 features (T, 3H) of the
                                 positions just verified and accepted (the prompt after prefill)
    propose(drafting, sampling, generator) -> Draft (target ids, parents, q or None = one-hot)

Target-only decoding has no proposer (None). The n-gram proposer is eval's own (no training); the
model proposers are built by the method table (draftsmith.methods: `entry.proposer(drafter, V, max_len)`).
P-EAGLE's proposer (K drafts from one drafter forward) is in eval/peagle_proposer.py.

Model proposers (EAGLE-3, draft model) share one chain/tree builder: chain = top-1 (greedy) or one
sample from q per depth; tree = top-k children of the best `tree_top_k` frontier nodes per depth,
ranked by cumulative draft log-prob, until `tree_budget` nodes. Tree drafts are deterministic, so
their q is one-hot (None); sampled chains carry the exact q they were drawn from. A model proposer's
own KV cache holds `max_len` slots (prompt + answer + one tree), and each step attends only to the
slots in use.

Dynamic draft length (`drafting.stop_below`, chain mode): the chain ends with its first token whose drafter
probability is below the threshold (greedy: the softmax of the drafter's logits at its argmax; sampling: q(x)
of the drawn x), so no drafter step is spent on the tokens after it. Only the length depends on the draft,
never q, so the accept rule stays exact. `NgramFirstProposer` (n-gram + head) drafts from a context match when
there is one and from the head otherwise.
"""

from __future__ import annotations

import torch

from draftsmith import DraftsmithError
from draftsmith.eval.decoder import Draft, DraftingConfig
from draftsmith.eval.target_runner import TargetRunner
from draftsmith.heads.eagle3 import StaticKVCache
from draftsmith.sampling import SamplingConfig, process_logits


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
        k, seq = drafting.num_speculative_tokens, self.seq
        for n in range(min(self.ngram_max, len(seq) - 1), self.ngram_min - 1, -1):
            pattern = seq[-n:]
            starts = range(len(seq) - n - 1, -1, -1)  # latest match first, never the suffix itself
            for j in (reversed(starts) if self.match == "earliest" else starts):
                if seq[j:j + n] == pattern:
                    cont = seq[j + n:j + n + k]
                    return Draft(cont, list(range(-1, len(cont) - 1)))
        return Draft.empty()


class _ModelProposer:
    """Chain/tree building on top of hooks: `_root_logits` (set by update), `_expand`, `_to_target`, `_q_target`.

    Vo below is the drafter's own vocabulary (EAGLE-3: its draft vocab; a draft model: the target's).
    """

    needs_aux = False

    def propose(self, drafting: DraftingConfig, sampling: SamplingConfig, generator=None) -> Draft:
        chain = drafting.mode == "chain"
        k = 1 if chain else drafting.tree_top_k  # children drafted per depth
        budget = drafting.num_speculative_tokens if chain else drafting.tree_budget  # nodes in all
        sample = chain and not sampling.greedy  # one child x ~ q per depth; else the best-scoring children
        tokens, parents, qs = [], [], []  # per node: target id, parent node (-1 = root), q over the target vocab
        self._anc: list[list[int]] = []  # per node: its ancestors' indices and its own, root first
        frontier = [-1]  # the m nodes whose children this depth drafts (-1 = the root)
        fscore = torch.zeros(1, dtype=torch.float64)  # (m,) their cumulative draft log-probs
        logits = self._root_logits[None]  # (m, Vo): row i drafts the children of frontier[i]
        for depth in range(1, drafting.num_speculative_tokens + 1):
            if sample:
                probs = process_logits(logits[0], sampling)  # (Vo,)
                own = torch.multinomial(probs.float(), 1, generator=generator)  # (1,) own-vocab id
                par, score, qs = [frontier[0]], fscore, qs + [self._q_target(probs)]
                prob = float(probs[own[0]])  # q(x) of the drawn token
            else:
                lp = logits.double().log_softmax(-1)  # (m, Vo)
                top = torch.topk(lp, min(k, lp.shape[-1]), dim=-1)  # (m, k') each frontier node's best children
                cand = (fscore[:, None] + top.values).flatten()  # (m*k',) cumulative score; child j of row i at i*k'+j
                best = torch.topk(cand, min(k, budget - len(tokens), cand.numel())).indices  # (n,) the kept children
                own = top.indices.flatten()[best]  # (n,) their own-vocab ids
                par = [frontier[i] for i in (best // top.values.shape[1]).tolist()]  # flat index // k' = its row
                score = cand[best]  # (n,)
                prob = float(top.values.flatten()[best[0]].exp())  # a chain's one child: its softmax probability
            new = list(range(len(tokens), len(tokens) + len(par)))  # this depth's node indices
            tokens += self._to_target(own).tolist()
            parents += par
            self._anc += [(self._anc[p] if p >= 0 else []) + [i] for i, p in zip(new, par)]
            if len(tokens) >= budget or depth == drafting.num_speculative_tokens:
                break
            if chain and drafting.stops_at(prob):  # dynamic draft length: no drafter step past an unsure token
                break
            logits = self._expand(new, tokens, parents, depth)  # (n, Vo): the drafter run on the new nodes
            frontier, fscore = new, score
        return Draft(tokens, parents, torch.stack(qs) if qs else None)

    def _tree_mask(self, nodes: list[int], prefix: int, width: int, device) -> torch.Tensor:
        """(m, width) bool: each node sees the committed prefix [0, prefix) and its ancestors' slots (prefix + i)."""
        mask = torch.zeros(len(nodes), width, dtype=torch.bool, device=device)
        mask[:, :prefix] = True
        for r, i in enumerate(nodes):
            mask[r, [prefix + a for a in self._anc[i]]] = True
        return mask


class Eagle3Proposer(_ModelProposer):
    """EAGLE-3: step 0 reads fused target features of accepted positions; deeper steps feed the
    head's own pre-norm outputs. Entry j (position j) consumes (h_j, x_{j+1}) and predicts x_{j+2}.

    Cache slots: entry j at slot j (j < n_entries, the committed step-0 entries); draft node i at
    slot n_entries + i."""

    needs_aux = True

    def __init__(self, head, target_vocab_size: int, max_len: int):
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
        self._check_room(start + T)
        pos = torch.arange(start, start + T, device=self.device)
        ids = torch.tensor(self.seq[start + 1:], device=self.device)[None]  # (1, T)
        slots = torch.arange(start + T, device=self.device)  # the slots in use after this step
        mask = (slots[None, :] <= pos[:, None])[None, None]  # (1, 1, T, start+T) causal over them
        h, logits = self.head(ids, self.head.fuse(aux[None].to(self.device)), pos[None], mask, self.cache, pos)
        self.n_entries = start + T
        self._root_logits, self._root_h = logits[0, -1], h[0, -1]  # entry n-1: predicts x_{n+1}
        self._h_nodes: dict[int, torch.Tensor] = {}  # tree node -> its pre-norm output

    @torch.inference_mode()
    def _expand(self, nodes, tokens, parents, depth):
        base = self.n_entries
        width = base + nodes[-1] + 1  # slots in use: the entries and draft nodes 0..nodes[-1]
        self._check_room(width)
        hidden = torch.stack([self._h_nodes[parents[i]] if parents[i] >= 0 else self._root_h for i in nodes])[None]
        ids = torch.tensor([tokens[i] for i in nodes], device=self.device)[None]  # (1, n)
        pos = torch.full((1, len(nodes)), base - 1 + depth, device=self.device)  # a depth-d node sits d past entry n-1
        slots = torch.tensor([base + i for i in nodes], device=self.device)
        mask = self._tree_mask(nodes, base, width, self.device)[None, None]  # (1, 1, n, width)
        h, logits = self.head(ids, hidden, pos, mask, self.cache, slots)
        self._h_nodes.update({i: h[0, r] for r, i in enumerate(nodes)})
        return logits[0]

    def _check_room(self, width: int) -> None:
        if width > self.max_len:
            raise DraftsmithError(f"EAGLE-3 proposer cache is full (max_len={self.max_len}); raise max_len.")

    def _to_target(self, own_ids):
        return self.head.draft_to_target(own_ids)

    def _q_target(self, probs):
        # the draft softmax scattered through d2t; zero outside the draft vocab
        return torch.zeros(self.V, dtype=probs.dtype, device=probs.device).index_copy_(0, self.draft_ids, probs)


class DraftModelProposer(_ModelProposer):
    """A small HF causal LM sharing the tokenizer, with its own static cache (a TargetRunner)."""

    def __init__(self, model, target_vocab_size: int, max_len: int):
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
        self.runner.commit(len(self.seq))  # slots [0, len(seq)) hold seq
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
