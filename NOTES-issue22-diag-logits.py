"""Issue 22 diagnosis: the drafter's logits per cycle in the built-in decoder and inside vLLM, for one prompt.

Run from the repository root (after the engine test's setup wrote /tmp/wt22_diag/{data,x-dflash}):
    .venv/bin/python NOTES-issue22-diag-logits.py ours 1         # built-in side; writes /tmp/d22/ours.*
    .venv-vllm/bin/python NOTES-issue22-diag-logits.py theirs     # vLLM side, in-process; writes /tmp/d22/theirs.*
    .venv/bin/python NOTES-issue22-diag-logits.py compare         # per cycle: feature and logit differences
(NOTES-issue22.md section 6 has what it showed.)
"""

import sys


def ours():
    import json, sys
    sys.path.insert(0, "tests")
    import torch
    from safetensors.torch import save_file
    from test_engine_vllm import COMMON, N_PROMPTS
    from draftsmith.configs import compose
    from draftsmith.eval import engine_vllm as ev_engine
    from draftsmith.eval import run as ev
    from draftsmith.eval.proposers.dflash import DFlashProposer
    from draftsmith.methods import methods

    K, MAX, PI = 3, 96, int(sys.argv[2]) if len(sys.argv) > 2 else 1
    head, data = "/tmp/wt22_diag/x-dflash", "/tmp/wt22_diag/data"
    cfg = compose("eval", COMMON + [f"head={head}", "prompts.source=holdout", f"prompts.path={data}",
                                    f"prompts.holdout={N_PROMPTS}", f"max_new_tokens={MAX}", "repeats=1", "warmup_prompts=0",
                                    "progress=false", f"drafting.num_speculative_tokens={K}", "out=/tmp/d22/eval"])
    setup = ev.prepare(cfg)
    drafter = ev.load_drafter(cfg, setup.target, setup.runner.max_len)
    rec, state = {}, {"prompt": -1, "cycle": 0}
    orig_reset, orig_fwd = DFlashProposer.reset, DFlashProposer._forward
    def reset(self, ids):
        state["prompt"] += 1; state["cycle"] = 0
        return orig_reset(self, ids)
    def fwd(self, k):
        feats = self.pending.clone()
        L = len(self.seq)
        logits = orig_fwd(self, k)
        if state["prompt"] == PI:
            c = state["cycle"]
            rec[f"logits.{c}"] = logits.float().cpu().clone().contiguous()
            rec[f"feats.{c}"] = feats.float().cpu().clone().contiguous()
            rec[f"L.{c}"] = torch.tensor([L])
        state["cycle"] += 1
        return logits
    DFlashProposer.reset, DFlashProposer._forward = reset, fwd
    inter = {}
    def hook(name):
        def f(mod, inp, out):
            if state["prompt"] == PI and state["cycle"] == 0:
                o = out[0] if isinstance(out, tuple) else out
                inter[name] = o.detach().float().reshape(-1, o.shape[-1]).cpu().clone().contiguous()
                inter[name + ".in"] = inp[0].detach().float().reshape(-1, inp[0].shape[-1]).cpu().clone().contiguous()
        return f
    hd = drafter.head if hasattr(drafter, "head") else None
    import draftsmith.heads.dflash as hdf
    orig_init = DFlashProposer.__init__
    def init(self, *a, **k):
        orig_init(self, *a, **k)
        for i, l in enumerate(self.head.layers):
            l.self_attn.register_forward_hook(hook(f"l{i}.attn")); l.mlp.register_forward_hook(hook(f"l{i}.mlp"))
            l.self_attn.q_proj.register_forward_hook(hook(f"l{i}.q_proj"))
        self.head.norm.register_forward_hook(hook("norm")); self.head.fc.register_forward_hook(hook("fc"))
        self.head.hidden_norm.register_forward_hook(hook("hidden_norm"))
    DFlashProposer.__init__ = init
    samples, _ = ev.decode_all(setup, {ev.TARGET_ONLY: None, "dflash": drafter.make()}, ev.Drafter("all", None))
    s = samples["dflash"][PI]
    save_file(rec, "/tmp/d22/ours.safetensors"); save_file(inter, "/tmp/d22/ours_inter.safetensors"); print(sorted(inter))
    spec = ev_engine.speculative_config("dflash", methods()["dflash"].engines, head, K)
    job = ev_engine.engine_job(ev_engine.served_target(setup.target), [s.prompt_ids], MAX, setup.target.eos_token_ids,
                               [{"name": "dflash", "k": K, "speculative_config": spec}])
    json.dump({"job": job, "tokens": s.tokens, "steps": ev_engine.builtin_steps(s)}, open("/tmp/d22/ours.json", "w"))
    print("prompt", PI, "cycles", sum(1 for n in rec if n.startswith("L.")), "steps", ev_engine.builtin_steps(s))


