"""EAGLE-3 training-step time on CPU, draftsmith's offline step next to SpecForge's, measured in one run.

    python benchmarks/bench_train.py                      # smollm2, batch 1, 256 tokens, TTT 7, vocab 32000 and 8192
    python benchmarks/bench_train.py --rounds 3 --steps 4 --json bench_train.json
    python benchmarks/bench_train.py --online             # also time draftsmith's online step (target forward included)

draftsmith's step = the target distributions over the draft vocab (from the stored last hidden state through
the draft-vocab rows of the frozen lm_head, with the full-vocab argmax and logsumexp that data-gen stores
beside it: work SpecForge's timed step does not do, it is handed the logits) + the TTT forward + backward +
clip + AdamW, through the trainer's own wrap (deepspeed=none, one process). `--recompute-stats` times the
step on older shards without the stored statistics (the whole lm_head then runs in the step). bf16 = the trainer's precision=bf16
(autocast, fp32 master weights). Features are bf16, as data-gen stores them.

The peer: SpecForge 0.2.0's own step, timed by ../shared/peers/specforge_step.py in the venv that
../shared/peers/setup_specforge.sh makes (forward + backward + AdamW given the target's aux hidden states and
logits). Both see the same sequence length, TTT depth, draft vocab, dtype, thread count and loss mask (the
last three quarters of the sequence). For each setting the two alternate, `--rounds` times, and each side's
figure is the median over its rounds of the per-round median step; ratio = SpecForge's time / draftsmith's
(> 1: draftsmith is faster). Without the venv the peer columns say "peer not installed". Prints a table,
writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from omegaconf import OmegaConf

from draftsmith.core.machine import machine_info

PEERS = Path(__file__).resolve().parent.parent.parent / "shared" / "peers"


def default_peer_venv() -> Path:
    return Path(os.environ.get("PEERS_HOME", Path.home() / ".cache" / "draftsmith-peers")) / "specforge-venv"


class DraftsmithStep:
    """One offline (or online) EAGLE-3 training step of draftsmith, built once, timed per call of `run`."""

    def __init__(self, target, mode: str, precision: str, seq: int, ttt: int, vocab: int, stored_stats: bool = True):
        from draftsmith.heads.eagle3 import Eagle3Head, eagle3_config_from_target
        from draftsmith.heads.vocab import build_vocab_map
        from draftsmith.train.config import TrainConfig
        from draftsmith.train.eagle3 import Eagle3Config, Eagle3Step
        from draftsmith.train.features import TargetHead
        from draftsmith.train.trainer import TrainerConfig, autocast, wrap_for_training

        cfg = OmegaConf.structured(TrainConfig(data="-", precision=precision, method=Eagle3Config(ttt_steps=ttt)))
        cfg.deepspeed.config = "none"
        self.cfg = TrainerConfig.from_train(cfg)
        self.autocast, self.target, self.mode = autocast, target, mode
        torch.manual_seed(0)
        vocab = min(vocab, target.vocab_size)
        d2t, t2d = build_vocab_map(torch.randint(0, 1000, (target.vocab_size,)), vocab)
        head = Eagle3Head(eagle3_config_from_target(target.model.config, vocab))
        head.init_from_target(target.model, d2t, t2d)
        self.target_head = TargetHead(target.model.get_output_embeddings().weight, t2d)
        self.w = wrap_for_training(Eagle3Step(head, ttt, 0.8), self.cfg, 1, 1000)
        self.ids = torch.randint(0, target.vocab_size, (1, seq))
        self.am = torch.ones_like(self.ids)
        self.lm = torch.zeros_like(self.ids)
        self.lm[:, seq // 4:] = 1  # the loss on the last three quarters, as the peer script's
        with torch.no_grad():
            aux, last = target.features(self.ids, self.am)
            logits = target.logits(last).float()
        self.aux, self.last = aux.to(torch.bfloat16), last.to(torch.bfloat16)  # data-gen stores bf16
        # data-gen stores these two beside the hidden states (data_gen/capture.py)
        self.stats = (logits.argmax(-1), torch.logsumexp(logits, -1)) if stored_stats and mode == "offline" else ()

    def run(self, steps: int, warmup: int) -> float:
        """Median seconds of `steps` steps after `warmup` untimed ones."""
        times = []
        for i in range(warmup + steps):
            t0 = time.perf_counter()
            with torch.no_grad():
                if self.mode == "online":
                    with self.autocast(self.cfg):
                        aux, last = self.target.features(self.ids, self.am)
                else:
                    aux, last = self.aux, self.last
                tgt = self.target_head(last, self.lm.bool() & self.am.bool(), *self.stats)  # as the trainer's prepare
            with self.autocast(self.cfg):
                loss, _ = self.w.model(self.ids, self.am, self.lm, aux, tgt)
            self.w.backward(loss)
            self.w.micro_step()
            if i >= warmup:
                times.append(time.perf_counter() - t0)
        return statistics.median(times)


def peer_step(venv: Path, script: Path, target_folder: Path, precision: str, seq: int, ttt: int, vocab: int,
              steps: int, threads: int) -> float:
    """SpecForge's median draft-step seconds (its script runs 2 warm-up steps first)."""
    dtype = {"fp32": "float32", "bf16": "bfloat16"}[precision]
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "sf.json"
        cmd = [str(venv / "bin" / "python"), str(script), "--target", str(target_folder), "--draft-vocab", str(vocab),
               "--dtype", dtype, "--steps", str(steps), "--seq", str(seq), "--ttt", str(ttt), "--threads", str(threads),
               "--json", str(out)]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
        if done.returncode != 0 or not out.is_file():
            tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
            raise RuntimeError(f"the SpecForge step script failed (exit {done.returncode}): {' | '.join(tail)}")
        return float(json.loads(out.read_text())["draft_step_s"])


