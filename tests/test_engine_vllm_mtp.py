"""(slow) MTP in the engine: vLLM for CPU serves a tiny random MiMo's own MTP layer (`{"method": "mtp"}`, the MiMo
folder as the model), decodes 6 prompts greedily in fp32 at K = 3, and measures what the built-in decoder measures.

The target: a random 2-layer Llama (vocab 259 as the tiny preset, hidden 64, 2 heads of 32: vLLM's CPU attention
has no head size 16; its norms not all ones and its embeddings of unit scale, as a trained model's), saved as a MiMo (heads/mtp_folders.py save_as_mimo) with the
tokenizer of the tiny preset. A random MTP layer drafts almost nothing (its acceptance is about 1/259), which no
check could tell from another wrong layer; so the layer is TRAINED here first, briefly: a fresh layer, 300 Adam steps
of train/mtp.py's loss on the target's own greedy continuations of 24 random prompts (a few seconds), after which it
drafts most tokens right. Then ONE vLLM worker process builds one `LLM` per run: target-only, and the trained MiMo
with method mtp.

Asserted: vLLM's output is token-identical to vLLM target-only and to the built-in decoder's target-only; vLLM's τ
and per-position acceptance equal the built-in decoder's within eval/engine_vllm.py's TOLERANCE (0.02), every
verification but each prompt's last accepting exactly as many tokens. The negative controls, each the built-in
decoder computing the layer otherwise against the same vLLM run, must FAIL that agreement: the fusion order swapped
(`input_proj(cat(e, h))`, DeepSeek's and Qwen's order), the post-norm hidden state instead of MiMo's pre-norm one, and
the untrained layer (the fresh one this layer was trained from), which also shows that vLLM read the stitched weights.

Measured 2026-12-06 (vLLM for CPU 0.32.0, 2 shared cores): vLLM τ 3.315 against the built-in 3.260 pooled (the last
verification of each prompt differs by design, eval/engine_vllm.py `agreement`), 0.0 apart over the compared
verifications, every one identical; the controls 2.30 (fusion swapped), 0.12 (post-norm hidden: 4 of 6 prompts'
steps identical) and 2.27 (untrained) apart. The module took 88 s.
"""

from __future__ import annotations

import pytest
import torch

from draftsmith.core import engine
from draftsmith.data_gen.target import tiny_tokenizer
from draftsmith.eval import engine_vllm as ev_engine
from draftsmith.eval import run as ev
from draftsmith.eval.decoder import DraftingConfig, SamplingConfig, speculative_generate
from draftsmith.eval.proposers.mtp import proposer
from draftsmith.eval.target_runner import TargetRunner
from draftsmith.heads import mtp_folders
from draftsmith.heads.mtp import MTPDrafter, init_mtp_layer, mtp_config_from_target
from draftsmith.train.features import TargetHead
from draftsmith.train.mtp import mtp_loss
from helpers import mtp_engine_agreement, tiny_llama

pytestmark = [pytest.mark.slow, pytest.mark.engine, pytest.mark.timeout(1800)]

K = 3
MAX_TOKENS = 48
N_PROMPTS = 6
TRAIN_STEPS = 300
VOCAB = 259  # the tiny preset's tokenizer
CONTROLS = {"fusion_swapped": {"mtp_fusion": "embedding_first"}, "post_norm_hidden": {"mtp_hidden": "post_norm"},
            "untrained_layer": None}


def greedy_continuations(model, prompts: torch.Tensor, n: int) -> torch.Tensor:
    """(B, P + n): the target's own greedy answers to `prompts` (B, P), what method=mtp trains on."""
    with torch.no_grad():
        return model.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=n, do_sample=False,
                              min_new_tokens=n, pad_token_id=0, eos_token_id=None)


def train_layer(model, drafter: MTPDrafter, steps: int) -> MTPDrafter:
    """`steps` full-batch Adam steps of train/mtp.py's loss on the target's greedy continuations."""
    g = torch.Generator().manual_seed(1)
    ids = greedy_continuations(model, torch.randint(0, VOCAB, (24, 8), generator=g), 40)
    attention = torch.ones_like(ids)
    loss_mask = torch.ones_like(ids)
    loss_mask[:, :8] = 0  # the prompts
    with torch.no_grad():
        last = model.model(ids, output_hidden_states=True).hidden_states[-1]
    side = TargetHead(model.lm_head.weight, torch.ones(VOCAB, dtype=torch.bool))(last)
    optimizer = torch.optim.Adam(drafter.parameters(), lr=3e-3)
    for _ in range(steps):
        loss, _ = mtp_loss(drafter, ids, attention, loss_mask, last, side, K, 0.8)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return drafter.requires_grad_(False)


