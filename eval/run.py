"""The eval stage: decode the same prompts target-only and speculatively, and report τ and speedup.

    draftsmith eval head=runs/head target=smollm2 prompts=question prompts.path=question.jsonl
    draftsmith eval head=ngram target=smollm2 prompts=question prompts.path=q.jsonl temperature=1 drafting.mode=tree

Both rows come from the same decoder code (`speculative_generate`; target-only = no proposer),
on the same prompts, after a warm-up; each prompt's time is the median of `repeats` runs. With a
multi-turn prompt each method answers turn 2 after its own turn-1 answer. Writes into `out/`:
report.json, report.md, report.png, config.yaml and manifest.json.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import torch
from omegaconf import OmegaConf

from draftsmith import DraftsmithError
from draftsmith.data_gen import manifest as mf
from draftsmith.data_gen.target import Target, load_target
from draftsmith.eval import metrics
from draftsmith.eval.config import build_settings
from draftsmith.eval.decoder import DraftingConfig, GenerationResult, SamplingConfig, speculative_generate
from draftsmith.eval.prompts import EvalPrompt, load_prompts, render
from draftsmith.eval.report import hardware, software_versions, summary_lines, write_report

EAGLE3_ARCHITECTURES = ("LlamaForCausalLMEagle3",)
SPECULATORS_ARCHITECTURES = ("Eagle3DraftModel",)
TARGET_ONLY = "target_only"


# --------------------------------------------------------------------------- the drafter

@dataclass
class Drafter:
    """What `head=` named: a method name, how to build a fresh proposer, and what the report says of it."""

    method: str  # eagle3 | draft_model | ngram | none
    make: Optional[Callable[[], object]]  # builds the proposer; None = target-only
    info: dict = field(default_factory=dict)
    model: Optional[torch.nn.Module] = None  # draft_model: the HF LM (for the hf_assisted baseline)


def find_head_folder(path: Path) -> Path:
    """The folder holding config.json: `path` itself, or `path/final` (what `draftsmith train` writes)."""
    for folder in (path, path / "final"):
        if (folder / "config.json").is_file():
            return folder
    raise DraftsmithError(f"head={str(path)!r} has no config.json (nor a final/ folder holding one); give an "
                          f"EAGLE-3 folder, a train out/ folder or an HF draft-model folder.")


def check_head_target(folder: Path, config: dict, target: Target) -> None:
    """Refuse a head made for another target: its manifest's identity, else its config's sizes."""
    where = f"head {folder}"
    manifest_dir = next((d for d in (folder, folder.parent) if (d / mf.MANIFEST).is_file()), None)
    if manifest_dir is not None:
        manifest = mf.read_manifest(manifest_dir)
        if manifest.get("target"):
            mf.check_same_target(manifest["target"], target.identity(), where=where)
    vocab = config.get("vocab_size")
    if vocab is not None and vocab != target.vocab_size:
        raise DraftsmithError(f"{where} has vocab_size={vocab}, but target {target.target_id!r} has "
                              f"{target.vocab_size}: it was made for another target.")
    hidden = config.get("target_hidden_size") or config.get("hidden_size")
    if config.get("architectures", [None])[0] in EAGLE3_ARCHITECTURES and hidden != target.hidden_size:
        raise DraftsmithError(f"{where} reads target hidden size {hidden}, but target {target.target_id!r} has "
                              f"{target.hidden_size}: it was made for another target.")


def load_drafter(cfg, target: Target, max_len: int) -> Drafter:
    """Resolve `head=`: none | ngram | an EAGLE-3 folder | an HF draft-model folder."""
    from draftsmith.eval.proposers import make_proposer

    head = str(cfg.head)
    if head == "none":
        return Drafter("none", None, {"kind": "none"})
    if head == "ngram":
        return Drafter("ngram", lambda: make_proposer("ngram", target, **ngram_kwargs(cfg)),
                       {"kind": "ngram", "ngram_min": cfg.ngram_min, "ngram_max": cfg.ngram_max})
    path = Path(head)
    if not path.is_dir():
        raise DraftsmithError(f"head={head!r} is neither `ngram`, `none` nor a folder.")
    folder = find_head_folder(path)
    try:
        config = json.loads((folder / "config.json").read_text())
    except json.JSONDecodeError as e:
        raise DraftsmithError(f"{folder / 'config.json'} is not valid JSON (line {e.lineno}).") from None
    arch = (config.get("architectures") or [None])[0]
    if arch in SPECULATORS_ARCHITECTURES:
        raise DraftsmithError(f"head {folder} is in the speculators format; evaluate the EAGLE-3 folder "
                              f"(format=vllm export or the training checkpoint) instead.")
    check_head_target(folder, config, target)
    if arch in EAGLE3_ARCHITECTURES:
        from draftsmith.heads.checkpoint import load_eagle3, weights_sha256

        model = load_eagle3(folder, device=target.device, dtype=target.dtype,
                            target_embeddings=target.model.get_input_embeddings()).eval()
        return Drafter("eagle3", lambda: make_proposer("eagle3", target, head=model, max_len=max_len),
                       {"kind": "eagle3", "path": str(folder), "draft_vocab_size": model.config.draft_vocab_size,
                        "sha256": weights_sha256(folder)})  # publish matches the head it publishes by this
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=target.dtype).to(target.device).eval()
    return Drafter("draft_model", lambda: make_proposer("draft_model", target, model=model, max_len=max_len),
                   {"kind": "draft_model", "path": str(folder), "architecture": arch,
                    "num_layers": model.config.num_hidden_layers}, model=model)


def ngram_kwargs(cfg) -> dict:
    return {"max_ngram": cfg.ngram_max, "min_ngram": cfg.ngram_min}


# --------------------------------------------------------------------------- decoding

def decode_conversation(runner, proposer, tokenizer, prompt: EvalPrompt,
                        max_new_tokens: int, sampling: SamplingConfig, drafting: DraftingConfig,
                        eos: list[int], seed: int) -> list[GenerationResult]:
    """Answer every turn of a prompt, each after the method's own previous answers; one result per turn."""
    results, answers = [], []
    for turn in range(len(prompt.turns)):
        ids = torch.tensor(render(tokenizer, prompt, answers))
        generator = torch.Generator(device=runner.device).manual_seed(seed + turn)
        runner.reset()
        res = speculative_generate(runner, proposer, ids, max_new_tokens, sampling, drafting, eos, generator=generator)
        results.append(res)
        answers.append(tokenizer.decode(res.tokens, skip_special_tokens=True))
    return results


