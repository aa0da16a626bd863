"""Training checkpoints: everything exact resume needs, written atomically.

    out/checkpoints/step_00000100/
        train_state.json        method, step, data position, compat fields, resolved config
        head.safetensors        the head's full state dict (d2t / t2d included): readable without DeepSpeed
        scheduler.json          LR scheduler state
        rng_rank{r}.json        python + numpy RNG of rank r;  rng_rank{r}.safetensors: torch RNG
        optimizer.safetensors + optimizer.json   (deepspeed=none) the torch optimizer state
        deepspeed/              (deepspeed=zero*) DeepSpeed's own save_checkpoint files (model,
                                partitioned optimizer) in state/*.pt, plus DeepSpeed's copies of its
                                zero_to_fp32.py / zero_to_torch.py scripts (never read or run)

A checkpoint is written under `.tmp-step_...` and renamed once every rank has finished, so a
crash never leaves a half checkpoint that resume could pick up.

What resume trusts: nothing in a checkpoint is executed. Everything draftsmith writes itself is
safetensors or JSON. DeepSpeed insists on torch pickles, so before DeepSpeed opens any of them,
`verify_deepspeed_files` loads every file under deepspeed/ with `torch.load(weights_only=True)` and
an allow-list of exactly the DeepSpeed types its ZeRO state holds (`DEEPSPEED_SAFE_GLOBALS`), and
DeepSpeed's own load then runs under the same restriction (`restricted_deepspeed_load`). A file
that needs any other global, is no torch file at all, or a symlink anywhere in the checkpoint, is
refused with one sentence naming the file. The two DeepSpeed scripts are allowed by name and
never opened.
"""

from __future__ import annotations

import contextlib
import json
import random
import re
import warnings
import zipfile
from pathlib import Path
from typing import Optional

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from ..core import DraftsmithError
from ..core.artifacts import atomic_write_json, remove_written, replace_folder
from ..core.trust import check_weights_file

STATE = "train_state.json"


def checkpoint_dir(out: str | Path) -> Path:
    return Path(out) / "checkpoints"


def list_checkpoints(out: str | Path) -> list[Path]:
    """Complete checkpoints under out/, oldest first."""
    root = checkpoint_dir(out)
    if not root.is_dir():
        return []
    return sorted(p for p in root.glob("step_*") if (p / STATE).is_file())


NO_RESUME = ("false", "none", "no", "0", "")
LATEST = ("true", "yes", "1", "latest")


def resume_path_given(resume: Optional[str]) -> Optional[str]:
    """The folder `resume=` names, or None when it says no / latest (a folder is an input of the run)."""
    return None if resume is None or str(resume).lower() in NO_RESUME + LATEST else str(resume)


def resolve_resume(resume: Optional[str], out: str | Path) -> Optional[Path]:
    """The checkpoint folder `resume=` names (true = the latest under out/), or None."""
    if resume is None or str(resume).lower() in NO_RESUME:
        return None
    if str(resume).lower() in LATEST:
        found = list_checkpoints(out)
        if not found:
            raise DraftsmithError(f"resume=true but {checkpoint_dir(out)} holds no complete checkpoint.")
        return checked_weights(found[-1])
    path = Path(str(resume))
    if (path / STATE).is_file():
        return checked_weights(path)
    found = list_checkpoints(path)  # an out/ folder of an earlier run
    if found:
        return checked_weights(found[-1])
    raise DraftsmithError(f"resume={resume!r} is not a training checkpoint (no {STATE}) nor a run folder with one.")


def checked_weights(checkpoint: Path) -> Path:
    """The checkpoint, once each of its safetensors files is a plain, complete file (heads.folders' check)."""
    for f in sorted(checkpoint.glob("*.safetensors")):
        check_weights_file(f)
    return checkpoint


