"""Plan distribution past one machine: the real tracker (``agent.tracker``) in a bandwidth model.

Discrete events over simulated time. The parts:

* an origin, one region cache, one cluster cache per cluster, and nodes, each with an upload and
  a download rate (full duplex);
* per cluster, one ``agent.tracker.Tracker`` — the very code the cluster cache runs — with the
  simulated clock injected: nodes announce each chunk as it verifies (``announce_chunks``) and
  re-announce periodically; for each chunk a node asks ``sources()`` and either fetches from the
  first parent it names, or (``upstream_allowed``) from its cluster cache, or tries another chunk
  and asks again after ``retry_after``;
* caches read through with single flight: a cluster cache miss becomes one region fetch, a region
  miss one origin fetch, however many wait; a cluster cache reads the version ahead as the agent's
  does: ``--read-ahead`` streams, each claiming a run of 16 chunks from the origin (requesters of
  any of them wait for the stream) and bringing them back to back; from a region cache, chunk by chunk.

Bandwidth: a transfer's rate is min(sender's upload ÷ its active uploads, receiver's download ÷
its active downloads), recomputed for the flows of both ends whenever a flow starts or ends. It
is not max-min fair (capacity a flow bottlenecked elsewhere leaves unused is not handed to its
neighbours), so it errs slow; there is no TCP ramp, no rack oversubscription. What the real
fan-out has and the model takes as constants: payload moves at ``--payload`` of line rate
(TCP/IPv4 headers at MTU 1500), nothing moves for ``--start-delay`` seconds after the pointer
update, and ``--request-latency`` (default 0) delays each chunk's first byte.

Output, per scenario: time until every node holds the version ÷ ideal (ideal = size ÷ node
link rate), origin egress ÷ size, the speed-up over every node fetching from the origin
(ideal of that = N × size ÷ origin rate), and when the cluster caches held the whole version
(``caches_complete_s``) and the first node did (``first_node_s``): the time after the first is
how far the nodes trail the caches. Scenarios: ``plan`` (default: 140 GB to 2,000 nodes in
10 clusters, 25 Gbit/s NICs, 100 Gbit/s origin and caches) and ``fanout`` (16 nodes, 256 MiB,
100 Mbit/s everywhere, cache and origin included — the topology of ``bench/fanout.py``, for
calibration; its chunks in flight, fan-out, upstream grants and read-ahead streams are the
agent's own defaults). The last line is one JSON object.

Usage: python bench/simulate.py [--scenario plan|fanout|both] [--nodes N] [--clusters C]
       [--size 140GB] [--chunk 1GiB] [--nic 25e9] [--origin 100e9] [--cache 100e9]
       [--fanout 4] [--upstream-slots K] [--concurrency 4] [--read-ahead 1] [--seed 1]
       [--payload 0.956] [--start-delay 0.3] [--request-latency 0]
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import heapq
import itertools
import json
import random
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from agent.cache import STREAM_CHUNKS
from agent.chunkorder import rank_chunks
from agent.config import AgentConfig
from agent.tracker import NodeView, Tracker, TrackerSettings
from weightship.sizes import parse_size

VERSION = "sha256:" + "5e" * 32
#: seconds a node keeps one availability answer (agent.sources.Sources's default)
AVAILABILITY_TTL = 0.1
#: share of a link's line rate left for payload: TCP/IPv4 over Ethernet at MTU 1500 (1448 of 1514 bytes per frame)
PAYLOAD_SHARE = 1448 / 1514
#: seconds from the pointer update until nodes start fetching and the cache starts reading ahead (bench/fanout.py's logs:
#: long-poll answer, manifest, first tracker call)
START_DELAY = 0.3


@dataclass(eq=False)
class Endpoint:
    """A host's link: upload and download rates in bytes/s and the flows using each."""

    name: str
    up: float
    down: float
    uploads: set[Flow] = field(default_factory=set)
    downloads: set[Flow] = field(default_factory=set)
    sent: int = 0


@dataclass(eq=False)
class Flow:
    """One chunk on the wire."""

    src: Endpoint
    dst: Endpoint
    remaining: float
    done: Callable[[], None]
    rate: float = 0.0
    updated: float = 0.0
    token: int = 0