def to_sample(category: str, runs: list[GenerationResult]) -> metrics.Sample:
    """One turn's repeated runs -> a Sample (counts of the first run, median time of all)."""
    r = runs[0]
    return metrics.Sample(
        category=category, new_tokens=len(r.tokens), verifications=r.n_verifications,
        seconds=metrics.median([x.prefill_s + x.decode_s for x in runs]),
        accepted=list(r.accepted_per_position), proposed=list(r.proposed_per_position),
        emitted=min(sum(r.emitted_per_verification), len(r.tokens) - 1) if r.emitted_per_verification else None)


def hf_generate_sample(model, tokenizer, prompt: EvalPrompt, cfg, eos: list[int], assistant=None) -> list[metrics.Sample]:
    """transformers' own `generate` (optionally with `assistant_model`) on the first turn; median wall time."""
    ids = torch.tensor([render(tokenizer, prompt, [])], device=model.device)
    kw = dict(max_new_tokens=cfg.max_new_tokens, eos_token_id=eos, pad_token_id=tokenizer.pad_token_id,
              do_sample=cfg.temperature > 0, attention_mask=torch.ones_like(ids))
    if cfg.temperature > 0:
        kw.update(temperature=cfg.temperature, top_k=cfg.top_k or None, top_p=cfg.top_p)
    if assistant is not None:
        kw["assistant_model"] = assistant
    times, n = [], 0
    for r in range(cfg.repeats):
        torch.manual_seed(cfg.seed + r)
        t0 = time.perf_counter()
        with torch.no_grad():
            out = model.generate(ids, **kw)
        times.append(time.perf_counter() - t0)
        n = out.shape[1] - ids.shape[1]
    return [metrics.Sample(prompt.category, new_tokens=n, verifications=0, seconds=metrics.median(times))]


