"""The eval stage: decode the same prompts target-only and speculatively, and report τ and speedup.

    draftsmith eval head=runs/head target=smollm2 prompts=question prompts.path=question.jsonl
    draftsmith eval head=ngram target=smollm2 prompts=question prompts.path=q.jsonl temperature=1 drafting.mode=tree

Both rows come from the same decoder code (`speculative_generate`; target-only = no proposer),
on the same prompts, after a warm-up; each prompt's time is the median of `repeats` runs. With a
multi-turn prompt each method answers turn 2 after its own turn-1 answer. Writes into `out/`:
report.json, report.md, report.png, config.yaml and manifest.json.

    run = prepare -> load_drafter -> method_proposers -> warm_up -> decode_all -> build_report -> write_outputs

A head folder is read by the method its config.json names (draftsmith.core.methods); `ngram`, `none` and `mtp`
(the MTP layer the target's own folder ships, read as that folder) are eval's own names. The CLI prints
`summary(report)`.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import torch
from omegaconf import OmegaConf
from transformers import PreTrainedModel

from ..core import DraftsmithError, machine
from ..core import artifacts as mf
from ..data_gen.target import KNOWN_TARGETS, Target, load_target, resolved_target
from ..core.engine import Engines
from . import cost, metrics
from .config import EvalConfig, build_settings
from .decoder import DraftingConfig, GenerationResult, Proposer, speculative_generate
from .engine_llamacpp import llamacpp_report
from .engine_vllm import engine_report, run_name, served_head, with_export_command
from .prompts import EvalPrompt, load_prompts, render
from .proposers.ngram import NGRAM_ENGINES, NgramFirstProposer, NgramProposer
from .report import hardware, software_versions, summary_lines, write_report
from .target_runner import TargetRunner, divergence
from ..heads.folders import weights_sha256
from ..core.methods import Method, method_for_folder, read_folder_config
from ..core.progress import progress
from ..core.sampling import SamplingConfig

TARGET_ONLY = "target_only"
BUILT_IN = ("ngram", "none")  # eval's own `head=` options, no trained drafter
# head=mtp: the MTP layer the target's own folder ships, untrained: that folder read by the mtp row, as
# head=<target folder> reads it. Like ngram and none, the name always means itself (vLLM's `"method": "mtp"` is a
# method, never a path): a folder named mtp is written head=./mtp.
TARGETS_OWN_MTP = "mtp"


# --------------------------------------------------------------------------- the drafter

@dataclass
class Drafter:
    """What `head=` named: a method name, how to build a fresh proposer, and what the report says of it."""

    method: str  # a method's name (draftsmith.core.methods: eagle3, draft_model, ...), ngram or none
    make: Optional[Callable[[], Proposer]]  # builds the proposer; None = target-only
    info: dict = field(default_factory=dict)
    model: Optional[torch.nn.Module] = None  # the loaded drafter (a transformers model can be hf_assisted's)
    engines: Engines = Engines(vllm=None)  # what vLLM and SGLang call it (its method's row; ngram's own)
    row: Optional[Method] = None  # its method's row (a head folder's); None for ngram and none


def head_folder(cfg) -> Optional[str]:
    """The folder `head=` reads: None for ngram and none, the target's own folder for mtp (checked to declare an MTP
    layer), else the head as given (load_drafter says what is wrong with it)."""
    head = str(cfg.head)
    if head in BUILT_IN:
        return None
    if head == TARGETS_OWN_MTP:
        return str(targets_own_mtp_folder(str(cfg.target.name)))
    return head


def targets_own_mtp_folder(target_name: str) -> Path:
    """head=mtp: the target's folder, when the mtp row reads it (a MiMo folder declaring num_nextn_predict_layers);
    one sentence otherwise, saying how to train one. Its MTP tensors are checked when the row loads them, as for
    head=<that folder>."""
    train = (f"train one with `draftsmith train method=mtp target.name={target_name} data=<data-gen folder> "
             f"out=runs/mtp`, then pass head=runs/mtp")
    folder = Path(target_name)
    if not (folder / "config.json").is_file():
        raise DraftsmithError(f"head=mtp reads the MTP layer in the target's own folder, but target.name="
                              f"{target_name} names no local folder with a config.json: pass target.name=<a local "
                              f"MiMo folder>, or {train}.")
    config = read_folder_config(folder)
    if not method_for_folder(folder, config).engines.in_target:  # the rows of a layer inside its target: mtp
        raise DraftsmithError(f"head=mtp: target.name={target_name} ships no MTP layer draftsmith reads (its "
                              f"config.json: architectures {config.get('architectures')}, num_nextn_predict_layers "
                              f"{config.get('num_nextn_predict_layers')}; draftsmith reads a MiMoForCausalLM's "
                              f"model.mtp_layers.*); {train}.")
    return folder


def find_head_folder(path: Path) -> Path:
    """The folder holding config.json: `path` itself, or `path/final` (what `draftsmith train` writes)."""
    for folder in (path, path / "final"):
        if (folder / "config.json").is_file():
            return folder
    raise DraftsmithError(f"head={str(path)!r} has no config.json (nor a final/ folder holding one); give an "
                          f"EAGLE-3 folder, a train out/ folder or an HF draft-model folder.")


def head_layers(head: Optional[str]):
    """The target layers the head's method reads (its row's `aux_layer_ids`); None for none, ngram or no folder
    (load_drafter then says what is wrong with it)."""
    if head is None or not Path(head).is_dir():
        return None
    try:
        folder = find_head_folder(Path(head))
        return method_for_folder(folder, read_folder_config(folder)).aux_layer_ids
    except DraftsmithError:
        return None


def check_head_target(folder: Path, config: dict, target: Target) -> None:
    """Refuse a head made for another target: its manifest's identity, else its config's vocab size.

    (A method's own size checks, such as an EAGLE-3 head's target hidden size, are in its `load`.)"""
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


def load_drafter(cfg, target: Target, max_len: int) -> Drafter:
    """Resolve `head=`: none | ngram | a folder (mtp: the target's own), loaded by the method its config.json names
    (draftsmith.core.methods)."""
    head = str(cfg.head)
    if head == "none":
        return Drafter("none", None, {"kind": "none"})
    if head == "ngram":
        return Drafter("ngram", lambda: ngram_proposer(cfg),
                       {"kind": "ngram", "ngram_min": cfg.ngram_min, "ngram_max": cfg.ngram_max,
                        "ngram_match": cfg.ngram_match}, engines=NGRAM_ENGINES)
    path = Path(head_folder(cfg) or head)  # head=mtp: the target's own folder
    if not path.is_dir():
        raise DraftsmithError(f"head={head!r} is neither `ngram`, `none`, `mtp` nor a folder.")
    folder = find_head_folder(path)
    config = read_folder_config(folder)
    entry = method_for_folder(folder, config)  # refuses a format that only another tool reads
    check_head_target(folder, config, target)
    model = entry.load(folder, target).eval()
    info = {"kind": entry.name, "path": str(folder), "architecture": (config.get("architectures") or [None])[0],
            "num_layers": config.get("num_hidden_layers"),
            "draft_vocab_size": config.get("draft_vocab_size") or config.get("vocab_size"),
            # publish matches the head it publishes by this
            "sha256": weights_sha256(folder) if (folder / "model.safetensors").is_file() else None}
    if entry.engines.in_target and folder.resolve() == Path(target.target_id).resolve():
        # head=mtp, or head=<the target folder>: the same drafter, named so in the report and the summary
        info["description"] = "the target's own MTP layer"
    return with_ngram_first(cfg, Drafter(entry.name, lambda: entry.proposer(model, target.vocab_size, max_len),
                                         info, model, entry.engines, entry))


def ngram_proposer(cfg) -> NgramProposer:
    return NgramProposer(cfg.ngram_max, cfg.ngram_min, cfg.ngram_match)


def with_ngram_first(cfg, drafter: Drafter) -> Drafter:
    """ngram_first=true: the head drafts only when the context has no n-gram match (method `ngram+<method>`)."""
    if not cfg.ngram_first:
        return drafter
    info = drafter.info | {"ngram_first": True, "ngram_min": cfg.ngram_min, "ngram_max": cfg.ngram_max}
    make = drafter.make
    assert make is not None  # a head folder's (EvalConfig refuses ngram_first with head=ngram or none)
    return Drafter(f"ngram+{drafter.method}", lambda: NgramFirstProposer(ngram_proposer(cfg), make()),
                   info, drafter.model, drafter.engines, drafter.row)  # served as its head


# --------------------------------------------------------------------------- decoding

def decode_conversation(runner, proposer: Optional[Proposer], tokenizer, prompt: EvalPrompt,
                        max_new_tokens: int, sampling: SamplingConfig, drafting: DraftingConfig,
                        eos: list[int], seed: int) -> list[GenerationResult]:
    """Answer every turn of a prompt, each after the method's own previous answers; one result per turn."""
    results: list[GenerationResult] = []
    answers: list[str] = []
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
        emitted_per_verification=list(r.emitted_per_verification),
        draft_seconds=metrics.median([x.draft_s for x in runs]), draft_sizes=list(r.draft_sizes),
        prefill_seconds=metrics.median([x.prefill_s for x in runs]),
        decode_seconds=metrics.median([x.decode_s for x in runs]),
        verify_seconds=metrics.median([x.verify_s for x in runs]),
        tokens=list(r.tokens), prompt_ids=list(r.prompt_ids))


