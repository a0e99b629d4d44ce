"""JSON read and written as Python's ``json`` would, in a fraction of the time.

Two hot paths use it: the env wire's frames (a remote step reads one frame and writes one on
each side: with the standard library about 4 µs of a server's 34 µs step in
``bench/remote_env.py``, with ``msgspec`` about 1 µs) and the generation servers' bodies (a
``/v1/completions`` request holds the whole prompt's ids: 245 µs to write 4,096 ids with
``json``, 19 µs here, on the trainer's process, for every turn of every episode). The two
libraries differ at the edges, so ``msgspec`` is used only where its result is the standard
library's:

* reading (:func:`loads`): what ``msgspec`` reads it reads as ``json`` does (integers of any
  size, the last of duplicate keys); what it refuses (the bare ``NaN``, a lone surrogate
  escape, ``1e400``, deep nesting, anything malformed) is read again by the strict standard
  decoder, which decides and names the fault as before. :func:`loads_lenient` reads what
  ``json.loads`` reads (the bare constants too), for replies of servers written in Python.
* writing (:func:`dumps`, :func:`dumps_bytes`): only a :func:`plain` value (dicts with str
  keys, lists, str, bool, None, ints, finite floats: nothing else) is written by ``msgspec``,
  which would write a NaN as ``null`` and an enum as its value. Its text is compact and keeps
  non-ASCII characters as they are (as OpenEnv's pydantic frames do). Any other value goes to
  the standard encoder, which refuses, escapes or converts it as it always did.

Without ``msgspec`` installed, every call takes the standard library's path.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

try:
    import msgspec
except ImportError:  # pragma: no cover - a dependency; the standard library serves without it
    msgspec = None  # type: ignore[assignment]

__all__ = ["dumps", "dumps_bytes", "loads", "loads_lenient", "plain"]

if msgspec is not None:
    _DECODE: Callable[[str | bytes], Any] | None = msgspec.json.Decoder().decode
    _ENCODE: Callable[[Any], bytes] | None = msgspec.json.Encoder().encode
    _REFUSED: tuple[type[Exception], ...] = (msgspec.MsgspecError, ValueError, RecursionError)
    _UNWRITTEN: tuple[type[Exception], ...] = (msgspec.MsgspecError, TypeError, ValueError)
else:  # pragma: no cover
    _DECODE = _ENCODE = None
    _REFUSED = _UNWRITTEN = ()


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


#: Parses JSON only: Python's ``json`` reads the bare constants ``NaN``, ``Infinity`` and
#: ``-Infinity`` by default, which no other JSON reader accepts.
_STRICT_JSON = json.JSONDecoder(parse_constant=_refuse_constant)


def loads(raw: str | bytes) -> Any:
    """``json.loads`` that refuses the bare ``NaN``, ``Infinity`` and ``-Infinity``.

    Raises:
        json.JSONDecodeError: ``raw`` is not JSON.
        UnicodeDecodeError: ``raw`` is bytes that are not UTF-8.
        ValueError: ``raw`` holds one of those constants (the message names it), or nests
            deeper than the parser can recurse (a first message of 200,000 ``[`` used to
            escape every handler as a ``RecursionError``).
    """
    if _DECODE is not None:
        try:
            return _DECODE(raw)
        except _REFUSED:  # the standard decoder decides, and names the fault
            pass
    try:
        return _STRICT_JSON.decode(raw.decode() if isinstance(raw, bytes) else raw)
    except RecursionError:
        raise ValueError(
            "nested deeper than the parser can follow (Python's recursion limit)"
        ) from None


def dumps(value: Any, fallback: Callable[[Any], str], *, checked: bool = False) -> str:
    """``value`` as JSON text: by ``msgspec`` when it is :func:`plain` (or the caller has
    ``checked`` that it is), else by ``fallback``, which raises what it raises (``ValueError``
    for a non-finite float where it refuses them, ``TypeError`` for a value JSON cannot hold).
    """
    if _ENCODE is not None and (checked or plain(value)):
        try:
            return _ENCODE(value).decode()
        except UnicodeEncodeError:  # a str holding a lone surrogate: the standard encoder
            pass  # escapes it
    return fallback(value)


def loads_lenient(raw: bytes) -> Any:
    """``json.loads(raw)``: the bare ``NaN``, ``Infinity`` and ``-Infinity`` read as floats,
    as ``aiohttp``'s ``response.json()`` reads them (a vLLM reply may hold them).

    Raises:
        json.JSONDecodeError: ``raw`` is not JSON.
        UnicodeDecodeError: ``raw`` is not text in a UTF encoding.
    """
    if _DECODE is not None:
        try:
            return _DECODE(raw)
        except _REFUSED:  # the standard decoder decides
            pass
    return json.loads(raw)


def dumps_bytes(value: dict[str, Any], *, ids: str | None = None) -> bytes:
    """``value`` as UTF-8 JSON: the value ``json.dumps(value).encode()`` writes, compact.

    ``ids`` names a field holding a list of token ids that is not walked: a walk would cost
    as much as the standard encoder. ``msgspec`` writes ints as ``json`` does and refuses
    what is not JSON (a NumPy integer, say), which then goes to the standard encoder; only
    a float id would be written otherwise (NaN as ``null``), which a server refuses either way.

    Raises:
        TypeError: a value JSON cannot hold (the standard encoder's refusal).
    """
    if _ENCODE is not None:
        rest = value if ids is None else {k: v for k, v in value.items() if k != ids}
        if plain(rest):
            try:
                return _ENCODE(value)
            except _UNWRITTEN:  # an id it cannot write, a lone surrogate: the standard encoder
                pass
    return _STANDARD_BYTES(value).encode()


#: The standard path of :func:`dumps_bytes`: compact; a non-finite float is written as the
#: bare ``NaN`` or ``Infinity``, as ``json.dumps`` writes it.
_STANDARD_BYTES = json.JSONEncoder(separators=(",", ":")).encode


def plain(value: Any) -> bool:
    """Whether ``value`` holds only JSON's own values, each of its exact type: dicts with str
    keys, lists and tuples, str, bool, None, ints and finite floats."""
    kind = type(value)
    if kind is str or kind is bool or kind is int or value is None:
        return True
    if kind is dict:
        for key, item in value.items():
            if type(key) is not str or not (type(item) is str or plain(item)):
                return False
        return True
    if kind is float:
        return value - value == 0.0  # False for NaN and the infinities
    if kind is list or kind is tuple:
        for item in value:  # noqa: SIM110 - a loop: all() over a generator costs twice this
            if not (type(item) is str or plain(item)):
                return False
        return True
    return False
