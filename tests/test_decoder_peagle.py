"""The P-EAGLE proposer in the built-in decoder: one drafter forward per cycle drafts exactly what the drafter
computes from scratch on the committed sequence, greedy decoding is token-identical to target-only decoding,
and sampled decoding has the target's distribution (with the negative control failing)."""

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

from draftsmith.eval import decoder
from draftsmith.eval.decoder import DraftingConfig, SamplingConfig, speculative_generate
from draftsmith.eval.proposers.peagle import PEagleProposer
from draftsmith.eval.target_runner import TargetRunner
from draftsmith.heads.kit import causal_mask
from draftsmith.heads.peagle import PEagleHead, peagle_config_from_target

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

AUX = [0, 1, 2]  # HF hidden_states indices of a 2-layer target


def _target(V, seed=0, scale=8.0, layers=2):
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=V, hidden_size=16, intermediate_size=32, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                      tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg).double().eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(scale)  # peaked distributions
    return model


def _head(target, used: list[int], seed=4, layers=2, scale=1.0):
    torch.manual_seed(seed)
    V, Vd = target.config.vocab_size, len(used)
    head = PEagleHead(peagle_config_from_target(target.config, Vd, layers, mask_token_id=V - 1)).double().eval()
    used = torch.tensor(used)
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[used] = True
    head.init_from_target(target, used - torch.arange(Vd), t2d)
    with torch.no_grad():
        head.lm_head.weight.mul_(scale)
    return head


class RecordingProposer(PEagleProposer):
    """Keeps, per cycle: the committed sequence and the k rows of draft logits of the one forward."""

    def __init__(self, *args):
        super().__init__(*args)
        self.rounds, self.forwards = [], 0

    def _forward(self, k):
        self.forwards += 1
        logits = super()._forward(k)
        self.rounds.append((list(self.seq), logits.clone()))
        return logits


def _from_scratch(head, target, seq, k):
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


@pytest.mark.parametrize("sampling", [SamplingConfig(), SamplingConfig(temperature=1.0)], ids=["greedy", "T1"])
def test_one_forward_per_cycle_drafts_what_the_drafter_computes_from_scratch(sampling):
    V, K = 12, 4
    target = _target(V)
    head = _head(target, [0, 1, 2, 4, 5, 7, 8, 10, 11])
    proposer = RecordingProposer(head, V, 96)
    g = torch.Generator().manual_seed(0)
    res = speculative_generate(TargetRunner(target, 96, AUX), proposer, torch.tensor([3, 1, 4, 1, 5, 9, 2, 6]), 40,
                               sampling, DraftingConfig("chain", K), [], generator=g)
    assert len(res.tokens) == 40
    assert proposer.forwards == len(proposer.rounds) <= res.n_verifications  # one drafter forward per cycle
    assert max(res.emitted_per_verification) > 1  # accepted drafts: cycles ran several new entries at once
    for seq, logits in proposer.rounds:
        assert logits.shape[0] == K
        torch.testing.assert_close(logits, _from_scratch(head, target, seq, K), rtol=1e-9, atol=1e-9)


def test_draft_forwards_attend_only_to_the_slots_in_use(monkeypatch):
    widths, sdpa = [], F.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, **kw):
        widths.append(k.shape[-2])
        return sdpa(q, k, v, attn_mask=attn_mask, **kw)

    V = 12
    target = _target(V)
    proposer = PEagleProposer(_head(target, list(range(V))), V, 4096)
    prompt = torch.tensor([3, 1, 4, 1, 5, 9, 2, 6])
    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    res = speculative_generate(TargetRunner(target, 64, AUX), proposer, prompt, 20, SamplingConfig(),
                               DraftingConfig("chain", 5), [])
    assert len(res.tokens) == 20 and widths
    assert max(widths) <= len(prompt) + 20 + 5


# ---- lossless: greedy token-identical, sampling distribution-exact ----------------------------------------

