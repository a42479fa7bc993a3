"""engine/launches.py on the CPU: launches go out at once, or wait in order inside deferring()
with keys that tell two steps' work apart; escape() sends what waited, in order, and the rest of
the step goes out at once. A fake CuPy module stands in for the two runtime calls."""

from __future__ import annotations

import sys
import types

import numpy as np
import pytest

from mtpserve.engine import launches


class FakeArray:
    """A device array as the keys see it: its pointer (``.data.ptr``)."""

    def __init__(self, ptr: int):
        self.data = types.SimpleNamespace(ptr=ptr)


@pytest.fixture
def device(monkeypatch):
    """What reached the "device", in order: kernel calls, copies, event records."""
    log = []
    stream = types.SimpleNamespace(ptr=7)
    runtime = types.SimpleNamespace(memcpyAsync=lambda *a: log.append(("copy", *a)),
                                    memcpy2DAsync=lambda *a: log.append(("copy2d", *a)))
    fake = types.SimpleNamespace(cuda=types.SimpleNamespace(runtime=runtime, get_current_stream=lambda: stream))
    monkeypatch.setitem(sys.modules, "cupy", fake)
    return log


def kernel_fn(log, name):
    return lambda grid, block, args: log.append((name, grid, block, args))


class Event:
    def __init__(self, log, name):
        self.log, self.name = log, name

    def record(self, stream=None):
        self.log.append(("event", self.name, stream.ptr))


def a_step(log, x: FakeArray, n: int, parts: dict | None = None):
    """A step's launches: a kernel on x, a copy, an event (what a staged upload does); ``parts``:
    the kernel and event objects to use (an engine's live as long as it does)."""
    parts = parts if parts is not None else {"k": kernel_fn(log, "k"), "sent": Event(log, "sent")}
    launches.kernel(parts["k"], (1,), (64,), (x, np.int64(n)))
    launches.copy(100, 200, 8 * n, 1)
    launches.record(parts["sent"])


def test_launches_go_out_at_once_outside_deferring(device):
    a_step(device, FakeArray(0xA0), 3)
    assert [e[0] for e in device] == ["k", "copy", "event"]
    assert device[1] == ("copy", 100, 200, 24, 1, 7)          # on the current stream


def test_deferred_launches_wait_and_go_out_in_order(device):
    with launches.deferring(FakeArray) as d:
        a_step(device, FakeArray(0xA0), 3)
        assert device == []                                   # nothing reached the device yet
    assert [c[0] for c in d.calls] == [launches.KERNEL, launches.COPY, launches.EVENT]
    launches.run_calls(d.calls)
    assert [e[0] for e in device] == ["k", "copy", "event"]
    assert device[0][3][1] == 3 and device[1][3] == 24


def test_the_signature_tells_steps_apart_by_every_pointer_and_scalar(device):
    parts = {"k": kernel_fn([], "k"), "sent": Event([], "sent")}

    def signature(ptr, n, parts=parts):
        with launches.deferring(FakeArray) as d:
            a_step([], FakeArray(ptr), n, parts)
        return d.signature()

    assert signature(0xA0, 3) == signature(0xA0, 3)           # the same work, other objects
    assert signature(0xA0, 3) != signature(0xB0, 3)           # another array
    assert signature(0xA0, 3) != signature(0xA0, 4)           # another scalar (and copy size)
    assert signature(0xA0, 3) != signature(0xA0, 3, {**parts, "sent": Event([], "sent")})   # another event
    with launches.deferring(FakeArray) as d:
        launches.kernel(kernel_fn([], "k"), (2,), (64,), (FakeArray(0xA0), np.int64(3)))
    assert d.keys[0] != signature(0xA0, 3)[0]                 # another grid


def test_escape_sends_what_waited_then_the_step_goes_out_at_once(device):
    with launches.deferring(FakeArray) as d:
        launches.kernel(kernel_fn(device, "first"), (1,), (1,), ())
        launches.escape()                                     # e.g. an eager forward
        assert [e[0] for e in device] == ["first"]
        launches.kernel(kernel_fn(device, "second"), (1,), (1,), ())
        assert [e[0] for e in device] == ["first", "second"]  # no longer deferred
    assert d.escaped and d.calls == []
    launches.escape()                                         # outside: a no-op
    assert [e[0] for e in device] == ["first", "second"]


def test_deferring_is_one_thread_s_and_does_not_nest(device):
    import threading
    with launches.deferring(FakeArray):
        other = threading.Thread(target=lambda: launches.kernel(kernel_fn(device, "other"), (1,), (1,), ()))
        other.start()
        other.join()
        assert [e[0] for e in device] == ["other"]            # another engine's thread launches at once
        with pytest.raises(AssertionError):
            with launches.deferring(FakeArray):
                pass
