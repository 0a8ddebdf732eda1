"""The time split on a GPU's timeline, on a simulated device: a queue that runs what the host
launched in order, and events that complete when the queue reaches them."""

from __future__ import annotations

import random

import pytest

from phalanx import timeline
from phalanx.timeline import DeviceTimeline


class Device:
    """A GPU's queue against the host's clock (seconds): `launch` queues work and returns at
    once, `sync` waits for the queue."""

    def __init__(self) -> None:
        self.host = 0.0
        self.free = 0.0  # when the queue has run everything launched so far

    def work(self, host_s: float) -> None:
        self.host += host_s

    def launch(self, device_s: float, host_s: float = 0.0) -> None:
        self.free = max(self.free, self.host) + device_s
        self.host += host_s

    def sync(self) -> None:
        self.host = max(self.host, self.free)

    def event(self) -> Event:
        return Event(self)


class Event:
    def __init__(self, device: Device):
        self.device, self.at = device, None
        self.streams: list = []  # the stream of each record
        self.queries = 0

    def record(self, stream=None) -> None:
        assert self.at is None or self.device.host >= self.at, "recorded again while in flight"
        self.streams.append(stream)
        self.at = self.device.free = max(self.device.free, self.device.host)

    def query(self) -> bool:
        self.queries += 1
        return self.device.host >= self.at

    def synchronize(self) -> None:
        self.device.host = max(self.device.host, self.at)

    def elapsed_time(self, other: Event) -> float:
        # as torch's: both events must have completed
        assert self.device.host >= max(self.at, other.at), "read before it completed"
        return 1e3 * (other.at - self.at)


def _loop(device: Device, steps: int, data_s: float, kernels_s: float, hook_reads: bool):
    """The trainer's loop, timed by the host as it is (`live`) and on the device's timeline."""
    clocked = DeviceTimeline(device.event)
    live = [0.0] * 5
    for _ in range(steps):
        t0 = device.host
        device.work(data_s)
        t1 = device.host
        clocked.begin()
        device.launch(kernels_s, host_s=0.002)  # queuing the step's kernels takes 2 ms
        clocked.end()
        t2 = device.host
        if hook_reads:  # a hook reads the loss back: the host waits for the queue
            device.sync()
        live[0] += t1 - t0
        live[1] += t2 - t1
        live[4] += device.host - t2
    return clocked, live


def test_a_busy_gpu_is_charged_to_the_steps_not_to_the_hook_that_waits_for_it():
    device = Device()
    clocked, live = _loop(device, 100, data_s=0.001, kernels_s=0.100, hook_reads=True)
    assert live[4] > 10 * live[1]  # the host's clock: the hook "took" the GPU's time
    timeline.split(live, *clocked.take())
    assert live[1] == pytest.approx(100 * 0.100)  # the GPU's time in the steps
    assert live[4] + live[0] == pytest.approx(99 * 0.001)  # between steps: the fetches
    assert live[1] > 50 * live[4]


def test_a_gpu_that_waits_for_data_is_charged_to_the_data():
    device = Device()
    clocked, live = _loop(device, 100, data_s=0.050, kernels_s=0.010, hook_reads=False)
    in_steps, between = clocked.take()
    # a step's queue runs while the host queues it (2 ms) and after, 10 ms in all; the next
    # step's start waits for the host's 50 ms fetch
    assert in_steps == pytest.approx(100 * 0.010)
    assert between == pytest.approx(99 * 0.042)
    timeline.split(live, in_steps, between)
    assert live[0] == pytest.approx(between) and live[4] == 0.0


def test_events_are_read_behind_the_steps_and_reused():
    """Without a wait, completed steps are read every few steps, so the events in flight stay
    few and are made once."""
    device = Device()
    made = []

    def new_event() -> Event:
        made.append(Event(device))
        return made[-1]

    clocked = DeviceTimeline(new_event)
    for _ in range(1000):
        clocked.begin()
        device.launch(0.001, host_s=0.001)
        clocked.end()
    assert len(made) < 100
    in_steps, _ = clocked.take()
    assert in_steps == pytest.approx(1.0)


