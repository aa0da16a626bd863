"""What the tests share, in one module: plain functions and constants (fixtures live in conftest.py). A test module
imports from here, never from another test module (tests/test_tests.py checks it); tests/ is on sys.path under pytest.

The drafting methods' checks and builders (decoder, folders, the speculators outside check, training) take the
method's own values; the tiny targets, drafters, data and configs below are built in code, so every test runs
offline."""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import random
import shutil
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig, LlamaForCausalLM

from draftsmith.cli import main
from draftsmith.configs import compose
from draftsmith.core import engine
from draftsmith.core.methods import METHODS
from draftsmith.core.sampling import process_logits
from draftsmith.data_gen.target import TargetConfig, load_target
from draftsmith.eval import decoder
from draftsmith.eval import engine_vllm as ev_engine
from draftsmith.eval import run as ev
from draftsmith.eval.decoder import DraftingConfig, SamplingConfig, speculative_generate
from draftsmith.eval.proposers.draft import DraftModelProposer
from draftsmith.eval.proposers.eagle3 import Eagle3Proposer
from draftsmith.eval.proposers.ngram import NGRAM_ENGINES
from draftsmith.eval.proposers.peagle import PEagleProposer
from draftsmith.eval.target_runner import TargetRunner
from draftsmith.heads.eagle3 import Eagle3Head, eagle3_config_from_target
from draftsmith.heads.mtp import MTPDrafter
from draftsmith.heads.peagle import PEagleHead, peagle_config_from_target
from draftsmith.heads.vocab import build_vocab_map
from draftsmith.train import trainer
from draftsmith.train.eagle3 import ttt_hidden

# ---- building a drafter ----------------------------------------------------------------------------------


@torch.no_grad()
def randomize_weights(head, prefixes: tuple[str, ...]):
    """Every parameter whose name starts with one of `prefixes` random (vectors around 1, so swapped norms show)."""
    for name, p in head.named_parameters():
        if name.startswith(prefixes):
            p.copy_(torch.randn_like(p) * 0.3 + (1.0 if p.dim() == 1 else 0.0))
    return head


def init_randomly_from_target(head, target, draft_vocab: int, random_prefixes: tuple[str, ...]):
    """`head` initialised from a loaded target with a random draft vocabulary of `draft_vocab` tokens, then the
    weights under `random_prefixes` random."""
    from draftsmith.heads.vocab import build_vocab_map

    head.init_from_target(target.model, *build_vocab_map(torch.randint(0, 1000, (target.vocab_size,)), draft_vocab))
    return randomize_weights(head, random_prefixes)


def init_from_used_tokens(head, target, used):
    """`head` initialised from a bare HF target, its draft vocabulary the target tokens `used` (sorted)."""
    used = torch.as_tensor(used)
    t2d = torch.zeros(target.config.vocab_size, dtype=torch.bool)
    t2d[used] = True
    head.init_from_target(target, used - torch.arange(len(used)), t2d)
    return head


def ttt_unroll(head: Eagle3Head, input_ids: torch.Tensor, hidden: torch.Tensor, attention_mask: torch.Tensor,
               steps: int, **options):
    """Yield the draft logits (B, T, Vd) of each TTT step of train/eagle3.py; index t of step i drafts x_{t+2+i}
    (the training loss takes the logits of the positions that count only). options: ttt_hidden's."""
    for h in ttt_hidden(head, input_ids, hidden, attention_mask, steps, **options):
        yield head.lm_head(head.norm(h))


# ---- the attention masks the drafters are checked with ------------------------------------------------------

def causal_mask(T: int, device=None) -> torch.Tensor:
    """(1, 1, T, T) bool lower-triangular mask."""
    return torch.ones(T, T, dtype=torch.bool, device=device).tril()[None, None]


def ttt_mask(T: int, step: int, device=None) -> torch.Tensor:
    """Training-time-test mask for unroll step `step` over keys [step 0 | step 1 | ... | step `step`]: the reference
    train/eagle3.py's attention is checked against (it never builds this dense mask itself).

    Query t attends causally to step-0 keys (<= t) and, in each later step, only to its own
    index t (the same sequence slot, one position further on). Shape (1, 1, T, (step+1)*T).
    """
    eye = torch.eye(T, dtype=torch.bool, device=device)
    blocks = [torch.ones(T, T, dtype=torch.bool, device=device).tril()] + [eye] * step
    return torch.cat(blocks, dim=1)[None, None]


# ---- the built-in decoder: one forward per cycle, the slots it attends to, lossless -----------------------

CYCLE_PROMPT = [3, 1, 4, 1, 5, 9, 2, 6]


class RecordsForwards:
    """Mixin for a proposer with one `_forward(k)` per cycle: keeps, per cycle, the committed sequence and the k
    rows of draft logits of the one forward."""

    def __init__(self, *args):
        super().__init__(*args)
        self.rounds, self.forwards = [], 0

    def _forward(self, k):
        self.forwards += 1
        logits = super()._forward(k)
        self.rounds.append((list(self.seq), logits.clone()))
        return logits


def check_drafts_match_from_scratch(recording_cls, head, target, aux, sampling, from_scratch, k: int):
    """40 tokens at K=k with `recording_cls(head, V, 96)` (a `RecordsForwards` proposer) on a bare HF target of V
    tokens: one drafter forward per cycle, each drafting k rows equal (1e-9) to `from_scratch(head, target, seq, k)`
    on the committed sequence. Returns (the generation, the proposer)."""
    proposer = recording_cls(head, target.config.vocab_size, 96)
    g = torch.Generator().manual_seed(0)
    res = speculative_generate(TargetRunner(target, 96, aux), proposer, torch.tensor(CYCLE_PROMPT), 40, sampling,
                               DraftingConfig("chain", k), [], generator=g)
    assert len(res.tokens) == 40
    assert proposer.forwards == len(proposer.rounds) <= res.n_verifications  # one drafter forward per cycle
    for seq, logits in proposer.rounds:
        assert logits.shape[0] == k
        torch.testing.assert_close(logits, from_scratch(head, target, seq, k), rtol=1e-9, atol=1e-9)
    return res, proposer


