"""What agentkv's connector uses of vLLM, read from our own source, checked against a vLLM source tree.

Nothing is listed by hand: ``uses()`` parses our modules that import vLLM (``vllm_modules()``) with ast and
collects every ``from vllm... import``, every ``module.name`` on an imported vLLM module, and for each class
that extends a vLLM class: the methods it overrides (public ones, and any that call ``super()`` under the
same name) with their parameters, every ``super().m(...)`` and ``VllmBase.m(self, ...)`` call, every
``self.x`` it reads without setting, and attributes read from parameters annotated with a vLLM type (one
step further through a local such as ``ktc = vllm_config.kv_transfer_config``). ``Tree`` answers the same
questions from a vLLM source tree, parsed, never imported. ``getattr(obj, "x", default)`` is how our code
marks a name it knows some releases lack, so those are not collected.
"""

from __future__ import annotations

import ast
import dataclasses
from collections.abc import Iterator, Mapping
from pathlib import Path

__all__ = ["Tree", "Use", "check", "has_member", "uses", "vllm_modules"]

REPO = Path(__file__).resolve().parents[3]
VLLM_IMPORTS = (
    "agentkv/server/engine/_connector/_vllm.py"  # the vLLM classes we extend, imported in one place
)


def vllm_modules(root: Path = REPO) -> tuple[str, ...]:
    """Every module of ours that imports from vLLM, directly or through ``_vllm``: found, not listed, so a
    new one is checked the day it is written."""
    dotted = VLLM_IMPORTS.removesuffix(".py").replace("/", ".")
    found = []
    for path in sorted((root / "agentkv").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            modules = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else []
            )
            if any(m.split(".")[0] == "vllm" or m == dotted for m in modules):
                found.append(path.relative_to(root).as_posix())
                break
    return tuple(found)


@dataclasses.dataclass(frozen=True)
class Use:
    """One thing our code relies on."""

    # import | attr (``x.name`` on an imported vLLM module or class) | override | call (super() or
    # Base.m(self)) | member (an attribute read) | sets (one our subclass assigns, which vLLM may read)
    kind: str
    module: str  # the vLLM module that defines (or re-exports) ``owner``
    owner: str  # a class name, or "" for a module-level name
    name: str
    params: tuple[str, ...] = ()  # override: our positional parameters after self
    args: int = 0  # call: positional arguments passed after self
    keywords: tuple[str, ...] = ()  # call: keyword arguments passed
    where: str = ""  # file:line in our code

    def __str__(self) -> str:
        target = f"{self.module}.{self.owner + '.' if self.owner else ''}{self.name}"
        return f"{self.kind} {target} ({self.where})"


# --- the vLLM side -----------------------------------------------------------------------------------------
@dataclasses.dataclass
class ClassInfo:
    module: str
    node: ast.ClassDef
    bases: list[ClassInfo]

    def mro(self) -> Iterator[ClassInfo]:
        seen: set[int] = set()
        stack = [self]
        while stack:
            cls = stack.pop(0)
            if id(cls.node) not in seen:
                seen.add(id(cls.node))
                yield cls
                stack.extend(cls.bases)

    def method(self, name: str) -> ast.FunctionDef | ast.AsyncFunctionDef | None:
        for cls in self.mro():
            for stmt in cls.node.body:
                if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)) and stmt.name == name:
                    return stmt
        return None

    def has_member(self, name: str) -> bool:
        return self.method(name) is not None or any(name in _assigned(cls.node) for cls in self.mro())

    def member_type(self, name: str) -> tuple[str, ast.expr] | None:
        """The annotation of a field or ``self.name: T = ...`` (with the module it is written in)."""
        for cls in self.mro():
            for node in ast.walk(cls.node):
                if isinstance(node, ast.AnnAssign):
                    t = node.target
                    if (isinstance(t, ast.Name) and t.id == name and node in cls.node.body) or (
                        isinstance(t, ast.Attribute) and _is_self(t.value) and t.attr == name
                    ):
                        return cls.module, node.annotation
        return None


def _is_self(node: ast.expr) -> bool:
    return isinstance(node, ast.Name) and node.id == "self"


