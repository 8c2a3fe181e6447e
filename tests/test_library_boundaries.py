"""The library never imports the entry point or tools/ (Megatron core's rule), and loads
checkpoints without unpickling."""

import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _library_files():
    for dirpath, _, files in os.walk(os.path.join(ROOT, "megatron_moe")):
        for f in files:
            if f.endswith(".py"):
                yield os.path.join(dirpath, f)


def test_library_does_not_import_tools_or_the_entry_point():
    bad = []
    for path in _library_files():
        tree = ast.parse(open(path).read(), path)
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            bad += [(path, n) for n in names if n.split(".")[0] in ("tools", "pretrain_gpt_moe")]
    assert not bad, bad


def test_no_pickle_based_checkpoint_loading():
    offenders = []
    for path in _library_files():
        if path.endswith(os.path.join("megatron_moe", "testing.py")):
            continue  # pickles results between its own child processes (a queue would anyway); no files
        src = open(path).read()
        tree = ast.parse(src, path)
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                name = f"{getattr(node.func.value, 'id', '')}.{node.func.attr}"
                if name in ("pickle.load", "pickle.loads"):
                    offenders.append((path, name))
                if name == "torch.load":
                    kw = {k.arg: k.value for k in node.keywords}
                    if not (isinstance(kw.get("weights_only"), ast.Constant) and kw["weights_only"].value is True):
                        offenders.append((path, "torch.load without weights_only=True"))
    assert not offenders, offenders


def _writes(tree):
    """(attribute written, the expression it is written on) for every assignment target in `tree`,
    including subscripted ones (`a.b[k] = v` writes `b` of `a`) and setattr(obj, "name", v)."""
    for node in ast.walk(tree):
        targets = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        elif isinstance(node, ast.Delete):
            targets = node.targets
        elif (
            isinstance(node, ast.Call)
            and getattr(node.func, "id", None) == "setattr"
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
        ):
            yield node.args[1].value, node.args[0], node
        for t in targets:
            for el in t.elts if isinstance(t, ast.Tuple) else [t]:
                while isinstance(el, ast.Subscript):
                    el = el.value
                if isinstance(el, ast.Attribute):
                    yield el.attr, el.value, node


def test_no_forward_replacement_and_no_private_parallel_state_writes():
    """Optimizations ask modules for hooks: nothing assigns a module's `forward`, and only
    ParallelState's own methods write its private fields (others call `new_groups`)."""
    from megatron_moe.parallel_state import ParallelState

    private = {f for f in ParallelState.__dataclass_fields__ if f.startswith("_")}
    assert private == {"_groups"}
    bad = []
    for path in _library_files():
        tree = ast.parse(open(path).read(), path)
        methods = {
            id(n)
            for c in ast.walk(tree)
            if isinstance(c, ast.ClassDef) and c.name == "ParallelState"
            for n in ast.walk(c)
        }
        for attr, obj, node in _writes(tree):
            if attr == "forward":
                bad.append((path, node.lineno, "assigns forward"))
            if attr in private and not (id(node) in methods and getattr(obj, "id", None) == "self"):
                bad.append((path, node.lineno, f"writes {attr}"))
    assert not bad, bad


def test_the_check_sees_forward_and_private_writes():
    """The check above is not vacuous: it flags the forms it looks for."""
    src = "m.forward = f\nsetattr(b, 'forward', g)\nps._groups['x'] = 1\nps._groups = {}\n"
    found = sorted(attr for attr, _, _ in _writes(ast.parse(src)))
    assert found == ["_groups", "_groups", "forward", "forward"]


LAYERS = {
    "distributed": 0,
    "layers": 1,
    "kernels": 1,
    "moe": 2,
    "pro_prophet": 2,
    "model": 3,
    "lancet": 4,
    "optimizations": 5,
    "training": 6,
    "inference": 6,
}


def _layer_of(module: str):
    parts = module.split(".")
    return LAYERS.get(parts[1]) if len(parts) > 1 and parts[0] == "megatron_moe" else None


def test_imports_go_down_the_layers_only():
    """distributed -> layers (kernels) -> moe (pro_prophet) -> model -> lancet -> optimizations -> training
    (inference): a module imports
    only from its own layer or lower ones (at module level, outside TYPE_CHECKING) and never
    imports a project module inside a function."""
    bad = []
    for path in _library_files():
        rel = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
        mine = _layer_of(rel)
        if mine is None:
            continue
        tree = ast.parse(open(path).read(), path)
        checking = {
            id(n)
            for node in tree.body
            if isinstance(node, ast.If) and getattr(node.test, "id", "") == "TYPE_CHECKING"
            for n in ast.walk(node)
        }
        top = {id(n) for n in tree.body}  # module level, or the body of a module-level try (optional deps)
        top |= {id(n) for node in tree.body if isinstance(node, ast.Try) for n in node.body}
        for node in ast.walk(tree):
            if not isinstance(node, ast.ImportFrom) or not (node.module or "").startswith("megatron_moe"):
                continue
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            theirs = max((x for x in map(_layer_of, names) if x is not None), default=None)
            if id(node) in checking:
                continue
            if id(node) not in top:
                bad.append((rel, node.lineno, "import inside a function or block"))
            elif theirs is not None and theirs > mine:
                bad.append((rel, node.lineno, f"imports {node.module} from a higher layer"))
    assert not bad, bad