def test_the_split_keeps_communication_and_the_optimizer_within_the_steps():
    live = [
        1.0,
        0.5,
        0.2,
        0.3,
        3.0,
    ]  # host: data, forward_backward, communication, optimizer, hooks
    timeline.split(live, in_steps=4.0, between_steps=2.0)
    assert live == pytest.approx([0.5, 3.5, 0.2, 0.3, 1.5])
    live = [0.0, 0.1, 2.0, 2.0, 0.0]  # the host's waits inside the step exceed the GPU's time
    timeline.split(live, in_steps=1.0, between_steps=0.0)
    assert live == pytest.approx([0.0, 0.0, 0.5, 0.5, 0.0])


def test_a_step_costs_two_records_on_a_stream_looked_up_once_and_two_queries_a_fold():
    """The per-step cost on a GPU that keeps up with the host: the stream is looked up once
    between takes, not at every record, and one query of the newest event folds every step
    before it."""
    device = Device()
    made: list[Event] = []
    lookups = []

    def new_event() -> Event:
        made.append(Event(device))
        return made[-1]

    def current_stream() -> str:
        lookups.append(len(lookups))
        return f"stream {len(lookups)}"

    clocked = DeviceTimeline(new_event, current_stream)
    for _ in range(320):
        clocked.begin()
        device.launch(0.003, host_s=0.002)  # 2 ms to queue what runs 3 ms on the device
        clocked.end()
        device.work(0.002)  # the next batch: the device keeps up
    assert len(lookups) == 1
    assert {s for e in made for s in e.streams} == {"stream 1"}
    assert sum(len(e.streams) for e in made) == 640
    # the newest step is still running when the fold looks; the one before it is done
    assert sum(e.queries for e in made) == 2 * (320 // 32)
    in_steps, between = clocked.take()
    assert in_steps == pytest.approx(320 * 0.003)
    assert between == pytest.approx(319 * 0.001)
    clocked.begin()
    clocked.end()
    assert len(lookups) == 2 and made[-1].streams[-1] == "stream 2"  # looked up again after a take


def test_steps_still_in_flight_are_folded_once_they_complete():
    """A GPU behind the host: a fold reads the steps that have completed, oldest first, and
    leaves the rest for a later one."""
    device = Device()
    clocked = DeviceTimeline(device.event)
    for k in range(32):
        clocked.begin()
        device.launch(0.010, host_s=0.002)
        clocked.end()
        if k == 29:
            device.work(0.05)  # the host waits on something else: some steps complete meanwhile
    # the 32nd step's fold: the host is at 0.114 s, the device has run 11 of the 10 ms steps
    assert clocked.in_steps == pytest.approx(11 * 0.010)
    assert clocked.between_steps == pytest.approx(0.0)
    for _ in range(32):
        clocked.begin()
        device.launch(0.001, host_s=0.002)
        clocked.end()
    in_steps, between = clocked.take()
    assert in_steps == pytest.approx(32 * 0.010 + 32 * 0.001)
    assert between == pytest.approx(0.0)


@pytest.mark.parametrize("seed", range(20))
def test_the_folded_times_are_each_steps_own(seed):
    """Random host and device times, hooks that wait for the device now and then, takes at random:
    each take gives the sum of its steps' times on the device and of the gaps between them, as
    read from each step's own start and end."""
    rng = random.Random(seed)
    device = Device()
    clocked = DeviceTimeline(device.event)
    expected, got = [], []
    in_steps = between = 0.0
    last_end = None
    for _ in range(rng.randint(1, 300)):
        device.work(rng.uniform(0.0, 0.003))
        start = max(device.free, device.host)  # where the step's start event lands
        clocked.begin()
        device.launch(
            rng.choice([0.0005, 0.002, 0.01]) * rng.random(), host_s=rng.uniform(0, 0.002)
        )
        end = max(device.free, device.host)
        clocked.end()
        in_steps += end - start
        between += 0.0 if last_end is None else start - last_end
        last_end = end
        if rng.random() < 0.05:
            device.sync()
        if rng.random() < 0.02:
            got.append(clocked.take())
            expected.append((in_steps, between))
            in_steps = between = 0.0
            last_end = None
    got.append(clocked.take())
    expected.append((in_steps, between))
    flat = [seconds for pair in got for seconds in pair]
    assert flat == pytest.approx([seconds for pair in expected for seconds in pair], abs=1e-9)
