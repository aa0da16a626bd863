"""Training data: a data-gen folder -> length-bucketed, deterministic, resumable micro-batches.

The order of samples is a pure function of (seed, epoch): shuffle, cut into mega-batches, sort each
mega-batch by length, cut into global batches, shuffle the batches. A global batch of
`micro_batch_size * grad_accum * world_size` samples is cut into micro-batches; micro-batch k
goes to rank k % world_size as accumulation slot k // world_size. So one process with
grad_accum = 2 sees exactly the micro-batches two processes with grad_accum = 1 see, and the
data position is just (epoch, batch index): part of the resumable state.

Tokens stay in the tokenized set's memory-mapped Arrow buffers (data_gen/dataset.py TokenRows), never
Python lists. With `pack_tokens` N > 0 a micro-batch's conversations are packed first-fit, in order,
into rows of at most N tokens (`pack_rows`); the batch then carries position_ids restarting at 0 per
conversation and document_ids. `prefetch` collates the micro-batches ahead in a thread (offline: the
hidden-state shards are read there) into pinned memory, in the same order.
"""

from __future__ import annotations

import queue
import random
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Generator, Iterable, Iterator, Optional

import numpy as np
import torch

from ..core import DraftsmithError
from ..data_gen.capture import shard_problem
from ..data_gen.dataset import HiddenStates, TokenRows, load_tokenized
from ..data_gen.topk import TopkLogits


@dataclass
class TrainData:
    """The tokenized rows (flat, memory-mapped: `input_ids[r]` / `loss_mask[r]` are read-only numpy views cut at
    max_length), optional offline features, the data folder's manifest, and the packing budget."""

    input_ids: TokenRows
    loss_mask: TokenRows
    hidden: Optional[HiddenStates]
    manifest: dict
    indices: list[int]  # the dataset rows this split uses
    topk: Optional[TopkLogits] = None  # offline draft distillation: the data's top-k cache (data_gen/topk.py)
    pack_tokens: int = 0  # 0: right-padded micro-batches; N: conversations packed into rows of at most N tokens

    def lengths(self) -> list[int]:
        return self.input_ids.lengths()[self.indices].tolist()


def load_data(data_dir: str, target_identity: dict, mode: str, max_length: int, val_samples: int,
              offline: str = "hidden_states", pack_tokens: int = 0) -> tuple[TrainData, Optional[TrainData], str]:
    """(train split, held-out split or None, resolved mode "online" | "offline").

    `offline` is what the method reads in offline mode (its entry's `offline_data`): hidden_states
    (EAGLE-3 features) or topk_logits (the target's top-k log-probs, data_gen/topk.py). `pack_tokens`: the
    packing budget both splits collate with (0 = off)."""
    if offline == "topk_logits":
        return _load_topk_data(data_dir, target_identity, mode, max_length, val_samples, pack_tokens)
    if not Path(data_dir).is_dir():
        raise DraftsmithError(f"data={data_dir!r} is not a folder; give a data-gen output folder.")
    ds, manifest = load_tokenized(data_dir, target_identity)
    has_hidden = bool(manifest.get("hidden_states"))
    if mode == "auto":
        mode = "offline" if has_hidden else "online"
    if mode not in ("online", "offline"):
        raise DraftsmithError(f"mode={mode!r} must be auto, online or offline.")
    hidden = None
    if mode == "offline":
        if not has_hidden:
            raise DraftsmithError(f"mode=offline needs hidden states in {data_dir}; rerun data-gen with hidden_states=true.")
        hs_target = {**manifest["target"], "hidden_size": manifest["hidden_states"].get("hidden_size", manifest["target"]["hidden_size"])}
        if hs_target["hidden_size"] != target_identity["hidden_size"]:
            raise DraftsmithError(f"the hidden states in {data_dir} have hidden_size {hs_target['hidden_size']}, "
                                  f"the target has {target_identity['hidden_size']}.")
        if list(manifest["hidden_states"].get("aux_layer_ids", [])) != list(target_identity["aux_layer_ids"]):
            raise DraftsmithError(f"the hidden states in {data_dir} were captured at layers "
                                  f"{manifest['hidden_states'].get('aux_layer_ids')}, the target uses "
                                  f"{target_identity['aux_layer_ids']} (target.aux_layer_ids).")
        hidden = open_hidden_states(data_dir, len(ds))
    ids, masks = TokenRows(ds, "input_ids", max_length), TokenRows(ds, "loss_mask", max_length)
    keep = [i for i in np.flatnonzero(ids.lengths() >= 2).tolist() if masks[i].any()]
    if not keep:
        raise DraftsmithError(f"the data in {data_dir} has no sample with a loss-masked token to train on.")
    if val_samples >= len(keep):
        raise DraftsmithError(f"val_samples={val_samples} leaves no training sample out of {len(keep)}.")
    split = len(keep) - val_samples
    train = TrainData(ids, masks, hidden, manifest, keep[:split], pack_tokens=pack_tokens)
    val = TrainData(ids, masks, hidden, manifest, keep[split:], pack_tokens=pack_tokens) if val_samples else None
    return train, val, mode