def hf_generate_sample(model, tokenizer, prompt: EvalPrompt, cfg, eos: list[int],
                       assistant=None) -> list[metrics.Sample]:
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
    room = drafting.tree_budget if drafting.mode == "tree" else max([drafting.num_speculative_tokens, *cfg.sweep_k])
    return longest + room + 64


# --------------------------------------------------------------------------- the stage

@dataclass
class Setup:
    """What every step of a run reads: the config, the decoder's settings, out folder, prompts, target."""

    cfg: EvalConfig  # target.dtype=auto resolved
    sampling: SamplingConfig
    drafting: DraftingConfig
    out: Path
    prompts: list[EvalPrompt]
    target: Target
    runner: TargetRunner  # the target with its static KV cache, shared by every method
    sweep: dict[str, DraftingConfig] = field(default_factory=dict)  # K-sweep rows: name -> their drafting
    dtype_why: str = ""  # why the target runs in its dtype (draftsmith.core.machine: target.dtype=auto's choice)

    def decode(self, proposer: Optional[Proposer], prompt: EvalPrompt, method: str = "") -> list[GenerationResult]:
        drafting = self.sweep.get(method, self.drafting)
        return decode_conversation(self.runner, proposer, self.target.tokenizer, prompt, self.cfg.max_new_tokens,
                                   self.sampling, drafting, self.target.eos_token_ids, self.cfg.seed)