def runner_max_len(cfg, tokenizer, prompts: list[EvalPrompt], drafting: DraftingConfig) -> int:
    """KV slots: the longest conversation's template and user turns + every answer + one draft."""
    if cfg.max_len:
        return int(cfg.max_len)
    longest = max(len(render(tokenizer, p, [""] * (len(p.turns) - 1))) + len(p.turns) * cfg.max_new_tokens
                  for p in prompts)
    room = drafting.tree_budget if drafting.mode == "tree" else drafting.num_speculative_tokens
    return longest + room + 64


# --------------------------------------------------------------------------- the stage

def run(cfg) -> dict:
    """Evaluate `cfg.head` on `cfg.prompts`; returns the report (also written under cfg.out)."""
    from draftsmith.progress import progress

    from draftsmith.eval.target_runner import TargetRunner

    sampling, drafting = build_settings(cfg)
    head_path = None if str(cfg.head) in ("ngram", "none") else cfg.head
    out = mf.prepare_output(cfg.out, "eval", [("head", head_path), ("prompts.path", cfg.prompts.path),
                                              ("target", cfg.target.name)],
                            overwrite=bool(getattr(cfg, "overwrite", False)))  # before any decoding
    prompts = load_prompts(cfg.prompts)
    target = load_target(cfg.target)
    tok, eos = target.tokenizer, target.eos_token_ids
    max_len = runner_max_len(cfg, tok, prompts, drafting)
    drafter = load_drafter(cfg, target, max_len)
    if "hf_assisted" in cfg.baselines and drafter.model is None:
        raise DraftsmithError("baselines=[hf_assisted] needs a draft-model head (an HF causal-LM folder).")
    runner = TargetRunner(target.model, max_len, target.aux_layer_ids)

    # method -> its proposer (built once; the decoder resets it for every prompt)
    methods: dict[str, object] = {TARGET_ONLY: None}
    if drafter.make is not None:
        methods[drafter.method] = drafter.make()
    if "ngram" in cfg.baselines and drafter.method != "ngram":
        from draftsmith.eval.proposers import make_proposer

        methods["ngram"] = make_proposer("ngram", target, **ngram_kwargs(cfg))

    def decode(proposer, prompt):
        return decode_conversation(runner, proposer, tok, prompt, cfg.max_new_tokens, sampling, drafting, eos,
                                   cfg.seed)

    t0 = time.perf_counter()
    for prompt in prompts[: cfg.warmup_prompts]:  # warm-up: every code path once, nothing recorded
        for proposer in methods.values():
            decode(proposer, EvalPrompt(prompt.id, prompt.category, prompt.turns[:1], prompt.system))

    samples: dict[str, list[metrics.Sample]] = {m: [] for m in methods}
    hf_samples: dict[str, list[metrics.Sample]] = {b: [] for b in cfg.baselines if b.startswith("hf_")}
    for prompt in progress(prompts, desc=f"eval {drafter.method}", unit="prompt", enabled=cfg.progress):
        runs = {m: [] for m in methods}
        for _ in range(cfg.repeats):  # methods interleaved, so drift in machine speed hits all alike
            for m, proposer in methods.items():
                runs[m].append(decode(proposer, prompt))
        for m in methods:
            for turn in range(len(prompt.turns)):
                s = to_sample(prompt.category, [rep[turn] for rep in runs[m]])
                if sampling.greedy and m != TARGET_ONLY:
                    s.identical = runs[m][0][turn].tokens == runs[TARGET_ONLY][0][turn].tokens
                samples[m].append(s)
        if "hf_generate" in hf_samples:
            hf_samples["hf_generate"] += hf_generate_sample(target.model, tok, prompt, cfg, eos)
        if "hf_assisted" in hf_samples:
            hf_samples["hf_assisted"] += hf_generate_sample(target.model, tok, prompt, cfg, eos, drafter.model)

    main = drafter.method if drafter.make is not None else TARGET_ONLY
    report = build_report(cfg, target, drafter, prompts, samples, hf_samples, main, sampling, drafting)
    report["wall_s"] = round(time.perf_counter() - t0, 2)
    mf.claim_output(out, "eval")
    mf.atomic_write_bytes(out / "config.yaml", OmegaConf.to_yaml(cfg).encode())
    report["files"] = write_report(out, report, plot=cfg.plot)
    mf.write_manifest(out, stage="eval", target=target.identity(),
                      counts={"prompts": len(prompts), "samples": report["n_samples"]},
                      complete=True, method=drafter.method, head=str(cfg.head))
    if cfg.progress:
        print(summary_lines(report))
    return report