def _assigned(node: ast.ClassDef) -> frozenset[str]:
    names: set[str] = set()
    for stmt in node.body:
        targets = stmt.targets if isinstance(stmt, ast.Assign) else [getattr(stmt, "target", None)]
        names.update(t.id for t in targets if isinstance(t, ast.Name))
    for sub in ast.walk(node):
        targets = sub.targets if isinstance(sub, ast.Assign) else [getattr(sub, "target", None)]
        if isinstance(sub, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            names.update(t.attr for t in targets if isinstance(t, ast.Attribute) and _is_self(t.value))
    return frozenset(names)


class Tree:
    """A vLLM source tree (the directory that holds the ``vllm`` package), parsed on demand."""

    def __init__(self, root: Path, *, replaced: Mapping[str, str | None] | None = None) -> None:
        """``replaced``: file paths relative to ``root`` -> their text instead, None for a file that is gone
        (how the test mutates a release without copying it)."""
        self.root = root
        self._replaced = dict(replaced or {})
        self._modules: dict[str, ast.Module | None] = {}

    def _text(self, rel: str) -> str | None:
        if rel in self._replaced:
            return self._replaced[rel]
        path = self.root / rel
        return path.read_text(encoding="utf-8") if path.is_file() else None

    def module(self, dotted: str) -> ast.Module | None:
        if dotted not in self._modules:
            base = "/".join(dotted.split("."))
            text = next((t for t in map(self._text, (f"{base}.py", f"{base}/__init__.py")) if t), None)
            self._modules[dotted] = ast.parse(text) if text is not None else None
        return self._modules[dotted]

    def resolve(self, module: str, name: str, depth: int = 0) -> tuple[str, ast.AST] | None:
        """Where ``module.name`` is defined (following re-exports and submodules), or None."""
        tree = self.module(module)
        if tree is None or depth > 8:
            return None
        for stmt in _top_level(tree):
            if isinstance(stmt, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and stmt.name == name:
                return module, stmt
            if isinstance(stmt, (ast.Assign, ast.AnnAssign)):
                targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
                if any(isinstance(t, ast.Name) and t.id == name for t in targets):
                    return module, stmt
            if isinstance(stmt, ast.ImportFrom):
                for alias in stmt.names:
                    if (alias.asname or alias.name) == name:
                        source = _absolute(module, stmt, self)
                        return self.resolve(source, alias.name, depth + 1) or (
                            (f"{source}.{alias.name}", stmt)
                            if self.module(f"{source}.{alias.name}")
                            else None
                        )
        sub = f"{module}.{name}"
        return (sub, tree) if self.module(sub) is not None else None

    def cls(self, module: str, name: str) -> ClassInfo | None:
        found = self.resolve(module, name)
        if found is None or not isinstance(found[1], ast.ClassDef):
            return None
        where, node = found
        bases = []
        for base in node.bases:
            ref = _dotted(base)
            if ref is None:
                continue
            head, _, rest = ref.partition(".")
            info = self.cls(*self._name_ref(where, head, rest))
            if info is not None:
                bases.append(info)
        return ClassInfo(module=where, node=node, bases=bases)

    def _name_ref(self, module: str, head: str, rest: str) -> tuple[str, str]:
        """``head[.rest]`` as written in ``module`` -> (module, class name) to resolve."""
        if not rest:
            return module, head
        found = self.resolve(module, head)
        return (found[0] if found else module), rest.rsplit(".", 1)[-1]

    def type_of(self, module: str, annotation: ast.expr) -> ClassInfo | None:
        """The one vLLM class an annotation names (``X``, ``X | None``, ``"X"``), or None."""
        if isinstance(annotation, ast.Constant) and isinstance(annotation.value, str):
            annotation = ast.parse(annotation.value, mode="eval").body
        names = [n.id for n in ast.walk(annotation) if isinstance(n, ast.Name) and n.id != "None"]
        classes = [c for c in (self.cls(module, n) for n in names) if c is not None]
        return classes[0] if len(classes) == 1 else None


def _top_level(tree: ast.Module) -> Iterator[ast.stmt]:
    """Module-level statements, including those under ``if``/``try`` (TYPE_CHECKING, optional imports)."""
    stack = list(tree.body)
    while stack:
        stmt = stack.pop(0)
        if isinstance(stmt, (ast.If, ast.Try)):
            stack[:0] = [*stmt.body, *getattr(stmt, "orelse", []), *getattr(stmt, "finalbody", [])]
            for handler in getattr(stmt, "handlers", []):
                stack[:0] = handler.body
        else:
            yield stmt


def _absolute(module: str, stmt: ast.ImportFrom, tree: Tree) -> str:
    if not stmt.level:
        return stmt.module or ""
    is_package = tree._text("/".join([*module.split("."), "__init__.py"])) is not None
    parts = module.split(".")
    base = parts if is_package else parts[:-1]
    base = base[: len(base) - (stmt.level - 1)]
    return ".".join([*base, *([stmt.module] if stmt.module else [])])


def _dotted(node: ast.expr) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        head = _dotted(node.value)
        return f"{head}.{node.attr}" if head else None
    return None


# --- our side ----------------------------------------------------------------------------------------------
def _positional(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> tuple[str, ...]:
    return tuple(a.arg for a in [*fn.args.posonlyargs, *fn.args.args][1:])


def uses(root: Path = REPO) -> list[Use]:
    """Everything our modules use of vLLM (see the module docstring)."""
    files = vllm_modules(root)
    out: list[Use] = []
    # Files in import order (``_vllm`` before its users): a vLLM name our module re-exports keeps its origin.
    parsed = {rel: ast.parse((root / rel).read_text(encoding="utf-8")) for rel in files}
    exported: dict[str, dict[str, tuple[str, str]]] = {}
    for rel in sorted(files, key=lambda r: r != VLLM_IMPORTS):
        tree = parsed[rel]
        names: dict[str, tuple[str, str]] = {}  # local name -> (vLLM module, name); name "" = a module
        for node in ast.walk(tree):
            where = f"{rel}:{getattr(node, 'lineno', 0)}"
            if isinstance(node, ast.ImportFrom) and node.module in exported:
                for alias in node.names:
                    if alias.name in exported[node.module]:
                        names[alias.asname or alias.name] = exported[node.module][alias.name]
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "vllm":
                for alias in node.names:
                    names[alias.asname or alias.name] = (node.module or "", alias.name)
                    out.append(Use("import", node.module or "", "", alias.name, where=where))
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.split(".")[0] == "vllm":
                        names[alias.asname or alias.name] = (alias.name, "")
        # Our own classes that extend vLLM's, even through one of ours (AgentKV* -> Nixl*).
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id in names
            ):
                module, name = names[node.value.id]
                out.append(Use("attr", module, name, node.attr, where=f"{rel}:{node.lineno}"))
            if isinstance(node, ast.ClassDef):
                base = next(
                    (names[b.id] for b in node.bases if isinstance(b, ast.Name) and b.id in names), None
                )
                if base is not None:
                    out.extend(_class_uses(node, base, names, rel))
        exported[rel.removesuffix(".py").replace("/", ".")] = names
    return out


def _class_uses(
    node: ast.ClassDef, base: tuple[str, str], names: dict[str, tuple[str, str]], rel: str
) -> Iterator[Use]:
    module, owner = base
    own = set()
    for sub in ast.walk(node):
        if isinstance(sub, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = sub.targets if isinstance(sub, ast.Assign) else [sub.target]
            own.update(t.attr for t in targets if isinstance(t, ast.Attribute) and _is_self(t.value))
    methods = {s.name: s for s in node.body if isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef))}
    for fn in methods.values():
        where = f"{rel}:{fn.lineno}"
        supers = {
            c.func.attr
            for c in ast.walk(fn)
            if isinstance(c, ast.Call)
            and isinstance(c.func, ast.Attribute)
            and isinstance(c.func.value, ast.Call)
            and isinstance(c.func.value.func, ast.Name)
            and c.func.value.func.id == "super"
        }
        if not fn.name.startswith("_") or fn.name == "__init__" or fn.name in supers:
            yield Use("override", module, owner, fn.name, params=_positional(fn), where=where)
        for call in ast.walk(fn):
            if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute)):
                continue
            target = call.func.value
            via_super = isinstance(target, ast.Call) and getattr(target.func, "id", None) == "super"
            via_base = isinstance(target, ast.Name) and target.id in names and names[target.id][1]
            if via_super or via_base:
                cls_module, cls_name = (module, owner) if via_super else names[target.id]  # type: ignore[index]
                n_args = len(call.args) - (0 if via_super else 1)  # Base.m(self, ...) passes self
                kws = tuple(k.arg for k in call.keywords if k.arg)
                yield Use(
                    "call", cls_module, cls_name, call.func.attr, args=n_args, keywords=kws, where=where
                )
        for sub in ast.walk(fn):
            loaded = isinstance(sub, ast.Attribute) and _is_self(sub.value) and isinstance(sub.ctx, ast.Load)
            if loaded and sub.attr not in own and sub.attr not in methods:  # type: ignore[union-attr]
                yield Use("member", module, owner, sub.attr, where=f"{rel}:{sub.lineno}")
        yield from _typed_uses(fn, names, rel)
    # Attributes our class sets that vLLM may read (``connector_scheduler``): the test compares releases.
    for attr in sorted(own):
        yield Use("sets", module, owner, attr, where=f"{rel}:{node.lineno}")


