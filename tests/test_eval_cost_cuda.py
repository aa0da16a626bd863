"""On a CUDA device: the target passes replayed from CUDA graphs are lossless (greedy speculative output equals
target-only decoding, sampling stays seeded-reproducible) and give the eager pass's logits. Skipped without CUDA
(scripts/gpu_check.sh runs them on a GPU machine)."""

import pytest
import torch

from draftsmith.data_gen.target import TargetConfig, load_target
from draftsmith.eval.decoder import DraftingConfig, speculative_generate
from draftsmith.eval.proposers.eagle3 import Eagle3Proposer
from draftsmith.eval.proposers.ngram import NgramProposer
from draftsmith.eval.target_runner import TargetRunner
from draftsmith.heads.eagle3 import Eagle3Head, eagle3_config_from_target
from draftsmith.core.sampling import SamplingConfig

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (scripts/gpu_check.sh)")


@pytest.fixture(scope="module")
def cuda_tiny():
    target = load_target(TargetConfig(name="tiny", dtype="float32", device="cuda"))
    return target


def _eagle_head(target, draft_vocab=200):
    """A random EAGLE-3 head over a random draft vocabulary, built on the CPU (as tests/test_decoder_greedy.py)."""
    cpu = load_target(TargetConfig(name="tiny", dtype="float32"))
    torch.manual_seed(0)
    head = Eagle3Head(eagle3_config_from_target(cpu.model.config, draft_vocab)).float().eval()
    used = torch.sort(torch.randperm(cpu.vocab_size)[:draft_vocab]).values
    t2d = torch.zeros(cpu.vocab_size, dtype=torch.bool)
    t2d[used] = True
    head.init_from_target(cpu.model, used - torch.arange(draft_vocab), t2d)
    return head.to(target.model.device)


def _prompt(seed=0):
    base = torch.randint(0, 256, (6,), generator=torch.Generator().manual_seed(seed))
    return torch.cat([base] * 4)


def test_graph_pass_matches_eager_pass(cuda_tiny):
    eager = TargetRunner(cuda_tiny.model, 256, cuda_tiny.aux_layer_ids, cuda_graph=False)
    graph = TargetRunner(cuda_tiny.model, 256, cuda_tiny.aux_layer_ids, cuda_graph=True)
    assert graph.cuda_graph and graph.static
    ids = _prompt().cuda()
    for r in (eager, graph):
        r.reset()
        r.forward(ids[:16], torch.arange(16, device="cuda"), 0, logits_rows="none")
        r.commit(16)
    for T in (1, 4):  # twice each: the second call replays the captured graph
        for _ in range(2):
            a, xa = eager.forward(ids[16:16 + T], torch.arange(16, 16 + T, device="cuda"), 16, want_aux=True)
            b, xb = graph.forward(ids[16:16 + T], torch.arange(16, 16 + T, device="cuda"), 16, want_aux=True)
            torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-3)
            torch.testing.assert_close(xa, xb, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("mode", ["chain", "tree"])
def test_greedy_lossless_with_cuda_graphs(cuda_tiny, mode):
    runner = TargetRunner(cuda_tiny.model, 256, cuda_tiny.aux_layer_ids, cuda_graph=True)
    eager = TargetRunner(cuda_tiny.model, 256, cuda_tiny.aux_layer_ids, cuda_graph=False)
    drafting = DraftingConfig(mode=mode, num_speculative_tokens=4, tree_top_k=3, tree_budget=10)
    head = _eagle_head(cuda_tiny)
    for seed in range(3):
        ids = _prompt(seed)
        want = speculative_generate(eager, None, ids, 40, SamplingConfig(), drafting, eos_token_ids=[]).tokens
        assert speculative_generate(runner, None, ids, 40, SamplingConfig(), drafting, eos_token_ids=[]).tokens == want
        for proposer in (NgramProposer(3, 1), Eagle3Proposer(head, cuda_tiny.vocab_size, 256)):
            got = speculative_generate(runner, proposer, ids, 40, SamplingConfig(), drafting, eos_token_ids=[])
            assert got.tokens == want


def test_sampling_reproducible_with_cuda_graphs(cuda_tiny):
    runner = TargetRunner(cuda_tiny.model, 256, cuda_tiny.aux_layer_ids, cuda_graph=True)
    sampling, chain = SamplingConfig(temperature=1.0), DraftingConfig("chain", 3)
    outs = [speculative_generate(runner, NgramProposer(3, 1), _prompt(), 32, sampling, chain, eos_token_ids=[],
                                 generator=torch.Generator(device="cuda").manual_seed(7)).tokens for _ in range(2)]
    assert outs[0] == outs[1] and len(outs[0]) == 32
