"""Draft-model distillation on the tiny target: init, LoRA, export, assisted generation, resume, top-k cache."""

from __future__ import annotations

import json

import pytest
import torch
from omegaconf import OmegaConf
from safetensors.torch import load_file
from helpers import crash_after_step, make_tiny_data

from draftsmith.configs import check_config
from draftsmith.core import DraftsmithError
from draftsmith.data_gen.target import TargetConfig, load_target
from draftsmith.heads.draft import DraftLM, draft_from_model, draft_from_target, pick_layers
from draftsmith.heads.draft_folders import save_draft
from draftsmith.train.config import DeepSpeedConfig, TrainConfig
from draftsmith.train.draft import DraftConfig, LoraOptions
from draftsmith.train.run import run

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: more threads only add contention

LORA = {"r": 4, "lora_alpha": 8, "lora_dropout": 0.0, "target_modules": ["q_proj", "v_proj", "down_proj"]}


@pytest.fixture(scope="module")
def target():
    return load_target(TargetConfig(name="tiny", dtype="float32"))


@pytest.fixture(scope="module")
def tiny_data(tmp_path_factory, target):
    return make_tiny_data(tmp_path_factory.mktemp("data"), target, n=12)


def _cfg(data, out, method=None, deepspeed="none", **kw):
    kw = {"micro_batch_size": 2, "grad_accum": 2, **kw}
    cfg = OmegaConf.structured(TrainConfig(
        data=str(data), out=str(out), target=TargetConfig(name="tiny", dtype="float32"),
        method=method or DraftConfig(num_layers=2),
        epochs=2, save_every=2, keep_last=5, lr=3e-3, warmup_ratio=0.2,
        progress=False, deepspeed=DeepSpeedConfig(deepspeed), **kw))
    cfg.wandb.mode = "disabled"
    return check_config("train", cfg)  # the typed tree train's run takes


def _prompt(target):
    ids = target.tokenizer.apply_chat_template([{"role": "user", "content": "Say something nice."}],
                                               add_generation_prompt=True, return_tensors="pt", return_dict=True)
    return ids["input_ids"], ids["attention_mask"]


def test_layer_picks_and_copied_weights(target):
    assert pick_layers(30, 4, "first") == [0, 1, 2, 3]
    assert pick_layers(30, 6, "every") == [0, 5, 10, 15, 20, 25]
    assert pick_layers(30, 4, "spread") == [0, 10, 19, 29]
    draft = draft_from_target(target, [1, 7], None, train_embeddings=False)
    sd, tsd = draft.lm.state_dict(), target.model.state_dict()
    assert draft.lm.config.num_hidden_layers == 2 and not draft.lm.config.tie_word_embeddings
    torch.testing.assert_close(sd["model.layers.1.mlp.up_proj.weight"], tsd["model.layers.7.mlp.up_proj.weight"])
    torch.testing.assert_close(sd["lm_head.weight"], tsd["lm_head.weight"])
    assert sd["model.norm.weight"].data_ptr() != tsd["model.norm.weight"].data_ptr()  # a copy: the target stays frozen
    assert not draft.lm.get_input_embeddings().weight.requires_grad


def test_draft_config_refusals(compose_cfg):
    cfg = compose_cfg("train", "method=draft", "data=x", "method.loss=0.5*fkl+0.5*jsd", "method.lora.r=8")
    assert cfg.method.name == "draft" and cfg.method.lora.r == 8
    for bad, match in ((["method.loss=kl"], "method.loss="), (["method.hidden_size=32"], "only init=scratch"),
                       (["method.init=from_model"], "method.model="), (["method.temperature=0"], "method.temperature")):
        with pytest.raises(DraftsmithError, match=match):
            compose_cfg("train", "method=draft", "data=x", *bad)


def test_tokenizer_mismatch_is_refused(target, tmp_path):
    other = load_target(TargetConfig(name="tiny", dtype="float32"))
    other.tokenizer.add_tokens(["<extra>"])
    other.tokenizer.save_pretrained(tmp_path / "m")
    target.model.save_pretrained(tmp_path / "m")
    with pytest.raises(DraftsmithError, match=r"draft model .* does not share the tokenizer of target 'tiny'") as e:
        draft_from_model(str(tmp_path / "m"), target, None, False)
    assert str(e.value).count(".") <= 3  # one sentence


