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
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import json
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from omegaconf import OmegaConf

from draftsmith.core import DraftsmithError, checks, llamacpp
from draftsmith.core.artifacts import (MANIFEST, OWNER, RECORD, atomic_folder, atomic_write_bytes, atomic_write_json,
                                          claim_output, prepare_output, read_manifest, read_record)
from draftsmith.data_gen.target import DTYPES, KNOWN_TARGETS, PRESETS, torch_dtype
from draftsmith.core.engine import NUM_SPECULATIVE_TOKENS, Engines
from draftsmith.eval.cost import serving_settings
from draftsmith.export import head_target_folder, is_set
from draftsmith.heads.folders import FormatOptions
from draftsmith.core.trust import check_weights_file
from draftsmith.heads.folders import WEIGHTS, weights_sha256
from draftsmith.core.methods import export_formats, method_for_folder, read_folder_config

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


LINK_FIX = ("publish reads and uploads no file reached through a link, as it can point at any file on this machine: "
            "put the file itself there (or remove the link)")


def refuse_links(*paths: Path) -> None:
    """One sentence for the first of `paths` that is a symbolic link."""
    for path in paths:
        if path.is_symlink():
            raise DraftsmithError(f"{path} is a symbolic link (to {os.readlink(path)}); {LINK_FIX}.")


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


EVAL_FILES = ("report.md", "report.png")  # copied beside report.json into eval/ when the eval folder has them


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
# What the card says


def card_commands(method: str, engines: Engines, base_model: str, repo_id: str, k: int,
                  report: Optional[dict]) -> dict:
    """The card's serving commands, one flag per line: eval's `serving_settings` (the one place that knows the
    engines' flags) for the drafting mode the eval report measured; an engine that cannot serve `method` is left
    out."""
    drafting = (report or {}).get("drafting") or {}
    tree = drafting.get("mode") == "tree"
    settings = serving_settings(method, engines, base_model, repo_id, k, "tree" if tree else "chain",
                                tree_top_k=int(drafting.get("tree_top_k", 1)),
                                tree_size=int(drafting["tree_budget"]) if tree and drafting.get("tree_budget") else None,
                                line_break=True)
    return {engine: settings[engine]["command"] for engine in ("vllm", "sglang", "llamacpp")
            if settings[engine]["command"]}


def eval_results(report: dict, base_model: str) -> list:
    """model-index entries: tau, speedup and position-1 acceptance of the report."""
    from huggingface_hub import EvalResult

    prompts = report.get("prompts") or {}
    source = Path(str(prompts.get("path") or prompts.get("source") or "prompts")).stem
    d = report["drafting"]
    setting = f"{d['mode']} K={d['num_speculative_tokens']}, temperature {report.get('temperature')}"

    def result(metric_type: str, metric_name: str, metric_value: float) -> EvalResult:
        return EvalResult(task_type="text-generation", task_name=f"speculative decoding with {base_model}",
                          dataset_type=source, dataset_name=f"{source} ({report.get('n_prompts')} prompts)",
                          dataset_args={"drafting": setting}, verified=False, metric_type=metric_type,
                          metric_name=metric_name, metric_value=metric_value)

    results = [result("acceptance_length", "acceptance length tau (bonus token included)",
                      round(float(report["tau"]), 4)),
               result("speedup", "speedup vs target-only decoding (same decoder, "
                      f"{report.get('hardware', {}).get('device', '?')})", round(float(report["speedup"]), 4))]
    if report.get("per_position_acceptance"):
        results.append(result("acceptance_rate", "acceptance rate at draft position 1",
                              round(float(report["per_position_acceptance"][0]), 4)))
    return results


def _saved_config(path: Path) -> dict:
    """A run's saved config.yaml (a mapping) as plain containers, interpolations as written."""
    config = OmegaConf.to_container(OmegaConf.load(path), resolve=False)
    assert isinstance(config, dict), f"{path}: not a mapping"
    return config


