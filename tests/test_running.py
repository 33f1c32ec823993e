"""fleet.running: the choice of a preemption victim, without a head (the e2e cases: test_batch_priority and
test_waiting_room_e2e)."""

from __future__ import annotations

from fleet.running import HIGHER_CLASS, UNDER_SHARE, Holder, Running
from fleet.waiting import RANKS, Waiter


def waiter(priority: str = "normal", key: str = "k", weight: int = 1) -> Waiter:
    return Waiter(f"g-{priority}-{key}", RANKS[priority], 0.0, key, weight)


def holding(*holders: Holder) -> Running:
    running = Running()
    for holder in holders:
        running.hold("m", holder)
    return running


def choose(running: Running, me: Waiter, *, exclude=(), over_interactive=False, share_preempting=False):
    return running.victim("m", me, exclude=set(exclude), over_interactive=over_interactive,
                          share_preempting=share_preempting)


def test_a_batch_line_is_taken_the_one_placed_last_first_and_never_on_an_excluded_node():
    early = Holder(waiter("batch"), True, "n1", placed_at=1.0)
    late = Holder(waiter("batch"), True, "n2", placed_at=2.0)
    interactive = Holder(waiter("low"), False, "n1", placed_at=3.0)
    running = holding(early, late, interactive)
    assert choose(running, waiter("high")) == (late, HIGHER_CLASS)
    assert choose(running, waiter("high"), exclude={"n2"}) == (early, HIGHER_CLASS)
    late.preempting = True  # its cancel is on the way: not taken twice
    assert choose(running, waiter("high")) == (early, HIGHER_CLASS)
    running.release("m", early)
    assert choose(running, waiter("high")) is None  # an interactive one only where the classes say so


def test_a_lower_interactive_class_is_taken_only_where_the_waiting_class_preempts_and_lowest_first():
    low = Holder(waiter("low"), False, "n1", placed_at=1.0)
    normal = Holder(waiter("normal"), False, "n1", placed_at=2.0)
    running = holding(low, normal)
    assert choose(running, waiter("high")) is None
    assert choose(running, waiter("high"), over_interactive=True) == (low, HIGHER_CLASS)
    assert choose(running, waiter("normal"), over_interactive=True) == (low, HIGHER_CLASS)
    assert choose(running, waiter("low"), over_interactive=True) is None  # never its own class by class


def test_within_a_class_a_key_over_its_share_gives_a_lane_to_one_it_then_holds_no_fewer_than():
    a = [Holder(waiter(key="a"), False, "n1", placed_at=float(i)) for i in range(3)]
    b = Holder(waiter(key="b"), False, "n1", placed_at=9.0)
    running = holding(*a, b)
    assert choose(running, waiter(key="c")) is None  # only where the class is named
    assert choose(running, waiter(key="c"), share_preempting=True) == (a[2], UNDER_SHARE)  # a: 3 lanes, c: 0
    assert choose(running, waiter(key="b"), share_preempting=True) == (a[2], UNDER_SHARE)  # 3-1 >= 1+1
    running.release("m", a[2])
    assert choose(running, waiter(key="b"), share_preempting=True) is None  # 2-1 < 1+1: it would take it back
    assert choose(running, waiter(key="b", weight=3), share_preempting=True) == (a[1], UNDER_SHARE)  # (1+1)/3