def check_draft_forwards_attend_only_to_the_slots_in_use(monkeypatch, proposer, target, aux, extra_slots: int):
    """20 tokens at K=5 from a proposer with room for 4096: no attention call sees more keys than the prompt, the
    tokens, the K drafts and the method's `extra_slots`."""
    widths, sdpa = [], F.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, **kw):
        widths.append(k.shape[-2])
        return sdpa(q, k, v, attn_mask=attn_mask, **kw)

    prompt = torch.tensor(CYCLE_PROMPT)
    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    res = speculative_generate(TargetRunner(target, 64, aux), proposer, prompt, 20, SamplingConfig(),
                               DraftingConfig("chain", 5), [])
    assert len(res.tokens) == 20 and widths
    assert max(widths) <= len(prompt) + 20 + 5 + extra_slots


def check_greedy_is_token_identical_to_target_only(target, proposer, k: int):
    """Two random 12-token prompts: greedy speculative decoding at K=k emits target-only decoding's 30 tokens
    (`target` a loaded target)."""
    runner = TargetRunner(target.model, 256, target.aux_layer_ids)
    for seed in range(2):
        prompt = torch.randint(0, 256, (12,), generator=torch.Generator().manual_seed(seed))
        plain = speculative_generate(runner, None, prompt, 30, SamplingConfig(), DraftingConfig(), []).tokens
        spec = speculative_generate(runner, proposer, prompt, 30, SamplingConfig(), DraftingConfig("chain", k), [])
        assert spec.tokens == plain
        assert sum(spec.proposed_per_position) > 0


# ---- the seeded statistical test of sampled decoding ------------------------------------------------------

SAMPLING_V = 8  # tiny vocabulary: the joint of two generated tokens has 64 cells
PROMPT = torch.tensor([1, 5, 2, 7, 1, 5, 2])
N_RUNS = 2500
SAMPLINGS = {"T1": SamplingConfig(temperature=1.0), "topk-topp": SamplingConfig(temperature=0.8, top_k=5, top_p=0.9)}


def exact_joint(target, sampling, V: int = SAMPLING_V):
    """P(x2, x3) of the 2nd and 3rd generated tokens, by enumerating every (x1, x2, x3)."""
    seqs = torch.tensor(list(itertools.product(range(V), repeat=2)))  # (V², 2): x1, x2
    ids = torch.cat([PROMPT.expand(len(seqs), -1), seqs], dim=1)
    with torch.no_grad():
        logits = target(ids).logits  # (V², T, V)
    n = PROMPT.numel()
    p1 = process_logits(logits[0, n - 1], sampling)  # (V,)
    p2 = process_logits(logits[:, n], sampling).view(V, V, V)[:, 0, :]  # x1 -> P(x2 | x1)
    p3 = process_logits(logits[:, n + 1], sampling).view(V, V, V)  # x1, x2 -> P(x3 | x1, x2)
    return torch.einsum("a,ab,abc->bc", p1, p2, p3).flatten()


def chi2_pvalue(counts, probs):
    """Pearson chi-square, cells with expected count < 5 pooled; p-value from the regularised gamma."""
    expected = probs * counts.sum()
    small = expected < 5
    obs = torch.cat([counts[~small], counts[small].sum()[None]])
    exp = torch.cat([expected[~small], expected[small].sum()[None]])
    keep = exp > 0
    assert counts[probs == 0].sum() == 0, "a token with target probability 0 was emitted"
    stat = ((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum()
    df = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2.0), stat / 2)), float(stat), df


def sampled_joint_counts(runner, proposer, sampling, drafting, seed: int = 0, V: int = SAMPLING_V):
    """N_RUNS seeded generations of 4 tokens: the counts of (x2, x3), and how many drafts were accepted."""
    g = torch.Generator().manual_seed(seed)
    counts = torch.zeros(V * V, dtype=torch.float64)
    accepted = 0
    for _ in range(N_RUNS):
        # 4 tokens, scored on the 2nd and 3rd: after the prefill's x1 a K=2 cycle drafts x2 and x3 and both
        # draft positions are verified (with 3 tokens the last cycle's chain would be cut to one draft)
        res = speculative_generate(runner, proposer, PROMPT, 4, sampling, drafting, [], generator=g)
        counts[res.tokens[1] * V + res.tokens[2]] += 1
        accepted += sum(res.accepted_per_position)
    return counts, accepted


def speculative_sampling_pvalue(runner, proposer, target, sampling):
    """The chi-square (p-value, statistic, df) of K=2 chain decoding's (x2, x3) against the target's exact joint;
    drafts must have been accepted (and rejected: the test's tokens have the target's distribution)."""
    counts, accepted = sampled_joint_counts(runner, proposer, sampling, DraftingConfig("chain", 2))
    assert 0 < accepted  # drafts were accepted and rejected: the rule ran both ways
    return chi2_pvalue(counts, exact_joint(target, sampling))


# ---- folders and `draftsmith export` ----------------------------------------------------------------------

