"""Config of the eval stage (registered with Hydra in draftsmith.configs as `eval_schema`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from ..core import DraftsmithError, checks, llamacpp
from ..data_gen.config import PromptSetConfig
from ..data_gen.target import TargetConfig
from .decoder import DraftingConfig
from .proposers.ngram import NGRAM_MATCHES
from ..core.sampling import SamplingConfig

# ngram+head: the head folder's drafts after n-gram lookup (`ngram+<method>`, as ngram_first=true measures it) beside
# the head alone
BASELINES = ("ngram", "ngram+head", "hf_generate", "hf_assisted")
# where the figures are measured: the built-in decoder, and beside it vLLM (eval/engine_vllm.py) or llama.cpp
# (eval/engine_llamacpp.py)
ENGINES = ("builtin", "vllm", "llamacpp")
LLAMACPP_TARGETS = ("same", "f32", "bf16")  # engine=llamacpp: the target's own GGUF, or its weights converted


@dataclass
class EvalPromptsConfig(PromptSetConfig):
    """Which prompts to decode: a prompt set (data-gen's `prompts/*` options compose here) plus eval's own keys.

    Sampling is the decoder's (temperature, top_k, top_p at the top level), not the prompt set's."""

    source: str = "question"  # question | sharegpt | openai | holdout  (see draftsmith.eval.prompts)
    path: Optional[str] = None  # a JSONL file; for holdout, a data-gen output folder
    n: Optional[int] = 16  # sample size after per-category sampling (None = all)
    per_category: Optional[int] = None  # keep at most this many of each category
    categories: Optional[list[str]] = None  # keep only these categories
    multi_turn: bool = False  # decode every user turn, each after the decoder's own previous answers
    holdout: int = 16  # holdout: the last this-many conversations of the data-gen output

    def __post_init__(self):
        super().__post_init__()
        checks.at_least("prompts.per_category", self.per_category, 1, null="all")
        if self.source == "holdout":
            checks.at_least("prompts.holdout", self.holdout, 1)

    def check_required(self):
        if self.path in (None, "", "???"):
            raise DraftsmithError(f"prompts.source={self.source} needs prompts.path=<file or folder>.")


@dataclass
class EvalConfig:
    # target.dtype=auto: what this machine runs fastest (the report records why, and the cost model's measured
    # t_verify(K+1) / t_step in that dtype); float32 keeps greedy speculative output token-identical to target-only.
    target: TargetConfig = field(default_factory=TargetConfig)
    prompts: EvalPromptsConfig = field(default_factory=EvalPromptsConfig)
    # The drafter: a head folder (a train out/ folder, an exported one or an HF draft-model folder, read by the method
    # its config.json names), or one of eval's own names, which always mean themselves (a folder of that name is
    # written with its path, head=./mtp): `ngram` (prompt lookup), `none` (target-only decoding only), `mtp` (the MTP
    # layer the target's own folder ships, untrained: target.name a local MiMo folder; the same as head=<that folder>).
    head: str = "ngram"
    out: str = "runs/eval"  # output folder: report.json, report.md, plot
    overwrite: bool = False  # true: write into an out folder that is not an earlier eval output
    # Sampling (applied to both target and draft distributions; draftsmith.core.sampling).
    temperature: float = SamplingConfig.temperature  # 0 = greedy
    top_k: int = SamplingConfig.top_k  # 0 = off
    top_p: float = SamplingConfig.top_p  # nucleus sampling, in (0, 1]
    drafting: DraftingConfig = field(default_factory=DraftingConfig)
    # n-gram proposer (the `ngram` head and baseline): longest suffix match up to this length.
    ngram_max: int = 3  # n-gram proposer: longest suffix matched (eval/proposers/ngram.py NgramProposer)
    ngram_min: int = 1  # n-gram proposer: shortest suffix matched
    ngram_match: str = "latest"  # n-gram proposer: copy after the latest earlier match | earliest (vLLM's ngram)
    # n-gram + head: with a head folder, draft from a context match (ngram_max..ngram_min) when one exists and
    # from the head otherwise (eval/proposers/ngram.py NgramFirstProposer); the report's method is `ngram+<method>`.
    ngram_first: bool = False  # with a head folder: draft by n-gram match when the context has one, else by the head
    max_new_tokens: int = 128  # per decoded turn
    # Timing: every prompt is decoded `repeats` times by each method; its time is the median.
    repeats: int = 3  # timing: decodes of every prompt by each method (the median counts)
    warmup_prompts: int = 1  # decoded first by every method, excluded from every figure
    seed: int = 0  # prompt sampling and decoding
    # Extra rows: ngram (our decoder with the n-gram proposer), ngram+head (the head after n-gram lookup, as
    # ngram_first=true decodes it), hf_generate (transformers' target-only generate), hf_assisted (transformers'
    # generate(assistant_model=...) for draft models).
    baselines: list[str] = field(default_factory=list)
    # KV-cache slots of the target runner; None = longest prompt + turns * max_new_tokens + draft room.
    max_len: Optional[int] = None
    # The K sweep: the head is also decoded at each of these draft lengths (chain length / tree depth), and the
    # report's cost table, recommendation and plot compare them; [] = drafting.num_speculative_tokens only.
    sweep_k: list[int] = field(default_factory=list)  # extra K to decode the head with, e.g. [1,2,3,5,7]
    cost_repeats: int = 5  # cost model: timed target passes per verify size (the median counts)
    # Greedy output checks: a divergence from target-only decoding whose target top-2 logit margin is below this
    # counts as a near-tie (bf16 numerics that depend on the pass's shape, not a decoder error).
    near_tie_eps: float = 0.25  # logits: top-2 margin below which a greedy divergence is a near-tie
    cuda_graph: bool = True  # on CUDA: replay each target pass of up to 65 tokens from a CUDA graph (no-op on CPU)
    progress: bool = True  # show a progress bar
    plot: bool = True  # write the acceptance / speedup plot
    # builtin: draftsmith's decoder only; vllm: also decode the same prompts in vLLM (its venv: bash scripts/setup.sh
    # --engine) and report its tau, acceptance, tokens/s, speedup and best K beside the built-in decoder's
    engine: str = "builtin"  # builtin | vllm | llamacpp (the same prompts measured in that engine too, greedy, chains)
    # engine=llamacpp: the target llama-server loads. same: its own GGUF (e.g. the embedded Q4_1 file; llama.cpp
    # computes with the quantised blocks); f32 | bf16: the weights draftsmith computes with, converted
    llamacpp_target: str = "same"
    # engine=llamacpp: the head's GGUF weight types measured side by side on the same prompts, each written as export's
    # gguf_outtype=<t> (llama.cpp's --outtype): f32 | f16 | bf16 | q8_0, e.g. [f32,f16,bf16,q8_0]; one type (the
    # default: export's) keeps the runs' names free of it. The τ agreement with the built-in decoder is a check only
    # at the converted target's own type (f32 | bf16)
    gguf_outtypes: list[str] = field(default_factory=lambda: [llamacpp.OUTTYPE])

    def __post_init__(self):
        if not self.head:
            raise DraftsmithError("head is empty: pass head=<EAGLE-3 folder | draft-model folder | ngram | mtp | "
                                  "none>.")
        check_options(self)
        checks.at_least("max_len", self.max_len, 1, null="as long as needed")
        for num_speculative_tokens in self.sweep_k:
            checks.in_range("sweep_k", num_speculative_tokens, 1, 64)
        checks.at_least("cost_repeats", self.cost_repeats, 1)
        checks.at_least("near_tie_eps", self.near_tie_eps, 0)
        checks.one_of("engine", self.engine, ENGINES)
        checks.one_of("llamacpp_target", self.llamacpp_target, LLAMACPP_TARGETS)
        check_gguf_outtypes(self.gguf_outtypes)
        checks.one_of("ngram_match", self.ngram_match, NGRAM_MATCHES)
        check_engine_options(self)
        if self.ngram_first and self.head in ("ngram", "none"):
            raise DraftsmithError(f"ngram_first=true needs a head folder to fall back on, not head={self.head}.")
        if "ngram+head" in self.baselines and (self.ngram_first or self.head in ("ngram", "none")):
            raise DraftsmithError(f"baselines has 'ngram+head' (the head after n-gram lookup, beside the head alone): it "
                                  f"needs a head folder and ngram_first=false, not head={self.head} "
                                  f"ngram_first={str(self.ngram_first).lower()}.")


def check_options(cfg) -> None:
    """Range checks of the decoding options (EvalConfig runs them when built; so does build_settings)."""
    if cfg.max_new_tokens < 1:
        raise DraftsmithError(f"max_new_tokens={cfg.max_new_tokens} must be at least 1.")
    if cfg.repeats < 1:
        raise DraftsmithError(f"repeats={cfg.repeats} must be at least 1.")
    if cfg.warmup_prompts < 0:
        raise DraftsmithError(f"warmup_prompts={cfg.warmup_prompts} must be >= 0.")
    if not 1 <= cfg.ngram_min <= cfg.ngram_max:
        raise DraftsmithError(f"ngram_min={cfg.ngram_min} and ngram_max={cfg.ngram_max} need 1 <= ngram_min <= ngram_max.")
    for b in cfg.baselines:
        if b not in BASELINES:
            raise DraftsmithError(f"baselines has {b!r}; choose from {', '.join(BASELINES)}.")
    SamplingConfig(cfg.temperature, cfg.top_k, cfg.top_p)  # checks its own ranges


def check_gguf_outtypes(outtypes: list[str]) -> None:
    """engine=llamacpp's head GGUF types: at least one, each one of llama.cpp's OUTTYPES, each once (a run per type)."""
    choices = ", ".join(llamacpp.OUTTYPES)
    if not outtypes:
        raise DraftsmithError(f"gguf_outtypes is empty: name at least one of {choices}.")
    for outtype in outtypes:
        if outtype not in llamacpp.OUTTYPES:
            raise DraftsmithError(f"gguf_outtypes has {outtype!r}; choose from {choices}.")
        if outtypes.count(outtype) > 1:
            raise DraftsmithError(f"gguf_outtypes has {outtype!r} twice; each type is measured once.")


def check_engine_options(cfg) -> None:
    """engine=vllm and engine=llamacpp measure greedy chain drafting (vLLM's with a fixed K; llama.cpp's stops where
    drafting.stop_below says, its --spec-draft-p-min); one sentence otherwise."""
    engine = cfg.engine
    if engine == "builtin":
        return
    if cfg.temperature != 0:
        raise DraftsmithError(f"engine={engine} measures greedy decoding: set temperature=0 (not {cfg.temperature}).")
    if cfg.drafting.mode != "chain":
        raise DraftsmithError(f"engine={engine} drafts chains (the engines' EAGLE and draft-model drafting): set "
                              "drafting.mode=chain.")
    if cfg.drafting.stop_below and engine == "vllm":  # llama.cpp has the same rule: --spec-draft-p-min
        raise DraftsmithError("engine=vllm drafts a fixed K (it has no dynamic draft length): set "
                              "drafting.stop_below=0.")
    if cfg.ngram_first and engine == "vllm":  # llama.cpp mixes them (its ngram+<method> run)
        raise DraftsmithError("engine=vllm: vLLM has no n-gram-first mode for a head; set ngram_first=false.")


def build_settings(cfg) -> tuple[SamplingConfig, DraftingConfig]:
    """Check the options and build the decoder's settings; out-of-range values raise one sentence. `cfg` is the
    checked EvalConfig, whose `drafting` is the decoder's DraftingConfig already (its ranges checked when built)."""
    check_options(cfg)
    sampling = SamplingConfig(cfg.temperature, cfg.top_k, cfg.top_p)  # checks its own ranges
    return sampling, cfg.drafting  # the typed node check_config built (it checked its ranges then)
