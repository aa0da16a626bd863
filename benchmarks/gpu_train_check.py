"""The training half of the GPU check (issue 46): the pipeline on one GPU, the EAGLE-3 step at the users' shapes
beside the dense reference and speculators' own step, and hidden-state capture. Writes one JSON.

    python benchmarks/gpu_train_check.py --device cuda --out runs/gpu_check/train.json        # the GPU check
    python benchmarks/gpu_train_check.py --tiny --device cpu --out /tmp/train.json            # the same code, tiny
                                                                                              # shapes (the tests)
Parts (--parts, default all):

  kernels   method.attention=flex against dense on a packed micro-batch: loss, statistics and (on CUDA) gradients;
            one device-path step under torch.cuda.set_sync_debug_mode("error") (no host sync may happen in it).
  pipeline  data-gen on the device (the tiny target), train 20 steps with deepspeed=zero2, precision=bf16 (on
            CUDA: the process group is cpu:gloo,cuda:nccl), the same run killed after step 10 (tests/helpers.py crash_after_step) and
            resumed with resume=true, the two metrics.jsonl compared record by record; then export and eval.
  step      the EAGLE-3 training step (prepare + forward + backward + clip + AdamW, the trainer's own wrap,
            deepspeed=none, bf16 autocast over fp32 master weights, TTT 3, draft vocab 32k) on random-weight
            targets shaped like Llama-3.1-8B (T = 2048, 4096 and 8192 packed from 4 conversations of 2048) and
            Qwen3-0.6B (T = 2048), online (the target runs) and offline (stored features), each with
            method.attention=dense (the reference) and the memory-efficient kernel: milliseconds per phase,
            tokens/s and peak memory; a setting that does not fit says "out of memory".
  peer      speculators 0.9's own Eagle3DraftModel step (its flex attention, AdamW) on the same GPU, shapes and
            dtype, when `speculators` imports; speculators' published anchor beside it: 28,328 tokens/s at
            seq 2048 for a Qwen3-0.6B EAGLE-3 on one A100 (vLLM speculators PR #1111).
  capture   data-gen's hidden-state capture (data_gen/capture.py) on the random 8B-shaped target: tokens/s,
            bytes per token, and the GPU's busy share (NVML utilisation sampled every 50 ms, CUDA only).

Every figure is measured in this run; nothing is copied in except the peer's published anchor, labelled as such.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent

# Random-weight targets of the users' shapes (LlamaConfig fields). Qwen3-0.6B's q/k norms are left out: the head is
# a Llama layer either way and the target's features are random.
SHAPES = {
    "llama3.1-8b": dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                        intermediate_size=14336, vocab_size=128256, rope_theta=500000.0),
    "qwen3-0.6b": dict(hidden_size=1024, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                       head_dim=128, intermediate_size=3072, vocab_size=151936, rope_theta=1000000.0),
    "tiny": dict(hidden_size=64, num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=128, vocab_size=512),
}
SPECULATORS_ANCHOR = {"tokens_per_s": 28328, "seq": 2048, "peak_gb": 6.5, "gpu": "A100",
                      "source": "vLLM speculators PR #1111 (published, not measured here)"}


def settings(tiny: bool) -> dict:
    """What the step part runs: (shape, T, packed documents) per setting; tiny shapes on a CPU for the tests."""
    if tiny:
        return {"draft_vocab": 256, "steps": 2, "warmup": 1,
                "runs": [("tiny", 64, 1), ("tiny", 128, 1), ("tiny", 256, 4)], "peer_runs": [("tiny", 64, 1)],
                "capture": ("tiny", 16, 48)}
    return {"draft_vocab": 32000, "steps": 5, "warmup": 2,
            "runs": [("llama3.1-8b", 2048, 1), ("llama3.1-8b", 4096, 1), ("llama3.1-8b", 8192, 4),
                     ("qwen3-0.6b", 2048, 1)],
            "peer_runs": [("qwen3-0.6b", 2048, 1), ("llama3.1-8b", 4096, 1)],
            "capture": ("llama3.1-8b", 64, 1024)}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def peak_gb(device: torch.device) -> float | None:
    return round(torch.cuda.max_memory_allocated(device) / 2 ** 30, 2) if device.type == "cuda" else None


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def is_oom(e: BaseException) -> bool:
    return isinstance(e, torch.OutOfMemoryError) or "out of memory" in str(e).lower()


# ---- random-weight targets ------------------------------------------------------------------------------------

def random_target(shape: str, device: torch.device, layers: int | None = None):
    """A draftsmith Target over a random-weight Llama of `shape`, built on `device` in bf16 (fp32 on a CPU without
    fast bf16 would also do, but the users' targets are bf16). `layers`: fewer decoder layers (offline steps read
    only the embeddings and the lm_head)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from draftsmith.data_gen.target import Target, tiny_tokenizer

    fields = dict(SHAPES[shape])
    if layers is not None:
        fields["num_hidden_layers"] = layers
    config = LlamaConfig(**fields, max_position_embeddings=16384, rms_norm_eps=1e-5, tie_word_embeddings=False,
                         bos_token_id=None, eos_token_id=None, pad_token_id=None)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            torch.manual_seed(0)
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    tokenizer = tiny_tokenizer()
    return Target(model, tokenizer, f"random-{shape}", f"random-{shape}",
                  aux_layer_ids=None if layers is None else [min(2, layers)] * 3)


