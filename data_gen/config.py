"""Configs of the data-generation stage (registered with Hydra in draftsmith.configs)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional
from urllib.parse import urlsplit

from ..core import DraftsmithError, checks
from .target import DTYPES, TargetConfig
from ..core.sampling import SamplingConfig

PROMPT_SOURCES = ("self", "sharegpt", "openai", "question", "hf")


# Openers that steer a self-written prompt toward a task kind: the target continues the user turn
# after one of them (the opener stays part of the prompt). `general` is the bare header (Magpie).
# The kinds follow what users send (Spec-Bench's categories: coding, extraction, math, reasoning,
# summarization, translation, roleplay, writing, stem / humanities / qa).
TASK_OPENERS = {
    "code": ["Write a Python function that", "How do I", "Fix the bug in this code:\n\n```python\n",
             "Explain what this code does:\n\n```", "Write a SQL query that", "In JavaScript, how can I"],
    "extraction": ["Extract all the names and dates from the following text:\n\n",
                   "List the key facts in this paragraph:\n\n",
                   "From the text below, pull out every product and its price.\n\n",
                   "Identify the main entities mentioned in this passage:\n\n"],
    "math": ["Solve for x:", "What is", "A train travels", "Calculate the", "If a rectangle has",
             "Prove that", "How many ways"],
    "reasoning": ["If all", "Which of the following is true:", "Think step by step:", "A riddle:",
                  "What comes next in the sequence"],
    "summarisation": ["Summarize the following article in three sentences:\n\n",
                      "Give me a short summary of this text:\n\n", "TL;DR of the following:\n\n",
                      "Summarize this email:\n\n"],
    "translation": ["Translate into French:", "Translate the following sentence into Spanish:",
                    "How do you say this in German:", "Translate this text into English:\n\n"],
    "roleplay": ["Pretend you are", "Let's play a game. You are", "Act as", "Imagine you are a",
                 "You are a pirate captain."],
    "writing": ["Write a short story about", "Write an email to", "Write a poem about",
                "Write a blog post about", "Draft a cover letter for"],
    "knowledge": ["Why does", "What is the difference between", "Explain how", "Who was",
                  "What causes", "How does"],
    "general": [""],
}


@dataclass
class PromptSetConfig:
    """Which prompt set: what data-gen's `prompts` and eval's share (each stage extends it)."""

    # self | sharegpt | openai | question | hf  (question = Spec-Bench / MT-bench `turns` JSONL;
    # hf = a `datasets` dataset saved to disk or named by hub id)
    source: str = "self"
    path: Optional[str] = None  # the prompt file (JSONL), or the hf dataset folder or hub id
    # Most prompts to use (self: how many the target writes). None = all.
    n: Optional[int] = 64
    seed: int = 0  # sampling of the prompt set (and of self-written prompts)

    def __post_init__(self):
        checks.at_least("prompts.n", self.n, 1, null="all")


@dataclass
class PromptsConfig(PromptSetConfig):
    """data-gen's prompts: a prompt set, or the target writing its own (`self`)."""

    split: str = "train"  # hf: the dataset split
    # self-written prompts: sampling of the user turn
    temperature: float = 1.0  # self: sampling temperature of the user turn
    top_p: float = 0.95  # self: nucleus sampling of the user turn, in (0, 1]
    max_prompt_tokens: int = 64  # self: length cap of a written prompt, in tokens
    # self: a system message to render before the user header (None = the template's default)
    system: Optional[str] = None
    # self: give up after this many sampled prompts (None = 8 * n)
    max_attempts: Optional[int] = None
    # self: steer the written prompts across task kinds, round robin (TASK_OPENERS above:
    # code, extraction, math, reasoning, summarisation, translation, roleplay, writing, knowledge,
    # general); each prompt starts with an opener of its kind and the kind is its category
    kinds: Optional[list[str]] = None  # self: task kinds to steer the prompts across (None = unsteered)

    def __post_init__(self):
        super().__post_init__()
        checks.one_of("prompts.source", self.source, PROMPT_SOURCES)
        checks.at_least("prompts.temperature", self.temperature, 0)
        checks.in_range("prompts.top_p", self.top_p, 0, 1, low_open=True)
        checks.at_least("prompts.max_prompt_tokens", self.max_prompt_tokens, 1)
        checks.at_least("prompts.max_attempts", self.max_attempts, 1, null="8 * n")
        if self.kinds is not None:
            if not self.kinds:
                raise DraftsmithError("prompts.kinds=[] names no task kind; give some "
                                      f"({', '.join(TASK_OPENERS)}) or null for unsteered prompts.")
            for kind in self.kinds:
                checks.one_of("prompts.kinds", kind, TASK_OPENERS)

    def check_required(self):
        """Before a run (draftsmith.configs.check_config): every source but self reads prompts.path."""
        if self.source != "self" and self.path in (None, "", "???"):
            what = "<dataset folder or hub id>" if self.source == "hf" else "<file.jsonl>"
            raise DraftsmithError(f"prompts={self.source} needs a file: set prompts.path={what}.")


