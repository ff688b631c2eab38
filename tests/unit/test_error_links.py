"""Every error message `unified` raises ends with a link to its section of docs/troubleshooting.md.

The link is built by `unified.errors.see(anchor)`. These tests read the source (no import of
torch or JAX) and the troubleshooting page:

- every ``raise SomeError(...)`` in ``unified/`` and ``backends/`` passes a ``see(...)`` call in
  its message (or is one of the documented exceptions below);
- every anchor given to ``see("...")`` exists on the page, and every anchor on the page is used.
"""
from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import Dict, Iterator, List, Set, Tuple

import unified
from unified.errors import see

REPO = Path(__file__).resolve().parents[2]
PAGE = REPO / "docs" / "troubleshooting.md"
ROOTS = ("unified", "backends")
# The conformance suite (unified/testing) raises to the author of a backend or a test (its errors
# name docs/certify-a-backend.md) and injects faults into scenarios: not errors of a training run.
SUITE = "unified/testing/"

# Raises whose message needs no see(): BarrierTimeout appends its own link (errors.py);
# `timeout_error` (backends/common.py) and the JAX backend's `_timeout_error` return one, and
# `_invalid_structure` (unified/checkpoint/codec.py), `_not_safetensors`, `checksum_mismatch`,
# `size_mismatch`, `cannot_open` and `_ended` (unified/checkpoint/safetensors_format.py) and
# `_commit_error` (unified/checkpoint/failures.py) return CheckpointErrors that end with see(...);
# `_rows_error` (unified/training/metrics.py) returns a ValueError ending with
# see("gather-for-metrics-rows"); `changed` (backends/*/private.py) returns a BackendUnavailable
# ending with see("private-api-changed").
SELF_LINKED = {"changed", "BarrierTimeout", "_timeout_error", "timeout_error", "_invalid_structure", "_not_safetensors",
               "_commit_error", "_unsupported", "checksum_mismatch", "size_mismatch", "cannot_open", "_ended",
               "_rows_error"}
# Control flow, not a message for a user.
NOT_MESSAGES = {"StopIteration"}

# (file, a fragment of the raise statement's source) -> why it carries no link of its own.
UNLINKED: Dict[Tuple[str, str], str] = {
    ("unified/launcher/rendezvous.py", "BadRequest("):
        "the rendezvous's HTTP answer to a launcher, which raises it as RendezvousRefused + "
        "see('launch-rendezvous-refused')",
    ("unified/launcher/rendezvous.py", "an answer not signed"):
        "a client's retry, raised as RendezvousLost + see('launch-rendezvous-lost') once its patience is spent",
    ("unified/checkpoint/safetensors_read.py", "the destination of"):
        "a caller's wrong destination array; `_lay_out` turns it into a CheckpointError with a link",
    ("unified/runtime/watchdog.py", "no answer within"):
        "internal to the watchdog: its callers treat it as an unanswered channel",
    ("backends/jax/control.py", "_NoAnswer"):
        "internal: JaxBackend._answered turns it into a BarrierTimeout (self-linked)",
    ("unified/checkpoint/codec.py", "dict key"):
        "wrapped by CheckpointManager.snapshot as 'cannot save …: …' + see('cannot-save')",
    ("unified/checkpoint/codec.py", "a value of type"):
        "wrapped by CheckpointManager.snapshot as 'cannot save …: …' + see('cannot-save')",
    ("unified/checkpoint/codec.py", "would be saved under this one name"):
        "wrapped by CheckpointManager.snapshot as 'cannot save …: …' + see('cannot-save')",
    ("unified/checkpoint/codec.py", "levels deep (a container"):
        "wrapped by CheckpointManager.snapshot as 'cannot save …: …' + see('cannot-save')",
    ("unified/data/loaders.py", "the data loader's epoch has"):
        "check_state_dict error, wrapped by load_state as 'cannot resume …' + see('cannot-resume')",
    ("unified/data/samplers.py", "was not prepared from a batch sampler"):
        "check_state_dict error, wrapped by load_state as 'cannot resume …' + see('cannot-resume')",
    ("unified/data/samplers.py", "the batch sampler gives"):
        "check_state_dict error, wrapped by load_state as 'cannot resume …' + see('cannot-resume')",
    ("unified/data/layout.py", "cannot resume after {seen}"):
        "resume_position error, wrapped by load_state as 'cannot resume …' + see('cannot-resume')",
    ("backends/torch/core.py", "parameter group(s); this run's has"):
        "check_loadable error, wrapped by load_state as 'cannot resume …' + see('cannot-resume')",
    ("backends/torch/core.py", "parameter group {index} holds"):
        "check_loadable error, wrapped by load_state as 'cannot resume …' + see('cannot-resume')",
    ("backends/jax/core.py", "expected keys"):
        "load_state_into error, wrapped by load_state as 'cannot restore …' + see('cannot-restore')",
    ("backends/jax/tensors.py", "the checkpoint has {host.dtype}"):
        "load_state_into error, wrapped by load_state as 'cannot restore …' + see('cannot-restore')",
    ("unified/training/loop.py", "the checkpoint was saved with gradient_accumulation_steps"):
        "check_state_dict error, wrapped by load_state as 'cannot resume …' + see('cannot-resume')",
    ("unified/training/loop.py", "the checkpoint was saved inside an open gradient-accumulation window"):
        "check_state_dict error, wrapped by load_state as 'cannot resume …' + see('cannot-resume')",
    ("backends/torch/loop.py", "AttributeError(name)"):
        "__getattr__ of a wrapper: the attribute protocol (not set yet while unpickling)",
    ("unified/data/orders.py", "outside an epoch of"):
        "IndexError of ShuffledOrder.__getitem__: the sequence protocol, as for a list",
}

