"""wattwatch.record: the frozen records of the CLI's settings and tables behave as frozen dataclasses do."""

from __future__ import annotations

import copy
import pickle
from pathlib import Path

import pytest

from wattwatch import limits
from wattwatch.config import Settings
from wattwatch.record import FrozenRecordError, field, field_names, record, replace

MADE: list[int] = []


def _count() -> list[int]:
    MADE.append(1)
    return [len(MADE)]


@record
class Point:
    x: float
    y: float = 0.0
    tags: list[int] = field(default_factory=_count)


def test_init_takes_positions_keywords_and_defaults() -> None:
    a, b = Point(1.0), Point(1.0)
    assert a.tags != b.tags and a.tags is not b.tags
    assert Point(1.0, 2.0, [7]) == Point(y=2.0, x=1.0, tags=[7])
    assert Point.y == 0.0  # plain defaults stay on the class, as with dataclasses
    with pytest.raises(TypeError, match="missing 1 required positional argument: 'x'"):
        Point()  # type: ignore[call-arg]
    with pytest.raises(TypeError, match="unexpected keyword argument 'z'"):
        Point(1.0, z=3)  # type: ignore[call-arg]
    with pytest.raises(TypeError, match="multiple values"):
        Point(1.0, x=2.0)  # type: ignore[misc]


def test_records_are_frozen_equal_by_value_and_hashable() -> None:
    p = Point(1.0, 2.0, [3])
    with pytest.raises(FrozenRecordError, match="field 'x' of a Point: it is frozen"):
        p.x = 5.0  # type: ignore[misc]
    with pytest.raises(AttributeError):
        del p.y
    assert p == Point(1.0, 2.0, [3]) and p != Point(1.0, 2.5, [3])
    assert p != (1.0, 2.0, [3])  # not a tuple
    assert repr(p) == "Point(x=1.0, y=2.0, tags=[3])"
    assert field_names(Point) == ("x", "y", "tags") == field_names(p)
    window = limits.TimeWindow(60.0, 30.0)
    assert hash(window) == hash(limits.TimeWindow(60.0, 30.0))
    assert len({window, limits.TimeWindow(60.0, 30.0), limits.DEFAULT_WINDOW}) == 2


def test_replace_copies_with_changes_and_refuses_unknown_fields() -> None:
    p = Point(1.0, 2.0, [3])
    q = replace(p, y=9.0)
    assert (q.x, q.y, q.tags) == (1.0, 9.0, [3]) and p.y == 2.0
    with pytest.raises(TypeError, match="Point has no field 'z'"):
        replace(p, z=1)


def test_post_init_validates() -> None:
    with pytest.raises(ValueError, match="past_s must be a positive number"):
        limits.TimeWindow(-1.0, 30.0)


def test_a_field_without_default_after_one_with_is_refused() -> None:
    with pytest.raises(TypeError, match="field 'b' without a default follows one with a default"):

        @record
        class Bad:
            a: int = 1
            b: int  # type: ignore[misc]


def test_settings_copy_pickle_and_default_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Settings cross process boundaries (the collector's workers) and are copied; home's default is read
    when each Settings is made, not when the module was imported."""
    s = Settings(home=tmp_path, token="t", pue=1.2)
    assert pickle.loads(pickle.dumps(s)) == s and copy.deepcopy(s) == s
    monkeypatch.setenv("WATTWATCH_HOME", str(tmp_path / "elsewhere"))
    assert Settings().home == tmp_path / "elsewhere"