def _load_topk_data(data_dir: str, target_identity: dict, mode: str, max_length: int, val_samples: int,
                    pack_tokens: int = 0) -> tuple[TrainData, Optional[TrainData], str]:
    """load_data for a method whose offline signal is data-gen's top-k cache (auto = offline when it is there)."""
    if not Path(data_dir).is_dir():
        raise DraftsmithError(f"data={data_dir!r} is not a folder; give a data-gen output folder.")
    _, manifest = load_tokenized(data_dir, target_identity)
    has_topk = bool(manifest.get("topk_logits"))
    mode = ("offline" if has_topk else "online") if mode == "auto" else mode
    if mode == "offline" and not has_topk:
        raise DraftsmithError(f"mode=offline needs a top-k cache in {data_dir}; rerun data-gen with topk_logits=true.")
    train, val, _ = load_data(data_dir, target_identity, "online", max_length, val_samples, pack_tokens=pack_tokens)
    if mode == "offline":
        train.topk = TopkLogits(data_dir)
        if len(train.topk) != len(train.input_ids):
            raise DraftsmithError(f"the top-k cache in {data_dir} lists {len(train.topk)} samples but the tokenized "
                                  f"set has {len(train.input_ids)}; rerun data-gen on that folder.")
        if val is not None:
            val.topk = train.topk
    return train, val, mode


def open_hidden_states(data_dir: str, num_rows: int) -> HiddenStates:
    """The data folder's hidden-state shards, checked before training: a missing, empty, truncated or
    corrupted shard (or index) is refused with one sentence naming the file, not met mid-run."""
    redo = "rerun data-gen with the same settings on that folder to recapture it"
    index = Path(data_dir) / "hidden_states" / "index.json"
    try:
        hidden = HiddenStates(data_dir)
        shards, per_shard, num = hidden.shards, int(hidden.per_shard), len(hidden)
        covered = sorted((int(e["first"]), int(e["count"])) for e in shards)
    except (ValueError, KeyError, TypeError, AttributeError, UnicodeDecodeError):
        raise DraftsmithError(f"the hidden-state index {index} is corrupted; {redo}.") from None
    if num != num_rows:
        raise DraftsmithError(f"{index} lists {num} samples but the tokenized set in {data_dir} has {num_rows}; {redo}.")
    expected = [(f, min(per_shard, num - f)) for f in range(0, num, per_shard)]
    if covered != expected:
        raise DraftsmithError(f"{index} does not list a shard for every sample (shards of {per_shard} samples "
                              f"for {num}); {redo}.")
    for entry in shards:
        problem = shard_problem(hidden.folder / entry["file"], entry, hidden.stats)
        if problem:
            raise DraftsmithError(f"the hidden-state shard {hidden.folder / entry['file']} {problem}; {redo}.")
    return hidden


def batch_order(lengths: list[int], global_batch: int, mega_batch: int, seed: int, epoch: int) -> list[list[int]]:
    """Positions (into `lengths`) of each global batch of one epoch; the last partial batch is dropped."""
    rng = random.Random(seed * 100_003 + epoch)
    order = list(range(len(lengths)))
    rng.shuffle(order)
    mega = global_batch * max(mega_batch, 1)
    batches = []
    for m in range(0, len(order), mega):
        chunk = sorted(order[m:m + mega], key=lambda i: lengths[i])
        batches += [chunk[b:b + global_batch] for b in range(0, len(chunk) - global_batch + 1, global_batch)]
    rng.shuffle(batches)
    return batches


