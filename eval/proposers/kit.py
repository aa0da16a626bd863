"""The chain/tree builder every model proposer shares (eval/proposers/<method>.py subclass `ModelProposer`), and
the one-forward chain proposer (`OneForwardProposer`, with its chain sampler `sample_chain`) for drafters that
draft all K rows of a chain in one forward, and the block drafter's forward (`BlockProposer`: DFlash's, DSpark's).

chain = top-1 (greedy) or one sample from q per depth; tree = top-k children of the best `tree_top_k` frontier
nodes per depth, ranked by cumulative draft log-prob, until `tree_budget` nodes. Tree drafts are deterministic, so
their q is one-hot (None); sampled chains carry the exact q they were drawn from. A model proposer's own KV cache
holds `max_len` slots (prompt + answer + one tree), and each step attends only to the slots in use.

Dynamic draft length (`drafting.stop_below`, chain mode), llama.cpp's `--spec-draft-p-min` rule: the chain stops
before its first depth whose drafter is unsure, i.e. whose TOP probability (the largest entry of q after
temperature / top-k / top-p; greedy: the softmax of the drafter's logits at its argmax) is below the threshold. That
depth's token is not drafted and no drafter step is spent past it; an unsure first depth gives an empty draft, and
the cycle is a plain target step. The decision reads q only, never the draw, and the kept depths' q are unchanged,
so the accept rule stays exact (lossless).

A one-forward drafter computes the K rows of its chain at once, row d independent of the tokens drafted before
it: `sample_chain` takes each row's argmax (greedy) or one draw from the row's own q (sampling, q returned), and
cuts the chain before its first row whose top probability is below `drafting.stop_below`; the forward is already
paid, so only verification width is saved.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from ...core import DraftsmithError
from ..decoder import Draft, DraftingConfig
from ...heads.kit import StaticKVCache
from ...core.sampling import SamplingConfig, process_logits


class ModelProposer:
    """Chain/tree building on top of hooks: `_root_logits` (set by update), `_expand`, `_to_target`, `_q_target`.

    Vo below is the drafter's own vocabulary (EAGLE-3: its draft vocab; a draft model: the target's).
    """

    needs_aux = False
    one_forward = False  # a drafter step per depth: its cost grows with K (eval/cost.py cost_table)
    # the hooks, given by the subclass
    _root_logits: torch.Tensor  # (Vo,) the root's drafter logits, set by `update`
    _expand: Callable[[list[int], list[int], list[int], int], torch.Tensor]  # (new nodes, tokens, parents, depth) ->
    #                                                                          (n, Vo): the drafter run on them
    _to_target: Callable[[torch.Tensor], torch.Tensor]  # own-vocab ids -> target ids
    _q_target: Callable[[torch.Tensor], torch.Tensor]  # probs over Vo -> q over the target vocab

    def propose(self, drafting: DraftingConfig, sampling: SamplingConfig, generator=None) -> Draft:
        chain = drafting.mode == "chain"
        children = 1 if chain else drafting.tree_top_k  # children drafted per depth
        budget = drafting.num_speculative_tokens if chain else drafting.tree_budget  # nodes in all
        sample = chain and not sampling.greedy  # one child x ~ q per depth; else the best-scoring children
        tokens: list[int] = []  # per node: target id, parent node (-1 = root), q over the target vocab
        parents: list[int] = []
        qs: list[torch.Tensor] = []
        self._anc: list[list[int]] = []  # per node: its ancestors' indices and its own, root first
        frontier = [-1]  # the m nodes whose children this depth drafts (-1 = the root)
        fscore = torch.zeros(1, dtype=torch.float64, device=self._root_logits.device)  # (m,) their cumulative draft log-probs
        logits = self._root_logits[None]  # (m, Vo): row i drafts the children of frontier[i]
        for depth in range(1, drafting.num_speculative_tokens + 1):
            if sample:
                probs = process_logits(logits[0], sampling)  # (Vo,)
                if drafting.stops_at(float(probs.max())):  # dynamic draft length: the drafter is unsure here
                    break
                own = torch.multinomial(probs.float(), 1, generator=generator)  # (1,) own-vocab id
                par, score, qs = [frontier[0]], fscore, qs + [self._q_target(probs)]
            else:
                lp = logits.double().log_softmax(-1)  # (m, Vo)
                top = torch.topk(lp, min(children, lp.shape[-1]), dim=-1)  # (m, k') each frontier node's best children
                if chain and drafting.stops_at(float(top.values[0, 0].exp())):  # dynamic draft length (its argmax)
                    break
                cand = (fscore[:, None] + top.values).flatten()  # (m*k',) cumulative score; child j of row i at i*k'+j
                best = torch.topk(cand, min(children, budget - len(tokens), cand.numel())).indices  # (n,) kept children
                own = top.indices.flatten()[best]  # (n,) their own-vocab ids
                par = [frontier[i] for i in (best // top.values.shape[1]).tolist()]  # flat index // k' = its row
                score = cand[best]  # (n,)
            new = list(range(len(tokens), len(tokens) + len(par)))  # this depth's node indices
            tokens += self._to_target(own).tolist()
            parents += par
            self._anc += [(self._anc[p] if p >= 0 else []) + [i] for i, p in zip(new, par)]
            if len(tokens) >= budget or depth == drafting.num_speculative_tokens:
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


def eval_head(head, target_vocab_size: int, method: str):
    """(the head in eval mode, one of its parameters: its device and dtype); refused when it was made for another
    vocab than the target's."""
    if head.config.vocab_size != target_vocab_size:
        raise DraftsmithError(f"{method} head was built for a vocab of {head.config.vocab_size}, the target has "
                              f"{target_vocab_size}; use a head trained for this target.")
    return head.eval(), next(head.parameters())


