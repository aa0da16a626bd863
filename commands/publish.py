"""`draftsmith publish`: a trained head -> one Hub-ready folder (engine formats + a measured model card) -> the Hub.

    draftsmith publish head=runs/eagle3 report=runs/eval repo_id=me/Llama-3.1-8B-eagle3 dry_run=true
    draftsmith publish head=runs/eagle3 report=runs/eval repo_id=me/Llama-3.1-8B-eagle3 private=true

The folder: the first of `formats` at its root (eagle3 first: vLLM and SGLang load the root), any
other in a subfolder named after it, `README.md` (the card: Hub metadata with model-index results
from the eval report, the method, the training data, the eval figures and their conventions, the
plot, serving commands) and `eval/` (the eval report and plot). The card's numbers come only from
an eval report of this very head (matched by the SHA-256 of its weights, which eval records);
without one, publish refuses unless `allow_no_eval=true`. The upload is one commit through
huggingface_hub; the token comes from HF_TOKEN or `hf auth login` and is never printed or written.

What goes public is only what the folder means: no local path (the head's is replaced by the repo id, a local
target's by base_model, the prompts file's by its name, any other under the home, working or input folders by
its last part), and no file reached through a symbolic link (refused). Every Hub request has a timeout
(`hub_timeout`); an offline, unreachable, slow or refusing Hub is one sentence saying what failed, what exists
on the Hub now, and how to retry.

Here: the options, the checks made before any work, and the run. Its stories have their own modules: the card
(draftsmith.publish_card), the folder (draftsmith.publish_folder), the local paths it rewrites
(draftsmith.public_paths) and the Hub client (draftsmith.hub).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from draftsmith.core import DraftsmithError, checks, llamacpp
from draftsmith.core.artifacts import MANIFEST, prepare_output, read_manifest
from draftsmith.core.engine import NUM_SPECULATIVE_TOKENS
from draftsmith.core.methods import export_formats, method_for_folder, read_folder_config
from draftsmith.core.trust import check_weights_file
from draftsmith.data_gen.target import DTYPES, KNOWN_TARGETS
from .export import is_set
from draftsmith.heads.folders import WEIGHTS, weights_sha256
from .hub import has_token, hub_offline, offline_refusal, upload
from .public_paths import public_paths
from .publish_folder import EVAL_FILES, refuse_links, upload_files, write_publish_folder

REPO_ID_RULE = "<owner>/<name>, letters, digits, '-', '_' and '.', at most 96 characters"


@dataclass
class PublishConfig:
    head: str = "???"  # the head or draft model: a `draftsmith train` out/ folder or its final/ folder
    repo_id: str = "???"  # the Hub model repo to create or update, as <owner>/<name>
    # formats written, the first at the repo root; None = every format of the head's method
    # (EAGLE-3: eagle3 for vLLM and SGLang, then speculators for vLLM)
    formats: Optional[list[str]] = None
    report: Optional[str] = None  # eval out/ folder (or its report.json) of this same head: the card's numbers
    allow_no_eval: bool = False  # true: publish without an eval report (the card says nothing was measured)
    base_model: Optional[str] = None  # the target's Hub id (card + serving commands); null = the head's target id
    license: Optional[str] = None  # the card's Hub license id (usually the target's); null = the target's if known
    library_name: str = "vllm"  # the card's library_name: the engine that loads the head
    private: bool = False  # create the repo private (an existing repo keeps its visibility)
    dry_run: bool = False  # true: write the folder only, upload nothing
    out: Optional[str] = None  # the folder that is uploaded; default: beside the head, `<head>-hub`
    # K in the serving commands and the speculators config; null = the eval report's, else 3
    num_speculative_tokens: Optional[int] = None
    dtype: str = "bfloat16"  # dtype of the published weights: bfloat16 | float16 | float32
    # formats with gguf: the GGUF file's weight type, export's gguf_outtype (llama.cpp's --outtype): f32 | f16 | bf16 |
    # q8_0
    gguf_outtype: str = llamacpp.OUTTYPE
    include_embeddings: bool = True  # false: engines share the target's embeddings
    overwrite: bool = False  # true: replace an out folder that is not an earlier publish folder (never the head's)
    # seconds one Hub request may wait to connect or for data before publish gives up (per request, not the upload)
    hub_timeout: float = 60.0

    def __post_init__(self):
        if self.repo_id != "???":
            check_repo_id(self.repo_id)
        if self.formats is not None:
            formats = list(self.formats)
            if not formats:
                raise DraftsmithError(f"formats=[] is empty; choose one or more of {', '.join(export_formats())}.")
            for fmt in formats:
                checks.one_of("formats", fmt, export_formats())
            if len(set(formats)) != len(formats):
                raise DraftsmithError(f"formats={formats} names a format twice.")
        if self.base_model is not None:
            check_base_model(self.base_model)
        if self.license is not None:
            check_license(self.license)
        checks.at_least("num_speculative_tokens", self.num_speculative_tokens, 1, null="the eval report's K")
        checks.one_of("dtype", self.dtype, DTYPES)
        checks.one_of("gguf_outtype", self.gguf_outtype, llamacpp.OUTTYPES)
        checks.positive("hub_timeout", self.hub_timeout)


# ---------------------------------------------------------------------------------------------
# Checks made before any work


def check_repo_id(repo_id) -> str:
    """A Hub model repo id `<owner>/<name>` (huggingface_hub's own rules), or one sentence."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    text = str(repo_id or "")
    try:
        validate_repo_id(text)
    except HFValidationError:
        text = ""
    if text.count("/") != 1 or not re.fullmatch(r"[\w.-]+/[\w.-]+", text):
        raise DraftsmithError(f"repo_id={repo_id!r} is not a valid Hub repo id; write it as {REPO_ID_RULE}.")
    return text


def check_base_model(value) -> str:
    """base_model= as the target's Hub id `<owner>/<name>`, or one sentence about that value (a local path, a GGUF
    file or anything else is not an id the card and the serving commands can name)."""
    text = str(value)
    if text.startswith((".", "/", "~")) or ".." in text or text.endswith(".gguf"):
        why = "a local path"
    elif text.count("/") != 1 or not re.fullmatch(r"[\w.-]+/[\w.-]+", text):
        why = "not <owner>/<name>"
    else:
        try:
            return check_repo_id(text)
        except DraftsmithError:
            why = f"not {REPO_ID_RULE}"
    raise DraftsmithError(f"base_model={text!r} is not a Hub model id ({why}); pass base_model=<owner>/<name>, the "
                          f"target's id on the Hub (e.g. HuggingFaceTB/SmolLM2-135M-Instruct).")


def check_license(value) -> str:
    """license= as a Hub license id (apache-2.0, mit, llama3.1, other, ...), or one sentence about that value."""
    text = str(value)
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9.+_-]{0,63}", text):
        raise DraftsmithError(f"license={text!r} is not a Hub license id; pass one such as license=apache-2.0, "
                              f"license=mit or license=other (letters, digits, '.', '-', '+' and '_').")
    return text