def test_lora_merged_export_gives_the_unmerged_logits(target, tmp_path):
    from transformers import AutoModelForCausalLM

    draft = draft_from_target(target, [0, 4], LORA, train_embeddings=False)
    with torch.no_grad():  # LoRA B starts at zero: give the adapters weight so the merge matters
        for name, p in draft.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    trainable = [n for n, p in draft.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    ids, mask = _prompt(target)
    with torch.no_grad():
        unmerged = draft(ids, mask)
        assert not torch.allclose(unmerged, draft_from_target(target, [0, 4], None, False)(ids, mask), atol=1e-4)
    save_draft(draft, tmp_path / "export", target.identity())
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "export").eval()
    assert not any("lora" in k for k in load_file(str(tmp_path / "export" / "model.safetensors")))
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids, attention_mask=mask).logits, unmerged, rtol=1e-4, atol=1e-5)
    rebuilt = type(draft)(draft.config)  # what the trainer's final save does
    rebuilt.load_state_dict(draft.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(rebuilt(ids, mask), unmerged)


def test_export_is_an_assistant_model_with_the_targets_greedy_output(target, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    save_draft(draft_from_target(target, [0, 7], None, False), tmp_path / "d", target.identity())
    names = {p.name for p in (tmp_path / "d").iterdir()}
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json", "manifest.json"} <= names
    assistant = AutoModelForCausalLM.from_pretrained(tmp_path / "d").eval()
    assert AutoTokenizer.from_pretrained(tmp_path / "d").get_vocab() == target.tokenizer.get_vocab()
    ids, mask = _prompt(target)
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=24, do_sample=False)
    plain = target.model.generate(**kw)
    assisted = target.model.generate(**kw, assistant_model=assistant)
    assert torch.equal(plain, assisted)


@pytest.mark.parametrize("deepspeed,lora", [("none", False), ("zero2", True)])
def test_resume_is_exact(tiny_data, tmp_path, deepspeed, lora):
    method = DraftConfig(num_layers=2, loss="0.5*fkl+0.5*ce", lora=LoraOptions(enabled=lora, r=4))
    full = run(_cfg(tiny_data, tmp_path / "full", method, deepspeed))
    assert full["steps"] == 6
    with crash_after_step(3), pytest.raises(RuntimeError, match="simulated crash"):
        run(_cfg(tiny_data, tmp_path / "cut", method, deepspeed))
    resumed = run(_cfg(tiny_data, tmp_path / "cut", method, deepspeed, resume="true"))
    a = load_file(str(tmp_path / "full/checkpoints/step_00000006/head.safetensors"))
    b = load_file(str(tmp_path / "cut/checkpoints/step_00000006/head.safetensors"))
    assert a.keys() == b.keys() and any(("lora_" in k) == lora for k in a)
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=1e-6, msg=k)
    assert resumed["metrics"]["loss"] == pytest.approx(full["metrics"]["loss"], abs=1e-6)
    records = [__import__("json").loads(x) for x in (tmp_path / "full/metrics.jsonl").read_text().splitlines()]
    assert records[-1]["loss"] < records[0]["loss"] and {"loss_fkl", "alpha_0", "acc_0"} <= set(records[-1])


def test_topk_cache_with_k_equal_to_vocab_trains_like_online(target, tmp_path):
    """data-gen's top-k cache (data_gen/topk.py) at k = V: offline training gives the online losses."""
    from draftsmith.core.artifacts import read_manifest, write_manifest
    from draftsmith.data_gen.topk import bytes_per_token, capture_topk_logits

    data = make_tiny_data(tmp_path / "data", target, n=8)
    import datasets

    ids = datasets.load_from_disk(str(data / "tokenized"))["input_ids"]
    index = capture_topk_logits(target, ids, data / "topk_logits", k=target.vocab_size, samples_per_shard=3)
    manifest = read_manifest(data)
    write_manifest(data, "data_gen", manifest["target"], manifest["counts"], hidden_states=None,
                   topk_logits={"k": index["k"], "temperature": 1.0, "bytes_per_token": bytes_per_token(index["k"])})
    method = DraftConfig(num_layers=2, loss="0.25*fkl+0.25*rkl+0.25*jsd+0.25*tv")
    # precision=fp32: the default before precision=auto (bf16 autocast rounds online and offline differently)
    online = run(_cfg(data, tmp_path / "on", method, mode="online", max_steps=2, precision="fp32"))
    offline = run(_cfg(data, tmp_path / "off", method, mode="offline", max_steps=2, precision="fp32"))
    assert offline["mode"] == "offline" and online["mode"] == "online"
    for key in ("loss", "loss_fkl", "loss_rkl", "loss_jsd", "loss_tv", "alpha_0", "acc_0"):
        assert offline["metrics"][key] == pytest.approx(online["metrics"][key], rel=1e-4, abs=1e-6), key
    with pytest.raises(DraftsmithError, match="temperature 1.0, but method.temperature=2.0"):
        run(_cfg(data, tmp_path / "t2", DraftConfig(num_layers=2, temperature=2.0), mode="offline", max_steps=1))


