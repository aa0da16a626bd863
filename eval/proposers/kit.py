"""The chain/tree builder every model proposer shares (eval/proposers/<method>.py subclass `ModelProposer`).

chain = top-1 (greedy) or one sample from q per depth; tree = top-k children of the best `tree_top_k` frontier
nodes per depth, ranked by cumulative draft log-prob, until `tree_budget` nodes. Tree drafts are deterministic, so
their q is one-hot (None); sampled chains carry the exact q they were drawn from. A model proposer's own KV cache
holds `max_len` slots (prompt + answer + one tree), and each step attends only to the slots in use.

Dynamic draft length (`drafting.stop_below`, chain mode): the chain ends with its first token whose drafter
probability is below the threshold (greedy: the softmax of the drafter's logits at its argmax; sampling: q(x)
of the drawn x), so no drafter step is spent on the tokens after it. Only the length depends on the draft,
never q, so the accept rule stays exact.
"""

from __future__ import annotations

import torch

from draftsmith.core import DraftsmithError
from draftsmith.eval.decoder import Draft, DraftingConfig
from draftsmith.core.sampling import SamplingConfig, process_logits


class ModelProposer:
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
        fscore = torch.zeros(1, dtype=torch.float64, device=self._root_logits.device)  # (m,) their cumulative draft log-probs
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


def eval_head(head, target_vocab_size: int, method: str):
    """(the head in eval mode, one of its parameters: its device and dtype); refused when it was made for another
    vocab than the target's."""
    if head.config.vocab_size != target_vocab_size:
        raise DraftsmithError(f"{method} head was built for a vocab of {head.config.vocab_size}, the target has "
                              f"{target_vocab_size}; use a head trained for this target.")
    return head.eval(), next(head.parameters())