def theirs():
    import json, os, sys
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    import torch
    from safetensors.torch import save_file
    sys.path.insert(0, "scripts")
    import vllm_worker
    from vllm import SamplingParams, TokensPrompt
    from vllm.model_executor.models import qwen3_dflash as q
    M = q.DFlashQwen3ForCausalLM
    d = json.load(open("/tmp/d22/ours.json")); job = d["job"]
    rec, on, n = {}, [False], {"logits": 0, "feats": 0, "ctxpos": 0, "qpos": 0}
    def put(kind, t):
        if on[0]:
            rec[f"{kind}.{n[kind]}"] = t.detach().float().cpu().clone().contiguous(); n[kind] += 1
    oc, op, ol, of = M.combine_hidden_states, M.precompute_and_store_context_kv, M.compute_logits, M.forward
    def comb(self, h):
        put("feats", h); return oc(self, h)
    def pre(self, states, pos, slots=None):
        if slots is not None: put("ctxpos", pos)
        return op(self, states, pos, slots)
    def logits(self, h):
        out = ol(self, h)
        if self.draft_id_to_target_id is not None:
            tg = torch.arange(self.config.draft_vocab_size) + self.draft_id_to_target_id
            put("logits", out[:, tg])
        else:
            put("logits", out)
        return out
    def fwd(self, input_ids, positions, inputs_embeds=None):
        put("qpos", positions); return of(self, input_ids, positions, inputs_embeds)
    M.combine_hidden_states, M.precompute_and_store_context_kv, M.compute_logits, M.forward = comb, pre, logits, fwd
    inter, first = {}, [True]
    def hook(name):
        def f(mod, inp, out):
            if on[0] and n["logits"] == 0 and name + ".in" not in inter:
                o = out[0] if isinstance(out, tuple) else out
                i0 = inp[0] if inp else None
                inter[name] = o.detach().float().reshape(-1, o.shape[-1]).cpu().clone().contiguous()
                if i0 is not None and torch.is_tensor(i0):
                    inter[name + ".in"] = i0.detach().float().reshape(-1, i0.shape[-1]).cpu().clone().contiguous()
        return f
    oi = q.DFlashQwen3Model.__init__
    def minit(self, *a, **k):
        oi(self, *a, **k)
        for i, l in enumerate(self.layers):
            l.self_attn.register_forward_hook(hook(f"l{i}.attn")); l.mlp.register_forward_hook(hook(f"l{i}.mlp"))
        self.norm.register_forward_hook(hook("norm")); self.fc.register_forward_hook(hook("fc"))
    q.DFlashQwen3Model.__init__ = minit
    run = job["runs"][0]
    llm = vllm_worker.build_llm(job, run)
    params = SamplingParams(temperature=0.0, max_tokens=int(job["max_tokens"]), stop_token_ids=list(job.get("stop_token_ids") or []), detokenize=False)
    on[0] = True
    out = llm.generate([TokensPrompt(prompt_token_ids=job["prompts"][0])], params, use_tqdm=False)[0]
    on[0] = False
    save_file(rec, "/tmp/d22/theirs.safetensors"); save_file(inter, "/tmp/d22/theirs_inter.safetensors"); print(sorted(inter))
    m = out.outputs[0].spec_decode_metrics
    json.dump({"tokens": list(out.outputs[0].token_ids), "metrics": m.to_dict() if m else None}, open("/tmp/d22/theirs.json", "w"))
    print("counts", n, "identical tokens", list(out.outputs[0].token_ids) == d["tokens"])


def compare():
    import torch
    from safetensors.torch import load_file
    a, b = load_file("/tmp/d22/ours.safetensors"), load_file("/tmp/d22/theirs.safetensors")
    n = min(sum(k.startswith("L.") for k in a), sum(k.startswith("logits.") for k in b))
    for c in range(n):
        fa, fb = a[f"feats.{c}"], b[f"feats.{c}"]
        la, lb = a[f"logits.{c}"], b[f"logits.{c}"]
        fd = (fa - fb).abs().max().item() if fa.shape == fb.shape else f"shape {tuple(fa.shape)} vs {tuple(fb.shape)}"
        top = la.topk(2, -1)
        marg = (top.values[:, 0] - top.values[:, 1])
        print(c, "L", int(a[f"L.{c}"]), "ctxpos", b[f"ctxpos.{c}"][[0, -1]].long().tolist(), "qpos", b[f"qpos.{c}"].long().tolist(),
              "feat maxdiff", fd if isinstance(fd, str) else f"{fd:.2e}", "feat max", f"{fa.abs().max():.1f}",
              "logit maxdiff", f"{(la - lb).abs().max():.2e}", "argmax eq", (la.argmax(-1) == lb.argmax(-1)).tolist(),
              "margin0", f"{marg[0]:.4f}")


if __name__ == "__main__":
    {"ours": ours, "theirs": theirs, "compare": compare}[sys.argv[1]]()
