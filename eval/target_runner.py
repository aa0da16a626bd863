"""The target with a static, position-indexed KV cache, driven layer by layer.

The HF model is used unmodified: we call its own `embed_tokens`, `rotary_emb`, decoder layers,
`norm` and `lm_head`, and hand the layers a duck-typed cache whose `update` writes K/V at our
slots and returns the cache up to the last slot in use. Validity is defined by the mask, so
rejected chain slots are never copied or cleared: later steps overwrite them.

    slots      0 ........ start-1 | start ... start+T-1 | (stale, never attended)
    mask       prefix: all True   | new tokens: causal (chain) or ancestors (tree)

`length` (slots [0, length) hold the committed sequence) is the runner's own: its user writes
tokens with `forward`, then says how many are now committed with `commit(length)`.

Static mode (`cuda_graph=True` on a CUDA device): a pass of up to GRAPH_MAX_TOKENS tokens is replayed
from a CUDA graph captured once per (tokens, aux) shape, so per-kernel launch overhead (which on a GPU
dwarfs a small model's math and would distort every speedup) is paid once. Inside a graph nothing may
depend on Python ints, so the pass writes K/V with `index_copy_` at slots held in a device tensor and
attends over all `max_len` slots through a (T, max_len) mask buffer; the same path runs eagerly on the
CPU (`static=True`) so tests can check it there.
"""

from __future__ import annotations

from contextlib import contextmanager
from functools import partial
from typing import Optional

import torch
from torch import nn
from transformers import PreTrainedModel


GRAPH_MAX_TOKENS = 65  # static mode: passes up to this many tokens (a draft of 64 and its root) use graphs
WEIGHT_FIRST_TOKENS = range(2, 9)  # fp32 on a CPU: passes of these many tokens take weight_first_linear


