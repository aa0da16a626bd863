"""publish's model card: README.md with Hub metadata (model-index results from the eval report) and the card's
sections (serving commands, the evaluation, the method, the training data, the files), from what the head's folder,
its training run and its data-gen output recorded."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Optional

from omegaconf import OmegaConf

from draftsmith.core.artifacts import MANIFEST, read_manifest
from draftsmith.core.engine import Engines
from draftsmith.eval.cost import serving_settings
from draftsmith.eval.decoder import DraftingConfig


def card_commands(method: str, engines: Engines, base_model: str, repo_id: str, num_speculative_tokens: int,
                  report: Optional[dict]) -> dict:
    """The card's serving commands, one flag per line: eval's `serving_settings` (the one place that knows the
    engines' flags) for the drafting mode the eval report measured; an engine that cannot serve `method` is left
    out."""
    drafting = (report or {}).get("drafting") or {}
    tree = drafting.get("mode") == "tree"
    settings = serving_settings(method, engines, base_model, repo_id, num_speculative_tokens,
                                "tree" if tree else "chain",
                                tree_top_k=int(drafting.get("tree_top_k", DraftingConfig.tree_top_k)),
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


def build_card(cfg, base_model: str, license: str, report: Optional[dict], summary: dict, num_speculative_tokens: int,
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
    serving = card_commands(method.name, method.engines, base_model, cfg.repo_id, num_speculative_tokens, report)
    parts = method.card(options, formats, serving)
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
    body += [f"K = {num_speculative_tokens} speculative tokens" + (" (the eval's setting)." if report else "."), ""]
    body += eval_section(report, plot) + method_section(summary, parts)
    files = parts["files"] | {"gguf": f"llama.cpp's `-md` file, {cfg.gguf_outtype} weights"}
    body += ["## Files", ""] + [f"- `{'.' if i == 0 else fmt + '/'}`: the {fmt} format ({files[fmt]})"
                                for i, fmt in enumerate(formats)]
    weights = cfg.dtype + (f" (`{gguf_file}`: {cfg.gguf_outtype})" if gguf_file else "")
    body += ["", f"Trained, measured and published with draftsmith; weights in {weights}.", ""]
    return str(ModelCard(f"---\n{data.to_yaml()}\n---\n\n" + "\n".join(body)))
