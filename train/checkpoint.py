"""Training checkpoints: everything exact resume needs, written atomically.

    out/checkpoints/step_00000100/
        train_state.json        method, step, data position, compat fields, resolved config
        head.safetensors        the head's full state dict (d2t / t2d included): readable without DeepSpeed
        scheduler.json          LR scheduler state
        rng_rank{r}.json        python + numpy RNG of rank r;  rng_rank{r}.safetensors: torch RNG
        optimizer.safetensors + optimizer.json   (deepspeed=none) the torch optimizer state
        deepspeed/              (deepspeed=zero*) DeepSpeed's own save_checkpoint files (model,
                                partitioned optimizer). They are torch pickles: draftsmith only
                                loads them from a checkpoint whose train_state.json it wrote and
                                whose compat fields match this run.

A checkpoint is written under `.tmp-step_...` and renamed once every rank has finished, so a
crash never leaves a half checkpoint that resume could pick up.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path
from typing import Optional

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from draftsmith import DraftsmithError
from draftsmith.data_gen.manifest import atomic_write_json

STATE = "train_state.json"


def checkpoint_dir(out: str | Path) -> Path:
    return Path(out) / "checkpoints"


def list_checkpoints(out: str | Path) -> list[Path]:
    """Complete checkpoints under out/, oldest first."""
    root = checkpoint_dir(out)
    if not root.is_dir():
        return []
    return sorted(p for p in root.glob("step_*") if (p / STATE).is_file())


def resolve_resume(resume: Optional[str], out: str | Path) -> Optional[Path]:
    """The checkpoint folder `resume=` names (true = the latest under out/), or None."""
    if resume is None or str(resume).lower() in ("false", "none", "no", "0", ""):
        return None
    if str(resume).lower() in ("true", "yes", "1", "latest"):
        found = list_checkpoints(out)
        if not found:
            raise DraftsmithError(f"resume=true but {checkpoint_dir(out)} holds no complete checkpoint.")
        return found[-1]
    path = Path(str(resume))
    if (path / STATE).is_file():
        return path
    found = list_checkpoints(path)  # an out/ folder of an earlier run
    if found:
        return found[-1]
    raise DraftsmithError(f"resume={resume!r} is not a training checkpoint (no {STATE}) nor a run folder with one.")


def read_state(path: Path) -> dict:
    try:
        return json.loads((path / STATE).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise DraftsmithError(f"{path / STATE} cannot be read ({e}).") from None


def check_compatible(state: dict, compat: dict, path: Path) -> None:
    """Refuse a checkpoint of another method or an incompatible config, naming the first field that differs."""
    if state.get("method") != compat.get("method"):
        raise DraftsmithError(f"{path} is a {state.get('method')!r} checkpoint; this run trains method={compat.get('method')!r}.")
    saved = state.get("compat", {})
    for key, want in compat.items():
        if saved.get(key) != want:
            raise DraftsmithError(f"{path} was written with {key}={saved.get(key)!r}; this run has {key}={want!r}, "
                                  "so it cannot resume exactly from it.")


# ---- RNG -----------------------------------------------------------------------------------------

def rng_state() -> tuple[dict, dict]:
    """(JSON part: python + numpy, tensor part: torch)."""
    py = random.getstate()
    np_state = np.random.get_state()
    js = {"python": [py[0], list(py[1]), py[2]],
          "numpy": [np_state[0], np_state[1].tolist(), int(np_state[2]), int(np_state[3]), float(np_state[4])]}
    return js, {"torch": torch.get_rng_state()}


def set_rng_state(js: dict, tensors: dict) -> None:
    v, st, g = js["python"]
    random.setstate((v, tuple(st), g))
    name, keys, pos, has_gauss, cached = js["numpy"]
    np.random.set_state((name, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(tensors["torch"])


# ---- plain torch optimizer state as safetensors + JSON ------------------------------------------

def save_optimizer(optimizer: torch.optim.Optimizer, folder: Path) -> None:
    sd = optimizer.state_dict()
    tensors, scalars = {}, {}
    for pid, st in sd["state"].items():
        for k, v in st.items():
            if torch.is_tensor(v):
                tensors[f"{pid}.{k}"] = v.contiguous()
            else:
                scalars[f"{pid}.{k}"] = v
    save_file(tensors, str(folder / "optimizer.safetensors"))
    atomic_write_json(folder / "optimizer.json", {"param_groups": sd["param_groups"], "scalars": scalars})


def load_optimizer(optimizer: torch.optim.Optimizer, folder: Path) -> None:
    meta = json.loads((folder / "optimizer.json").read_text())
    state: dict = {}
    for key, v in list(load_file(str(folder / "optimizer.safetensors")).items()) + list(meta["scalars"].items()):
        pid, k = key.split(".", 1)
        state.setdefault(int(pid), {})[k] = v
    optimizer.load_state_dict({"state": state, "param_groups": meta["param_groups"]})


# ---- write / prune --------------------------------------------------------------------------------

def tmp_path(out: str | Path, step: int) -> Path:
    return checkpoint_dir(out) / f".tmp-step_{step:08d}"


def final_path(out: str | Path, step: int) -> Path:
    return checkpoint_dir(out) / f"step_{step:08d}"


def write_common(folder: Path, head_state: dict, state: dict, scheduler_state: dict) -> None:
    """Rank 0's share: head weights, scheduler, loop state (train_state.json last)."""
    save_file({k: v.detach().contiguous().cpu() for k, v in head_state.items()}, str(folder / "head.safetensors"))
    atomic_write_json(folder / "scheduler.json", scheduler_state)
    atomic_write_json(folder / STATE, state)


def write_rng(folder: Path, rank: int) -> None:
    js, tensors = rng_state()
    atomic_write_json(folder / f"rng_rank{rank}.json", js)
    save_file(tensors, str(folder / f"rng_rank{rank}.safetensors"))


def read_rng(folder: Path, rank: int) -> None:
    js = json.loads((folder / f"rng_rank{rank}.json").read_text())
    set_rng_state(js, load_file(str(folder / f"rng_rank{rank}.safetensors")))


def publish(out: str | Path, step: int, keep_last: int) -> Path:
    """Rename the finished temp folder into place and drop all but the last `keep_last` (rank 0 only)."""
    src, dst = tmp_path(out, step), final_path(out, step)
    if dst.exists():
        shutil.rmtree(dst)
    src.rename(dst)
    for old in list_checkpoints(out)[:-max(keep_last, 1)]:
        shutil.rmtree(old, ignore_errors=True)
    return dst