def training_summary(folder: Path, offline_data: str) -> dict:
    """What the head's manifest, its training run and its data-gen output record (missing parts stay out).
    `offline_data`: the data-gen manifest key that train's mode=auto reads offline (the method's)."""
    summary: dict = {}
    if (folder / MANIFEST).is_file():
        summary["head"] = read_manifest(folder).get("counts", {})
    run_dir = folder.parent if folder.name == "final" else None
    if run_dir is not None and (run_dir / "config.yaml").is_file():
        train = _saved_config(run_dir / "config.yaml")
        summary["train"] = {k: train.get(k) for k in ("method", "mode", "epochs", "max_steps", "lr", "precision",
                                                      "max_length", "micro_batch_size", "grad_accum") if k in train}
        data = Path(str(train.get("data", "")))
        if train.get("data") and (data / MANIFEST).is_file():
            manifest = read_manifest(data)
            mode = train.get("mode", "auto")
            summary["data"] = {"counts": manifest.get("counts", {}),
                               "offline": mode == "offline" or (mode == "auto" and bool(manifest.get(offline_data)))}
            if (data / "config.yaml").is_file():
                prompts = (_saved_config(data / "config.yaml") or {}).get("prompts") or {}
                summary["data"]["prompts"] = prompts.get("source")
    return summary


def _fmt(x, digits: int = 2) -> str:
    return f"{x:.{digits}f}" if isinstance(x, (int, float)) else "-"


def eval_section(report: Optional[dict], plot: bool) -> list[str]:
    if report is None:
        return ["## Evaluation", "", "Not measured: this head was published without a draftsmith eval report "
                "(`allow_no_eval=true`). Its acceptance length and speedup are unknown.", ""]
    d, hw = report["drafting"], report.get("hardware", {})
    acc = report.get("per_position_acceptance") or []
    lines = ["## Evaluation", "",
             f"Measured with draftsmith's built-in lossless decoder on {report['target']['target_id']}: "
             f"{report.get('n_prompts')} prompts ({(report.get('prompts') or {}).get('source')}), "
             f"{report.get('n_samples')} decoded turns, temperature {report.get('temperature')}, {d['mode']} drafting "
             f"with K = {d['num_speculative_tokens']}"
             + (f" (tree_top_k {d['tree_top_k']}, tree_budget {d['tree_budget']})" if d["mode"] == "tree" else "")
             + f", max_new_tokens {report.get('max_new_tokens')}, median of {report.get('repeats')} runs, on "
             f"{hw.get('cpu', '?')} / device {hw.get('device', '?')}" + (f" ({hw['gpu']})" if hw.get("gpu") else "")
             + ".", "",
             "| metric | value |", "|---|---:|",
             f"| acceptance length τ | {_fmt(report['tau'])} |",
             f"| speedup vs target-only | {_fmt(report['speedup'])}x |",
             f"| speculative tokens/s | {_fmt(report.get('speculative_tokens_per_s'), 1)} |",
             f"| target-only tokens/s | {_fmt(report.get('target_only_tokens_per_s'), 1)} |",
             "| per-position acceptance | " + " / ".join(_fmt(a) for a in acc) + " |"]
    if report.get("greedy_identical_fraction") is not None:
        lines.append(f"| greedy output identical to the target's | {report['greedy_identical_fraction']:.0%} |")
    cats = report.get("per_category") or {}
    if cats:
        lines += ["", "| category | n | τ | speedup |", "|---|---:|---:|---:|"]
        lines += [f"| {c} | {r.get('n')} | {_fmt(r.get('tau'))} | {_fmt(r.get('speedup'))}x |" for c, r in cats.items()]
    for name, b in (report.get("baselines") or {}).items():
        lines.append(f"\nBaseline {name} on the same prompts: τ {_fmt(b.get('tau'))}, speedup {_fmt(b.get('speedup'))}x.")
    lines += ["", f"Conventions: {report.get('conventions', '')}", ""]
    if plot:
        lines += ["![per-position acceptance and τ per category](eval/report.png)", ""]
    lines += ["The whole report is in `eval/report.json` and `eval/report.md`.", ""]
    return lines


