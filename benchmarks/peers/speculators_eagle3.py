#!/usr/bin/env python
"""The `speculators` peer: vLLM's `speculators` 0.9 EAGLE-3 trainer, run on CPU on a draftsmith data-gen folder.

Run with the project venv's python (speculators 0.9 is installed there without its deps, scripts/setup.sh):

    P=benchmarks/peers/speculators_eagle3.py
    # 1. draftsmith data-gen folder -> speculators' offline training folder (what `speculators prepare-data` +
    #    `speculators generate-offline-data` would have written)
    .venv/bin/python $P convert --data runs/demo/data --out runs/peer/data --samples 16
    # 2. convert + train with speculators' own trainer (in-process, patched for CPU) + export the head
    .venv/bin/python $P train --data runs/demo/data --out runs/peer --samples 16 --budget-s 60 --json runs/peer/run.json
    # 3. evaluate the head with draftsmith's built-in decoder (any `draftsmith eval` overrides after --head)
    .venv/bin/python $P eval --head runs/peer/head target=smollm2 prompts.source=holdout \\
        prompts.path=runs/demo/data prompts.holdout=2 prompts.n=null max_new_tokens=32 out=runs/peer/eval
    # (a head trained with --no-norm-before-fc --no-norm-output --no-norm-before-residual, i.e. without the EAGLE-3.1
    #  norms, is also written as a plain draftsmith EAGLE-3 folder, runs/peer/head_eagle3, that `draftsmith eval` and
    #  `draftsmith export` read directly; `to-eagle3` does that conversion for a finished head.)

What `train` writes under --out:
    data/          the converted data (below)                      speculators_run/  speculators' run.yaml
    head/          the trained head in the speculators format:     logs/             speculators' metric logs
                   config.json (Eagle3DraftModel) + model.safetensors + manifest.json (draftsmith's, the target)
    head_eagle3/   the same head as a draftsmith EAGLE-3 folder, only when its architecture is draftsmith's
    peer_speculators.json   this run's record (also --json): samples seen, steps, wall seconds, recipe, patches

The converted data folder (speculators' offline format, read by `speculators.train.data.ArrowDataset`):
    data-*.arrow, dataset_info.json, state.json   a `datasets` dataset (torch format): input_ids int64 (T,),
                                                  loss_mask int64 (T,), seq_len int64 = T; train rows first, then
                                                  the validation rows
    hidden_states/hs_<row>.safetensors            hidden_states (T, 4, H) in the stored dtype (bf16):
                                                  [:, 0:3] the target's aux layers in draftsmith's order
                                                  (hidden_states[i] of HF, i in aux_layer_ids), [:, 3] the last
                                                  hidden state; token_ids int64 (T,) = input_ids
    token_freq.pt                                 {token id: count} over the loss-masked tokens of the train rows
                                                  (speculators builds d2t / t2d from it when --draft-vocab-size)
    peer_data.json                                what was converted (source rows, layers, norms)

Mapping (draftsmith field -> speculators field):
    tokenized.input_ids[i]                     -> input_ids, hidden_states/hs_<row>.token_ids
    tokenized.loss_mask[i] (1 = assistant token, same convention) -> loss_mask
    hidden_states shard `<i>.aux` (T, 3H)      -> hs_<row>.hidden_states[:, :3] (speculators' dataloader flattens
                                                  [:, :-1] back to (T, 3H): the same concatenation order)
    hidden_states shard `<i>.last` (T, H)      -> hs_<row>.hidden_states[:, 3]
    manifest aux_layer_ids [2, N//2, N-3]      -> --target-layer-ids (HF hidden_states indices in both)
    `<i>.top` / `<i>.lse`                      -> not used (speculators recomputes the target logits)
  MISMATCH: draftsmith stores the last hidden state AFTER the target's final norm ("post_final_norm"); speculators'
  `verifier_last_hidden_states` is the last layer's output BEFORE it: its trainer applies `verifier_norm` (the
  target's final norm) and then the target's lm_head. Fed draftsmith's tensor unchanged, the norm would be applied
  twice. Patch `verifier_norm_identity` makes `verifier_norm` the identity, so the trainer's target logits are
  exactly lm_head(post-norm state) = the target's logits.

speculators' EAGLE-3 recipe (its defaults, speculators 0.9.0 train/config/schema.py), used unless an option says
otherwise: TTT 3 steps (ttt_step_loss_decay 1.0: no decay), loss kl_div against the target's distribution over the
draft vocab, optimizer muon (Muon lr 1e-3 on the 2-D weights, momentum 0.95, weight decay 0.1, ns_steps 5,
match_rms_adamw; AdamW lr 1e-3, weight decay 0.01 on the rest), linear schedule with 1% warmup over
epochs x steps per epoch, 20 epochs, grad clip 1.0, one packed sequence of up to 8192 tokens per step, norms
norm_before_fc=True (one RMSNorm over the concatenated 3H features, `input_norm.weight`), fc_norm=False,
norm_output=True, norm_before_residual=True, sliding-window draft attention (window 2048), frozen embeddings and
lm_head, full target vocab (no d2t/t2d) unless --draft-vocab-size, bf16 autocast (hidden_states_dtype=bfloat16).
speculators 0.9 has no feature noise.

The head's EAGLE-3.1 norms are NOT in draftsmith's EAGLE-3 head (heads/eagle3.py):
    input_norm.weight (3H)  [norm_before_fc]     x = input_norm(cat(aux)) before fc (one RMSNorm over 3H)
    fc_norm.{0,1,2}.weight  [fc_norm]            one RMSNorm per aux layer before fc (off by default)
    norm_before_residual                         the layer's residual is hidden_norm(h), not the raw h
    norm_output                                  the next step's h is norm(h'), not the pre-norm h'
None of them can be folded into draftsmith's tensors exactly (input_norm divides by the RMS of the whole 3H vector,
a nonlinearity fc cannot absorb; the other two change the layer's dataflow). So this script never converts such a
head to a draftsmith EAGLE-3 folder: `eval` registers a method row (draftsmith.core.methods.register) whose loader builds
`SpeculatorsEagle3Head`, draftsmith's EAGLE-3 head plus those norms, from the speculators folder itself, and
draftsmith's own EAGLE-3 proposer drafts with it; tests/test_peer_speculators.py proves it computes speculators'
logits. vLLM reads all four flags from the speculators config.json. The draft layer is a sliding-window layer
(speculators' default, window 2048; vLLM applies it too): the adapter masks keys more than the window behind a
query's position, which matters only for contexts over 2048 tokens.

Patches (each a named function below, applied at runtime in this process; no file of speculators is edited):
    cpu_device              the trainer moves the model and batches to `get_local_rank()` (0 = cuda:0) and autocasts
                            for "cuda" when no accelerator exists: use the CPU, autocast on "cpu"
    step_timer_no_sync      its step timer calls torch.accelerator.synchronize(), which raises without an
                            accelerator: time without synchronizing (the CPU runs synchronously)
    verifier_norm_identity  the post-norm last hidden state (above)
    budget_loop             its run_training loops over epochs with a checkpoint and a validation pass after each:
                            a loop over its own train_epoch that stops after the step at which --budget-s seconds of
                            training (or --max-samples samples) have passed, then the head is exported (no
                            per-epoch checkpoints or validation)
Options the CPU needs, passed as speculators' own flags: --draft-attn-impl sdpa (flex attention has no CPU backward),
--loss-implementation eager (the same loss; the fused one is for accelerators), --num-workers 0 (its 12 spawned
loader workers would only compete for the cores), --on-missing raise (never call a vLLM server).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Optional

SPECULATORS_ARCHITECTURE = "Eagle3DraftModel"
DATA_MARK = "peer_data.json"  # what `convert` writes: its own output folder (a rerun may replace it)
RUN_MARK = "peer_speculators.json"  # what `train` writes into --out


class PeerError(Exception):
    """A user error: one sentence, exit 2."""


# =====================================================================================================
# 1. Converter: draftsmith data-gen folder -> speculators' offline training folder
# =====================================================================================================

def parse_indices(spec: str) -> list[int]:
    """'0-15,20,30-31' -> [0, ..., 15, 20, 30, 31] (a file of such specs with @path)."""
    if spec.startswith("@"):
        spec = Path(spec[1:]).read_text().replace("\n", ",")
    out: list[int] = []
    for part in filter(None, (p.strip() for p in spec.split(","))):
        lo, _, hi = part.partition("-")
        out.extend(range(int(lo), int(hi) + 1) if hi else [int(lo)])
    return out


def select_rows(num_rows: int, samples: Optional[int], indices: Optional[list[int]], val_samples: int
                ) -> tuple[list[int], list[int]]:
    """(train rows, validation rows) of the tokenized set: `indices`, else the first `samples` rows (else all but
    the validation rows); validation: the `val_samples` rows after the last train row that are not train rows."""
    if indices is not None and samples is not None:
        raise PeerError("give --samples or --indices, not both.")
    if indices is not None:
        train = list(dict.fromkeys(indices))
    else:
        n = num_rows - val_samples if samples is None else samples
        train = list(range(n))
    bad = [i for i in train if not 0 <= i < num_rows]
    if bad:
        raise PeerError(f"row {bad[0]} is not in the data (it has {num_rows} rows).")
    if not train:
        raise PeerError("no training rows selected.")
    taken = set(train)
    after = [i for i in range(max(train) + 1, num_rows) if i not in taken]
    before = [i for i in range(num_rows) if i not in taken and i < max(train)]
    val = (after + before)[:val_samples]
    if len(val) < val_samples:
        raise PeerError(f"--val-samples={val_samples}: only {len(val)} rows are left out of the train rows.")
    return train, val


def _claim(folder: Path, mark: str, keep: Optional[Path] = None) -> None:
    """`folder` new, empty, or this script's own earlier output (it holds `mark`): emptied; else refused. `keep`
    (an input) must not be inside it."""
    if keep is not None and Path(keep).resolve().is_relative_to(Path(folder).resolve()):
        raise PeerError(f"{keep} is inside the output folder {folder}; give an output folder apart from the input.")
    if folder.exists() and not folder.is_dir():
        raise PeerError(f"{folder} is a file, not a folder.")
    if folder.is_dir() and any(folder.iterdir()):
        if not (folder / mark).is_file():
            raise PeerError(f"{folder} is not empty and is not an earlier output of this script (no {mark}); "
                            f"give a new or empty folder.")
        shutil.rmtree(folder)
    folder.mkdir(parents=True, exist_ok=True)


def convert(data_dir: str | Path, out_dir: str | Path, train_rows: list[int], val_rows: list[int],
            target_identity: Optional[dict] = None) -> dict:
    """Write speculators' offline format for `train_rows` then `val_rows` of a draftsmith data-gen folder.

    Reads the data with draftsmith's own loaders (tokenized set, manifest, checked hidden-state shards). Rows
    without a loss-masked token or shorter than 2 tokens are dropped (draftsmith's training drops them too).
    Returns the record written to out/peer_data.json."""
    import datasets
    import torch
    from safetensors.torch import save_file

    from draftsmith.core import DraftsmithError
    from draftsmith.data_gen.dataset import load_tokenized
    from draftsmith.train.data import open_hidden_states

    data_dir, out_dir = Path(data_dir).resolve(), Path(out_dir)
    try:
        ds, manifest = load_tokenized(data_dir, target_identity)
        hs_info = manifest.get("hidden_states")
        if not hs_info:
            raise PeerError(f"{data_dir} has no hidden states: speculators trains offline here; rerun data-gen "
                            f"with hidden_states=true.")
        hidden = open_hidden_states(str(data_dir), len(ds))
    except DraftsmithError as e:
        raise PeerError(str(e)) from None
    H = int(hs_info["hidden_size"])
    aux_ids = [int(i) for i in hs_info["aux_layer_ids"]]
    ids_col, mask_col = ds["input_ids"], ds["loss_mask"]

    def usable(i: int) -> bool:
        return len(ids_col[i]) >= 2 and sum(mask_col[i]) > 0

    rows = [("train", i) for i in train_rows] + [("val", i) for i in val_rows]
    dropped = [i for _, i in rows if not usable(i)]
    rows = [(split, i) for split, i in rows if usable(i)]
    n_train = sum(split == "train" for split, _ in rows)
    if n_train == 0 or n_train == len(rows):
        raise PeerError(f"after dropping rows without a loss-masked token ({dropped}), {n_train} train and "
                        f"{len(rows) - n_train} validation rows are left; speculators needs at least one of each.")
    _claim(out_dir, DATA_MARK, keep=data_dir)
    (out_dir / "hidden_states").mkdir()
    input_ids, loss_mask, seq_len, freq = [], [], [], Counter()
    for row, (split, i) in enumerate(rows):
        ids = torch.tensor(list(ids_col[i]), dtype=torch.long)
        mask = torch.tensor(list(mask_col[i]), dtype=torch.long)
        aux, last = hidden[i]  # (T, 3H), (T, H): the stored dtype
        T = ids.numel()
        if tuple(aux.shape) != (T, len(aux_ids) * H) or tuple(last.shape) != (T, H):
            raise PeerError(f"sample {i}: hidden states {tuple(aux.shape)} / {tuple(last.shape)} do not fit its "
                            f"{T} tokens and hidden size {H}.")
        stacked = torch.cat([aux.reshape(T, len(aux_ids), H), last.reshape(T, 1, H)], dim=1).contiguous()
        save_file({"hidden_states": stacked, "token_ids": ids.clone()},
                  str(out_dir / "hidden_states" / f"hs_{row}.safetensors"))
        input_ids.append(ids.tolist())
        loss_mask.append(mask.tolist())
        seq_len.append(T)
        if split == "train":
            freq.update(ids[mask.bool()].tolist())
    features = datasets.Features({"input_ids": datasets.Sequence(datasets.Value("int64")),
                                  "loss_mask": datasets.Sequence(datasets.Value("int64")),
                                  "seq_len": datasets.Value("int64")})
    table = datasets.Dataset.from_dict({"input_ids": input_ids, "loss_mask": loss_mask, "seq_len": seq_len},
                                       features=features)
    table.set_format(type="torch")  # what speculators' prepare-data saves: its dataloader reads tensors
    table.save_to_disk(str(out_dir))
    torch.save({int(k): int(v) for k, v in freq.items()}, out_dir / "token_freq.pt")
    record = {
        "source_data": str(data_dir),
        "target": manifest.get("target"),
        "train_rows": [i for split, i in rows if split == "train"],
        "val_rows": [i for split, i in rows if split == "val"],
        "dropped_rows": dropped,
        "num_train": n_train,
        "num_val": len(rows) - n_train,
        "tokens_train": sum(seq_len[:n_train]),
        "loss_tokens_train": sum(sum(m) for m in loss_mask[:n_train]),
        "aux_layer_ids": aux_ids,
        "hidden_size": H,
        "hidden_states_dtype": str(hs_info.get("dtype")),
        "last_hidden_state": hs_info.get("last_hidden_state"),
        "layout": "hidden_states/hs_<row>.safetensors: hidden_states (T, 4, H) = aux layers " + str(aux_ids)
                  + " then the last hidden state; token_ids (T,) int64; rows: train first, then validation",
    }
    (out_dir / DATA_MARK).write_text(json.dumps(record, indent=2) + "\n")
    return record


def train_data_ratio(num_train: int, num_rows: int) -> float:
    """speculators' --train-data-ratio that puts exactly the first `num_train` rows in its train split (it takes
    int(rows * ratio) rows; the half row keeps float rounding from losing one)."""
    return (num_train + 0.5) / num_rows


# =====================================================================================================
# 2. Patches: small, named, applied at runtime in this process only (never an edit of site-packages)
# =====================================================================================================

APPLIED: list[dict] = []  # one entry per patch applied: name, target, why


def _applied(name: str, target: str, why: str) -> None:
    APPLIED.append({"name": name, "target": target, "why": why})


def patch_step_timer_no_sync() -> None:
    """speculators.train.trainer._StepTimer.mark / now call torch.accelerator.synchronize() on every logged step,
    which raises "Cannot access accelerator device when none is available" on a CPU-only machine. Replace the
    timer with a subclass that takes the same timestamps without synchronizing (CPU work is synchronous)."""
    import speculators.train.trainer as trainer_module

    base = trainer_module._StepTimer

    class CpuStepTimer(base):
        def mark(self, name: str) -> None:
            if self.enabled:
                self._marks[name] = time.perf_counter()

        def now(self) -> Optional[float]:
            return time.perf_counter() if self.enabled else None

    trainer_module._StepTimer = CpuStepTimer
    _applied("step_timer_no_sync", "speculators.train.trainer._StepTimer.mark/now",
             "torch.accelerator.synchronize() raises without an accelerator; CPU timestamps need no sync")


def patch_verifier_norm_identity() -> None:
    """draftsmith's last hidden state is already after the target's final norm; speculators applies that norm
    (`verifier_norm`) again before the target's lm_head. Wrap speculators.train.cli.build_draft_model so the built
    model's verifier_norm is the identity: its target logits are then exactly lm_head(post-norm state).
    verifier_norm is frozen and never saved (speculators' _keys_to_ignore_on_save), so the head is unchanged."""
    import torch
    import speculators.train.cli as cli

    original = cli.build_draft_model

    def build_draft_model(*args, **kwargs):
        model = original(*args, **kwargs)
        model.verifier_norm = torch.nn.Identity()
        return model

    cli.build_draft_model = build_draft_model
    _applied("verifier_norm_identity", "speculators.train.cli.build_draft_model -> model.verifier_norm",
             "draftsmith stores the last hidden state post final norm; speculators would apply the norm twice")


def patch_trainer(budget_s: Optional[float], max_samples: Optional[int], export) -> dict:
    """Install a subclass of speculators' Trainer as the one speculators.train.cli.main builds. Two patches:

    cpu_device: Trainer.setup_model moves the model to `self.local_rank` (get_local_rank() = 0, i.e. cuda:0) and
    the step autocasts for `self.device_type`, "cuda" when there is no accelerator (so bf16 autocast would be
    silently off). On CPU both become "cpu" before its own setup_model runs.

    budget_loop: Trainer.run_training loops over epochs with a checkpoint and a validation pass after each. This
    loop calls its own train_epoch per epoch with a step callback that, after the step at which `budget_s`
    seconds of training (from the start of the loop, data loading included) or `max_samples` samples have passed,
    sets max_steps to the current step (train_epoch's own stop test then ends the epoch) and stops; the head is
    then exported with `export(model)`. No per-epoch checkpoint or validation pass (the benchmark evaluates the
    exported head with draftsmith eval). A forward pre-hook counts samples (documents packed in the step),
    tokens and loss tokens; a forward hook records each step's loss.

    Returns the dict the run's figures are written into."""
    import torch
    import speculators.train.cli as cli

    base = cli.Trainer
    record: dict = {"steps": 0, "samples_seen": 0, "tokens_seen": 0, "loss_tokens_seen": 0, "losses": [],
                    "stop_reason": None, "epochs_started": 0}

    class PeerTrainer(base):
        def setup_model(self):
            self.local_rank = torch.device("cpu")
            self.device_type = "cpu"
            super().setup_model()

        def _count(self, module, args, kwargs):
            doc = kwargs["document_ids"]
            record["samples_seen"] += int(torch.unique(doc[doc >= 0]).numel())
            record["tokens_seen"] += int((doc >= 0).sum())
            if kwargs.get("loss_mask") is not None:
                record["loss_tokens_seen"] += int(kwargs["loss_mask"].sum())

        def _loss(self, module, args, kwargs, output):
            if isinstance(output, tuple) and len(output) == 3:
                record["losses"].append(round(float(output[1].detach()), 5))

        def _after_step(self):
            elapsed = time.perf_counter() - self._peer_start
            record["steps"] = self.global_step
            if budget_s is not None and elapsed >= budget_s:
                record["stop_reason"] = "budget_s"
            elif max_samples is not None and record["samples_seen"] >= max_samples:
                record["stop_reason"] = "max_samples"
            elif self.config.max_steps is not None and self.global_step >= self.config.max_steps:
                record["stop_reason"] = "max_steps"
            if record["stop_reason"]:
                self.config = self.config._replace(max_steps=self.global_step)

        def run_training(self):
            hooks = [self.model.register_forward_pre_hook(self._count, with_kwargs=True),
                     self.model.register_forward_hook(self._loss, with_kwargs=True)]
            self._peer_start = time.perf_counter()
            record["setup_s"] = round(self._peer_start - record["main_start"], 3)
            try:
                for epoch in range(self.current_epoch, self.config.num_epochs):
                    record["epochs_started"] = epoch + 1
                    self.train_epoch(epoch, step_callback=self._after_step)
                    if record["stop_reason"]:
                        break
                else:
                    record["stop_reason"] = "epochs"
            finally:
                record["train_wall_s"] = round(time.perf_counter() - self._peer_start, 3)
                record["steps"] = self.global_step
                for h in hooks:
                    h.remove()
            t = time.perf_counter()
            export(self.model)
            record["export_s"] = round(time.perf_counter() - t, 3)

    cli.Trainer = PeerTrainer
    _applied("cpu_device", "speculators.train.trainer.Trainer.setup_model (local_rank, device_type)",
             "the trainer sends tensors to get_local_rank()=0 (cuda:0) and autocasts for 'cuda' without an "
             "accelerator; use the CPU and autocast on 'cpu'")
    _applied("budget_loop", "speculators.train.trainer.Trainer.run_training",
             f"stop after the step at which budget_s={budget_s} s of training or max_samples={max_samples} samples "
             "have passed, then export; no per-epoch checkpoint or validation")
    return record


# =====================================================================================================
# 3. Training: speculators' own `speculators train` entry (TrainConfig.resolve + main), in this process
# =====================================================================================================

def speculators_argv(args, data: Path, out: Path, verifier: str, record: dict) -> list[str]:
    """The `speculators train` flags of this run: the data and verifier, what the CPU needs, and only the recipe
    options an option of this script changes; anything after `--` is passed through."""
    argv = ["--speculator-type", "eagle3", "--verifier-name-or-path", verifier, "--data-path", str(data),
            "--save-path", str(out / "speculators_run"), "--log-dir", str(out / "logs"),
            "--target-layer-ids", *map(str, record["aux_layer_ids"]),
            "--train-data-ratio", repr(train_data_ratio(record["num_train"], record["num_train"] + record["num_val"])),
            "--hidden-states-dtype", {"fp32": "float32", "bf16": "bfloat16"}[args.precision],
            # what the CPU needs
            "--draft-attn-impl", "sdpa", "--loss-implementation", "eager",
            "--num-workers", str(args.num_workers), "--on-missing", "raise", "--no-resume-from-checkpoint"]
    for flag, value in (("--total-seq-len", args.total_seq_len), ("--epochs", args.epochs), ("--seed", args.seed),
                        ("--draft-vocab-size", args.draft_vocab_size), ("--max-steps", args.max_steps)):
        if value is not None:
            argv += [flag, str(value)]
    return argv + list(args.speculators_args)


def _jsonable(value):
    try:
        json.dumps(value)
        return value
    except TypeError:
        return str(value)


def process_settings() -> dict:
    """draftsmith's CLI process settings, applied here too so both trainers run alike: OpenMP's short spin
    (before torch loads), torch threads = the cores this process may use, subnormals flushed to zero."""
    from draftsmith.core import procenv

    spin = procenv.share_cores()
    from draftsmith.core import machine

    threads, why = machine.use_threads()
    return {"omp_spin_env_set": spin, "torch_threads": threads, "threads_why": why,
            "flush_denormal": machine.flush_denormals()}


def load_target_lazily(name: str):
    """draftsmith's target (tokenizer, config, identity; no weights) and the HF folder speculators reads as the
    verifier (a GGUF target's cached safetensors copy)."""
    from draftsmith.core import DraftsmithError
    from draftsmith.data_gen.target import TargetConfig, load_target
    from draftsmith.core.engine import served_folder
    from draftsmith.core.layers import default_aux_layer_ids

    try:
        target = load_target(TargetConfig(name=name), lazy=True, layers=default_aux_layer_ids)
        folder = served_folder(target, "the speculators peer")
    except DraftsmithError as e:
        raise PeerError(str(e)) from None
    if not (Path(folder) / "config.json").is_file():
        raise PeerError(f"the target's folder {folder} has no config.json: speculators needs an HF folder.")
    return target, folder


def cmd_train(args) -> dict:
    t_start = time.perf_counter()
    if args.budget_s is not None and args.budget_s <= 0:
        raise PeerError("--budget-s must be positive.")
    out = Path(args.out).resolve()
    _claim(out, RUN_MARK, keep=Path(args.data))
    (out / RUN_MARK).write_text("{}\n")  # claimed: a rerun may replace this folder
    settings = process_settings()
    target, verifier = load_target_lazily(args.target)
    train_rows, val_rows = _rows(args, target)
    data_record = convert(args.data, out / "data", train_rows, val_rows, target.identity())

    import torch

    from importlib.metadata import version

    from speculators.train.checkpointer import patch_config_dtype
    from speculators.train.cli import main as speculators_main
    from speculators.train.config import TrainConfig

    save_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.save_dtype or args.precision]
    head_dir, eagle3_dir = out / "head", out / "head_eagle3"
    heads: dict = {}

    def export(model) -> None:
        """speculators' own save_pretrained (config.json + model.safetensors, verifier tensors left out) in
        `save_dtype`, config dtype set as speculators' checkpointer does, plus draftsmith's manifest (the target);
        and the draftsmith EAGLE-3 folder when the architecture is draftsmith's."""
        state = {k: (v.detach().to(save_dtype) if v.is_floating_point() else v.detach())
                 for k, v in model.state_dict().items()}
        model.save_pretrained(str(head_dir), state_dict=state)
        patch_config_dtype(head_dir / "config.json", save_dtype)
        write_head_manifest(head_dir, target.identity(), args)
        heads["head"] = str(head_dir)
        why_not = eagle3_incompatibility(json.loads((head_dir / "config.json").read_text()))
        if why_not is None:
            to_eagle3(head_dir, eagle3_dir)
            heads["head_eagle3"] = str(eagle3_dir)
        else:
            heads["head_eagle3"] = None
            heads["head_eagle3_why_not"] = why_not

    APPLIED.clear()
    patch_step_timer_no_sync()
    patch_verifier_norm_identity()
    record = patch_trainer(args.budget_s, args.max_samples, export)
    argv = speculators_argv(args, out / "data", out, verifier, data_record)
    cfg = TrainConfig.resolve(argv)
    record["main_start"] = time.perf_counter()
    speculators_main(cfg)
    record.pop("main_start")
    if "head" not in heads:
        raise PeerError("speculators' trainer returned without training (no head was exported).")

    flat = {k: _jsonable(v) for k, v in cfg.flatten().items()}
    default = {k: _jsonable(v) for k, v in TrainConfig(speculator_type="eagle3").flatten().items()}
    result = {
        "peer": f"speculators {version('speculators')}",
        "command": [sys.executable, *sys.argv],
        "speculators_argv": argv,
        "samples_seen": record["samples_seen"],
        "steps": record["steps"],
        "train_wall_s": record["train_wall_s"],
        "stop_reason": record["stop_reason"],
        "tokens_seen": record["tokens_seen"],
        "loss_tokens_seen": record["loss_tokens_seen"],
        "epochs_started": record["epochs_started"],
        "budget_s": args.budget_s,
        "max_samples": args.max_samples,
        "precision": args.precision,
        "save_dtype": str(save_dtype).removeprefix("torch."),
        "setup_s": record.get("setup_s"),
        "export_s": record.get("export_s"),
        "total_wall_s": round(time.perf_counter() - t_start, 3),
        "losses": record["losses"],
        "samples_seen_counting": "documents packed into each step's sequence (a document cut at total_seq_len "
                                 "counts as seen); each loses its first token to speculators' shift",
        "recipe": flat,
        "recipe_changed_from_speculators_defaults": {k: {"default": default.get(k), "used": v}
                                                     for k, v in flat.items() if default.get(k) != v},
        "patches": list(APPLIED),
        "data": data_record,
        **heads,
        "process": settings,
    }
    text = json.dumps(result, indent=2) + "\n"
    (out / RUN_MARK).write_text(text)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(text)
    return result


