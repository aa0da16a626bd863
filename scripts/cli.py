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
import sys

# subcommand -> (module holding `run(cfg)`, config name under draftsmith/configs)
SUBCOMMANDS = {
    "data-gen": ("draftsmith.data_gen.run", "data_gen"),
    "train": ("draftsmith.train.run", "train"),
    "eval": ("draftsmith.eval.run", "eval"),
    "export": ("draftsmith.heads.export", "export"),
    "demo": ("draftsmith.eval.demo", "demo"),
}

USAGE = """usage: draftsmith <command> [key=value ...]   (Hydra overrides; --cfg job prints the config)

commands:
  data-gen   prompts -> the target's own conversations -> tokenized set (+ hidden states)
  train      train a drafter (method=eagle3) on a data-gen output
  eval       measure acceptance length and real speedup with the built-in lossless decoder
  export     write a trained head in the vLLM / SGLang or speculators format
  demo       data-gen + EAGLE-3 training + eval on the embedded SmolLM2, on CPU
"""


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(USAGE)
        sys.exit(0 if argv else 2)
    command, overrides = argv[0], argv[1:]
    if command not in SUBCOMMANDS:
        print(f"draftsmith: unknown command {command!r}.\n\n{USAGE}", file=sys.stderr)
        sys.exit(2)
    module_name, config_name = SUBCOMMANDS[command]

    import hydra

    from draftsmith import DraftsmithError
    from draftsmith.configs import register_configs

    register_configs(config_name)
    run = importlib.import_module(module_name).run

    def task(cfg) -> None:
        try:
            run(cfg)
        except DraftsmithError as e:
            print(f"draftsmith {command}: error: {e}", file=sys.stderr)
            sys.exit(2)

    sys.argv = [f"draftsmith {command}", *overrides]
    hydra.main(config_path="pkg://draftsmith.configs", config_name=config_name, version_base=None)(task)()


if __name__ == "__main__":
    main()