def method_section(summary: dict, parts: dict) -> list[str]:
    train = summary.get("train", {})
    head = summary.get("head", {})
    lines = ["## Method", "", parts["method"]]
    facts = {"draft vocab": head.get("draft_vocab_size") or parts.get("draft_vocab_size"),
             "parameters (without embeddings)": head.get("parameters"), "mode": train.get("mode"),
             "precision": train.get("precision"), "learning rate": train.get("lr"), "epochs": train.get("epochs"),
             "max steps": train.get("max_steps"), "max length": train.get("max_length")}
    lines += [""] + [f"- {k}: {v}" for k, v in facts.items() if v is not None] + [""]
    data = summary.get("data")
    lines += ["## Training data", ""]
    if data:
        c = data["counts"]
        lines.append(f"Prompts ({data.get('prompts') or 'unknown source'}) answered by the target itself "
                     f"(draftsmith data-gen): {c.get('samples')} samples, {c.get('tokens')} tokens, of which "
                     f"{c.get('loss_tokens')} assistant tokens carry the loss"
                     + ("; the target's outputs were captured once and read offline." if data.get("offline")
                        else "; the target ran in every training step (online)."))
    else:
        lines.append("Not recorded beside this head (no training run / data-gen manifest found).")
    return lines + [""]


def method_defaults(method) -> dict:
    """The method's training options at their defaults (its Config dataclass): the card states what a run left
    at its default from the one place that default is written."""
    if method.config is None:
        return {}
    out = {}
    for f in dataclasses.fields(method.config):
        if f.default is not dataclasses.MISSING:
            out[f.name] = f.default
        elif f.default_factory is not dataclasses.MISSING:  # a nested options dataclass (a draft model's lora)
            value = f.default_factory()
            if dataclasses.is_dataclass(value) and not isinstance(value, type):
                value = dataclasses.asdict(value)
            out[f.name] = value
    return out


def build_card(cfg, base_model: str, license: str, report: Optional[dict], summary: dict, k: int,
               formats: list[str], plot: bool, method, num_layers: Optional[int] = None,
               gguf_file: Optional[str] = None) -> str:
    """README.md: Hub metadata (base_model, license, library_name, tags, pipeline_tag, model-index) + the card.
    `gguf_file`: the folder's GGUF file (formats with gguf), which llama.cpp's command then names."""
    from huggingface_hub import ModelCard, ModelCardData

    name = cfg.repo_id.split("/")[1]
    train = summary.get("train", {})
    # what the run recorded, over the method's defaults; the layer count is the folder's own (num_layers: its
    # config.json), never a default the head may not have
    options = {**method_defaults(method), **({"num_layers": num_layers} if num_layers is not None else {}),
               **(train.get("method") if isinstance(train.get("method"), dict) else {})}
    parts = method.card(options, formats, card_commands(method.name, method.engines, base_model, cfg.repo_id, k, report))
    commands = parts["commands"]
    data = ModelCardData(base_model=base_model, license=license, library_name=cfg.library_name, tags=parts["tags"],
                         pipeline_tag="text-generation", model_name=name,
                         eval_results=eval_results(report, base_model) if report else None)
    body = [f"# {name}", "",
            f"{parts['title']} for [{base_model}](https://huggingface.co/{base_model}): it proposes tokens that "
            f"the target verifies, so outputs are the target's own (lossless); it only changes speed.", "",
            "## Serve it", "", "vLLM:", "", "```bash", commands["vllm"], "```", ""]
    if '"parallel_drafting": true' in commands["vllm"]:  # the folder's own flag is not read (vLLM 0.32)
        body += ['Keep `"parallel_drafting": true` in `--speculative-config`: vLLM ignores the flag in this '
                 "folder's config.json and, without it, drafts one token per forward, saying only \"mask_hidden "
                 "found in weights but model is not configured for parallel drafting\".", ""]
    if "sglang" in commands:
        body += ["SGLang:", "", "```bash", commands["sglang"], "```", ""]
    else:
        body += [parts["no_sglang"], ""]
    if "llamacpp" in commands and gguf_file:  # this repo's GGUF file, at the type it was written in
        body += [f"llama.cpp (CPU), with this repo's `{gguf_file}` ({cfg.gguf_outtype} weights, written by llama.cpp's "
                 "own converter) and the target as a GGUF file:", "", "```bash",
                 commands["llamacpp"].replace("<head>.gguf", gguf_file), "```", ""]
    elif "llamacpp" in commands:  # llama.cpp loads GGUF files only: the target's, and this head converted
        body += ["llama.cpp (CPU), after `draftsmith export head=<this folder> format=gguf` (llama.cpp's own "
                 "converter) and with the target as a GGUF file:", "", "```bash", commands["llamacpp"], "```", ""]
    body += [f"K = {k} speculative tokens" + (" (the eval's setting)." if report else "."), ""]
    body += eval_section(report, plot) + method_section(summary, parts)
    files = parts["files"] | {"gguf": f"llama.cpp's `-md` file, {cfg.gguf_outtype} weights"}
    body += ["## Files", ""] + [f"- `{'.' if i == 0 else fmt + '/'}`: the {fmt} format ({files[fmt]})"
                                for i, fmt in enumerate(formats)]
    weights = cfg.dtype + (f" (`{gguf_file}`: {cfg.gguf_outtype})" if gguf_file else "")
    body += ["", f"Trained, measured and published with draftsmith; weights in {weights}.", ""]
    return str(ModelCard(f"---\n{data.to_yaml()}\n---\n\n" + "\n".join(body)))