def write_head_manifest(folder: Path, identity: dict, args) -> None:
    """draftsmith's manifest beside the speculators files: eval refuses the head beside another target."""
    from draftsmith.core.artifacts import write_manifest

    write_manifest(folder, "peer", identity, {}, peer="speculators 0.9 EAGLE-3 trainer (benchmarks/peers)",
                   format="speculators")


def _rows(args, target) -> tuple[list[int], list[int]]:
    from draftsmith.core import DraftsmithError
    from draftsmith.data_gen.dataset import load_tokenized

    try:
        ds, _ = load_tokenized(args.data, target.identity() if target is not None else None)
    except DraftsmithError as e:
        raise PeerError(str(e)) from None
    indices = parse_indices(args.indices) if args.indices else None
    return select_rows(len(ds), args.samples, indices, args.val_samples)


def cmd_convert(args) -> dict:
    target = load_target_lazily(args.target)[0] if args.target != "none" else None
    train_rows, val_rows = _rows(args, target)
    return convert(args.data, args.out, train_rows, val_rows, target.identity() if target else None)


# =====================================================================================================
# 4. The head in draftsmith's decoder: draftsmith's EAGLE-3 head plus speculators' EAGLE-3.1 norms
# =====================================================================================================

def speculators_flags(config: dict) -> dict:
    """The four norm flags of a speculators EAGLE-3 config.json (speculators' own defaults when absent)."""
    return {"norm_before_fc": bool(config.get("norm_before_fc", False)), "fc_norm": bool(config.get("fc_norm", False)),
            "norm_before_residual": bool(config.get("norm_before_residual", False)),
            "norm_output": bool(config.get("norm_output", False))}


