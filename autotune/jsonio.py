"""Strict JSON files, read and written safely: shared by policies, profiles and models.

Files autotune exchanges (policies, profiles, cost models) may come from someone else,
so they are only ever JSON, never pickle. Reading is strict (no duplicate keys, no
NaN/Infinity, UTF-8 only) and every failure is one line naming the file; writing is
atomic (temporary file in the same directory, fsync, rename), so a reader sees the old
file or the new one, never half of one.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from pathlib import Path
from types import MappingProxyType
from typing import Any, Mapping, NoReturn

from autotune.errors import AutotuneError

__all__ = ["read_json", "write_atomic", "check_writable", "dumps", "freeze", "thaw", "json_type"]

MAX_FILE_BYTES = 256 * 2**20
"""Largest file read_json accepts: far above any real profile, and it keeps `/dev/zero`
or a mistyped path to a disk image from eating the memory (or never finishing)."""

MAX_DEPTH = 100
"""Deepest nesting of arrays and objects accepted; autotune's files nest about 6 deep."""

_MAX_INT_DIGITS = 100  # an integer longer than this is no count, size or version


def dumps(data: Any, indent: int | None = 2) -> str:
    """Strict JSON text (NaN and Infinity are refused)."""
    return json.dumps(data, indent=indent, allow_nan=False)


def read_json(path: str | os.PathLike[str], error: type[AutotuneError], what: str) -> Any:
    """Parse the JSON file ``path``; failures raise ``error`` naming the path.

    Args:
        path: the file.
        error: the AutotuneError subclass to raise.
        what: what the file should be, for messages ("policy", "profile").
    """
    source = str(path)
    try:
        # Bounded read: a pipe or process substitution still works, an endless device
        # does not hang the reader.
        with open(path, "rb") as fh:
            raw = fh.read(MAX_FILE_BYTES + 1)
    except OSError as exc:
        raise error(f"{source}: cannot read {what}: {_os_reason(exc)}") from exc
    if len(raw) > MAX_FILE_BYTES:
        raise error(
            f"{source}: larger than {MAX_FILE_BYTES // 2**20} MiB: is this a {what} JSON file?"
        )
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise error(
            f"{source}: not UTF-8 text (byte {exc.start}): is this a {what} JSON file?"
        ) from exc
    try:
        data = json.loads(
            text,
            object_pairs_hook=_reject_duplicates,
            parse_constant=_reject_constant,
            parse_float=_finite_float,
            parse_int=_bounded_int,
        )
    except json.JSONDecodeError as exc:
        raise error(
            f"{source}: malformed JSON at line {exc.lineno}, column {exc.colno}: {exc.msg}"
        ) from exc
    except ValueError as exc:  # raised by the hooks above
        raise error(f"{source}: {exc}") from exc
    except RecursionError as exc:  # the C parser recurses once per nesting level
        raise error(f"{source}: arrays or objects nested more than {MAX_DEPTH} deep") from exc
    if _depth(data) > MAX_DEPTH:
        # Caught here rather than as a RecursionError later, in whatever walks the data.
        raise error(f"{source}: arrays or objects nested more than {MAX_DEPTH} deep")
    return data


def check_writable(path: str | os.PathLike[str], error: type[AutotuneError], what: str) -> None:
    """Fail before any work if ``path`` cannot be written, naming the path and why.

    Creates and removes a temporary file beside ``path``: the only test that also
    catches read-only file systems and permissions (which root may bypass, or not).
    """
    target = Path(path)
    directory = target.parent
    if target.is_dir():
        raise error(f"{target}: cannot write {what}: is a directory")
    if not directory.exists():
        raise error(f"{target}: cannot write {what}: directory {directory} does not exist")
    if not directory.is_dir():
        raise error(f"{target}: cannot write {what}: {directory} is not a directory")
    try:
        with tempfile.TemporaryFile(prefix=f".{target.name}.", dir=directory):
            pass
    except OSError as exc:
        raise error(f"{target}: cannot write {what}: {_os_reason(exc)}") from exc


def write_atomic(path: str | os.PathLike[str], text: str, error: type[AutotuneError], what: str) -> None:
    """Write ``text`` to ``path`` atomically; failures raise ``error`` naming the path.

    A failure (or Ctrl-C) leaves the old file untouched and no temporary file behind.
    """
    target = Path(path)
    directory = target.parent
    try:
        fd, tmp_name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=directory)
    except OSError as exc:
        raise error(f"{target}: cannot write {what}: {_os_reason(exc)}") from exc
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            if hasattr(os, "fchmod"):
                # mkstemp creates 0600; keep the mode of the file we replace, or make a
                # new one readable like any other file.
                mode = target.stat().st_mode & 0o777 if target.exists() else 0o644
                os.fchmod(fh.fileno(), mode)
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp_name, target)
    except BaseException as exc:
        try:
            os.unlink(tmp_name)
        except FileNotFoundError:
            pass
        if isinstance(exc, OSError):
            raise error(f"{target}: cannot write {what}: {_os_reason(exc)}") from exc
        raise
    _fsync_directory(directory)


def freeze(value: Any) -> Any:
    """A deep read-only copy of parsed JSON: objects become mappingproxies, arrays tuples."""
    if isinstance(value, Mapping):
        return MappingProxyType({k: freeze(v) for k, v in value.items()})
    if isinstance(value, (list, tuple)):
        return tuple(freeze(v) for v in value)
    return value


def thaw(value: Any) -> Any:
    """Plain dicts and lists again, for JSON and for callers that want to edit."""
    if isinstance(value, Mapping):
        return {k: thaw(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [thaw(v) for v in value]
    return value


def json_type(value: Any) -> str:
    """The JSON name of a value's type, for messages about parsed files."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, (list, tuple)):
        return "an array"
    if isinstance(value, Mapping):
        return "an object"
    return type(value).__name__


def _reject_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    # json keeps the last of duplicate keys silently; in these files a repeated key is
    # almost always an editing mistake, so refuse it.
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"duplicate key {key!r} in a JSON object")
        out[key] = value
    return out


def _reject_constant(name: str) -> NoReturn:
    raise ValueError(f"{name} is not valid JSON; numbers must be finite")


def _finite_float(text: str) -> float:
    # json turns 1e999 into inf without calling parse_constant; refuse it the same way
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"number {text[:30]} is out of range; numbers must be finite")
    return value


def _bounded_int(text: str) -> int:
    if len(text.lstrip("-")) > _MAX_INT_DIGITS:
        raise ValueError(f"an integer of {len(text)} digits is out of range")
    return int(text)


def _depth(value: Any) -> int:
    """Nesting depth of parsed JSON, without recursion."""
    deepest = 0
    stack = [(value, 1)]
    while stack:
        item, level = stack.pop()
        if isinstance(item, dict):
            children: Any = item.values()
        elif isinstance(item, list):
            children = item
        else:
            continue
        deepest = max(deepest, level)
        if deepest > MAX_DEPTH:
            return deepest
        stack.extend((child, level + 1) for child in children)
    return deepest


def _os_reason(exc: OSError) -> str:
    return exc.strerror or str(exc)


def _fsync_directory(directory: Path) -> None:
    """Make the rename durable. Best effort: some file systems refuse to fsync a
    directory, and the file is complete and atomic without it."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