def sample_chain(logits: torch.Tensor, draft_ids: torch.Tensor, target_vocab_size: int, drafting: DraftingConfig,
                 sampling: SamplingConfig, generator=None) -> Draft:
    """The chain drafted from K rows of draft logits (K, Vd) computed in one forward (row d drafts depth d+1):
    argmax or one draw per row, q over the target vocab when sampled, cut before the first row whose top probability
    is below `drafting.stop_below` (so possibly empty)."""
    num_speculative_tokens = drafting.num_speculative_tokens
    if sampling.greedy:
        own = logits.argmax(-1)
        q = None
        top = logits.float().softmax(-1).max(-1).values  # (K,) each row's top probability (its argmax's)
    else:
        probs = torch.stack([process_logits(row, sampling) for row in logits])  # (K, Vd)
        own = torch.multinomial(probs.float(), 1, generator=generator)[:, 0]
        q = torch.zeros(num_speculative_tokens, target_vocab_size, dtype=probs.dtype, device=probs.device)
        q.index_copy_(1, draft_ids, probs)  # (K, V)
        top = probs.max(-1).values  # (K,) each row's top probability (read before, and apart from, the draw)
    # dynamic length
    n = next((d for d, pr in enumerate(top.tolist()) if drafting.stops_at(pr)), num_speculative_tokens)
    return Draft(draft_ids[own[:n]].tolist(), list(range(-1, n - 1)), q[:n] if q is not None and n else None)