def test_from_model_with_lora_trains_and_exports_a_plain_model(target, tiny_data, tmp_path):
    from transformers import AutoModelForCausalLM

    save_draft(draft_from_target(target, [0, 3], None, False), tmp_path / "small", target.identity())
    method = DraftConfig(init="from_model", model=str(tmp_path / "small"), lora=LoraOptions(r=4))
    result = run(_cfg(tiny_data, tmp_path / "out", method, max_steps=2))
    final = AutoModelForCausalLM.from_pretrained(result["final"])
    assert final.config.num_hidden_layers == 2
    assert not any("lora" in k for k in load_file(f"{result['final']}/model.safetensors"))
    assert isinstance(draft_from_model(str(tmp_path / "small"), target, LORA, False), DraftLM)


def test_export_format_hf_writes_a_bf16_hf_folder(target, tmp_path):
    from transformers import AutoModelForCausalLM

    from draftsmith.export import ExportConfig, run as export_run

    save_draft(draft_from_target(target, [0, 7], None, False), tmp_path / "d", target.identity())
    out = export_run(ExportConfig(head=str(tmp_path / "d"), out=str(tmp_path / "e")))  # the draft's first format: hf
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.dtype == torch.bfloat16 and (out / "tokenizer.json").is_file() and (out / "manifest.json").is_file()


def test_data_gen_topk_logits_then_offline_training(compose_cfg, tmp_path):
    import json

    from draftsmith.data_gen.run import run as data_gen

    questions = tmp_path / "q.jsonl"
    questions.write_text("".join(json.dumps({"question_id": i, "category": "c", "turns": [f"Question {i}?"]}) + "\n"
                                 for i in range(5)))
    out = tmp_path / "data"
    args = ["target=tiny", "prompts=question", f"prompts.path={questions}", "max_new_tokens=6", f"out={out}",
            "topk_logits=true", "topk_k=8", "samples_per_shard=2"]
    data_gen(compose_cfg("data_gen", *args))
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["topk_logits"]["k"] == 8 and manifest["topk_logits"]["bytes_per_token"] == 8 * 8 + 4
    index = json.loads((out / "topk_logits" / "index.json").read_text())
    assert index["complete"] and len(index["shards"]) == 3
    result = run(_cfg(out, tmp_path / "train", DraftConfig(num_layers=1, loss="rkl"), max_steps=1, micro_batch_size=1,
                      grad_accum=1))
    assert result["mode"] == "offline" and result["metrics"]["loss_rkl"] >= 0


def test_help_lists_the_draft_options(capsys):
    from draftsmith.cli import main

    with pytest.raises(SystemExit) as e:
        main(["train", "method=draft", "--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0 and "method.loss=fkl" in out and "method.lora.r=16" in out


def test_publish_dry_run_writes_a_draft_model_folder_and_card(target, tiny_data, tmp_path):
    """A trained draft model publishes like a head: the HF folder at the root, a card whose serving commands are
    eval's (vLLM draft_model, SGLang STANDALONE) and whose method section names the distillation run."""
    import shlex

    from huggingface_hub import ModelCard
    from transformers import AutoModelForCausalLM

    from draftsmith.cli import main

    result = run(_cfg(tiny_data, tmp_path / "out", DraftConfig(num_layers=2, loss="jsd"), max_steps=2))
    main(["publish", f"head={tmp_path / 'out'}", "repo_id=me/tiny-draft", f"out={tmp_path / 'hub'}", "dry_run=true",
          "allow_no_eval=true", "license=mit", "base_model=a/b", "num_speculative_tokens=4"])
    hub = tmp_path / "hub"
    model = AutoModelForCausalLM.from_pretrained(hub)
    assert model.config.num_hidden_layers == 2 and model.dtype == torch.bfloat16
    assert (hub / "tokenizer.json").is_file() and result["final"]
    card = ModelCard.load(hub / "README.md")
    assert "draft-model" in card.data.tags and card.data.base_model == "a/b"
    assert "loss jsd" in card.text and "2 of the target's layers" in card.text
    blocks = card.text.split("```bash\n")[1:]
    vllm, sglang = (shlex.split(b.split("```")[0].replace("\\\n", " ")) for b in blocks[:2])
    assert vllm[:4] == ["vllm", "serve", "a/b", "--speculative-config"]
    assert json.loads(vllm[4]) == {"method": "draft_model", "model": "me/tiny-draft", "num_speculative_tokens": 4}
    assert sglang[sglang.index("--speculative-algorithm") + 1] == "STANDALONE"
    assert sglang[sglang.index("--speculative-draft-model-path") + 1] == "me/tiny-draft"
