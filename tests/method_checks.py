"""Checks and builders that the drafting methods' tests share (decoder, folders, the speculators outside check,
training): one copy of each, the method's own values passed in. Plain functions, plus two fixtures a test module
imports by name (`verifier_folder`, `tiny_data`); tests/ is on sys.path under pytest."""

from __future__ import annotations

import itertools
import json

import pytest
import torch
import torch.nn.functional as F

from draftsmith.core.sampling import process_logits
from draftsmith.eval import decoder
from draftsmith.eval.decoder import DraftingConfig, SamplingConfig, speculative_generate
from draftsmith.eval.target_runner import TargetRunner

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


@pytest.fixture
def verifier_folder(tiny_target, tmp_path, monkeypatch):
    """The tiny target as an HF folder: speculators reads the verifier's config and norm from it (offline)."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    folder = tmp_path / "verifier"
    tiny_target.model.save_pretrained(folder)
    return folder


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
    from draftsmith.heads.eagle3 import ttt_mask
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
        torch.testing.assert_close(a, b, atol=atol, rtol=rtol, msg=lambda m: f"TTT step {k}: {m}")


# ---- `draftsmith train method=...` -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_data(tmp_path_factory):
    """12 rows of offline data (hidden states included) from the tiny target."""
    from test_train_data import make_tiny_data

    from draftsmith.data_gen.target import TargetConfig, load_target

    return make_tiny_data(tmp_path_factory.mktemp("data"), load_target(TargetConfig(name="tiny", dtype="float32")),
                          n=12, hidden_states=True)


def tiny_train_cfg(data, out, method, deepspeed="none", mode="auto", **kw):
    """The training config of a short run of `method` (a method config) on the tiny target: 2 epochs of 3 steps,
    a checkpoint every 2 steps, W&B off."""
    from omegaconf import OmegaConf

    from draftsmith.data_gen.target import TargetConfig
    from draftsmith.train.config import DeepSpeedConfig, TrainConfig

    cfg = OmegaConf.structured(TrainConfig(
        data=str(data), out=str(out), target=TargetConfig(name="tiny", dtype="float32"), mode=mode, method=method,
        micro_batch_size=2, grad_accum=2, epochs=2, save_every=2, keep_last=5, lr=3e-3, warmup_ratio=0.2,
        progress=False, deepspeed=DeepSpeedConfig(deepspeed), **kw))
    cfg.wandb.mode = "disabled"
    return cfg


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
    with pytest.raises(RuntimeError, match="simulated crash"):
        run(train_cfg(data, tmp_path / "cut", deepspeed, fail_at_step=3))
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
