"""The classes of an installed engine's source, read with `ast` (nothing is imported or executed).

The audit asks structural questions of an engine's model files: which class a model inherits from,
which method it would call, which attributes its constructor sets, which sub-models it builds, which
names its code mentions. Importing an engine to ask them would need its GPU libraries; reading its
source needs only the files, so the audit runs in any environment that has the package installed.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

from parity.textfiles import read_text_capped


@dataclass(frozen=True)
class FunctionInfo:
    params: tuple[str, ...]
    names: frozenset[str]  # every identifier and attribute name its body mentions
    calls: frozenset[str]  # the names of the functions and methods it calls
    defaults: dict[str, str]  # parameter -> the qualified name its default names (a class passed in)
    strings: frozenset[str]  # its string constants (the architectures a predicate compares with)


PARAM = "param:"
# The largest module of an engine is a few hundred kB; a larger .py (or a FIFO named like one) is not read.
MAX_SOURCE_BYTES = 16 * 2**20


@dataclass(frozen=True)
class ClassInfo:
    module: str  # dotted, relative to the package root (`models.qwen3_vl`)
    name: str
    bases: tuple[str, ...]  # qualified (`models.qwen3_vl.Qwen3VLForConditionalGeneration`) where resolvable
    methods: dict[str, FunctionInfo]
    self_attrs: frozenset[str]  # `self.<attr> = ...` anywhere in its methods
    constants: dict[str, object]  # `self.<attr> = <literal>` or a class attribute's literal (the last in the file)
    # attribute -> the qualified class a method builds it from (`self.thinker = X(...)`), or
    # `PARAM + name` when the class is a constructor parameter (`self.model = language_model_cls(...)`)
    built: dict[str, str]

    @property
    def qualname(self) -> str:
        return f"{self.module}.{self.name}"

    @property
    def names(self) -> frozenset[str]:
        return frozenset().union(*(m.names for m in self.methods.values())) if self.methods else frozenset()


@dataclass(frozen=True)
class ModuleInfo:
    name: str
    path: Path
    classes: dict[str, ClassInfo]
    functions: dict[str, FunctionInfo]  # module-level functions
    assignments: dict[str, ast.expr]  # module-level `NAME = <expr>`
    # Every name the module imports from inside the package, wherever the import stands: a package's
    # `__init__` re-exports its classes, also under `if TYPE_CHECKING:` or in a lazy `__getattr__`.
    exports: dict[str, str]


class SourceIndex:
    """Every class of a package's modules, and their method resolution order within the package."""

    def __init__(self, root: Path, package: str) -> None:
        self.root = root  # the package's folder
        self.package = package  # its import name: `from <package>.x import Y` is inside it
        self._modules: dict[str, ModuleInfo | None] = {}

    def module(self, dotted: str) -> ModuleInfo | None:
        """`dotted` relative to the package root (`models.qwen3_vl`), a module or a sub-package's
        `__init__`; None when it has no file."""
        if dotted not in self._modules:
            folder = self.root.joinpath(*dotted.split("."))
            path, package = folder.with_suffix(".py"), False
            if not path.is_file() and (folder / "__init__.py").is_file():
                path, package = folder / "__init__.py", True
            self._modules[dotted] = _read_module(dotted, path, self.package, package) if path.is_file() else None
        return self._modules[dotted]

    def modules_under(self, folder: str) -> list[ModuleInfo]:
        files = sorted(self.root.joinpath(*folder.split(".")).glob("*.py"))
        found = (self.module(f"{folder}.{p.stem}") for p in files)
        return [m for m in found if m is not None]

    def cls(self, qualname: str) -> ClassInfo | None:
        """The class, where the module defines it or re-exports it from another module of the package."""
        for _ in range(8):  # a chain of re-exports is short; a cycle of them is no class
            module, _, name = qualname.rpartition(".")
            info = self.module(module)
            if info is None:
                return None
            if name in info.classes:
                return info.classes[name]
            if name not in info.exports:
                return None
            qualname = info.exports[name]
        return None

    def mro(self, qualname: str) -> list[ClassInfo]:
        """The class and its ancestors that live in the package, nearest first (depth-first, left to
        right, each once: Python's order for the single-inheritance chains these models use)."""
        order: list[ClassInfo] = []
        seen: set[str] = set()

        def visit(name: str) -> None:
            info = self.cls(name)
            if info is None or name in seen:
                return
            seen.add(name)
            order.append(info)
            for base in info.bases:
                visit(base)

        visit(qualname)
        return order

    def defining(self, qualname: str, method: str) -> ClassInfo | None:
        """The class whose `method` an instance of `qualname` would call."""
        return next((c for c in self.mro(qualname) if method in c.methods), None)

    def sets(self, qualname: str, attr: str) -> ClassInfo | None:
        """The nearest class in the MRO that assigns `self.<attr>`, or defines it as a class attribute."""
        return next((c for c in self.mro(qualname) if attr in c.self_attrs), None)

    def mentions(self, qualname: str, names: frozenset[str]) -> frozenset[str]:
        """Which of `names` the class's own code or its ancestors' mentions."""
        found: set[str] = set()
        for info in self.mro(qualname):
            found |= info.names & names
        return frozenset(found)

    def built(self, qualname: str) -> dict[str, str]:
        """Attribute -> class of every sub-model the class (or an ancestor) builds, nearest wins; a
        class passed to the constructor is the nearest constructor's default for that parameter."""
        chain = self.mro(qualname)
        merged: dict[str, str] = {}
        for info in reversed(chain):
            merged.update(info.built)
        for attr, source in merged.items():
            if source.startswith(PARAM):
                param = source[len(PARAM):]
                merged[attr] = next((c.methods["__init__"].defaults[param] for c in chain
                                     if param in getattr(c.methods.get("__init__"), "defaults", {})), source)
        return merged

    def submodel(self, qualname: str, attr: str) -> str | None:
        found = self.built(qualname).get(attr)
        return None if found is None or found.startswith(PARAM) else found