def build_report(cfg, target: Target, drafter: Drafter, prompts, samples, hf_samples, main: str,
                 sampling: SamplingConfig, drafting: DraftingConfig) -> dict:
    """The report.json dict: settings, overall and per-category figures, baselines, environment."""
    base = samples[TARGET_ONLY]
    overall = metrics.compare(samples[main], base)
    base_tps = overall["target_only_tokens_per_s"]
    baselines = {}
    for m, ss in samples.items():
        if m not in (main, TARGET_ONLY):
            agg = metrics.aggregate(ss)
            baselines[m] = {"tau": agg["tau"], "tokens_per_s": agg["tokens_per_s"],
                            "speedup": metrics.speedup(agg["tokens_per_s"], base_tps),
                            "per_position_acceptance": agg["per_position_acceptance"]}
    for b, ss in hf_samples.items():
        agg = metrics.aggregate(ss)
        baselines[b] = {"tau": None, "tokens_per_s": agg["tokens_per_s"], "new_tokens": agg["new_tokens"],
                        "speedup": metrics.speedup(agg["tokens_per_s"], base_tps), "turns": "first turn only"}
    identical = [s.identical for s in samples[main] if s.identical is not None]
    return {
        "method": drafter.method,
        "head": str(cfg.head),
        "drafter": drafter.info,
        "target": target.identity(),
        "temperature": sampling.temperature,
        "top_k": sampling.top_k,
        "top_p": sampling.top_p,
        "drafting": {"mode": drafting.mode, "num_speculative_tokens": drafting.num_speculative_tokens,
                     "tree_top_k": drafting.tree_top_k, "tree_budget": drafting.tree_budget},
        "prompts": {"source": cfg.prompts.source, "path": cfg.prompts.path, "n": cfg.prompts.n,
                    "per_category": cfg.prompts.per_category, "multi_turn": cfg.prompts.multi_turn,
                    "seed": cfg.prompts.seed, "ids": [p.id for p in prompts]},
        "n_prompts": len(prompts),
        "n_samples": len(base),
        "max_new_tokens": cfg.max_new_tokens,
        "repeats": cfg.repeats,
        "warmup_prompts": cfg.warmup_prompts,
        "new_tokens": overall["new_tokens"],
        "tau": overall["tau"],
        "per_position_acceptance": overall["per_position_acceptance"],
        "accepted_per_position": overall["accepted_per_position"],
        "proposed_per_position": overall["proposed_per_position"],
        "target_only_tokens_per_s": base_tps,
        "speculative_tokens_per_s": overall["speculative_tokens_per_s"],
        "speedup": overall["speedup"],
        "greedy_identical_fraction": (sum(identical) / len(identical)) if identical else None,
        "per_category": metrics.by_category(samples[main], base),
        "baselines": baselines,
        "software": software_versions(),
        "hardware": hardware(cfg.target.device),
        "conventions": metrics.CONVENTIONS,
    }