def weight_first_linear(weight: torch.Tensor, bias: Optional[torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """`nn.Linear`'s product for a few rows, written `(W @ x.T).T`: the same sums, the weight as the left operand.

    Why: torch's fp32 `linear` on a CPU leaves its one-row path at 2 rows, and a pass of the few tokens a
    verification holds then costs far more than reading the weights. SmolLM2-135M on a 2-core AMD EPYC Zen 3
    (AVX2): a pass of 2 / 3 / 4 tokens cost 1.7 / 2.1 / 1.8 one-token steps with `linear` and about 1.3 / 1.5 / 1.3
    with the weight first (docs/benchmarks.md, 2026-12-05). Every speculative cycle pays one such pass."""
    y = (weight @ x.reshape(-1, x.shape[-1]).T).T
    if bias is not None:
        y = y + bias
    return y.reshape(*x.shape[:-1], weight.shape[0])


class _LayerKV:
    """What an HF attention layer calls `cache.update(k, v, layer_idx, ...)` on; writes at `start`."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor):
        self.k, self.v = k, v  # (L, B, n_kv, S, d)
        self.start, self.end = 0, 0
        self.slots: Optional[torch.Tensor] = None  # static mode: (T,) slots on the device; attend to all S

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        # key_states (B, n_kv, T, d) -> slots [start, end)
        if self.slots is not None:
            self.k[layer_idx].index_copy_(2, self.slots, key_states)
            self.v[layer_idx].index_copy_(2, self.slots, value_states)
            return self.k[layer_idx], self.v[layer_idx]
        self.k[layer_idx, :, :, self.start:self.end] = key_states
        self.v[layer_idx, :, :, self.start:self.end] = value_states
        return self.k[layer_idx, :, :, :self.end], self.v[layer_idx, :, :, :self.end]


class TargetRunner:
    """An HF causal LM (Llama / Qwen2 / Qwen3 families) with one preallocated KV cache.

    Reusable across prompts: `reset()` only forgets the length, nothing is reallocated.
    """

    def __init__(self, model: PreTrainedModel, max_len: int, aux_layer_ids: Optional[list[int]] = None,
                 cuda_graph: bool = False, static: Optional[bool] = None):
        self.model = model.eval()
        self.base = model.model  # the decoder stack (LlamaModel, Qwen2Model, ...)
        cfg = model.config
        self.config = cfg
        self.max_len = int(max_len)
        self.num_layers = cfg.num_hidden_layers
        self.vocab_size = cfg.vocab_size
        self.aux_layer_ids = list(aux_layer_ids) if aux_layer_ids is not None else None
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        p = next(model.parameters())
        self.dtype, self.device = p.dtype, p.device
        shape = (self.num_layers, 1, cfg.num_key_value_heads, self.max_len, head_dim)
        self.kv = _LayerKV(torch.zeros(shape, dtype=p.dtype, device=p.device),
                           torch.zeros(shape, dtype=p.dtype, device=p.device))
        self._length = 0
        # cuda_graph only means something on CUDA; `static` alone runs the graph's eager path (tests, CPU)
        self.cuda_graph = bool(cuda_graph) and self.device.type == "cuda"
        self.static = self.cuda_graph if static is None else bool(static)
        self._graphs: dict = {}  # (T, want_aux) -> (graph, static inputs, static outputs)
        # fp32 on a CPU: a pass of WEIGHT_FIRST_TOKENS tokens (a verification) runs every plain nn.Linear of the
        # model as weight_first_linear; one-token steps (target-only decoding) and prefill keep torch's linear
        self.weight_first = self.device.type == "cpu" and self.dtype == torch.float32
        self._linears = [(m, partial(weight_first_linear, m.weight, m.bias))
                         for m in model.modules() if type(m) is nn.Linear]

    @property
    def length(self) -> int:
        """Slots [0, length) hold the committed sequence."""
        return self._length

    def commit(self, length: int) -> None:
        """Slots [0, length) now hold the committed sequence (written by `forward`, moved by `gather`)."""
        if not 0 <= length <= self.max_len:
            raise ValueError(f"commit({length}) outside the cache's 0..{self.max_len} slots")
        self._length = length

    def reset(self) -> None:
        self._length = 0

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, start: int,
                attn_mask: Optional[torch.Tensor] = None, logits_rows: str = "all",
                want_aux: bool = False) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Run T new tokens written at slots [start, start+T).

        tokens, positions (T,); attn_mask (T, start+T) bool, True = attend; None = causal by slot
        (valid when slot == position, i.e. chains). logits_rows: "all" | "last" | "none".
        Returns (logits (T or 1, V), aux (T, len(aux_layer_ids)*H) or None).
        """
        T = tokens.numel()
        end = start + T
        if end > self.max_len:
            raise ValueError(f"KV cache overflow: {end} slots > max_len {self.max_len}")
        if self.static and T <= GRAPH_MAX_TOKENS:
            return self._static_forward(tokens, positions, start, attn_mask, logits_rows, want_aux)
        self.kv.start, self.kv.end = start, end
        mask = self._mask(positions, start, end, attn_mask)
        if self.weight_first and T in WEIGHT_FIRST_TOKENS:
            with self._weight_first_linears():
                return self._run(tokens, positions, mask, logits_rows, want_aux)
        return self._run(tokens, positions, mask, logits_rows, want_aux)

    @contextmanager
    def _weight_first_linears(self):
        """For one pass, each plain nn.Linear's `forward` is weight_first_linear (an instance attribute shadows
        the class's method; removed afterwards, so the model is left as it came)."""
        for module, forward in self._linears:
            module.__dict__["forward"] = forward
        try:
            yield
        finally:
            for module, _ in self._linears:
                module.__dict__.pop("forward", None)

    def _run(self, tokens, positions, mask, logits_rows, want_aux):
        """The decoder stack over `tokens` with `mask`; K/V go where `self.kv` says."""
        h = self.base.embed_tokens(tokens[None])  # (1, T, H)
        pos_emb = self.base.rotary_emb(h, position_ids=positions[None])
        aux_ids = self.aux_layer_ids if want_aux else ()
        feats = {}
        for i, layer in enumerate(self.base.layers):
            if i in aux_ids:
                feats[i] = h
            h = layer(h, attention_mask=mask, position_embeddings=pos_emb, position_ids=positions[None],
                      cache=self.kv)
        h = self.base.norm(h)
        feats[self.num_layers] = h  # hidden_states[N] is after the final norm, as in HF
        aux = torch.cat([feats[i] for i in aux_ids], dim=-1)[0] if want_aux else None
        if logits_rows == "none":
            return None, aux
        rows = h[0, -1:] if logits_rows == "last" else h[0]
        return self.model.lm_head(rows), aux

    # ---- static mode: fixed shapes, every index a device tensor ------------------------------------

    def _static_forward(self, tokens, positions, start, attn_mask, logits_rows, want_aux):
        """The same pass with K/V written at device-held slots and a (T, max_len) mask (stale slots masked)."""
        T = tokens.numel()
        full = torch.zeros(T, self.max_len, dtype=torch.bool, device=self.device)
        if attn_mask is not None:
            full[:, : start + T] = attn_mask
        else:  # chain: slot == position
            full[:, : start + T] = torch.arange(start + T, device=self.device)[None, :] <= positions[:, None]
        slots = torch.arange(start, start + T, device=self.device)
        if not self.cuda_graph:
            self.kv.slots = slots
            try:
                logits, aux = self._run(tokens, positions, full[None, None], "all", want_aux)
            finally:
                self.kv.slots = None
        else:
            logits, aux = self._replay(tokens, positions, slots, full, want_aux)
        if logits_rows == "none":
            return None, aux
        return (logits[-1:] if logits_rows == "last" else logits), aux

    def _replay(self, tokens, positions, slots, mask, want_aux):
        """Copy the inputs into the (T, want_aux) graph's buffers and replay it; capture it on first use."""
        key = (tokens.numel(), bool(want_aux))
        if key not in self._graphs:
            self._graphs[key] = self._capture(*key)
        graph, inputs, outputs = self._graphs[key]
        for buf, x in zip(inputs, (tokens, positions, slots, mask)):
            buf.copy_(x)
        graph.replay()
        logits, aux = outputs
        return logits.clone(), (aux.clone() if aux is not None else None)

    def _capture(self, T: int, want_aux: bool):
        """Record one pass of T tokens; warm-up writes land in the last T slots, which hold no committed
        token until the cache is full, and are overwritten before any mask lets them be read."""
        dev = self.device
        slots = torch.arange(self.max_len - T, self.max_len, device=dev)
        inputs = (torch.zeros(T, dtype=torch.long, device=dev), slots.clone(), slots.clone(),
                  torch.ones(T, self.max_len, dtype=torch.bool, device=dev))

        def body():
            self.kv.slots = inputs[2]
            try:
                return self._run(inputs[0], inputs[1], inputs[3][None, None], "all", want_aux)
            finally:
                self.kv.slots = None

        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):  # warm-up off the capture, as torch.cuda.graph asks
            for _ in range(2):
                body()
        torch.cuda.current_stream(dev).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outputs = body()
        return graph, inputs, outputs

    @staticmethod
    def _mask(positions, start, end, attn_mask):
        if attn_mask is not None:
            return attn_mask[None, None]  # (1, 1, T, S)
        if end - start == 1:
            return None  # one query, every slot up to `end` visible
        slots = torch.arange(end, device=positions.device)
        return (slots[None, :] <= positions[:, None])[None, None]  # (1, 1, T, S)

    def gather(self, src_slots: list[int], dst_start: int) -> None:
        """Move the K/V of `src_slots` (an accepted tree path) to [dst_start, dst_start+len)."""
        if src_slots == list(range(dst_start, dst_start + len(src_slots))):
            return
        src = torch.tensor(src_slots, device=self.device)
        dst = slice(dst_start, dst_start + len(src_slots))
        self.kv.k[:, :, :, dst] = self.kv.k[:, :, :, src]
        self.kv.v[:, :, :, dst] = self.kv.v[:, :, :, src]


def divergence(runner: TargetRunner, prompt_ids: list[int], reference: list[int], other: list[int]) -> dict:
    """Where greedy output `other` first leaves `reference` (target-only), and the target's top-2 margin there.

    The target is run once more over the prompt and the common prefix. A divergence where the margin is wide is a
    decoder error; at a near-tie it is numerics that depend on the pass's shape (one token or K+1): bf16 in the
    built-in decoder, or another engine's kernels (llama.cpp's F32 matmul differs between 1 and K+1 rows)."""
    i = next((j for j, (x, y) in enumerate(zip(reference, other)) if x != y), min(len(reference), len(other)))
    ids = torch.tensor(list(prompt_ids) + list(reference[:i]), device=runner.device)
    if ids.numel() > runner.max_len:  # cannot happen with eval's own max_len; say so rather than crash
        return {"position": i, "margin": float("inf"), "note": "longer than the cache"}
    runner.reset()
    logits, _ = runner.forward(ids, torch.arange(ids.numel(), device=runner.device), 0, logits_rows="last")
    runner.reset()
    row = logits[0].float()
    top = torch.topk(row, 2)
    other_token = other[i] if i < len(other) else None
    out = {"position": i, "target_token": reference[i] if i < len(reference) else None, "other_token": other_token,
           "margin": float(top.values[0] - top.values[1]), "top2": top.indices.tolist()}
    if other_token is not None:
        out["other_rank"] = int((row > row[other_token]).sum())  # 0 = the target's argmax here
    return out
