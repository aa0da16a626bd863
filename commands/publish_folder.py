"""The Hub-ready folder publish writes (atomically) and uploads: the head's formats, eval/ (the report and its plot),
README.md (the card), its local paths rewritten; and the files of it that are uploaded. No file reached through a
symbolic link is read or uploaded."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Optional

from draftsmith.core import DraftsmithError
from draftsmith.core.artifacts import (MANIFEST, OWNER, RECORD, atomic_folder, atomic_write_bytes, atomic_write_json,
                                       claim_output, read_manifest, read_record)
from draftsmith.data_gen.target import torch_dtype
from .export import head_target_folder
from draftsmith.heads.folders import FormatOptions
from .public_paths import PublicPaths
from .publish_card import build_card, training_summary

LINK_FIX = ("publish reads and uploads no file reached through a link, as it can point at any file on this machine: "
            "put the file itself there (or remove the link)")


def refuse_links(*paths: Path) -> None:
    """One sentence for the first of `paths` that is a symbolic link."""
    for path in paths:
        if path.is_symlink():
            raise DraftsmithError(f"{path} is a symbolic link (to {os.readlink(path)}); {LINK_FIX}.")


EVAL_FILES = ("report.md", "report.png")  # copied beside report.json into eval/ when the eval folder has them


def write_formats(folder: Path, tmp: Path, formats: list[str], cfg, base_model: str, num_speculative_tokens: int,
                  method) -> None:
    """Export the head into tmp with its method's writers: the first format at the root, the others in subfolders."""
    head = method.load(folder)
    target = read_manifest(folder).get("target") if (folder / MANIFEST).is_file() else None
    target_id = (target or {}).get("target_id")
    options = FormatOptions(torch_dtype(cfg.dtype), cfg.include_embeddings, verifier=base_model,
                            num_speculative_tokens=num_speculative_tokens, target_folder=lambda: head_target_folder(None, target_id), gguf_outtype=cfg.gguf_outtype)
    for i, fmt in enumerate(formats):
        sub = tmp / (f".{fmt}-root" if i == 0 else fmt)
        method.formats[fmt](head, sub, target, options)
        (sub / OWNER).unlink(missing_ok=True)
        if i == 0:
            for f in sub.iterdir():
                f.rename(tmp / f.name)
            sub.rmdir()


def write_publish_folder(cfg, out: Path, folder: Path, report: Optional[tuple[dict, Path]], base_model: str,
                         license: str, num_speculative_tokens: int, method, num_layers: Optional[int],
                         public: Optional[PublicPaths] = None) -> Path:
    """The Hub-ready folder (atomically): formats, eval/ (report + plot), README.md; `method`: the folder's
    entry in draftsmith.core.methods (`head_folder` finds it); `num_layers`: the folder's own layer count (its
    config.json), which the card states; `public`: the local paths its text files must not hold (`public_paths`),
    rewritten last."""
    # by default every format but gguf, which needs llama.cpp's converter built here (formats=[..., gguf] adds it)
    formats = list(cfg.formats) if cfg.formats is not None else [f for f in method.formats if f != "gguf"]
    with atomic_folder(out, owner="publish", overwrite=bool(cfg.overwrite)) as tmp:  # (keeps the user's files)
        claim_output(tmp, "publish")
        write_formats(folder, tmp, formats, cfg, base_model, num_speculative_tokens, method)
        plot = False
        if report is not None:
            data, where = report
            (tmp / "eval").mkdir()
            atomic_write_json(tmp / "eval" / "report.json", data)
            for name in EVAL_FILES:
                if (where / name).is_file():
                    refuse_links(where / name)
                    shutil.copyfile(where / name, tmp / "eval" / name)
            plot = (tmp / "eval" / "report.png").is_file()
        summary = training_summary(folder, method.offline_data)
        gguf_file = next((p.relative_to(tmp).as_posix() for p in sorted(tmp.rglob("*.gguf"))), None)
        card = build_card(cfg, base_model, license, report[0] if report else None, summary, num_speculative_tokens,
                          formats, plot, method, num_layers, gguf_file)
        atomic_write_bytes(tmp / "README.md", card.encode())
        if public is not None:
            public.rewrite(tmp)
    return out


def upload_files(out: Path) -> list[str]:
    """The files publish wrote into its folder (its record), sorted: a file the user keeps beside them stays
    local, as do draftsmith's owner and record files; a link in it (publish writes none) is refused rather than
    followed."""
    refuse_links(*out.rglob("*"))
    written = read_record(out)
    if written is None:
        raise DraftsmithError(f"{out} has no record of what publish wrote there ({RECORD}); rerun publish to "
                              f"write the folder again before uploading it.")
    return sorted(rel for rel in written if (out / rel).is_file() and not (out / rel).is_symlink()
                  and not any(part.startswith(".") for part in Path(rel).parts))