# ---------------------------------------------------------------------------------------------
# No local path goes public

PATH_CHARS = r"[^\s\"'`<>|,;()\[\]{}\\]"  # what a path in the folder's text runs on with
BINARY_SUFFIXES = (".safetensors", ".png", ".jpg", ".jpeg", ".gif", ".bin", ".pt", ".gguf")


def _escaped(text: str) -> str:
    return json.dumps(text)[1:-1]  # how the text stands in a JSON file


def _replaced_by(new: str) -> Callable[[re.Match[str]], str]:
    """re.sub's replacement by `new` as it is (a string replacement would read its backslashes as escapes)."""
    return lambda m: new


def _last_part_under(root: str) -> Callable[[re.Match[str]], str]:
    """re.sub's replacement of a path under `root` by its last part, and of `root` itself by <local folder>."""
    def last_part(m: re.Match[str]) -> str:
        path = m.group(0).rstrip("/")
        return path.rsplit("/", 1)[-1] if path != root else "<local folder>"
    return last_part


@dataclass
class PublicPaths:
    """What the Hub copy says instead of a local path: `names` maps a local path (and any path below it) to its
    public name; any other path under one of `roots` (the home and working folders, the folders holding the
    inputs) becomes its last part."""

    names: dict[str, str]
    roots: list[str]

    def text(self, text: str) -> str:
        edge = r"(?<![\w.~/-])"
        for old in sorted(self.names, key=len, reverse=True):
            new = self.names[old]
            for o, n in {(old, new), (_escaped(old), _escaped(new))}:
                text = re.sub(edge + re.escape(o) + r"(?![\w.-])", _replaced_by(n), text)
        for root in sorted(self.roots, key=len, reverse=True):
            for r in {root, _escaped(root)}:
                text = re.sub(edge + re.escape(r) + f"(?:/{PATH_CHARS}*)?" + r"(?![\w.-])", _last_part_under(r),
                              text)
        return text

    def rewrite(self, folder: Path) -> None:
        """Every text file under `folder` (weights and images aside) with its local paths replaced."""
        for path in sorted(folder.rglob("*")):
            if not path.is_file() or path.is_symlink() or path.name == OWNER or path.suffix in BINARY_SUFFIXES:
                continue
            data = path.read_bytes()
            try:
                text = data.decode("utf-8")
            except UnicodeDecodeError:
                continue
            public = self.text(text)
            if public != text:
                atomic_write_bytes(path, public.encode())


def path_forms(path) -> set[str]:
    """The spellings a local path may stand in a file under: as given (when it names a folder in it), absolute,
    resolved."""
    text = str(path).rstrip("/") or str(path)
    forms = {text} if "/" in text or os.sep in text else set()
    local = Path(text).expanduser()
    return forms | {os.path.abspath(local), str(local.resolve())}


def is_local_path(name: str) -> bool:
    return bool(name) and name not in PRESETS and (os.path.isabs(name) or name.startswith((".", "~"))
                                                   or Path(name).expanduser().exists())