class Network:
    """Flows, their rates and the event queue."""

    def __init__(self) -> None:
        self.now = 0.0
        self._queue: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = itertools.count()
        self.events = 0

    def at(self, when: float, action: Callable[[], None]) -> None:
        heapq.heappush(self._queue, (when, next(self._seq), action))

    def run(self, until: Callable[[], bool]) -> None:
        while self._queue and not until():
            when, _seq, action = heapq.heappop(self._queue)
            self.now = when
            self.events += 1
            action()

    def send(self, src: Endpoint, dst: Endpoint, size: int, done: Callable[[], None]) -> None:
        flow = Flow(src, dst, float(size), done, updated=self.now)
        src.sent += size
        src.uploads.add(flow)
        dst.downloads.add(flow)
        self._rerate(src, dst)

    def _rerate(self, *ends: Endpoint) -> None:
        touched = {f for e in ends for f in (*e.uploads, *e.downloads)}
        for flow in touched:
            flow.remaining -= flow.rate * (self.now - flow.updated)
            flow.updated = self.now
            flow.rate = min(flow.src.up / len(flow.src.uploads), flow.dst.down / len(flow.dst.downloads))
            flow.token += 1
            token = flow.token
            self.at(self.now + max(0.0, flow.remaining) / flow.rate, functools.partial(self._finish, flow, token))

    def _finish(self, flow: Flow, token: int) -> None:
        if token != flow.token:
            return  # superseded by a rate change
        flow.src.uploads.discard(flow)
        flow.dst.downloads.discard(flow)
        flow.token = -1
        self._rerate(flow.src, flow.dst)
        flow.done()


class Cache:
    """A read-through cache tier with single flight per chunk."""

    def __init__(self, net: Network, link: Endpoint, upstream: Cache | Endpoint, chunk_size: Callable[[int], int]):
        self.net = net
        self.link = link
        self.upstream = upstream
        self.size = chunk_size
        self.held: set[int] = set()
        #: when the last chunk came in
        self.last_arrival = 0.0
        self.waiting: dict[int, list[Callable[[], None]]] = {}

    def read_ahead(self, chunks: int, streams: int, run: int = 1) -> None:
        """Pull every chunk from upstream without waiting to be asked: ``streams`` at a time, each a run of chunks.

        ``run`` > 1 is the agent's streamed read-ahead (``agent.cache``): a stream claims up to ``run``
        consecutive chunks at once (a requester of any of them waits for the stream) and brings them
        one after another, back to back.
        """
        order = iter(range(chunks))

        def next_run() -> None:
            claimed: list[int] = []
            for index in order:
                if index in self.held or index in self.waiting:
                    if claimed:
                        break
                    continue
                claimed.append(index)
                self.waiting[index] = []
                if len(claimed) == run:
                    break
            if claimed:
                one_by_one(claimed)

        def one_by_one(claimed: list[int]) -> None:
            index = claimed.pop(0)
            waiters = self.waiting.pop(index)
            self._fetch(index, [*waiters, (lambda: one_by_one(claimed)) if claimed else next_run])

        for _ in range(streams):
            next_run()

    def serve(self, index: int, to: Endpoint, done: Callable[[], None]) -> None:
        """Send chunk ``index`` to ``to`` once held; fetch it upstream once however many ask."""
        if index in self.held:
            self.net.send(self.link, to, self.size(index), done)
            return
        waiters = self.waiting.get(index)
        if waiters is not None:
            waiters.append(lambda: self.net.send(self.link, to, self.size(index), done))
            return
        self._fetch(index, [lambda: self.net.send(self.link, to, self.size(index), done)])

    def _fetch(self, index: int, waiters: list[Callable[[], None]]) -> None:
        self.waiting[index] = waiters

        def arrived() -> None:
            self.held.add(index)
            self.last_arrival = self.net.now
            for waiter in self.waiting.pop(index):
                waiter()

        if isinstance(self.upstream, Cache):
            self.upstream.serve(index, self.link, arrived)
        else:
            self.net.send(self.upstream, self.link, self.size(index), arrived)


