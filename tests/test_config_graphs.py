"""The runtime configuration (one object from the environment and the command line) and the
shared static-buffer helper of the backends (runtime.backends.graphs) on the CPU."""

from __future__ import annotations

import argparse
import time

import pytest
import torch

from runtime import config as settings
from runtime.backends.graphs import GraphSlots, Slot, builds_of, like, signature
from runtime.config import RuntimeConfig


def test_defaults_then_environment_then_overrides():
    assert RuntimeConfig.from_env({}) == RuntimeConfig()
    env = {"OMNIJEV_PREFIX_CACHE": "0", "OMNIJEV_ORT_THREADS": "2", "OMNIJEV_BACKEND": "ort"}
    config = RuntimeConfig.from_env(env, backend="torch", device=None)
    assert (config.prefix_cache, config.ort_threads, config.backend) == (0, 2, "torch")
    assert config.device is None


def test_bad_settings_are_refused_with_the_limit():
    with pytest.raises(ValueError, match="OMNIJEV_PREFIX_CACHE must be an integer, got 'x'"):
        RuntimeConfig.from_env({"OMNIJEV_PREFIX_CACHE": "x"})
    with pytest.raises(ValueError, match="question_batch must be 1..16, got 17"):
        RuntimeConfig(question_batch=17)
    with pytest.raises(ValueError, match="ort_threads must be at least 0, got -1"):
        RuntimeConfig.from_env({"OMNIJEV_ORT_THREADS": "-1"})
    with pytest.raises(ValueError, match="OMNIJEV_MERGE must be on or off, got 'maybe'"):
        RuntimeConfig.from_env({"OMNIJEV_MERGE": "maybe"})


def test_merging_is_switched_by_on_or_off():
    assert RuntimeConfig().merge and RuntimeConfig.from_env({"OMNIJEV_MERGE": "ON"}).merge
    assert not RuntimeConfig.from_env({"OMNIJEV_MERGE": "0"}).merge
    parser = argparse.ArgumentParser()
    settings.add_arguments(parser)
    assert not RuntimeConfig.from_args(parser.parse_args(["--merge", "off"]), environ={}).merge
    with pytest.raises(SystemExit):
        parser.parse_args(["--merge", "sometimes"])


def test_command_line_options_cover_every_setting():
    parser = argparse.ArgumentParser()
    settings.add_arguments(parser)
    args = parser.parse_args(["--backend", "torch", "--question-batch", "4"])
    config = RuntimeConfig.from_args(args, environ={"OMNIJEV_ORT_THREADS": "3"})
    assert (config.backend, config.question_batch) == ("torch", 4)
    assert config.ort_threads == 3  # the environment where the command line is silent
    options = {a.dest for a in parser._actions}
    fields = set(RuntimeConfig.__dataclass_fields__)
    assert fields == options - {"help"}  # every setting an option, and no option more


def test_the_servers_settings_are_read_here():
    assert settings.allowed_hosts({}) is None
    hosts = settings.allowed_hosts({"OMNIJEV_ALLOWED_HOSTS": " A.example, b ,"})
    assert hosts == ("a.example", "b")
    assert settings.docs_enabled({}) and not settings.docs_enabled({"OMNIJEV_DOCS": "0"})


def test_every_backend_declares_what_the_executor_uses():
    """The executor's uses of a backend are on the protocol, and the portable engines declare
    the default capabilities: rectangle passes, not packed ones."""
    from runtime.backends import Backend, Capabilities
    from runtime.backends.base import Portable
    from runtime.backends.compiled import TorchBackend
    from runtime.backends.ort import OrtBackend
    from runtime.backends.trt import TensorRTBackend

    for kind in (OrtBackend, TensorRTBackend, TorchBackend):
        for name in ("run", "has_graph", "input_dtypes", "prepare", "settle", "stats"):
            assert callable(getattr(kind, name)), (kind, name)
    portable = Portable()
    assert portable.capabilities == Capabilities() and not portable.capabilities.packed
    assert "capabilities" in Backend.__annotations__


