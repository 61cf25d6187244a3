"""The pure tracker algorithm, driven by a fake clock: ranking, fan-out, admission, penalties, soft state."""

from __future__ import annotations

import pytest

from agent.chunkorder import Availability, bitmap_of, chunk_order, indexes_of, obtainable, rank_chunks
from agent.tracker import NodeView, Reason, Tracker, TrackerSettings
from weightship.errors import ValidationError
from weightship.testing import ManualClock

pytestmark = pytest.mark.timeout(10)

V = "sha256:" + "ab" * 32


def node(name: str, rack: str = "", zone: str = "", slots: int = 4) -> NodeView:
    return NodeView(name, f"http://{name}:7071", rack=rack, zone=zone, upload_slots_free=slots)


def make(**settings: float) -> tuple[Tracker, ManualClock]:
    clock = ManualClock()
    return Tracker(TrackerSettings(**settings), clock, sweep_interval=0.0), clock  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("parents", "expected"),
    [
        # spare upload capacity first, whatever the topology
        ([node("far", "r9", "z9", slots=4), node("near", "r1", "z1", slots=1)], ["far", "near"]),
        # equal capacity: same rack before same zone before elsewhere
        ([node("else", "r9", "z9"), node("zone", "r2", "z1"), node("rack", "r1", "z1")], ["rack", "zone", "else"]),
        # no free slot at all: never handed out
        ([node("full", "r1", "z1", slots=0), node("ok", "r9", "z9", slots=1)], ["ok"]),
    ],
    ids=["capacity_first", "rack_then_zone", "full_parent_skipped"],
)
def test_sources_are_ranked_by_spare_capacity_then_rack_then_zone(parents: list[NodeView], expected: list[str]) -> None:
    tracker, _ = make()
    for parent in parents:
        tracker.announce(parent, {V: [0]})
    tracker.announce(node("child", "r1", "z1"), {V: []})
    advice = tracker.sources("child", V, 0)
    assert [s.node for s in advice.sources] == expected
    assert not advice.upstream_allowed


def test_fan_out_per_parent_is_bounded_and_freed_when_the_child_announces() -> None:
    tracker, _ = make(fanout=2)
    tracker.announce(node("p", slots=10), {V: [0]})
    got = [tracker.sources(f"c{i}", V, 0).sources for i in range(3)]
    assert [len(s) for s in got] == [1, 1, 0]
    assert tracker.load("p") == 2
    tracker.announce_chunks(node("c0"), V, [0])  # c0 verified it: p is free for one more, c0 serves too
    assert tracker.load("p") == 1
    assert {s.node for s in tracker.sources("c2", V, 0).sources} == {"p", "c0"}


def test_fan_out_lease_expires_without_news_from_the_child() -> None:
    tracker, clock = make(fanout=1, lease_seconds=5.0)
    tracker.announce(node("p"), {V: [0]})
    assert tracker.sources("a", V, 0).sources
    assert not tracker.sources("b", V, 0).sources
    clock.now += 5.1
    tracker.announce(node("p"), {V: [0]})  # still alive
    assert [s.node for s in tracker.sources("b", V, 0).sources] == ["p"]


def test_equal_parents_share_the_load_rather_than_the_first_taking_it_all() -> None:
    tracker, _ = make(fanout=100)
    for i in range(4):
        tracker.announce(node(f"p{i}", slots=100), {V: list(range(64))})
    firsts = {tracker.sources(f"c{c}", V, k).sources[0].node for c in range(4) for k in range(16)}
    assert len(firsts) == 4