def head_config(config: dict, where: Path):
    """The LlamaConfig draftsmith's EAGLE-3 head is built from, read from a speculators config.json (its
    transformer_layer_config: a 1-layer Llama), with the norm flags as attributes."""
    from transformers import LlamaConfig

    from draftsmith.heads.kit import draft_config_from_target

    if SPECULATORS_ARCHITECTURE not in (config.get("architectures") or []) \
            or config.get("speculators_model_type") != "eagle3":
        raise PeerError(f"{where} is not a speculators EAGLE-3 folder (architectures {config.get('architectures')}).")
    layer = dict(config.get("transformer_layer_config") or {})
    if layer.get("model_type", "llama") != "llama":
        raise PeerError(f"{where}: draft layer model_type {layer.get('model_type')!r}; draftsmith's EAGLE-3 layer "
                        f"is a Llama layer (q_norm / k_norm of qwen3 are not in it).")
    if int(layer.get("num_hidden_layers", 1)) != 1:
        raise PeerError(f"{where}: {layer.get('num_hidden_layers')} draft layers; draftsmith's EAGLE-3 head has one.")
    if layer.get("attention_bias") or layer.get("mlp_bias"):
        raise PeerError(f"{where}: the draft layer has biases; draftsmith's EAGLE-3 layer has none.")
    sliding = "sliding_attention" in (layer.get("layer_types") or []) or bool(layer.get("use_sliding_window"))
    window = layer.get("sliding_window") if sliding else None
    for key in ("_attn_implementation", "architectures", "layer_types", "use_sliding_window"):
        layer.pop(key, None)
    llama = LlamaConfig(**layer)
    cfg = draft_config_from_target(llama, int(config["draft_vocab_size"]))
    if cfg.draft_vocab_size != int(config["draft_vocab_size"]):
        raise PeerError(f"{where}: draft_vocab_size {config['draft_vocab_size']} exceeds the vocab {llama.vocab_size}.")
    cfg.target_hidden_size = int(config.get("target_hidden_size") or llama.hidden_size)
    for flag, value in speculators_flags(config).items():
        setattr(cfg, flag, value)
    cfg.sliding_window = int(window) if window else None
    return cfg