# the weights of a Llama decoder layer, by the name under layers.{i}. (".weight" left off)
LLAMA_LAYER_WEIGHTS = ("input_layernorm", "post_attention_layernorm", "self_attn.q_proj", "self_attn.k_proj",
                       "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def layer_weight_names(layers: int, parts=LLAMA_LAYER_WEIGHTS) -> set[str]:
    """`layers.{i}.{part}.weight` of every layer."""
    return {f"layers.{i}.{part}.weight" for i in range(layers) for part in parts}


def tensors_of(folder) -> dict[str, torch.Tensor]:
    """Every tensor of a folder's model.safetensors, as stored (dtype too)."""
    from safetensors import safe_open

    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        return {name: f.get_tensor(name) for name in f.keys()}


def check_a_folder_without_embeddings_needs_the_targets(save, load, head, folder, target, logits_of):
    """`save(head, folder, include_embeddings=False)` writes no embed_tokens: `load` alone refuses it, and with the
    target's embeddings it computes the head's logits exactly (`logits_of(head)`)."""
    from draftsmith.core import DraftsmithError

    lean = save(head, folder, include_embeddings=False)
    assert "embed_tokens.weight" not in tensors_of(lean)
    with pytest.raises(DraftsmithError, match="embed_tokens"):
        load(lean)
    back = load(lean, target_embeddings=target.model.get_input_embeddings())
    torch.testing.assert_close(logits_of(back), logits_of(head), rtol=0, atol=0)


def check_cli_export_both_formats(save, head, target, tmp_path, capsys, *, method: str, architecture: str,
                                  layers: int, k: int):
    """`draftsmith export` of a head folder (`save(head, ...)` for `target`) to the method's own format (bf16 by
    default) and to the speculators format at K=k (its architecture, model type, algorithm, layers); the speculators
    folder is refused as a head. Returns (the own folder's config, the speculators folder's config); they are in
    tmp_path/v and /s."""
    from draftsmith.cli import main

    head_folder = save(head, tmp_path / "trained", manifest_target=target.identity())
    main(["export", f"head={head_folder}", f"format={method}", f"out={tmp_path / 'v'}"])
    own = json.loads((tmp_path / "v" / "config.json").read_text())
    assert tensors_of(tmp_path / "v")["lm_head.weight"].dtype == torch.bfloat16  # export default
    main(["export", f"head={head_folder}", "format=speculators", f"out={tmp_path / 's'}",
          f"num_speculative_tokens={k}"])
    config = json.loads((tmp_path / "s" / "config.json").read_text())
    assert config["architectures"] == [architecture] and config["speculators_model_type"] == method
    assert config["transformer_layer_config"]["num_hidden_layers"] == layers
    assert config["speculators_config"]["algorithm"] == method
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == k
    with pytest.raises(SystemExit):  # the speculators folder is not a head folder draftsmith reads
        main(["export", f"head={tmp_path / 's'}", f"out={tmp_path / 'x'}"])
    assert "speculators format" in capsys.readouterr().err
    return own, config


# ---- the outside check: speculators' own models -----------------------------------------------------------


def load_speculators_model(config_cls, model_cls, folder):
    """speculators' own loader, with SDPA attention (its default flex attention has no CPU path here)."""
    config = config_cls.from_pretrained(str(folder))
    config.transformer_layer_config._attn_implementation = "sdpa"
    return model_cls.from_pretrained(str(folder), config=config).eval()


def check_speculators_holds_our_head(model, head, layers: int):
    """A speculators model loaded from our export holds our head's mask token, layers and vocabulary maps."""
    assert model.mask_token_id == head.mask_token_id and len(model.layers) == layers
    assert torch.equal(model.d2t, head.d2t) and torch.equal(model.t2d, head.t2d)


def random_ttt_inputs(vocab_size: int, width: int, T: int, seed: int, aux_scale: float = 1.0,
                      first_position: int = 0):
    """(ids, aux, pos) of one random sequence: T token ids, T feature rows `width` wide, positions from
    `first_position`."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab_size, (1, T), generator=g)
    aux = aux_scale * torch.randn(1, T, width, generator=g)
    return ids, aux, torch.arange(first_position, first_position + T)[None]


@torch.no_grad()
def speculators_eagle3_ttt_logits(model, ids, aux, pos, ttt_steps: int) -> list[torch.Tensor]:
    """Per-step logits of a speculators Eagle3DraftModel's training-time-test forward (one document, teacher-forced
    ids)."""
    steps = []
    hook = model.lm_head.register_forward_hook(lambda mod, args, out: steps.append(out.detach()))
    try:
        model(hidden_states=aux, input_ids=ids, document_ids=torch.zeros_like(ids), position_ids=pos,
              ttt_steps=ttt_steps)
    finally:
        hook.remove()
    return steps


@torch.no_grad()
def eagle3_ttt_logits(head, ids, aux, pos, ttt_steps: int) -> list[torch.Tensor]:
    """The same unroll with an EAGLE-3 head: step k reads ids shifted by k, the previous step's output, pos + k."""
    from draftsmith.heads.kit import ConcatKVCache

    T = ids.shape[1]
    cache, hidden, step_ids, steps = ConcatKVCache(), head.fuse(aux), ids, []
    for k in range(ttt_steps):
        hidden, logits = head(step_ids, hidden, pos + k, ttt_mask(T, k), kv_cache=cache)
        steps.append(logits)
        step_ids = torch.cat([ids[:, 1 + k:], ids.new_zeros(1, 1 + k)], dim=1)
    return steps


def assert_ttt_steps_close(ours, theirs, ttt_steps: int, atol: float, rtol: float):
    """`ttt_steps` steps of logits on each side, each step equal within atol/rtol."""
    assert len(theirs) == len(ours) == ttt_steps
    for k, (a, b) in enumerate(zip(ours, theirs)):
        # the message is built inside assert_close, in this iteration
        torch.testing.assert_close(a, b, atol=atol, rtol=rtol, msg=lambda m: f"TTT step {k}: {m}")  # noqa: B023


# ---- `draftsmith train method=...` -----------------------------------------------------------------------


@contextlib.contextmanager
def crash_after_step(step: int):
    """Inside, a training run stops with RuntimeError("simulated crash ...") where the first micro-batch of step
    `step` + 1 would come: step `step` is done (logged, checkpointed where save_every asks) and nothing of the next one
    is, as if the process died there. The tests' fault injection (and benchmarks/gpu_train_check.py's): it wraps the
    trainer's micro-batch plan, so the library carries no crash switch."""
    real = trainer.micro_batch_plan

    def plan_then_crash(lengths, global_batch, mega_batch, seed, micro_batch_size, rank, world, start_step,
                        total_steps):
        yield from real(lengths, global_batch, mega_batch, seed, micro_batch_size, rank, world, start_step,
                        min(step, total_steps))
        if step < total_steps:
            raise RuntimeError(f"simulated crash after step {step}")

    trainer.micro_batch_plan = plan_then_crash
    try:
        yield
    finally:
        trainer.micro_batch_plan = real