@pytest.mark.parametrize(
    ("slots", "per_chunk", "asks", "allowed"),
    [
        # one node per chunk goes up; the others wait for it
        (4, 1, [("a", 0), ("b", 0), ("c", 1)], [True, False, True]),
        # at most two chunk fetches upstream at once, cluster-wide
        (2, 1, [("a", 0), ("b", 1), ("c", 2), ("a", 3)], [True, True, False, False]),
        # a node asking again for a chunk it was granted keeps its grant
        (1, 1, [("a", 0), ("a", 0), ("b", 1)], [True, True, False]),
        # a lone node may use every slot: nobody else could feed it
        (3, 1, [("a", 0), ("a", 1), ("a", 2), ("a", 3)], [True, True, True, False]),
    ],
    ids=["per_chunk", "cluster_wide", "regrant", "lone_node"],
)
def test_upstream_admission_is_bounded(
    slots: int, per_chunk: int, asks: list[tuple[str, int]], allowed: list[bool]
) -> None:
    tracker, _ = make(upstream_slots=slots, upstream_per_chunk=per_chunk)
    answers = [tracker.sources(child, V, index) for child, index in asks]
    assert [a.upstream_allowed for a in answers] == allowed
    assert all(a.retry_after > 0 for a in answers if not a.upstream_allowed)
    assert tracker.upstream_grants() <= slots


def test_upstream_grant_ends_when_the_chunk_is_announced_and_waiters_get_the_new_holder() -> None:
    tracker, clock = make(upstream_slots=1, upstream_lease=30.0)
    assert tracker.sources("a", V, 0).upstream_allowed
    assert not tracker.sources("b", V, 0).upstream_allowed
    tracker.announce_chunks(node("a"), V, [0])
    assert tracker.upstream_count() == 0
    assert [s.node for s in tracker.sources("b", V, 0).sources] == ["a"]
    # a grant whose holder vanished expires
    assert tracker.sources("c", V, 1).upstream_allowed
    assert not tracker.sources("d", V, 2).upstream_allowed
    clock.now += 31
    assert tracker.sources("d", V, 2).upstream_allowed


def test_a_node_without_a_peer_listener_ends_its_grants_by_announcing_and_is_never_a_parent() -> None:
    tracker, _clock = make(upstream_slots=8, upstream_per_node=2, upstream_lease=30.0)
    leech = NodeView("leech", "")  # serves no peers: announces without an address
    assert [tracker.sources("leech", V, k).upstream_allowed for k in range(3)] == [True, True, False]
    tracker.announce_chunks(leech, V, [0])  # fetched: that grant ends now, not after its 30 s lease
    assert tracker.upstream_grants() == 1
    assert tracker.sources("leech", V, 2).upstream_allowed
    tracker.announce(leech, {V: [0, 1, 2]})
    assert tracker.upstream_grants() == 0
    assert tracker.holders(V, 0) == set()  # nobody is sent to it
    assert tracker.sources("other", V, 0).upstream_allowed


@pytest.mark.parametrize(
    ("reason", "base"),
    [(Reason.corrupt, 300.0), (Reason.slow, 30.0)],
)
def test_reported_parent_is_avoided_by_the_reporter_at_once_and_by_all_after_a_quorum(
    reason: Reason, base: float
) -> None:
    tracker, clock = make()
    tracker.announce(node("bad", slots=4), {V: [0]})
    tracker.announce(node("good", slots=1), {V: [0]})
    assert tracker.sources("a", V, 0).sources[0].node == "bad"
    tracker.report("a", "bad", V, 0, reason)
    assert [s.node for s in tracker.sources("a", V, 0).sources] == ["good"]
    assert tracker.sources("b", V, 0).sources[0].node == "bad"  # one report is not enough for others
    tracker.report("b", "bad", V, 0, reason)
    assert "bad" not in [s.node for s in tracker.sources("c", V, 0).sources]
    # second strike doubled the penalty: still avoided after the base time, free after the doubled one
    clock.now += base + 1
    tracker.announce(node("bad", slots=4), {V: [0]})
    assert tracker.avoided("bad", "c")
    clock.now += base
    tracker.announce(node("bad", slots=4), {V: [0]})
    assert not tracker.avoided("bad", "c")


def test_a_report_frees_the_reporters_fan_out_charge() -> None:
    tracker, _ = make(fanout=1)
    tracker.announce(node("slow"), {V: [0]})
    tracker.announce(node("other", slots=1), {V: [0]})
    assert tracker.sources("a", V, 0).sources[0].node == "slow"
    tracker.report("a", "slow", V, 0, Reason.slow)
    assert tracker.load("slow") == 0
    assert [s.node for s in tracker.sources("a", V, 0).sources] == ["other"]


