"""The HF backend's decode loop: continuous batching over a static KV cache.

    results = generate_tokens(target, prompts, params, seeds, batch_size=32)

`batch_size` rows decode together, one token per row per step. Each row owns its slots in a
static KV cache (RowCache: nothing is concatenated or copied as sequences grow) and its own
position, so a row whose answer ends (EOS or max_new_tokens) takes the next waiting prompt at
once instead of idling until the longest answer of its batch ends, as rows do in transformers'
batched `generate`. When no prompt is left waiting, finished rows leave the batch.

Every prompt gets the tokens it would get alone: its prompt is prefilled at positions 0..len-1
(prompts of similar length that enter together share one left-padded forward, the padding
masked) and copied into its row without the padding; at each step a row attends only to its own
slots (the attention mask hides the rest); and it samples with its own generator (seeded per
prompt), one draw per token, whatever rows sit beside it. What batching can change is rounding: the rows of one step share matmuls, whose sums
may round differently at another batch size. Greedy tokens equal generating alone exactly in
float64 (tests/test_data_gen_batching.py); in float32 and bfloat16 a near-tie can flip.

The model is any HF causal LM whose attention layers write through `cache.update(key, value,
layer_idx)` (every decoder in transformers); the loop passes it a ready 4D mask and per-row
position ids.
"""

from __future__ import annotations

from collections import deque
from typing import Optional

import torch
from tqdm.auto import tqdm
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from ..core import DraftsmithError
from ..core.sampling import process_logits


def sample_next(logits: torch.Tensor, params, generators: list[torch.Generator]) -> torch.Tensor:
    """Next token per row: argmax when greedy, else draftsmith.core.sampling's rule with each row's own generator."""
    if params.greedy:
        return logits.argmax(dim=-1)
    probs = process_logits(logits, params)  # (B, V) float64
    # Inverse CDF, one uniform per row from the row's own generator: token i when cdf[i-1] <= u * total < cdf[i],
    # so a dropped token (an empty step of the cdf) is never drawn. (An exponential race drew a noise per token:
    # 92 ms a step on 64 rows of 49k tokens, against 2 ms.)
    u = torch.stack([torch.rand((), dtype=torch.float64, generator=g) for g in generators]).to(probs.device)
    cdf = probs.cumsum(-1)
    drawn = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True)[:, 0]
    return drawn.clamp(max=probs.shape[-1] - 1)


class RowCache:
    """A static KV cache with one row per sequence in flight: row r holds its tokens at slots 0..len_r-1.

    Prefill copies a prompt's keys/values into a row (`write_row`); in a decode step the model's
    attention layers call `update`, which writes each row's new key/value at that row's own
    position (`write_at`) and returns the slots up to `read_len` (a view: no copy).
    """

    def __init__(self, rows: int, max_len: int):
        self.rows, self.max_len = rows, max_len
        self.keys: list[torch.Tensor] = []  # per layer (rows, kv_heads, max_len, head_dim); made at the first prefill
        self.values: list[torch.Tensor] = []
        self.write_at: torch.Tensor | None = None  # (rows,) slot each row's new token goes to this step
        self.row_index: torch.Tensor | None = None  # arange(rows), paired with write_at
        self.read_len = 0  # slots the attention reads this step (the longest row's length)

    def write_row(self, layer: int, row: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Put a prompt's (kv_heads, T, head_dim) keys/values at slots 0..T-1 of `row`."""
        if layer == len(self.keys):
            shape = (self.rows, keys.shape[0], self.max_len, keys.shape[-1])
            self.keys.append(keys.new_zeros(shape))
            self.values.append(values.new_zeros(shape[:3] + values.shape[-1:]))
        self.keys[layer][row, :, :keys.shape[1]] = keys
        self.values[layer][row, :, :values.shape[1]] = values

    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, *args, **kwargs):
        """Called by each attention layer in a decode step with (rows, kv_heads, 1, head_dim)."""
        self.keys[layer_idx][self.row_index, :, self.write_at] = key[:, :, 0]
        self.values[layer_idx][self.row_index, :, self.write_at] = value[:, :, 0]
        return self.keys[layer_idx][:, :, :self.read_len], self.values[layer_idx][:, :, :self.read_len]

    def keep(self, index: torch.Tensor) -> None:
        """Keep only the rows in `index` (in that order): finished rows leave when nothing waits."""
        self.keys = [k.index_select(0, index) for k in self.keys]
        self.values = [v.index_select(0, index) for v in self.values]
        self.rows = len(index)


