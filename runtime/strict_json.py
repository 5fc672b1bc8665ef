"""Strict JSON parse of a request body into its top-level object (docs/contract.md §1.5).

Follows the native worker's `json::parse` (`S1@04d43d0 src/models/qwen3_5/native/src/json.rs`):
Python's `json` accepts NaN/Infinity, duplicate keys, lone surrogate escapes and out-of-range
numbers, and recurses without a limit of its own, so each of those is refused here explicitly.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable

import numpy as np

from runtime.errors import BodyError

# json.rs refuses a container at depth >= 127, counting arrays and objects, with the body's own
# object at depth 0: at most 127 containers may be open at once.
MAX_OPEN_CONTAINERS = 127
# serde_json keeps integers in i64 ∪ u64 exact and reads larger ones as f64 (json.rs then refuses
# those beyond f64's range); a JSON integer has no leading zeros, so 20 characters bound that range.
I64_MIN = -(2**63)
U64_MAX = 2**64 - 1
MAX_EXACT_INT_CHARS = 20  # len("-9223372036854775808") == len(str(U64_MAX)) == 20
BOM = b"\xef\xbb\xbf"

NOT_VALID = "request body is not valid JSON: "
NOT_OBJECT = "request body must be a JSON object"

# The depth scan walks the body in steps of this many bytes, so that its arrays stay a few MiB
# whatever the body's size (a whole-body pass peaked at +706 MiB on 12 MiB of `"",`).
SCAN_CHUNK = 256 * 1024
QUOTE, BACKSLASH = ord('"'), ord("\\")
_STEP = np.zeros(256, np.int32)  # +1 for an opening bracket, -1 for a closing one
_STEP[list(b"[{")], _STEP[list(b"]}")] = 1, -1
# the bytes the depth scan reads: a chunk without any (an image's base64 inside its data URL)
# passes the scan's state on as it is, found by C's byte search alone; the numpy scan of such
# chunks took 198 ms for a 3 MB image with 255 options on the 2-core CI machine (the bench's
# 39 KB image hid it)
_SCANNED = (b'"', b"\\", b"[", b"]", b"{", b"}")
# Only an integer of 19 or more digits can leave i64 ∪ u64, and only a number with such a digit
# run or a 3-digit exponent can overflow a float; bodies without either skip the Python number
# hooks, so json.loads reads their numbers in C (the hooks cost 3-4x on number-heavy bodies).
# The search runs on the body mapped to digits "0", exponents "e", signs "+" and spaces.
_NUMBER_SHAPE = bytes(
    ord("0")
    if chr(b).isdigit() and b < 128
    else ord("e")
    if b in b"eE"
    else ord("+")
    if b in b"+-"
    else ord(" ")
    for b in range(256)
)
_BIG_NUMBERS = (b"0" * 19, b"e000", b"e+000")
# Only a `\uD800`-`\uDFFF` escape can leave a surrogate in a decoded string (strict UTF-8 refuses
# encoded ones), so bodies without one skip the surrogate walk.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
# The image's base64 is most of a body and holds none of what the checks look for: where its
# run (after ";base64," to the next quote) holds no backslash, the surrogate and number checks
# pass over it, and so does the depth scan where the run is inside a string. A 4 MB body spent
# 4.6 ms on the number check and 1.8 on the surrogate search, each over the whole base64.
BASE64_RUN = b";base64,"
_SURROGATE = re.compile(r"[\ud800-\udfff]")


class _Refusal(ValueError):
    """A strict-parse refusal raised from inside `json.loads`' hooks."""


def parse_body(body: bytes, *, interleave: bool = False) -> dict:
    """The request body's top-level object, or a `BodyError` with the worker's 400 message.

    `interleave`: read every number through a Python hook even where C would do, so that a long
    parse in a thread lets the others run (json.loads holds the GIL while it stays in C; the
    hooks cost ~1.5x on number-heavy bodies but hand the GIL over every few milliseconds).
    """
    return parse_passing_over(body, base64_run(body), interleave=interleave)


