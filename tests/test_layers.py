"""parity's layers (README, "Package map"; design §5): what each package may import, read from the
source itself. A lower layer never imports a higher one, packages of one layer never import each
other, and no two modules import each other, directly or around a circle (an import under
`if TYPE_CHECKING:` is a type hint, not an import). Backends' capabilities come down as data: the
registry (a base module) names each backend's entry as a string and loads it when asked.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "parity"

# Lowest first. A module may import its own package's modules and any lower layer's.
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("base", ("parity", "parity.errors", "parity.textfiles", "parity.design", "parity.data", "parity.arms",
              "parity.evidence", "parity.row_owners", "parity.presets", "parity.preset_tokenizer",
              "parity.model_identity", "parity.capabilities", "parity.registry")),
    ("results", ("parity.results",)),  # the file's model and its JSON
    ("media", ("parity.media",)),  # what a request shows the model
    ("runner", ("parity.runner",)),  # the in-process prefill graph runner
    ("audit", ("parity.audit",)),  # the audit's reading of an engine's source and its report
    ("plan", ("parity.plan",)),  # a run's plan and its shards
    ("judge", ("parity.judge",)),  # metrics, verdicts, the evidence they need, experiment identity
    ("trust", ("parity.trust",)),  # reading a file back, and the rules a file keeps
    ("models", ("parity.models",)),  # loading models: presets and checkpoints
    ("backends", ("parity.backends",)),  # the backend protocol and the in-process backend
    ("engines", ("parity.engines",)),  # the server engines (SGLang, vLLM) behind that protocol
    ("run", ("parity.run",)),  # running the experiment on a backend
    ("reporting", ("parity.reporting",)),  # rendering judged runs
    ("commands", ("parity.cli", "parity.cli_options", "parity.run_command", "parity.localize_command",
                  "parity.merge", "parity.listings", "parity.__main__")),
)
RANK = {name: i for i, (name, _) in enumerate(LAYERS)}


def _modules() -> dict[str, Path]:
    found = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


MODULES = _modules()


def layer_of(module: str) -> str:
    matches = [(len(prefix), name) for name, prefixes in LAYERS for prefix in prefixes
               if module == prefix or (prefix != "parity" and module.startswith(prefix + "."))]
    assert matches, f"{module} is in no layer: add it to LAYERS (and to the README's package map)"
    return max(matches)[1]


def _type_checking(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def imports_of(module: str) -> set[str]:
    """The parity modules `module` imports, at module level or inside a function."""
    found: set[str] = set()
    stack: list[ast.AST] = [ast.parse(MODULES[module].read_text())]
    while stack:
        node = stack.pop()
        if _type_checking(node):
            continue
        stack.extend(ast.iter_child_nodes(node))
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "parity":
            names = [f"{node.module}.{a.name}" for a in node.names]
            found.update(n for n in names if n in MODULES) if any(n in MODULES for n in names) else found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.split(".")[0] == "parity")
    return {m for m in found if m in MODULES and m != module}


def test_every_module_has_a_layer_and_no_import_runs_up_or_across():
    wrong = []
    for module in sorted(MODULES):
        mine = layer_of(module)
        for target in sorted(imports_of(module)):
            theirs = layer_of(target)
            if RANK[theirs] > RANK[mine] or (theirs != mine and RANK[theirs] == RANK[mine]):
                wrong.append(f"{module} ({mine}) imports {target} ({theirs})")
    assert wrong == []


def test_no_import_circle():
    graph = {m: imports_of(m) for m in MODULES}
    state: dict[str, int] = {}  # 1 on the path, 2 done
    circles = []

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for target in sorted(graph[module]):
            if state.get(target) == 1:
                circles.append(" -> ".join(path[path.index(target):] + [module, target]) if target in path
                               else f"{module} -> {target}")
            elif target not in state:
                visit(target, path + [module])
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [])
    assert circles == []


def test_no_module_outside_the_engines_names_a_backend():
    """A backend is asked for by its capabilities (the registry), never compared by name."""
    named = []
    for module, path in MODULES.items():
        if module.startswith(("parity.engines", "parity.backends")) or module == "parity.registry":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Compare) and any(isinstance(c, ast.Constant) and c.value in ENGINE_NAMES
                                                     for c in [node.left, *node.comparators]):
                named.append(f"{module}:{node.lineno}")
    assert named == []


ENGINE_NAMES = ("transformers", "sglang", "vllm")


def test_the_layering_itself_is_a_real_check():
    """The negative control: an import that runs up, and a circle, are found."""
    assert RANK[layer_of("parity.judge.verdict")] < RANK[layer_of("parity.engines.engine")]
    assert "parity.results" in imports_of("parity.judge.verdict")
    assert layer_of("parity.trust.loader") == "trust" and layer_of("parity.run_command") == "commands"
