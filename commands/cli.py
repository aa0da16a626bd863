"""The `draftsmith` console script: one Hydra app per subcommand.

    draftsmith data-gen target=smollm2 prompts=self prompts.n=64 out=runs/smol
    draftsmith train method=eagle3 target=smollm2 data=runs/smol
    draftsmith eval head=runs/eagle3 prompts=question prompts.path=question.jsonl
    draftsmith export head=runs/eagle3 format=vllm out=exported/
    draftsmith demo

Each subcommand is a thin wrapper around its stage's `run(cfg)`; the stage saves the resolved
config beside its output. User errors (DraftsmithError) print one sentence and exit with 2.
"""

from __future__ import annotations

import importlib
import inspect
import logging
import re
import sys
from typing import Sequence

from draftsmith.core import procenv
from draftsmith.core.methods import trainable  # the table's names only: nothing of a method (nor torch) is imported

# subcommand -> (module holding `run(cfg)`, config name under draftsmith/configs)
SUBCOMMANDS = {
    "data-gen": ("draftsmith.data_gen.run", "data_gen"),
    "train": ("draftsmith.train.run", "train"),
    "eval": ("draftsmith.eval.run", "eval"),
    "export": ("draftsmith.export", "export"),
    "publish": ("draftsmith.publish", "publish"),
    "demo": ("draftsmith.demo", "demo"),
}

# What a Ctrl-C leaves and how to go on: every stage writes through temporary names, so nothing finished is lost
AFTER_INTERRUPT = {
    "data-gen": "the finished parts are kept, and the same command resumes from them.",
    "train": "the checkpoints saved so far are kept; the same command with resume=true continues from the latest "
             "(save_every sets how often one is written).",
    "eval": "nothing is resumed: the same command starts the eval again.",
    "export": "nothing was left half-written: the same command starts again.",
    "publish": "the upload is one commit, so the Hub repo has all of it or none of it: the same command starts again.",
    "demo": "the finished stages and the interrupted stage's parts are kept, and the same command resumes.",
}

USAGE = f"""usage: draftsmith <command> [key=value ...]   (Hydra overrides; --cfg job prints the config)
       draftsmith <command> --help   (every option with its default)
       draftsmith --version

commands:
  data-gen   prompts -> the target's own conversations -> tokenized set (+ hidden states)
  train      train a drafter (method={' | '.join(trainable())}) on a data-gen output
  eval       measure acceptance length and real speedup with the built-in lossless decoder
  export     write a trained head in the vLLM / SGLang or speculators format
  publish    push a head to the Hugging Face Hub with a model card measured by eval
  demo       data-gen + EAGLE-3 training + eval on the embedded SmolLM2, on CPU
"""


# Hydra flags after which the CLI leaves composition to Hydra (it does not build a run's config)
HYDRA_OWN = ("multirun", "config_path", "config_name", "config_dir", "shell_completion", "info", "hydra_help",
             "experimental_rerun")


def version() -> str:
    from draftsmith.core import __version__

    return f"draftsmith {__version__}"


def field_docs(cls: type) -> dict[str, str]:
    """Field name -> its description: the comment after the field, else the comment lines right above it.

    Base classes first, so a subclass (EvalPromptsConfig) overrides what it redefines."""
    import dataclasses

    docs: dict[str, str] = {}
    for klass in reversed([k for k in cls.__mro__ if dataclasses.is_dataclass(k)]):
        try:
            source = inspect.getsource(klass)
        except (OSError, TypeError):
            continue
        above: list[str] = []
        for line in source.splitlines()[1:]:
            comment = re.match(r"^ {4}#\s?(.*)$", line)
            if comment:
                above.append(comment.group(1).strip())
                continue
            m = re.match(r"^ {4}(\w+)\s*:[^#]*?(?:#\s*(.*))?$", line)
            if m and m.group(1) in klass.__dataclass_fields__:
                docs[m.group(1)] = (m.group(2) or " ".join(above)).strip()
            above = []
    return docs


def _show(value) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(_show(v) for v in value) + "]"
    return "''" if value == "" else str(value)