def head_folder(head: str | Path):
    """(the head folder `head=` names: the folder itself or its final/, its method from draftsmith.core.methods);
    its weights checked and no file in it a link, before any work."""
    path = Path(str(head))
    folder = next((f for f in (path, path / "final") if (f / "config.json").is_file()), None)
    if folder is None:
        raise DraftsmithError(f"head={str(head)!r} has no config.json (nor a final/ folder holding one); give a "
                              f"draftsmith train out/ folder or a head folder.")
    method = method_for_folder(folder)
    if method.card is None:
        raise DraftsmithError(f"head {folder} is a {method.name} folder, which publish does not describe yet; "
                              f"publish a folder draftsmith train wrote.")
    check_weights_file(folder / WEIGHTS)
    refuse_links(*sorted(folder.iterdir()))
    return folder, method



def read_report(path: str | Path) -> tuple[dict, Path]:
    """(report.json of an eval out/ folder or the file itself, the folder holding it)."""
    path = Path(str(path))
    file = path / "report.json" if path.is_dir() else path
    if not file.is_file():
        raise DraftsmithError(f"report={str(path)!r} is neither an eval out/ folder with report.json nor a report.json.")
    refuse_links(file, *(file.parent / name for name in EVAL_FILES))  # what publish copies from the eval folder
    try:
        report = json.loads(file.read_text())
    except (OSError, ValueError) as e:
        raise DraftsmithError(f"{file} cannot be read as JSON ({e}).") from None
    if not isinstance(report, dict) or "tau" not in report or "drafting" not in report:
        raise DraftsmithError(f"{file} is not a draftsmith eval report (no tau / drafting).")
    return report, file.parent


def matching_report(cfg, folder: Path) -> Optional[tuple[dict, Path]]:
    """The eval report of this head (matched by the SHA-256 of its weights), None when allowed, else refused."""
    if not cfg.report:
        if cfg.allow_no_eval:
            return None
        raise DraftsmithError("publish needs the eval report of this head for the card: pass report=<eval out/ "
                              "folder> (draftsmith eval head=... out=...), or allow_no_eval=true to publish unmeasured.")
    report, where = read_report(cfg.report)
    have = (report.get("drafter") or {}).get("sha256")
    want = weights_sha256(folder)
    if have != want:
        said = f"sha256 {have[:12]}..." if have else "no head hash (an eval from before draftsmith recorded one)"
        raise DraftsmithError(f"report={cfg.report} is not an eval of head {folder}: the report records {said}, the "
                              f"head's weights hash to {want[:12]}...; evaluate this head (draftsmith eval head="
                              f"{cfg.head}) and pass that report.")
    return report, where