@dataclass
class BackendConfig:
    # hf (batched, built in) | openai (any OpenAI-compatible server: vllm serve, SGLang) | vllm (vLLM in-process,
    # in its venv: bash scripts/setup.sh --engine)
    kind: str = "hf"
    batch_size: int = 16  # hf: conversations decoded together (rows of the static KV cache); vllm: max_num_seqs
    url: str = "http://127.0.0.1:8000/v1"  # openai: the server's base URL
    model: Optional[str] = None  # served model name for the openai backend
    # openai: requests in flight, kept in flight across chunk boundaries (a vLLM or SGLang server batches hundreds)
    concurrency: int = 256
    timeout_s: float = 600.0  # openai: seconds per request try, connect to last byte (a total deadline)
    # openai: tries after the first for a request that met 429, 408, 5xx, a dropped connection or a timeout
    retries: int = 4
    backoff_s: float = 1.0  # openai: wait before the first retry; doubles per retry (half to all of it, jittered)
    backoff_max_s: float = 30.0  # openai: longest wait between tries, a server's Retry-After included
    # share of prompts that may still fail after their retries without failing the run (0: none is dropped silently; a rerun asks again)
    max_failed_share: float = 0.0
    # hf: a finished row takes the next waiting prompt at once (false: fixed batches wait for their longest answer)
    prune_finished: bool = True

    def __post_init__(self):
        checks.one_of("backend.kind", self.kind, ("hf", "openai", "vllm"))
        checks.at_least("backend.batch_size", self.batch_size, 1)
        checks.at_least("backend.concurrency", self.concurrency, 1)
        checks.positive("backend.timeout_s", self.timeout_s)
        checks.at_least("backend.retries", self.retries, 0)
        checks.at_least("backend.backoff_s", self.backoff_s, 0)
        checks.at_least("backend.backoff_max_s", self.backoff_max_s, self.backoff_s)
        checks.in_range("backend.max_failed_share", self.max_failed_share, 0, 1)
        url = urlsplit(str(self.url))  # refused here, not after every request has tried it
        if url.scheme not in ("http", "https") or not url.netloc:
            raise DraftsmithError(f"backend.url={self.url} is not an http:// or https:// URL; write the OpenAI-compatible "
                                  f"server's base URL, e.g. backend.url=http://127.0.0.1:8000/v1.")


@dataclass
class FiltersConfig:
    """Quality filters (data_gen/filters.py): a self-written prompt that fails is resampled, a sample
    whose regenerated answer fails is dropped; the manifest counts what each filter dropped."""

    prompts: bool = False  # filter the self-written prompts (prompts=self)
    answers: bool = False  # drop samples whose regenerated answer fails the length, repetition or language filter
    near_dup: Optional[float] = 0.7  # prompts: word 3-gram Jaccard at which a prompt is a near duplicate; null = exact only
    drop_unfinished: bool = True  # prompts: drop a prompt cut off by prompts.max_prompt_tokens (a run-on)
    min_words: int = 3  # prompts: fewest words
    max_words: Optional[int] = None  # prompts: most words (None = no bound beyond max_prompt_tokens)
    min_answer_words: int = 1  # answers: fewest words
    max_repetition: Optional[float] = 0.5  # share of repeated word n-grams above which text is dropped; null = off
    repetition_n: int = 3  # the n of the repetition filter's word n-grams
    language: Optional[str] = "en"  # en: mostly Latin letters and English function words; null = no language check
    min_latin: float = 0.9  # language=en: least share of letters that are Latin
    min_stopwords: float = 0.15  # language=en: least share of English function words (texts of 8+ words)

    def __post_init__(self):
        if self.near_dup is not None:
            checks.in_range("filters.near_dup", self.near_dup, 0, 1, low_open=True, note=" (or null for exact only)")
        checks.at_least("filters.min_words", self.min_words, 0)
        checks.at_least("filters.max_words", self.max_words, max(self.min_words, 1), null="no bound")
        checks.at_least("filters.min_answer_words", self.min_answer_words, 0)
        if self.max_repetition is not None:
            checks.in_range("filters.max_repetition", self.max_repetition, 0, 1, high_open=True,
                            note=" (or null for off)")
        checks.at_least("filters.repetition_n", self.repetition_n, 1)
        if self.language is not None:
            checks.one_of("filters.language", self.language, ("en",))
        checks.in_range("filters.min_latin", self.min_latin, 0, 1)
        checks.in_range("filters.min_stopwords", self.min_stopwords, 0, 1)