def parse_passing_over(
    body: bytes, run: tuple[int, int] | None, *, interleave: bool = False
) -> dict:
    """`parse_body` with the depth, surrogate and number checks passing over body[run[0]:run[1]]
    (`base64_run`); None: checking the whole body."""
    text = _decode(body)
    if _max_open_containers(body, run) > MAX_OPEN_CONTAINERS:
        raise BodyError(NOT_VALID + "recursion limit exceeded")
    check_surrogates = _surrogate_escapes(body, run)
    numbers = {"parse_float": _parse_float, "parse_int": _parse_int}
    try:
        value = json.loads(
            text,
            object_pairs_hook=_object_hook(check_surrogates),
            parse_constant=_parse_constant,
            **(numbers if interleave or _big_numbers_outside(body, run) else {}),
        )
        if check_surrogates:
            _check_strings(value)
    except (_Refusal, json.JSONDecodeError) as error:
        raise BodyError(NOT_VALID + str(error)) from None
    except RecursionError:  # the depth scan should make this unreachable
        raise BodyError(NOT_VALID + "recursion limit exceeded") from None
    if not isinstance(value, dict):
        raise BodyError(NOT_OBJECT)
    return value


def _decode(body: bytes) -> str:
    if body.startswith(BOM):
        raise BodyError(NOT_VALID + "a byte-order mark is not allowed")
    try:
        return body.decode("utf-8")
    except UnicodeDecodeError as error:
        raise BodyError(NOT_VALID + f"invalid UTF-8 at byte {error.start}") from None


def base64_run(body: bytes) -> tuple[int, int] | None:
    """[start, end) of the body's first base64 run: after ";base64," up to the next quote,
    where it holds no backslash; else None. Inside a string (a valid body's data URL) it holds
    no number, escape or bracket that counts; outside one, the ";" before it is where
    `json.loads` stops, having read nothing after it."""
    at = body.find(BASE64_RUN)
    if at < 0:
        return None
    start = at + len(BASE64_RUN)
    end = body.find(b'"', start)
    if end < 0 or body.find(b"\\", start, end) >= 0:
        return None
    return start, end


def _surrogate_escapes(body: bytes, run: tuple[int, int] | None) -> bool:
    """Whether the body may hold a surrogate escape, the base64 run passed over."""
    if run is None:
        return _SURROGATE_ESCAPE.search(body) is not None
    before = _SURROGATE_ESCAPE.search(body, 0, run[0])
    return before is not None or _SURROGATE_ESCAPE.search(body, run[1]) is not None


def _big_numbers_outside(body: bytes, run: tuple[int, int] | None) -> bool:
    """`_may_hold_big_numbers` of the body, the base64 run passed over (no digit run or exponent
    crosses its ends: "," before it, a quote after)."""
    if run is None:
        return _may_hold_big_numbers(body)
    return _may_hold_big_numbers(body[: run[0]]) or _may_hold_big_numbers(body[run[1] :])


def _max_open_containers(body: bytes, run: tuple[int, int] | None = None) -> int:
    """The most arrays and objects open at once, brackets inside strings ignored; the base64
    run (`base64_run`) passed over where it is inside a string."""
    opens = body.count(b"[") + body.count(b"{")
    if opens <= MAX_OPEN_CONTAINERS:
        return opens  # fast path: never deeper than the number of brackets, strings' included
    return _scanned_depth(body, run)


def _scanned_depth(body: bytes, run: tuple[int, int] | None = None, chunk: int = SCAN_CHUNK) -> int:
    """The most arrays and objects open at once, `chunk` bytes at a time, up to the first
    chunk that passes MAX_OPEN_CONTAINERS; from `run`'s end on where the scan is inside a
    string at its start (the run has no quote or backslash: it changes nothing)."""
    state = (0, 0, False, 0)  # (depth, deepest, inside a string, backslashes just before)
    if run is None:
        return _scan_range(body, 0, len(body), state, chunk)[1]
    state = _scan_range(body, 0, run[0], state, chunk)
    if state[1] > MAX_OPEN_CONTAINERS:
        return state[1]
    resume = run[1] if state[2] else run[0]
    return _scan_range(body, resume, len(body), state, chunk)[1]


