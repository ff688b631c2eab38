"""Accelerate's compatibility names are composed onto the `Accelerator`, not fed by its private
state (issue 47): no class of ``unified/compat/`` reads a private attribute (``self._x``) that it
does not define itself, nothing there reads a private attribute of another object (the host's
``accelerator._x`` included), and what `AccelerateSurface` and `AcceleratorState` read of the
Accelerator is declared by the `SurfaceHost` protocol, which the Accelerator satisfies. Each
offence is named file:line."""
from __future__ import annotations

import ast
from pathlib import Path
from typing import Dict, Iterator, List, Set, Tuple

REPO = Path(__file__).resolve().parents[2]
COMPAT = REPO / "unified" / "compat"
HOST_PROTOCOL = ("unified/compat/host.py", "SurfaceHost")
# classes of unified/compat/ mixed into the Accelerator: their public ``self.<name>`` reads are
# their own names or the protocol's
MIXINS = {("unified/compat/surface.py", "AccelerateSurface")}
# classes of unified/compat/ that hold the Accelerator as ``self.<attribute>``: what they read of it
VIEWS = {("unified/compat/state.py", "AcceleratorState"): "_accelerator"}


def _compat_files() -> Iterator[Tuple[str, ast.Module]]:
    for path in sorted(COMPAT.glob("*.py")):
        yield str(path.relative_to(REPO)), ast.parse(path.read_text(), str(path))


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _targets(node: ast.AST) -> Iterator[ast.AST]:
    if isinstance(node, (ast.Tuple, ast.List)):
        for element in node.elts:
            yield from _targets(element)
    elif isinstance(node, ast.Starred):
        yield from _targets(node.value)
    else:
        yield node


def _own_names(cls: ast.ClassDef) -> Set[str]:
    """What ``cls`` itself defines: its class body's assignments (with a value), methods and nested
    classes, and the attributes its methods assign on ``self``. A bare annotation declares, and
    does not define."""
    names: Set[str] = set()
    for statement in cls.body:
        if isinstance(statement, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(statement.name)
        elif isinstance(statement, ast.Assign):
            names.update(t.id for target in statement.targets for t in _targets(target) if isinstance(t, ast.Name))
        elif isinstance(statement, ast.AnnAssign) and statement.value is not None:
            if isinstance(statement.target, ast.Name):
                names.add(statement.target.id)
    for node in ast.walk(cls):
        if isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                for t in _targets(target):
                    if (isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self"
                            and isinstance(t.ctx, ast.Store)):
                        names.add(t.attr)
    return names


def _classes(tree: ast.Module) -> Dict[str, ast.ClassDef]:
    return {node.name: node for node in tree.body if isinstance(node, ast.ClassDef)}


def _defined(name: str, classes: Dict[str, ast.ClassDef]) -> Set[str]:
    """The names class ``name`` and its bases of the same module define."""
    cls = classes[name]
    names = _own_names(cls)
    for base in cls.bases:
        if isinstance(base, ast.Name) and base.id in classes and base.id != name:
            names |= _defined(base.id, classes)
    return names


def _private_reads(path: str, tree: ast.Module) -> List[str]:
    classes = _classes(tree)
    inside: Dict[int, str] = {id(n): name for name, cls in classes.items() for n in ast.walk(cls)}
    found = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Attribute) and _private(node.attr)):
            continue
        owner = inside.get(id(node))
        value = node.value
        if isinstance(value, ast.Name) and value.id in ("self", "cls") and owner is not None:
            if node.attr not in _defined(owner, classes):
                found.append(f"{path}:{node.lineno}: {value.id}.{node.attr} (not defined by {owner})")
        elif isinstance(value, ast.Name) and value.id in classes:
            if node.attr not in _defined(value.id, classes):
                found.append(f"{path}:{node.lineno}: {value.id}.{node.attr} (not defined by {value.id})")
        else:
            found.append(f"{path}:{node.lineno}: {ast.unparse(node)} (a private attribute of another object)")
    return sorted(found, key=lambda line: int(line.split(":")[1]))


