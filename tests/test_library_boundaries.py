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
            continue    # pickles results between its own child processes (a queue would anyway); no files
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