def public_paths(cfg, folder: Path, report: Optional[tuple[dict, Path]], target: dict, base_model: str,
                 repo_id: str) -> PublicPaths:
    """The local paths the published folder must not hold and what it says instead: the head (as given, its
    final/, as eval recorded it) -> the repo id, a local target -> base_model, the eval folder -> eval, the
    prompts file -> its name; anything else under the home, working or input folders -> its last part."""
    names: dict[str, str] = {}
    roots = {str(Path.home()), os.getcwd()}

    def add(path, public: str) -> None:
        if not path:
            return
        for form in path_forms(path):
            names.setdefault(form, public)
            roots.add(os.path.dirname(form))

    data = report[0] if report else {}
    for head in (cfg.head, folder, (data.get("drafter") or {}).get("path"), data.get("head")):
        add(head, repo_id)
    for target_id in (target.get("target_id"), (data.get("target") or {}).get("target_id")):
        if isinstance(target_id, str) and is_local_path(target_id):
            add(target_id, base_model)
    if report:
        add(report[1] / "report.json", "eval/report.json")
        add(report[1], "eval")
    prompts = (data.get("prompts") or {}).get("path")
    if isinstance(prompts, str) and prompts:
        add(prompts, Path(prompts).name)
    return PublicPaths(names, sorted(r for r in roots if os.path.isabs(r) and len(r.rstrip("/")) > 1))


# ---------------------------------------------------------------------------------------------
# The folder and the upload


def write_formats(folder: Path, tmp: Path, formats: list[str], cfg, base_model: str, k: int, method) -> None:
    """Export the head into tmp with its method's writers: the first format at the root, the others in subfolders."""
    head = method.load(folder)
    target = read_manifest(folder).get("target") if (folder / MANIFEST).is_file() else None
    target_id = (target or {}).get("target_id")
    options = FormatOptions(torch_dtype(cfg.dtype), cfg.include_embeddings, verifier=base_model, num_speculative_tokens=k,
                            target_folder=lambda: head_target_folder(None, target_id), gguf_outtype=cfg.gguf_outtype)
    for i, fmt in enumerate(formats):
        sub = tmp / (f".{fmt}-root" if i == 0 else fmt)
        method.formats[fmt](head, sub, target, options)
        (sub / OWNER).unlink(missing_ok=True)
        if i == 0:
            for f in sub.iterdir():
                f.rename(tmp / f.name)
            sub.rmdir()


def write_publish_folder(cfg, out: Path, folder: Path, report: Optional[tuple[dict, Path]], base_model: str,
                         license: str, k: int, method, public: Optional["PublicPaths"] = None) -> Path:
    """The Hub-ready folder (atomically): formats, eval/ (report + plot), README.md; `method`: the folder's
    entry in draftsmith.core.methods (`head_folder` finds it); `public`: the local paths its text files must not hold
    (`public_paths`), rewritten last."""
    # by default every format but gguf, which needs llama.cpp's converter built here (formats=[..., gguf] adds it)
    formats = list(cfg.formats) if cfg.formats is not None else [f for f in method.formats if f != "gguf"]
    with atomic_folder(out, owner="publish", overwrite=bool(cfg.overwrite)) as tmp:  # (keeps the user's files)
        claim_output(tmp, "publish")
        write_formats(folder, tmp, formats, cfg, base_model, k, method)
        plot = False
        if report is not None:
            data, where = report
            (tmp / "eval").mkdir()
            atomic_write_json(tmp / "eval" / "report.json", data)
            for name in EVAL_FILES:
                if (where / name).is_file():
                    refuse_links(where / name)
                    shutil.copyfile(where / name, tmp / "eval" / name)
            plot = (tmp / "eval" / "report.png").is_file()
        summary = training_summary(folder, method.offline_data)
        gguf_file = next((p.relative_to(tmp).as_posix() for p in sorted(tmp.rglob("*.gguf"))), None)
        card = build_card(cfg, base_model, license, report[0] if report else None, summary, k, formats, plot, method,
                          read_folder_config(folder).get("num_hidden_layers"), gguf_file)
        atomic_write_bytes(tmp / "README.md", card.encode())
        if public is not None:
            public.rewrite(tmp)
    return out


