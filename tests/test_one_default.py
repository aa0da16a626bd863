"""One name and one default per concept (issue 50): read from the package's source with `ast`, not from the
composed configs, so that a second name or a second literal default fails here the day it is written.

The number of drafted tokens per cycle (K) is `num_speculative_tokens` everywhere: the config's name
(drafting.num_speculative_tokens, export's and publish's), vLLM's and SGLang's, and the exported JSON's. Its one
default is NUM_SPECULATIVE_TOKENS in core/engine.py. "K" stays the maths symbol in comments, docstrings and
report headers, which this test does not read.

The rules, precise so that they cannot flicker:
- a name in OTHER_NAMES is never bound (a parameter, an assignment, a loop, an attribute);
- k or K is never bound to the count: to a value or loop that reads `num_speculative_tokens` or `sweep_k`;
- in the stages that handle the count (SCOPED: the CLI and export / publish, the core, heads, eval) a parameter named
  k or K is refused, except a tensor (`k: torch.Tensor`, attention's keys), and so is k or K bound to a report row's
  "k"; data_gen's and train's k stay what they are there (the top-k logits kept, the TTT step index);
- a parameter or field named num_speculative_tokens has no literal default: NUM_SPECULATIVE_TOKENS, None (a
  writer's own rule) or none; `NUM_SPECULATIVE_TOKENS = <int>` is written once, in core/engine.py;
- a parameter named like an option whose default a config dataclass holds (ONE_DEFAULT: eval's, train's) has no
  literal default: it reads the config's (`EvalConfig.ngram_max`, `TrainConfig.optimizer`) or has none;
- a parameter named steps or decay (a loss's or a check's TTT steps and loss weights) has no literal default: it
  reads the method config's (`PEagleConfig.depth_decay`) or is the caller's (peagle_loss once had decay=1.0, the
  flex-attention check steps=3, beside method.depth_decay and method.ttt_steps);
- a report's or a config's field read from a mapping invents no literal default: `.get("tree_top_k", 1)` is refused
  (publish once read 1 while DraftingConfig.tree_top_k is 4; the MTP card `.get("steps", 3)`), and
  `.get("tree_top_k", DraftingConfig.tree_top_k)` is not;
- a training loss's TTT steps come from its caller: no default (eagle3_loss once had steps=7 while
  method.ttt_steps defaulted to 3).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE_FOLDERS = ("commands", "core", "data_gen", "heads", "train", "eval", "configs")
COUNT = "num_speculative_tokens"
SHORT_NAMES = {"k", "K"}
OTHER_NAMES = {"kk", "main_k", "depth_cap", "num_draft_tokens", "n_draft", "draft_len", "draft_length",
               "num_spec_tokens", "spec_tokens", "speculative_tokens", "spec_k", "num_k"}
COUNT_MARKERS = {COUNT, "sweep_k"}  # attributes and names that hold the count (or the list of counts)
SCOPED = ("commands/", "core/", "heads/", "eval/")
ROW_KEYS = {"k", COUNT}  # a report row's or a JSON's key for the count
ONE_DEFAULT = {"ngram_min", "ngram_max", "stop_below", "tree_top_k", "tree_budget", "ttt_steps", "ttt_decay", "depth_decay",
               "cost_repeats", "near_tie_eps", "optimizer", "max_new_tokens", "max_tokens"}
CALLERS = {"steps", "decay"}  # a loss's or a check's TTT steps and loss weights: the caller's or the config's
CONSTANT = "NUM_SPECULATIVE_TOKENS"
CONSTANT_HOME = "core/engine.py"


def package_files() -> list[Path]:
    return sorted(p for folder in PACKAGE_FOLDERS for p in (ROOT / folder).rglob("*.py"))


def parsed() -> list[tuple[str, ast.AST]]:
    return [(str(p.relative_to(ROOT)), ast.parse(p.read_text(), str(p))) for p in package_files()]


def is_tensor(annotation) -> bool:
    return annotation is not None and "Tensor" in ast.unparse(annotation)


def is_literal(node) -> bool:
    """A number or string written out (a negative number too); None and booleans are not defaults of a count."""
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        node = node.operand
    return isinstance(node, ast.Constant) and isinstance(node.value, (int, float, str)) \
        and not isinstance(node.value, bool)


def reads_the_count(node, row_keys: bool) -> bool:
    """The expression reads `.num_speculative_tokens`, `num_speculative_tokens`, `sweep_k`, or (`row_keys`) a "k"
    or "num_speculative_tokens" key."""
    for n in ast.walk(node):
        if isinstance(n, ast.Attribute) and n.attr in COUNT_MARKERS:
            return True
        if isinstance(n, ast.Name) and n.id in COUNT_MARKERS:
            return True
        if not row_keys:
            continue
        if isinstance(n, ast.Subscript) and isinstance(n.slice, ast.Constant) and n.slice.value in ROW_KEYS:
            return True
        if (isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "get" and n.args
                and isinstance(n.args[0], ast.Constant) and n.args[0].value in ROW_KEYS):
            return True
    return False


def bound_names(target) -> list[str]:
    """The names a binding target binds: x, (a, b), self.attr (as attr), *rest."""
    if isinstance(target, ast.Name):
        return [target.id]
    if isinstance(target, ast.Attribute):
        return [target.attr]
    if isinstance(target, ast.Starred):
        return bound_names(target.value)
    if isinstance(target, (ast.Tuple, ast.List)):
        return [name for t in target.elts for name in bound_names(t)]
    return []


def pairs(target, value) -> list[tuple[list[str], ast.AST]]:
    """(names, the value they take) for an assignment, element by element where both sides are tuples."""
    if (isinstance(target, (ast.Tuple, ast.List)) and isinstance(value, (ast.Tuple, ast.List))
            and len(target.elts) == len(value.elts)):
        return [pair for t, v in zip(target.elts, value.elts) for pair in pairs(t, v)]
    return [(bound_names(target), value)]


def parameters(fn) -> list[tuple[ast.arg, ast.AST | None]]:
    """(parameter, its default or None) of a function or lambda."""
    a = fn.args
    positional = a.posonlyargs + a.args
    defaults = [None] * (len(positional) - len(a.defaults)) + list(a.defaults)
    out = list(zip(positional, defaults)) + list(zip(a.kwonlyargs, a.kw_defaults))
    out += [(x, None) for x in (a.vararg, a.kwarg) if x is not None]
    return out


def second_names(path: str, tree: ast.AST) -> list[str]:
    scoped = path.startswith(SCOPED)
    found = []
    for node in ast.walk(tree):
        where = f"{path}:{getattr(node, 'lineno', '?')}"
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            for arg, _ in parameters(node):
                if arg.arg in OTHER_NAMES or (scoped and arg.arg in SHORT_NAMES and not is_tensor(arg.annotation)):
                    found.append(f"{where}: parameter {arg.arg!r}")
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign, ast.NamedExpr)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                for names, value in (pairs(target, node.value) if node.value is not None else []):
                    for name in names:
                        if name in OTHER_NAMES or (name in SHORT_NAMES and reads_the_count(value, scoped)):
                            found.append(f"{where}: {name!r} = {ast.unparse(value)}")
        elif isinstance(node, (ast.For, ast.AsyncFor, ast.comprehension)):
            for name in bound_names(node.target):
                if name in OTHER_NAMES or (name in SHORT_NAMES and reads_the_count(node.iter, scoped)):
                    found.append(f"{where}: for {name!r} in {ast.unparse(node.iter)}")
    return found


def literal_defaults(path: str, tree: ast.AST) -> list[str]:
    found = []
    for node in ast.walk(tree):
        where = f"{path}:{getattr(node, 'lineno', '?')}"
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            for arg, default in parameters(node):
                if default is not None and arg.arg in ONE_DEFAULT | CALLERS | {COUNT} and is_literal(default):
                    found.append(f"{where}: parameter {arg.arg}={ast.unparse(default)}")
                if (arg.arg in ("steps", "ttt_steps") and default is not None
                        and getattr(node, "name", "").endswith("_loss")):
                    found.append(f"{where}: {node.name}({arg.arg}={ast.unparse(default)}): the caller's steps")
        elif isinstance(node, ast.ClassDef):
            for st in node.body:
                if (isinstance(st, ast.AnnAssign) and isinstance(st.target, ast.Name) and st.target.id == COUNT
                        and st.value is not None and is_literal(st.value)):
                    found.append(f"{where}: field {node.name}.{COUNT} = {ast.unparse(st.value)}")
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get"
              and len(node.args) == 2 and isinstance(node.args[0], ast.Constant)
              and node.args[0].value in ONE_DEFAULT | CALLERS | {COUNT} and is_literal(node.args[1])):
            found.append(f"{where}: {ast.unparse(node)}: a field read with a default of its own")
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(CONSTANT in bound_names(t) for t in targets) and path != CONSTANT_HOME:
                found.append(f"{where}: {CONSTANT} assigned outside {CONSTANT_HOME}")
    return found


def test_the_number_of_drafted_tokens_has_one_name():
    found = [line for path, tree in parsed() for line in second_names(path, tree)]
    assert not found, (f"the number of drafted tokens is `{COUNT}` in code (K in comments only); rename:\n  "
                       + "\n  ".join(found))


def test_no_second_literal_default():
    found = [line for path, tree in parsed() for line in literal_defaults(path, tree)]
    assert not found, ("a second literal default: read the one default (core/engine.py NUM_SPECULATIVE_TOKENS, the "
                       "config dataclass's field) or take the caller's:\n  " + "\n  ".join(found))


def test_the_one_default_is_written_once():
    homes = [path for path, tree in parsed() for node in ast.walk(tree)
             if isinstance(node, ast.Assign) and any(CONSTANT in bound_names(t) for t in node.targets)]
    assert homes == [CONSTANT_HOME]


# what the rules catch: the shapes they were written against, so that a rule that stops catching fails here too
BEFORE = {
    "def engine_runs(cfg, drafter, k: int): pass": second_names,
    "def propose(self, depth_cap): pass": second_names,
    "k = drafting.num_speculative_tokens": second_names,
    "k, seq = drafting.num_speculative_tokens, self.seq": second_names,
    "for k in cfg.sweep_k: pass": second_names,
    "k, best = max((r['k'], r['speedup']) for r in rows)": second_names,
    "class FormatOptions:\n    num_speculative_tokens: int = 3": literal_defaults,
    "def eagle3_loss(head, steps: int = 7, decay: float = 0.8): pass": literal_defaults,
    "def llamacpp_settings(method, num_speculative_tokens, ngram_max: int = 3): pass": literal_defaults,
    "NUM_SPECULATIVE_TOKENS = 3": literal_defaults,
    "def resolve_deepspeed(requested, environ=None, optimizer: str = 'adamw'): pass": literal_defaults,
    "def peagle_loss(head, slots, depths: int, decay: float = 1.0): pass": literal_defaults,
    "def check_attention_against_dense(device='cpu', grads: bool = True, steps: int = 3): pass": literal_defaults,
    "top_k = int(drafting.get('tree_top_k', 1))": literal_defaults,
    "text = f\"over {options.get('steps', 3)} steps\"": literal_defaults,
}
ALLOWED = [
    "def update(self, cache_positions, k: torch.Tensor, v: torch.Tensor): pass",  # attention's keys
    "out = {k: v for k, v in d.items()}",  # a dict's keys
    "for k in TOP_P_CANDIDATES: pass",  # top-k
    "def speculative_config(method, num_speculative_tokens: int, ngram_max: int = EvalConfig.ngram_max): pass",
    "class ExportConfig:\n    num_speculative_tokens: int = NUM_SPECULATIVE_TOKENS",
    "def save(head, num_speculative_tokens: Optional[int] = None): pass",
    "def eagle3_loss(head, steps: int, decay: float = Eagle3Config.ttt_decay): pass",
    "def peagle_loss(head, slots, depths: int, decay: float = PEagleConfig.depth_decay): pass",
    "def check_attention_against_dense(device='cpu', grads: bool = True, *, steps: int): pass",
    "top_k = int(drafting.get('tree_top_k', DraftingConfig.tree_top_k))",
    "mode = drafting.get('mode', 'chain')",  # a field the rules do not name
]


UNSCOPED = [  # data_gen's and train's own k
    "def capture_topk_logits(target, input_ids, folder, k: int = 64): pass",
    "def step_mask(T: int, k: int, device=None): pass",
    "self.k = self.index['k']",
]


@pytest.mark.parametrize("source", list(BEFORE))
def test_the_rules_catch_what_they_were_written_against(source):
    assert BEFORE[source]("eval/example.py", ast.parse(source))


@pytest.mark.parametrize("source", ALLOWED)
def test_the_rules_leave_other_names_alone(source):
    tree = ast.parse(source)
    assert not second_names("eval/example.py", tree) and not literal_defaults("eval/example.py", tree)


@pytest.mark.parametrize("source", UNSCOPED)
def test_data_gen_and_train_keep_their_own_k(source):
    assert not second_names("data_gen/example.py", ast.parse(source))
    assert second_names("commands/example.py", ast.parse(source))