def micro_batches(batch: list[int], micro_batch_size: int, rank: int, world: int) -> list[list[int]]:
    """This rank's micro-batches (its accumulation slots, in order) of one global batch."""
    micro = [batch[k:k + micro_batch_size] for k in range(0, len(batch), micro_batch_size)]
    return micro[rank::world]


def micro_batch_plan(lengths: list[int], global_batch: int, mega_batch: int, seed: int, micro_batch_size: int,
                    rank: int, world: int, start_step: int, total_steps: int) -> Iterator[list[int]]:
    """This rank's micro-batches of optimizer steps start_step..total_steps, in the order a training loop takes
    them (batch_order per epoch, micro_batches per step: grad_accum of them per step); what `prefetch` reads."""
    batches_per_epoch = len(lengths) // global_batch
    order_epoch, order = None, []
    for step in range(start_step, total_steps):
        epoch, b = divmod(step, batches_per_epoch)
        if epoch != order_epoch:
            order, order_epoch = batch_order(lengths, global_batch, mega_batch, seed, epoch), epoch
        yield from micro_batches(order[b], micro_batch_size, rank, world)


def pack_rows(lengths: list[int], budget: int) -> list[list[int]]:
    """First-fit, in order: conversation k (of `lengths[k]` tokens) goes into the first row whose total stays
    within `budget`, else opens a new row. Returns each row's conversations (positions into `lengths`), in order.
    A pure function of (lengths, budget): resume replays the same rows."""
    rows: list[list[int]] = []
    used: list[int] = []
    for k, n in enumerate(lengths):
        if n > budget:  # TrainConfig keeps pack_tokens >= max_length, so a cut conversation always fits
            raise DraftsmithError(f"a conversation of {n} tokens does not fit pack_tokens={budget}; "
                                  f"set pack_tokens to at least max_length.")
        row = next((j for j, u in enumerate(used) if u + n <= budget), None)
        if row is None:
            row = len(rows)
            rows.append([])
            used.append(0)
        rows[row].append(k)
        used[row] += n
    return rows


def _laid_out(per_doc, layout: list[list[int]], starts: list[list[int]], T: int,
              dtype: Optional[torch.dtype] = None, pin: bool = False) -> torch.Tensor:
    """(B, T, ...) zeros holding document k's (T_k, ...) tensor at [row, start:start + T_k] for the row and start
    that `layout` / `starts` give it (unpacked: one document per row, at 0); dtype: the documents' own."""
    first = per_doc[0]
    out = torch.zeros(len(layout), T, *first.shape[1:], dtype=dtype or first.dtype, pin_memory=pin)
    for b, docs in enumerate(layout):
        for k, start in zip(docs, starts[b]):
            x = per_doc[k]
            out[b, start:start + x.shape[0]] = x
    return out


def host_batch(data: TrainData, positions: list[int], pin: bool = False, pack_tokens: Optional[int] = None) -> dict:
    """`collate`'s batch on the host (pinned when `pin`): what a prefetch thread builds."""
    rows = [data.indices[p] for p in positions]
    pack = data.pack_tokens if pack_tokens is None else pack_tokens
    n = [len(data.input_ids[r]) for r in rows]
    layout = pack_rows(n, pack) if pack else [[k] for k in range(len(rows))]
    starts = [np.cumsum([0] + [n[k] for k in docs[:-1]]).tolist() for docs in layout]
    T = max(sum(n[k] for k in docs) for docs in layout)

    def place(per_doc, dtype=None):
        return _laid_out(per_doc, layout, starts, T, dtype, pin)

    ids = [torch.from_numpy(data.input_ids[r].astype(np.int64)) for r in rows]
    batch = {"input_ids": place(ids), "attention_mask": place([torch.ones(len(x), dtype=torch.long) for x in ids]),
             "loss_mask": place([torch.from_numpy(data.loss_mask[r].astype(np.int64)) for r in rows])}
    if pack:  # positions restart at 0 per conversation; document ids 0, 1, ... within a row, -1 on padding
        batch["position_ids"] = place([torch.arange(len(x)) for x in ids])
        within = {k: j for docs in layout for j, k in enumerate(docs)}  # document k is the j-th of its row
        batch["document_ids"] = place([torch.full((len(x),), within[k] + 1) for k, x in enumerate(ids)]).sub_(1)
    if data.hidden is not None:  # stored rows are the full conversation: cut as the tokens are
        aux, last = zip(*(data.hidden[r] for r in rows))
        batch["aux"] = place([x[:m] for x, m in zip(aux, n)])
        batch["last"] = place([x[:m] for x, m in zip(last, n)])
        if data.hidden.stats:  # the target's argmax and logsumexp per position (padding: never read)
            top, lse = zip(*(data.hidden.target_stats(r) for r in rows))
            batch["target_top"] = place([x[:m] for x, m in zip(top, n)], torch.long)
            batch["target_lse"] = place([x[:m] for x, m in zip(lse, n)], torch.float32)
    if data.topk is not None:  # (B, T, k) ids and log-probs, (B, T) tail; padding positions are never scored
        ids_k, logp, tail = zip(*(data.topk[r] for r in rows))
        batch["topk_ids"] = place([x[:m] for x, m in zip(ids_k, n)], torch.int32)
        batch["topk_logp"] = place([x[:m] for x, m in zip(logp, n)], torch.float32)
        batch["topk_tail"] = place([x[:m] for x, m in zip(tail, n)], torch.float32)
    return batch