def _typed_uses(
    fn: ast.FunctionDef | ast.AsyncFunctionDef, names: dict[str, tuple[str, str]], rel: str
) -> Iterator[Use]:
    """``param.x`` for parameters annotated with a vLLM class; ``local.y`` where ``local = param.x``."""
    typed: dict[str, tuple[str, str, str]] = {}  # name -> (module, class, via member or "")
    for arg in [*fn.args.posonlyargs, *fn.args.args, *fn.args.kwonlyargs]:
        ann = arg.annotation
        if isinstance(ann, ast.Constant) and isinstance(ann.value, str):
            ann = ast.parse(ann.value, mode="eval").body
        if isinstance(ann, ast.Name) and ann.id in names and names[ann.id][1]:
            typed[arg.arg] = (*names[ann.id], "")
    for stmt in ast.walk(fn):
        if (
            isinstance(stmt, ast.Assign)
            and len(stmt.targets) == 1
            and isinstance(stmt.targets[0], ast.Name)
            and isinstance(stmt.value, ast.Attribute)
            and isinstance(stmt.value.value, ast.Name)
            and stmt.value.value.id in typed
            and not typed[stmt.value.value.id][2]
        ):
            module, cls, _ = typed[stmt.value.value.id]
            typed[stmt.targets[0].id] = (module, cls, stmt.value.attr)
    for sub in ast.walk(fn):
        if isinstance(sub, ast.Attribute) and isinstance(sub.value, ast.Name) and sub.value.id in typed:
            module, cls, via = typed[sub.value.id]
            # "Class.via.name": the member's own annotated type is resolved by the checker.
            yield Use(
                "member", module, cls if not via else f"{cls}.{via}", sub.attr, where=f"{rel}:{sub.lineno}"
            )


