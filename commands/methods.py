"""The package's method rows (eagle3, peagle, dflash, dspark, mtp, draft), registered in the method table
(draftsmith.core.methods).

The package root (commands/__init__.py) imports this module, so the rows are in the table before any stage asks:
Python imports the parent package `draftsmith` before `draftsmith.core.methods` or any stage. Each row names its
hooks with loaders (the HOOKS of heads/<m>_folders.py and train/<m>.py, eval/proposers/<m>.py's proposer); see
core/methods.py for the hooks' typed specs."""

from __future__ import annotations

from draftsmith.core.engine import Engines
from draftsmith.core.methods import FolderHooks, Method, ProposerBuilder, TrainingHooks, register

# The loaders' function-level imports are the method table's deliberate lazy edges: a module is imported when a stage
# first asks for one of its hooks, so `draftsmith eval` never imports training code, `draftsmith train` never imports
# eval's proposers, and the CLI imports no torch just to list method names. An import graph and a type checker follow
# them as written.


def _eagle3_folders() -> FolderHooks:
    from draftsmith.heads import eagle3_folders
    return eagle3_folders.HOOKS


def _eagle3_proposers() -> ProposerBuilder:
    from draftsmith.eval.proposers import eagle3
    return eagle3.proposer


def _eagle3_training() -> TrainingHooks:
    from draftsmith.train import eagle3
    return eagle3.HOOKS


def _peagle_folders() -> FolderHooks:
    from draftsmith.heads import peagle_folders
    return peagle_folders.HOOKS


def _peagle_proposers() -> ProposerBuilder:
    from draftsmith.eval.proposers import peagle
    return peagle.proposer


def _peagle_training() -> TrainingHooks:
    from draftsmith.train import peagle
    return peagle.HOOKS


def _dflash_folders() -> FolderHooks:
    from draftsmith.heads import dflash_folders
    return dflash_folders.HOOKS


def _dflash_proposers() -> ProposerBuilder:
    from draftsmith.eval.proposers import dflash
    return dflash.proposer


def _dflash_training() -> TrainingHooks:
    from draftsmith.train import dflash
    return dflash.HOOKS


def _dspark_folders() -> FolderHooks:
    from draftsmith.heads import dspark_folders
    return dspark_folders.HOOKS


def _dspark_proposers() -> ProposerBuilder:
    from draftsmith.eval.proposers import dspark
    return dspark.proposer


def _dspark_training() -> TrainingHooks:
    from draftsmith.train import dspark
    return dspark.HOOKS


def _mtp_folders() -> FolderHooks:
    from draftsmith.heads import mtp_folders
    return mtp_folders.HOOKS


def _mtp_proposers() -> ProposerBuilder:
    from draftsmith.eval.proposers import mtp
    return mtp.proposer


def _mtp_training() -> TrainingHooks:
    from draftsmith.train import mtp
    return mtp.HOOKS


def _draft_folders() -> FolderHooks:
    from draftsmith.heads import draft_folders
    return draft_folders.HOOKS


def _draft_proposers() -> ProposerBuilder:
    from draftsmith.eval.proposers import draft
    return draft.proposer


def _draft_training() -> TrainingHooks:
    from draftsmith.train import draft
    return draft.HOOKS


ROWS = (
    Method("eagle3", folders=_eagle3_folders, proposers=_eagle3_proposers, train=_eagle3_training,
           engines=Engines(vllm="eagle3", sglang="EAGLE3", llamacpp="draft-eagle3")),
    # P-EAGLE's folders share EAGLE-3's architecture (`LlamaForCausalLMEagle3`, as vLLM wants): it claims those
    # with "parallel_drafting": true. vLLM serves it as eagle3 with parallel drafting; SGLang has no P-EAGLE.
    Method("peagle", folders=_peagle_folders, proposers=_peagle_proposers, train=_peagle_training,
           engines=Engines(vllm="eagle3", vllm_options=(("parallel_drafting", True),))),
    # DFlash: vLLM's method dflash (the folder's DFlashDraftModel); llama.cpp's draft-dflash (export format=gguf,
    # through its DSpark converter: heads/dflash_folders.py); SGLang's DFLASH flags are not confirmed here
    Method("dflash", folders=_dflash_folders, proposers=_dflash_proposers, train=_dflash_training,
           engines=Engines(vllm="dflash", llamacpp="draft-dflash")),
    # DSpark: DFlash plus a Markov head and a confidence head (DeepSpec). llama.cpp serves it (draft-dspark, export
    # format=gguf); vLLM 0.32's method dspark (export format=dspark, which vLLM reads as Qwen3DSparkModel) runs only
    # on its V2 runner (GPU, Triton): vLLM for CPU refuses it ("Model Runner V1 does not support: dspark speculative
    # decoding"), so draftsmith decodes it in llama.cpp and checks vLLM's reading of the folder
    # (tests/test_dspark_vllm_folder.py)
    Method("dspark", folders=_dspark_folders, proposers=_dspark_proposers, train=_dspark_training,
           engines=Engines(vllm="dspark", llamacpp="draft-dspark")),
    # MTP: the target's own multi-token-prediction layer (a MiMo folder's, or one grafted on), fine-tuned and stitched
    # back into a copy of the target (export format=mimo); vLLM serves that folder as the model with method mtp,
    # SGLang as model and draft alike with NEXTN (its EAGLE worker; MiMo is not among the architectures whose draft
    # path SGLang fills in itself: server_args.py), not engine-checked
    Method("mtp", folders=_mtp_folders, proposers=_mtp_proposers, train=_mtp_training,
           engines=Engines(vllm="mtp", sglang="NEXTN", in_target=True)),
    # the catch-all (ARCHITECTURES = ()): any HF causal-LM folder is evaluated as a draft model
    Method("draft", folders=_draft_folders, proposers=_draft_proposers, train=_draft_training,
           engines=Engines(vllm="draft_model", sglang="STANDALONE", llamacpp="draft-simple")),
)

for _row in ROWS:
    register(_row)
