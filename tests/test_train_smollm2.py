"""(slow) On the embedded SmolLM2: data-gen -> a short EAGLE-3 training -> held-out step-0 accuracy far above chance."""

from __future__ import annotations

import pytest

from draftsmith.configs import compose
from draftsmith.train.run import run as train


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_short_training_learns(smollm2_data, tmp_path):
    """On the test run's SmolLM2 data-gen (conftest.py: 16 prompts x 64 tokens with hidden states, shared with the
    engine modules), 4 of them held out."""
    result = train(compose("train", ["method=eagle3", "target=smollm2", f"data={smollm2_data}",
                                     f"out={tmp_path / 'out'}", "deepspeed=none", "precision=auto", "epochs=6",
                                     "lr=1e-3", "method.ttt_steps=3", "method.draft_vocab_size=8192", "val_samples=4",
                                     "wandb.mode=disabled", "progress=false", "save_every=1000"]))
    assert result["mode"] == "offline"
    # chance is 1/8192; 0.1 is ~800x chance
    assert result["val"]["val_acc_0"] > 0.1, result["val"]
    assert (tmp_path / "out" / "final" / "config.json").is_file()
