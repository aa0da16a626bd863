"""llama.cpp beside draftsmith, the fast part: its /metrics counters, the llama-server flags of the serving
settings, the sentence that says it is not built, a llama-server that cannot start, `export format=gguf` (refused
in one sentence for P-EAGLE, and into a folder that is not its own), its `gguf_outtype` through export,
eval (its `gguf_outtypes`; several side by side: tests/test_eval_llamacpp_outtypes.py) and publish (the converter replaced, and one real q8_0 conversion read back), the folder DFlash and DSpark
hand llama.cpp's DSpark converter (its command line, config and tensors, the converter replaced; a full-vocab
drafter refused) and eval's engine=llamacpp options.

The tests that run llama.cpp's binary or converter skip with the sentence of `llamacpp_missing()` where it is not
built (`bash scripts/setup.sh --engine`), and fail where DRAFTSMITH_REQUIRE_ENGINE=1. The slow half, every GGUF
export decoding SmolLM2's prompts in llama-server, is tests/test_engine_llamacpp.py.
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors import safe_open

from draftsmith.core import DraftsmithError, llamacpp
from draftsmith.cli import main
from draftsmith.configs import compose
from draftsmith.eval import cost
from draftsmith.eval import engine_llamacpp as ll
from draftsmith.eval.config import LLAMACPP_TARGETS
from draftsmith.eval.engine_vllm import TARGET_ONLY
from draftsmith.eval.metrics import Sample
from draftsmith.eval.proposers.ngram import NGRAM_ENGINES
from draftsmith.export import run as export
from draftsmith.core.methods import method_for_folder, methods

try:
    import psutil
except ImportError:  # the process check then reads the Popen alone
    psutil = None

DRAFT_VOCAB = 64


@pytest.fixture(autouse=True)
def keep_argv(monkeypatch):
    monkeypatch.setattr(sys, "argv", list(sys.argv))  # main() hands its overrides to Hydra through sys.argv


# --------------------------------------------------------------------------- llama-server's counters

def metrics_text(drafts: int, draft_tokens: int, accepted: int, per_pos: list[int]) -> str:
    """llama-server's /metrics body as tools/server/server-task.cpp writes it: HELP, TYPE and value of every counter
    and gauge (values streamed as C++ doubles), then the per-position series once a draft was accepted."""
    counters = [("prompt_tokens_total", 57), ("prompt_tokens_cached_total", 0), ("prompt_seconds_total", 0.0213),
                ("tokens_predicted_total", 64), ("tokens_predicted_seconds_total", 0.87), ("n_decode_total", 31),
                ("n_tokens_max", 121), ("spec_decode_num_draft_tokens_total", draft_tokens),
                ("spec_decode_num_accepted_tokens_total", accepted), ("spec_decode_num_drafts_total", drafts)]
    gauges = [("prompt_tokens_seconds", 2676.06), ("predicted_tokens_seconds", 73.5632), ("requests_processing", 0),
              ("requests_deferred", 0), ("n_busy_slots_per_decode", 1)]
    lines = []
    for kind, items in (("counter", counters), ("gauge", gauges)):
        for name, value in items:
            lines += [f"# HELP llamacpp:{name} {name.replace('_', ' ')}", f"# TYPE llamacpp:{name} {kind}",
                      f"llamacpp:{name} {value}"]
    if per_pos:
        name = "llamacpp:spec_decode_num_accepted_tokens_per_pos_total"
        lines += [f"# HELP {name} Accepted tokens per draft position", f"# TYPE {name} counter"]
        lines += [f'{name}{{position="{i}"}} {v}' for i, v in enumerate(per_pos)]
    return "\n".join(lines) + "\n"


def test_parse_metrics_reads_the_speculative_counters_and_nothing_else():
    per_pos = [7, 4, 2]
    got = llamacpp.parse_metrics(metrics_text(12, 36, sum(per_pos), per_pos))
    assert got == {"num_drafts": 12, "num_draft_tokens": 36, "num_accepted_tokens": sum(per_pos),
                   "num_accepted_tokens_per_pos": per_pos}
    assert all(isinstance(v, int) for v in got.values() if not isinstance(v, list))


def test_parse_metrics_before_any_draft_is_zero_with_no_positions():
    assert llamacpp.parse_metrics(metrics_text(0, 0, 0, [])) == {
        "num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0, "num_accepted_tokens_per_pos": []}


def test_parse_metrics_reads_counters_streamed_as_cpp_doubles():
    """A C++ stream writes the double 1000000 as 1e+06: still the integer count."""
    text = metrics_text(0, 0, 0, [3]).replace("llamacpp:spec_decode_num_draft_tokens_total 0",
                                              "llamacpp:spec_decode_num_draft_tokens_total 1e+06")
    assert llamacpp.parse_metrics(text)["num_draft_tokens"] == 1_000_000


def test_parse_metrics_keeps_positions_in_order_whatever_the_line_order():
    per_pos = [9, 5, 1]
    lines = metrics_text(10, 30, sum(per_pos), per_pos).splitlines()
    lines.reverse()
    assert llamacpp.parse_metrics("\n".join(lines))["num_accepted_tokens_per_pos"] == per_pos


def test_counter_delta_is_one_requests_counts_when_a_new_position_appears():
    before = llamacpp.parse_metrics(metrics_text(12, 36, 11, [7, 4]))
    after = llamacpp.parse_metrics(metrics_text(20, 60, 18, [10, 6, 2]))
    assert llamacpp.counter_delta(before, after) == {
        "num_drafts": 8, "num_draft_tokens": 24, "num_accepted_tokens": 7, "num_accepted_tokens_per_pos": [3, 2, 2]}


def test_counter_delta_of_the_first_request_is_its_counts():
    before = llamacpp.parse_metrics(metrics_text(0, 0, 0, []))
    after = llamacpp.parse_metrics(metrics_text(5, 15, 6, [4, 2]))
    assert llamacpp.counter_delta(before, after) == after


def test_pooled_sums_requests_of_different_depths():
    a = {"num_drafts": 3, "num_draft_tokens": 9, "num_accepted_tokens": 4, "num_accepted_tokens_per_pos": [3, 1]}
    b = {"num_drafts": 2, "num_draft_tokens": 6, "num_accepted_tokens": 4, "num_accepted_tokens_per_pos": [2, 1, 1]}
    c = {"num_drafts": 1, "num_draft_tokens": 3, "num_accepted_tokens": 0, "num_accepted_tokens_per_pos": []}
    assert ll.pooled([a, b, c]) == {"num_drafts": 6, "num_draft_tokens": 18, "num_accepted_tokens": 8,
                                    "num_accepted_tokens_per_pos": [5, 2, 1]}


# --------------------------------------------------------------------------- llama-server's flags

def argv_of(settings: dict) -> list[str]:
    return shlex.split(settings["command"])


def value_after(argv: list[str], flag: str) -> str:
    assert argv.count(flag) == 1, (flag, argv)
    return argv[argv.index(flag) + 1]


def test_stop_below_is_served_as_llamacpps_p_min():
    """drafting.stop_below is llama.cpp's --spec-draft-p-min (the same rule), on the drafter's runs only: eval
    accepts it with engine=llamacpp and every drafter run and the recommended command carry it."""
    engines = methods()["eagle3"].engines
    for ngram_first in (False, True):
        argv = argv_of(cost.llamacpp_settings("eagle3", engines, 3, ngram_first=ngram_first, stop_below=0.4))
        assert value_after(argv, "--spec-draft-p-min") == "0.4"
    assert "--spec-draft-p-min" not in cost.llamacpp_settings("eagle3", engines, 3)["flags"]  # 0: llama.cpp's own 0
    assert "--spec-draft-p-min" not in cost.llamacpp_settings("ngram", NGRAM_ENGINES, 3, stop_below=0.4)["flags"]
    cfg = compose("eval", ["engine=llamacpp", "drafting.stop_below=0.4", "sweep_k=[1]"])
    drafter = SimpleNamespace(method="eagle3", engines=engines, make=lambda: None)
    runs = {r["name"]: r for r in ll.llamacpp_runs(cfg, drafter, 3)}
    assert {name for name, r in runs.items() if "--spec-draft-p-min" in r["flags"]} == {
        name for name, r in runs.items() if r["draft"]} and len([r for r in runs.values() if r["draft"]]) == 3


@pytest.mark.parametrize("method, spec_type", [("eagle3", "draft-eagle3"), ("draft", "draft-simple")])
def test_a_head_is_served_with_its_drafter_and_k(method, spec_type):
    s = cost.llamacpp_settings(method, methods()[method].engines, 5)
    assert s["spec_type"] == spec_type
    assert s["flags"] == ["--spec-type", spec_type, "--spec-draft-n-max", "5"]
    argv = argv_of(s)
    assert argv[:3] == ["llama-server", "-m", "<target>.gguf"]
    assert value_after(argv, "-md") == "<head>.gguf"
    assert value_after(argv, "--spec-type") == spec_type and value_after(argv, "--spec-draft-n-max") == "5"
    assert value_after(argv, "--parallel") == "1"
    assert not any(a.startswith("--spec-ngram") for a in argv)


def test_ngram_is_ngram_simple_matching_ngram_max_and_copying_k_without_a_drafter():
    s = cost.llamacpp_settings("ngram", NGRAM_ENGINES, 4, ngram_max=2)
    assert s["spec_type"] == "ngram-simple"
    argv = argv_of(s)
    assert "-md" not in argv
    assert value_after(argv, "--spec-type") == "ngram-simple"
    assert value_after(argv, "--spec-ngram-simple-size-n") == "2"  # the lookup: ngram_max tokens
    assert value_after(argv, "--spec-ngram-simple-size-m") == "4"  # the copy: K tokens
    assert value_after(argv, "--spec-draft-n-max") == "4"
    assert " ".join(s["flags"]) in s["command"]


def test_ngram_first_mixes_ngram_simple_before_the_drafter():
    s = cost.llamacpp_settings("eagle3", methods()["eagle3"].engines, 3, ngram_max=5, ngram_first=True)
    assert s["spec_type"] == "ngram-simple,draft-eagle3"
    argv = argv_of(s)
    assert value_after(argv, "-md") == "<head>.gguf"
    assert value_after(argv, "--spec-type") == "ngram-simple,draft-eagle3"
    assert value_after(argv, "--spec-ngram-simple-size-n") == "5"
    assert value_after(argv, "--spec-ngram-simple-size-m") == "3"
    assert value_after(argv, "--spec-draft-n-max") == "3"


@pytest.mark.parametrize("method", ["peagle"])  # DFlash and DSpark load (export format=gguf, draft-dflash / draft-dspark)
def test_a_method_llama_cpp_cannot_load_gets_no_command_and_a_note(method):
    s = cost.llamacpp_settings(method, methods()[method].engines, 3)
    assert s["spec_type"] is None and s["command"] is None
    assert "llama.cpp" in s["note"] and repr(method) in s["note"] and "vLLM" in s["note"]
    assert s["note"].endswith(".") and "\n" not in s["note"]


def test_serving_settings_carry_the_llama_cpp_settings():
    engines = methods()["eagle3"].engines
    one_line = cost.serving_settings("eagle3", engines, "HuggingFaceTB/SmolLM2-135M-Instruct", "runs/head", 4,
                                     ngram_max=2)
    assert one_line["llamacpp"] == cost.llamacpp_settings("eagle3", engines, 4, 2)
    card = cost.serving_settings("eagle3", engines, "HuggingFaceTB/SmolLM2-135M-Instruct", "runs/head", 4,
                                 ngram_max=2, line_break=True)
    assert "\n" in card["llamacpp"]["command"]
    assert card["llamacpp"]["command"].replace(" \\\n    ", " ") == one_line["llamacpp"]["command"]
    peagle = cost.serving_settings("peagle", methods()["peagle"].engines, "t", "runs/head", 4)
    assert peagle["llamacpp"]["command"] is None and peagle["vllm"]["command"] is not None


def test_server_command_is_one_slot_on_loopback():
    flags = ["--spec-type", "draft-eagle3", "--spec-draft-n-max", "3"]
    argv = llamacpp.server_command("t.gguf", "h.gguf", flags, port=18123, threads=2, ctx=512)
    assert argv[0] == str(llamacpp.server_binary())
    assert value_after(argv, "-m") == "t.gguf" and value_after(argv, "-md") == "h.gguf"
    i = argv.index("--spec-type")
    assert argv[i:i + len(flags)] == flags
    assert (value_after(argv, "--parallel"), value_after(argv, "-c")) == ("1", "512")
    assert (value_after(argv, "--host"), value_after(argv, "--port")) == ("127.0.0.1", "18123")
    assert (value_after(argv, "-t"), value_after(argv, "-tb")) == ("2", "2")
    plain = llamacpp.server_command("t.gguf", None, [])
    assert "-md" not in plain and "--spec-type" not in plain and "-t" not in plain


def help_options(text: str) -> tuple[set[str], list[str]]:
    """llama-server --help: every option name, and the --spec-type choices."""
    names: set[str] = set()
    types: list[str] = []
    for line in text.splitlines():
        if not line.startswith("-"):
            continue
        head = re.split(r"\s{2,}(?=[^\s-])", line, maxsplit=1)[0]  # "-np,   --parallel N     number of ..."
        names.update(re.findall(r"(?<![\w-])(--?[A-Za-z][\w-]*)", head))
        if head.startswith("--spec-type "):
            types = head.split()[1].split(",")
    return names, types


def test_every_flag_we_pass_is_one_llama_server_knows(llamacpp_ready):
    import subprocess

    done = subprocess.run([str(llamacpp.server_binary()), "--help"], capture_output=True, text=True, timeout=60)
    names, types = help_options(done.stdout + done.stderr)
    assert "--spec-type" in names and types, done.stdout[-2000:]
    settings = [cost.llamacpp_settings("eagle3", methods()["eagle3"].engines, 3),
                cost.llamacpp_settings("draft", methods()["draft"].engines, 3),
                cost.llamacpp_settings("ngram", NGRAM_ENGINES, 3),
                cost.llamacpp_settings("eagle3", methods()["eagle3"].engines, 3, ngram_first=True)]
    for s in settings:
        flags = [a for a in s["flags"] if a.startswith("-")]
        assert set(flags) <= names, (set(flags) - names, s)
        assert set(s["spec_type"].split(",")) <= set(types), (s["spec_type"], types)
    server = llamacpp.server_command("t.gguf", "h.gguf", [], threads=2) + ["--metrics"]
    assert {a for a in server if a.startswith("-")} <= names


# --------------------------------------------------------------------------- the llama.cpp eval runs

def test_llamacpp_runs_of_a_head_are_its_ks_ngram_and_head_after_ngram():
    drafter = SimpleNamespace(method="eagle3", make=lambda: None, engines=methods()["eagle3"].engines)
    cfg = SimpleNamespace(ngram_max=2, sweep_k=[1, 3, 5], drafting=SimpleNamespace(stop_below=0.0),
                          gguf_outtypes=["f32"])
    runs = ll.llamacpp_runs(cfg, drafter, 3)
    assert [r["name"] for r in runs] == [TARGET_ONLY, "eagle3", "eagle3@K=1", "eagle3@K=5", "ngram", "ngram+eagle3"]
    by_name = {r["name"]: r for r in runs}
    assert by_name[TARGET_ONLY]["flags"] == [] and not by_name[TARGET_ONLY]["draft"]
    assert by_name["eagle3@K=5"]["flags"] == cost.llamacpp_settings("eagle3", drafter.engines, 5)["flags"]
    assert not by_name["ngram"]["draft"] and "-md" not in by_name["ngram"]["flags"]
    assert by_name["ngram+eagle3"]["draft"]
    assert value_after(by_name["ngram+eagle3"]["flags"], "--spec-type") == "ngram-simple,draft-eagle3"
    assert value_after(by_name["ngram+eagle3"]["flags"], "--spec-ngram-simple-size-n") == "2"


def test_llamacpp_runs_refuse_a_head_llama_cpp_cannot_load():
    drafter = SimpleNamespace(method="peagle", make=lambda: None, engines=methods()["peagle"].engines)
    with pytest.raises(DraftsmithError, match=r"^engine=llamacpp: llama.cpp has no loader for 'peagle'"):
        ll.llamacpp_runs(SimpleNamespace(ngram_max=3, sweep_k=[], drafting=SimpleNamespace(stop_below=0.0)), drafter, 3)


def test_recommendation_is_the_fastest_run_with_its_command():
    drafter = SimpleNamespace(method="eagle3", engines=methods()["eagle3"].engines, info={"path": "runs/h/final"})
    section = {"target": "/models/target.gguf", "runs": {
        "eagle3": {"k": 3, "gguf_outtype": "q8_0", "speedup": 1.4},
        "eagle3@K=5": {"k": 5, "gguf_outtype": "q8_0", "speedup": 1.7},
        "ngram": {"k": 3, "gguf_outtype": None, "speedup": 1.1},
        "ngram+eagle3": {"k": 3, "gguf_outtype": "q8_0", "speedup": 1.5}}}
    cfg = SimpleNamespace(ngram_max=3, drafting=SimpleNamespace(stop_below=0.0))
    rec = ll.recommendation(section, drafter, cfg)
    assert (rec["drafter"], rec["k"], rec["measured_speedup"]) == ("eagle3@K=5", 5, 1.7)
    assert rec["faster_than_target_only"] and rec["measured_by"] == "llamacpp"
    command = rec["llamacpp"]["command"]
    assert command.startswith("llama-server -m /models/target.gguf -md ") and "--spec-draft-n-max 5" in command
    drafter_file = command.split(" -md ", 1)[1].split(" --spec-type ", 1)[0]  # export's output, by its command
    assert drafter_file == "runs/h/final-gguf/eagle3.gguf"
    assert rec["llamacpp"]["export_command"] == ("draftsmith export head=runs/h/final format=gguf gguf_outtype=q8_0 "
                                                 "out=runs/h/final-gguf")
    section["runs"]["ngram"]["speedup"] = 2.0
    rec = ll.recommendation(section, drafter, cfg)
    assert rec["drafter"] == "ngram" and " -md " not in rec["llamacpp"]["command"]


# --------------------------------------------------------------------------- not built

def test_missing_build_names_the_binary_then_the_converter_and_the_build_command(tmp_path, monkeypatch):
    monkeypatch.setenv(llamacpp.HOME_ENV, str(tmp_path))
    binary = tmp_path / "build" / "bin" / "llama-server"
    missing = llamacpp.llamacpp_missing()
    assert missing is not None and str(binary) in missing and "bash scripts/setup.sh --engine" in missing
    assert "\n" not in missing
    binary.parent.mkdir(parents=True)
    binary.write_text("")
    missing = llamacpp.llamacpp_missing()
    converter = tmp_path / "src" / "convert_hf_to_gguf.py"
    assert missing is not None and str(converter) in missing and "bash scripts/setup.sh --engine" in missing
    converter.parent.mkdir(parents=True)
    converter.write_text("")
    assert llamacpp.llamacpp_missing() is None


def test_without_a_build_server_and_convert_refuse_with_that_sentence(tmp_path, monkeypatch):
    monkeypatch.setenv(llamacpp.HOME_ENV, str(tmp_path / "empty"))
    sentence = llamacpp.llamacpp_missing()
    with pytest.raises(DraftsmithError) as e:
        llamacpp.Server(str(tmp_path / "t.gguf"))
    assert str(e.value) == f"{sentence}."
    with pytest.raises(DraftsmithError) as e:
        llamacpp.convert(tmp_path, tmp_path / "x.gguf")
    assert str(e.value) == f"{sentence}."
    assert not (tmp_path / "x.gguf").exists()


def test_the_default_home_is_the_cache_by_version(tmp_path, monkeypatch):
    monkeypatch.delenv(llamacpp.HOME_ENV, raising=False)
    monkeypatch.setenv("DRAFTSMITH_CACHE", str(tmp_path))
    assert llamacpp.llamacpp_home() == tmp_path / "llamacpp" / f"{llamacpp.VERSION}-{llamacpp.COMMIT}"


# --------------------------------------------------------------------------- llama-server that cannot start

def test_server_on_a_file_that_is_not_gguf_says_it_exited_with_its_log_and_leaves_no_process(llamacpp_ready,
                                                                                              tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"this is not a GGUF file\x00\xff" * 64)
    server = llamacpp.Server(str(bad), what="the test's server")
    log = Path(server._log.name)
    with pytest.raises(DraftsmithError) as e:
        with server:
            pytest.fail("llama-server started on a file that is not a GGUF")
    msg = str(e.value)
    assert msg.startswith("the test's server: llama-server exited with status "), msg
    assert "its log ends: " in msg and str(bad) in msg.split("its log ends: ", 1)[1], msg  # llama-server's own words
    assert server.proc is not None and server.proc.poll() is not None and server.proc.returncode != 0
    if psutil is not None:
        assert server.proc.pid not in {p.pid for p in psutil.Process().children(recursive=True)}
    assert not log.exists()


def test_a_failed_conversion_is_one_error_with_the_converters_words_and_leaves_no_file(llamacpp_ready, tmp_path):
    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"architectures": ["NoSuchModelForCausalLM"],
                                                    "model_type": "nosuch"}))
    out = tmp_path / "out.gguf"
    with pytest.raises(DraftsmithError) as e:
        llamacpp.convert(folder, out)
    msg = str(e.value)
    assert msg.startswith(f"llama.cpp's converter could not convert {folder} (exit "), msg
    assert "NoSuchModelForCausalLM" in msg  # the converter's own words
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]  # neither the file nor its temporary name


# --------------------------------------------------------------------------- export format=gguf

def peagle_folder(target, folder: Path) -> Path:
    from draftsmith.heads.peagle import PEagleHead, peagle_config_from_target
    from draftsmith.heads.peagle_folders import save_peagle
    from draftsmith.heads.vocab import build_vocab_map

    torch.manual_seed(0)
    head = PEagleHead(peagle_config_from_target(target.model.config, DRAFT_VOCAB, 1, target.vocab_size - 1, True))
    head.init_from_target(target.model, *build_vocab_map(torch.randint(0, 1000, (target.vocab_size,)), DRAFT_VOCAB))
    return save_peagle(head, folder, manifest_target=target.identity())


def dflash_folder(target, folder: Path, draft_vocab: int = DRAFT_VOCAB) -> Path:
    from draftsmith.heads.dflash import DFlashHead, dflash_config_from_target
    from draftsmith.heads.dflash_folders import save_dflash
    from draftsmith.heads.vocab import build_vocab_map

    torch.manual_seed(0)
    head = DFlashHead(dflash_config_from_target(target.model.config, draft_vocab, 1, 4, target.vocab_size - 1,
                                                target.aux_layer_ids))
    head.init_from_target(target.model, *build_vocab_map(torch.randint(0, 1000, (target.vocab_size,)), draft_vocab))
    return save_dflash(head, folder, manifest_target=target.identity())


def dspark_folder(target, folder: Path, draft_vocab: int = DRAFT_VOCAB) -> Path:
    from draftsmith.heads.dspark import DSparkHead, dspark_config_from_target
    from draftsmith.heads.dspark_folders import save_dspark
    from draftsmith.heads.vocab import build_vocab_map

    torch.manual_seed(0)
    head = DSparkHead(dspark_config_from_target(target.model.config, draft_vocab, 1, 4, target.vocab_size - 1,
                                                target.aux_layer_ids, 8))
    head.init_from_target(target.model, *build_vocab_map(torch.randint(0, 1000, (target.vocab_size,)), draft_vocab))
    return save_dspark(head, folder, manifest_target=target.identity())


def eagle3_folder(target, folder: Path) -> Path:
    from helpers import random_head

    from draftsmith.heads.eagle3_folders import save_eagle3

    return save_eagle3(random_head(target), folder, manifest_target=target.identity())


def draft_folder(target, folder: Path) -> Path:
    from draftsmith.heads.draft import draft_from_target
    from draftsmith.heads.draft_folders import save_draft

    torch.manual_seed(0)
    return save_draft(draft_from_target(target, [0, 1], None, False), folder, target.identity())


@pytest.mark.parametrize("method, make", [("peagle", peagle_folder)])
def test_gguf_export_of_a_head_llama_cpp_cannot_load_is_refused_in_one_sentence(method, make, tiny_target, tmp_path,
                                                                                monkeypatch, capsys):
    monkeypatch.setenv(llamacpp.HOME_ENV, str(tmp_path / "no-build"))  # the method's reason, built or not
    head = make(tiny_target, tmp_path / "trained")
    assert method_for_folder(head).name == method
    out = tmp_path / "out"
    with pytest.raises(DraftsmithError) as e:
        export(compose("export", [f"head={head}", "format=gguf", f"out={out}"]))
    msg = str(e.value)
    assert msg.startswith(f"format=gguf cannot be written for {method} heads: ") and "llama.cpp" in msg, msg
    assert "vLLM" in msg and "not built" not in msg and "\n" not in msg and msg.endswith(".")
    assert not out.exists() and not head.with_name(f"{head.name}-gguf").exists()
    with pytest.raises(SystemExit) as e:
        main(["export", f"head={head}", "format=gguf"])  # the default out, beside the head
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and err == [f"draftsmith export: error: {msg}"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["trained"]


@pytest.fixture(scope="module")
def tiny_files(tiny_target, tmp_path_factory):
    """A random 2-layer draft model of the tiny target (the GGUF read-back of real exports, whose tokenizer
    llama.cpp's converter knows, is in tests/test_engine_llamacpp.py)."""
    root = tmp_path_factory.mktemp("tiny-gguf")
    return SimpleNamespace(root=root, draft=draft_folder(tiny_target, root / "draft"))


def test_gguf_export_into_a_folder_of_other_files_is_refused(tiny_files, tmp_path):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    with pytest.raises(DraftsmithError) as e:
        export(compose("export", [f"head={tiny_files.draft}", "format=gguf", f"out={out}"]))
    assert str(e.value).startswith(f"out={out} already holds files draftsmith export did not write"), str(e.value)
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"] and (out / "notes.txt").read_text() == "mine"


# --------------------------------------------------------------------------- gguf_outtype: the GGUF's weight type

def fake_converter(tmp_path: Path, monkeypatch) -> list[dict]:
    """llama.cpp's converter replaced: each call's command line and the dtypes of the folder it was handed are
    recorded, and the file it names is written (llama-server and the converter stand there as empty files)."""
    home = tmp_path / "fake-llamacpp"
    for part in (home / "build" / "bin" / "llama-server", home / "src" / "convert_hf_to_gguf.py"):
        part.parent.mkdir(parents=True, exist_ok=True)
        part.write_text("")
    monkeypatch.setenv(llamacpp.HOME_ENV, str(home))
    calls = []

    def run(command, **kwargs):
        with safe_open(Path(command[2]) / "model.safetensors", "pt") as f:
            dtypes = {f.get_slice(name).get_dtype() for name in f.keys()}
            names = set(f.keys())
        calls.append({"command": command, "dtypes": dtypes, "tensors": names,
                      "config": json.loads((Path(command[2]) / "config.json").read_text())})
        Path(value_after(command, "--outfile")).write_bytes(b"GGUF")
        return subprocess.CompletedProcess(command, 0, "", "")

    monkeypatch.setattr(llamacpp.subprocess, "run", run)
    return calls


@pytest.mark.parametrize("outtype", [*llamacpp.OUTTYPES, None])
def test_gguf_outtype_reaches_the_converter_and_the_manifest(outtype, tiny_files, tmp_path, monkeypatch):
    calls = fake_converter(tmp_path, monkeypatch)
    given = [f"gguf_outtype={outtype}"] if outtype else []  # None: the default
    out = export(compose("export", [f"head={tiny_files.draft}", "format=gguf", *given, f"out={tmp_path / 'out'}"]))
    (call,) = calls
    assert value_after(call["command"], "--outtype") == (outtype or llamacpp.OUTTYPE)
    assert call["dtypes"] == {"F32"}  # the converter rounds once, from float32, whatever the type asked
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["gguf"] == "draft.gguf" and manifest["gguf_outtype"] == (outtype or llamacpp.OUTTYPE)


def test_a_gguf_outtype_outside_its_choices_is_refused_in_one_sentence():
    """export's one type (eval's list, gguf_outtypes, is checked in tests/test_eval_llamacpp_outtypes.py)."""
    with pytest.raises(DraftsmithError) as e:
        compose("export", ["head=runs/h/final", "format=gguf", "gguf_outtype=q4_0"])
    assert str(e.value) == "gguf_outtype=q4_0 is not one of f32, f16, bf16, q8_0."
    for choice in llamacpp.OUTTYPES:
        assert compose("export", ["head=runs/h/final", f"gguf_outtype={choice}"]).gguf_outtype == choice


@pytest.mark.parametrize("dtype, instead", [("float32", "f32"), ("bf16", "bf16"), ("float16", "f16")])
def test_a_gguf_export_given_a_dtype_is_refused_with_the_gguf_outtype_to_pass(dtype, instead, tiny_files, tmp_path,
                                                                              monkeypatch):
    """The dtype route to the GGUF's type is gone (one name): a config that still gives it is told what to pass."""
    calls = fake_converter(tmp_path, monkeypatch)
    out = tmp_path / "out"
    with pytest.raises(DraftsmithError) as e:
        export(compose("export", [f"head={tiny_files.draft}", "format=gguf", f"dtype={dtype}", f"out={out}"]))
    assert str(e.value) == (f"format=gguf writes the weight type gguf_outtype names (f32, f16, bf16, q8_0), not "
                            f"dtype: pass gguf_outtype={instead} in place of dtype={dtype}.")
    assert calls == [] and not out.exists()


def test_eval_engine_llamacpp_converts_the_head_at_its_gguf_outtype(tiny_files, tmp_path, monkeypatch):
    """eval's gguf_outtypes (one type) reaches the converter through the head's own gguf writer; the report's section
    and the recommended export command carry it (llama-server replaced: every run gives target-only's tokens)."""
    calls = fake_converter(tmp_path, monkeypatch)
    converted = tmp_path / "llamacpp-targets" / "t-f32.gguf"  # as target_gguf names a conversion of its weights
    monkeypatch.setattr(ll, "target_gguf", lambda target, how: converted)
    served = []

    def decode_run(model, draft, run, prompts, *args):
        served.append(draft if run["draft"] else None)
        out = {"tokens": [[1, 2]] * len(prompts), "seconds": [0.1] * len(prompts)}
        if run["flags"]:
            c = {"num_drafts": 1, "num_draft_tokens": 3, "num_accepted_tokens": 1, "num_accepted_tokens_per_pos": [1]}
            out |= {"counters": c, "per_prompt_counters": [c] * len(prompts)}
        return out

    monkeypatch.setattr(ll, "decode_run", decode_run)
    cfg = compose("eval", ["engine=llamacpp", "llamacpp_target=f32", "gguf_outtypes=[q8_0]",
                           f"head={tiny_files.draft}", "progress=false"])
    method = methods()["draft"]
    drafter = SimpleNamespace(method="draft", make=lambda: None, engines=method.engines,
                              info={"path": str(tiny_files.draft)}, model=method.load(tiny_files.draft))
    samples = {TARGET_ONLY: [Sample("c", 2, 2, 0.1, tokens=[1, 2], prompt_ids=[5, 6])]}
    setup = SimpleNamespace(cfg=cfg, drafting=cfg.drafting, target=None, runner=None)
    out = ll.llamacpp_report(setup, drafter, samples, {}, method.formats["gguf"])
    (call,) = calls
    assert value_after(call["command"], "--outtype") == "q8_0"
    assert {Path(d).name for d in served if d} == {"draft.gguf"}  # the converted head is what llama-server loaded
    section = out["llamacpp"]
    assert section["head_gguf_outtypes"] == ["q8_0"] and section["runs"]["draft"]["gguf_outtype"] == "q8_0"
    assert section["same_function_as_builtin"] is False  # an F32 target beside a q8_0 head: a reading, not a check
    assert " gguf_outtype=q8_0 " in out["recommendation"]["llamacpp"]["export_command"]


def test_publish_writes_the_gguf_at_its_outtype_and_its_card_serves_that_file(tiny_files, tmp_path, monkeypatch):
    from draftsmith.publish import PublishConfig, run as publish

    calls = fake_converter(tmp_path, monkeypatch)
    publish(PublishConfig(head=str(tiny_files.draft), repo_id="someone/tiny-draft", base_model="someone/tiny-base",
                          license="apache-2.0", formats=["hf", "gguf"], gguf_outtype="q8_0", allow_no_eval=True,
                          dry_run=True, out=str(tmp_path / "hub")))
    (call,) = calls
    assert value_after(call["command"], "--outtype") == "q8_0"
    assert json.loads((tmp_path / "hub" / "gguf" / "manifest.json").read_text())["gguf_outtype"] == "q8_0"
    card = (tmp_path / "hub" / "README.md").read_text()
    assert "with this repo's `gguf/draft.gguf` (q8_0 weights" in card and " -md gguf/draft.gguf " in card, card
    assert "<head>.gguf" not in card and "- `gguf/`: the gguf format (llama.cpp's `-md` file, q8_0 weights)" in card


# --------------------------------------------------------------------------- DFlash and DSpark: llama.cpp's DSpark converter

MARKOV_TENSORS = {"markov_head.markov_w1.weight", "markov_head.markov_w2.weight", "confidence_head.proj.weight",
                  "confidence_head.proj.bias"}


@pytest.mark.parametrize("method, make", [("dflash", dflash_folder), ("dspark", dspark_folder)])
def test_block_gguf_export_hands_llama_cpps_dspark_converter_its_folder_and_the_target(method, make, tiny_target,
                                                                                        tmp_path, monkeypatch):
    """The converter's command line (the temporary folder, the out file's temporary name, gguf_outtype, the target's
    folder for its tokenizer) and what it is handed: DSparkDraftModel (the converter that maps d2t), the bonus-anchor
    layout stated, the drafter's target layers and block, float32 tensors with d2t; DFlash without any Markov or
    confidence tensor (then exactly DFlash in llama.cpp: heads/dflash_folders.py), DSpark with them."""
    calls = fake_converter(tmp_path, monkeypatch)
    head = make(tiny_target, tmp_path / "trained")
    target_dir = tmp_path / "target"
    target_dir.mkdir()
    (target_dir / "config.json").write_text("{}")
    out = export(compose("export", [f"head={head}", "format=gguf", "gguf_outtype=f16", f"target_dir={target_dir}",
                                    f"out={tmp_path / 'out'}"]))
    (call,) = calls
    argv = call["command"]
    assert argv[0] == sys.executable and argv[1] == str(llamacpp.converter()) and Path(argv[2]).name == "hf"
    outfile = Path(value_after(argv, "--outfile"))  # a temporary name in the folder's temporary twin, both renamed
    assert outfile.name == f".{method}.gguf.tmp" and outfile.parent.name.startswith(f".{out.name}.")
    assert value_after(argv, "--outtype") == "f16" and value_after(argv, "--target-model-dir") == str(target_dir)
    config = call["config"]
    assert config["architectures"] == ["DSparkDraftModel"] and config["sample_from_anchor"] is False
    assert config["dflash_config"]["target_layer_ids"] == [i - 1 for i in tiny_target.aux_layer_ids]
    assert config["block_size"] == 4 and config["draft_vocab_size"] == DRAFT_VOCAB
    assert config["dflash_config"]["mask_token_id"] == tiny_target.vocab_size - 1
    assert call["dtypes"] == {"F32", "I64", "BOOL"} and {"d2t", "fc.weight", "lm_head.weight"} <= call["tensors"]
    assert (MARKOV_TENSORS <= call["tensors"]) is (method == "dspark")
    assert not MARKOV_TENSORS & call["tensors"] or method == "dspark"
    assert json.loads((out / "manifest.json").read_text())["gguf"] == f"{method}.gguf"
    assert (out / f"{method}.gguf").read_bytes() == b"GGUF"


@pytest.mark.parametrize("method, make", [("dflash", dflash_folder), ("dspark", dspark_folder)])
def test_a_full_vocab_block_drafter_is_refused_gguf_in_one_sentence(method, make, tiny_target, tmp_path, monkeypatch):
    """llama.cpp's DSpark converter drops a full-vocab drafter's own lm_head (the target's output computes its
    logits then): refused before the converter runs, naming the option that trains one it serves."""
    calls = fake_converter(tmp_path, monkeypatch)
    head = make(tiny_target, tmp_path / "trained", draft_vocab=tiny_target.vocab_size)
    out = tmp_path / "out"
    with pytest.raises(DraftsmithError) as e:
        export(compose("export", [f"head={head}", "format=gguf", f"target_dir={head}", f"out={out}"]))
    name = {"dflash": "DFlash", "dspark": "DSpark"}[method]
    assert str(e.value) == (f"format=gguf: this {name} drafter drafts over the target's whole vocabulary "
                            f"({tiny_target.vocab_size} tokens), and llama.cpp's DSpark converter then drops its "
                            f"trained lm_head for the target's output; train it with method.draft_vocab_size below "
                            f"{tiny_target.vocab_size}.")
    assert calls == [] and not out.exists()


def smollm2_vocab_eagle3_folder(folder: Path) -> Path:
    """A random EAGLE-3 head 64 wide over SmolLM2's 49152-token vocabulary: llama.cpp's converter reads SmolLM2's
    tokenizer (one it knows; the tiny target's byte-level one it refuses) in a few seconds."""
    from transformers import LlamaForCausalLM

    from draftsmith.core.layers import default_aux_layer_ids
    from draftsmith.data_gen.target import tiny_model_config
    from draftsmith.heads.eagle3 import Eagle3Head, eagle3_config_from_target
    from draftsmith.heads.eagle3_folders import save_eagle3
    from draftsmith.heads.vocab import build_vocab_map

    torch.manual_seed(0)
    config = tiny_model_config(49152, num_layers=4, hidden_size=64)
    head = Eagle3Head(eagle3_config_from_target(config, DRAFT_VOCAB))
    head.init_from_target(LlamaForCausalLM(config), *build_vocab_map(torch.randint(0, 1000, (49152,)), DRAFT_VOCAB))
    identity = {"target_id": "smollm2", "target_hash": "test", "tokenizer_hash": "test", "hidden_size": 64,
                "num_layers": 4, "vocab_size": 49152, "aux_layer_ids": default_aux_layer_ids(4)}
    return save_eagle3(head, folder, manifest_target=identity)


def test_a_q8_0_export_reads_back_as_q8_0(llamacpp_gguf, tmp_path):
    """One real conversion: `export format=gguf gguf_outtype=q8_0` of an EAGLE-3 head, read back by llama.cpp's own
    gguf-py: the file type and every matrix Q8_0, the norms F32."""
    gguf = llamacpp_gguf
    head = smollm2_vocab_eagle3_folder(tmp_path / "head")
    out = export(compose("export", [f"head={head}", "format=gguf", "gguf_outtype=q8_0", f"out={tmp_path / 'gguf'}"]))
    reader = gguf.GGUFReader(out / "eagle3.gguf")
    assert reader.fields[gguf.Keys.General.FILE_TYPE].contents() == gguf.LlamaFileType.MOSTLY_Q8_0
    types = {t.name: (t.tensor_type.name, len(t.shape)) for t in reader.tensors}
    matrices = {name for name, (_, dims) in types.items() if dims == 2}
    assert {"fc.weight", "token_embd.weight", "output.weight", "blk.0.attn_q.weight"} <= matrices, types
    assert {types[name][0] for name in matrices} == {"Q8_0"}, types
    assert {kind for name, (kind, dims) in types.items() if name.endswith("norm.weight")} == {"F32"}, types


# --------------------------------------------------------------------------- eval engine=llamacpp options

@pytest.mark.parametrize("overrides, words", [
    (["temperature=0.7"], "engine=llamacpp measures greedy decoding: set temperature=0"),
    (["drafting.mode=tree"], "engine=llamacpp drafts chains"),
])
def test_eval_engine_llamacpp_refuses_what_it_cannot_measure(overrides, words):
    with pytest.raises(DraftsmithError) as e:
        compose("eval", ["engine=llamacpp", *overrides])
    msg = str(e.value)
    assert msg.startswith(words) and "\n" not in msg and msg.endswith("."), msg


def test_eval_llamacpp_target_is_one_of_its_choices():
    with pytest.raises(DraftsmithError) as e:
        compose("eval", ["engine=llamacpp", "llamacpp_target=q8"])
    assert str(e.value) == f"llamacpp_target=q8 is not one of {', '.join(LLAMACPP_TARGETS)}."
    for choice in LLAMACPP_TARGETS:
        assert compose("eval", ["engine=llamacpp", f"llamacpp_target={choice}"]).llamacpp_target == choice


def test_ngram_first_is_measured_in_llama_cpp_but_refused_for_vllm():
    cfg = compose("eval", ["engine=llamacpp", "ngram_first=true", "head=runs/train/final"])
    assert cfg.engine == "llamacpp" and cfg.ngram_first is True
    with pytest.raises(DraftsmithError) as e:
        compose("eval", ["engine=vllm", "ngram_first=true", "head=runs/train/final"])
    msg = str(e.value)
    assert msg.startswith("engine=vllm") and "ngram_first=false" in msg and "\n" not in msg, msg


def test_report_reads_a_quantised_targets_agreement_as_a_reading_not_a_check():
    from draftsmith.eval.report import llamacpp_lines

    agree = {"equal": False, "tolerance": 0.02, "tau_builtin": 1.54, "per_position_builtin": [0.34, 0.14, 0.06]}
    section = {"version": "v", "target": "/m/SmolLM2.Q4_1.gguf", "target_weights": "same", "threads": 2,
               "target_only_identical_to_builtin": 0.3, "target_only_tokens_per_s": 100.0, "counting": "c",
               "same_function_as_builtin": False,
               "runs": {"eagle3": {"tau": 1.52, "per_position_acceptance": [0.34, 0.12, 0.06], "agreement": agree,
                                   "greedy_identical_to_engine_target_only": 1.0, "speedup": 0.45}}}
    row = next(line for line in llamacpp_lines({"llamacpp": section}) if line.startswith("| eagle3 "))
    assert "no (quantised target or head: not expected)" in row and "**no**" not in row
    section["same_function_as_builtin"] = True  # the F32 conversion: a miss is a defect, in bold
    row = next(line for line in llamacpp_lines({"llamacpp": section}) if line.startswith("| eagle3 "))
    assert "**no** (0.02)" in row


def test_divergences_are_counted_up_to_near_ties_and_leave_the_agreement():
    """A run that left target-only on one prompt: near-tie or not by its margin, listed in report.md, and the τ
    agreement pooled over the other prompts only (their counters and their built-in samples)."""
    from draftsmith.eval.metrics import Sample
    from draftsmith.eval.report import llamacpp_lines

    divergences = [{"prompt": 1, "position": 3, "margin": 0.1}]
    assert ll.up_to_near_ties(divergences, 4, 0.25) == 1.0 and ll.up_to_near_ties(divergences, 4, 0.05) == 0.75
    c = lambda drafts, acc: {"num_drafts": drafts, "num_draft_tokens": 3 * drafts,  # noqa: E731
                             "num_accepted_tokens": acc, "num_accepted_tokens_per_pos": [acc, 0, 0]}
    got = {"tokens": [[1, 2], [1, 9]], "per_prompt_counters": [c(2, 2), c(2, 0)]}
    builtin = [Sample("c", 2, 2, 1.0, accepted=[2, 0, 0], proposed=[2, 2, 2], draft_sizes=[3, 3]),
               Sample("c", 2, 2, 1.0, accepted=[2, 0, 0], proposed=[2, 2, 2], draft_sizes=[3, 3])]
    agree = ll.agreement_where_identical(builtin, got, [[1, 2], [1, 2]], 3)
    assert agree["prompts_compared"] == "1/2" and agree["equal"], agree  # prompt 1 (τ 1.0 there) left out
    assert not ll.agreement(builtin, {"counters": ll.pooled(got["per_prompt_counters"])}, 3)["equal"]
    none_left = ll.agreement_where_identical(builtin, got, [[5], [5]], 3)  # no prompt left identical: never "equal"
    assert none_left["prompts_compared"] == "0/2" and none_left["equal"] is False
    section = {"version": "v", "target": "/m/t.gguf", "target_weights": "f32", "threads": 2, "counting": "c",
               "target_only_identical_to_builtin": 1.0, "target_only_tokens_per_s": 100.0, "near_tie_eps": 0.25,
               "target_only_divergences": [],
               "runs": {"eagle3": {"tau": 2.0, "per_position_acceptance": [1.0, 0, 0], "speedup": 1.1,
                                   "greedy_identical_to_engine_target_only": 0.5,
                                   "greedy_identical_up_to_near_ties": 1.0,
                                   "divergences": divergences}}}
    lines = llamacpp_lines({"llamacpp": section})
    assert "- eagle3: prompt 1 leaves at token 3, top-2 margin 0.1000" in lines
    assert next(line for line in lines if line.startswith("| eagle3 ")).count("| 0.50 | 1.00 |") == 1