def check_window(config, max_len: int) -> None:
    """One 4D mask serves every layer, so a sliding window must not bite within max_len tokens."""
    window = getattr(config, "sliding_window", None)
    if window and getattr(config, "use_sliding_window", True) and max_len >= window:
        raise DraftsmithError(
            f"the target attends within a sliding window of {window} tokens and a prompt plus max_new_tokens "
            f"reaches {max_len}; the hf backend decodes sequences shorter than the window: lower max_new_tokens "
            f"or use backend.kind=openai.")


@torch.inference_mode()
def prefill(model, cache: RowCache, rows: list[int], prompts: list[list[int]], device) -> torch.Tensor:
    """Run `prompts` (longest first) and copy each one's keys/values into its row of the cache (slots
    0..len-1); their next-token logits (len(rows), V).

    Prompts of similar length share one left-padded forward (the padding masked, each prompt's
    positions starting at 0, so each is computed as it would be alone); a prompt under 3/4 of its
    group's longest starts a new group, so that padding never costs more than a third of the work.
    """
    groups, start = [], 0
    for k in range(1, len(prompts) + 1):
        if k == len(prompts) or 4 * len(prompts[k]) < 3 * len(prompts[start]):
            groups.append(range(start, k))
            start = k
    return torch.cat([prefill_group(model, cache, [rows[j] for j in g], [prompts[j] for j in g], device)
                      for g in groups])


def prefill_group(model, cache: RowCache, rows: list[int], prompts: list[list[int]], device) -> torch.Tensor:
    T = max(map(len, prompts))
    input_ids = torch.tensor([[0] * (T - len(p)) + p for p in prompts], device=device)
    attn = torch.tensor([[0] * (T - len(p)) + [1] * len(p) for p in prompts], device=device)
    alone = DynamicCache()  # no config: full layers, every token kept (check_window guards the mask)
    # The last position as an index tensor, not logits_to_keep=1: the int slices the hidden states into a
    # non-contiguous (B, 1, H) view, and torch 2.13's CPU linear on such a view copies the lm_head weight once per
    # row (bf16, alone on a 2-core AMX Xeon: 64 rows 5.0 s against 6.6 ms on a contiguous input, one row 118 ms
    # against 6 ms; benchmarks/bench_cpu_linear.py).
    # The index gathers a contiguous copy.
    out = model(input_ids=input_ids, attention_mask=attn, position_ids=(attn.cumsum(-1) - 1).clamp(min=0),
                cache=alone, use_cache=True, logits_to_keep=torch.tensor([T - 1], device=device))
    for layer, kv in enumerate(alone.layers):
        assert isinstance(kv, DynamicLayer) and kv.keys is not None and kv.values is not None  # full layers, filled
        for j, (row, p) in enumerate(zip(rows, prompts)):
            cache.write_row(layer, row, kv.keys[j, :, T - len(p):], kv.values[j, :, T - len(p):])
    return out.logits[:, -1]