def _head_class():
    """SpeculatorsEagle3Head, built on first use (this module imports no torch at import time)."""
    global SpeculatorsEagle3Head
    if "SpeculatorsEagle3Head" in globals():
        return SpeculatorsEagle3Head
    import torch
    from torch import nn
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from draftsmith.heads.eagle3 import Eagle3Head

    class _SpeculatorsEagle3Head(Eagle3Head):
        """draftsmith's EAGLE-3 head (same tensors, midlayer.* = speculators' layers.0.*) plus the speculators
        0.9 options, in speculators' forward order (models/eagle3/core.py, model_definitions.py):

            x   = input_norm(cat(aux))                       [norm_before_fc; input_norm.weight (3H)]
            x   = cat(fc_norm.i(aux_i))                      [fc_norm; fc_norm.{0,1,2}.weight (H)]
            h0  = fc(x)
            hn  = hidden_norm(h)
            out = r + o_proj(attn(cat(input_layernorm(embed), hn)))   r = hn [norm_before_residual] else h
            out = out + mlp(post_attention_layernorm(out))
            logits = lm_head(norm(out)); next h = norm(out) [norm_output] else out

        Sliding window (config.sliding_window W, speculators' sliding_attention layer): a query at position p reads
        no key slot s <= p - W. In draftsmith's EAGLE-3 proposer committed entry j sits at slot j = its position
        and draft nodes sit past every entry (a draft slot is never W behind), so the slot test is the position
        test vLLM applies. With every flag off and W=None it is exactly draftsmith's Eagle3Head."""

        def __init__(self, config):
            super().__init__(config)
            H_t = getattr(config, "target_hidden_size", None) or config.hidden_size
            eps = config.rms_norm_eps
            self.norm_before_fc = bool(getattr(config, "norm_before_fc", False))
            self.use_fc_norm = bool(getattr(config, "fc_norm", False))
            self.norm_before_residual = bool(getattr(config, "norm_before_residual", False))
            self.norm_output = bool(getattr(config, "norm_output", False))
            if self.norm_before_fc and self.use_fc_norm:
                raise PeerError("norm_before_fc and fc_norm are mutually exclusive (as in speculators).")
            self.sliding_window = getattr(config, "sliding_window", None)
            self.input_norm = LlamaRMSNorm(3 * H_t, eps=eps) if self.norm_before_fc else None
            self.fc_norm = nn.ModuleList([LlamaRMSNorm(H_t, eps=eps) for _ in range(3)]) if self.use_fc_norm else None

        def fuse(self, aux_hidden_states: torch.Tensor) -> torch.Tensor:
            x = aux_hidden_states.to(self.fc.weight.dtype)
            if self.input_norm is not None:
                x = self.input_norm(x)
            if self.fc_norm is not None:
                x = torch.cat([norm(c) for norm, c in zip(self.fc_norm, x.chunk(len(self.fc_norm), dim=-1))], dim=-1)
            return self.fc(x)

        def forward(self, input_ids, hidden, position_ids, attn_mask, kv_cache=None, cache_positions=None):
            W = self.sliding_window
            if W and attn_mask.shape[-1] > W:  # keys more than W behind the query's position are out of reach
                slots = torch.arange(attn_mask.shape[-1], device=attn_mask.device)
                in_window = slots[None, None, :] > position_ids[:, :, None] - W  # (B, T, S)
                attn_mask = attn_mask & in_window[:, None]
            m = self.midlayer
            embeds = self.embed_tokens(input_ids).to(hidden.dtype)
            cos, sin = self.rotary_emb(hidden, position_ids)
            normed = m.hidden_norm(hidden)
            x = torch.cat([m.input_layernorm(embeds), normed], dim=-1)
            residual = normed if self.norm_before_residual else hidden
            h = residual + m.self_attn(x, cos, sin, attn_mask, kv_cache, cache_positions)
            h = h + m.mlp(m.post_attention_layernorm(h))
            out = self.norm(h)
            return (out if self.norm_output else h), self.lm_head(out)

    SpeculatorsEagle3Head = _SpeculatorsEagle3Head
    return SpeculatorsEagle3Head