def to_device(batch: dict, device) -> dict:
    """The host batch on `device` (asynchronous from pinned memory)."""
    return {k: v.to(device, non_blocking=v.is_pinned()) for k, v in batch.items()}


def collate(data: TrainData, positions: list[int], device, pack_tokens: Optional[int] = None) -> dict:
    """One micro-batch's tensors: input_ids, attention_mask (1 on real tokens), loss_mask (B, T); offline adds
    aux (B, T, 3H) and last (B, T, H), and target_top / target_lse (B, T) when the shards carry them.
    pack_tokens (None: data.pack_tokens): 0 = one conversation per row, right-padded to the longest; N = the
    conversations packed first-fit into rows of at most N tokens (pack_rows), adding position_ids (B, T)
    restarting at 0 per conversation and document_ids (B, T): 0, 1, ... per conversation within a row, -1 on
    padding."""
    return to_device(host_batch(data, positions, pin=_pinned(device), pack_tokens=pack_tokens), device)


def _pinned(device) -> bool:
    """Pin host batches only for a CUDA device (pinning needs CUDA, and buys nothing for a CPU run)."""
    return torch.device(device).type == "cuda" and torch.cuda.is_available()


_END = object()


def prefetch(data: TrainData, plan: Iterable[list[int]], device,
             depth: Optional[int] = None) -> Generator[dict, None, None]:
    """`collate(data, positions, device)` of each micro-batch of `plan` (micro_batch_plan), in order: a thread
    reads up to `depth` micro-batches ahead (the offline shards' rows included) into pinned memory when the
    device is CUDA; the copy to the device happens here, in the caller's thread. An error in the thread is
    raised here, as itself, where its micro-batch would have come. Closing the generator stops the thread.

    depth None: 2 on an accelerator, 0 on a CPU. 0 reads each micro-batch when it is due, in this thread: on a CPU
    the cores that would read ahead are the ones computing the step, and a second thread's torch ops compete for
    them (the demo's offline step on 2 cores took 258 ms with the thread against 196 ms for the loop before it, and
    157 against 155 ms without it: docs/results/train-builds-2026-12-06.json)."""
    if depth is None:
        depth = 0 if torch.device(device).type == "cpu" else 2
    if depth == 0:
        for positions in plan:
            yield collate(data, positions, device)
        return
    pin = _pinned(device)
    ready: queue.Queue = queue.Queue(maxsize=max(1, depth))
    stop = threading.Event()

    def put(item) -> bool:
        while not stop.is_set():
            try:
                ready.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def read() -> None:
        try:
            for positions in plan:
                if not put((host_batch(data, positions, pin), None)):
                    return
        except BaseException as e:  # noqa: BLE001 - handed to the caller's thread, raised there
            put((None, e))
            return
        put((_END, None))

    thread = threading.Thread(target=read, name="draftsmith-prefetch", daemon=True)
    thread.start()
    try:
        while True:
            batch, error = ready.get()
            if error is not None:
                raise error
            if batch is _END:
                return
            yield to_device(batch, device)
    finally:
        stop.set()
        thread.join()