# Anchors on the page that no see(...) in the code uses, with the reason.
UNUSED_ANCHORS: Dict[str, str] = {
    "not-json-serializable": "raised by json.dumps inside gather_object, not by unified's code",
}


def _sources() -> Iterator[Tuple[str, str, ast.Module]]:
    for root in ROOTS:
        for path in sorted((REPO / root).rglob("*.py")):
            if path.relative_to(REPO).as_posix().startswith(SUITE):
                continue
            text = path.read_text()
            yield path.relative_to(REPO).as_posix(), text, ast.parse(text, filename=str(path))


def _name(func: ast.expr) -> str:
    if isinstance(func, ast.Name):
        return func.id
    if isinstance(func, ast.Attribute):
        return func.attr
    return ""


def _see_calls(node: ast.AST) -> List[ast.Call]:
    return [n for n in ast.walk(node) if isinstance(n, ast.Call) and _name(n.func) == "see"]


def _page_anchors() -> List[str]:
    return re.findall(r'<a id="([^"]+)"></a>', PAGE.read_text())


def _exempt(path: str, call: ast.Call, source: str) -> bool:
    name = _name(call.func)
    if name in SELF_LINKED or name in NOT_MESSAGES:
        return True
    if name == "NotImplementedError" and path == "unified/backend/capabilities.py" and not call.args:
        return True  # an abstract Backend method: tells backend authors to implement it
    segment = ast.get_source_segment(source, call) or ""
    return any(p == path and fragment in segment for p, fragment in UNLINKED)


def test_every_raised_message_links_to_troubleshooting():
    offenders = []
    for path, source, tree in _sources():
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call)):
                continue  # bare `raise`, `raise err`, `raise SomeError`
            call = node.exc
            arguments = [*call.args, *(k.value for k in call.keywords)]
            if any(_see_calls(a) for a in arguments) or _exempt(path, call, source):
                continue
            offenders.append(f"{path}:{node.lineno}: raise {_name(call.func)}(...) without see(...)")
    assert not offenders, "append + see(\"<anchor>\") to these messages:\n" + "\n".join(offenders)


def test_unlinked_allowlist_is_current():
    """Each UNLINKED entry still matches a raise (remove entries for code that is gone)."""
    found: Set[Tuple[str, str]] = set()
    for path, source, tree in _sources():
        for node in ast.walk(tree):
            if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call):
                segment = ast.get_source_segment(source, node.exc) or ""
                found.update(key for key in UNLINKED if key[0] == path and key[1] in segment)
    assert set(UNLINKED) == found, f"stale UNLINKED entries: {sorted(set(UNLINKED) - found)}"