def tiny_train_cfg(data, out, method, deepspeed="none", mode="auto", **kw):
    """The training config of a short run of `method` (a method config) on the tiny target: 2 epochs of 3 steps,
    a checkpoint every 2 steps, W&B off."""
    from omegaconf import OmegaConf

    from draftsmith.configs import check_config
    from draftsmith.data_gen.target import TargetConfig
    from draftsmith.train.config import DeepSpeedConfig, TrainConfig

    cfg = OmegaConf.structured(TrainConfig(
        data=str(data), out=str(out), target=TargetConfig(name="tiny", dtype="float32"), mode=mode, method=method,
        micro_batch_size=2, grad_accum=2, epochs=2, save_every=2, keep_last=5, lr=3e-3, warmup_ratio=0.2,
        progress=False, deepspeed=DeepSpeedConfig(deepspeed), **kw))
    cfg.wandb.mode = "disabled"
    return check_config("train", cfg)  # the typed tree train's run takes


def check_resume_is_exact(train_cfg, data, tmp_path, deepspeed, *, method: str, depths: int, own_tensor: str,
                          layers: int):
    """A 6-step offline run, and the same run crashed at step 3 and resumed: the method's per-depth metrics, the same
    step-6 checkpoint (to 1e-6, `own_tensor` in it), a final folder of `method` with `layers` layers.
    `train_cfg(data, out, deepspeed, **kw)` builds the config. Returns (full run, resumed run, final head)."""
    from safetensors.torch import load_file

    from draftsmith.core.methods import method_for_folder
    from draftsmith.train.run import run

    full = run(train_cfg(data, tmp_path / "full", deepspeed))
    assert full["steps"] == 6 and full["method"] == method and full["mode"] == "offline"
    assert {f"{k}_{d}" for k in ("loss", "acc", "alpha") for d in range(depths)} <= set(full["metrics"])
    with crash_after_step(3), pytest.raises(RuntimeError, match="simulated crash"):
        run(train_cfg(data, tmp_path / "cut", deepspeed))
    resumed = run(train_cfg(data, tmp_path / "cut", deepspeed, resume="true"))
    a = load_file(str(tmp_path / "full/checkpoints/step_00000006/head.safetensors"))
    b = load_file(str(tmp_path / "cut/checkpoints/step_00000006/head.safetensors"))
    assert a.keys() == b.keys() and own_tensor in a
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=1e-6, msg=k)
    final = tmp_path / "full" / "final"
    entry = method_for_folder(final)
    head = entry.load(final)
    assert entry.name == method and len(head.layers) == layers
    return full, resumed, head


def tiny_training_rows(target, head):
    """Two rows of 14 random tokens for a drafter of `target` (a loaded float64 target): the second right-padded by
    4, the loss mask off on the 3-token "prompt" and at a hole (row 0, position 8). Returns (input_ids,
    attention_mask, loss_mask, aux, tgt): the target's features and its head's logits over the draft vocabulary."""
    from draftsmith.train.features import TargetHead

    B, T = 2, 14
    input_ids = torch.randint(0, target.vocab_size - 1, (B, T))
    attention_mask = torch.ones(B, T, dtype=torch.long)
    attention_mask[1, T - 4:] = 0
    loss_mask = torch.ones(B, T, dtype=torch.long)
    loss_mask[:, :3] = 0  # the "prompt"
    loss_mask[0, 8] = 0  # a hole (P-EAGLE's groups crossing it stop)
    aux, last = target.features(input_ids, attention_mask)
    tgt = TargetHead(target.model.lm_head.weight, head.t2d)(last)
    return input_ids, attention_mask, loss_mask, aux, tgt


def statistical_sampling_tests(sampled_pvalue):
    """The two seeded statistical tests of a proposer's sampling, for a test module to bind under their names:
    `sampled_pvalue(sampling) -> (p-value, statistic, degrees of freedom)` of the decoder's emitted tokens against
    the target's exact distribution (speculative_sampling_pvalue). The decoder passes; a wrong sampler (on
    rejection, resample from p instead of the residual) fails the same test."""

    @pytest.mark.slow  # 2500 seeded generations
    @pytest.mark.parametrize("sampling", list(SAMPLINGS.values()), ids=list(SAMPLINGS))
    def test_sampling_matches_target_distribution(sampling):
        pval, stat, df = sampled_pvalue(sampling)
        assert pval > 1e-3, (stat, df)

    @pytest.mark.slow
    def test_negative_control_resampling_from_p_fails(monkeypatch):
        """A wrong sampler (on rejection, resample from p instead of the residual) must fail the same test."""
        monkeypatch.setattr(decoder, "residual_distribution", lambda p, q: p)
        pval, stat, df = sampled_pvalue(SamplingConfig(temperature=1.0))
        assert pval < 1e-4, (stat, df)

    return test_sampling_matches_target_distribution, test_negative_control_resampling_from_p_fails


# ---- tiny drafters with random weights (heads, folders, exports) -------------------------------------------

DRAFT_VOCAB = 100  # random_head's and random_peagle's draft vocabulary