def run(cfg: EvalConfig) -> dict:
    """Evaluate `cfg.head` on `cfg.prompts`; returns the report (also written under cfg.out). `cfg` is the checked,
    typed tree (draftsmith.configs.check_config: the CLI checks it once, a caller in code calls it first)."""
    setup = prepare(cfg)
    cfg = setup.cfg  # target.dtype=auto resolved
    drafter = load_drafter(cfg, setup.target, setup.runner.max_len)
    proposers = method_proposers(cfg, drafter)
    add_sweep(setup, drafter, proposers)
    t0 = time.perf_counter()
    warm_up(setup, proposers)
    samples, hf_samples = decode_all(setup, proposers, drafter)
    report = build_report(setup, drafter, samples, hf_samples)
    report.update(cost_report(setup, drafter, samples, report))
    if cfg.engine == "vllm":  # the same prompts inside vLLM, its figures beside ours
        engine_warning = drafter.row.engine_warning if drafter.row else None  # the method's own hook
        report.update(engine_report(setup, drafter, samples, report, _hub_id(setup.target.target_id), engine_warning))
    elif cfg.engine == "llamacpp":  # the same prompts in llama-server
        write_gguf = drafter.row.formats.get("gguf") if drafter.row else None
        report.update(llamacpp_report(setup, drafter, samples, report, write_gguf))
    report["wall_s"] = round(time.perf_counter() - t0, 2)
    write_outputs(setup, drafter, report)
    return report