def option_rows(cls, node, prefix: str = ""):
    """(dotted option, default, description) for every field of a schema dataclass, nested ones expanded; `node`
    is the composed config (the typed tree configs.compose returns)."""
    import dataclasses

    docs = field_docs(cls)
    for f in dataclasses.fields(cls):
        name = prefix + f.name
        child = getattr(node, f.name)
        missing = child == "???"
        if dataclasses.is_dataclass(child):
            yield from option_rows(type(child), child, name + ".")
            continue
        doc = docs.get(f.name, "")
        if missing:
            doc = f"{doc} (required)".strip()
        yield name, "???" if missing else _show(child), doc


def option_help(command: str, config_name: str, overrides: Sequence[str] = ()) -> str:
    """`draftsmith <command> --help`: every option with its default (as the stage's YAML sets it) and description
    (`method=draft --help`: with that option group's options)."""
    from pathlib import Path

    import draftsmith.configs as configs

    cfg = configs.compose(config_name, [o for o in overrides if not o.startswith('-')])
    rows = list(option_rows(configs.schema(config_name), cfg))
    summary = next((ln.split(None, 1)[1] for ln in USAGE.splitlines() if ln.strip().startswith(command + " ")), "")
    width = min(max(len(f"{n}={d}") for n, d, _ in rows), 44)
    lines = [f"usage: draftsmith {command} [key=value ...]   (Hydra overrides; --cfg job prints the config)",
             "", f"{command}: {summary.strip()}", "", "options (key=default  description):"]
    for name, default, doc in rows:
        left = f"{name}={default}"
        lines.append(f"  {left:<{width}}  {doc}" if len(left) <= width else f"  {left}\n  {'':<{width}}  {doc}")
    folder = Path(configs.__file__).parent
    stage_yaml = (folder / f"{config_name}.yaml").read_text()
    groups = [f"  {d.name}=" + "|".join(sorted(p.stem for p in d.glob("*.yaml")))
              for d in sorted(folder.iterdir()) if d.is_dir() and f"- {d.name}:" in stage_yaml]
    if groups:
        lines += ["", "option groups (presets of the options above):", *groups]
    lines += ["", "Hydra's own flags: --cfg job|hydra|all, --info, --hydra-help, --multirun."]
    return "\n".join(lines)


# Characters Hydra's override grammar reads only inside quotes; a line break it never reads
NEEDS_QUOTES = "!\"#&'();<=>[]^`{}~"
# The options that name a file or folder (their last part), where `~` means the home folder to a user
PATH_OPTIONS = {"out", "path", "head", "data", "report", "resume", "target_dir", "verifier", "name", "base_model"}


def option_doc(config_name: str, key: str) -> str:
    """What option `key` takes (its description up to the first ';'), or '' where the stage has no such option."""
    import draftsmith.configs as configs

    try:
        rows = option_rows(configs.schema(config_name), configs.compose(config_name, []))
        doc = next((d for name, _, d in rows if name == key), "")
    except Exception:  # (only a sentence's hint: an option that cannot be composed has none)
        return ""
    return doc.removesuffix(" (required)").split(";")[0].strip()


def override_error(command: str, config_name: str, override: str) -> str:
    """One sentence for an override Hydra cannot parse: the option, its value (line breaks shown as \\n), what is
    wrong with it and what would work; never the parser's own exception."""
    from pathlib import Path

    key, eq, value = override.partition("=")
    if not eq:
        return (f"{override!r} is not an option setting: write key=value (draftsmith {command} --help lists the "
                f"options).")
    option = key.lstrip("+~")
    shown = f"{key}=" + value.replace("\r", "\\r").replace("\n", "\\n")
    doc = option_doc(config_name, option)
    takes = f"{option} takes {doc}" if doc else f"{option} takes a value without it"
    if "\n" in value or "\r" in value:
        return f"{shown} holds a line break, and an option's value is one line: {takes}, so write it on one line."
    is_path = option.rsplit(".", 1)[-1] in PATH_OPTIONS or any(w in doc for w in ("folder", "file", "path"))
    if "~" in value and is_path:
        home = str(Path.home())
        example = home + value.split("~", 1)[1] if value.startswith("~/") and len(value) > 2 else f"{home}/runs/{command}"
        return (f"{shown} holds '~', which draftsmith does not expand to your home folder (and Hydra reads it "
                f"only quoted): write the full path instead, e.g. {option}={example}.")
    char = next((c for c in value if c in NEEDS_QUOTES), None)
    if char is None or (char in "[]{}" and not is_path):
        return (f"{shown} cannot be read as an option setting: check its brackets and quotes (a list is written "
                f"{option}=[a,b]; {takes}).")
    quoted = value.replace("'", "\\'")
    if is_path:
        return (f"{shown} holds {char!r}, which Hydra reads only inside quotes: quote the whole value, e.g. "
                f"\"{key}='{quoted}'\" in the shell.")
    return (f"{shown} holds {char!r}, which Hydra reads only inside quotes: {takes}, so leave the {char!r} out (or "
            f"quote the whole value, \"{key}='{quoted}'\", if it belongs there).")


