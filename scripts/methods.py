"""The method table: one entry per drafting method. Stages look a method up here; none branches on a name.

    train   METHODS[name]: config (configs/method/<name>.yaml) -> new_drafter -> training -> save
    eval    method_for_folder(config.json): load -> proposer (the decoder's interface, eval/proposers.py)
    export  method_for_folder(config.json): load -> formats[format]

A method's own code lives in its files (EAGLE-3: heads/eagle3.py the drafter, heads/checkpoint.py
and heads/export.py its folders, train/eagle3.py its training step, eval/proposers.py its
proposer); its entry only names them. Adding a method is one entry plus its own files:

    Method(name, config=<dataclass>, architectures=(<config.json architecture>,),
           new_drafter=f(target, method_cfg, train_data, resume_checkpoint) -> nn.Module,
           training=f(drafter, target, method_cfg, mode, autocast) -> (module with .drafter, prepare),
           summarize=f(stats) -> dict, save=f(drafter, folder, target_identity) -> Path,
           load=f(folder, target) -> drafter, proposer=f(drafter, target_vocab_size, max_len) -> Proposer,
           formats={format: f(drafter, folder, manifest_target, options) -> Path},
           card=f(base_model, repo_id, eval_report, k, formats, train_config) -> the model card's parts,
           offline_data=<the data-gen output mode=offline reads: hidden_states | topk_logits>,
           claims=f(config.json dict) -> bool: which folders of an architecture another method shares are its)

P-EAGLE's folders share EAGLE-3's architecture (`LlamaForCausalLMEagle3`, as vLLM wants); its entry claims
those with "parallel_drafting": true (heads/peagle.py, heads/peagle_folders.py, train/peagle.py,
eval/peagle_proposer.py).

A method without `config` can be evaluated (its folders loaded and drafted with) but not trained.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

from draftsmith import DraftsmithError


@dataclass(frozen=True)
class Method:
    name: str
    load: Callable  # (folder, target | None) -> drafter module, checked against the target when given
    proposer: Callable  # (drafter, target_vocab_size, max_len) -> eval Proposer
    architectures: tuple[str, ...] = ()  # config.json `architectures` of its folders; () = any other
    config: Optional[type] = None  # the training options dataclass; None = not trainable
    new_drafter: Optional[Callable] = None
    training: Optional[Callable] = None
    summarize: Optional[Callable] = None
    save: Optional[Callable] = None
    formats: dict[str, Callable] = field(default_factory=dict)  # export format -> writer
    foreign_architectures: dict[str, str] = field(default_factory=dict)  # loadable elsewhere only: why not here
    card: Optional[Callable] = None  # publish: (base_model, repo_id, report, k, formats, train config) -> card parts
    offline_data: str = "hidden_states"  # what mode=offline reads from a data-gen folder (its manifest key)
    claims: Optional[Callable] = None  # (config.json dict) -> bool: which folders of a shared architecture are its


# ---- EAGLE-3 ------------------------------------------------------------------------------------

def check_target_hidden_size(folder: Path, target) -> None:
    """A head whose fc reads the target's features must have been made for this target's width."""
    config = read_folder_config(folder)
    hidden = config.get("target_hidden_size") or config.get("hidden_size")
    if hidden != target.hidden_size:
        raise DraftsmithError(f"head {folder} reads target hidden size {hidden}, but target {target.target_id!r} "
                              f"has {target.hidden_size}: it was made for another target.")


def _load_eagle3(folder: Path, target=None):
    from draftsmith.heads.checkpoint import load_eagle3

    if target is None:
        return load_eagle3(folder)
    check_target_hidden_size(folder, target)
    return load_eagle3(folder, device=target.device, dtype=target.dtype,
                       target_embeddings=target.model.get_input_embeddings())


def _save_eagle3(head, folder: Path, identity: dict) -> Path:
    from draftsmith.heads.checkpoint import save_eagle3

    return save_eagle3(head, folder, manifest_target=identity)


def _export_eagle3(head, folder: Path, manifest_target: Optional[dict], options) -> Path:
    from draftsmith.heads.checkpoint import save_eagle3

    return save_eagle3(head, folder, manifest_target=manifest_target, dtype=options.dtype,
                       include_embeddings=options.include_embeddings, stage="export")


def _export_speculators(head, folder: Path, manifest_target: Optional[dict], options) -> Path:
    from draftsmith.heads.speculators import save_speculators

    verifier = options.verifier or (manifest_target or {}).get("target_id")
    return save_speculators(head, folder, verifier=verifier, speculative_tokens=options.speculative_tokens,
                            manifest_target=manifest_target, dtype=options.dtype,
                            include_embeddings=options.include_embeddings)


def _eagle3_proposer(head, target_vocab_size: int, max_len: int):
    from draftsmith.eval.proposers import Eagle3Proposer

    return Eagle3Proposer(head, target_vocab_size, max_len)


def _eagle3_entry() -> Method:
    from draftsmith.heads.publish import eagle3_card
    from draftsmith.train import eagle3

    return Method(
        name="eagle3", config=eagle3.Eagle3Config, architectures=("LlamaForCausalLMEagle3",),
        new_drafter=eagle3.new_eagle3, training=eagle3.eagle3_training, summarize=eagle3.summarize,
        save=_save_eagle3, load=_load_eagle3, proposer=_eagle3_proposer,
        formats={"eagle3": _export_eagle3, "speculators": _export_speculators}, card=eagle3_card,
        foreign_architectures={"Eagle3DraftModel": "the speculators format (vLLM loads it); give the "
                                                   "EAGLE-3 folder it was exported from"})


# ---- P-EAGLE: EAGLE-3's architecture drafting K tokens in one forward (parallel_drafting folders) -------

def _load_peagle(folder: Path, target=None):
    from draftsmith.heads.peagle_folders import load_peagle

    if target is None:
        return load_peagle(folder)
    check_target_hidden_size(folder, target)
    return load_peagle(folder, device=target.device, dtype=target.dtype,
                       target_embeddings=target.model.get_input_embeddings())


def _save_peagle(head, folder: Path, identity: dict) -> Path:
    from draftsmith.heads.peagle_folders import save_peagle

    return save_peagle(head, folder, manifest_target=identity)


def _export_peagle(head, folder: Path, manifest_target: Optional[dict], options) -> Path:
    from draftsmith.heads.peagle_folders import save_peagle

    return save_peagle(head, folder, manifest_target=manifest_target, dtype=options.dtype,
                       include_embeddings=options.include_embeddings, stage="export")


def _export_speculators_peagle(head, folder: Path, manifest_target: Optional[dict], options) -> Path:
    from draftsmith.heads.peagle_folders import save_speculators_peagle

    verifier = options.verifier or (manifest_target or {}).get("target_id")
    return save_speculators_peagle(head, folder, verifier=verifier, speculative_tokens=options.speculative_tokens,
                                   manifest_target=manifest_target, dtype=options.dtype,
                                   include_embeddings=options.include_embeddings)


def _peagle_proposer(head, target_vocab_size: int, max_len: int):
    from draftsmith.eval.peagle_proposer import PEagleProposer

    return PEagleProposer(head, target_vocab_size, max_len)


def _peagle_entry() -> Method:
    from draftsmith.heads.peagle_folders import is_peagle_folder, peagle_card
    from draftsmith.train import peagle

    return Method(
        name="peagle", config=peagle.PEagleConfig, architectures=("LlamaForCausalLMEagle3",), claims=is_peagle_folder,
        new_drafter=peagle.new_peagle, training=peagle.peagle_training, summarize=peagle.summarize,
        save=_save_peagle, load=_load_peagle, proposer=_peagle_proposer,
        formats={"peagle": _export_peagle, "speculators": _export_speculators_peagle}, card=peagle_card,
        foreign_architectures={"PEagleDraftModel": "the speculators format (vLLM loads it); give the P-EAGLE "
                                                   "folder it was exported from"})


# ---- a draft model: any HF causal LM sharing the target's tokenizer (trained by train/draft.py) -----

def _load_draft_model(folder: Path, target=None):
    from draftsmith.heads.draft import load_draft_folder

    if target is None:
        return load_draft_folder(folder).eval()
    return load_draft_folder(folder, dtype=target.dtype).to(target.device).eval()


def _save_draft(drafter, folder: Path, identity: dict) -> Path:
    from draftsmith.heads.draft import save_draft

    return save_draft(drafter, folder, manifest_target=identity)


def _export_draft(model, folder: Path, manifest_target: Optional[dict], options) -> Path:
    from draftsmith.heads.draft import save_draft

    return save_draft(model, folder, manifest_target, stage="export", dtype=options.dtype)


def _draft_model_proposer(model, target_vocab_size: int, max_len: int):
    from draftsmith.eval.proposers import DraftModelProposer

    return DraftModelProposer(model, target_vocab_size, max_len)


def _draft_entry() -> Method:
    """The catch-all (architectures=()): any HF causal-LM folder is evaluated as a draft model."""
    from draftsmith.heads.draft import draft_card
    from draftsmith.train import draft

    return Method(name="draft", config=draft.DraftConfig, new_drafter=draft.new_draft,
                  training=draft.draft_training, summarize=draft.summarize, save=_save_draft,
                  load=_load_draft_model, proposer=_draft_model_proposer, formats={"hf": _export_draft},
                  card=draft_card, offline_data="topk_logits")


# ---- the table ----------------------------------------------------------------------------------

_ENTRIES = (_eagle3_entry, _peagle_entry, _draft_entry)
METHODS: dict[str, Method] = {}


def methods() -> dict[str, Method]:
    """name -> Method, built on first use (entries import their modules lazily)."""
    if not METHODS:
        for make in _ENTRIES:
            entry = make()
            METHODS[entry.name] = entry
    return METHODS


def register(entry: Method) -> None:
    """Add (or replace) an entry: a method defined outside draftsmith, or a test's."""
    methods()[entry.name] = entry


