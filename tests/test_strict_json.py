"""The strict JSON parse refuses what the worker's json.rs refuses, and stays fast on big bodies."""

from __future__ import annotations

import base64
import json
import random
import time
import tracemalloc
from collections.abc import Callable
from functools import partial

import numpy as np
import pytest

from runtime import strict_json
from runtime.errors import BodyError
from runtime.strict_json import MAX_OPEN_CONTAINERS, parse_body

NOT_VALID = "request body is not valid JSON: "


def nested(depth: int) -> bytes:
    """`{"a": [[…]]}` whose innermost array sits at worker depth `depth` (the object is 0)."""
    return b'{"a": ' + b"[" * depth + b"1" + b"]" * depth + b"}"


def refusal(body: bytes) -> str:
    with pytest.raises(BodyError) as caught:
        parse_body(body)
    assert caught.value.status == 400
    return str(caught.value)


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        (b'{"a": NaN}', "NaN"),
        (b'{"a": Infinity}', "Infinity"),
        (b'{"a": -Infinity}', "-Infinity"),
        (b'{"a": 1e400}', "number out of range"),
        (b'{"a": -1e400}', "number out of range"),
        (b'{"a": 1' + b"0" * 400 + b"}", "number out of range"),
        (b'{"a": -1' + b"0" * 5000 + b"}", "number out of range"),
        (b'{"a": "\\ud800x"}', "lone surrogate"),
        (b'{"a": "\\udc00"}', "lone surrogate"),
        (b'{"a": ["ok", "\\uDBFF"]}', "lone surrogate"),
        (b'{"\\ud800": 1}', "lone surrogate"),
        (b'{"\\ud800": 1, "\\ud800": 2}', "lone surrogate"),
        (b'{"a": "\\ud800\\u0041"}', "lone surrogate"),
        (b'{"a": 1, "b": 2, "a": 3}', 'duplicate key "a"'),
        (b'{"q": {"w": {"e": {"r": {"t": 1, "t": 2}}}}}', 'duplicate key "t"'),
        (b'{"a": [{"x": 1}, {"y": 1, "y": 1}]}', 'duplicate key "y"'),
        (nested(MAX_OPEN_CONTAINERS), "recursion limit exceeded"),
        (b"[" * 100_000, "recursion limit exceeded"),
        (b'{"a": [1,]}', ""),
        (b'{"a": 1,}', ""),
        (b"{} x", "Extra data"),
        (b"{}{}", "Extra data"),
        (b"\xef\xbb\xbf{}", "byte-order mark"),
        (b'{"a": "\xff"}', "invalid UTF-8"),
        (b'{"a": "\xed\xa0\x80"}', "invalid UTF-8"),  # an encoded surrogate is not UTF-8
        (b"", ""),
        (b'{"a": "x\ny"}', ""),  # raw control character inside a string
        (b"{'a': 1}", ""),
    ],
)
def test_refuses_what_the_worker_refuses(body: bytes, reason: str) -> None:
    message = refusal(body)
    assert message.startswith(NOT_VALID)
    assert reason in message


@pytest.mark.parametrize("body", [b"[]", b"1", b'"x"', b"null", b"true", b" [ {} ] "])
def test_top_level_must_be_an_object(body: bytes) -> None:
    assert refusal(body) == "request body must be a JSON object"


def test_depth_126_is_the_deepest_accepted() -> None:
    assert MAX_OPEN_CONTAINERS == 127
    value = parse_body(nested(MAX_OPEN_CONTAINERS - 1))["a"]
    for _ in range(MAX_OPEN_CONTAINERS - 1):
        assert isinstance(value, list)
        value = value[0]
    assert value == 1
    # objects count as arrays do: 127 nested objects pass, 128 do not
    deepest = b'{"a":' * MAX_OPEN_CONTAINERS + b"1" + b"}" * MAX_OPEN_CONTAINERS
    assert parse_body(deepest)
    assert refusal(b'{"a":' + deepest + b"}").endswith("recursion limit exceeded")


