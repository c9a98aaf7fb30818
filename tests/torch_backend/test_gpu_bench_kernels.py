"""The GPU bench's kernel profile split by matrix (``benches/gpu/kernels.per_matmul``): fake profiler
events of random steps in launch order, some matmuls split in two launches, others' kernels between."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

pytest.importorskip("torch", reason="torch is not installed (pip install 'oxibonsai[torch]')")
sys.path.append(str(Path(__file__).resolve().parents[2] / "benches"))  # for the gpu package

from gpu.kernels import FOLLOWERS, MATMULS, ROLES, per_matmul


@dataclass
class Span:
    start: float
    us: float

    def elapsed_us(self) -> float:
        return self.us


@dataclass
class Event:
    name: str
    time_range: Span
    device_type: str = "DeviceType.CUDA"


def random_steps(rng, steps: int, layers: int) -> tuple[list[Event], dict[str, float]]:
    """Events of ``steps`` decode steps (shuffled: the profiler's order is not the launch order) and
    the microseconds per step each role should get."""
    events, want, clock = [], dict.fromkeys((*ROLES, "head"), 0.0), 0.0
    for _ in range(steps):
        for role in [*ROLES * layers, "head"]:
            for name in ("_quantize_kernel", "_decode_kernel")[: int(rng.integers(0, 3))]:
                clock += 1
                events.append(Event(name, Span(clock, float(rng.uniform(1, 9)))))
            launches = [str(rng.choice(sorted(MATMULS)))]
            if rng.random() < 0.4:
                launches.append(str(rng.choice(sorted(FOLLOWERS))))
            for name in launches:
                clock += 1
                us = float(rng.uniform(1, 50))
                events.append(Event(name, Span(clock, us)))
                want[role] += us / steps
    events.append(Event("_gemm_kernel", Span(-1.0, 5.0), "DeviceType.CPU"))  # another device's: ignored
    return [events[i] for i in rng.permutation(len(events))], want


def test_each_matmuls_time_goes_to_its_matrix(rng):
    steps, layers = int(rng.integers(1, 4)), int(rng.integers(1, 5))
    events, want = random_steps(rng, steps, layers)
    got = per_matmul(events, "CUDA", steps, layers)["matmuls"]
    assert got.keys() == want.keys()
    for role, us in want.items():
        assert got[role] == pytest.approx(us), role


def test_a_launch_order_of_another_layout_gives_nothing(rng):
    steps, layers = 2, int(rng.integers(1, 5))
    events, _ = random_steps(rng, steps, layers)
    assert per_matmul(events, "CUDA", steps, layers + 1) == {}
    extra = Event("_gemv_kernel", Span(1e9, 3.0))
    assert per_matmul([*events, extra], "CUDA", steps, layers) == {}