def summary(report: dict) -> str:
    """The lines the CLI prints after `run` (stages return data; only the CLI prints)."""
    return summary_lines(report)


def prepare(cfg: EvalConfig) -> Setup:
    """Check the settings and `out` (before any work), read the prompts, load the target and its runner."""
    sampling, drafting = build_settings(cfg)
    head_path = head_folder(cfg)  # head=mtp: the target's own folder, checked before any work
    out = mf.prepare_output(cfg.out, "eval", [("head", head_path), ("prompts.path", cfg.prompts.path),
                                              ("target", cfg.target.name)],
                            overwrite=cfg.overwrite)
    prompts = load_prompts(cfg.prompts)
    target_cfg, dtype_why = resolved_target(cfg.target)  # dtype=auto -> this machine's choice (saved in config.yaml)
    cfg = dataclasses.replace(cfg, target=target_cfg)
    target = load_target(cfg.target, layers=head_layers(head_path))  # the features the head reads
    max_len = runner_max_len(cfg, target.tokenizer, prompts, drafting)
    runner = TargetRunner(target.model, max_len, target.aux_layer_ids,
                          cuda_graph=cfg.cuda_graph)
    return Setup(cfg, sampling, drafting, out, prompts, target, runner, dtype_why=dtype_why)


def method_proposers(cfg, drafter: Drafter) -> dict[str, Optional[Proposer]]:
    """method -> its proposer, built once (the decoder resets it for every prompt); target-only is None."""
    if "hf_assisted" in cfg.baselines and not isinstance(drafter.model, PreTrainedModel):
        raise DraftsmithError("baselines=[hf_assisted] needs a head that transformers can assist with (an HF "
                              "causal-LM folder).")
    proposers: dict[str, Optional[Proposer]] = {TARGET_ONLY: None}
    if drafter.make is not None:
        proposers[drafter.method] = drafter.make()
    if "ngram" in cfg.baselines and drafter.method != "ngram":
        proposers["ngram"] = ngram_proposer(cfg)
    if "ngram+head" in cfg.baselines and drafter.make is not None:  # the head after n-gram lookup (ngram_first's)
        proposers[f"ngram+{drafter.method}"] = NgramFirstProposer(ngram_proposer(cfg), drafter.make())
    return proposers


def add_sweep(setup: Setup, drafter: Drafter, proposers: dict[str, Optional[Proposer]]) -> None:
    """sweep_k: the head's proposer once more per extra K (the same instance: it is reset for every decode)."""
    if drafter.make is None:
        return
    d = setup.drafting
    for num_speculative_tokens in dict.fromkeys(getattr(setup.cfg, "sweep_k", [])):
        if num_speculative_tokens != d.num_speculative_tokens:
            name = run_name(drafter.method, num_speculative_tokens, d.num_speculative_tokens)
            setup.sweep[name] = dataclasses.replace(d, num_speculative_tokens=num_speculative_tokens)
            proposers[name] = proposers[drafter.method]


