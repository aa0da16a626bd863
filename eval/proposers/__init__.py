"""Proposers: what drafts tokens for the decoder. Each implements `Proposer` (eval/decoder.py):

    reset(prompt_ids)            forget the last prompt
    update(tokens, aux)          the target emitted `tokens`; aux = the features the drafter reads (T, 3H) of the
                                 positions just verified and accepted (the prompt after prefill)
    propose(drafting, sampling, generator) -> Draft (target ids, parents, q or None = one-hot)

Target-only decoding has no proposer (None). One file per drafting method, each with the same hook,
`proposer(drafter, target_vocab_size, max_len) -> Proposer`, which the method table names
(draftsmith.core.methods): eagle3.py, peagle.py, dflash.py, dspark.py, draft.py. What they share is kit.py (the
chain/tree builder, `sample_chain`, `OneForwardProposer`: the cache and bookkeeping of a drafter that drafts K tokens
in one forward, P-EAGLE's, DFlash's and DSpark's, and `BlockProposer`: the block drafter's forward, DFlash's and
DSpark's);
ngram.py is eval's own n-gram proposer (no training) and the n-gram-first combination.
"""