def test_brackets_inside_strings_do_not_count() -> None:
    text = "[" * 500 + '\\"{' * 200
    assert parse_body(json.dumps({"a": text}).encode()) == {"a": text}
    # many sibling containers are not nesting
    assert len(parse_body(b'{"a": [' + b"[[]]," * 10_000 + b"[]]}")["a"]) == 10_001


def test_accepts_what_is_valid() -> None:
    body = (
        b'{"pair": "\\ud83d\\ude80", "lone_looking": "\\\\ud800",'
        b' "ints": [0, -0, 18446744073709551615, -9223372036854775808, 18446744073709551616],'
        b' "small": 1e-400, "max": 1.7976931348623157e308,'
        b' "nested": {"a": {"a": 1}}, "ws": [ 1 ,\t2\r\n] }'
    )
    value = parse_body(body)
    assert value["pair"] == "\U0001f680"
    assert value["lone_looking"] == "\\ud800"
    assert value["ints"][:4] == [0, 0, 2**64 - 1, -(2**63)]
    assert value["ints"][4] == float(2**64) and isinstance(value["ints"][4], float)
    assert value["small"] == 0.0
    assert value["max"] == 1.7976931348623157e308
    assert value["ws"] == [1, 2]


def test_key_order_is_preserved() -> None:
    keys = ["z", "a", "m", "b", "y"]
    body = "{" + ", ".join(f'"{key}": {{"{key}2": 1, "0": 2}}' for key in keys) + "}"
    value = parse_body(body.encode())
    assert list(value) == keys
    assert list(value["m"]) == ["m2", "0"]


def test_a_12_mib_body_parses_fast() -> None:
    image = "data:image/png;base64," + "A" * (12 * 1024 * 1024 - 200)
    question = {"type": "noul", "instructions": "x"}
    request = {"state": {"images": [image]}, "questions": {"q": question}}
    body = json.dumps(request).encode()
    assert len(body) <= 12 * 1024 * 1024
    # CPU seconds, not wall time: the suite runs in two processes on two cores
    started = time.process_time()
    assert parse_body(body)["state"]["images"][0] == image
    assert time.process_time() - started < 0.5


def test_pathological_bodies_are_refused_fast() -> None:
    started = time.process_time()
    refusal(b'{"a": "' + b'\\"' * 1_000_000)  # unterminated string full of escaped quotes
    refusal(b"[" * 1_000_000)
    assert time.process_time() - started < 1.0


