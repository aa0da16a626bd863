"""The EAGLE-3 proposer: step 0 reads the fused target features of accepted positions, deeper steps the head's own
outputs (pre-norm; post-norm for a head with norm_output, as `Eagle3Head.forward` hands them on); chains and trees from
the shared builder (eval/proposers/kit.py)."""

from __future__ import annotations

import torch

from ...core import DraftsmithError
from .kit import ModelProposer, eval_head
from ...heads.eagle3 import Eagle3Head
from ...heads.kit import StaticKVCache


class Eagle3Proposer(ModelProposer):
    """EAGLE-3: step 0 reads fused target features of accepted positions; deeper steps feed the
    head's own outputs (pre-norm, or post-norm with norm_output: the hidden `head.forward` returns). Entry j
    (position j) consumes (h_j, x_{j+1}) and predicts x_{j+2}.

    Cache slots: entry j at slot j (j < n_entries, the committed step-0 entries); draft node i at
    slot n_entries + i."""

    needs_aux = True

    def __init__(self, head, target_vocab_size: int, max_len: int):
        cfg = head.config
        self.head, p = eval_head(head, target_vocab_size, "EAGLE-3")
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
        self._h_nodes: dict[int, torch.Tensor] = {}  # tree node -> the hidden it hands on (head.forward's)

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


def proposer(head: Eagle3Head, target_vocab_size: int, max_len: int) -> Eagle3Proposer:
    """The method table's hook: the decoder's proposer for an EAGLE-3 head."""
    return Eagle3Proposer(head, target_vocab_size, max_len)