def resolve_base_model(cfg, target: dict) -> tuple[str, str]:
    """(the target's Hub id, the card's license), refused with one sentence when neither is known."""
    target_id = str(target.get("target_id") or "")
    known_id, known_license = KNOWN_TARGETS.get(target_id, (None, None))
    if cfg.base_model:  # the value given is checked as itself (PublishConfig checked its form)
        if Path(cfg.base_model).exists():
            raise DraftsmithError(f"base_model={cfg.base_model!r} is a local path, not a Hub model id; pass "
                                  f"base_model=<owner>/<name>, the target's id on the Hub.")
        check_base_model(cfg.base_model)
    base = cfg.base_model or known_id or target_id
    if not base or Path(base).exists() or base.endswith(".gguf") or base.count("/") != 1:
        raise DraftsmithError(f"the head's target {target_id or '(unknown)'!r} is not a Hub model id; pass "
                              f"base_model=<owner>/<name> of the target on the Hub.")
    check_repo_id(base)
    license = cfg.license or known_license or local_license(target_id)
    if not license:
        raise DraftsmithError(f"the license of {base} is not known here; pass license=<Hub license id> (a head "
                              f"trained on a target's outputs usually takes the target's license).")
    return base, license


def local_license(target_id: str) -> Optional[str]:
    """The license in a local target folder's README.md metadata, if any."""
    readme = Path(target_id) / "README.md"
    if not target_id or not readme.is_file():
        return None
    from huggingface_hub import ModelCard

    return ModelCard.load(readme).data.to_dict().get("license")


# ---------------------------------------------------------------------------------------------
# The stage


def run(cfg: PublishConfig) -> dict:
    """Check everything, write the publish folder, and (unless dry_run) upload it; returns what was done."""
    for key, hint in (("head", "head=<draftsmith train out/ folder>"), ("repo_id", "repo_id=<owner>/<name>")):
        if not is_set(cfg, key):
            raise DraftsmithError(f"{key}= is required: pass {hint}.")
    repo_id = check_repo_id(cfg.repo_id)  # before any work
    folder, method = head_folder(cfg.head)
    missing = [fmt for fmt in (cfg.formats or []) if fmt not in method.formats]
    if missing:
        raise DraftsmithError(f"formats has {missing[0]}, not a format of {method.name} heads; choose from "
                              f"{', '.join(method.formats)}.")
    report = matching_report(cfg, folder)
    target = read_manifest(folder).get("target", {}) if (folder / MANIFEST).is_file() else {}
    base_model, license = resolve_base_model(cfg, target)
    num_speculative_tokens = cfg.num_speculative_tokens or (report[0]["drafting"]["num_speculative_tokens"]
                                                            if report else NUM_SPECULATIVE_TOKENS)
    if not cfg.dry_run and hub_offline():
        raise DraftsmithError(offline_refusal())
    if not cfg.dry_run and not has_token():
        raise DraftsmithError("no Hugging Face token: set HF_TOKEN or run `hf auth login` (or pass dry_run=true).")
    head_arg = Path(str(cfg.head).rstrip("/"))
    out = Path(cfg.out) if cfg.out else head_arg.with_name(f"{head_arg.name}-hub")
    inputs = [("head", head_arg), ("head", folder)] + ([("report", cfg.report)] if cfg.report else [])
    out = prepare_output(out, "publish", inputs, overwrite=bool(cfg.overwrite))
    public = public_paths(cfg, folder, report, target, base_model, repo_id)
    write_publish_folder(cfg, out, folder, report, base_model, license, int(num_speculative_tokens), method,
                         read_folder_config(folder).get("num_hidden_layers"), public)
    files = upload_files(out)
    result = {"out": str(out), "repo_id": repo_id, "files": files, "uploaded": False}
    if cfg.dry_run:
        return result
    done = upload(out, files, repo_id, bool(cfg.private),
                  f"draftsmith publish: {method.name} head for {base_model}", timeout=float(cfg.hub_timeout))
    result.update(uploaded=True, url=done["url"], commit=done["commit"])
    return result


def summary(result: dict) -> str:
    """The line the CLI prints."""
    if not result["uploaded"]:
        return f"draftsmith publish: wrote {result['out']} ({len(result['files'])} files); dry_run=true, nothing uploaded"
    return (f"draftsmith publish: uploaded {len(result['files'])} files from {result['out']} to {result['url']} "
            f"in one commit")
