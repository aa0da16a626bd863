"""Every export of every method, hashed: proof that a refactor leaves each exported byte as it was.

    python tests/export_hashes.py heads DIR          build fixed tiny heads (seeded) into DIR, once, before
    python tests/export_hashes.py hash DIR OUT.json  export each head in each format and dtype through the CLI
                                                     (and a publish dry run), write {file: sha256} to OUT.json
    python tests/export_hashes.py compare A.json B.json

The heads are built once with the code before the change, so the hash step reads them only through the
CLI (`draftsmith export`, `draftsmith publish`), whose options do not change."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

FORMATS = {"eagle3": ("eagle3", "speculators"), "peagle": ("peagle", "speculators"), "draft": ("hf",)}


def build_heads(out: Path) -> None:
    import torch

    from draftsmith.data_gen.target import TargetConfig, load_target
    from draftsmith.heads.eagle3_folders import save_eagle3
    from draftsmith.heads.draft import draft_from_target
    from draftsmith.heads.draft_folders import save_draft
    from draftsmith.heads.eagle3 import Eagle3Head, eagle3_config_from_target
    from draftsmith.heads.peagle import PEagleHead, peagle_config_from_target
    from draftsmith.heads.peagle_folders import save_peagle
    from draftsmith.heads.vocab import build_vocab_map

    target = load_target(TargetConfig(name="tiny", dtype="float32"))
    identity = target.identity()

    def randomize(head, prefixes):
        with torch.no_grad():
            for name, p in head.named_parameters():
                if name.startswith(prefixes):
                    p.copy_(torch.randn_like(p) * 0.3 + (1.0 if p.dim() == 1 else 0.0))
        return head

    torch.manual_seed(0)
    head = Eagle3Head(eagle3_config_from_target(target.model.config, 100))
    head.init_from_target(target.model, *build_vocab_map(torch.randint(0, 1000, (target.vocab_size,)), 100))
    save_eagle3(randomize(head, ("fc", "midlayer", "norm")), out / "eagle3", manifest_target=identity)
    torch.manual_seed(1)
    head = PEagleHead(peagle_config_from_target(target.model.config, 100, 3, target.vocab_size - 1, True))
    head.init_from_target(target.model, *build_vocab_map(torch.randint(0, 1000, (target.vocab_size,)), 100))
    save_peagle(randomize(head, ("fc", "layers", "norm", "mask_hidden")), out / "peagle", manifest_target=identity)
    torch.manual_seed(2)
    save_draft(draft_from_target(target, [0, 1], None, False), out / "draft", identity)


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def cli(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "draftsmith.cli", *args], check=True, stdout=subprocess.DEVNULL)


def hash_exports(heads: Path, out_json: Path) -> dict:
    work = Path("/tmp/draftsmith_export_hashes")  # fixed: the publish card names no path, but keep it fixed
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir()
    hashes = {}
    for method, formats in FORMATS.items():
        for fmt in formats:
            for dtype in ("bfloat16", "float32"):
                for embed in ("true", "false"):
                    name = f"{method}-{fmt}-{dtype}-embed_{embed}"
                    cli("export", f"head={heads / method}", f"format={fmt}", f"out={work / name}", f"dtype={dtype}",
                        f"include_embeddings={embed}", "num_speculative_tokens=4")
        name = f"{method}-publish"
        cli("publish", f"head={heads / method}", "repo_id=someone/tiny-head", "dry_run=true", "allow_no_eval=true",
            "base_model=someone/tiny", "license=apache-2.0", f"out={work / name}")
        name = f"{method}-publish-k5"
        cli("publish", f"head={heads / method}", "repo_id=someone/tiny-head", "dry_run=true", "allow_no_eval=true",
            "base_model=someone/tiny", "license=apache-2.0", "num_speculative_tokens=5", f"out={work / name}")
    for path in sorted(work.rglob("*")):
        if path.is_file():
            hashes[str(path.relative_to(work))] = sha256(path)
    out_json.write_text(json.dumps(hashes, indent=1, sort_keys=True) + "\n")
    return hashes


def compare(a: Path, b: Path) -> int:
    old, new = json.loads(a.read_text()), json.loads(b.read_text())
    differ = sorted(k for k in old.keys() | new.keys() if old.get(k) != new.get(k))
    for k in differ:
        print(f"DIFFERS {k}: {old.get(k)} -> {new.get(k)}")
    print(f"{len(old)} files before, {len(new)} after, {len(differ)} differ")
    return 1 if differ else 0


if __name__ == "__main__":
    command = sys.argv[1]
    if command == "heads":
        build_heads(Path(sys.argv[2]))
    elif command == "hash":
        print(f"{len(hash_exports(Path(sys.argv[2]), Path(sys.argv[3])))} files hashed")
    else:
        sys.exit(compare(Path(sys.argv[2]), Path(sys.argv[3])))