def warm_up(setup: Setup, proposers: dict[str, Optional[Proposer]]) -> None:
    """Every code path once, nothing recorded: the first turn of the first `warmup_prompts` prompts."""
    for prompt in setup.prompts[: setup.cfg.warmup_prompts]:
        for m, proposer in proposers.items():
            setup.decode(proposer, EvalPrompt(prompt.id, prompt.category, prompt.turns[:1], prompt.system), m)


def decode_all(setup: Setup, proposers: dict[str, Optional[Proposer]], drafter: Drafter
               ) -> tuple[dict[str, list[metrics.Sample]], dict[str, list[metrics.Sample]]]:
    """Every prompt by every method, `repeats` times; (method -> samples, hf baseline -> samples)."""
    cfg, model, tok, eos = setup.cfg, setup.target.model, setup.target.tokenizer, setup.target.eos_token_ids
    samples: dict[str, list[metrics.Sample]] = {m: [] for m in proposers}
    hf_samples: dict[str, list[metrics.Sample]] = {b: [] for b in cfg.baselines if b.startswith("hf_")}
    for prompt in progress(setup.prompts, desc=f"eval {drafter.method}", unit="prompt", enabled=cfg.progress):
        runs: dict[str, list[list[GenerationResult]]] = {m: [] for m in proposers}
        for _ in range(cfg.repeats):  # methods interleaved, so drift in machine speed hits all alike
            for m, proposer in proposers.items():
                runs[m].append(setup.decode(proposer, prompt, m))
        for m in proposers:
            for turn in range(len(prompt.turns)):
                s = to_sample(prompt.category, [rep[turn] for rep in runs[m]])
                if setup.sampling.greedy and m != TARGET_ONLY:
                    s.identical = runs[m][0][turn].tokens == runs[TARGET_ONLY][0][turn].tokens
                    if not s.identical:
                        ref, other = runs[TARGET_ONLY][0][turn], runs[m][0][turn]
                        s.divergence = {"prompt": prompt.id, "turn": turn,
                                        **divergence(setup.runner, ref.prompt_ids, ref.tokens, other.tokens)}
                samples[m].append(s)
        if "hf_generate" in hf_samples:
            hf_samples["hf_generate"] += hf_generate_sample(model, tok, prompt, cfg, eos)
        if "hf_assisted" in hf_samples:
            hf_samples["hf_assisted"] += hf_generate_sample(model, tok, prompt, cfg, eos, drafter.model)
    return samples, hf_samples