class Node:
    """A node's fetch loop: ask the tracker per chunk, fetch, announce as it verifies."""

    def __init__(self, sim: Simulation, name: str, cluster: int, rack: str, zone: str) -> None:
        self.sim = sim
        self.name = name
        self.cluster = cluster
        self.view = NodeView(name, f"http://{name}", rack=rack, zone=zone, upload_slots_free=sim.args.fanout)
        self.link = Endpoint(name, sim.nic, sim.nic)
        self.todo = list(range(sim.chunks))
        if sim.args.order != "sequential":
            sim.rng.shuffle(self.todo)  # spread: nodes start on different chunks
        self.inflight: set[int] = set()
        self.have = 0
        self.finished_at: float | None = None
        self.retry_pending = False
        self.ranked_at = float("-inf")
        self.from_peers = 0
        self.from_cache = 0

    def pump(self) -> None:
        """Start chunks up to the concurrency; when the tracker says wait, try again later."""
        self.retry_pending = False
        tracker = self.sim.trackers[self.cluster]
        if self.sim.args.order == "rarest" and self.sim.net.now - self.ranked_at >= AVAILABILITY_TTL:
            # what the agent's fetcher does (agent.sources.Sources.availability, at most every 0.1 s)
            self.ranked_at = self.sim.net.now
            cached = self.sim.cluster_caches[self.cluster].held
            seen = tracker.availability(self.name, VERSION, self.sim.chunks, cached)
            self.todo = rank_chunks(self.todo, seen, self.name)
        asked = 0
        i = 0
        while len(self.inflight) < self.sim.args.concurrency and i < len(self.todo) and asked < self.sim.args.asks:
            index = self.todo[i]
            asked += 1
            advice = tracker.sources(self.name, VERSION, index, index in self.sim.cluster_caches[self.cluster].held)
            if advice.sources:
                parent = self.sim.nodes[advice.sources[0].node]
                self._start(
                    i,
                    functools.partial(
                        self.sim.net.send,
                        parent.link,
                        self.link,
                        self.sim.size(index),
                        functools.partial(self._got, index, True),
                    ),
                )
            elif advice.upstream_allowed:
                cache = self.sim.cluster_caches[self.cluster]
                self._start(i, functools.partial(cache.serve, index, self.link, functools.partial(self._got, index, False)))
            else:
                i += 1
        if len(self.inflight) < self.sim.args.concurrency and self.todo and not self.retry_pending:
            self.retry_pending = True
            self.sim.net.at(self.sim.net.now + tracker.settings.retry_after, self.pump)

    def _start(self, position: int, go: Callable[[], None]) -> None:
        self.inflight.add(self.todo.pop(position))
        if self.sim.args.request_latency > 0:
            # the tracker's answer and the request reach the source before a byte moves
            self.sim.net.at(self.sim.net.now + self.sim.args.request_latency, go)
        else:
            go()

    def _got(self, index: int, from_peer: bool) -> None:
        self.inflight.discard(index)
        self.have += 1
        size = self.sim.size(index)
        if from_peer:
            self.from_peers += size
        else:
            self.from_cache += size
        self.sim.trackers[self.cluster].announce_chunks(self.view, VERSION, [index])
        if self.have == self.sim.chunks:
            self.finished_at = self.sim.net.now
            self.sim.remaining -= 1
        self.pump()


