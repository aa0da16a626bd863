"""The MTP proposer: the target's own MTP layer drafts with its own KV cache over the committed sequence, step 0 from
the target's hidden states of the verified positions (the one the engine feeds: heads/mtp.py `engine_hidden`), deeper
steps from the layer's own outputs, as vLLM's MiMoMTP drafts; chains and trees from the shared builder
(eval/proposers/kit.py). Lossless like every proposer: the decoder verifies every draft."""

from __future__ import annotations

import torch

from ...core import DraftsmithError
from .kit import ModelProposer, eval_head
from ...heads.kit import StaticKVCache
from ...heads.mtp import MTPDrafter


class MTPProposer(ModelProposer):
    """Entry j (position j) reads (h_j, x_{j+1}) and drafts x_{j+2}; a depth-d draft node reads its parent's output
    and its own token at position n-1+d (n entries). Cache slots: entry j at slot j, draft node i at n + i (stale
    slots are overwritten by the next update, never read)."""

    needs_aux = True  # the target's hidden_states[N] of the verified positions (the mtp row's aux_layer_ids)

    def __init__(self, drafter: MTPDrafter, target_vocab_size: int, max_len: int):
        cfg = drafter.config
        self.drafter, p = eval_head(drafter, target_vocab_size, "MTP")
        self.device, self.max_len, self.V = p.device, max_len, target_vocab_size
        self.cache = StaticKVCache(1, max_len, cfg.num_key_value_heads, cfg.head_dim, dtype=p.dtype, device=p.device)
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
        ids = torch.tensor(self.seq[start + 1:], device=self.device)[None]  # (1, T): x_{j+1}
        slots = torch.arange(start + T, device=self.device)
        mask = (slots[None, :] <= pos[:, None])[None, None]  # (1, 1, T, start+T) causal over the entries
        hidden = self.drafter.engine_hidden(aux[None].to(self.device, self.cache.k_cache.dtype))  # (1, T, H)
        h, logits = self.drafter(ids, hidden, pos[None], mask, self.cache, pos)
        self.n_entries = start + T
        self._root_logits, self._root_h = logits[0, -1], h[0, -1]  # entry n-1 drafts x_{n+1}
        self._h_nodes: dict[int, torch.Tensor] = {}  # draft node -> the output it hands on

    @torch.inference_mode()
    def _expand(self, nodes, tokens, parents, depth):
        base = self.n_entries
        width = base + nodes[-1] + 1  # slots in use: the entries and draft nodes 0..nodes[-1]
        self._check_room(width)
        hidden = torch.stack([self._h_nodes[parents[i]] if parents[i] >= 0 else self._root_h for i in nodes])[None]
        ids = torch.tensor([tokens[i] for i in nodes], device=self.device)[None]  # (1, n)
        pos = torch.full((1, len(nodes)), base - 1 + depth, device=self.device)  # a depth-d node: d past entry n-1
        slots = torch.tensor([base + i for i in nodes], device=self.device)
        mask = self._tree_mask(nodes, base, width, self.device)[None, None]  # (1, 1, n, width)
        h, logits = self.drafter(ids, hidden, pos, mask, self.cache, slots)
        self._h_nodes.update({i: h[0, r] for r, i in enumerate(nodes)})
        return logits[0]

    def _check_room(self, width: int) -> None:
        if width > self.max_len:
            raise DraftsmithError(f"MTP proposer cache is full (max_len={self.max_len}); raise max_len.")

    def _to_target(self, own_ids):
        return own_ids  # the target's lm_head: its own vocab

    def _q_target(self, probs):
        return probs


def proposer(drafter: MTPDrafter, target_vocab_size: int, max_len: int) -> MTPProposer:
    """The method table's hook: the decoder's proposer for the MTP layer (attached to the target by its loader)."""
    return MTPProposer(drafter, target_vocab_size, max_len)
