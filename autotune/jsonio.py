"""Strict JSON files, read and written safely: shared by policies, profiles and models.

Files autotune exchanges (policies, profiles, cost models) may come from someone else,
so they are only ever JSON, never pickle. Reading is strict (no duplicate keys, no
NaN/Infinity, UTF-8 only) and every failure is one line naming the file; writing is
atomic (temporary file in the same directory, fsync, rename), so a reader sees the old
file or the new one, never half of one.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from types import MappingProxyType
from typing import Any, Mapping, NoReturn

from autotune.errors import AutotuneError

__all__ = ["read_json", "write_atomic", "dumps", "freeze", "thaw", "json_type"]


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
        raw = Path(path).read_bytes()
    except OSError as exc:
        raise error(f"{source}: cannot read {what}: {_os_reason(exc)}") from exc
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise error(
            f"{source}: not UTF-8 text (byte {exc.start}): is this a {what} JSON file?"
        ) from exc
    try:
        return json.loads(text, object_pairs_hook=_reject_duplicates, parse_constant=_reject_constant)
    except json.JSONDecodeError as exc:
        raise error(
            f"{source}: malformed JSON at line {exc.lineno}, column {exc.colno}: {exc.msg}"
        ) from exc
    except ValueError as exc:  # raised by the two hooks above
        raise error(f"{source}: {exc}") from exc


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