def speculators_tensor_shapes(cfg) -> dict[str, tuple[int, ...]]:
    """The speculators folder's tensors (names as saved) and shapes for `cfg`."""
    from draftsmith.heads.eagle3_folders import eagle3_tensor_shapes, speculators_name

    H_t = getattr(cfg, "target_hidden_size", None) or cfg.hidden_size
    shapes = {speculators_name(n): s for n, s in eagle3_tensor_shapes(cfg).items()}
    if cfg.norm_before_fc:
        shapes["input_norm.weight"] = (3 * H_t,)
    if cfg.fc_norm:
        shapes.update({f"fc_norm.{i}.weight": (H_t,) for i in range(3)})
    return shapes


def load_speculators_folder(folder: str | Path, device="cpu", dtype=None, target_embeddings=None):
    """A speculators EAGLE-3 folder -> SpeculatorsEagle3Head; every tensor's name, shape and dtype checked
    (draftsmith's reader: safetensors only). Renames layers.0.* -> midlayer.*; a full-vocab head (no d2t / t2d)
    gets the identity map; a folder without embed_tokens takes the target's."""
    import torch

    from draftsmith.core import DraftsmithError
    from draftsmith.heads.folders import EMBED, WEIGHTS, build_head, read_checked_tensors, with_target_embeddings

    folder = Path(folder)
    config = json.loads((folder / "config.json").read_text())
    cfg = head_config(config, folder)
    shapes = speculators_tensor_shapes(cfg)
    full_vocab = cfg.draft_vocab_size == cfg.vocab_size
    optional = (EMBED, "d2t", "t2d") if full_vocab else (EMBED,)
    try:
        tensors = read_checked_tensors(folder / WEIGHTS, shapes, optional=optional)
        if full_vocab and ("d2t" in tensors) != ("t2d" in tensors):
            raise PeerError(f"{folder / WEIGHTS} has only one of d2t / t2d.")
        if "d2t" not in tensors:
            tensors["d2t"] = torch.zeros(cfg.draft_vocab_size, dtype=torch.long)
            tensors["t2d"] = torch.ones(cfg.vocab_size, dtype=torch.bool)
        ours = {("midlayer." + n.removeprefix("layers.0.") if n.startswith("layers.0.") else n): t
                for n, t in tensors.items()}
        expected = {("midlayer." + n.removeprefix("layers.0.") if n.startswith("layers.0.") else n): s
                    for n, s in shapes.items()}
        ours = with_target_embeddings(ours, expected, folder, target_embeddings)
        head = build_head(_head_class(), cfg, ours, device, dtype)
    except DraftsmithError as e:
        raise PeerError(str(e)) from None
    head.embed_tokens.weight.requires_grad_(False)
    return head