class OneForwardProposer:
    """A proposer whose drafter drafts the whole chain in one forward per cycle, on the target's features.

    Holds the drafter's KV cache (`max_len` slots), the committed sequence and the features not yet in the cache;
    a subclass gives `_check_num_speculative_tokens(num_speculative_tokens)` (refuse a K the drafter was not trained
    for) and `_forward(num_speculative_tokens)` (the K rows of draft logits, (K, Vd)). Tree mode drafts the same chain.
    """

    needs_aux = True
    one_forward = True  # one drafter forward per cycle whatever K (eval/cost.py cost_table)

    def __init__(self, head, target_vocab_size: int, max_len: int, method: str):
        cfg = head.config
        self.head, p = eval_head(head, target_vocab_size, method)
        self.method, self.device = method, p.device
        self.max_len, self.V = max_len, target_vocab_size
        self.caches = [StaticKVCache(1, max_len, cfg.num_key_value_heads, cfg.head_dim, dtype=p.dtype, device=p.device)
                       for _ in head.layers]
        self.draft_ids = head.draft_to_target(torch.arange(cfg.draft_vocab_size, device=p.device))
        self.seq: list[int] = []
        self.pending: Optional[torch.Tensor] = None  # (T, 3H_t) features of positions not yet in the cache

    def reset(self, prompt_ids):
        self.seq, self.pending = list(prompt_ids), None

    def update(self, tokens, aux):
        """Only bookkeeping: the new features go into the cache in the next `propose`, with the draft rows."""
        self.seq.extend(tokens)
        self.pending = aux if self.pending is None else torch.cat([self.pending, aux])

    @torch.inference_mode()
    def propose(self, drafting: DraftingConfig, sampling: SamplingConfig, generator=None) -> Draft:
        num_speculative_tokens = drafting.num_speculative_tokens
        self._check_num_speculative_tokens(num_speculative_tokens)
        logits = self._forward(num_speculative_tokens)  # (K, Vd)
        return sample_chain(logits, self.draft_ids, self.V, drafting, sampling, generator)

    def _pending_rows(self) -> torch.Tensor:
        """The pending features (T, 3H_t), there from the first `update` on (the decoder's first call after reset)."""
        assert self.pending is not None, f"{self.method} proposer: propose before update"
        return self.pending

    def _pending_span(self) -> tuple[int, int, int]:
        """(L, T, start): the committed length, the pending feature rows, the first pending position."""
        L, T = len(self.seq), self._pending_rows().shape[0]
        return L, T, L - 1 - T  # the pending rows are positions [start, L-1)

    def _slots_in_use(self, width: int) -> int:
        """`width`, refused when the cache has fewer slots."""
        if width > self.max_len:
            raise DraftsmithError(f"{self.method} proposer cache is full (max_len={self.max_len}); raise max_len.")
        return width

    def _check_num_speculative_tokens(self, num_speculative_tokens: int) -> None:
        raise NotImplementedError

    def _forward(self, num_speculative_tokens: int) -> torch.Tensor:
        raise NotImplementedError


class BlockProposer(OneForwardProposer):
    """A one-forward proposer whose drafter is the block drafter (heads/block.py: DFlash's, DSpark's).

    After the target verified and emitted tokens, the sequence is x_0 .. x_{L-1}; the target's features are known
    for positions up to L-2 and x_{L-1} (the bonus / correction token) is the root of the next draft. One forward
    runs the context (the features verified since the last cycle, start .. L-2: keys / values only, written to the
    cache at slot = position, once) and the queries [x_{L-1}, mask, ..., mask] at positions L-1 .. L-1+K (cache
    slots L-1 .. L-1+K); every query sees every slot in use. The mask query at L-1+k drafts x_{L-1+k}. The query
    slots are overwritten by the next cycle's context, and nothing past the slots in use is ever read."""

    def _check_num_speculative_tokens(self, num_speculative_tokens: int) -> None:
        """Mask slots past the trained block were never trained: refuse, do not guess."""
        if num_speculative_tokens > self.head.block_size - 1:
            raise DraftsmithError(f"K={num_speculative_tokens} (drafting.num_speculative_tokens or sweep_k) is more "
                                  f"than the {self.head.block_size - 1} tokens a block of this {self.method} head "
                                  f"drafts (block_size {self.head.block_size} in its config.json); draft at most "
                                  f"{self.head.block_size - 1}, or train with method.block_size={num_speculative_tokens + 1}.")

    def _block(self, num_speculative_tokens: int) -> torch.Tensor:
        """Write the pending context and run the block [x_{L-1}, K masks] in one forward: its pre-norm hidden
        (K+1, H), row 0 the bonus token's, row d the mask query that drafts depth d."""
        L, T, start = self._pending_span()  # the pending rows are positions [start, L-1)
        width = self._slots_in_use(L + num_speculative_tokens)  # context 0 .. L-2, the block L-1 .. L-1+K
        ids = torch.tensor([self.seq[-1]] + [self.head.mask_token_id] * num_speculative_tokens,
                           device=self.device)[None]  # (1, K+1)
        block_pos = torch.arange(L - 1, width, device=self.device)  # (K+1,)
        context = self.head.context(self._pending_rows()[None].to(self.device)) if T else None  # (1, T, H)
        ctx_pos = torch.arange(start, L - 1, device=self.device)  # (T,)
        # every slot in use, both ways
        mask = torch.ones(1, 1, num_speculative_tokens + 1, width, dtype=torch.bool, device=self.device)
        h = self.head.trunk(ids, block_pos[None], context, ctx_pos[None] if T else None, mask, self.caches,
                            torch.cat([ctx_pos, block_pos]) if T else block_pos)
        self.pending = self._pending_rows()[:0]  # the context now sits in the cache
        return h[0]