def test_state_is_soft_silent_nodes_are_forgotten_and_a_restart_rebuilds_from_announcements() -> None:
    tracker, clock = make(announce_ttl=30.0)
    tracker.announce(node("p"), {V: [0, 1]})
    clock.now += 31
    assert tracker.node_count() == 0
    assert tracker.sources("c", V, 0).sources == ()
    restarted = Tracker(TrackerSettings(), clock, sweep_interval=0.0)
    assert restarted.sources("c", V, 0).sources == ()
    restarted.announce(node("p"), {V: [0, 1]})  # the periodic re-announcement
    assert [s.node for s in restarted.sources("c", V, 1).sources] == ["p"]


def test_an_announcement_replaces_what_the_node_held_before() -> None:
    tracker, _ = make()
    tracker.announce(node("p"), {V: [0, 1]})
    tracker.announce(node("p"), {V: [1]})  # chunk 0 evicted
    assert tracker.holders(V, 0) == set()
    assert tracker.holders(V, 1) == {"p"}


def test_a_node_is_never_its_own_source() -> None:
    tracker, _ = make()
    tracker.announce(node("p"), {V: [0]})
    assert tracker.sources("p", V, 0).sources == ()


@pytest.mark.parametrize("indexes", [[], [0], [0, 7, 8], list(range(0, 37, 3)), list(range(37))])
def test_bitmap_round_trips(indexes: list[int]) -> None:
    assert list(indexes_of(bitmap_of(indexes, 37), 37)) == indexes


def test_bitmap_naming_a_chunk_past_the_version_is_refused() -> None:
    with pytest.raises(ValidationError, match="has 3 chunks"):
        indexes_of(bitmap_of([5], 8), 3)


def test_chunk_order_numbers_distinct_chunks_in_file_order() -> None:
    from types import SimpleNamespace

    manifest = SimpleNamespace(files=(SimpleNamespace(chunks=("a", "b", "a")), SimpleNamespace(chunks=("c", "b"))))
    assert chunk_order(manifest) == ["a", "b", "c"]  # type: ignore[arg-type]


def test_settings_refuse_nonsense() -> None:
    with pytest.raises(ValidationError):
        TrackerSettings(fanout=0)
    with pytest.raises(ValidationError):
        TrackerSettings(lease_seconds=0)


def test_a_chunk_whose_peers_are_all_at_their_fanout_bound_is_waited_for_not_fetched_upstream() -> None:
    tracker, _ = make(fanout=1, upstream_slots=4)
    tracker.announce(node("parent"), {V: [0]})
    for child in ("a", "b"):
        tracker.announce(node(child), {V: []})
    assert [s.node for s in tracker.sources("a", V, 0).sources] == ["parent"]
    busy = tracker.sources("b", V, 0)
    # the cache's link is kept for chunks no peer has: b waits for the parent to free up
    assert busy.sources == ()
    assert not busy.upstream_allowed
    assert busy.retry_after > 0
    assert tracker.upstream_grants() == 0
    tracker.announce_chunks(node("a"), V, [0])  # a finished: the parent is free, and a holds it too
    assert {s.node for s in tracker.sources("b", V, 0).sources} == {"parent", "a"}
    # a holder that was reported (avoided) does not count as busy: the child may go upstream
    tracker.report("c", "parent", V, 1, Reason.corrupt)
    tracker.report("c", "a", V, 1, Reason.corrupt)
    assert tracker.sources("c", V, 0).upstream_allowed


def test_availability_counts_live_holders_other_than_the_asker_and_the_chunks_fetched_upstream() -> None:
    tracker, clock = make(upstream_slots=3, announce_ttl=30.0)
    tracker.announce(node("a"), {V: [0, 1]})
    tracker.announce(node("b"), {V: [1]})
    tracker.announce(node("asker"), {V: [2]})
    assert tracker.sources("asker", V, 3).upstream_allowed
    seen = tracker.availability("asker", V, 5)
    assert seen.holders == (1, 2, 0, 0, 0)  # its own chunk 2 is not counted
    assert seen.fetching == {3}
    assert seen.upstream_free == 2
    clock.now += 20
    tracker.announce(node("b"), {V: [1]})
    clock.now += 15  # a is silent past the ttl: forgotten
    assert tracker.availability("asker", V, 5).holders == (0, 1, 0, 0, 0)


