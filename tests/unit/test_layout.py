"""The package's shape: imports point one way, modules stay small enough to read in one sitting."""

import ast
import pathlib

from runner import REPO

PACKAGE = pathlib.Path(REPO, "jaxrat")

# Higher layers may import lower ones, never the reverse; two rooms of one layer never import
# each other. Inside a room (a package folder) imports are free.
LAYERS = {
    # the ``python -m jaxrat.NAME`` entry modules, each calling its command in cli/
    "main": 7, "launch": 7, "checkpoints": 7, "evaluate": 7, "sweep": 7, "summarize": 7, "robustness": 7,
    "predict": 7, "export": 7, "tune": 7, "report": 7, "download": 7, "__main__": 7,
    "cli": 6,
    "configs": 3,
    "inference": 5,
    "trainer": 4, "experiments": 4,
    "tasks": 3,
    "models": 2, "data": 2,
    "parallel": 1, "checkpointing": 1, "cluster": 1, "tracking": 1,
    "config_schema": 0.5,  # what a config is and its defaults: below every room that reads a config
    "ops": 1,
    "optim": 1,  # the optimizer's kernels over the parameter tree: beside the model's ops, importing neither
    "runtime": 0,
}
MAX_LINES = 420


def _room(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def _modules():
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE.parent).with_suffix("")
        name = ".".join(rel.parts).removesuffix(".__init__")
        yield name, path


def _imports(path: pathlib.Path, name: str):
    tree = ast.parse(path.read_text())
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                yield f"{base}.{node.module}" if node.module else base
            elif node.module:
                if node.module == "jaxrat":
                    yield from (f"jaxrat.{a.name}" for a in node.names)
                else:
                    yield node.module


def test_imports_point_down():
    bad = []
    for name, path in _modules():
        room = _room(name)
        if room not in LAYERS:
            continue
        for target in _imports(path, name):
            if not target.startswith("jaxrat."):
                continue
            other = _room(target)
            if other == room or other not in LAYERS:
                continue
            if LAYERS[other] >= LAYERS[room]:
                bad.append(f"{name} imports {target}")
    assert not bad, "imports against the layering:\n" + "\n".join(bad)


def test_every_room_has_a_layer():
    rooms = {_room(name) for name, _ in _modules()} - {""}
    assert rooms <= set(LAYERS), f"place these in LAYERS: {sorted(rooms - set(LAYERS))}"


def test_no_module_is_too_long_to_read():
    long = {name: n for name, path in _modules() if (n := len(path.read_text().splitlines())) > MAX_LINES}
    assert not long, f"split these: {long}"


# Inside ops/: the dispatch modules (ops/*.py) choose among the kernel families, which import only down;
# ops/blocks.py holds the static kernel parameters both sides share, and imports nothing of ops.
OPS_LAYERS = {"dispatch": 3, "gpu": 2, "cpu": 2, "portable": 1, "blocks": 0}


def _ops_room(module: str) -> str:
    parts = module.split(".")
    return parts[2] if len(parts) >= 3 and parts[2] in OPS_LAYERS else "dispatch"


def test_ops_kernel_families_import_only_down():
    bad = []
    for name, path in _modules():
        if not name.startswith("jaxrat.ops."):
            continue
        for target in _imports(path, name):
            if target.startswith("jaxrat.ops.") and _ops_room(target) != _ops_room(name):
                if OPS_LAYERS[_ops_room(target)] >= OPS_LAYERS[_ops_room(name)]:
                    bad.append(f"{name} imports {target}")
    assert not bad, "ops imports against its layering:\n" + "\n".join(bad)


def test_models_call_only_the_ops_dispatch():
    """Model code states the math; which kernel computes it is the dispatch's choice."""
    bad = [f"{name} imports {target}" for name, path in _modules() if name.startswith("jaxrat.models")
           for target in _imports(path, name) if target.startswith("jaxrat.ops.") and _ops_room(target) != "dispatch"]
    assert not bad, "\n".join(bad)