def upload_files(out: Path) -> list[str]:
    """The files publish wrote into its folder (its record), sorted: a file the user keeps beside them stays
    local, as do draftsmith's owner and record files; a link in it (publish writes none) is refused rather than
    followed."""
    refuse_links(*out.rglob("*"))
    written = read_record(out)
    if written is None:
        raise DraftsmithError(f"{out} has no record of what publish wrote there ({RECORD}); rerun publish to "
                              f"write the folder again before uploading it.")
    return sorted(rel for rel in written if (out / rel).is_file() and not (out / rel).is_symlink()
                  and not any(part.startswith(".") for part in Path(rel).parts))


@contextlib.contextmanager
def hub_timeouts(seconds: float):
    """Every request huggingface_hub makes inside waits at most `seconds` to connect or for data (its default
    client has no timeout): the shared client comes from a factory wrapping the one in place, restored after."""
    from huggingface_hub.utils import _http

    if not hasattr(_http, "set_client_factory"):  # huggingface_hub < 1.0 (requests): its own defaults
        yield
        return
    previous = getattr(_http, "_GLOBAL_CLIENT_FACTORY", _http.default_client_factory)

    def factory():
        client = previous()
        client.timeout = seconds
        return client

    _http.set_client_factory(factory)
    try:
        yield
    finally:
        _http.set_client_factory(previous)


def hub_errors() -> tuple[type[Exception], ...]:
    """What a failing Hub raises: HTTP answers (HfHubHTTPError), offline mode and refused connections (OSErrors),
    timeouts and transport errors (the HTTP library's own), an answer that is not JSON (ValueError)."""
    errors: list[type[Exception]] = [OSError, ValueError]
    for name in ("httpx2", "httpx"):
        try:
            errors.append(importlib.import_module(name).HTTPError)
        except (ImportError, AttributeError):
            continue
    return tuple(errors)


OFFLINE_VARIABLES = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")  # either turns huggingface_hub offline


def offline_variables() -> list[str]:
    """The variables that turn the Hub off, as set in the environment now; ["HF_HUB_OFFLINE"] where huggingface_hub
    read offline mode at import but neither is set now (it no longer says which)."""
    from huggingface_hub import constants

    set_now = [v for v in OFFLINE_VARIABLES if os.environ.get(v, "").strip().upper() in ("1", "ON", "YES", "TRUE")]
    return set_now or (["HF_HUB_OFFLINE"] if getattr(constants, "HF_HUB_OFFLINE", False) else [])


def hub_offline() -> bool:
    """HF_HUB_OFFLINE or TRANSFORMERS_OFFLINE set (as huggingface_hub read them at import, or in the environment now)."""
    return bool(offline_variables())


def offline_refusal() -> str:
    """One sentence naming the variable that is actually set (TRANSFORMERS_OFFLINE turns the Hub off too)."""
    names = offline_variables() or ["HF_HUB_OFFLINE"]
    said = " and ".join(names)
    return (f"{said} {'is' if len(names) == 1 else 'are'} set, so publish cannot reach the Hub and nothing was "
            f"written or uploaded: unset {said} to upload, or pass dry_run=true to write the folder only.")