@pytest.mark.parametrize("k", [1, 3, 7])
def test_greedy_is_token_identical_to_target_only(k):
    from draftsmith.data_gen.target import TargetConfig, load_target

    tiny = load_target(TargetConfig(name="tiny", dtype="float64"))
    runner = TargetRunner(tiny.model, 256, tiny.aux_layer_ids)
    torch.manual_seed(0)
    head = PEagleHead(peagle_config_from_target(tiny.model.config, 200, 2, tiny.vocab_size - 1)).double().eval()
    used = torch.sort(torch.randperm(tiny.vocab_size)[:200]).values
    t2d = torch.zeros(tiny.vocab_size, dtype=torch.bool)
    t2d[used] = True
    head.init_from_target(tiny.model, used - torch.arange(200), t2d)
    proposer = PEagleProposer(head, tiny.vocab_size, 256)
    for seed in range(2):
        prompt = torch.randint(0, 256, (12,), generator=torch.Generator().manual_seed(seed))
        plain = speculative_generate(runner, None, prompt, 30, SamplingConfig(), DraftingConfig(), []).tokens
        spec = speculative_generate(runner, proposer, prompt, 30, SamplingConfig(), DraftingConfig("chain", k), [])
        assert spec.tokens == plain
        assert sum(spec.proposed_per_position) > 0


SAMPLING_V = 8
PROMPT = torch.tensor([1, 5, 2, 7, 1, 5, 2])
N_RUNS = 2500


def _exact_joint(target, sampling):
    """P(x2, x3) of the 2nd and 3rd generated tokens, by enumerating every (x1, x2, x3)."""
    import itertools

    from draftsmith.core.sampling import process_logits

    V = SAMPLING_V
    seqs = torch.tensor(list(itertools.product(range(V), repeat=2)))  # (V², 2): x1, x2
    ids = torch.cat([PROMPT.expand(len(seqs), -1), seqs], dim=1)
    with torch.no_grad():
        logits = target(ids).logits  # (V², T, V)
    n = PROMPT.numel()
    p1 = process_logits(logits[0, n - 1], sampling)
    p2 = process_logits(logits[:, n], sampling).view(V, V, V)[:, 0, :]
    p3 = process_logits(logits[:, n + 1], sampling).view(V, V, V)
    return torch.einsum("a,ab,abc->bc", p1, p2, p3).flatten()


def _chi2_pvalue(counts, probs):
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


def _sampled_pvalue(sampling):
    target = _target(SAMPLING_V, seed=0, scale=60, layers=1)
    runner = TargetRunner(target, 32, [0, 1, 1])
    head = _head(target, [0, 1, 2, 4, 5, 7], seed=3, layers=2, scale=60)
    proposer = PEagleProposer(head, SAMPLING_V, 32)
    g = torch.Generator().manual_seed(0)
    counts = torch.zeros(SAMPLING_V ** 2, dtype=torch.float64)
    accepted = 0
    for _ in range(N_RUNS):
        # 4 tokens, scored on the 2nd and 3rd: the K=2 cycle after the prefill's x1 drafts both x2 and x3
        res = speculative_generate(runner, proposer, PROMPT, 4, sampling, DraftingConfig("chain", 2), [], generator=g)
        counts[res.tokens[1] * SAMPLING_V + res.tokens[2]] += 1
        accepted += sum(res.accepted_per_position)
    assert 0 < accepted  # drafts were accepted and rejected: the rule ran both ways
    return _chi2_pvalue(counts, _exact_joint(target, sampling))


@pytest.mark.slow  # 2500 seeded generations: ~10 s of CPU each
@pytest.mark.parametrize("sampling", [SamplingConfig(temperature=1.0), SamplingConfig(temperature=0.8, top_k=5, top_p=0.9)],
                         ids=["T1", "topk-topp"])
def test_sampling_matches_target_distribution(sampling):
    pval, stat, df = _sampled_pvalue(sampling)
    assert pval > 1e-3, (stat, df)


@pytest.mark.slow
def test_negative_control_resampling_from_p_fails(monkeypatch):
    """A wrong sampler (on rejection, resample from p instead of the residual) must fail the same test."""
    monkeypatch.setattr(decoder, "residual_distribution", lambda p, q: p)
    pval, stat, df = _sampled_pvalue(SamplingConfig(temperature=1.0))
    assert pval < 1e-4, (stat, df)