def _read_module(dotted: str, path: Path, package: str, is_package: bool = False) -> ModuleInfo | None:
    try:
        tree = ast.parse(read_text_capped(path, MAX_SOURCE_BYTES), filename=str(path))
    except (OSError, SyntaxError, UnicodeDecodeError, ValueError):
        return None  # a file the audit cannot read is a file it reports nothing about
    here = dotted if is_package else dotted.rsplit(".", 1)[0] if "." in dotted else ""  # what `.` means
    imports = _imports(tree.body, here, package)
    local = {n.name for n in tree.body if isinstance(n, ast.ClassDef)}

    def qualify(name: str) -> str:
        head, _, rest = name.partition(".")
        if head in local and not rest:
            return f"{dotted}.{head}"
        if head in imports:
            return imports[head] + (f".{rest}" if rest else "")
        return name

    classes = {n.name: _read_class(dotted, n, qualify) for n in tree.body if isinstance(n, ast.ClassDef)}
    assignments = {t.id: n.value for n in tree.body if isinstance(n, ast.Assign)
                   for t in n.targets if isinstance(t, ast.Name)}
    functions = {n.name: _function(n, qualify) for n in tree.body
                 if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    exports = {**_imports(ast.walk(tree), here, package, first_wins=True), **imports}  # top level wins
    return ModuleInfo(dotted, path, classes, functions, assignments, exports)


def _imports(nodes, package: str, root: str, first_wins: bool = False) -> dict[str, str]:
    """Local name -> dotted name relative to the package root, for imports from inside the package;
    `package` is what a relative import's `.` names. A name imported twice is bound by the last
    import, as Python binds it; across branches (`first_wins`, a platform's alternatives) by the first."""
    names: dict[str, str] = {}
    for node in nodes:
        if not isinstance(node, ast.ImportFrom) or node.module is None and not node.level:
            continue
        if node.level:
            parts = [p for p in package.split(".") if p]
            source = ".".join(parts[: max(0, len(parts) - node.level + 1)] + ([node.module] if node.module else []))
        else:
            if node.module != root and not node.module.startswith(root + "."):
                continue
            source = node.module[len(root) + 1:]
        for alias in node.names:
            if not (first_wins and (alias.asname or alias.name) in names):
                names[alias.asname or alias.name] = f"{source}.{alias.name}"
    return names


def _read_class(module: str, node: ast.ClassDef, qualify) -> ClassInfo:
    methods: dict[str, FunctionInfo] = {}
    self_attrs: set[str] = set()
    constants: dict[str, object] = {}
    built: dict[str, str] = {}
    for item in node.body:
        if isinstance(item, (ast.Assign, ast.AnnAssign)):
            targets = item.targets if isinstance(item, ast.Assign) else [item.target]
            self_attrs.update(t.id for t in targets if isinstance(t, ast.Name))
            if isinstance(item.value, ast.Constant):  # a class attribute's literal (an opt-in flag)
                constants.update((t.id, item.value.value) for t in targets if isinstance(t, ast.Name))
        if not isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        info = _function(item, qualify)
        methods[item.name] = info
        for sub in ast.walk(item):
            for target in _self_targets(sub):
                self_attrs.add(target)
                value = sub.value
                if isinstance(value, ast.Constant):
                    constants[target] = value.value
                if isinstance(value, ast.Call) and _dotted(value.func):
                    callee = _dotted(value.func)
                    built[target] = PARAM + callee if callee in info.params else qualify(callee)
    bases = tuple(qualify(_dotted(b)) for b in node.bases if _dotted(b))
    return ClassInfo(module, node.name, bases, methods, frozenset(self_attrs), constants, built)


def _function(node: ast.FunctionDef | ast.AsyncFunctionDef, qualify) -> FunctionInfo:
    args = node.args
    params = tuple(a.arg for a in (*args.posonlyargs, *args.args, *args.kwonlyargs))
    positional = (*args.posonlyargs, *args.args)
    pairs = [*zip(positional[len(positional) - len(args.defaults):], args.defaults),
             *zip(args.kwonlyargs, args.kw_defaults)]
    defaults = {a.arg: qualify(_dotted(d)) for a, d in pairs if d is not None and _dotted(d)}
    names, calls, strings = set(), set(), set()
    for sub in ast.walk(node):
        if isinstance(sub, ast.Name):
            names.add(sub.id)
        elif isinstance(sub, ast.Attribute):
            names.add(sub.attr)
        elif isinstance(sub, ast.Constant) and isinstance(sub.value, str):
            strings.add(sub.value)
            if sub.value.isidentifier():
                names.add(sub.value)  # getattr(self, "name"), kwargs["name"]
        if isinstance(sub, ast.Call) and _callee(sub.func):
            calls.add(_callee(sub.func))
    return FunctionInfo(params, frozenset(names), frozenset(calls), defaults, frozenset(strings))


def _self_targets(node: ast.AST) -> list[str]:
    if isinstance(node, ast.Assign):
        targets = node.targets
    elif isinstance(node, ast.AnnAssign):
        targets = [node.target]
    else:
        return []
    return [t.attr for t in targets
            if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self"]


def _dotted(node: ast.expr) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        head = _dotted(node.value)
        return f"{head}.{node.attr}" if head else ""
    if isinstance(node, ast.Subscript):  # Generic[...] bases
        return _dotted(node.value)
    return ""


def _callee(node: ast.expr) -> str:
    if isinstance(node, ast.Attribute):
        return node.attr
    return node.id if isinstance(node, ast.Name) else ""


def literal_strings(node: ast.expr | None) -> tuple[str, ...]:
    """The string constants of a list, tuple or set literal (a module's architecture list)."""
    if not isinstance(node, (ast.List, ast.Tuple, ast.Set)):
        return ()
    return tuple(e.value for e in node.elts if isinstance(e, ast.Constant) and isinstance(e.value, str))