def target_folder_of(target) -> Path:
    """The HF-format folder of the target: its name when that is a folder, else draftsmith's cached copy."""
    if Path(target.target_id).is_dir():
        return Path(target.target_id)
    from draftsmith.data_gen.target import cache_root

    found = sorted((cache_root() / "targets").glob(f"*-{target.target_hash}"))
    if not found:
        raise SystemExit(f"no HF-format folder for target {target.target_id!r}; pass --peer-target.")
    return found[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="smollm2")
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--ttt", type=int, default=7)
    ap.add_argument("--vocabs", type=int, nargs="+", default=[32000, 8192])
    ap.add_argument("--precisions", nargs="+", default=["fp32", "bf16"], choices=["fp32", "bf16"])
    ap.add_argument("--steps", type=int, default=4, help="timed steps per round and side")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps before each of draftsmith's rounds")
    ap.add_argument("--rounds", type=int, default=2, help="alternations draftsmith / SpecForge per setting")
    ap.add_argument("--threads", type=int, default=0, help="torch threads for both sides (0 = torch's default)")
    ap.add_argument("--online", action="store_true", help="also time draftsmith's online step")
    ap.add_argument("--recompute-stats", action="store_true",
                    help="offline shards without data-gen's stored argmax / logsumexp (older folders)")
    ap.add_argument("--peer-venv", default=str(default_peer_venv()))
    ap.add_argument("--peer-script", default=str(PEERS / "specforge_step.py"))
    ap.add_argument("--peer-target", default=None, help="HF folder of the target for the peer (default: found)")
    ap.add_argument("--json", default="bench_train.json")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    threads = torch.get_num_threads()

    from draftsmith.data_gen.target import TargetConfig, load_target

    target = load_target(TargetConfig(name=args.target, dtype="float32"))
    venv, script = Path(args.peer_venv), Path(args.peer_script)
    peer = (venv / "bin" / "python").is_file() and script.is_file()
    folder = Path(args.peer_target) if args.peer_target else (target_folder_of(target) if peer else None)
    result = {"machine": machine_info(), "target": args.target, "batch": 1, "seq": args.seq, "ttt_steps": args.ttt, "threads": threads,
              "loss_mask": "last three quarters", "rounds": args.rounds, "steps": args.steps,
              "stored_target_stats": not args.recompute_stats,
              "peer": "specforge 0.2.0" if peer else "peer not installed", "rows": []}
    print(f"{'mode':8} {'precision':9} {'vocab':>6} {'draftsmith_s':>12} {'specforge_s':>11} {'ratio':>6}", flush=True)

    def add(row: dict) -> None:  # print and save each row as it is measured: a long run keeps what it has
        result["rows"].append(row)
        sf = f"{row['specforge_s']:11.3f}" if row["specforge_s"] is not None else (
            f"{'peer not installed':>18}" if row["mode"] == "offline" else f"{'-':>11}")
        ratio = f" {row['ratio']:6.2f}" if row["ratio"] is not None else ""
        print(f"{row['mode']:8} {row['precision']:9} {row['draft_vocab']:6d} {row['draftsmith_s']:12.3f} {sf}{ratio}",
              flush=True)
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)

    for vocab in args.vocabs:
        for prec in args.precisions:
            step = DraftsmithStep(target, "offline", prec, args.seq, args.ttt, vocab, not args.recompute_stats)
            ours, theirs = [], []
            for _ in range(args.rounds):
                ours.append(step.run(args.steps, args.warmup))
                if peer:
                    theirs.append(peer_step(venv, script, folder, prec, args.seq, args.ttt, vocab, args.steps, threads))
            row = {"mode": "offline", "precision": prec, "draft_vocab": min(vocab, target.vocab_size),
                   "draftsmith_s": round(statistics.median(ours), 3), "draftsmith_rounds_s": [round(t, 3) for t in ours],
                   "specforge_s": round(statistics.median(theirs), 3) if peer else None,
                   "specforge_rounds_s": [round(t, 3) for t in theirs] if peer else None}
            row["ratio"] = round(row["specforge_s"] / row["draftsmith_s"], 2) if peer else None
            add(row)
            del step
            if args.online:
                s = DraftsmithStep(target, "online", prec, args.seq, args.ttt, vocab).run(args.steps, args.warmup)
                add({"mode": "online", "precision": prec, "draft_vocab": min(vocab, target.vocab_size),
                     "draftsmith_s": round(s, 3), "specforge_s": None, "ratio": None})
    if not peer:
        print(f"SpecForge: peer not installed (no {venv}/bin/python; bash ../shared/peers/setup_specforge.sh)")
    print(f"wrote {args.json}")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