def _scan_range(body: bytes, first: int, last: int, state: tuple, chunk: int) -> tuple:
    """The depth scan's state after body[first:last], from `state`, `chunk` bytes at a time."""
    for start in range(first, last, chunk):
        end = min(start + chunk, last)
        lo, hi = read_span(body, start, end)
        if lo > start:  # plain bytes before the first read one: they end any backslash run
            state = (*state[:3], 0)
        if lo == hi:
            continue
        state = _scan_chunk(np.frombuffer(body[lo:hi], np.uint8), state)
        if hi < end:
            state = (*state[:3], 0)
        if state[1] > MAX_OPEN_CONTAINERS:
            break  # deep enough to refuse; the rest need not be read
    return state


def read_span(body: bytes, start: int, end: int) -> tuple[int, int]:
    """[lo, hi) of body[start:end] from its first to its last bracket, quote or backslash
    (C's byte search); lo == hi where it has none. The bytes outside leave the depth, and
    whether a string is open, as they are."""
    firsts = [at for at in (body.find(byte, start, end) for byte in _SCANNED) if at >= 0]
    if not firsts:
        return end, end
    return min(firsts), max(body.rfind(byte, start, end) for byte in _SCANNED) + 1


def _may_hold_big_numbers(body: bytes) -> bool:
    shape = body.translate(_NUMBER_SHAPE)
    return any(pattern in shape for pattern in _BIG_NUMBERS)


def _scan_chunk(codes: np.ndarray, state: tuple) -> tuple:
    """One step of the depth scan: a quote after an even run of backslashes opens or closes a
    string (escapes are only valid inside strings, and an invalid body is refused anyway)."""
    depth, deepest, inside, carried = state
    backslash = codes == BACKSLASH
    quotes = codes == QUOTE
    run_to = np.zeros(codes.size, np.int64)
    if carried or backslash.any():  # else no quote can be escaped
        index = np.arange(codes.size)
        last_other = np.maximum.accumulate(np.where(backslash, -1, index))
        run_to = index - last_other + np.where(last_other < 0, carried, 0)  # run ending at i
        run_before = np.concatenate(([carried], run_to[:-1]))
        quotes &= run_before % 2 == 0
    in_string = (np.cumsum(quotes, dtype=np.int64) + inside) % 2 == 1
    steps = np.where(in_string, 0, _STEP[codes])
    levels = depth + np.cumsum(steps)
    return (
        int(levels[-1]),
        max(deepest, int(levels.max())),
        bool(in_string[-1]),
        int(run_to[-1]),
    )


def _object_hook(check_surrogates: bool) -> Callable[[list[tuple[str, object]]], dict]:
    def build(pairs: list[tuple[str, object]]) -> dict:
        if check_surrogates:
            # before the duplicate check, so no message ever carries a lone surrogate
            for key, _ in pairs:
                _check_string(key)
        obj = dict(pairs)
        if len(obj) != len(pairs):
            seen: set[str] = set()
            for key, _ in pairs:
                if key in seen:
                    raise _Refusal(f"duplicate key {json.dumps(key, ensure_ascii=False)}")
                seen.add(key)
        return obj

    return build


def _parse_float(text: str) -> float:
    value = float(text)
    if math.isinf(value):
        raise _Refusal("number out of range")
    return value


def _parse_int(text: str) -> int | float:
    if len(text) <= MAX_EXACT_INT_CHARS:
        value = int(text)
        if I64_MIN <= value <= U64_MAX:
            return value
    return _parse_float(text)  # float() has no digit limit, unlike int()


def _parse_constant(name: str) -> float:
    raise _Refusal(f"{name} is not allowed")


def _check_string(text: str) -> None:
    if _SURROGATE.search(text):
        raise _Refusal("lone surrogate in string")


def _check_strings(value: object) -> None:
    """Walks every key and string value; iterative, though depth is already bounded."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            _check_string(item)
        elif isinstance(item, dict):
            for key, child in item.items():
                _check_string(key)
                stack.append(child)
        elif isinstance(item, list):
            stack.extend(item)