# ---- the EAGLE-3 step -------------------------------------------------------------------------------------------

def conversations_batch(T: int, docs: int, vocab: int, device: torch.device) -> dict:
    """One row of T tokens: `docs` conversations of T // docs tokens each (packed when docs > 1), the loss on the
    last three quarters of each conversation (its answer), as the peers' timed steps do."""
    n = T // docs
    g = torch.Generator().manual_seed(0)
    batch = {"input_ids": torch.randint(0, vocab, (1, T), generator=g),
             "attention_mask": torch.ones(1, T, dtype=torch.long),
             "loss_mask": torch.zeros(1, T, dtype=torch.long)}
    for d in range(docs):
        batch["loss_mask"][0, d * n + n // 4:(d + 1) * n] = 1
    if docs > 1:
        batch["position_ids"] = torch.arange(n).repeat(docs)[None]
        batch["document_ids"] = torch.arange(docs).repeat_interleave(n)[None]
    return {k: v.to(device) for k, v in batch.items()}


def trainer_config(device: str, precision: str):
    from omegaconf import OmegaConf

    from draftsmith.train.config import TrainConfig
    from draftsmith.train.eagle3 import Eagle3Config
    from draftsmith.train.trainer import TrainerConfig

    cfg = OmegaConf.structured(TrainConfig(data="-", device=device, precision=precision, method=Eagle3Config()))
    cfg.deepspeed.config = "none"
    return TrainerConfig.from_train(cfg)


def eagle3_step_figures(target, mode: str, attention: str, T: int, docs: int, draft_vocab: int,
                        steps: int, warmup: int) -> dict:
    """Median milliseconds of prepare (the target side), forward, backward and the optimizer step, tokens/s and
    the peak memory of draftsmith's EAGLE-3 step."""
    from draftsmith.heads.eagle3 import Eagle3Head, eagle3_config_from_target
    from draftsmith.heads.vocab import build_vocab_map
    from draftsmith.train.eagle3 import Eagle3Config, Eagle3Step
    from draftsmith.train.features import target_prepare
    from draftsmith.train.trainer import autocast, wrap_for_training

    device = target.device
    cfg = trainer_config(str(device), "bf16")
    vocab = target.vocab_size
    torch.manual_seed(0)
    d2t, t2d = build_vocab_map(torch.randint(0, 1000, (vocab,)), min(draft_vocab, vocab))
    head = Eagle3Head(eagle3_config_from_target(target.model.config, d2t.numel()))
    head.init_from_target(target.model, d2t, t2d)
    step_module = Eagle3Step(head, Eagle3Config.ttt_steps, Eagle3Config.ttt_decay, attention=attention).to(device)
    w = wrap_for_training(step_module, cfg, 1, 1000)
    prepare = target_prepare(head.t2d, target, mode, lambda: autocast(cfg))
    batch = conversations_batch(T, docs, vocab, device)
    if mode == "offline":  # what data-gen stores: bf16 features and the target's full-vocab argmax / logsumexp
        with torch.no_grad(), autocast(cfg):
            aux, last = target.features(batch["input_ids"], batch["attention_mask"])
            logits = target.logits(last).float()
        batch.update(aux=aux.to(torch.bfloat16), last=last.to(torch.bfloat16), target_top=logits.argmax(-1),
                     target_lse=torch.logsumexp(logits, -1))
        del logits
    reset_peak(device)
    phases = {"prepare": [], "forward": [], "backward": [], "optimizer": []}
    for i in range(warmup + steps):
        marks = [time.perf_counter()]
        prepared = prepare(dict(batch))
        sync(device)
        marks.append(time.perf_counter())
        with autocast(cfg):
            loss, _ = w.model(**prepared)
        sync(device)
        marks.append(time.perf_counter())
        w.backward(loss)
        sync(device)
        marks.append(time.perf_counter())
        w.micro_step()
        sync(device)
        marks.append(time.perf_counter())
        if i >= warmup:
            for name, a, b in zip(phases, marks, marks[1:]):
                phases[name].append(1000 * (b - a))
    ms = {name: round(statistics.median(v), 2) for name, v in phases.items()}
    total = sum(ms.values())
    return {**{f"{k}_ms": v for k, v in ms.items()}, "step_ms": round(total, 2),
            "tokens_per_s": round(T / (total / 1000), 1), "peak_gb": peak_gb(device), "loss": float(loss)}


def step_part(device: torch.device, tiny: bool, attentions: list[str]) -> list[dict]:
    plan = settings(tiny)
    rows = []
    targets: dict = {}
    for shape, T, docs in plan["runs"]:
        for mode in ("offline", "online"):
            key = (shape, mode)
            if key not in targets:
                targets.clear()  # one target at a time on the GPU
                reset_peak(device)
                targets[key] = random_target(shape, device, layers=None if mode == "online" else 1)
            for attention in attentions:
                row = {"shape": shape, "T": T, "documents": docs, "mode": mode, "attention": attention}
                try:
                    row.update(eagle3_step_figures(targets[key], mode, attention, T, docs, plan["draft_vocab"],
                                                   plan["steps"], plan["warmup"]))
                except Exception as e:  # noqa: BLE001 - recorded per setting, the others still run
                    row["error"] = "out of memory" if is_oom(e) else f"{type(e).__name__}: {e}"[:300]
                    if not is_oom(e):
                        traceback.print_exc()
                print("step", json.dumps(row), flush=True)
                rows.append(row)
                reset_peak(device)
    return rows


# ---- the memory-efficient attention against dense, and host syncs ---------------------------------------------

def kernels_part(device: torch.device, tiny: bool) -> dict:
    """flex against dense on one packed micro-batch (train/eagle3.py check_attention_against_dense): the loss, the
    statistics and, on CUDA (flex has no CPU backward), every gradient, float32, also with activation
    checkpointing; then one step of the device path under torch.cuda.set_sync_debug_mode("error"): a host sync in
    the step raises."""
    from draftsmith.train.eagle3 import Eagle3Config, check_attention_against_dense, eagle3_loss, pack, \
        random_conversation, tiny_eagle3_head

    cuda = device.type == "cuda"
    dtype = torch.float32 if cuda else torch.float64
    scale = 2 if tiny else 10
    steps = Eagle3Config.ttt_steps  # the method's default TTT depth, what a user's run trains
    result = {"dtype": str(dtype), "grads": cuda,
              "flex_vs_dense": check_attention_against_dense(device, dtype, grads=cuda, steps=steps, scale=scale),
              "flex_vs_dense_checkpointed": check_attention_against_dense(device, dtype, grads=cuda, steps=steps,
                                                                          scale=scale, activation_checkpointing=True)}
    if cuda:
        head = tiny_eagle3_head(device, dtype)
        g = torch.Generator().manual_seed(2)
        batch = pack([random_conversation(head, n, g, dtype) for n in (90, 140, 50)], [[0, 1], [2]], 300, device)
        eagle3_loss(head, **batch, steps=steps)[0].backward()  # warm-up: compile flex, allocate
        torch.cuda.synchronize(device)
        torch.cuda.set_sync_debug_mode("error")
        try:
            eagle3_loss(head, **batch, steps=steps)[0].backward()
            result["host_syncs_in_step"] = "none (set_sync_debug_mode error raised nothing)"
        except RuntimeError as e:
            result["host_syncs_in_step"] = f"a sync: {e}"[:300]
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return result


# ---- speculators' own step --------------------------------------------------------------------------------------

def speculators_step_figures(target, shape: str, T: int, draft_vocab: int, steps: int, warmup: int) -> dict:
    """speculators 0.9's Eagle3DraftModel (loaded from draftsmith's speculators export of a random head of the same
    shape, its own default attention on CUDA: flex), forward with its loss + backward + AdamW, bf16 autocast."""
    from safetensors.torch import save_file
    from speculators.losses import resolve_loss_config
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig

    from draftsmith.heads.eagle3 import Eagle3Head, eagle3_config_from_target
    from draftsmith.heads.eagle3_folders import save_speculators
    from draftsmith.heads.vocab import build_vocab_map
    from draftsmith.train.eagle3 import Eagle3Config

    device = target.device
    vocab = target.vocab_size
    torch.manual_seed(0)
    d2t, t2d = build_vocab_map(torch.randint(0, 1000, (vocab,)), min(draft_vocab, vocab))
    head = Eagle3Head(eagle3_config_from_target(target.model.config, d2t.numel()))
    head.init_from_target(target.model, d2t, t2d)
    with tempfile.TemporaryDirectory() as tmp:  # speculators reads its verifier's embeddings and lm_head from a folder
        verifier = Path(tmp) / "verifier"  # the full-depth config; of the weights only what speculators reads
        verifier.mkdir()
        config = type(target.model.config)(**{**target.model.config.to_dict(),
                                              "num_hidden_layers": SHAPES[shape]["num_hidden_layers"]})
        config.save_pretrained(verifier)
        model = target.model
        save_file({"model.embed_tokens.weight": model.get_input_embeddings().weight.detach().contiguous(),
                   "lm_head.weight": model.get_output_embeddings().weight.detach().contiguous(),
                   "model.norm.weight": model.model.norm.weight.detach().contiguous()}, str(verifier / "model.safetensors"))
        save_speculators(head, Path(tmp) / "head", verifier=str(Path(tmp) / "verifier"))
        config = Eagle3SpeculatorConfig.from_pretrained(Path(tmp) / "head")
        if device.type != "cuda":  # its flex attention has no CPU backward
            config.transformer_layer_config._attn_implementation = "sdpa"
        model = Eagle3DraftModel.from_pretrained(Path(tmp) / "head", config=config).to(device).train()
    del head
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-4)
    # its default loss (kl_div), Triton-fused on CUDA as its trainer runs it; eager where there is no Triton
    loss_config = resolve_loss_config("kl_div", "fused" if device.type == "cuda" else "eager")
    batch = conversations_batch(T, 1, vocab, device)
    H = target.hidden_size
    g = torch.Generator(device=device).manual_seed(0)
    hidden = torch.randn(1, T, 3 * H, device=device, generator=g, dtype=torch.bfloat16)
    last = torch.randn(1, T, H, device=device, generator=g, dtype=torch.bfloat16)
    reset_peak(device)
    times = []
    for i in range(warmup + steps):
        t0 = time.perf_counter()
        with torch.autocast(device_type=device.type, dtype=torch.bfloat16):
            out = model(hidden_states=hidden, input_ids=batch["input_ids"],
                        document_ids=torch.zeros_like(batch["input_ids"]), loss_mask=batch["loss_mask"].bool(),
                        position_ids=torch.arange(T, device=device)[None], verifier_last_hidden_states=last,
                        ttt_steps=Eagle3Config.ttt_steps, ttt_step_loss_decay=Eagle3Config.ttt_decay,
                        loss_config=loss_config)
        loss = out[1] if isinstance(out, tuple) else out.loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 0.5)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        sync(device)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    step_s = statistics.median(times)
    return {"step_ms": round(1000 * step_s, 2), "tokens_per_s": round(T / step_s, 1), "peak_gb": peak_gb(device),
            "trained_tensors": sum(p.numel() for p in params),
            "note": "speculators 0.9 freezes its lm_head (draftsmith trains it): its step updates fewer weights"}


