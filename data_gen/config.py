"""Configs of the data-generation stage (registered with Hydra in draftsmith.configs)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from draftsmith.data_gen.target import TargetConfig


@dataclass
class PromptsConfig:
    # self | sharegpt | openai | question | hf  (question = Spec-Bench / MT-bench `turns` JSONL;
    # hf = a `datasets` dataset saved to disk or named by hub id)
    source: str = "self"
    path: Optional[str] = None
    split: str = "train"
    # Most prompts to use (self: how many the target writes). None = all.
    n: Optional[int] = 64
    seed: int = 0
    # self-written prompts: sampling of the user turn
    temperature: float = 1.0
    top_p: float = 0.95
    max_prompt_tokens: int = 64
    # self: a system message to render before the user header (None = the template's default)
    system: Optional[str] = None
    # self: give up after this many sampled prompts (None = 8 * n)
    max_attempts: Optional[int] = None


@dataclass
class BackendConfig:
    kind: str = "hf"  # hf (batched, built in) | openai (any OpenAI-compatible server: vllm serve, SGLang)
    batch_size: int = 16
    url: str = "http://127.0.0.1:8000/v1"
    model: Optional[str] = None  # served model name for the openai backend
    concurrency: int = 8
    timeout_s: float = 600.0
    # hf: drop finished rows from the batch (and its KV cache) as they end
    prune_finished: bool = True


@dataclass
class DataGenConfig:
    target: TargetConfig = field(default_factory=TargetConfig)
    prompts: PromptsConfig = field(default_factory=PromptsConfig)
    backend: BackendConfig = field(default_factory=BackendConfig)
    out: str = "runs/data"
    seed: int = 0
    # Regeneration of every assistant turn by the target.
    regenerate: bool = True
    temperature: float = 0.0
    top_p: float = 1.0
    max_new_tokens: int = 256
    # Tokenization with assistant-only loss masks.
    max_length: int = 2048
    on_overflow: str = "truncate"  # truncate | drop
    reasoning: str = "keep"  # keep | strip  (<think>...</think> blocks in assistant turns)
    # Offline mode: capture the target's hidden states beside the tokenized set.
    hidden_states: bool = False
    hidden_states_dtype: str = "bfloat16"
    samples_per_shard: int = 256
    capture_batch_size: int = 8