def trainable() -> list[str]:
    return [name for name, m in methods().items() if m.config is not None]


def method_for_config(method_cfg: Any) -> Method:
    """The entry whose config dataclass types `method_cfg` (a composed `method` node or a dataclass)."""
    from omegaconf import OmegaConf

    cls = OmegaConf.get_type(method_cfg) if OmegaConf.is_config(method_cfg) else type(method_cfg)
    for entry in methods().values():
        if entry.config is not None and entry.config is cls:
            return entry
    name = getattr(method_cfg, "name", None)
    raise DraftsmithError(f"method={name!r} is not one of the trainable methods {', '.join(trainable())}.")


def read_folder_config(folder: Path) -> dict:
    path = folder / "config.json"
    try:
        config = json.loads(path.read_text())
    except OSError as e:
        raise DraftsmithError(f"{path} cannot be read ({e.strerror}).") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DraftsmithError(f"{path} is not valid JSON ({e}).") from None
    if not isinstance(config, dict):
        raise DraftsmithError(f"{path} is not a model config: it holds no JSON object.")
    return config


def method_for_folder(folder: Path, config: Optional[dict] = None) -> Method:
    """The entry whose folders declare this `architectures` (the catch-all entry otherwise)."""
    config = read_folder_config(folder) if config is None else config
    arch = (config.get("architectures") or [None])[0]
    catch_all = None
    entries = sorted(methods().values(), key=lambda e: e.claims is None)  # a claim beats the bare architecture
    for entry in entries:
        if arch in entry.foreign_architectures:
            raise DraftsmithError(f"{folder} is in {entry.foreign_architectures[arch]}.")
        if arch in entry.architectures and (entry.claims is None or entry.claims(config)):
            return entry
        if not entry.architectures:
            catch_all = entry
    if catch_all is None:
        raise DraftsmithError(f"{folder} declares architectures {config.get('architectures')!r}, which no "
                              f"draftsmith method reads.")
    return catch_all


def export_formats() -> list[str]:
    return list(dict.fromkeys(fmt for entry in methods().values() for fmt in entry.formats))  # each name once