def eagle3_incompatibility(config: dict) -> Optional[str]:
    """Why a speculators EAGLE-3 config cannot become a draftsmith EAGLE-3 folder exactly (None: it can)."""
    on = [flag for flag, value in speculators_flags(config).items() if value]
    if on:
        return (f"{', '.join(on)} on: draftsmith's EAGLE-3 head (heads/eagle3.py) has no such norm, and none folds "
                f"into its tensors exactly; evaluate it with `{Path(__file__).name} eval --head <speculators folder>`")
    return None


def to_eagle3(speculators_dir: str | Path, out_dir: str | Path) -> Path:
    """A speculators EAGLE-3 folder without the EAGLE-3.1 norms -> draftsmith's EAGLE-3 folder, exactly:
    layers.0.* -> midlayer.*, fc / norm / lm_head / embed_tokens / d2t / t2d unchanged (the identity map added for
    a full-vocab head), written by draftsmith's own save_eagle3 (config LlamaForCausalLMEagle3, manifest)."""
    from draftsmith.core.artifacts import read_manifest
    from draftsmith.heads.eagle3 import Eagle3Head
    from draftsmith.heads.eagle3_folders import save_eagle3

    speculators_dir = Path(speculators_dir)
    config = json.loads((speculators_dir / "config.json").read_text())
    why = eagle3_incompatibility(config)
    if why:
        raise PeerError(f"{speculators_dir}: {why}.")
    spec_head = load_speculators_folder(speculators_dir)
    head = Eagle3Head(spec_head.config)
    head.to(spec_head.fc.weight.dtype)
    head.load_state_dict(spec_head.state_dict(), strict=True)
    identity = None
    if (speculators_dir / "manifest.json").is_file():
        identity = read_manifest(speculators_dir).get("target")
    return save_eagle3(head, Path(out_dir), manifest_target=identity, stage="export")


