"""The target-layer convention of feature-fed drafters: which layers' hidden states a drafter fuses when its
folder names none. data-gen captures them, train and eval compute them, and the heads' folders write them."""

from __future__ import annotations


def default_aux_layer_ids(num_layers: int) -> list[int]:
    """The target layers a feature-fed drafter fuses: the residual stream entering layers 2, N//2 and N-3 (HF
    hidden_states indices), as EAGLE-3 and the engines assume when a folder names none."""
    return [2, num_layers // 2, num_layers - 3]
