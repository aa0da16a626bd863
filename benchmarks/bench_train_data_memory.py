"""Host memory of training data: what load_data adds to a process's resident set, for 200k and 2M tokens.

    python benchmarks/bench_train_data_memory.py                       # 200k and 2M tokens, flat and lists
    python benchmarks/bench_train_data_memory.py --sizes 200000 2000000 20000000 --json mem.json

For each size a data-gen-shaped folder is written once (tokenized/ as data-gen writes it, datasets.save_to_disk
with id, input_ids list<int32>, loss_mask list<int8>; manifest.json for the tiny target), conversations of 64 to
1024 tokens. Each (size, implementation) is then loaded in a fresh subprocess, after its imports and the target's
identity, so only the data counts:
  flat   load_data as it is (tokens in the memory-mapped Arrow buffers, train/data.py)
  lists  the lists load_data held before (77bd05a: `[list(x)[:max_length] for x in ds["input_ids"]]`, the same for
         loss_mask), for comparison
Reported per run: resident set (psutil RSS) after load minus before, the same after every row was read once, split
into private (RssAnon) and file pages (RssFile: the Arrow pages read are file-backed, shared between the ranks of a
node and reclaimable), and the peak (ru_maxrss) over the run minus the resident set before. The goal (issue 46): 2M tokens add at most 1 GB over 200k. Memory
only: no timing. Prints a table, writes JSON.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

GOAL_BYTES = 1 << 30


def write_folder(folder: Path, tokens: int, seed: int = 0) -> dict:
    """A data-gen folder of about `tokens` tokens for the tiny target; returns its counts."""
    import datasets
    import pyarrow as pa

    from draftsmith.core.artifacts import write_manifest
    from draftsmith.data_gen.target import TargetConfig, load_target

    rng = np.random.default_rng(seed)
    lengths = []
    while sum(lengths) < tokens:
        lengths.append(int(rng.integers(64, 1025)))
    lengths[-1] -= sum(lengths) - tokens
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    ids = rng.integers(0, 250, tokens, dtype=np.int32)
    mask = (rng.random(tokens) < 0.6).astype(np.int8)
    table = pa.table({"id": pa.array([f"s{i}" for i in range(len(lengths))]),
                      "input_ids": pa.ListArray.from_arrays(pa.array(offsets), pa.array(ids)),
                      "loss_mask": pa.ListArray.from_arrays(pa.array(offsets), pa.array(mask))})
    features = datasets.Features({"id": datasets.Value("string"),
                                  "input_ids": datasets.Sequence(datasets.Value("int32")),
                                  "loss_mask": datasets.Sequence(datasets.Value("int8"))})
    datasets.Dataset(table).cast(features).save_to_disk(str(folder / "tokenized"))
    target = load_target(TargetConfig(name="tiny", dtype="float32"), lazy=True)
    counts = {"samples": len(lengths), "tokens": tokens, "loss_tokens": int(mask.sum())}
    write_manifest(folder, stage="data_gen", target=target.identity(), counts=counts, hidden_states=None)
    return counts


def child(folder: str, impl: str, max_length: int) -> dict:
    """Runs in its own process: load the folder's data with `impl`, and read every row once."""
    import psutil

    from draftsmith.data_gen.dataset import load_tokenized
    from draftsmith.data_gen.target import TargetConfig, load_target
    from draftsmith.train.data import load_data

    identity = load_target(TargetConfig(name="tiny", dtype="float32"), lazy=True).identity()
    process = psutil.Process()
    anon_file_before = _anon_file()
    before = process.memory_info().rss
    if impl == "flat":
        train, _, _ = load_data(folder, identity, "online", max_length, 0)
        rows = (train.input_ids[r] for r in train.indices)
    else:
        ds, _ = load_tokenized(folder, identity)
        ids = [list(x)[:max_length] for x in ds["input_ids"]]
        masks = [list(x)[:max_length] for x in ds["loss_mask"]]
        keep = [i for i in range(len(ids)) if len(ids[i]) >= 2 and sum(masks[i]) > 0]
        rows = (ids[r] for r in keep)
    loaded = process.memory_info().rss
    total = sum(int(np.asarray(x, dtype=np.int64).sum()) for x in rows)  # every row read once
    read = process.memory_info().rss
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    split = {f"read_{k}_bytes": v - anon_file_before[k] for k, v in _anon_file().items()}
    return {"loaded_bytes": loaded - before, "read_bytes": read - before, "peak_bytes": max(0, peak - before),
            **split, "checksum": total}