# ---- the method table's hooks (draftsmith.core.method_hooks), for `eval` -------------------------------

def claims(config: dict) -> bool:
    return config.get("speculators_model_type") == "eagle3"


def load(folder: Path, target=None):
    from draftsmith.core import DraftsmithError

    config = json.loads((Path(folder) / "config.json").read_text())
    if target is None:
        return load_speculators_folder(folder)
    hidden = config.get("target_hidden_size") or (config.get("transformer_layer_config") or {}).get("hidden_size")
    if hidden != target.hidden_size:
        raise DraftsmithError(f"head {folder} reads target hidden size {hidden}, target {target.target_id!r} has "
                              f"{target.hidden_size}.")
    aux = config.get("eagle_aux_hidden_state_layer_ids")
    if aux is not None and list(aux) != list(target.aux_layer_ids):
        raise DraftsmithError(f"head {folder} reads target layers {aux}, the target gives {target.aux_layer_ids}.")
    # what draftsmith's heads.folders.target_load_options gives a head (it reads top-level sizes, which a
    # speculators config nests under transformer_layer_config): the target's device, dtype and embeddings
    options = {"device": target.device, "dtype": target.dtype,
               "target_embeddings": target.model.get_input_embeddings()}
    try:
        return load_speculators_folder(folder, **options)
    except PeerError as e:
        raise DraftsmithError(str(e)) from None