def test_see_anchors_exist_and_every_section_is_used():
    page = _page_anchors()
    duplicates = sorted({a for a in page if page.count(a) > 1})
    assert not duplicates, f"anchors defined twice in {PAGE.name}: {duplicates}"
    used: Dict[str, List[str]] = {}
    problems = []
    for path, source, tree in _sources():
        for call in _see_calls(tree):
            where = f"{path}:{call.lineno}"
            if len(call.args) == 1 and isinstance(call.args[0], ast.Constant) and isinstance(call.args[0].value, str):
                used.setdefault(call.args[0].value, []).append(where)
            elif path != "unified/errors.py":
                problems.append(f"{where}: see() needs one string literal (so that it can be checked)")
        # links written out by hand ("See docs/troubleshooting.md#...") must exist too
        for match in re.finditer(r"troubleshooting\.md#([A-Za-z0-9_-]+)", source):
            line = source.count("\n", 0, match.start()) + 1
            used.setdefault(match.group(1), []).append(f"{path}:{line}")
    for anchor, places in sorted(used.items()):
        if anchor not in page:
            problems.append(f"{', '.join(places)}: no <a id=\"{anchor}\"></a> in docs/troubleshooting.md")
    for anchor in page:
        if anchor not in used and anchor not in UNUSED_ANCHORS:
            problems.append(f"docs/troubleshooting.md#{anchor}: no see({anchor!r}) in the code")
    for anchor in UNUSED_ANCHORS:
        if anchor not in page or anchor in used:
            problems.append(f"UNUSED_ANCHORS[{anchor!r}] is stale")
    assert not problems, "\n".join(problems)


def test_see_and_barrier_timeout_message():
    assert see("barrier-timeout") == " See docs/troubleshooting.md#barrier-timeout"
    message = str(unified.BarrierTimeout("wait_for_everyone #1", 5, [1]))
    assert message.endswith("See docs/troubleshooting.md#barrier-timeout"), message
    assert "process 1 did not arrive" in message
    detailed = str(unified.BarrierTimeout("gather #2", 5, None, detail="jax coordination service: x"))
    assert detailed.endswith("(jax coordination service: x). See docs/troubleshooting.md#barrier-timeout")


def test_see_ends_the_sentence_before_the_link():
    """No message reads "... directory See docs/...": appending see() ends the last sentence."""
    link = " See docs/troubleshooting.md#save-failed"
    assert "the directory is missing" + see("save-failed") == "the directory is missing." + link
    for ended in ("Saved.", "Which one?", "Stop!"):
        assert ended + see("save-failed") == ended + link
    assert "trailing space  " + see("save-failed") == "trailing space." + link
    reason = OSError(28, "No space left on device")
    assert f"process 1: {reason}" + see("save-failed") == "process 1: [Errno 28] No space left on device." + link
    message = str(unified.CheckpointError("a (quoted) reason" + see("save-failed")))
    assert message == "a (quoted) reason." + link and type("x" + see("save-failed")) is str


def _literal_end(node: ast.expr):
    """The literal text that ends the expression ``node`` (None when it ends with a value)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr) and node.values and isinstance(node.values[-1], ast.Constant):
        return node.values[-1].value
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        return _literal_end(node.right)
    return None


def test_messages_end_their_last_sentence_before_the_link():
    """In the source too: the text written right before every ``... + see(...)`` ends with '.', '?'
    or '!' (a message that ends with a value, e.g. a quoted error, gets its full stop from see())."""
    offenders, checked = [], 0
    for path, _source, tree in _sources():
        for node in ast.walk(tree):
            if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add) and _see_calls(node.right) \
                    and isinstance(node.right, ast.Call):
                text = _literal_end(node.left)
                checked += text is not None
                if text is not None and not text.rstrip().endswith((".", "?", "!")):
                    offenders.append(f"{path}:{node.lineno}: ...{text[-50:]!r} + see(...)")
    assert checked > 50, checked  # the scan finds the messages
    assert not offenders, "end these sentences before the link:\n" + "\n".join(offenders)