class Simulation:
    """One scenario."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.rng = random.Random(args.seed)
        self.net = Network()
        self.nic = args.nic / 8
        self.size_bytes = args.size
        self.chunk = args.chunk
        self.chunks = -(-args.size // args.chunk)
        # Payload moves at a share of each link's line rate (headers); ideal stays at line rate, as in bench/fanout.py.
        self.payload_rate = self.nic * args.payload
        cache_rate = args.cache / 8 * args.payload
        origin = Endpoint("origin", args.origin / 8 * args.payload, 0.0)
        self.origin = origin
        region = Cache(self.net, Endpoint("region", cache_rate, cache_rate), origin, self.size)
        self.cluster_caches: list[Cache] = []
        self.trackers: list[Tracker] = []
        self.nodes: dict[str, Node] = {}
        settings = TrackerSettings(fanout=args.fanout, upstream_slots=args.upstream_slots, retry_after=args.retry_after)
        for c in range(args.clusters):
            link = Endpoint(f"cache{c}", cache_rate, cache_rate)
            upstream: Cache | Endpoint = region if args.clusters > 1 or args.region else origin
            self.cluster_caches.append(Cache(self.net, link, upstream, self.size))
            self.trackers.append(Tracker(settings, lambda: self.net.now))
        per_cluster = -(-args.nodes // args.clusters)
        for n in range(args.nodes):
            c = n // per_cluster
            within = n % per_cluster
            name = f"c{c}-n{n}"
            self.nodes[name] = Node(self, name, c, rack=f"r{within // args.rack_size}", zone=f"z{within % 2}")
        self.remaining = args.nodes

    def size(self, index: int) -> int:
        return int(min(self.chunk, self.size_bytes - index * self.chunk))

    def reannounce(self) -> None:
        for node in self.nodes.values():
            self.trackers[node.cluster].announce_chunks(node.view, VERSION, [])
        if self.remaining:
            self.net.at(self.net.now + 10.0, self.reannounce)

    def run(self) -> dict[str, Any]:
        started = time.perf_counter()
        for node in self.nodes.values():
            self.trackers[node.cluster].announce_chunks(node.view, VERSION, [])
        start = self.args.start_delay
        if self.args.read_ahead:
            # A cluster cache that sees a version's first miss seeds the whole version (Dragonfly's
            # seed peer does the same): the origin link stays busy while nodes feed each other. It
            # claims its first runs before the nodes' first requests arrive (the agent's first tracker
            # call, for availability, starts it).
            for cache in self.cluster_caches:
                # From the origin a stream is one range read over a run of chunks; from a cache, chunk by chunk.
                run = STREAM_CHUNKS if isinstance(cache.upstream, Endpoint) else 1
                self.net.at(start, functools.partial(cache.read_ahead, self.chunks, self.args.read_ahead, run))
        for node in self.nodes.values():
            self.net.at(start, node.pump)
        self.net.at(10.0, self.reannounce)
        self.net.run(lambda: self.remaining == 0)
        args = self.args
        ideal = self.size_bytes / self.nic
        # what the links allow at best: a node's NIC, the origin, and the region cache's link shared by clusters
        region = args.clusters > 1 or args.region
        bound = max(
            ideal,
            self.size_bytes / (args.origin / 8),
            self.size_bytes * (args.clusters if region else 1) / (args.cache / 8),
        )
        makespan = max(n.finished_at or float("inf") for n in self.nodes.values())
        origin_bytes = self.origin.sent
        naive = args.nodes * self.size_bytes / (args.origin / 8)
        peer = sum(n.from_peers for n in self.nodes.values())
        cached = sum(n.from_cache for n in self.nodes.values())
        return {
            "scenario": args.scenario,
            "N": args.nodes,
            "clusters": args.clusters,
            "S": self.size_bytes,
            "chunk": self.chunk,
            "nic_bps": args.nic,
            "origin_bps": args.origin,
            "cache_bps": args.cache,
            "time_s": round(makespan, 3),
            # when the last cluster cache held the whole version, and the first node did
            "caches_complete_s": round(max(c.last_arrival for c in self.cluster_caches), 3),
            "first_node_s": round(min(n.finished_at or float("inf") for n in self.nodes.values()), 3),
            "ideal_s": round(ideal, 3),
            "time_over_ideal": round(makespan / ideal, 3),
            "time_over_link_bound": round(makespan / bound, 3),
            "origin_egress_over_size": round(origin_bytes / self.size_bytes, 3),
            "speedup_over_origin": round(max(naive, ideal) / makespan, 2),
            "peer_share": round(peer / max(1, peer + cached), 3),
            "events": self.net.events,
            "wall_s": round(time.perf_counter() - started, 2),
        }


#: the agent's own defaults (``weightship-agent`` flags), which the fanout scenario runs with
AGENT = {f.name: f.default for f in dataclasses.fields(AgentConfig)}

SCENARIOS: dict[str, dict[str, Any]] = {
    "plan": {
        "concurrency": 4,
        "fanout": 4,
        "nodes": 2000,
        "clusters": 10,
        "size": "140GB",
        "chunk": "1GiB",
        "asks": 16,
        "order": "random",
        "read_ahead": 1,
        "nic": 25e9,
        "origin": 100e9,
        "cache": 100e9,
    },
    "fanout": {
        "nodes": 16,
        "clusters": 1,
        "size": "256MiB",
        "chunk": "4MiB",
        "asks": 64,
        "order": "rarest",
        # the agent's defaults: --peer-concurrency, --tracker-fanout, --tracker-upstream-slots, --read-ahead
        "concurrency": AGENT["peer_concurrency"],
        "fanout": AGENT["tracker_fanout"],
        "upstream_slots": AGENT["tracker_upstream_slots"],
        "read_ahead": AGENT["read_ahead"],
        "nic": 100e6,
        "origin": 100e6,
        "cache": 100e6,
    },
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--scenario", choices=["plan", "fanout", "both"], default="both")
    parser.add_argument("--nodes", type=int)
    parser.add_argument("--clusters", type=int)
    parser.add_argument("--size")
    parser.add_argument("--chunk")
    parser.add_argument("--nic", type=float, help="node link, bit/s")
    parser.add_argument("--origin", type=float, help="origin egress, bit/s")
    parser.add_argument("--cache", type=float, help="each cache's link, bit/s")
    parser.add_argument("--region", action="store_true", help="a region tier even with one cluster")
    parser.add_argument(
        "--fanout", type=int, help="children per parent at once (tracker fanout; plan 4, fanout the agent's --tracker-fanout)"
    )
    parser.add_argument(
        "--upstream-slots",
        type=int,
        help="nodes per cluster fetching from the cache at once (default: cache link ÷ node link × concurrency)",
    )
    parser.add_argument("--concurrency", type=int, help="chunks a node fetches at once (plan 4; fanout 4, the agent's --peer-concurrency)")
    parser.add_argument(
        "--retry-after", type=float, default=TrackerSettings().retry_after, help="seconds a node told to wait waits"
    )
    parser.add_argument(
        "--read-ahead", type=int, help="chunks each cluster cache pulls ahead at once (0: only on request; the agent's "
        "default stream count, 2, for fanout; 1 for plan)"
    )
    parser.add_argument(
        "--order",
        choices=["sequential", "random", "rarest"],
        help="the order a node wants chunks in: the agent's is rarest (agent.chunkorder.rank_chunks on the "
        "tracker's availability; fanout's default; plan's is random, as rarest costs O(nodes x chunks) per ask)",
    )
    parser.add_argument(
        "--asks", type=int, help="chunks a node with a free slot asks the tracker about per round (plan 16, fanout 64)"
    )
    parser.add_argument(
        "--payload", type=float, default=PAYLOAD_SHARE,
        help="share of a link's line rate that carries payload (default: TCP/IPv4 at MTU 1500, 1448 of 1514 bytes)",
    )
    parser.add_argument(
        "--start-delay", type=float, default=START_DELAY,
        help="seconds from the pointer update until nodes ask and the cache reads ahead (measured on bench/fanout.py)",
    )
    parser.add_argument(
        "--request-latency", type=float, default=0.0,
        help="seconds from a node's choice of a chunk until its bytes start to move (tracker call, request)",
    )
    parser.add_argument("--rack-size", type=int, default=20)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args(argv)
    results = []
    for name in ["plan", "fanout"] if args.scenario == "both" else [args.scenario]:
        run = argparse.Namespace(**vars(args))
        run.scenario = name
        for key, value in SCENARIOS[name].items():
            if getattr(args, key) is None:
                setattr(run, key, value)
        if run.upstream_slots is None:
            # enough to keep the cache's link full while each node also feeds from peers
            run.upstream_slots = max(1, round(run.cache / run.nic)) * run.concurrency
        run.size = parse_size(run.size)
        run.chunk = parse_size(run.chunk)
        result = Simulation(run).run()
        results.append(result)
        print(
            f"{name:7s} N={result['N']:5d} clusters={result['clusters']:3d} S={result['S'] / 1e9:8.2f} GB "
            f"chunk={result['chunk'] >> 20} MiB nic={result['nic_bps'] / 1e9:g} Gbit/s: "
            f"time {result['time_s']:.2f} s = {result['time_over_ideal']:.3f} x ideal "
            f"({result['time_over_link_bound']:.3f} x what the cache and origin links allow), "
            f"origin egress {result['origin_egress_over_size']:.2f} x S, "
            f"speed-up over origin-only {result['speedup_over_origin']:.1f}x, peer share {result['peer_share']:.2f} "
            f"({result['events']} events, {result['wall_s']} s wall)"
        )
    print(
        json.dumps({"simulate": results, **{k: results[-1][k] for k in ("time_over_ideal", "origin_egress_over_size")}})
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