MiB = 1024 * 1024
# 3 MiB bodies that are cheap to send and costly to parse (issue 14 sent 12 MiB of them; the
# costs scale linearly): long arrays of numbers and of empty strings
COSTLY = {
    "ints": b'{"x":[' + b"1," * (3 * MiB // 2) + b"1]}",
    "empty strings": b'{"x":[' + b'"",' * (MiB) + b'""]}',
    "floats": b'{"x":[' + b"1.5," * (3 * MiB // 4) + b"1.5]}",
}


def peak_bytes(parse: Callable[[bytes], object], body: bytes) -> int:
    tracemalloc.start()
    try:
        parse(body)
    except (BodyError, ValueError):
        pass
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    return peak


def cpu_seconds(parse: Callable[[bytes], object], body: bytes) -> float:
    started = time.process_time()
    parse(body)
    return time.process_time() - started


@pytest.mark.parametrize("kind", sorted(COSTLY))
def test_costly_bodies_cost_about_what_the_standard_parser_costs(kind: str) -> None:
    body = COSTLY[kind]
    assert peak_bytes(parse_body, body) <= peak_bytes(json.loads, body) + 4 * MiB
    standard = min(cpu_seconds(json.loads, body) for _ in range(2))
    strict = min(cpu_seconds(parse_body, body) for _ in range(2))
    assert strict <= 1.6 * standard + 0.05, (strict, standard)


def test_the_depth_scan_of_12_mib_of_brackets_stays_small() -> None:
    body = b"[" * (12 * MiB)
    # the decoded text and one chunk's arrays; a whole-body scan took ten times the body
    assert peak_bytes(parse_body, body) < 2 * len(body) + 4 * MiB
    assert refusal(body) == NOT_VALID + "recursion limit exceeded"


@pytest.mark.parametrize("chunk", [7, 64, 1000])
def test_the_chunked_depth_scan_carries_strings_and_escapes_across_chunks(chunk: int) -> None:
    filler = b'"[[\\\\\\"[[\\\\", ' * 40  # brackets and escaped quotes inside strings
    shallow = b'{"a": [' + filler + b"[" * 120 + b"1" + b"]" * 120 + b"]}"
    assert strict_json._scanned_depth(shallow, chunk=chunk) == 122
    assert len(parse_body(shallow)["a"]) == 41
    deep = b'{"a": [' + filler + b"[" * 126 + b"1" + b"]" * 126 + b"]}"
    assert strict_json._scanned_depth(deep, chunk=chunk) > MAX_OPEN_CONTAINERS
    assert refusal(deep) == NOT_VALID + "recursion limit exceeded"


def whole_chunk_depth(body: bytes, chunk: int) -> int:
    """The depth scan with every chunk scanned whole (`_scan_chunk`), as before the sparse one."""
    state = (0, 0, False, 0)
    for start in range(0, len(body), chunk):
        codes = np.frombuffer(body[start : start + chunk], np.uint8)
        state = strict_json._scan_chunk(codes, state)
    return state[1]


@pytest.mark.parametrize("chunk", [5, 16, 64, 256 * 1024])
def test_the_depth_scan_skipping_plain_chunks_gives_the_full_scans_depth(chunk: int) -> None:
    """Chunks without brackets, quotes or backslashes (an image's base64) pass the scan's state
    on unread: the same depth as scanning every chunk, with strings, escaped quotes and
    backslash runs across chunk boundaries, and long runs of plain bytes."""
    rng = random.Random(chunk)
    pieces = [b"[", b"]", b"{", b"}", b'"', b"\\", b'\\"', b"\\\\", b"a", b"x" * 40, b" "]
    weights = [6, 5, 6, 5, 8, 2, 2, 1, 10, 3, 4]
    for _ in range(300):
        body = b"".join(rng.choices(pieces, weights, k=rng.randrange(1, 120)))
        if rng.random() < 0.5:  # a long plain run, as a data URL's base64
            at = rng.randrange(len(body) + 1)
            body = body[:at] + b"A" * rng.randrange(1, 5 * chunk) + body[at:]
        assert strict_json._scanned_depth(body, chunk=chunk) == whole_chunk_depth(body, chunk), body


def test_a_large_image_costs_the_depth_scan_little() -> None:
    """A 3 MB image in a request with 255 options (more brackets than the depth limit, so the
    scan runs): its base64 chunks hold no bracket or quote and are skipped whole."""
    image = base64.b64encode(bytes(range(256)) * (3 * MiB // 256)).decode()
    options = [{"key": f"k{i}", "text": f"option {i}"} for i in range(255)]
    body = json.dumps(
        {"state": {"images": [f"data:image/png;base64,{image}"]}, "questions": {"q": options}}
    ).encode()
    assert strict_json._max_open_containers(body) == 4 == whole_chunk_depth(body, 256 * 1024)
    scan_whole = partial(whole_chunk_depth, chunk=strict_json.SCAN_CHUNK)
    whole = min(cpu_seconds(scan_whole, body) for _ in range(2))
    sparse = min(cpu_seconds(strict_json._max_open_containers, body) for _ in range(2))
    assert sparse < whole / 3, (sparse, whole)


def outcome(body: bytes, parse: Callable[[bytes], dict] = parse_body) -> tuple[str, str]:
    try:
        return "parsed", repr(parse(body))
    except BodyError as error:
        return "refused", str(error)


def random_body(rng: random.Random) -> bytes:
    """A request-shaped body whose data URL's base64 run holds digits, exponents, brackets,
    escapes or quotes at times, its other parts deep, wide or holding big numbers and
    surrogate escapes at times; now and then ";base64," outside any string."""
    run = "".join(rng.choices("AQe0123456789+/E", k=rng.randrange(0, 60)))
    if rng.random() < 0.3:
        at = rng.randrange(len(run) + 1)
        run = run[:at] + rng.choice(["\\ud800", "\\", "[[", "{", '\\"', "1e400"]) + run[at:]
    values = ["1", "-2.5", "18446744073709551616", "1e400", "1E+400", '"\\udc00"', '"x"', "[]"]
    items = ", ".join(rng.choice(values) for _ in range(rng.randrange(0, 6)))
    wide = ", ".join(["{}"] * rng.choice([0, 130]))
    deep = rng.choice([0, 60, 130])
    questions = "[" * deep + f"[{items}]" + (", " + wide if wide else "") + "]" * deep
    image = f'"data:image/png;base64,{run}"'
    if rng.random() < 0.2:  # ";base64," outside a string: invalid at that ";"
        image = f"1;base64,{run}" + "[" * rng.choice([0, 130])
    if rng.random() < 0.1:
        image = f'"a;base64,{run}", "b;base64,{run}"'
    return f'{{"state": {{"images": [{image}]}}, "questions": {questions}}}'.encode()


def test_passing_over_the_base64_run_keeps_every_outcome() -> None:
    """`base64_run`: the depth, surrogate and number checks passing over the image's base64
    give every body the outcome (the parsed value, or the refusal's message) of checking the
    whole body."""
    rng = random.Random(7)
    bodies = [random_body(rng) for _ in range(1500)]
    assert any(strict_json.base64_run(body) for body in bodies)
    with_run = [outcome(body) for body in bodies]
    check_whole = partial(strict_json.parse_passing_over, run=None)
    whole = [outcome(body, check_whole) for body in bodies]
    kinds = {kind for kind, _ in whole}
    assert kinds == {"parsed", "refused"}
    messages = {message for kind, message in whole if kind == "refused"}
    assert NOT_VALID + "recursion limit exceeded" in messages
    assert NOT_VALID + "number out of range" in messages
    assert NOT_VALID + "lone surrogate in string" in messages
    for body, ours, theirs in zip(bodies, with_run, whole, strict=True):
        assert ours == theirs, body


def test_big_numbers_still_take_the_checked_path() -> None:
    assert parse_body(b'{"a": 18446744073709551615}')["a"] == 2**64 - 1
    assert parse_body(b'{"a": -9223372036854775808}')["a"] == -(2**63)
    assert isinstance(parse_body(b'{"a": -9223372036854775809}')["a"], float)
    assert isinstance(parse_body(b'{"a": 18446744073709551616}')["a"], float)
    assert refusal(b'{"a": 1E+400}') == NOT_VALID + "number out of range"
    assert parse_body(b'{"a": 123456789012345678, "b": 1e99}') == {
        "a": 123456789012345678,
        "b": 1e99,
    }


@pytest.mark.parametrize(
    "body",
    [
        b'{"a": [1, -2, 3.5, 1e99, 18446744073709551615, -9223372036854775809], "b": {"c": 0}}',
        b'{"a": 1e400}',
        b'{"a": 1, "a": 2}',
    ],
)
def test_the_interleaved_parse_reads_what_the_plain_one_reads(body: bytes) -> None:
    try:
        expected: object = parse_body(body)
    except BodyError as error:
        expected = str(error)
    try:
        interleaved: object = parse_body(body, interleave=True)
    except BodyError as error:
        interleaved = str(error)
    assert interleaved == expected
    assert type(interleaved) is type(expected)
