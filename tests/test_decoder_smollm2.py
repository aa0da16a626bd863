"""SmolLM2 in fp32: speculative greedy equals target-only greedy, except on logit near-ties."""

import pytest
import torch

from draftsmith.eval.decoder import DraftingConfig, SamplingConfig, speculative_generate
from draftsmith.eval.proposers.eagle3 import Eagle3Proposer
from draftsmith.eval.proposers.ngram import NgramProposer
from draftsmith.eval.target_runner import TargetRunner
from draftsmith.heads.eagle3 import Eagle3Head, eagle3_config_from_target

pytestmark = pytest.mark.slow

PROMPTS = ["List the days of the week, then list them again in reverse order.",
           "Write a haiku about the sea."]
N_NEW = 32


def _first_divergence_is_near_tie(target, prompt, ref, got):
    """At the first differing position the target's top-2 logits must be within 1e-3 of the logit scale."""
    i = next((j for j, (a, b) in enumerate(zip(ref, got)) if a != b), None)
    if i is None:
        return True
    ids = torch.cat([prompt, torch.tensor(ref[:i], dtype=torch.long)])
    with torch.no_grad():
        logits = target.model(ids[None]).logits[0, -1].double()
    top2 = logits.topk(2)
    gap, scale = float(top2.values[0] - top2.values[1]), float(logits.abs().max())
    print(f"divergence at {i}: tokens {ref[i]} vs {got[i]}, top-2 gap {gap:.2e}, scale {scale:.1f}")
    return gap < 1e-3 * scale and {ref[i], got[i]} <= set(top2.indices.tolist())


def test_smollm2_greedy_lossless(smollm2_target):
    target = smollm2_target
    runner = TargetRunner(target.model, 512, target.aux_layer_ids)
    torch.manual_seed(0)
    head = Eagle3Head(eagle3_config_from_target(target.model.config, 2048)).eval()
    used = torch.arange(2048)
    head.init_from_target(target.model, used - torch.arange(2048), torch.arange(target.vocab_size) < 2048)
    cases = [("ngram", NgramProposer(3, 1), DraftingConfig("chain", 5)),
             ("eagle3-tree", Eagle3Proposer(head, target.vocab_size, 512), DraftingConfig("tree", 3, 3, 8))]
    for text in PROMPTS:
        prompt = target.tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                      return_tensors="pt", return_dict=True)["input_ids"][0]
        ref = speculative_generate(runner, None, prompt, N_NEW, SamplingConfig(), DraftingConfig(), []).tokens
        hf = target.model.generate(prompt[None], attention_mask=torch.ones(1, prompt.numel(), dtype=torch.long),
                                   max_new_tokens=N_NEW, do_sample=False, eos_token_id=None,
                                   pad_token_id=target.tokenizer.pad_token_id)[0, prompt.numel():].tolist()
        assert _first_divergence_is_near_tie(target, prompt, hf, ref)
        for name, proposer, drafting in cases:
            got = speculative_generate(runner, proposer, prompt, N_NEW, SamplingConfig(), drafting, []).tokens
            assert len(got) == N_NEW
            assert _first_divergence_is_near_tie(target, prompt, ref, got), name