def doubling_slots(size: int) -> tuple[GraphSlots, list]:
    bound = []

    def bind(key, feeds, outputs):
        bound.append(key)
        return Slot(like(feeds), like(outputs))

    def launch(slot):
        torch.mul(slot.inputs["x"], 2, out=slot.outputs["y"])

    return GraphSlots(torch.device("cpu"), bind, launch, size=size, capture=True), bound


def test_slots_bind_once_per_signature_and_copy_in_and_out():
    slots, bound = doubling_slots(size=2)
    for step in range(3):
        for rows in (2, 3):
            x = torch.full((rows, 4), float(step))
            y = torch.empty_like(x)
            slots.run(signature("g", {"x": x}), {"x": x}, {"y": y})
            assert torch.equal(y, 2 * x)
    assert len(bound) == 2  # one slot per shape; the CPU never captures
    stats = slots.stats()
    assert stats.pop("build_seconds") > 0
    assert stats == {"slots": 2, "captured": 0, "replays": 0, "eager": 6, "builds": 2}
    x = torch.ones(5, 4)
    slots.run(signature("g", {"x": x}), {"x": x}, {"y": torch.empty_like(x)})
    assert len(slots.slots) == 2 and len(bound) == 3  # the least recently used went


def test_a_shape_is_counted_as_built_once_with_the_seconds_of_its_build():
    """On the CPU a slot is built by its binding and first launch: later runs of its shape add
    neither a build nor seconds; a new shape, or one evicted and seen again, is a build."""
    slots, bound = doubling_slots(size=1)
    slow_bind = slots.bind

    def bind(key, feeds, outputs):
        time.sleep(0.05)  # as a compilation would
        return slow_bind(key, feeds, outputs)

    slots.bind = bind
    small, large = torch.ones(2, 4), torch.ones(3, 4)

    def run(x):
        slots.run(signature("g", {"x": x}), {"x": x}, {"y": torch.empty_like(x)})

    run(small)
    assert slots.builds == 1 and 0.05 <= slots.build_seconds < 1
    built = slots.build_seconds
    run(small)
    assert (slots.builds, slots.build_seconds) == (1, built)
    run(large)  # evicts the small shape's slot (size 1)
    run(small)
    assert slots.builds == 3 and slots.build_seconds >= built + 0.1
    slots.install(("g", "made"), Slot({}, {}), seconds=1.5)  # a session built elsewhere
    assert slots.build_seconds >= built + 1.6 and slots.stats()["builds"] == 3
    unused = doubling_slots(size=1)[0]
    assert builds_of([slots, unused]) == {"builds": 3, "build_seconds": slots.build_seconds}
    assert len(bound) == 3


def test_dropped_graphs_leave_the_slots_and_their_buffers():
    slots, bound = doubling_slots(size=2)
    x = torch.ones(2, 4)
    key = signature("g", {"x": x})
    for _ in range(2):
        slots.run(key, {"x": x}, {"y": torch.empty_like(x)})
    slot = slots.get(key)
    slot.graph = object()  # as if captured (the CPU never captures)
    buffer = slot.inputs["x"]
    slots.drop_graphs()
    assert slot.graph is None and slot.launches == 0
    assert slots.get(key) is slot and slot.inputs["x"] is buffer and len(bound) == 1
    y = torch.empty_like(x)
    slots.run(key, {"x": x}, {"y": y})  # runs eagerly again, on the same slot
    assert torch.equal(y, 2 * x) and slot.launches == 1


def test_a_refused_launch_is_an_error():
    slots = GraphSlots(
        torch.device("cpu"),
        lambda key, feeds, outputs: Slot(like(feeds), like(outputs)),
        lambda slot: False,
        size=1,
        capture=False,
    )
    x = torch.ones(1)
    with pytest.raises(RuntimeError, match="g: enqueue failed"):
        slots.run(signature("g", {"x": x}), {"x": x}, {})
