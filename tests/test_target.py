"""Target loading: the embedded SmolLM2 cache is faithful to the GGUF; features sit at the documented indices."""

import pytest
import torch

from draftsmith.core.layers import default_aux_layer_ids
from draftsmith.data_gen.target import TargetConfig, load_target, smollm2_gguf_path


def test_default_aux_layers():
    assert default_aux_layer_ids(30) == [2, 15, 27]
    assert default_aux_layer_ids(8) == [2, 4, 5]


def test_tiny_features_at_documented_indices():
    target = load_target(TargetConfig(name="tiny", dtype="float32"))
    ids = torch.randint(0, target.vocab_size, (2, 7))
    aux, last = target.features(ids)
    ref = target.model(ids, output_hidden_states=True)
    hs = ref.hidden_states
    assert torch.equal(aux, torch.cat([hs[2], hs[4], hs[5]], dim=-1))
    assert torch.equal(last, hs[-1])
    torch.testing.assert_close(target.logits(last), ref.logits)


@pytest.mark.slow
def test_smollm2_cached_copy_matches_the_gguf():
    from transformers import AutoModelForCausalLM

    target = load_target(TargetConfig(name="smollm2", dtype="float32"))  # compared with the GGUF read in fp32
    assert (target.num_layers, target.hidden_size, target.vocab_size) == (30, 576, 49152)
    assert target.aux_layer_ids == [2, 15, 27]
    path = smollm2_gguf_path()
    direct = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    ids = target.tokenizer("The quick brown fox", return_tensors="pt").input_ids
    with torch.no_grad():
        torch.testing.assert_close(target.model(ids).logits, direct(ids).logits, rtol=0, atol=1e-4)
    rendered = target.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                                    add_generation_prompt=True)
    assert rendered.endswith("<|im_start|>assistant\n")
    assert target.tokenizer.convert_tokens_to_ids("<|im_end|>") in target.eos_token_ids
