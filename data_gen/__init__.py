"""The target side: loading targets, prompt sources, regeneration, tokenization, hidden-state capture."""