def hub_failure(e: Exception, step: str, repo_id: str, endpoint: str, created: bool, timeout: float,
                out: Path) -> str:
    """One sentence: which step failed and why, what exists on the Hub now, and how to retry."""
    from huggingface_hub.errors import HfHubHTTPError, OfflineModeIsEnabled

    if isinstance(e, OfflineModeIsEnabled):
        return offline_refusal()
    status = getattr(getattr(e, "response", None), "status_code", None)
    hint = ""
    if isinstance(e, HfHubHTTPError) and status:
        said = " ".join(str(getattr(e, "server_message", "") or "").split())
        why = f"the Hub answered HTTP {status}" + (f" ({said})" if said else "")
        if status in (401, 403):
            hint = (f"check that HF_TOKEN (or `hf auth login`) holds a token with write access to "
                    f"{repo_id.split('/')[0]}, then ")
        elif status == 404:
            hint = "check the repo id and that the token may write to it, then "
        elif status == 429 or status >= 500:
            hint = "the Hub failed on its side: wait a little, then "
    elif "timeout" in type(e).__name__.lower() or isinstance(e, TimeoutError):
        why = f"it did not answer within hub_timeout={timeout:g} s"
        hint = "wait or raise hub_timeout=, then "
    elif isinstance(e, (ConnectionError,)) or "connect" in type(e).__name__.lower() or \
            "network" in type(e).__name__.lower():
        why = f"it cannot be reached ({' '.join(str(e).split()) or type(e).__name__})"
        hint = "check the network (and HF_ENDPOINT, if set), then "
    else:
        why = " ".join(str(e).split())[:300] or type(e).__name__
    state = (f"the repo {repo_id} exists on the Hub (created now, or there before) but nothing was committed to it"
             if created else "nothing was created or uploaded on the Hub")
    return f"publish could not {step} on {endpoint}: {why}; {state}; {hint}rerun the same command to upload {out}."


def upload(out: Path, repo_id: str, private: bool, commit_message: str, timeout: float = 60.0) -> dict:
    """Create the repo if needed and push every file of `out` in ONE commit; the token is huggingface_hub's own.
    Every request waits at most `timeout` seconds; a failing Hub is one sentence (`hub_failure`)."""
    from huggingface_hub import CommitOperationAdd, HfApi

    api = HfApi()  # token: HF_TOKEN or the saved login, resolved by huggingface_hub, never seen here
    files = upload_files(out)
    created, step = False, f"create the repo {repo_id}"
    try:
        with hub_timeouts(timeout):
            repo = api.create_repo(repo_id, repo_type="model", private=private or None, exist_ok=True)
            created, step = True, f"upload {len(files)} files to {repo_id} in one commit"
            info = api.create_commit(repo_id, repo_type="model", commit_message=commit_message,
                                     operations=[CommitOperationAdd(path_in_repo=f, path_or_fileobj=str(out / f))
                                                 for f in files])
    except hub_errors() as e:
        raise DraftsmithError(hub_failure(e, step, repo_id, api.endpoint, created, timeout, out)) from None
    return {"url": str(getattr(repo, "url", "") or f"https://huggingface.co/{repo_id}"),
            "commit": getattr(info, "oid", None), "files": files}


def has_token() -> bool:
    from huggingface_hub import get_token

    return bool(get_token())


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
    k = cfg.num_speculative_tokens or (report[0]["drafting"]["num_speculative_tokens"] if report
                                      else NUM_SPECULATIVE_TOKENS)
    if not cfg.dry_run and hub_offline():
        raise DraftsmithError(offline_refusal())
    if not cfg.dry_run and not has_token():
        raise DraftsmithError("no Hugging Face token: set HF_TOKEN or run `hf auth login` (or pass dry_run=true).")
    head_arg = Path(str(cfg.head).rstrip("/"))
    out = Path(cfg.out) if cfg.out else head_arg.with_name(f"{head_arg.name}-hub")
    inputs = [("head", head_arg), ("head", folder)] + ([("report", cfg.report)] if cfg.report else [])
    out = prepare_output(out, "publish", inputs, overwrite=bool(cfg.overwrite))
    public = public_paths(cfg, folder, report, target, base_model, repo_id)
    write_publish_folder(cfg, out, folder, report, base_model, license, int(k), method, public)
    result = {"out": str(out), "repo_id": repo_id, "files": upload_files(out), "uploaded": False}
    if cfg.dry_run:
        return result
    done = upload(out, repo_id, bool(cfg.private), f"draftsmith publish: {method.name} head for {base_model}",
                  timeout=float(cfg.hub_timeout))
    result.update(uploaded=True, url=done["url"], commit=done["commit"])
    return result


def summary(result: dict) -> str:
    """The line the CLI prints."""
    if not result["uploaded"]:
        return f"draftsmith publish: wrote {result['out']} ({len(result['files'])} files); dry_run=true, nothing uploaded"
    return (f"draftsmith publish: uploaded {len(result['files'])} files from {result['out']} to {result['url']} "
            f"in one commit")