def test_compat_reads_no_private_attribute_it_does_not_define():
    offenders = [line for path, tree in _compat_files() for line in _private_reads(path, tree)]
    assert not offenders, ("unified/compat/ reads private attributes it does not define (use the host's public "
                           "names, declared by SurfaceHost, or the composed parts handed to it):\n"
                           + "\n".join(offenders))


def _protocol_names() -> Set[str]:
    path, name = HOST_PROTOCOL
    file = REPO / path
    assert file.exists(), f"{path}: the protocol {name} declaring what unified/compat/ reads of the Accelerator"
    tree = ast.parse(file.read_text(), str(file))
    protocol = _classes(tree).get(name)
    assert protocol is not None, f"{path}: no class {name}"
    names = set()
    for statement in protocol.body:
        if isinstance(statement, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names.add(statement.name)
        elif isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name):
            names.add(statement.target.id)
    return names


def test_what_compat_reads_of_the_accelerator_is_declared_by_the_host_protocol():
    declared = _protocol_names()
    offenders = []
    for path, tree in _compat_files():
        classes = _classes(tree)
        for name, cls in classes.items():
            own = _defined(name, classes)
            holder = VIEWS.get((path, name))
            for node in ast.walk(cls):
                if not isinstance(node, ast.Attribute) or _private(node.attr) or node.attr.startswith("__"):
                    continue
                value = node.value
                on_self = (path, name) in MIXINS and isinstance(value, ast.Name) and value.id == "self"
                on_held = (holder is not None and isinstance(value, ast.Attribute) and value.attr == holder
                           and isinstance(value.value, ast.Name) and value.value.id == "self")
                if on_self and node.attr not in own and node.attr not in declared:
                    offenders.append(f"{path}:{node.lineno}: self.{node.attr} (neither {name}'s nor declared by "
                                     f"{HOST_PROTOCOL[1]})")
                elif on_held and node.attr not in declared:
                    offenders.append(f"{path}:{node.lineno}: self.{holder}.{node.attr} (not declared by "
                                     f"{HOST_PROTOCOL[1]})")
    offenders.sort(key=lambda line: (line.split(":")[0], int(line.split(":")[1])))
    assert not offenders, "unified/compat/ reads undeclared names of the Accelerator:\n" + "\n".join(offenders)


def test_the_accelerator_satisfies_the_host_protocol():
    from .memory_backend import MemoryGroup

    acc = MemoryGroup(1).accelerator(0)
    try:
        missing = sorted(name for name in _protocol_names() if not hasattr(acc, name))
    finally:
        acc.end_training()
    assert not missing, f"{HOST_PROTOCOL[1]} declares names the Accelerator lacks: {missing}"


def test_the_check_finds_a_private_read_of_the_host():
    """The probe above can fail: an undefined ``self._x`` and a host's ``accelerator._x`` are named."""
    tree = ast.parse("class Mixin:\n    def f(self, accelerator):\n        self._mine = 1\n"
                     "        return self._mine, self._backend, accelerator._collectives\n")
    found = _private_reads("probe.py", tree)
    assert found == ["probe.py:4: self._backend (not defined by Mixin)",
                     "probe.py:4: accelerator._collectives (a private attribute of another object)"]


def test_prepared_objects_by_kind_and_forgotten():
    """`PreparedObjects`, which the Accelerator owns and the surface reads: by kind, by identity."""
    from unified.api.prepared import PreparedObjects

    untracked = []
    prepared = PreparedObjects(untrack=lambda: untracked.append(True))
    model, loader = object(), object()
    prepared.add("model", model)
    prepared.add_loader(loader)
    assert prepared.of("model") == [model] and prepared.of("dataloader") == [loader] and prepared.of("optimizer") == []
    assert prepared.kind_of(loader) == "dataloader" and model in prepared and object() not in prepared
    assert prepared.pairs() == [("model", model)]  # what a backend's guard_writes takes: no loaders
    prepared.forget()
    assert untracked == [True] and prepared.of("model") == [] and loader not in prepared