def peer_part(device: torch.device, tiny: bool) -> dict:
    plan = settings(tiny)
    try:
        import speculators  # noqa: F401
    except Exception as e:  # noqa: BLE001 - the peer is optional; say why it did not run
        return {"anchor": SPECULATORS_ANCHOR, "skipped": f"speculators does not import: {type(e).__name__}: {e}"[:300]}
    rows = []
    for shape, T, _ in plan["peer_runs"]:
        row = {"shape": shape, "T": T, "mode": "offline"}
        try:
            target = random_target(shape, device, layers=1)
            row.update(speculators_step_figures(target, shape, T, plan["draft_vocab"], plan["steps"], plan["warmup"]))
        except Exception as e:  # noqa: BLE001 - recorded per setting
            row["error"] = "out of memory" if is_oom(e) else f"{type(e).__name__}: {e}"[:300]
            if not is_oom(e):
                traceback.print_exc()
        target = None
        reset_peak(device)
        print("peer", json.dumps(row), flush=True)
        rows.append(row)
    return {"anchor": SPECULATORS_ANCHOR, "runs": rows}


# ---- capture ----------------------------------------------------------------------------------------------------

class BusySampler:
    """The GPU's utilisation (NVML, percent of time a kernel ran) sampled every 50 ms in a thread."""

    def __init__(self, device: torch.device):
        self.samples: list[int] = []
        self.device, self.stop = device, threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True) if device.type == "cuda" else None

    def _run(self):
        while not self.stop.is_set():
            try:
                self.samples.append(int(torch.cuda.utilization(self.device)))
            except Exception:  # noqa: BLE001 - no NVML: no figure, said in the JSON
                return
            time.sleep(0.05)

    def __enter__(self):
        if self.thread:
            self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        if self.thread:
            self.thread.join()

    def share(self) -> float | None:
        return round(sum(self.samples) / (100 * len(self.samples)), 3) if self.samples else None