def random_head(target, draft_vocab: int = DRAFT_VOCAB, seed: int = 0, target_hidden_size=None,
                **norms: bool) -> Eagle3Head:
    """A head initialised from `target` with every other weight random (norms too, so swaps show); `norms`: the
    EAGLE-3.1 norms it has (norm_before_fc=True, ...)."""
    torch.manual_seed(seed)
    config = eagle3_config_from_target(target.model.config, draft_vocab, **norms)
    if target_hidden_size:
        config.target_hidden_size = target_hidden_size
    head = Eagle3Head(config)
    counts = torch.randint(0, 1000, (target.vocab_size,))
    head.init_from_target(target.model, *build_vocab_map(counts, config.draft_vocab_size))
    with torch.no_grad():
        for name, p in head.named_parameters():
            if name.startswith(("fc", "midlayer", "norm", "input_norm")):  # fc_norm.* too
                p.copy_(torch.randn_like(p) * 0.3 + (1.0 if p.dim() == 1 else 0.0))
    return head


def random_inputs(head: Eagle3Head, T: int = 11, seed: int = 1):
    """(ids, aux, pos) of two random sequences of T tokens for `head`."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, head.config.vocab_size, (2, T), generator=g)
    aux = torch.randn(2, T, head.fc.in_features, generator=g)
    pos = torch.arange(T).expand(2, T)
    return ids, aux, pos


@torch.no_grad()
def logits_of(head: Eagle3Head, ids, aux, pos) -> torch.Tensor:
    """An EAGLE-3 head's logits (float32) on random_inputs, causal, no cache."""
    return head(ids, head.fuse(aux), pos, causal_mask(ids.shape[1]))[1].float()


# the tensors of an EAGLE-3 head folder (embed_tokens.weight left off)
EAGLE3_HEAD_TENSORS = {
    "fc.weight", "midlayer.input_layernorm.weight", "midlayer.hidden_norm.weight",
    "midlayer.post_attention_layernorm.weight", "midlayer.self_attn.q_proj.weight",
    "midlayer.self_attn.k_proj.weight", "midlayer.self_attn.v_proj.weight",
    "midlayer.self_attn.o_proj.weight", "midlayer.mlp.gate_proj.weight", "midlayer.mlp.up_proj.weight",
    "midlayer.mlp.down_proj.weight", "norm.weight", "lm_head.weight", "d2t", "t2d",
}


PEAGLE_LAYERS = 3  # random_peagle's layers


def random_peagle(target, train_embeddings: bool = True, seed: int = 0) -> PEagleHead:
    """A 3-layer drafter initialised from `target`, every other weight random (norms too, so swaps show)."""
    torch.manual_seed(seed)
    head = PEagleHead(peagle_config_from_target(target.model.config, DRAFT_VOCAB, PEAGLE_LAYERS,
                                                target.vocab_size - 1, train_embeddings))
    return init_randomly_from_target(head, target, DRAFT_VOCAB, ("fc", "layers", "norm", "mask_hidden"))


TINY_LLAMA_VOCAB = 96  # tiny_llama's vocabulary


def tiny_llama(seed: int = 0, vocab: int = TINY_LLAMA_VOCAB, layers: int = 2, hidden: int = 64, heads: int = 4,
               kv_heads: int = 2) -> LlamaForCausalLM:
    """A random Llama whose norms are not all ones (so the final norm's weight tells pre- from post-norm states) and
    whose embeddings are of unit scale, as a trained model's hidden states are (heads/mtp.py engine_hidden: the
    pre-norm state read from hidden_states[N] differs by eps / (2 mean(h^2)) relative, 1e-3 at HF's 0.02 init)."""
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=512,
                         rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
        model.get_input_embeddings().weight.normal_(0.0, 1.0)
    return model


def random_layers(config, seed: int = 1) -> MTPDrafter:
    """An MTP drafter with random weights everywhere, biases and norms included."""
    drafter = MTPDrafter(config)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(torch.rand(p.shape, generator=g) + 0.5)
            else:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    return drafter


# ---- tiny float64 targets and drafters for the built-in decoder --------------------------------------------

AUX = [0, 1, 2]  # HF hidden_states indices of a 2-layer target (2 = after the final norm)

# test_decoder_eagle3's target and head
EAGLE3_V, EAGLE3_VD = 12, 9  # target vocab, draft vocab: small, so that drafts are often accepted
EAGLE3_K = 4  # chain length


def eagle3_decoder_target():
    """A 2-layer float64 Llama of EAGLE3_V tokens with peaked distributions."""
    return peaked_llama(EAGLE3_V)


def eagle3_decoder_head(target, **norms):
    """A float64 EAGLE-3 head of EAGLE3_VD tokens for eagle3_decoder_target; `norms`: the EAGLE-3.1 norms it has
    (norm_before_fc=True, ...), their weights random so that they matter."""
    torch.manual_seed(4)  # a head whose greedy drafts are sometimes accepted
    head = Eagle3Head(eagle3_config_from_target(target.config, EAGLE3_VD, **norms)).double().eval()
    used = torch.tensor([0, 1, 2, 4, 5, 7, 8, 10, 11])  # the draft vocab's target ids
    t2d = torch.zeros(EAGLE3_V, dtype=torch.bool)
    t2d[used] = True
    head.init_from_target(target, used - torch.arange(EAGLE3_VD), t2d)
    with torch.no_grad():
        for name, p in head.named_parameters():
            if name.startswith(("input_norm", "fc_norm")):
                p.uniform_(0.5, 1.5)
    return head


class Eagle3RecordingProposer(Eagle3Proposer):
    """Keeps, per draft round: the committed sequence, the drafted target ids, the logits at each depth."""

    def __init__(self, *args):
        super().__init__(*args)
        self.rounds = []

    def propose(self, drafting, sampling, generator=None):
        self._depth_logits = [self._root_logits.clone()]  # depth 1: entry n-1's output
        draft = super().propose(drafting, sampling, generator)
        assert self.n_entries == len(self.seq) - 1  # entry j consumed (h_j, x_{j+1})
        self.rounds.append((list(self.seq), draft.tokens, self._depth_logits))
        return draft

    def _expand(self, nodes, tokens, parents, depth):
        logits = super()._expand(nodes, tokens, parents, depth)  # (1, Vd): a chain has one node per depth
        self._depth_logits.append(logits[0].clone())
        return logits