@torch.inference_mode()
def generate_tokens(target, prompts: list[list[int]], params, seeds: list[int], batch_size: int = 16,
                    prune: bool = True, desc: str = "generate", done=None) -> list[tuple[list[int], str]]:
    """New token ids (EOS excluded) and 'stop' | 'length' per prompt, in order.

    params: SamplingParams (greedy, temperature, top_p, max_new_tokens); seeds: one per prompt.
    prune=True refills a finished row with the next waiting prompt at once (and drops finished rows
    when none waits); prune=False runs fixed batches that wait for their longest answer, as HF
    `generate` does. `done(i)`, if given, is called as prompt i's answer ends (for progress).
    """
    if not prompts:
        return []
    model, device, dtype = target.model, target.device, target.dtype
    eos = set(target.eos_token_ids)
    max_new = params.max_new_tokens
    max_len = max(map(len, prompts)) + max_new
    check_window(model.config, max_len)
    waiting = deque(sorted(range(len(prompts)), key=lambda i: -len(prompts[i])))  # longest first
    results: list = [None] * len(prompts)
    rows = min(batch_size, len(prompts))
    cache = RowCache(rows, max_len)
    slot: list[int | None] = [None] * rows  # row -> the prompt it decodes (None: idle)
    pos = [0] * rows  # row -> slot its next input token is written to (= its length so far)
    tokens = [0] * rows  # row -> its next input token
    answers: dict[int, list[int]] = {}
    generators: dict[int, torch.Generator] = {}
    logits: Optional[torch.Tensor] = None  # (rows, V): each row's next-token logits
    with tqdm(total=None, desc=desc, unit="tok", leave=False, disable=None) as bar:
        while True:
            idle = [r for r in range(rows) if slot[r] is None]
            if waiting and idle and (prune or len(idle) == rows):
                refill = idle[:len(waiting)]  # the free rows take the next waiting prompts
                taken = [waiting.popleft() for _ in refill]
                first = prefill(model, cache, refill, [prompts[i] for i in taken], device)
                if logits is None:
                    logits = first.new_zeros(rows, first.shape[-1])
                logits[refill] = first
                for r, i in zip(refill, taken):
                    slot[r], pos[r], answers[i] = i, len(prompts[i]), []
                    generators[i] = torch.Generator().manual_seed(seeds[i])
            elif prune and idle and len(idle) * 4 >= rows and len(idle) < rows:
                # nothing waits: a quarter of the rows are idle, drop them (a copy of the cache, so not at every finish)
                live = [r for r in range(rows) if slot[r] is not None]
                cache.keep(torch.tensor(live, device=device))
                assert logits is not None  # the live rows were prefilled
                logits = logits[live]
                slot, pos, tokens = [slot[r] for r in live], [pos[r] for r in live], [tokens[r] for r in live]
                rows = len(live)
            live = [r for r in range(rows) if slot[r] is not None]
            if not live:
                break
            assert logits is not None  # the live rows were prefilled
            live_prompts = [i for i in slot if i is not None]  # each live row's prompt, in the order of `live`
            new = sample_next(logits[live] if len(live) < rows else logits, params,
                              [generators[i] for i in live_prompts]).tolist()
            bar.update(len(live))
            for r, i, t in zip(live, live_prompts, new):
                ended = "stop" if t in eos else None
                if ended is None:
                    answers[i].append(t)
                    tokens[r] = t
                    ended = "length" if len(answers[i]) == max_new else None
                if ended:
                    results[i] = (answers.pop(i), ended)
                    del generators[i]
                    slot[r], pos[r] = None, 0  # an idle row writes slot 0 of its own row: harmless, in bounds
                    if done is not None:
                        done(i)
            if all(s is None for s in slot) and not waiting:
                break
            # one decode step for every row (idle rows compute a throwaway token: cheaper than reshaping)
            cache.write_at = torch.tensor(pos, device=device)
            cache.row_index = torch.arange(rows, device=device)
            cache.read_len = max(pos) + 1
            visible = torch.arange(cache.read_len, device=device)[None, :] <= cache.write_at[:, None]
            mask = torch.zeros(visible.shape, dtype=dtype, device=device)
            mask.masked_fill_(~visible, torch.finfo(dtype).min)
            logits = model(input_ids=torch.tensor(tokens, device=device)[:, None],
                           position_ids=cache.write_at[:, None], attention_mask=mask[:, None, None, :],
                           cache=cache, use_cache=True).logits[:, -1]
            pos = [p + 1 if s is not None else 0 for p, s in zip(pos, slot)]
    return results