def save(drafter, folder, identity):
    raise PeerError("the speculators peer's heads are written by its `train` command, not by draftsmith train.")


def register_method() -> None:
    """Add the row `speculators_eagle3` to draftsmith's method table (draftsmith.core.methods.register): folders with
    architectures [Eagle3DraftModel] and speculators_model_type eagle3 load with this module's `load`, read the
    target's EAGLE-3 layers (low, middle, high), and draftsmith's own EAGLE-3 proposer drafts with them; vLLM serves
    them as eagle3."""
    from draftsmith.core.engine import Engines
    from draftsmith.core.layers import default_aux_layer_ids
    from draftsmith.core.method_hooks import FolderHooks
    from draftsmith.core.methods import Method, register
    from draftsmith.eval.proposers import eagle3

    # formats: none, export writes nothing for this row (the speculators folder is already vLLM's format)
    hooks = FolderHooks(architectures=(SPECULATORS_ARCHITECTURE,), formats={}, load=load, save=save, claims=claims,
                        aux_layer_ids=default_aux_layer_ids)
    register(Method("speculators_eagle3", folders=lambda: hooks, proposers=lambda: eagle3.proposer,
                    engines=Engines(vllm="eagle3")))


def cmd_eval(args, overrides: list[str]) -> None:
    """`draftsmith eval head=<folder> <overrides>` in this process, with the row registered."""
    register_method()
    from draftsmith import cli

    cli.main(["eval", f"head={args.head}", *overrides])


# =====================================================================================================
# CLI
# =====================================================================================================

def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="speculators_eagle3.py", description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)

    def rows(p):
        p.add_argument("--data", required=True, help="a draftsmith data-gen folder with hidden_states/")
        p.add_argument("--samples", type=int, default=None, help="train on the first N rows (default: all but "
                                                                  "the validation rows)")
        p.add_argument("--indices", default=None, help="train on these rows: '0-15,20' or @file")
        p.add_argument("--val-samples", type=int, default=1,
                       help="rows for speculators' validation split (it needs one; not run here; default 1)")
        p.add_argument("--target", default="smollm2", help="draftsmith target (preset, HF folder, .gguf)")

    c = sub.add_parser("convert", help="draftsmith data-gen folder -> speculators' offline training folder")
    rows(c)
    c.add_argument("--out", required=True)

    t = sub.add_parser("train", help="convert + speculators' EAGLE-3 trainer on CPU + export")
    rows(t)
    t.add_argument("--out", required=True)
    t.add_argument("--budget-s", type=float, default=None, help="stop after the step at which this many seconds of "
                                                                "training have passed")
    t.add_argument("--max-samples", type=int, default=None, help="stop after the step at which this many samples "
                                                                 "have been seen")
    t.add_argument("--max-steps", type=int, default=None, help="speculators' --max-steps")
    t.add_argument("--precision", choices=("fp32", "bf16"), default="fp32",
                   help="fp32: fp32 data and compute; bf16: bf16 data and bf16 autocast (speculators' default); "
                        "master weights fp32 in both")
    t.add_argument("--save-dtype", choices=("fp32", "bf16"), default=None, help="the head's dtype (default: "
                                                                                "--precision)")
    t.add_argument("--total-seq-len", type=int, default=None, help="tokens packed per step (speculators: 8192)")
    t.add_argument("--epochs", type=int, default=None, help="speculators: 20 (sets the LR schedule's length)")
    t.add_argument("--draft-vocab-size", type=int, default=None, help="speculators: full target vocab")
    t.add_argument("--seed", type=int, default=None, help="speculators: 42")
    t.add_argument("--num-workers", type=int, default=0, help="dataloader workers (speculators: 12)")
    t.add_argument("--json", default=None, help="also write the run's record here")
    t.add_argument("speculators_args", nargs=argparse.REMAINDER,
                   help="after --: more `speculators train` flags, e.g. -- --ttt-steps 7")

    e = sub.add_parser("eval", help="draftsmith eval of a speculators head (overrides after --head)")
    e.add_argument("--head", required=True)

    x = sub.add_parser("to-eagle3", help="speculators head without EAGLE-3.1 norms -> draftsmith EAGLE-3 folder")
    x.add_argument("--head", required=True)
    x.add_argument("--out", required=True)
    return ap


def main(argv: Optional[list[str]] = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = build_parser()
    try:
        if argv and argv[0] == "eval":
            args, overrides = ap.parse_known_args(argv)
            cmd_eval(args, overrides)
            return
        args = ap.parse_args(argv)
        if args.command == "train":
            args.speculators_args = [a for a in args.speculators_args if a != "--"]
            result = cmd_train(args)
            print(json.dumps({k: result[k] for k in ("samples_seen", "steps", "train_wall_s", "stop_reason",
                                                     "head", "head_eagle3")}, indent=2))
        elif args.command == "convert":
            result = cmd_convert(args)
            print(json.dumps({k: result[k] for k in ("num_train", "num_val", "dropped_rows", "tokens_train")}))
        elif args.command == "to-eagle3":
            print(to_eagle3(args.head, args.out))
    except PeerError as e:
        print(f"{Path(__file__).name}: error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