def eagle3_decoder_features(target, ids: list[int]) -> torch.Tensor:
    """(1, T, 3H): the target's aux hidden states from one plain HF forward, no KV cache."""
    with torch.no_grad():
        hs = target(torch.tensor([ids]), output_hidden_states=True).hidden_states
    return torch.cat([hs[i] for i in AUX], dim=-1)


def peaked_llama(V, seed=0, scale=8.0, layers=2, max_positions=128):
    """A float64 Llama of V tokens whose logits are scaled by `scale` (peaked distributions)."""
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=V, hidden_size=16, intermediate_size=32, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_positions,
                      tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg).double().eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(scale)  # peaked distributions
    return model


def peagle_decoder_head(target, used: list[int], seed=4, layers=2, scale=1.0):
    """A float64 P-EAGLE head for a bare HF target, its draft vocabulary the target tokens `used`."""
    torch.manual_seed(seed)
    V, Vd = target.config.vocab_size, len(used)
    head = PEagleHead(peagle_config_from_target(target.config, Vd, layers, mask_token_id=V - 1)).double().eval()
    init_from_used_tokens(head, target, used)
    with torch.no_grad():
        head.lm_head.weight.mul_(scale)
    return head


class PEagleRecordingProposer(RecordsForwards, PEagleProposer):
    """Keeps, per cycle: the committed sequence and the k rows of draft logits of the one forward."""


def peagle_from_scratch(head, target, seq, k):
    """The drafter on the whole committed sequence, no cache: entries 0..L-2 (x_{p+1}, f_p), k-1 mask slots."""
    L = len(seq)
    with torch.no_grad():
        hs = target(torch.tensor([seq[:-1]]), output_hidden_states=True).hidden_states
        aux = torch.cat([hs[i] for i in AUX], dim=-1)  # (1, L-1, 3H): positions 0..L-2
        ids = torch.tensor([seq[1:] + [head.mask_token_id] * (k - 1)])
        hidden = torch.cat([head.fuse(aux), head.mask_fused()[None, None].expand(1, k - 1, -1)], dim=1)
        N = L - 1 + k - 1
        _, logits = head(ids, hidden, torch.arange(N)[None], causal_mask(N))
    return logits[0, L - 2:]


MTP_V = 12  # mtp_decoder_target's vocabulary: small, so that drafts are often accepted


def mtp_decoder_target(vocab: int = MTP_V):
    """A 2-layer float64 Llama with peaked distributions, a final norm that is not all ones, unit embeddings."""
    model = peaked_llama(vocab, max_positions=256)
    with torch.no_grad():
        model.model.norm.weight.uniform_(0.5, 1.5)  # pre- and post-norm states differ
        model.get_input_embeddings().weight.normal_(0.0, 1.0)
    return model


def repetitive_prompt(n=24, seed=0):
    """n tokens of a random 6-token motif repeated: n-gram and head drafts are often accepted."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randint(0, 256, (6,), generator=g)
    return torch.cat([base, base, base, base])[:n]


def draft_llama(vocab, seed):
    """A random 2-layer float64 Llama of `vocab` tokens: a draft model."""
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    return LlamaForCausalLM(cfg).double().eval()


def eagle3_head_f64(target, draft_vocab=200, seed=0, **norms):
    """A float64 EAGLE-3 head of a loaded target, its draft vocabulary `draft_vocab` random target tokens."""
    torch.manual_seed(seed)
    head = Eagle3Head(eagle3_config_from_target(target.model.config, draft_vocab, **norms)).double().eval()
    used = torch.sort(torch.randperm(target.vocab_size)[:draft_vocab]).values
    t2d = torch.zeros(target.vocab_size, dtype=torch.bool)
    t2d[used] = True
    head.init_from_target(target.model, used - torch.arange(draft_vocab), t2d)
    return head


def peagle_head_f64(target, draft_vocab=200, seed=0):
    """A float64 2-layer P-EAGLE head of a loaded target, its draft vocabulary `draft_vocab` random target tokens."""
    torch.manual_seed(seed)
    V = target.vocab_size
    head = PEagleHead(peagle_config_from_target(target.model.config, draft_vocab, 2, V - 1)).double().eval()
    used = torch.sort(torch.randperm(V)[:draft_vocab]).values
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[used] = True
    head.init_from_target(target.model, used - torch.arange(draft_vocab), t2d)
    return head


def sampling_llama(seed, scale):
    """A 1-layer float64 Llama of SAMPLING_V tokens, its logits scaled by `scale`."""
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=SAMPLING_V, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                      tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg).double().eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(scale)  # spread the logits so p and q differ a lot
    return model


def sampling_eagle3_head(target):
    """A float64 EAGLE-3 head of 6 draft tokens for sampling_llama, its logits spread (x60)."""
    torch.manual_seed(3)
    head = Eagle3Head(eagle3_config_from_target(target.config, 6)).double().eval()
    with torch.no_grad():
        head.lm_head.weight.mul_(60)
    used = torch.tensor([0, 1, 2, 4, 5, 7])
    t2d = torch.zeros(SAMPLING_V, dtype=torch.bool)
    t2d[used] = True
    head.d2t.copy_(used - torch.arange(6))
    head.t2d.copy_(t2d)
    return head


def sampling_proposer(kind, target):
    """The `kind` proposer (eagle3, draft_model or peagle) of the sampling tests' setup, for sampling_llama."""
    if kind == "eagle3":
        return Eagle3Proposer(sampling_eagle3_head(target), SAMPLING_V, 32)
    if kind == "draft_model":
        return DraftModelProposer(sampling_llama(1, 60), SAMPLING_V, 32)
    return PEagleProposer(peagle_decoder_head(target, [0, 1, 2, 4, 5, 7], seed=3, layers=2, scale=1), SAMPLING_V, 32)


