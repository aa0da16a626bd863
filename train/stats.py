"""Per-step training statistics and their summary, shared by the methods that draft in steps or depths (EAGLE-3's
TTT steps, P-EAGLE's depths): a method's loss returns a (steps, columns) tensor of sums whose columns it declares
(`STEP_STATS`, plus `CHAIN_STATS` when it can follow one anchor's chain), and `summarize` turns the sums into
loss_i / acc_i / alpha_i, outside_draft and the expected acceptance length E[tau]."""

from __future__ import annotations

import torch

# Step i's row: sums over the scored positions; outside_draft counts those whose target argmax is outside the draft
# vocab.
STEP_STATS = ("loss_sum", "loss_count", "correct", "alpha_sum", "metric_count", "outside_draft")
# The chain columns sum, over the anchors t whose targets t+1 .. t+1+i all count (chain_count of them), the products
# over steps 0..i of [draft argmax right] and of alpha: the probability that a chain drafted at t gets i+1 tokens in.
CHAIN_STATS = ("chain_correct", "chain_alpha", "chain_count")


def summarize_steps(stats: torch.Tensor, columns: tuple[str, ...] = STEP_STATS + CHAIN_STATS) -> dict:
    """Per-step metrics from summed statistics (steps, len(columns)) (summed over micro-batches / ranks).

    Besides loss_i / acc_i / alpha_i: `outside_draft` (share of scored positions whose target argmax is
    outside the draft vocab) and the expected acceptance length of a chain of K = steps drafted tokens,
    no decoding needed: E[tau] = 1 + sum_{k=1..K} P(the first k drafts are accepted), bonus token
    included, `etau_greedy` with acceptance = the draft's argmax equals the target's and `etau_sample`
    with acceptance alpha_i. Term k is the mean, over anchors whose k targets all count, of the product
    over steps i < k (the chain_* columns); when a method has none (P-EAGLE) it is the product of the
    per-step means."""
    s = stats.double()
    out = {}
    terms_greedy, terms_sample, run_greedy, run_sample = [], [], 1.0, 1.0
    for i in range(s.shape[0]):
        row = dict(zip(columns, s[i].tolist()))
        n = max(row["metric_count"], 1)
        out[f"loss_{i}"] = row["loss_sum"] / max(row["loss_count"], 1)
        out[f"acc_{i}"] = row["correct"] / n
        out[f"alpha_{i}"] = row["alpha_sum"] / n
        run_greedy, run_sample = run_greedy * out[f"acc_{i}"], run_sample * out[f"alpha_{i}"]
        chained = row.get("chain_count", 0) > 0
        terms_greedy.append(row["chain_correct"] / row["chain_count"] if chained else run_greedy)
        terms_sample.append(row["chain_alpha"] / row["chain_count"] if chained else run_sample)
    out["outside_draft"] = s[0, columns.index("outside_draft")].item() / max(s[0, columns.index("metric_count")].item(), 1)
    out["etau_greedy"] = 1 + sum(terms_greedy)
    out["etau_sample"] = 1 + sum(terms_sample)
    return out