def capture_part(device: torch.device, tiny: bool) -> dict:
    from draftsmith.data_gen.capture import capture_hidden_states

    shape, n, T = settings(tiny)["capture"]
    target = random_target(shape, device)
    g = torch.Generator().manual_seed(0)
    lengths = [T // 2 + int(x) for x in torch.randint(0, T // 2, (n,), generator=g)]
    input_ids = [torch.randint(0, target.vocab_size, (length,), generator=g).tolist() for length in lengths]
    with tempfile.TemporaryDirectory() as tmp:
        capture_hidden_states(target, input_ids[:2], Path(tmp) / "warm", batch_size=2, samples_per_shard=2)
        sync(device)
        with BusySampler(device) as busy:
            t0 = time.perf_counter()
            index = capture_hidden_states(target, input_ids, Path(tmp) / "hs", batch_size=8, samples_per_shard=16)
            sync(device)
            seconds = time.perf_counter() - t0
        nbytes = sum(e["bytes"] for e in index["shards"])
    tokens = sum(lengths)
    return {"shape": shape, "samples": n, "tokens": tokens, "seconds": round(seconds, 2),
            "tokens_per_s": round(tokens / seconds, 1), "bytes_per_token": round(nbytes / tokens, 1),
            "gpu_busy_share": busy.share(), "gpu_busy_note": None if device.type == "cuda" else "no GPU: not measured"}


# ---- the pipeline -----------------------------------------------------------------------------------------------

def cli(args: list[str], env: dict, log: Path, check: bool = True, crash_after: int | None = None) -> int:
    """`draftsmith <args>` in a subprocess; crash_after=N: killed after step N by the tests' fault injection."""
    code = "from draftsmith.cli import main; main()"
    if crash_after is not None:
        # the CLI first: it sets the process's threads before anything imports torch (helpers does)
        code = ("from draftsmith.cli import main; import sys; sys.path.insert(0, 'tests')\n"
                f"from helpers import crash_after_step\nwith crash_after_step({crash_after}): main()")
    cmd = [sys.executable, "-c", code, *args]
    with open(log, "a") as f:
        f.write(f"$ draftsmith {' '.join(args)}\n")
        f.flush()
        done = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    if check and done.returncode != 0:
        raise RuntimeError(f"draftsmith {args[0]} exited {done.returncode}; see {log}")
    return done.returncode


def metrics(folder: Path) -> list[dict]:
    return [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines() if line.strip()]


def pipeline_part(device: torch.device, tiny: bool, work: Path) -> dict:
    """data-gen -> train (uninterrupted; killed halfway and resumed) -> export -> eval, all on `device`. The GPU
    check trains 20 steps killed at 10; --tiny 6 killed at 3 (the tests' budget)."""
    env = {**os.environ, "WANDB_MODE": "disabled"}
    log = work / "pipeline.log"
    dev = device.type
    precision = "bf16" if dev == "cuda" else "fp32"
    n, steps = (24, 6) if tiny else (256, 20)
    t0 = time.perf_counter()
    cli(["data-gen", "target=tiny", f"target.device={dev}", "prompts=self", f"prompts.n={n}", "hidden_states=true",
         f"max_new_tokens={24 if tiny else 64}", f"out={work / 'data'}"], env, log)
    data_s = time.perf_counter() - t0
    common = ["train", "method=eagle3", "target=tiny", f"device={dev}", f"data={work / 'data'}", "deepspeed=zero2",
              f"precision={precision}", f"max_steps={steps}", f"save_every={steps // 4}", "micro_batch_size=2",
              "val_samples=4", f"eval_every={steps // 2}", "progress=false", "wandb.mode=disabled"]
    t0 = time.perf_counter()
    cli([*common, f"out={work / 'whole'}"], env, log)
    train_s = time.perf_counter() - t0
    killed = cli([*common, f"out={work / 'cut'}"], env, log, check=False, crash_after=steps // 2)
    cli([*common, f"out={work / 'cut'}", "resume=true"], env, log)
    whole, cut = metrics(work / "whole"), metrics(work / "cut")
    compared = ("loss", "tokens", "lr", "acc_0", "val_etau_greedy")
    worst = 0.0  # the largest relative difference of a compared metric between the two runs
    for a, b in zip(whole, cut):
        for k in compared:
            if a.get(k) is not None and b.get(k) is not None:
                worst = max(worst, abs(a[k] - b[k]) / max(abs(a[k]), 1e-12))
    same_keys = all((a.get(k) is None) == (b.get(k) is None) for a, b in zip(whole, cut) for k in compared)
    cli(["export", f"head={work / 'whole' / 'final'}", "format=eagle3", f"out={work / 'export'}"], env, log)
    t0 = time.perf_counter()
    cli(["eval", f"head={work / 'whole' / 'final'}", "target=tiny", f"target.device={dev}", "prompts.source=holdout",
         f"prompts.path={work / 'data'}", "prompts.holdout=2", f"max_new_tokens={16 if tiny else 64}",
         "repeats=1", "cost_repeats=1", "plot=false", f"out={work / 'eval'}", "progress=false"], env, log)
    eval_s = time.perf_counter() - t0
    report = json.loads((work / "eval" / "report.json").read_text())
    return {"data_gen_s": round(data_s, 1), "train_s": round(train_s, 1), "eval_s": round(eval_s, 1),
            "steps": len(whole), "killed_at": steps // 2, "killed_exit_code": killed,
            "records_compared": min(len(whole), len(cut)), "max_relative_difference": worst,
            # exact up to float rounding of the reductions: DeepSpeed's fp32 gradient buckets (tests: 1e-6 on weights)
            "resume_equal": bool(killed != 0 and len(whole) == len(cut) == steps and same_keys and worst <= 1e-5),
            "final_loss": whole[-1]["loss"] if whole else None, "eval_tau": report["tau"],
            "eval_n_prompts": report["n_prompts"]}


# ---- main -------------------------------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes (the tests run this on a CPU)")
    ap.add_argument("--parts", nargs="+", default=["kernels", "pipeline", "step", "peer", "capture"],
                    choices=["kernels", "pipeline", "step", "peer", "capture"])
    ap.add_argument("--attentions", nargs="+", default=["dense", "auto"],
                    help="method.attention values the step part compares (dense: the reference)")
    ap.add_argument("--out", required=True, help="the JSON to write")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", 0)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    from draftsmith.core.machine import machine_info

    result = {"machine": machine_info(), "device": str(device), "torch": torch.__version__,
              "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
              "tiny": args.tiny, "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "parts": {}}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    failed = []
    with tempfile.TemporaryDirectory() as work:
        for part in args.parts:
            t0 = time.perf_counter()
            print(f"gpu_train_check: {part} ...", flush=True)
            try:
                if part == "kernels":
                    value = kernels_part(device, args.tiny)
                elif part == "pipeline":
                    value = pipeline_part(device, args.tiny, Path(work))
                elif part == "step":
                    value = step_part(device, args.tiny, args.attentions)
                elif part == "peer":
                    value = peer_part(device, args.tiny)
                else:
                    value = capture_part(device, args.tiny)
            except Exception as e:  # noqa: BLE001 - one part's failure is recorded; the others still run
                traceback.print_exc()
                value = {"error": f"{type(e).__name__}: {e}"[:500]}
                failed.append(part)
            result["parts"][part] = {"seconds": round(time.perf_counter() - t0, 1), "result": value}
            tmp = out.with_name(out.name + ".tmp")
            tmp.write_text(json.dumps(result, indent=1, default=str))
            tmp.replace(out)  # what is measured so far survives a kill
    print(f"gpu_train_check: wrote {out}" + (f"; failed parts: {failed}" if failed else ""), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
