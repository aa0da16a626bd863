"""Run one draftsmith stage in this process, as benchmarks/bench_learning_curve.py does
(draftsmith.configs.compose(stage, overrides) + draftsmith.<stage>.run.run(cfg)).

    python3 .gpu/stage.py <data_gen|train|eval> <overrides.json> <result.json>

Writes {"stage", "overrides", "seconds" (compose + run, in-process), "result" (run's return value)} to result.json
(atomically, only when the stage finished).
"""
import json
import os
import sys
import time
from importlib import import_module

stage, overrides_path, result_path = sys.argv[1:4]
overrides = json.loads(open(overrides_path).read())
t0 = time.perf_counter()
from draftsmith.configs import compose  # noqa: E402

module = {"data_gen": "draftsmith.data_gen.run", "train": "draftsmith.train.run", "eval": "draftsmith.eval.run"}[stage]
result = import_module(module).run(compose(stage, overrides))
seconds = time.perf_counter() - t0
tmp = result_path + ".tmp"
with open(tmp, "w") as f:
    json.dump({"stage": stage, "overrides": overrides, "seconds": round(seconds, 2), "result": result}, f,
              default=str, indent=1)
os.replace(tmp, result_path)
print(f"stage.py: {stage} done in {seconds:.1f} s -> {result_path}", flush=True)