@pytest.mark.parametrize(
    ("seen", "expected"),
    [
        # nothing anywhere: chunk order, the order the cache reads ahead
        (Availability((0, 0, 0, 0)), [0, 1, 2, 3]),
        # held by peers: rarest first, before chunks nobody has
        (Availability((3, 0, 1, 2)), [2, 3, 0, 1]),
        # only the cache has chunk 3, and an upstream grant is free: it enters the swarm first;
        # chunk 1 is being fetched upstream by a node already: after what peers hold
        (Availability((2, 0, 0, 0), fetching=frozenset({1}), cached=frozenset({3}), upstream_free=1), [3, 0, 1, 2]),
        # no upstream grant free: the cached chunk is just one nobody else holds yet
        (Availability((2, 0, 0, 0), cached=frozenset({3}), upstream_free=0), [0, 1, 2, 3]),
        # several chunks only the cache has: the oldest (the cache reads in chunk order) first
        (Availability((0, 0, 0, 0), cached=frozenset({1, 2, 3}), upstream_free=2), [1, 2, 3, 0]),
        # a rare chunk whose holders are all busy comes after a commoner one a free holder has
        (Availability((1, 3, 0, 0), free=(0, 1, 0, 0)), [1, 0, 2, 3]),
    ],
    ids=["chunk_order", "rarest_first", "cache_only_first", "no_upstream_slot", "cache_only_oldest", "free_first"],
)
def test_chunks_are_ranked_cache_only_then_rarest_then_in_flight_then_chunk_order(
    seen: Availability, expected: list[int]
) -> None:
    assert rank_chunks(range(4), seen, "n00") == expected


def test_nodes_break_ties_between_equally_rare_chunks_differently() -> None:
    seen = Availability((1,) * 64)
    orders = {tuple(rank_chunks(range(64), seen, f"n{i:02d}")[:4]) for i in range(16)}
    assert len(orders) == 16  # sixteen nodes, sixteen different first picks among equals
    assert sorted(rank_chunks(range(64), seen, "n00")) == list(range(64))


def test_availability_tells_which_chunks_a_parent_with_a_free_slot_holds() -> None:
    tracker, _ = make(fanout=1, upstream_slots=4)
    tracker.announce(node("p1"), {V: [0, 1]})
    tracker.announce(node("p2"), {V: [1]})
    tracker.announce(node("asker"), {V: []})
    assert tracker.availability("asker", V, 3).free == (1, 2, 0)
    assert tracker.sources("other", V, 0).sources[0].node == "p1"  # p1 is at its fan-out bound now
    seen = tracker.availability("asker", V, 3)
    assert seen.holders == (1, 2, 0)
    assert seen.free == (0, 1, 0)
    assert not obtainable(0, seen)  # held, but only by a busy parent: not worth asking about now
    assert obtainable(1, seen)


def test_the_cache_serves_a_chunk_whose_peers_are_busy_with_at_most_half_the_grants() -> None:
    tracker, _ = make(fanout=1, upstream_slots=4)
    tracker.announce(node("parent"), {V: [0, 1, 2, 3]})
    assert tracker.sources("a", V, 0).sources[0].node == "parent"  # the only parent is busy from now on
    assert not tracker.sources("b", V, 0, cached=False).upstream_allowed  # the cache lacks it: wait
    seen = tracker.availability("b", V, 4, cached=[0, 1])
    assert seen.free == (1, 1, 0, 0)  # the cache counts as a free holder of what it has
    assert tracker.sources("b", V, 0, cached=True).upstream_allowed
    assert tracker.sources("c", V, 1, cached=True).upstream_allowed
    # two of four grants taken: the rest stay for chunks only the cache has
    refused = tracker.sources("d", V, 1, cached=True)
    assert not refused.upstream_allowed
    assert refused.retry_after > 0
    assert tracker.availability("d", V, 4, cached=[0, 1]).free == (0, 0, 0, 0)
    assert tracker.sources("d", V, 9).upstream_allowed  # a chunk nobody has still gets a grant
