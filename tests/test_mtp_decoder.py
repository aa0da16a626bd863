"""The MTP proposer drafts, inside the decode loop, exactly what train/mtp.py's unroll trains, and the decoder stays
lossless with it (greedy token-identical in chains and trees; sampled: the seeded statistical test and its negative
control, tests/helpers.py).

Every draft round of `speculative_generate` with a real `MTPProposer` is recorded (its committed sequence, its draft
and its logits at each depth); then `mtp_unroll` runs on the same sequence teacher-forced along the drafted tokens,
with the target's hidden_states[N] from one plain HF forward: the logits must agree at every depth of every round."""

import pytest
import torch
from helpers import MTP_V, mtp_decoder_target, random_layers, speculative_sampling_pvalue, statistical_sampling_tests

from draftsmith.eval.decoder import DraftingConfig, SamplingConfig, speculative_generate
from draftsmith.eval.proposers.mtp import MTPProposer, proposer
from draftsmith.eval.target_runner import TargetRunner
from draftsmith.heads.mtp import mtp_config_from_target
from draftsmith.train.mtp import mtp_unroll

K = 4
AUX = [2]  # hidden_states[N] of the 2-layer target: what the mtp row asks the runner for

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def _drafter(target, **fields):
    config = mtp_config_from_target(target.config, **fields)
    return random_layers(config, seed=2).double().attach(target).eval()  # a seed whose greedy drafts get accepted


class RecordingProposer(MTPProposer):
    """Keeps, per draft round: the committed sequence, the drafted tokens, the logits at each depth."""

    def __init__(self, *args):
        super().__init__(*args)
        self.rounds = []

    def propose(self, drafting, sampling, generator=None):
        self._depth_logits = [self._root_logits.clone()]
        draft = super().propose(drafting, sampling, generator)
        assert self.n_entries == len(self.seq) - 1  # entry j read (h_j, x_{j+1})
        self.rounds.append((list(self.seq), draft.tokens, self._depth_logits))
        return draft

    def _expand(self, nodes, tokens, parents, depth):
        logits = super()._expand(nodes, tokens, parents, depth)
        self._depth_logits.append(logits[0].clone())
        return logits


@pytest.mark.parametrize("fields", [{}, {"fusion": "embedding_first"}, {"hidden": "post_norm"}],
                         ids=["mimo", "embedding_first", "post_norm"])
@pytest.mark.parametrize("sampling", [SamplingConfig(), SamplingConfig(temperature=1.0)], ids=["greedy", "T1"])
def test_proposer_logits_in_the_decode_loop_equal_the_training_unroll(sampling, fields):
    target, prompt = mtp_decoder_target(), torch.tensor([3, 1, 4, 1, 5, 9, 2, 6])
    drafter = _drafter(target, **fields)
    recording = RecordingProposer(drafter, MTP_V, 96)
    g = torch.Generator().manual_seed(0)
    res = speculative_generate(TargetRunner(target, 96, AUX), recording, prompt, 40, sampling,
                               DraftingConfig("chain", K), [], generator=g)
    assert len(res.tokens) == 40 and len(recording.rounds) >= res.n_verifications - 1
    assert max(res.emitted_per_verification) > 1  # drafts were accepted: update() ran on several rows
    for seq, draft, logits in recording.rounds:
        ids = seq + draft[:-1]  # teacher-forced along the drafted tokens
        t = len(seq) - 2  # the row whose step i drafts token len(seq) + i
        with torch.no_grad():
            last = target(torch.tensor([ids]), output_hidden_states=True).hidden_states[-1]
            steps = list(mtp_unroll(drafter, torch.tensor([ids]), drafter.engine_hidden(last), K))
        for i in range(K):
            torch.testing.assert_close(logits[i], drafter.logits(steps[i][0, t]), rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("drafting", [DraftingConfig("chain", 3), DraftingConfig("tree", 3, 2, 6)],
                         ids=["chain", "tree"])
def test_greedy_is_token_identical_to_target_only(drafting):
    target = mtp_decoder_target(256)
    runner = TargetRunner(target, 256, AUX)
    mtp = proposer(_drafter(target), 256, 256)
    for seed in range(2):
        prompt = torch.randint(0, 256, (12,), generator=torch.Generator().manual_seed(seed))
        plain = speculative_generate(runner, None, prompt, 30, SamplingConfig(), DraftingConfig(), []).tokens
        spec = speculative_generate(runner, mtp, prompt, 30, SamplingConfig(), drafting, [])
        assert spec.tokens == plain and sum(spec.proposed_per_position) > 0


def _sampled_pvalue(sampling):
    target = mtp_decoder_target(8)
    return speculative_sampling_pvalue(TargetRunner(target, 32, AUX), MTPProposer(_drafter(target), 8, 32), target,
                                       sampling)


test_sampling_matches_target_distribution, test_negative_control_resampling_from_p_fails = \
    statistical_sampling_tests(_sampled_pvalue)
