"""Token ids passed into the native module (``rust/py/src/token_ids.rs``): lists and tuples of ints read
through the C API, uint32 arrays copied, anything else through the generic path; all give the same ids
and the same errors. Observed through ``Scheduler.request_state`` (which returns the prompt as read)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from oxibonsai._core import PrefixCache, Scheduler

U32_MAX = 2**32 - 1


class Seq(Sequence[int]):
    """A sequence that is neither a list nor a tuple nor an array: the generic path."""

    def __init__(self, items: list[Any]) -> None:
        self.items = items

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: Any) -> Any:
        return self.items[i]


def read(tokens: Any) -> list[int]:
    sched = Scheduler(4)
    sched.add(1, tokens)
    state = sched.request_state(1)
    assert state is not None
    return state[0]


def forms(ids: list[int]) -> list[Any]:
    return [ids, tuple(ids), np.array(ids, dtype=np.uint32), Seq(ids), np.array(ids, dtype=np.int64)]


@given(st.lists(st.integers(0, U32_MAX), min_size=1, max_size=300))
def test_every_form_reads_the_same_ids(ids: list[int]) -> None:
    for form in forms(ids):
        assert read(form) == ids


def test_ints_at_cpython_digit_boundaries_read_exactly(rng: np.random.Generator) -> None:
    """Small ints are read from the object's 30-bit digits (``small_int.rs``): zero, one and two digits."""
    edges = [0, 1, 2**30 - 1, 2**30, 2**30 + 1, 2**31, 2**32 - 2, U32_MAX]
    ids = edges + rng.integers(0, U32_MAX, 200, endpoint=True).tolist()
    rng.shuffle(ids)
    assert read(ids) == ids
    assert read(tuple(ids)) == ids
    for bad in (2**32, 2**60, -1, -(2**30)):
        with pytest.raises(OverflowError):
            read([*ids, bad])


def test_strided_arrays_and_numpy_items_read_as_ints(rng: np.random.Generator) -> None:
    ids = rng.integers(0, U32_MAX, 64, dtype=np.uint32, endpoint=True)
    assert read(ids[::2]) == ids[::2].tolist()
    assert read([np.uint32(v) for v in ids]) == ids.tolist()
    assert read([True, False, 3]) == [1, 0, 3]


@pytest.mark.parametrize(
    ("bad", "error"),
    [
        (-1, OverflowError),
        (2**32, OverflowError),
        (2**64, OverflowError),
        (-(2**70), OverflowError),
        (np.int64(-3), OverflowError),
        ("a", TypeError),
        (1.5, TypeError),
        (None, TypeError),
        (np.float64(1.0), TypeError),
    ],
)
@pytest.mark.parametrize("where", [0, 5, 9])
def test_bad_items_raise_in_every_form(bad: Any, error: type[Exception], where: int) -> None:
    items: list[Any] = list(range(10))
    items[where] = bad
    for form in (items, tuple(items), Seq(items)):
        with pytest.raises(error):
            read(form)
    with pytest.raises(error):
        PrefixCache(4).match(items)


def test_bad_containers_raise_type_error() -> None:
    for bad in ("abc", 5, np.array([1.0, 2.0]), {1: 2}.items()):
        with pytest.raises(TypeError):
            read(bad)


def test_an_index_that_shrinks_the_list_is_safe() -> None:
    items: list[Any] = [1, 2, 3, 4]

    class Shrinks:
        def __index__(self) -> int:
            del items[2:]
            return 7

    items[1] = Shrinks()
    assert read(items) == [1, 7]