@dataclass
class DataGenConfig:
    target: TargetConfig = field(default_factory=TargetConfig)
    prompts: PromptsConfig = field(default_factory=PromptsConfig)
    backend: BackendConfig = field(default_factory=BackendConfig)
    filters: FiltersConfig = field(default_factory=FiltersConfig)  # quality filters (filters.prompts / filters.answers)
    out: str = "runs/data"  # output folder
    overwrite: bool = False  # true: write into an out folder that is not an earlier data-gen output
    seed: int = 0  # sampling seed of the regeneration
    # Regeneration of every assistant turn by the target.
    regenerate: bool = True  # false: keep the prompt set's own assistant turns
    temperature: float = SamplingConfig.temperature  # of the regeneration; 0 = greedy
    top_p: float = SamplingConfig.top_p  # of the regeneration, in (0, 1]
    max_new_tokens: int = 256  # per regenerated assistant turn
    regenerate_chunk: int = 64  # prompts per saved regeneration part (a killed run resumes from the last one)
    # Tokenization with assistant-only loss masks.
    max_length: int = 2048  # tokens per sample
    on_overflow: str = "truncate"  # truncate | drop
    reasoning: str = "keep"  # keep | strip  (<think>...</think> blocks in assistant turns)
    # Offline mode: capture the target's hidden states beside the tokenized set.
    hidden_states: bool = False  # true: also capture the target's hidden states (offline training)
    hidden_states_dtype: str = "bfloat16"  # storage dtype of the captured hidden states
    # the method that trains on them: the target layers it asks for are captured (target.aux_layer_ids overrides);
    # null: the default layers (draftsmith.core.layers: 2, N//2, N-3, what EAGLE-3, P-EAGLE and DFlash read)
    hidden_states_for: Optional[str] = None
    hidden_states_source: str = "hf"  # where they come from (data_gen/capture.py FEATURE_SOURCES): the target here
    samples_per_shard: int = 256  # hidden states: samples per shard file
    capture_batch_size: int = 8  # hidden states: samples per target forward
    # Offline draft distillation (method=draft): the target's top-k log-probs per position (data_gen/topk.py).
    topk_logits: bool = False  # true: also write the top-k cache (8 * topk_k + 4 bytes per token)
    topk_k: int = 64  # tokens kept per position (the vocab size makes the divergences exact)
    topk_temperature: float = 1.0  # log-probs of softmax(logits / topk_temperature); training uses the same

    def __post_init__(self):
        checks.at_least("temperature", self.temperature, 0)
        checks.in_range("top_p", self.top_p, 0, 1, low_open=True)
        checks.at_least("max_new_tokens", self.max_new_tokens, 1)
        checks.at_least("max_length", self.max_length, 1)
        checks.one_of("on_overflow", self.on_overflow, ("truncate", "drop"))
        checks.one_of("reasoning", self.reasoning, ("keep", "strip"))
        checks.one_of("hidden_states_dtype", self.hidden_states_dtype, DTYPES)
        checks.at_least("samples_per_shard", self.samples_per_shard, 1)
        checks.at_least("capture_batch_size", self.capture_batch_size, 1)
        checks.at_least("topk_k", self.topk_k, 1)
        checks.positive("topk_temperature", self.topk_temperature)
        checks.at_least("regenerate_chunk", self.regenerate_chunk, 1)