def sampled_joint_and_proposed(runner, proposer, sampling, drafting):
    """Counts of (x2, x3) over N_RUNS seeded generations, and the drafts' per-depth counts.

    Four tokens are generated (the exact joint is of x2 and x3 all the same) so that the first cycle's chain of
    two, drafting x2 and x3, fits whole: with three, the decoder would cut every draft to one token."""
    g = torch.Generator().manual_seed(0)
    counts = torch.zeros(SAMPLING_V * SAMPLING_V, dtype=torch.float64)
    proposed = [0, 0]
    for _ in range(N_RUNS):
        res = speculative_generate(runner, proposer, PROMPT, 4, sampling, drafting, [], generator=g)
        counts[res.tokens[1] * SAMPLING_V + res.tokens[2]] += 1
        proposed = [a + b for a, b in zip(proposed, res.proposed_per_position)]
    return counts, proposed


# ---- data, heads and configs on disk; the CLI --------------------------------------------------------------

# 52 Spec-Bench questions, 4 of each of its 13 categories, in the repository (tests/data/README.md: source, licence)
SPEC_BENCH = str(Path(__file__).resolve().parent / "data" / "spec_bench_question.jsonl")


def make_tiny_data(folder, target, n: int = 12, min_len: int = 10, max_len: int = 24, seed: int = 0,
                   hidden_states: bool = False) -> Path:
    """A data-gen-shaped folder (tokenized/, manifest.json, optional hidden_states/) for `target`."""
    import datasets

    from draftsmith.data_gen.capture import capture_hidden_states
    from draftsmith.core.artifacts import write_manifest

    folder = Path(folder)
    rng = random.Random(seed)
    ids, masks = [], []
    for _ in range(n):
        T = rng.randint(min_len, max_len)
        prompt = rng.randint(2, T // 2)
        # a learnable pattern: repeated short motifs from a small alphabet
        motif = [rng.randint(97, 110) for _ in range(3)]
        ids.append([rng.randint(0, 255) for _ in range(prompt)] + [motif[i % 3] for i in range(T - prompt)])
        masks.append([0] * prompt + [1] * (T - prompt))
    ds = datasets.Dataset.from_dict({"id": [f"s{i}" for i in range(n)], "input_ids": ids, "loss_mask": masks},
                                    features=datasets.Features({"id": datasets.Value("string"),
                                                                "input_ids": datasets.Sequence(datasets.Value("int32")),
                                                                "loss_mask": datasets.Sequence(datasets.Value("int8"))}))
    ds.save_to_disk(str(folder / "tokenized"))
    hidden = None
    if hidden_states:
        index = capture_hidden_states(target, ids, folder / "hidden_states", "float32", samples_per_shard=5)
        hidden = {k: index[k] for k in ("dtype", "aux_layer_ids", "last_hidden_state", "hidden_size")}
    counts = {"samples": n, "tokens": sum(map(len, ids)), "loss_tokens": sum(map(sum, masks))}
    write_manifest(folder, stage="data_gen", target=target.identity(), counts=counts, hidden_states=hidden)
    return folder


def save_tiny_head(folder, identity=None):
    """A random EAGLE-3 head for the tiny target, saved with a manifest naming `identity`."""
    from draftsmith.heads.eagle3_folders import save_eagle3
    from draftsmith.heads.eagle3 import Eagle3Head, eagle3_config_from_target
    from draftsmith.heads.vocab import build_vocab_map

    target = load_target(TargetConfig(name="tiny", dtype="float32"))
    torch.manual_seed(0)
    head = Eagle3Head(eagle3_config_from_target(target.model.config, draft_vocab_size=128))
    d2t, t2d = build_vocab_map(torch.arange(target.vocab_size, dtype=torch.long), 128)
    head.init_from_target(target.model, d2t, t2d)
    save_eagle3(head, folder, manifest_target=identity or target.identity())
    return str(folder)


def eval_cfg(questions, out, *extra):
    """The eval config of a short fp32 run on the tiny target over the `questions` file."""
    # fp32: greedy speculative output must be token-identical to target-only decoding (eval's default is bf16)
    return compose("eval", ["target=tiny", "target.dtype=float32", f"prompts.path={questions}", "prompts.n=null",
                            "max_new_tokens=12",
                            "repeats=1", "progress=false", f"out={out}", *extra])


def two_questions(folder):
    """Two MT-bench-style questions in `folder`/q.jsonl."""
    path = folder / "q.jsonl"
    path.write_text("".join(json.dumps({"question_id": i, "category": "writing", "turns": [text]}) + "\n"
                            for i, text in enumerate(["Write a poem about the sea.", "Name three colours."])))
    return path


def snapshot(folder) -> dict:
    """Every file under `folder` with its bytes: what must survive a refusal untouched."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def cli_error(capsys, argv) -> str:
    """Run the CLI, expect exit 2 and one line on stderr; return that line."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = [ln for ln in capsys.readouterr().err.strip().splitlines() if "examples/s" not in ln]
    assert len(err) == 1, err
    return err[0]


# ---- the engines (vLLM, llama.cpp) and what their modules make once per test run ---------------------------

REQUIRE_ENV = "DRAFTSMITH_REQUIRE_ENGINE"  # 1: a missing engine fails the engine tests instead of skipping


def engine_required() -> bool:
    """DRAFTSMITH_REQUIRE_ENGINE=1 (what .ci/run sets with --engine): a missing engine is a failure, not a skip.

    Only this flag, not a CI service's own CI=true: .ci/run is the one switch that installs the engine."""
    return os.environ.get(REQUIRE_ENV, "").lower() in ("1", "true", "yes")

def engines_of(method: str):
    """What the engines call `method`: its row's Engines (ngram+<m> is served as <m>; ngram is eval's own)."""
    base = method.split("+")[-1]
    return NGRAM_ENGINES if base == "ngram" else METHODS[base].engines


# What every engine module decodes: ENGINE_PROMPTS of engine_data's prompts, greedy, fp32, K = ENGINE_K
ENGINE_PROMPTS, ENGINE_K = 6, 3


def shared_path(tmp_path_factory, name: str) -> Path:
    """A path that every pytest-xdist worker of this test run sees: the run's base temp (a worker's own is a folder
    in it), fresh for each run."""
    base = tmp_path_factory.getbasetemp()
    return (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / name


MADE_ONCE_LOG = "made-once.jsonl"  # made_once's timings, in the run's base temp (shared_path's parent)


def made_once(path: Path, make) -> Path:
    """`path`, made by `make(path)` once per test run: the first worker to ask makes it while the others wait on its
    lock, then read it. A make that failed leaves no `.done`: the next to ask starts again from nothing."""
    from filelock import FileLock

    path.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    with FileLock(f"{path}.lock"):
        done = Path(f"{path}.done")
        waited = time.perf_counter() - t0
        if not done.exists():
            if path.is_dir():
                shutil.rmtree(path)
            path.unlink(missing_ok=True)
            make(path)
            done.touch()
            log_made(path, "made", time.perf_counter() - t0 - waited)
        elif waited > 1:  # this worker sat idle while another made it
            log_made(path, "waited for", waited)
    return path


def log_made(path: Path, what: str, seconds: float) -> None:
    """One line of the summary's "made once" section (pytest_terminal_summary), in the run's base temp."""
    from filelock import FileLock

    log_path = path.parent.parent / MADE_ONCE_LOG
    with FileLock(f"{log_path}.lock"), open(log_path, "a") as log:
        log.write(json.dumps({"what": what, "name": f"{path.parent.name}/{path.name}", "seconds": seconds,
                              "worker": os.environ.get("PYTEST_XDIST_WORKER", "-")}) + "\n")


def builtin_decode(engine_data, method: str, head, max_tokens: int, out: Path) -> list:
    """The built-in decoder on the engine modules' prompts: `method` (target_only, ngram with vLLM's earliest-match
    rule, or a head's method with its `head` folder), one Sample per turn, counted as eval's decode_all counts them
    (without its comparison with target-only, which another reading holds)."""
    from draftsmith.configs import compose
    from draftsmith.eval import run as ev

    cfg = compose("eval", ["target=smollm2", "target.dtype=float32", "head=ngram", "prompts.source=holdout",
                           f"prompts.path={engine_data}", f"prompts.holdout={ENGINE_PROMPTS}",
                           f"max_new_tokens={max_tokens}", "repeats=1", "warmup_prompts=0", "progress=false",
                           f"drafting.num_speculative_tokens={ENGINE_K}",
                           "ngram_match=earliest",  # vLLM's n-gram rule (the default copies the latest)
                           f"out={out}"])
    setup = ev.prepare(cfg)  # head=ngram: the prompts are chosen alike for every method
    proposer = None
    if method == "ngram":
        proposer = ev.ngram_proposer(cfg)
    elif method != ev.TARGET_ONLY:
        cfg.head = str(head)
        proposer = ev.load_drafter(cfg, setup.target, setup.runner.max_len).make()
    return [ev.to_sample(prompt.category, [turn]) for prompt in setup.prompts
            for turn in setup.decode(proposer, prompt, method)]


def edited_copy(src: Path, dst: Path, config: dict | None = None, drop: tuple[str, ...] = (),
                tensors=None) -> Path:
    """A copy of an export folder with config.json keys set (or dropped) and tensors rewritten."""
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg.update(config or {})
    for key in drop:
        cfg.pop(key, None)
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    if tensors is not None:
        state = load_file(dst / "model.safetensors")
        save_file(tensors(state), str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def engine_run(name: str, folder, k: int = ENGINE_K, parallel: bool | None = None) -> dict:
    """One run of the job: speculators folders are served as the model (their speculators_config says the rest)."""
    if name.startswith("speculators") or name.startswith("peagle_speculators"):
        return {"name": name, "k": k, "model": str(folder), "speculative_config": None}
    method = {"peagle": "peagle", "draft": "draft", "ngram": "ngram"}.get(name.split("_")[0], "eagle3")
    spec = ev_engine.speculative_config(method, engines_of(method), None if method == "ngram" else str(folder), k)
    if parallel is False:
        spec.pop("parallel_drafting", None)
    return {"name": name, "k": k, "speculative_config": spec}


def counters_job(target, samples: dict, max_tokens: int, runs: list[dict]) -> dict:
    """The engine's result for target-only + `runs` on the prompts of the built-in target-only samples: greedy,
    fp32, every prompt in one call (counters only: nothing timed, no warm-up)."""
    job = ev_engine.engine_job(ev_engine.served_target(target), [s.prompt_ids for s in samples[ev.TARGET_ONLY]],
                               max_tokens, target.eos_token_ids,
                               [{"name": ev_engine.TARGET_ONLY, "speculative_config": None}] + runs,
                               warmup=0, batch=True)
    return engine.run_job(job, timeout_s=3600)


def mtp_engine_agreement(samples: dict, result: dict, name: str, k: int, record_property) -> dict:
    """The MTP engine modules' reading of the built-in run `name` against vLLM's `mtp` run: vLLM loaded both runs,
    its output equals its target-only output and the built-in target-only's, the built-in run is lossless too; then
    eval/engine_vllm.py's agreement, recorded and printed (each module asserts what it expects of it)."""
    run, base = result["runs"]["mtp"], result["runs"][ev.TARGET_ONLY]
    assert base["ok"], base.get("error")
    assert run["ok"], f"vLLM refused the MiMo: {run.get('error')}"
    assert run["tokens"] == base["tokens"] == [s.tokens for s in samples[ev.TARGET_ONLY]]
    assert [s.tokens for s in samples[name]] == [s.tokens for s in samples[ev.TARGET_ONLY]]  # lossless here too
    agree = ev_engine.agreement(samples[name], run, k)
    record_property("agreement", agree)
    print(name, agree)
    return agree
