"""tensor_tables' host side: a many-tensor launch's alignment groups and its kept launches."""

from lockstep.tensor_tables import ALIGN, PreparedLaunches, alignment, alignment_groups, holding


def test_one_odd_item_does_not_take_the_hint_from_the_others():
    aligned, odd_size, odd_address = ([4096, 8192], 64), ([4096, 8192], 12), ([4100, 8192], 64)
    items = [aligned, odd_size, aligned, odd_address]
    groups = alignment_groups([a for a, _ in items], [n for _, n in items])
    assert groups == {ALIGN: [0, 2], 1: [1, 3]}
    assert alignment([4096, 8192, 4100], [64]) == 1  # the launch-wide rule the groups refine


def test_prepared_launches_are_kept_by_key_and_a_temporary_is_not():
    launched, prepared = [], []
    kernel = type("K", (), {"__getitem__": lambda self, grid: lambda *args, **kw: launched.append((grid, args))})()
    cache = PreparedLaunches(size=2)

    def prepare(copies=()):
        prepared.append(1)
        return [((3,), ("table",), {})], list(copies)

    cache.launch(kernel, "a", prepare, extra=("flags",))
    cache.launch(kernel, "a", prepare, extra=("other",))
    assert len(prepared) == 1 and launched == [((3,), ("table", "flags")), ((3,), ("table", "other"))]
    cache.launch(kernel, "b", lambda: prepare(copies=["a temporary copy"]))
    cache.launch(kernel, "b", lambda: prepare(copies=["a temporary copy"]))
    assert len(prepared) == 3  # a launch reading a temporary is prepared anew each call
    for key in ("c", "d", "a"):  # two entries kept, the oldest dropped first
        cache.launch(kernel, key, prepare)
    assert len(prepared) == 6


def test_launches_inside_holding_are_held_and_reach_an_outer_holding():
    """What a CUDA graph captured inside `holding` reads (its launches' tables) is held with it."""
    kernel = type("K", (), {"__getitem__": lambda self, grid: lambda *args, **kw: None})()
    cache = PreparedLaunches()
    prepare = lambda: ([((1,), ("table",), {})], [])  # noqa: E731
    cache.launch(kernel, "a", prepare)  # outside: held by nobody
    with holding() as outer:
        cache.launch(kernel, "a", prepare, extra=("gate",))
        with holding() as inner:
            cache.launch(kernel, "b", prepare)
        assert inner == [([((1,), ("table",), {})], ())]
    assert [extra for _, extra in outer] == [("gate",), ()]