# --- the check ---------------------------------------------------------------------------------------------
def check(use: Use, tree: Tree) -> str | None:
    """None when ``tree`` provides what ``use`` needs, else why not."""
    if use.kind == "import":
        if tree.module(use.module) is None:
            return f"module {use.module} does not exist"
        return None if tree.resolve(use.module, use.name) else f"{use.module} has no {use.name}"
    if use.kind == "attr":  # vllm.__version__, nixl_utils.NixlWrapper, KVConnectorRole.SCHEDULER
        module = use.module
        if use.owner:
            found = tree.resolve(use.module, use.owner)
            if found is None:
                return f"{use.module} has no {use.owner}"
            if isinstance(found[1], ast.ClassDef):
                cls = tree.cls(use.module, use.owner)
                ok = cls is not None and cls.has_member(use.name)
                return None if ok else f"{use.owner} has no attribute or method {use.name}"
            module = f"{use.module}.{use.owner}"
        return None if tree.resolve(module, use.name) else f"{module} has no {use.name}"
    owner, _, via = use.owner.partition(".")
    cls = tree.cls(use.module, owner)
    if cls is None:
        return f"class {use.module}.{owner} does not exist"
    if via:
        typed = cls.member_type(via)
        if typed is None:
            return f"{owner}.{via} has no annotated type"
        inner = tree.type_of(*typed)
        if inner is None:
            return None  # a dict, an int...: not vLLM's to change under us (the member itself is checked)
        cls, owner = inner, f"{owner}.{via}"
    if use.kind == "sets":
        # Ours unless vLLM has it too; whether vLLM reads it is a question across releases (the test's).
        return None
    if use.kind == "member":
        return None if cls.has_member(use.name) else f"{owner} has no attribute or method {use.name}"
    fn = cls.method(use.name)
    if fn is None:
        return f"{owner} has no method {use.name}"
    theirs = _positional(fn)
    if use.kind == "override":
        # vLLM calls overrides with its parameters, positionally or by name: ours must match them.
        if use.params != theirs and not (fn.args.vararg and not theirs):
            return f"{owner}.{use.name}{theirs} but ours takes {use.params}"
        return None
    # A call: what we pass must fit the signature.
    accepts_more = fn.args.vararg is not None
    if use.args > len(theirs) and not accepts_more:
        return f"{owner}.{use.name}{theirs} takes {len(theirs)} arguments, we pass {use.args}"
    named = {a.arg for a in [*fn.args.args, *fn.args.kwonlyargs]}
    unknown = [k for k in use.keywords if k not in named]
    if unknown and fn.args.kwarg is None:
        return f"{owner}.{use.name} has no parameter {unknown}"
    required = [a.arg for a in fn.args.kwonlyargs if fn.args.kw_defaults[fn.args.kwonlyargs.index(a)] is None]
    missing = [k for k in required if k not in use.keywords]
    if missing:
        return f"{owner}.{use.name} requires keyword {missing}"
    n_defaults = len(fn.args.defaults)
    needed = len(theirs) - n_defaults
    passed = use.args + len([k for k in use.keywords if k in theirs])
    return (
        None if passed >= needed else f"{owner}.{use.name}{theirs} needs {needed} arguments, we pass {passed}"
    )


def has_member(use: Use, tree: Tree) -> bool:
    """Whether the vLLM class behind ``use`` has ``use.name`` (for attributes our subclasses set)."""
    cls = tree.cls(use.module, use.owner)
    return cls is not None and cls.has_member(use.name)
