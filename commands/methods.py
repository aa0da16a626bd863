"""The package's method rows (eagle3, peagle, dflash, dspark, draft), registered in the method table
(draftsmith.core.methods).

The package root (commands/__init__.py) imports this module, so the rows are in the table before any stage asks:
Python imports the parent package `draftsmith` before `draftsmith.core.methods` or any stage. Each row names its
modules with loaders (heads/<m>_folders.py, eval/proposers/<m>.py, train/<m>.py); see core/methods.py for the hooks
each holds."""

from __future__ import annotations

from draftsmith.core.engine import Engines
from draftsmith.core.methods import Method, register

# The loaders' function-level imports are the method table's deliberate lazy edges: a module is imported when a stage
# first asks for one of its hooks, so `draftsmith eval` never imports training code, `draftsmith train` never imports
# eval's proposers, and the CLI imports no torch just to list method names. An import graph and a type checker follow
# them as written.


def _eagle3_folders():
    from draftsmith.heads import eagle3_folders
    return eagle3_folders


def _eagle3_proposers():
    from draftsmith.eval.proposers import eagle3
    return eagle3


def _eagle3_training():
    from draftsmith.train import eagle3
    return eagle3


def _peagle_folders():
    from draftsmith.heads import peagle_folders
    return peagle_folders


def _peagle_proposers():
    from draftsmith.eval.proposers import peagle
    return peagle


def _peagle_training():
    from draftsmith.train import peagle
    return peagle


def _dflash_folders():
    from draftsmith.heads import dflash_folders
    return dflash_folders


def _dflash_proposers():
    from draftsmith.eval.proposers import dflash
    return dflash


def _dflash_training():
    from draftsmith.train import dflash
    return dflash


def _dspark_folders():
    from draftsmith.heads import dspark_folders
    return dspark_folders


def _dspark_proposers():
    from draftsmith.eval.proposers import dspark
    return dspark


def _dspark_training():
    from draftsmith.train import dspark
    return dspark


def _mtp_folders():
    from draftsmith.heads import mtp_folders
    return mtp_folders


def _mtp_proposers():
    from draftsmith.eval.proposers import mtp
    return mtp


def _mtp_training():
    from draftsmith.train import mtp
    return mtp


def _draft_folders():
    from draftsmith.heads import draft_folders
    return draft_folders


def _draft_proposers():
    from draftsmith.eval.proposers import draft
    return draft


def _draft_training():
    from draftsmith.train import draft
    return draft


ROWS = (
    Method("eagle3", folders=_eagle3_folders, proposers=_eagle3_proposers, training_module=_eagle3_training,
           engines=Engines(vllm="eagle3", sglang="EAGLE3", llamacpp="draft-eagle3")),
    # P-EAGLE's folders share EAGLE-3's architecture (`LlamaForCausalLMEagle3`, as vLLM wants): it claims those
    # with "parallel_drafting": true. vLLM serves it as eagle3 with parallel drafting; SGLang has no P-EAGLE.
    Method("peagle", folders=_peagle_folders, proposers=_peagle_proposers, training_module=_peagle_training,
           engines=Engines(vllm="eagle3", vllm_options=(("parallel_drafting", True),))),
    # DFlash: vLLM's method dflash (the folder's DFlashDraftModel); llama.cpp's draft-dflash (export format=gguf,
    # through its DSpark converter: heads/dflash_folders.py); SGLang's DFLASH flags are not confirmed here
    Method("dflash", folders=_dflash_folders, proposers=_dflash_proposers, training_module=_dflash_training,
           engines=Engines(vllm="dflash", llamacpp="draft-dflash")),
    # DSpark: DFlash plus a Markov head and a confidence head (DeepSpec). llama.cpp serves it (draft-dspark, export
    # format=gguf); vLLM 0.32's method dspark runs only on its V2 runner (GPU, Triton): vLLM for CPU refuses it
    # ("Model Runner V1 does not support dspark speculative decoding"), so draftsmith checks it in llama.cpp
    Method("dspark", folders=_dspark_folders, proposers=_dspark_proposers, training_module=_dspark_training,
           engines=Engines(vllm="dspark", llamacpp="draft-dspark")),
    # MTP: the target's own multi-token-prediction layer (a MiMo folder's, or one grafted on), fine-tuned and stitched
    # back into a copy of the target (export format=mimo); vLLM serves that folder as the model with method mtp
    Method("mtp", folders=_mtp_folders, proposers=_mtp_proposers, training_module=_mtp_training,
           engines=Engines(vllm="mtp", in_target=True)),
    # the catch-all (ARCHITECTURES = ()): any HF causal-LM folder is evaluated as a draft model
    Method("draft", folders=_draft_folders, proposers=_draft_proposers, training_module=_draft_training,
           engines=Engines(vllm="draft_model", sglang="STANDALONE", llamacpp="draft-simple")),
)

for _row in ROWS:
    register(_row)