@pytest.fixture(scope="module")
def mimo(engine_ready, tmp_path_factory):
    """(the trained MiMo folder, the target model, the fresh layer it was trained from)."""
    model = tiny_llama(seed=0, vocab=VOCAB, heads=2, kv_heads=1)  # head_dim 32: vLLM's CPU attention has no 16
    fresh = MTPDrafter(mtp_config_from_target(model.config))
    init_mtp_layer(fresh.layers[0], generator=torch.Generator().manual_seed(0))
    trained = MTPDrafter(fresh.config)
    trained.load_state_dict(fresh.state_dict())
    train_layer(model, trained.attach(model), TRAIN_STEPS)
    folder = mtp_folders.save_as_mimo(model, tmp_path_factory.mktemp("engine-mtp") / "tiny-mimo", trained)
    tiny_tokenizer().save_pretrained(folder)
    return folder, model, fresh


def end_tokens(model) -> list[int]:
    """Where vLLM stops: the tokenizer's end token and the generation config's (a LlamaConfig's default, 2); the
    built-in decoder stops there too."""
    return sorted({tiny_tokenizer().convert_tokens_to_ids("<|im_end|>"), model.generation_config.eos_token_id})


def builtin_samples(folder, model, prompts, drafter=None, **fields) -> list:
    """The built-in decoder on `prompts` (target-only when `drafter` is None): one Sample per prompt, greedy, K = 3."""
    runner = TargetRunner(model, 128, mtp_folders.aux_layer_ids(model.config.num_hidden_layers))
    mtp = None
    if drafter is not None:
        for name, value in fields.items():
            setattr(drafter.config, name, value)
        for layer in drafter.layers:
            layer.fusion = drafter.config.mtp_fusion
        mtp = proposer(drafter.attach(model).eval(), VOCAB, 128)
    return [ev.to_sample("tiny", [speculative_generate(runner, mtp, torch.tensor(p), MAX_TOKENS, SamplingConfig(),
                                                       DraftingConfig("chain", K), end_tokens(model))])
            for p in prompts]


@pytest.fixture(scope="module")
def measured(mimo):
    """(built-in samples by name, the engine's result)."""
    folder, model, fresh = mimo
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, VOCAB, (8,), generator=g).tolist() for _ in range(N_PROMPTS)]
    samples = {ev.TARGET_ONLY: builtin_samples(folder, model, prompts),
               "mtp": builtin_samples(folder, model, prompts, mtp_folders.load_mtp(folder))}
    for name, fields in CONTROLS.items():
        drafter = mtp_folders.load_mtp(folder) if fields is not None else fresh
        samples[name] = builtin_samples(folder, model, prompts, drafter, **(fields or {}))
    job = ev_engine.engine_job(str(folder), prompts, MAX_TOKENS, end_tokens(model),
                               [{"name": ev_engine.TARGET_ONLY, "speculative_config": None},
                                {"name": "mtp", "k": K, "speculative_config": {"method": "mtp",
                                                                               "num_speculative_tokens": K}}],
                               warmup=0, batch=True)
    return samples, engine.run_job(job, timeout_s=1200)


def test_mtp_in_engine_equals_the_builtin_decoder(measured, record_property):
    """Loads, greedy output identical to target-only, τ and per-position acceptance equal to the built-in decoder's."""
    agree = mtp_engine_agreement(*measured, "mtp", K, record_property)
    assert agree["equal"], agree
    assert agree["steps_identical_fraction"] == 1.0, agree
    assert agree["per_position_engine"][0] > 0.5, agree  # a trained layer: most drafts are accepted


@pytest.mark.parametrize("name", list(CONTROLS))
def test_a_layer_computed_otherwise_fails_the_agreement(measured, name, record_property):
    """Negative controls: the built-in decoder with the fusion swapped, the post-norm hidden state or the untrained
    layer is lossless, and no longer agrees with vLLM's run of the trained MiMo."""
    agree = mtp_engine_agreement(*measured, name, K, record_property)
    assert not agree["equal"], agree
    assert agree["max_abs_delta"] > ev_engine.TOLERANCE, agree  # not only a step moved: τ itself is off