def cost_report(setup: Setup, drafter: Drafter, samples: dict[str, list[metrics.Sample]], report: dict) -> dict:
    """The report's cost model, K sweep, recommendation and near-tie figures (eval/cost.py)."""
    cfg, d = setup.cfg, setup.drafting
    out: dict = {"near_tie_eps": cfg.near_tie_eps}
    main = drafter.method if drafter.make is not None else TARGET_ONLY
    if setup.sampling.greedy and main != TARGET_ONLY:
        out["greedy_identical_up_to_near_ties_fraction"] = metrics.identical_up_to_near_ties(samples[main],
                                                                                            cfg.near_tie_eps)
        out["divergences"] = [s.divergence for s in samples[main] if s.divergence is not None]
    if main == TARGET_ONLY:
        return out
    base = samples[TARGET_ONLY]
    runs = {d.num_speculative_tokens: samples[main]}
    runs.update({drafting.num_speculative_tokens: samples[name] for name, drafting in setup.sweep.items()})
    rows = []
    for num_speculative_tokens, ss in sorted(runs.items()):
        cmp = metrics.compare(ss, base)
        n_ver = sum(s.verifications for s in ss)
        rows.append({"k": num_speculative_tokens, "tau": cmp["tau"], "speedup": cmp["speedup"],
                     "tokens_per_s": cmp["speculative_tokens_per_s"],
                     "per_position_acceptance": cmp["per_position_acceptance"],
                     "draft_s_per_verification": sum(s.draft_seconds for s in ss) / max(n_ver, 1),
                     "mean_draft_size": sum(sum(s.draft_sizes) for s in ss) / max(n_ver, 1)})
    longest = max(rows, key=lambda r: r["k"])
    acceptance = longest["per_position_acceptance"]
    tree = d.mode == "tree"
    sizes = list(range(1, max(runs) + 2))
    tree_sizes = sorted({int(round(r["mean_draft_size"])) + 1 for r in rows}) if tree else []
    # the typical cache length of a decode step: a prompt and half an answer
    context = int(metrics.median([len(render(setup.target.tokenizer, p, [])) for p in setup.prompts])
                  + metrics.median([s.new_tokens for s in base]) / 2)
    measured = cost.measure_target(setup.runner, context, sizes, cfg.cost_repeats, tree_sizes)
    assert drafter.make is not None  # main is the head's method (target-only returned above)
    one_forward = bool(getattr(drafter.make(), "one_forward", False))  # its cost per cycle, whatever K
    clock = cost.decode_clock(base, runs)  # the decode's own seconds: what the prediction is made of (eval/cost.py)
    table = cost.cost_table(measured, acceptance, rows, mode=d.mode, max_num_speculative_tokens=max(runs),
                            one_forward=one_forward, clock=clock)
    best = cost.best_measured(table)
    out["cost_model"] = {"target": measured, "acceptance_per_position": acceptance, "acceptance_from_k": longest["k"],
                         "decode_clock": clock, "table": table,
                         "formula": "speedup(K) = (P_target + N t_step) / (P_spec + N / tau(K) * (t_verify(K+1) + "
                                    "t_draft(K))), t_step and t_verify from the decode's own clock"}
    # what the target's dtype costs here, measured (not assumed): one verification of K+1 tokens, in decode steps
    # (the cost table's row at K: the decode's own clock, as the prediction reads it)
    num_speculative_tokens = d.num_speculative_tokens
    ratio = next((r["verify_over_step"] for r in table
                  if r["k"] == num_speculative_tokens and r["verify_tokens"] == num_speculative_tokens + 1), None)
    out["target_dtype_cost"] = {"dtype": str(setup.target.model.dtype).replace("torch.", ""),
                                "k": num_speculative_tokens, "verify_tokens": num_speculative_tokens + 1,
                                "verify_over_step": ratio}
    out["k_sweep"] = rows
    if best is not None:
        target_model = _hub_id(setup.target.target_id)
        served, export = served_head(drafter)
        settings = with_export_command(
            cost.serving_settings(drafter.method, drafter.engines, target_model, served, best["k"], d.mode,
                                  d.tree_top_k, d.tree_budget if tree else None, cfg.ngram_min, cfg.ngram_max,
                                  stop_below=d.stop_below), export)
        out["recommendation"] = {"k": best["k"], "mode": d.mode, "measured_speedup": best["measured_speedup"],
                                 "predicted_speedup": best["predicted_speedup"],
                                 "faster_than_target_only": best["measured_speedup"] > 1.0, **settings}
    return out


def _hub_id(target_id: str) -> str:
    """The target's Hub id for serving commands (the target presets' Hub ids), else its own id."""
    return KNOWN_TARGETS.get(target_id, (target_id,))[0]


def write_outputs(setup: Setup, drafter: Drafter, report: dict) -> None:
    """report.json / .md / .png, config.yaml and manifest.json into `out` (now claimed as eval's)."""
    out, cfg = setup.out, setup.cfg
    mf.claim_output(out, "eval")
    mf.atomic_write_bytes(out / "config.yaml", OmegaConf.to_yaml(cfg).encode())
    report["files"] = write_report(out, report, plot=cfg.plot)
    mf.write_manifest(out, stage="eval", target=setup.target.identity(),
                      counts={"prompts": len(setup.prompts), "samples": report["n_samples"]},
                      complete=True, method=drafter.method, head=str(cfg.head))