def check_overrides(command: str, config_name: str, overrides) -> None:
    """Refuse the first override Hydra's grammar cannot parse (`out=~`, a value holding ';' or a line break) with
    one sentence (override_error), before Hydra's own exception could reach the user."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import OverrideParseException

    from draftsmith.core import DraftsmithError

    parser = OverridesParser.create()
    for override in overrides:
        try:
            parser.parse_overrides([override])
        except OverrideParseException:
            raise DraftsmithError(override_error(command, config_name, override)) from None


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("--version", "-V", "version"):
        print(version())
        sys.exit(0)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(USAGE)
        sys.exit(0 if argv else 2)
    command, overrides = argv[0], argv[1:]
    if command not in SUBCOMMANDS:
        print(f"draftsmith: unknown command {command!r}.\n\n{USAGE}", file=sys.stderr)
        sys.exit(2)
    module_name, config_name = SUBCOMMANDS[command]
    procenv.share_cores()  # OpenMP reads its wait policy when torch loads it: before anything imports torch

    from draftsmith.core import DraftsmithError

    def fail(e: DraftsmithError):
        print(f"draftsmith {command}: error: {e}", file=sys.stderr)
        sys.exit(2)

    checked = None  # the typed tree checked before any work (when Hydra composes the same one: no multirun, ...)
    try:
        if "--version" in overrides:
            print(version())
            sys.exit(0)
        if "-h" in overrides or "--help" in overrides:
            check_overrides(command, config_name, [o for o in overrides if not o.startswith("-")])
            print(option_help(command, config_name, overrides))
            sys.exit(0)
        # Build and check the config before any work: a bad value, type or key is one sentence, exit 2.
        from hydra._internal.utils import get_args_parser

        try:
            args = get_args_parser().parse_args(overrides)
        except SystemExit:
            args = None  # Hydra reports its own usage error below
        if args is not None and not any(getattr(args, flag, None) for flag in HYDRA_OWN):
            from draftsmith.configs import compose

            check_overrides(command, config_name, args.overrides)

            checked = compose(config_name, args.overrides, missing_ok=bool(args.cfg))
    except DraftsmithError as e:
        fail(e)

    import hydra

    from draftsmith.core import machine  # (imports torch: after share_cores)
    from draftsmith.configs import check_config, register_configs

    machine.use_threads()  # the cores this process may use, shared among its job's processes on this node
    machine.flush_denormals()  # subnormal arithmetic is slow microcode on x86 (1.75x on a training step)
    register_configs(config_name)
    stage = importlib.import_module(module_name)

    def task(cfg) -> None:
        try:
            # the typed tree, checked once: the one checked above, else (a multirun job, another config) Hydra's
            result = stage.run(checked if checked is not None else check_config(config_name, cfg))
        except DraftsmithError as e:
            fail(e)
        except KeyboardInterrupt:  # Ctrl-C: one line that says what the next run does, not a torch traceback
            print(f"draftsmith {command}: interrupted; {AFTER_INTERRUPT[command]}", file=sys.stderr)
            sys.exit(130)
        # Stages return data; the few lines a person reads are printed here, by the stage's `summary`.
        if hasattr(stage, "summary") and result is not None:
            print(stage.summary(result))

    sys.argv = [f"draftsmith {command}", *overrides]
    # Hydra points the root logger at this job's stdout (configs' hydra/job_logging: stdout), where the stages' log
    # lines go; a caller in the same process (the tests) gets its own logging back, not a handler on a closed stream
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    try:
        hydra.main(config_path="pkg://draftsmith.configs", config_name=config_name, version_base=None)(task)()
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)


if __name__ == "__main__":
    main()
