#!/usr/bin/env python
"""The SpecForge peer: a full EAGLE-3 training run with SpecForge 0.2.0's own model, loss and optimizer, on CPU.

Run it with SpecForge's venv (`bash ../shared/peers/setup_specforge.sh`; never draftsmith's venv, its pins differ):

    SF=~/.cache/draftsmith-peers/specforge-venv/bin/python
    # the data: draftsmith's data-gen folder converted by the speculators peer (one offline format for both peers)
    .venv/bin/python benchmarks/peers/speculators_eagle3.py convert --data runs/demo/data --out runs/sf/data --samples 600
    $SF benchmarks/peers/specforge_eagle3.py --data runs/sf/data --target ~/.cache/draftsmith/targets/<SmolLM2 folder> \
        --out runs/sf/head --budget-s 150 --total-steps 400 --json runs/sf/run.json

What is SpecForge's and what is this script's:
  SpecForge's   the draft model (`AutoDraftModel` -> LlamaForCausalLMEagle3, sdpa attention: its default flex
                attention has no CPU backward), `OnlineEagle3Model` (the TTT unroll and its per-step loss), the
                per-step weights 0.8^i (`Eagle3TrainStrategy.ploss_decay`), `BF16Optimizer` (AdamW over fp32
                masters, grad clip, warmup + cosine schedule), the draft-vocab mapping
                (`process_token_dict_to_mappings` over the loss-masked tokens of the train rows), the target's
                embeddings loaded and frozen (`load_embedding`, `freeze_embedding`), `padding` (the one-token shift
                of `TargetHead.preprocess`), the loss mask's last token zeroed (`process_offline_eagle3_sample`)
  its defaults  TrainingConfig of specforge/config/schema.py: lr 1e-4, cosine, warmup ratio 0.015, grad clip 0.5,
                TTT 7, batch 1, weight decay 0; lm_head randomly initialised (SpecForge loads no target rows)
  this script   the loop: rows in a seeded random order each epoch, one row per step, until --budget-s seconds of
                training or --max-steps / --max-samples; the target logits as lm_head(last hidden state), the
                lm_head being the target's (SmolLM2 ties it to the embeddings); the CPU shim below
CPU shim: specforge.core.loss imports triton (a GPU kernel library, absent here) at module level; it is loaded
from its source without those two lines (stand-ins for the names), and OnlineEagle3Model's loss points at
SpecForge's own torch reference of the same loss (`_compute_loss`). TorchDynamo is off (nothing is compiled).

Writes --out: SpecForge's `save_pretrained` of the draft (config.json LlamaForCausalLMEagle3 + model.safetensors:
the EAGLE-3 folder vLLM and SGLang load), and a JSON record (--json): steps, samples, wall seconds, losses.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
import types
from collections import Counter
from pathlib import Path

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

import torch  # noqa: E402


def _stand_in(*args, **kwargs):
    """Any triton attribute: a decorator returns the function it decorates, everything else returns itself."""
    if len(args) == 1 and callable(args[0]) and not kwargs:
        return args[0]
    return _stand_in


class _Triton:
    def __getattr__(self, name):
        return _stand_in


TRITON_IMPORTS = "import triton\nimport triton.language as tl\n"


def import_specforge():
    """SpecForge's EAGLE-3 pieces, importable without triton (see the module docstring). Only specforge.core.loss
    imports triton: it is loaded from its own source without those two lines, with stand-ins for the names (a
    `triton` module in sys.modules would mislead transformers' own checks for triton)."""
    import importlib.util

    spec = importlib.util.find_spec("specforge.core.loss")
    source = Path(spec.origin).read_text()
    if TRITON_IMPORTS not in source:
        raise SystemExit(f"{spec.origin}: its triton imports changed; update this shim (SpecForge 0.2.0 expected).")
    sf_loss = types.ModuleType("specforge.core.loss")
    sf_loss.__file__, sf_loss.triton, sf_loss.tl = spec.origin, _Triton(), _Triton()
    exec(compile(source.replace(TRITON_IMPORTS, ""), spec.origin, "exec"), sf_loss.__dict__)
    sys.modules["specforge.core.loss"] = sf_loss
    import specforge.algorithms.eagle3.model as eagle3_model

    class ReferenceLoss:  # SpecForge's own torch version of its Triton loss
        @staticmethod
        def apply(logits, target_p, position_mask):
            return sf_loss._compute_loss(logits, target_p, position_mask)

    eagle3_model.LogSoftmaxLoss = ReferenceLoss
    return eagle3_model


def read_rows(data: Path, num_train: int):
    """The converted rows: (input_ids, loss_mask, aux (T, 3H), last (T, H)) for the first num_train rows."""
    import datasets
    from safetensors.torch import load_file

    ds = datasets.load_from_disk(str(data))
    rows = []
    for i in range(num_train):
        hs = load_file(str(data / "hidden_states" / f"hs_{i}.safetensors"))
        stacked = hs["hidden_states"]  # (T, 4, H): three aux layers, then the last (post-norm) hidden state
        T, _, H = stacked.shape
        rows.append((torch.as_tensor(ds[i]["input_ids"], dtype=torch.long), torch.as_tensor(ds[i]["loss_mask"]),
                     stacked[:, :3].reshape(T, 3 * H).float(), stacked[:, 3].float()))
    return rows


def target_lm_head(target: Path) -> torch.Tensor:
    """The target's lm_head (its embeddings when tied), read from model.safetensors (SpecForge's own TargetHead
    wants an index.json, which a single-file target has not)."""
    from safetensors import safe_open

    with safe_open(str(target / "model.safetensors"), framework="pt") as f:
        name = "lm_head.weight" if "lm_head.weight" in set(f.keys()) else "model.embed_tokens.weight"
        return f.get_tensor(name).float()


def build_draft(target: Path, draft_vocab: int, token_counts: Counter):
    from specforge.data.preprocessing import process_token_dict_to_mappings
    from specforge.modeling.auto import AutoDraftModel
    from transformers import AutoConfig, LlamaConfig

    tcfg = AutoConfig.from_pretrained(str(target))
    keys = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "hidden_act",
            "max_position_embeddings", "rms_norm_eps", "vocab_size")
    dcfg = LlamaConfig(**{k: getattr(tcfg, k) for k in keys if hasattr(tcfg, k)})
    for k in ("head_dim", "rope_parameters", "rope_theta", "rope_scaling"):
        if hasattr(tcfg, k):
            setattr(dcfg, k, getattr(tcfg, k))
    dcfg.architectures = ["LlamaForCausalLMEagle3"]
    dcfg.num_hidden_layers, dcfg.tie_word_embeddings, dcfg.pad_token_id = 1, False, 0
    dcfg.draft_vocab_size = min(draft_vocab, tcfg.vocab_size)
    dcfg.target_hidden_size = tcfg.hidden_size
    draft = AutoDraftModel.from_config(dcfg, attention_backend="sdpa", torch_dtype=torch.float32)
    # a copy: SpecForge's function adds the missing ids to the Counter it is given
    d2t, t2d = process_token_dict_to_mappings(Counter(token_counts), dcfg.draft_vocab_size, tcfg.vocab_size)
    draft.t2d.copy_(t2d)
    draft.d2t.copy_(d2t)
    # lm_head first: it reads model.safetensors and fails there when it is missing, before load_embedding, which
    # would fall back to unpickling a pytorch_model.bin
    head = target_lm_head(target)
    draft.load_embedding(str(target), embedding_key="model.embed_tokens.weight")
    draft.freeze_embedding()
    return draft, head


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", type=Path, required=True, help="a folder written by speculators_eagle3.py convert")
    ap.add_argument("--target", type=Path, required=True, help="the target's HF folder (config.json + model.safetensors)")
    ap.add_argument("--out", type=Path, required=True, help="the head folder to write (new or empty)")
    ap.add_argument("--budget-s", type=float, default=None, help="stop after the step at which this many seconds of "
                                                                 "training have passed")
    ap.add_argument("--max-steps", type=int, default=None)
    ap.add_argument("--max-samples", type=int, default=None)
    ap.add_argument("--total-steps", type=int, required=True, help="the LR schedule's length (warmup + cosine)")
    ap.add_argument("--draft-vocab-size", type=int, default=32000)
    ap.add_argument("--lr", type=float, default=1e-4, help="SpecForge's default 1e-4")
    ap.add_argument("--ttt", type=int, default=7, help="SpecForge's default 7")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    if args.out.exists() and any(args.out.iterdir()):
        print(f"--out {args.out}: exists and is not empty; give a new folder.", file=sys.stderr)
        return 2
    record_in = json.loads((args.data / "peer_data.json").read_text())
    num_train = int(record_in["num_train"])
    torch.manual_seed(args.seed)
    eagle3_model = import_specforge()
    from specforge.optimizer import BF16Optimizer
    from specforge.utils import padding

    rows = read_rows(args.data, num_train)
    counts = Counter()
    for ids, mask, _, _ in rows:
        counts.update(ids[mask == 1].tolist())
    draft, lm_head = build_draft(args.target, args.draft_vocab_size, counts)
    model = eagle3_model.OnlineEagle3Model(draft_model=draft, length=args.ttt, attention_backend="sdpa")
    opt = BF16Optimizer(model, lr=args.lr, max_grad_norm=0.5, total_steps=args.total_steps, warmup_ratio=0.015,
                        lr_scheduler="cosine")
    rng = random.Random(args.seed)
    order: list[int] = []
    steps, losses, step_ends, t0, stop = 0, [], [], time.perf_counter(), "max_steps"
    model.train()
    while True:
        if not order:
            order = list(range(len(rows)))
            rng.shuffle(order)
        ids, mask, aux, last = rows[order.pop()]
        mask = mask.clone()
        mask[-1] = 0  # process_offline_eagle3_sample
        input_ids = padding(ids[None], left=False)  # TargetHead.preprocess: the one-token shift
        target = padding(last[None], left=False) @ lm_head.T
        plosses, *_ = model(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), target=target,
                            loss_mask=mask[None, :, None], hidden_states=aux[None])
        loss = sum(0.8 ** i * p for i, p in enumerate(plosses))
        loss.backward()
        opt.step()
        steps += 1
        losses.append(round(loss.item(), 4))
        elapsed = time.perf_counter() - t0
        step_ends.append(elapsed)
        if args.budget_s is not None and elapsed >= args.budget_s:
            stop = "budget"
            break
        if args.max_steps is not None and steps >= args.max_steps:
            break
        if args.max_samples is not None and steps >= args.max_samples:
            stop = "max_samples"
            break
    wall = time.perf_counter() - t0
    args.out.mkdir(parents=True, exist_ok=True)
    draft.save_pretrained(str(args.out))
    record = {"peer": "specforge 0.2.0", "steps": steps, "samples_seen": steps, "train_wall_s": round(wall, 1),
              "stop_reason": stop, "s_per_step": round(wall / steps, 4),
              # the first two steps warm up (allocations, first-call costs): a schedule sized from them is short
              "s_per_step_after_2": round((step_ends[-1] - step_ends[1]) / (steps - 2), 4) if steps > 2 else None, "lr": args.lr, "ttt": args.ttt,
              "total_steps": args.total_steps, "draft_vocab_size": draft.config.draft_vocab_size,
              "num_train_rows": num_train, "losses_first_last": [losses[:5], losses[-5:]], "head": str(args.out)}
    if args.json:
        args.json.write_text(json.dumps(record, indent=1))
    print(json.dumps({k: record[k] for k in ("steps", "train_wall_s", "stop_reason", "head")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
