"""Regeneration: every assistant turn is rewritten by the target, conditioned on its own history.

Multi-turn conversations are regenerated round by round: round r prompts every conversation
with the target's own answers to rounds < r plus the r-th user segment, so turn 2's prompt
holds the target's answer to turn 1.

Backends (looked up in BACKENDS):
  hf      built in: draftsmith.data_gen.batching's continuous batching (a static KV cache whose
          rows, as their answers end, are refilled with waiting prompts).
  openai  any OpenAI-compatible server (`vllm serve`, SGLang): POST /v1/chat/completions with
          bounded concurrency.
A backend's `chat(conversations, seeds, done=None)` returns one answer per conversation (None:
failed) and calls `done(j)` as answer j is ready, for progress.

Sampling (draftsmith.sampling: the rule eval's decoder uses too) is reproducible per sample: each
conversation turn draws from its own generator, seeded from (seed, sample id, turn), so the same
sample gets the same answer whatever batch or rank it lands in.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass

from draftsmith import DraftsmithError
from draftsmith.data_gen.batching import generate_tokens
from draftsmith.data_gen.config import BackendConfig
from draftsmith.sampling import SamplingConfig, hash_seed


@dataclass
class SamplingParams(SamplingConfig):
    """What a backend generates with: the sampling rule and the answer length."""

    max_new_tokens: int = 256


# --- backends: conversations in, assistant texts out ------------------------------------------

class HFBackend:
    """The built-in batched backend on the loaded target."""

    def __init__(self, target, cfg: BackendConfig, params: SamplingParams):
        self.target, self.cfg, self.params = target, cfg, params

    def chat(self, conversations: list[list[dict]], seeds: list[int], done=None) -> list[str | None]:
        """The answer to each conversation (None: failed); `done(j)` is called as answer j is ready."""
        tok = self.target.tokenizer
        prompts = [tok.apply_chat_template(c, tokenize=False, add_generation_prompt=True) for c in conversations]
        ids = [tok(p, add_special_tokens=False)["input_ids"] for p in prompts]
        outs = generate_tokens(self.target, ids, self.params, seeds, self.cfg.batch_size,
                               self.cfg.prune_finished, desc="regenerate", done=done)
        return [tok.decode(o, skip_special_tokens=True) for o, _ in outs]


class OpenAIBackend:
    """Any OpenAI-compatible server: one /chat/completions request per turn, `concurrency` in flight."""

    def __init__(self, target, cfg: BackendConfig, params: SamplingParams):
        import httpx

        self.cfg, self.params = cfg, params
        self.url = cfg.url.rstrip("/")
        self.client = httpx.Client(timeout=cfg.timeout_s)
        self.model = cfg.model or self._first_model()

    def _request(self, method: str, path: str, **kw):
        import httpx

        try:
            r = self.client.request(method, self.url + path, **kw)
        except (httpx.ConnectError, httpx.ConnectTimeout) as e:
            raise DraftsmithError(f"cannot reach the OpenAI-compatible server at {self.url} ({e}); "
                                  f"start it or set backend.url.") from None
        r.raise_for_status()
        return r.json()

    def _first_model(self) -> str:
        models = self._request("GET", "/models").get("data") or []
        if not models:
            raise DraftsmithError(f"the server at {self.url} lists no model; set backend.model.")
        return models[0]["id"]

    def _one(self, messages: list[dict], seed: int) -> str | None:
        import httpx

        body = {"model": self.model, "messages": messages, "max_tokens": self.params.max_new_tokens,
                "temperature": self.params.temperature, "top_p": self.params.top_p, "seed": seed % (1 << 31)}
        try:
            return self._request("POST", "/chat/completions", json=body)["choices"][0]["message"]["content"]
        except (httpx.HTTPError, KeyError, IndexError, TypeError, ValueError):
            return None  # counted as failed; the sample is left out

    def chat(self, conversations: list[list[dict]], seeds: list[int], done=None) -> list[str | None]:
        with ThreadPoolExecutor(max_workers=max(1, self.cfg.concurrency)) as pool:
            futures = {pool.submit(self._one, c, s): j for j, (c, s) in enumerate(zip(conversations, seeds))}
            for f in as_completed(futures):
                if done is not None:
                    done(futures[f])
            return [f.result() for f in futures]


BACKENDS = {"hf": HFBackend, "openai": OpenAIBackend}


def make_backend(target, cfg: BackendConfig, params: SamplingParams):
    if cfg.kind not in BACKENDS:
        raise DraftsmithError(f"backend.kind={cfg.kind!r} is not one of {', '.join(BACKENDS)}.")
    return BACKENDS[cfg.kind](target, cfg, params)


# --- conversations ------------------------------------------------------------------------------

def user_segments(messages: list[dict]) -> list[list[dict]]:
    """The messages each assistant turn answers, ending at a user turn: [sys,u1,a1,u2] -> [[sys,u1],[u2]].

    Source assistant turns are dropped (they are regenerated); consecutive user turns (MT-bench
    `turns`) each get their own answer.
    """
    segments, current = [], []
    for m in messages:
        if m["role"] == "assistant":
            continue
        current.append(m)
        if m["role"] == "user":
            segments.append(current)
            current = []
    return segments


def regenerate_all(samples: list[dict], backend, seed: int, bar=None) -> list[list[dict] | None]:
    """Every sample's regenerated messages, in order (None: a turn failed; []: no user turn, left out).

    `bar.update(1)` per finished sample, as answers come back.
    """
    segments = [user_segments(s["messages"]) for s in samples]
    history: list[list[dict] | None] = [[] for _ in samples]
    for turn in range(max((len(s) for s in segments), default=0)):
        live = [i for i, s in enumerate(segments) if turn < len(s) and history[i] is not None]
        convs = [history[i] + segments[i][turn] for i in live]
        seeds = [hash_seed(seed, samples[i]["id"], turn) for i in live]
        last = [turn == len(segments[i]) - 1 for i in live]
        done = None if bar is None else (lambda j: bar.update(1) if last[j] else None)
        answers = backend.chat(convs, seeds) if done is None else backend.chat(convs, seeds, done=done)
        for j, (i, conv, text) in enumerate(zip(live, convs, answers)):
            history[i] = None if text is None else conv + [{"role": "assistant", "content": text}]
            if text is None and bar is not None and not last[j]:
                bar.update(1)  # a failed sample is finished too
    if bar is not None and not all(segments):
        bar.update(sum(not s for s in segments))  # nothing to answer ([]: left out, not failed)
    return history


def regenerate(samples: list[dict], backend, seed: int) -> tuple[list[dict], int]:
    """Replace every assistant turn with the target's own answer; returns (samples, failed count)."""
    history = regenerate_all(samples, backend, seed)
    out = [{**s, "messages": h} for s, h in zip(samples, history) if h]
    return out, sum(h is None for h in history)
