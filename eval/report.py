"""Reports of an eval run: report.json, report.md and a PNG plot, each written atomically."""

from __future__ import annotations

import io
import os
import platform
import sys
from pathlib import Path
from typing import Optional

import torch
import transformers

from ..core import __version__
from ..core.artifacts import atomic_write_bytes, atomic_write_json


def software_versions() -> dict:
    return {"python": platform.python_version(), "torch": torch.__version__,
            "transformers": transformers.__version__, "draftsmith": __version__}


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def hardware(device: str) -> dict:
    info = {"cpu": cpu_model(), "cpu_cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "device": str(device), "platform": sys.platform}
    if str(device).startswith("cuda") and torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(torch.device(device))
    return info


def _f(x: float, digits: int = 2) -> str:
    return f"{x:.{digits}f}"


def _opt(x: Optional[float], unit: str = "") -> str:
    """_f, or "-" where there is no figure (a K not decoded)."""
    return "-" if x is None else f"{_f(x)}{unit}"


def _about(report: dict) -> str:
    """" (the target's own MTP layer)" where eval names the drafter beyond its method (eval/run.py), else ""."""
    description = (report.get("drafter") or {}).get("description")
    return f" ({description})" if description else ""


def markdown(report: dict) -> str:
    """A human-readable report: settings, the overall row, baselines, one row per category, conventions."""
    d = report["drafting"]
    lines = [
        f"# draftsmith eval: {report['method']} on {report['target']['target_id']}",
        "",
        f"- head: `{report['head']}`{_about(report)}",
        f"- sampling: temperature {report['temperature']}, top_k {report['top_k']}, top_p {report['top_p']}",
        f"- drafting: {d['mode']}, K = {d['num_speculative_tokens']}"
        + (f", tree_top_k {d['tree_top_k']}, tree_budget {d['tree_budget']}" if d["mode"] == "tree" else ""),
        f"- prompts: {report['n_prompts']} ({report['prompts']['source']}: {report['prompts']['path']}), "
        f"{report['n_samples']} decoded turns, {report['new_tokens']} new tokens, max_new_tokens {report['max_new_tokens']}",
        f"- timing: median of {report['repeats']} runs, {report['warmup_prompts']} warm-up prompt(s) excluded",
        f"- hardware: {report['hardware']['cpu']} ({report['hardware']['cpu_cores']} cores), device {report['hardware']['device']}",
        *dtype_lines(report),
        "- software: " + ", ".join(f"{k} {v}" for k, v in report["software"].items()),
        "",
        "| category | n | tau | target-only tok/s | speculative tok/s | speedup |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    rows = [("**all**", report)] + list(report["per_category"].items())
    for name, r in rows:
        n = r.get("n", r.get("n_samples"))
        lines.append(f"| {name} | {n} | {_f(r['tau'])} | {_f(r['target_only_tokens_per_s'], 1)} | "
                     f"{_f(r['speculative_tokens_per_s'], 1)} | {_f(r['speedup'])}x |")
    if report.get("baselines"):
        lines += ["", "## Baselines (same prompts)", "",
                  "| method | tau | tok/s | speedup vs our target-only |", "|---|---:|---:|---:|"]
        for name, b in report["baselines"].items():
            t = _f(b["tau"]) if b.get("tau") is not None else "-"
            lines.append(f"| {name} | {t} | {_f(b['tokens_per_s'], 1)} | {_f(b['speedup'])}x |")
    acc = report["per_position_acceptance"]
    if acc:
        lines += ["", "## Per-position acceptance", "",
                  "| position | " + " | ".join(str(i + 1) for i in range(len(acc))) + " |",
                  "|---|" + "---:|" * len(acc),
                  "| accepted / proposed | " + " | ".join(_f(a, 3) for a in acc) + " |"]
    hist = report.get("accepted_length_histogram") or {}
    if hist:
        lines += ["", "## Accepted length (tokens emitted per verification, bonus included)", "",
                  "| tokens emitted | " + " | ".join(hist) + " |",
                  "|---|" + "---:|" * len(hist),
                  "| verifications | " + " | ".join(str(c) for c in hist.values()) + " |"]
    lines += cost_lines(report) + greedy_lines(report) + engine_lines(report) + llamacpp_lines(report)
    lines += ["", "## Conventions", "", report["conventions"], ""]
    return "\n".join(lines)


def dtype_lines(report: dict) -> list[str]:
    """`- target dtype: bfloat16 (why); measured here: verifying K+1 = 4 tokens costs 1.07 decode steps`."""
    if not report.get("target_dtype"):
        return []
    line = f"- target dtype: {report['target_dtype']}"
    if report.get("target_dtype_why"):
        line += f" ({report['target_dtype_why']})"
    cost = report.get("target_dtype_cost") or {}
    if cost.get("verify_over_step") is not None:
        line += (f"; measured here in {cost['dtype']}: verifying K+1 = {cost['verify_tokens']} tokens costs "
                 f"{cost['verify_over_step']:.2f} decode steps (cost model)")
    return [line]


def _ms(x) -> str:
    return "-" if x is None else f"{x * 1000:.1f}"


def _clock_lines(cm: dict) -> list[str]:
    """What the prediction reads from the decode's own clock, beside the isolated passes (eval/cost.py)."""
    clock = cm.get("decode_clock") or {}
    if not clock.get("step_s"):
        return []
    timed = cm["target"]["step_s"]
    rows = [r for r in cm["table"] if r.get("predicted_speedup_timed_passes") is not None and r["measured_tau"]]
    return [f"The prediction reads the decode's own clock: t_step = {_ms(clock['step_s'])} ms in the target-only "
            f"decode against {_ms(timed)} ms for the isolated pass ({timed / clock['step_s']:.2f}x), t_verify at a "
            f"decoded K its verifications' own seconds, each side's prefill added. On the isolated passes alone it "
            f"would have predicted " + ", ".join(f"K={r['k']}: {_f(r['predicted_speedup_timed_passes'])}x"
                                                 for r in rows) + ".", ""]


def cost_lines(report: dict) -> list[str]:
    """The cost model (measured step / verify / draft times, predicted beside measured speedup) and what to set."""
    cm = report.get("cost_model")
    if not cm:
        return []
    t = cm["target"]
    lines = ["", "## Cost model", "", f"`{cm['formula']}`; the isolated passes timed over a {t['context']}-token "
             f"cache (median of {t['repeats']}), t_draft = the drafter's seconds per verification in the decode, "
             f"tau predicted from the per-position acceptance of the K={cm['acceptance_from_k']} run.", "",
             f"isolated: t_step = {_ms(t['step_s'])} ms; t_verify(n) / t_step: "
             + ", ".join(f"n={n}: {v / t['step_s']:.2f}" for n, v in t["verify_s"].items() if t["step_s"])
             + (("; tree n=" + ", ".join(f"{n}: {v / t['step_s']:.2f}" for n, v in t["tree_verify_s"].items()))
                if t.get("tree_verify_s") else ""), "",
             *_clock_lines(cm),
             "| K | verify tokens | t_verify ms | t_draft ms | break-even tau | predicted tau | measured tau "
             "| predicted speedup | measured speedup |", "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in cm["table"]:
        mt = "-" if r["measured_tau"] is None else _f(r["measured_tau"])
        ms = "-" if r["measured_speedup"] is None else f"{_f(r['measured_speedup'])}x"
        lines.append(f"| {r['k']} | {r['verify_tokens']} | {_ms(r['t_verify_s'])} | {_ms(r['t_draft_s'])} | "
                     f"{_f(r['break_even_tau'])} | {_f(r['predicted_tau'])} | {mt} | {_f(r['predicted_speedup'])}x | {ms} |")
    rec = report.get("recommendation")
    if rec:
        verdict = ("faster than target-only decoding" if rec["faster_than_target_only"] else
                   "still slower than target-only decoding on this hardware: do not turn speculative decoding on "
                   "with this head here; these are the least slow settings")
        where = {"vllm": " in vLLM", "llamacpp": " in llama.cpp"}.get(rec.get("measured_by"), "")
        what = f"{rec['drafter']}, " if rec.get("drafter") else ""
        predicted = f" (predicted {_f(rec['predicted_speedup'])}x)" if rec.get("predicted_speedup") is not None else ""
        lines += ["", "## Recommendation", "",
                  f"Best measured{where}: {what}{rec['mode']} K = {rec['k']}, {_f(rec['measured_speedup'])}x"
                  f"{predicted}, {verdict}.", ""]
        for engine in ENGINE_NAMES:
            if engine not in rec:
                continue
            e = rec.get(engine) or {}
            lines += [f"{ENGINE_NAMES[engine]}:", ""]
            if e.get("command"):
                shell = [e["export_command"], e["command"]] if e.get("export_command") else [e["command"]]
                lines += ["```bash", *shell, "```", ""]
            else:
                lines += [e.get("note", "-"), ""]
    return lines


ENGINE_NAMES = {"vllm": "vLLM", "sglang": "SGLang", "llamacpp": "llama.cpp"}


def agreement_cells(run: dict, checked: bool = True) -> tuple[str, str, str, str]:
    """An engine run's built-in columns: τ, per-position, the equality check and the speedup ("-" where absent).
    `checked` False: the engine served another function (a quantised GGUF target or head), so the equality is a
    reading."""
    a = run.get("agreement") or {}
    ours = " / ".join(_f(x, 3) for x in a.get("per_position_builtin", [])) or "-"
    if not a:
        eq = "-"
    elif checked:
        eq = f"{'yes' if a['equal'] else '**no**'} ({a['tolerance']})"
    else:
        eq = f"{'yes' if a['equal'] else 'no'} (quantised target or head: not expected)"
    tb = _f(a["tau_builtin"], 3) if a else "-"
    sb = f"{_f(run['builtin_speedup'])}x" if run.get("builtin_speedup") is not None else "-"
    return tb, ours, eq, sb


def llamacpp_lines(report: dict) -> list[str]:
    """engine=llamacpp: the same prompts in llama-server, one row per drafter × head GGUF type × K beside the
    built-in decoder's figures, and the fastest named."""
    e = report.get("llamacpp")
    if not e:
        return []
    types = e.get("head_gguf_outtypes")  # none without a head
    head = f", head GGUF {' / '.join(types)}" if types else ""
    lines = ["", f"## llama.cpp {e['version']} (the same prompts, engine=llamacpp)", "",
             f"- target {e['target']} ({e['target_weights']}){head}, greedy, one slot, {e['threads']} threads; "
             f"target-only "
             f"output identical to the built-in decoder's: {_f(e['target_only_identical_to_builtin'])}; target-only "
             f"{_f(e['target_only_tokens_per_s'], 1)} tok/s",
             f"- counting: {e['counting']}",
             f"- greedy identical: to llama.cpp's target-only output; up to near-ties: or the first divergence is "
             f"where the target's top-2 logits are closer than {e.get('near_tie_eps')} (llama.cpp's kernels sum "
             "in another order over K+1 rows than over one); τ is compared over the identical prompts", "",
             "| run | head GGUF | K | tau llama.cpp | tau built-in | per-position llama.cpp | per-position built-in "
             "| equal (tol) | greedy identical | up to near-ties | tokens/s llama.cpp | speedup llama.cpp "
             "| speedup built-in |",
             "|---|---|---:|---:|---:|---|---|---|---:|---:|---:|---:|---:|"]
    for name, r in e["runs"].items():
        tb, ours, eq, sb = agreement_cells(r, checked=same_function(e, r))
        lines.append(f"| {name} | {r.get('gguf_outtype') or '-'} | {r.get('k', '-')} | {_f(r['tau'], 3)} | {tb} | "
                     f"{' / '.join(_f(x, 3) for x in r['per_position_acceptance'])} | {ours} | {eq} | "
                     f"{_f(r['greedy_identical_to_engine_target_only'])} | "
                     f"{_opt(r.get('greedy_identical_up_to_near_ties'))} | "
                     f"{_opt(r.get('speculative_tokens_per_s'))} | {_f(r['speedup'])}x | {sb} |")
    if e.get("fastest"):
        name, best = e["fastest"], e["runs"][e["fastest"]]
        figures = f"{_f(best['speculative_tokens_per_s'], 1)} tok/s, {_f(best['speedup'])}x target-only"
        lines += ["", f"Fastest in llama.cpp: {name} ({figures})." if best["speedup"] > 1.0 else
                      f"Fastest in llama.cpp: none is faster than target-only; {name} is the least slow ({figures})."]
    found = [d | {"expected": not e.get("same_function_as_builtin", True)}
             for d in e.get("target_only_divergences", [])]
    found += [d | {"run": n, "expected": not same_function(e, r)} for n, r in e["runs"].items()
              for d in r.get("divergences", [])]
    if found:
        lines += ["", "Where an output leaves its target-only reference:", ""]
    for d in found:
        expected = " (a quantised target or head: expected)" if d["expected"] else ""
        lines.append(f"- {d.get('run', 'target-only vs built-in')}: prompt {d['prompt']} leaves at token "
                     f"{d['position']}, top-2 margin {_f(d['margin'], 4)}{expected}")
    return lines


def same_function(section: dict, run: dict) -> bool:
    """Whether a llama.cpp run computes the built-in decoder's function (a converted target, the head at its type),
    so that its τ agreement is a check; runs of older reports carry none: the section's."""
    return run.get("same_function_as_builtin", section.get("same_function_as_builtin", True))


def engine_lines(report: dict) -> list[str]:
    """engine=vllm: the same prompts measured inside vLLM, each run beside the built-in decoder's figures."""
    e = report.get("engine")
    if not e:
        return []
    lines = ["", f"## vLLM {e['version']} (the same prompts, engine=vllm)", "",
             f"- target {e['target']} in {e['dtype']}, greedy, each prompt alone; target-only output identical to "
             f"the built-in decoder's: {_f(e['target_only_identical_to_builtin'])}; target-only "
             f"{_f(e['target_only_tokens_per_s'], 1)} tok/s",
             f"- counting: {e['counting']}"] + [f"- **warning:** {w}" for w in e.get("warnings", [])] + ["",
             "| run | loads | tau vLLM | tau built-in | per-position vLLM | per-position built-in | equal (tol) "
             "| greedy identical | speedup vLLM | speedup built-in |", "|---|---|---:|---:|---|---|---|---:|---:|---:|"]
    for name, r in e["runs"].items():
        if not r.get("loaded"):
            lines.append(f"| {name} | refused: {r.get('refused')} | - | - | - | - | - | - | - | - |")
            continue
        tb, ours, eq, sb = agreement_cells(r)
        note = " (sequential fallback: no parallel_drafting)" if r.get("sequential_fallback") else ""
        lines.append(f"| {name}{note} | yes | {_f(r['tau'], 3)} | {tb} | "
                     f"{' / '.join(_f(x, 3) for x in r['per_position_acceptance'])} | {ours} | {eq} | "
                     f"{_f(r['greedy_identical_to_engine_target_only'])} | {_f(r['speedup'])}x | {sb} |")
    cm = e.get("cost_model")
    if cm:
        lines += ["", f"Cost model calibrated to vLLM ({cm['formula']}; t_step {_f(cm['t_step_s'] * 1000, 1)} ms, "
                      f"decoded K {cm['decoded_k']}): the built-in decoder's cycle costs another share of its step "
                      f"than vLLM's, so its own table predicts its own speedup and this one vLLM's.", "",
                  "| K | vLLM cycle / step | built-in cycle / step | predicted tau | predicted vLLM | measured vLLM "
                  "| measured built-in |", "|---:|---:|---:|---:|---:|---:|---:|"]
        for r in cm["table"]:
            cells = [_f(r["cycle_over_step"]), _opt(r["builtin_cycle_over_step"]), _opt(r["predicted_tau"]),
                     _opt(r["predicted_speedup"], "x"), _opt(r["measured_speedup"], "x"),
                     _opt(r["builtin_measured_speedup"], "x")]
            lines.append(f"| {r['k']} | " + " | ".join(cells) + " |")
    return lines


def greedy_lines(report: dict) -> list[str]:
    """Greedy divergences from target-only decoding, each with the target's top-2 margin where it happened."""
    if report.get("greedy_identical_fraction") is None:
        return []
    eps = report.get("near_tie_eps")
    near = report.get("greedy_identical_up_to_near_ties_fraction")
    lines = ["", "## Greedy output vs target-only", "",
             f"- target dtype {report.get('target_dtype')}: identical {_f(report['greedy_identical_fraction'])}"
             + (f", identical up to near-ties (top-2 margin below {eps} logits) {_f(near)}" if near is not None else "")]
    divs = report.get("divergences") or []
    if divs:
        lines += ["- a divergence at a near-tie is bf16 numerics that depend on the pass's shape (one token vs K+1),"
                  " not a decoder error; fp32 is token-exact", "",
                  "| prompt | turn | position | target token | speculative token | top-2 margin | near-tie |",
                  "|---|---:|---:|---:|---:|---:|---|"]
        for d in divs:
            lines.append(f"| {d['prompt']} | {d['turn']} | {d['position']} | {d.get('target_token')} | "
                         f"{d.get('other_token')} | {d['margin']:.3f} | {'yes' if d['margin'] < eps else '**no**'} |")
    return lines


def summary_lines(report: dict) -> str:
    """The few lines `draftsmith eval` ends with."""
    acc = " ".join(f"{a:.2f}" for a in report["per_position_acceptance"])
    lines = [f"eval {report['method']}{_about(report)} on {report['target']['target_id']}: "
             f"{report['n_prompts']} prompts, "
             f"temperature {report['temperature']}, {report['drafting']['mode']} K={report['drafting']['num_speculative_tokens']}",
             f"  tau {report['tau']:.2f}, per-position acceptance {acc}",
             f"  speedup {report['speedup']:.2f}x ({report['speculative_tokens_per_s']:.1f} vs "
             f"{report['target_only_tokens_per_s']:.1f} tokens/s target-only)"]
    for name, b in report.get("baselines", {}).items():
        tau = f"tau {b['tau']:.2f}, " if b.get("tau") is not None else ""
        lines.append(f"  baseline {name}: {tau}{b['tokens_per_s']:.1f} tokens/s, speedup {b['speedup']:.2f}x")
    rec = report.get("recommendation")
    if rec:
        where = {"vllm": " in vLLM", "llamacpp": " in llama.cpp"}.get(rec.get("measured_by"), "")
        predicted = f", {rec['predicted_speedup']:.2f}x predicted" if rec.get("predicted_speedup") is not None else ""
        what = f"{rec['drafter']} " if rec.get("drafter") else ""
        lines.append(f"  best: {what}K={rec['k']} ({rec['mode']}): {rec['measured_speedup']:.2f}x measured{where}"
                     f"{predicted}")
        # the folder or file an engine command names, where export writes it first (the head's GGUF, a stitched MTP)
        for export in dict.fromkeys((rec.get(engine) or {}).get("export_command") for engine in ENGINE_NAMES):
            if export:
                lines.append(f"  export: {export}")
        for engine in ENGINE_NAMES:
            if (rec.get(engine) or {}).get("command"):
                lines.append(f"  {engine}: {rec[engine]['command']}")
    e = report.get("engine") or {}
    if e.get("tau") is not None:
        a = e.get("agreement") or {}
        lines.append(f"  vLLM {e['version']}: tau {e['tau']:.3f} (built-in {a.get('tau_builtin', float('nan')):.3f}, "
                     f"counted as vLLM counts), speedup {e['speedup']:.2f}x, greedy identical "
                     f"{e['greedy_identical_to_engine_target_only']:.2f}")
    elif e:
        lines.append(f"  vLLM {e['version']}: " + "; ".join(f"{n} refused: {r.get('refused')}"
                                                          for n, r in e["runs"].items() if not r.get("loaded")))
    for name, r in (report.get("llamacpp") or {}).get("runs", {}).items():
        a = r.get("agreement") or {}
        beside = f" (built-in {a['tau_builtin']:.3f})" if a else ""
        lines.append(f"  llama.cpp {name}: tau {r['tau']:.3f}{beside}, speedup {r['speedup']:.2f}x, greedy identical "
                     f"{r['greedy_identical_to_engine_target_only']:.2f}"
                     + (f" (up to near-ties {r['greedy_identical_up_to_near_ties']:.2f})"
                        if r.get("greedy_identical_up_to_near_ties") not in (None, 1.0) else ""))
    if report.get("greedy_identical_up_to_near_ties_fraction") is not None:
        lines.append(f"  greedy identical {report['greedy_identical_fraction']:.2f}, up to near-ties (margin < "
                     f"{report['near_tie_eps']}) {report['greedy_identical_up_to_near_ties_fraction']:.2f}")
    if report.get("files"):
        lines.append(f"  report: {report['files']['md']}")
    return "\n".join(lines)


def plot_png(report: dict) -> bytes:
    """Two panels: per-position acceptance bars, and tau per category."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    table = (report.get("cost_model") or {}).get("table") or []
    fig, axes = plt.subplots(1, 3 if table else 2, figsize=(16 if table else 11, 4))
    ax0, ax1 = axes[0], axes[1]
    acc = report["per_position_acceptance"]
    engine = report.get("engine") or {}
    if engine.get("per_position_acceptance"):  # engine=vllm: vLLM's bars beside the built-in decoder's
        vl = engine["per_position_acceptance"]
        ax0.bar([i + 1.2 for i in range(len(vl))], vl, width=0.4, color="tab:purple",
                label=f"vLLM (tau {engine['tau']:.2f})")
        ax0.bar([i + 0.8 for i in range(len(acc))], acc, width=0.4, color="tab:blue", label="built-in")
        ax0.legend()
    else:
        ax0.bar(range(1, len(acc) + 1), acc, color="tab:blue")
    ax0.set_xticks(range(1, len(acc) + 1))
    ax0.set_ylim(0, 1)
    ax0.set_xlabel("draft position")
    ax0.set_ylabel("accepted / proposed")
    ax0.set_title(f"per-position acceptance (tau = {report['tau']:.2f})")
    cats = list(report["per_category"])
    ax1.bar(range(len(cats)), [report["per_category"][c]["tau"] for c in cats], color="tab:orange")
    ax1.set_xticks(range(len(cats)), cats)
    ax1.axhline(1.0, color="gray", lw=0.8, ls="--")
    ax1.set_ylabel("tau (tokens / verification)")
    ax1.set_title(f"tau per category (speedup {report['speedup']:.2f}x overall)")
    ax1.tick_params(axis="x", rotation=45)
    for label in ax1.get_xticklabels():
        label.set_horizontalalignment("right")
    if table:
        ax2 = axes[2]
        ks = [r["k"] for r in table]
        ax2.plot(ks, [r["predicted_speedup"] for r in table], "o--", color="tab:gray", label="predicted (cost model)")
        meas = [(r["k"], r["measured_speedup"]) for r in table if r["measured_speedup"] is not None]
        ax2.plot([k for k, _ in meas], [v for _, v in meas], "s-", color="tab:green", label="measured")
        method = report["method"]
        vllm = sorted((r["k"], r["speedup"]) for name, r in engine.get("runs", {}).items()
                      if r.get("loaded") and (name == method or name.startswith(f"{method}@K=")))
        if vllm:
            ax2.plot([k for k, _ in vllm], [v for _, v in vllm], "^-", color="tab:purple", label="measured in vLLM")
        ax2.axhline(1.0, color="gray", lw=0.8, ls=":")
        ax2.set_xticks(ks)
        ax2.set_xlabel("K (draft tokens per verification)")
        ax2.set_ylabel("speedup vs target-only")
        ax2.set_title("speedup against K")
        ax2.legend()
    fig.suptitle(f"{report['method']} on {report['target']['target_id']}, "
                 f"T={report['temperature']}, {report['drafting']['mode']} K={report['drafting']['num_speculative_tokens']}")
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    plt.close(fig)
    return buf.getvalue()


def write_report(out: str | Path, report: dict, plot: bool = True) -> dict:
    """Write report.json, report.md and (optionally) report.png atomically; returns their paths."""
    out = Path(out)
    paths = {"json": out / "report.json", "md": out / "report.md"}
    atomic_write_json(paths["json"], report)
    atomic_write_bytes(paths["md"], markdown(report).encode())
    if plot:
        paths["png"] = out / "report.png"
        atomic_write_bytes(paths["png"], plot_png(report))
    return {k: str(v) for k, v in paths.items()}
