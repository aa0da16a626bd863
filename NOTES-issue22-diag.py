"""Which verification differs between vLLM and the built-in DFlash decoder, and how close the drafter's top-2 were."""
import json, sys
sys.path.insert(0, "/work/wt22/tests")
import torch
from test_engine_vllm import COMMON, N_PROMPTS
from draftsmith import engine
from draftsmith.configs import compose
from draftsmith.eval import engine_vllm as ev_engine
from draftsmith.eval import run as ev
from draftsmith.eval.proposers.dflash import DFlashProposer
from draftsmith.methods import methods

K, MAX = 3, 96
head, data = "/tmp/wt22_diag/x-dflash", "/tmp/wt22_diag/data"
cfg = compose("eval", COMMON + [f"head={head}", "prompts.source=holdout", f"prompts.path={data}",
                                f"prompts.holdout={N_PROMPTS}", f"max_new_tokens={MAX}", "repeats=1", "warmup_prompts=0",
                                "progress=false", f"drafting.num_speculative_tokens={K}", "out=/tmp/wt22_diag/eval"])
setup = ev.prepare(cfg)
drafter = ev.load_drafter(cfg, setup.target, setup.runner.max_len)
margins = []
orig = DFlashProposer._forward
def rec(self, k):
    logits = orig(self, k)
    top = logits.float().topk(2, dim=-1).values
    margins.append((len(self.seq), (top[:, 0] - top[:, 1]).tolist()))
    return logits
DFlashProposer._forward = rec
samples, _ = ev.decode_all(setup, {ev.TARGET_ONLY: None, "dflash": drafter.make()}, ev.Drafter("all", None))
spec = ev_engine.speculative_config("dflash", methods()["dflash"].engines, head, K)
runs = [{"name": ev_engine.TARGET_ONLY, "speculative_config": None}, {"name": "dflash", "k": K, "speculative_config": spec}]
job = ev_engine.engine_job(ev_engine.served_target(setup.target), [s.prompt_ids for s in samples["target_only"]],
                           MAX, setup.target.eos_token_ids, runs)
result = engine.run_job(job, timeout_s=1800)
run = result["runs"]["dflash"]
print("agreement", ev_engine.agreement(samples["dflash"], run, K))
for i, (s, d) in enumerate(zip(samples["dflash"], run["per_request"])):
    ours, theirs = ev_engine.builtin_steps(s), d["per_step_accepted"]
    first = next((j for j, (a, b) in enumerate(zip(ours, theirs)) if a != b), None)
    print(i, "steps", len(ours), len(theirs), "first differing", first,
          "ours", ours[max(0, (first or 0) - 2):(first or 0) + 3], "vllm", theirs[max(0, (first or 0) - 2):(first or 0) + 3])
json.dump({"margins": margins}, open("/tmp/wt22_diag/margins.json", "w"))
