"""The DFlash drafter: the block drafter of heads/block.py as it is (a block of K tokens from ONE forward over mask
slots, the target's features as every layer's context). It lives in that kit because DSpark (heads/dspark.py) is
the same backbone plus two small heads, and a method imports the shared kits, never a sibling method."""

from __future__ import annotations

from .block import DFlashAttention, DFlashHead, DFlashLayer, block_mask, dflash_config_from_target

__all__ = ["DFlashAttention", "DFlashHead", "DFlashLayer", "block_mask", "dflash_config_from_target"]