def _anon_file() -> dict:
    """This process's resident set split into private memory (anon) and file pages (file: the memory-mapped
    Arrow data among them, shared with every process that maps the same file), from /proc/self/status."""
    status = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
    return {"anon": int(status["RssAnon"].split()[0]) * 1024, "file": int(status["RssFile"].split()[0]) * 1024}


def _run(*args: str) -> str:
    """This script with `args` in a fresh process; its last line of output."""
    out = subprocess.run([sys.executable, __file__, *args], capture_output=True, text=True, check=True)
    return out.stdout.strip().splitlines()[-1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[200_000, 2_000_000], help="tokens per data set")
    parser.add_argument("--impls", nargs="+", default=["flat", "lists"], choices=["flat", "lists"])
    parser.add_argument("--max-length", type=int, default=2048)
    parser.add_argument("--json", default=None, help="write the results here")
    parser.add_argument("--child", nargs=2, metavar=("FOLDER", "IMPL"), help=argparse.SUPPRESS)
    parser.add_argument("--write", nargs=2, metavar=("FOLDER", "TOKENS"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child[0], args.child[1], args.max_length)))
        return
    if args.write:
        print(json.dumps(write_folder(Path(args.write[0]), int(args.write[1]))))
        return
    # Linux keeps a process's peak RSS (ru_maxrss) across fork and exec: this process stays small (it writes no data
    # itself) so that each child's peak is its own.
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for size in args.sizes:
            folder = Path(tmp) / f"data_{size}"
            counts = json.loads(_run("--write", str(folder), str(size)))
            for impl in args.impls:
                measured = json.loads(_run("--child", str(folder), impl, "--max-length", str(args.max_length)))
                runs.append({"tokens": size, "samples": counts["samples"], "impl": impl, **measured})
    small, large = min(args.sizes), max(args.sizes)
    growth = {}
    for impl in args.impls:
        by = {r["tokens"]: r for r in runs if r["impl"] == impl}
        growth[impl] = {k: by[large][k] - by[small][k] for k in ("loaded_bytes", "read_bytes", "peak_bytes")}
    result = {"sizes": args.sizes, "max_length": args.max_length, "runs": runs,
              "growth": {"from_tokens": small, "to_tokens": large, **growth},
              "goal": f"{large} tokens add at most 1 GiB resident over {small}",
              "goal_met": {impl: max(g.values()) <= GOAL_BYTES for impl, g in growth.items()}}
    mib = 1 << 20
    print(f"{'tokens':>10} {'impl':>5} {'loaded MiB':>11} {'read MiB':>9} {'(anon':>7} {'file)':>6} {'peak MiB':>9}")
    for r in runs:
        print(f"{r['tokens']:>10} {r['impl']:>5} {r['loaded_bytes'] / mib:>11.1f} {r['read_bytes'] / mib:>9.1f} "
              f"{r['read_anon_bytes'] / mib:>7.1f} {r['read_file_bytes'] / mib:>6.1f} {r['peak_bytes'] / mib:>9.1f}")
    for impl, g in growth.items():
        print(f"{impl}: {large} tokens over {small}: loaded +{g['loaded_bytes'] / mib:.1f} MiB, read "
              f"+{g['read_bytes'] / mib:.1f} MiB, peak +{g['peak_bytes'] / mib:.1f} MiB "
              f"({'within' if result['goal_met'][impl] else 'over'} the 1 GiB goal)")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
