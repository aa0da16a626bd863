"""EAGLE-3 training-step time on CPU: online vs offline, fp32 vs bf16, side by side.

    python scripts/bench_train.py                      # smollm2, batch 1, 256 tokens, TTT 7, vocab 32000
    python scripts/bench_train.py --target tiny --steps 3 --json /tmp/bench_train.json

A step = (online: target features) + target distributions over the draft vocab + the 7-step TTT
forward + backward + clip + AdamW, through the trainer's own wrap (deepspeed=none, one process).
bf16 = autocast with fp32 master weights (the trainer's precision=bf16). Prints a table, writes JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from omegaconf import OmegaConf


def bench(target, mode: str, precision: str, seq: int, ttt: int, vocab: int, steps: int, warmup: int) -> dict:
    from draftsmith.heads.eagle3 import Eagle3Head, eagle3_config_from_target
    from draftsmith.heads.vocab import build_vocab_map
    from draftsmith.train.config import TrainConfig
    from draftsmith.train.eagle3 import Eagle3Config, Eagle3Step, TargetHead
    from draftsmith.train.trainer import TrainerConfig, autocast, wrap_for_training

    cfg = OmegaConf.structured(TrainConfig(data="-", precision=precision, method=Eagle3Config(ttt_steps=ttt)))
    cfg.deepspeed.config = "none"
    cfg = TrainerConfig.from_train(cfg)
    torch.manual_seed(0)
    vocab = min(vocab, target.vocab_size)
    d2t, t2d = build_vocab_map(torch.randint(0, 1000, (target.vocab_size,)), vocab)
    head = Eagle3Head(eagle3_config_from_target(target.model.config, vocab))
    head.init_from_target(target.model, d2t, t2d)
    target_head = TargetHead(target.model.get_output_embeddings().weight, t2d)
    w = wrap_for_training(Eagle3Step(head, ttt, 0.8), cfg, 1, 1000)
    ids = torch.randint(0, target.vocab_size, (1, seq))
    am, lm = torch.ones_like(ids), torch.ones_like(ids)
    with torch.no_grad():
        aux0, last0 = target.features(ids, am)
    times = []
    for i in range(warmup + steps):
        t0 = time.perf_counter()
        with torch.no_grad():
            if mode == "online":
                with autocast(cfg):
                    aux, last = target.features(ids, am)
            else:  # offline: features come from disk in bf16
                aux, last = aux0.to(torch.bfloat16), last0.to(torch.bfloat16)
            tgt = target_head(last)
        with autocast(cfg):
            loss, _ = w.model(ids, am, lm, aux, tgt)
        w.backward(loss)
        w.micro_step()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    s = statistics.median(times)
    return {"mode": mode, "precision": precision, "step_s": round(s, 3), "tokens_per_s": round(seq / s, 1),
            "steps": steps}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="smollm2")
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--ttt", type=int, default=7)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--json", default="bench_train.json")
    args = ap.parse_args()

    from draftsmith.data_gen.target import TargetConfig, load_target

    target = load_target(TargetConfig(name=args.target))
    rows = [bench(target, mode, prec, args.seq, args.ttt, args.vocab, args.steps, args.warmup)
            for prec in ("fp32", "bf16") for mode in ("online", "offline")]
    result = {"target": args.target, "batch": 1, "seq": args.seq, "ttt_steps": args.ttt,
              "draft_vocab": min(args.vocab, target.vocab_size), "threads": torch.get_num_threads(),
              "reference_specforge_s": {"fp32": 2.0, "bf16": 1.3}, "rows": rows}
    print(f"{'mode':8} {'precision':9} {'step_s':>7} {'tok/s':>7}")
    for r in rows:
        print(f"{r['mode']:8} {r['precision']:9} {r['step_s']:7.3f} {r['tokens_per_s']:7.1f}")
    with open(args.json, "w") as f:
        json.dump(result, f, indent=2)
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