def baseline_rows(samples: dict[str, list[metrics.Sample]], hf_samples: dict[str, list[metrics.Sample]],
                  main: str, base_tps: float) -> dict[str, dict]:
    """The report's `baselines`: every other method of our decoder, then transformers' generate."""
    rows = {}
    for m, ss in samples.items():
        if m not in (main, TARGET_ONLY) and "@K=" not in m:
            agg = metrics.aggregate(ss)
            rows[m] = {"tau": agg["tau"], "tokens_per_s": agg["tokens_per_s"],
                       "speedup": metrics.speedup(agg["tokens_per_s"], base_tps),
                       "per_position_acceptance": agg["per_position_acceptance"],
                       "accepted_length_histogram": agg["accepted_length_histogram"]}
    for b, ss in hf_samples.items():
        agg = metrics.aggregate(ss)
        rows[b] = {"tau": None, "tokens_per_s": agg["tokens_per_s"], "new_tokens": agg["new_tokens"],
                   "speedup": metrics.speedup(agg["tokens_per_s"], base_tps), "turns": "first turn only"}
    return rows


def build_report(setup: Setup, drafter: Drafter, samples: dict[str, list[metrics.Sample]],
                 hf_samples: dict[str, list[metrics.Sample]]) -> dict:
    """The report.json dict: settings, overall and per-category figures, baselines, environment."""
    cfg, sampling, drafting = setup.cfg, setup.sampling, setup.drafting
    main = drafter.method if drafter.make is not None else TARGET_ONLY
    base = samples[TARGET_ONLY]
    overall = metrics.compare(samples[main], base)
    identical = [s.identical for s in samples[main] if s.identical is not None]
    return {
        "method": drafter.method,
        "head": str(cfg.head),
        "drafter": drafter.info,
        "target": setup.target.identity(),
        "temperature": sampling.temperature,
        "top_k": sampling.top_k,
        "top_p": sampling.top_p,
        "drafting": {"mode": drafting.mode, "num_speculative_tokens": drafting.num_speculative_tokens,
                     "tree_top_k": drafting.tree_top_k, "tree_budget": drafting.tree_budget,
                     "stop_below": drafting.stop_below},
        "sweep_k": sorted({drafting.num_speculative_tokens, *cfg.sweep_k}),
        "prompts": {"source": cfg.prompts.source, "path": cfg.prompts.path, "n": cfg.prompts.n,
                    "per_category": cfg.prompts.per_category, "multi_turn": cfg.prompts.multi_turn,
                    "seed": cfg.prompts.seed, "ids": [p.id for p in setup.prompts]},
        "n_prompts": len(setup.prompts),
        "n_samples": len(base),
        "max_new_tokens": cfg.max_new_tokens,
        "repeats": cfg.repeats,
        "warmup_prompts": cfg.warmup_prompts,
        "new_tokens": overall["new_tokens"],
        "tau": overall["tau"],
        "per_position_acceptance": overall["per_position_acceptance"],
        "accepted_per_position": overall["accepted_per_position"],
        "proposed_per_position": overall["proposed_per_position"],
        "accepted_length_histogram": overall["accepted_length_histogram"],
        "target_only_tokens_per_s": overall["target_only_tokens_per_s"],
        "speculative_tokens_per_s": overall["speculative_tokens_per_s"],
        "speedup": overall["speedup"],
        "greedy_identical_fraction": (sum(identical) / len(identical)) if identical else None,
        "target_dtype": str(setup.target.model.dtype).replace("torch.", ""),
        "target_dtype_why": setup.dtype_why,
        "cuda_graph": setup.runner.cuda_graph,
        "per_category": metrics.by_category(samples[main], base),
        "baselines": baseline_rows(samples, hf_samples, main, overall["target_only_tokens_per_s"]),
        "software": software_versions(),
        "hardware": hardware(cfg.target.device),
        "machine": machine.machine_info(cfg.target.device),
        "conventions": metrics.CONVENTIONS,
    }