def read_state(path: Path) -> dict:
    try:
        return json.loads((path / STATE).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise DraftsmithError(f"{path / STATE} cannot be read ({e}).") from None


def saved_layout(state: dict) -> dict:
    """world_size and grad_accum of the run that wrote a checkpoint (older checkpoints kept them in compat),
    and its global_batch filled into state["compat"] when that predates the field."""
    saved = state.setdefault("compat", {})
    layout = dict(state.get("layout") or {k: saved.get(k) for k in ("world_size", "grad_accum")})
    if "global_batch" not in saved and None not in (layout.get("world_size"), layout.get("grad_accum")):
        saved["global_batch"] = saved.get("micro_batch_size", 0) * layout["grad_accum"] * layout["world_size"]
    return layout


def check_compatible(state: dict, compat: dict, path: Path, layout: Optional[dict] = None) -> None:
    """Refuse a checkpoint of another method or an incompatible config, naming the first field that differs
    and, for the process layout, what to keep equal. `layout`: this run's world_size and grad_accum."""
    if state.get("method") != compat.get("method"):
        raise DraftsmithError(f"{path} is a {state.get('method')!r} checkpoint; this run trains method={compat.get('method')!r}.")
    was, now = saved_layout(state), layout or {}
    saved = state["compat"]
    saved.setdefault("optimizer", "adamw")  # a checkpoint from before optimizer= existed was trained with AdamW
    for key, want in compat.items():
        if saved.get(key) == want:
            continue
        if key == "world_size":
            raise DraftsmithError(
                f"{path} was written by {saved.get(key)} processes with deepspeed={saved.get('deepspeed')}, whose "
                f"optimizer state is split per process; this run has {want}. Resume it with nodes x processes per "
                f"node = {saved.get(key)} and grad_accum={was.get('grad_accum')}; only deepspeed=none checkpoints "
                f"move to another process count.")
        if key == "global_batch":
            per_step = compat["micro_batch_size"] * (now.get("world_size") or 1)
            fix = (f"set grad_accum={saved[key] // per_step}" if saved.get(key) and saved[key] % per_step == 0 else
                   f"use a process count that divides {saved.get(key)} / micro_batch_size")
            raise DraftsmithError(
                f"{path} was trained with a global batch of {saved.get(key)} (micro_batch_size x grad_accum x "
                f"processes = {saved.get('micro_batch_size')} x {was.get('grad_accum')} x {was.get('world_size')}); "
                f"this run's is {want} ({compat['micro_batch_size']} x {now.get('grad_accum')} x "
                f"{now.get('world_size')}). Keep it equal to resume exactly: with {now.get('world_size')} "
                f"processes, {fix}.")
        raise DraftsmithError(f"{path} was written with {key}={saved.get(key)!r}; this run has {key}={want!r}, "
                              "so it cannot resume exactly from it.")


# ---- RNG -----------------------------------------------------------------------------------------

def rng_state() -> tuple[dict, dict]:
    """(JSON part: python + numpy, tensor part: torch)."""
    py = random.getstate()
    np_state = np.random.get_state(legacy=True)  # (the default, named: numpy's stub types the call without it a dict)
    assert isinstance(np_state, tuple)  # the legacy form, the global RandomState being an MT19937
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
    """This rank's RNG state. A rank the checkpoint's run did not have (resumed on more processes) keeps the RNG
    seeded at start. Nothing of the EAGLE-3 step draws from it by default (no dropout; the data order has its own
    seeded RNG); what does (P-EAGLE's depth and DFlash's anchor sampling, EAGLE-3's method.feature_noise) resumes
    exactly on the same process count, not on another, where the micro-batches meet other ranks' RNG."""
    if not (folder / f"rng_rank{rank}.json").is_file():
        world = saved_layout(read_state(folder)).get("world_size")
        if world is not None and rank >= world:
            return
    js = json.loads((folder / f"rng_rank{rank}.json").read_text())
    set_rng_state(js, load_file(str(folder / f"rng_rank{rank}.safetensors")))


# What a checkpoint holds (written by draftsmith and DeepSpeed): what pruning one older than its record removes.
CHECKPOINT_FILES = (STATE, "head.safetensors", "scheduler.json", "rng_rank*", "optimizer.*", "deepspeed")


def publish(out: str | Path, step: int, keep_last: int) -> Path:
    """Rename the finished temp folder into place and drop all but the last `keep_last` (rank 0 only).

    Each checkpoint records what it holds; replacing or pruning one removes only that (a user's file stays)."""
    src, dst = tmp_path(out, step), final_path(out, step)
    replace_folder(src, dst)
    for old in list_checkpoints(out)[:-max(keep_last, 1)]:
        try:
            remove_written(old, CHECKPOINT_FILES)
        except OSError:
            pass
    return dst


# ---- DeepSpeed's pickles: proven loadable with weights_only=True before anything unpickles them ---

DEEPSPEED_SCRIPTS = ("zero_to_fp32.py", "zero_to_torch.py")  # copied in by save_checkpoint; never read


def deepspeed_safe_globals() -> list:
    """The only non-torch types a ZeRO 1/2/3 checkpoint holds (found by saving real ones):
    the stage enum, the loss scaler object (static; dynamic with fp16) and ZeRO-2's fragment map."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [ZeroStageEnum, LossScaler, DynamicLossScaler, fragment_address]


def _restricted_load(path, map_location="cpu"):
    """torch.load with weights_only=True and the DeepSpeed allow-list."""
    mmap = zipfile.is_zipfile(path)  # no need to read the tensors in to check the pickle
    with torch.serialization.safe_globals(deepspeed_safe_globals()):
        return torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)


def _refusal(path: Path, error: Exception) -> str:
    msg = str(error)
    found = re.search(r"GLOBAL (\S+) was not an allowed global", msg) or re.search(r"Unsupported global: GLOBAL (\S+)", msg)
    if found:
        why = f"needs the global {found.group(1)}, which is not among the DeepSpeed types resume allows"
    else:
        detail = re.search(r"WeightsUnpickler error:\s*(\S[^\n]*)", msg)
        first = detail.group(1) if detail else next((ln.strip() for ln in msg.splitlines() if ln.strip()),
                                                     type(error).__name__)
        why = f"is not a torch checkpoint that loads with weights_only=True ({first.strip()[:200]})"
    return f"{path} {why}; resume never unpickles anything else, so this checkpoint is refused."


def verify_deepspeed_files(checkpoint: Path) -> None:
    """Refuse a checkpoint whose DeepSpeed files could run code when unpickled (see the module docstring)."""
    checkpoint = Path(checkpoint)
    for p in sorted(checkpoint.rglob("*")):
        if p.is_symlink():
            raise DraftsmithError(f"{p} is a symlink; a training checkpoint holds only plain files, so it is refused.")
    folder = checkpoint / "deepspeed"
    if not folder.is_dir():
        raise DraftsmithError(f"{checkpoint} has no deepspeed/ folder, but this run uses DeepSpeed (deepspeed=...).")
    for p in sorted(folder.rglob("*")):
        if p.is_dir() or (p.parent == folder and p.name in DEEPSPEED_SCRIPTS):
            continue
        if not p.is_file():
            raise DraftsmithError(f"{p} is not a plain file; resume refuses this checkpoint.")
        try:
            with warnings.catch_warnings():  # torch's notes on odd pickle protocols: the refusal says it all
                warnings.simplefilter("ignore")
                state = _restricted_load(p)
        except Exception as e:  # noqa: BLE001 - every failure is a refusal, named
            raise DraftsmithError(_refusal(p, e)) from None
        del state


@contextlib.contextmanager
def restricted_deepspeed_load(engine):
    """DeepSpeed's own checkpoint loads go through weights_only=True with the same allow-list."""
    ce = getattr(engine, "checkpoint_engine", None)
    if ce is None:
        yield
        return

    def load(path, map_location=None):
        try:
            return _restricted_load(path, map_location=map_location)
        except Exception as e:  # noqa: BLE001
            raise DraftsmithError(_refusal(Path(path), e)) from None

    ce.load = load  # an instance attribute shadows the class method for this load only
    try:
        yield
    finally:
        del ce.load
