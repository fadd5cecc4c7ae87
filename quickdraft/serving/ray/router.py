"""Prefix-aware routing of requests over engine replicas.

A request is routed by the chained hashes of its prompt's full KV blocks (``kv.blocks.block_hash``, the keys of
every replica's prefix cache, computed by the ingress from the same tokenizer and block size). ``PrefixAffinity``
(kept by the ingress, which sees every request and which replica answered it) remembers which replica holds each
hash: a request's prompt, and once it is answered the conversation including the answer, which is what the next
turn's prompt starts with. The replica holding the longest prefix of a new request's chain (a multi-turn chat's
earlier turns, an agent loop's growing context) is the request's preferred replica when that prefix is more than
half the prompt; a request naming a session (header ``x-session-id``) prefers the replica that served the session
before.

``PrefixAwareRouter`` (Ray Serve's ``RequestRouter``, in the ingress's handle) then takes the preferred replica
unless it has ``max_imbalance`` more requests in flight than the least-loaded one, in which case the least-loaded
one takes it. ``policy="round_robin"`` ignores preferences, and ``"power_of_two"`` is Ray Serve's own router (two
random replicas, the less loaded): the baselines ``bench/scaleout.py`` compares with.
"""
from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

POLICIES = ("prefix", "round_robin", "power_of_two")  # power_of_two: Ray Serve's own default router


@dataclass
class Route:
    """What the ingress knows for routing: the prompt's block hashes, its session, the replica it prefers."""

    hashes: list[bytes] = field(default_factory=list)
    session: str | None = None
    preferred: str | None = None


class PrefixAffinity:
    """Which replica holds which prefix (by block hash) and which session; bounded LRU tables."""

    def __init__(self, min_match: float = 0.5, max_hashes: int = 500_000, max_sessions: int = 100_000) -> None:
        self.min_match = min_match
        self.max_hashes, self.max_sessions = max_hashes, max_sessions
        self._owner: OrderedDict[bytes, str] = OrderedDict()  # block hash -> the replica that last computed it
        self._sessions: OrderedDict[str, str] = OrderedDict()

    def preferred(self, route: Route) -> str | None:
        """The session's replica, else the owner of the longest owned prefix of the chain (a hash names its whole
        prefix: it is chained) when that prefix is more than ``min_match`` of the prompt's blocks: a short shared
        prefix (a system prompt) must not pull every new conversation onto one replica (as SGLang's cache-aware
        router's threshold)."""
        if route.session is not None and route.session in self._sessions:
            return self._sessions[route.session]
        for depth in range(len(route.hashes), 0, -1):
            owner = self._owner.get(route.hashes[depth - 1])
            if owner is not None:
                return owner if depth > self.min_match * len(route.hashes) else None
        return None

    def routed(self, replica: str, hashes: Sequence[bytes], session: str | None = None) -> None:
        """``replica`` computed these blocks (and served this session): later requests sharing them prefer it."""
        for digest in hashes:
            self._owner[digest] = replica
            self._owner.move_to_end(digest)
        while len(self._owner) > self.max_hashes:
            self._owner.popitem(last=False)
        if session is not None:
            self._sessions[session] = replica
            self._sessions.move_to_end(session)
            while len(self._sessions) > self.max_sessions:
                self._sessions.popitem(last=False)


class Balancer:
    """The replica a request goes to: its preferred one within the load bound, else the least loaded (of equals, the
    one chosen least recently, so an idle fleet spreads new prompts); or simply the next one, round-robin."""

    def __init__(self, policy: str = "prefix", max_imbalance: int = 4) -> None:
        if policy not in POLICIES[:2]:
            raise ValueError(f"policy must be one of {', '.join(POLICIES[:2])}, got {policy!r}")
        self.policy, self.max_imbalance = policy, max_imbalance
        self._turn = itertools.count()
        self._last: dict[str, int] = {}  # replica -> the turn it was last chosen

    def choose(self, candidates: Sequence[str], loads: dict[str, int], preferred: str | None) -> str | None:
        if not candidates:
            return None
        turn = next(self._turn)
        if self.policy == "round_robin":
            return candidates[turn % len(candidates)]
        lowest = min(loads.get(r, 0) for r in candidates)
        if preferred in candidates and loads.get(preferred, 0) - lowest <= self.max_imbalance:
            choice = preferred
        else:
            choice = min(candidates, key=lambda r: (loads.get(r, 0), self._last.get(r, -1)))
        self._last[choice] = turn
        if len(self._last) > 4 * len(candidates):  # replicas come and go: keep the live ones
            self._last = {r: self._last[r] for r in candidates if r in self._last}
        return choice


def preferred_of(pending: PendingRequest | None) -> str | None:
    """The replica the ingress prefers for the request: its call's ``prefer`` keyword (a plain string, since the
    router may hold another copy of this module's classes than the ingress)."""
    prefer: Any = pending.kwargs.get("prefer") if pending is not None else None
    return prefer if isinstance(prefer, str) else None


class PrefixAwareRouter(RequestRouter):
    """``Balancer`` over Ray Serve's replicas. Loads are the requests each replica has in flight, from Serve's own
    queue-length cache (counted up when a request is sent, down when it completes). One replica is returned: it is
    the one used."""

    def initialize_state(self, policy: str = "prefix", max_imbalance: int = 4, **kwargs: Any) -> None:
        self.balancer = Balancer(policy, max_imbalance)

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        cache = self.replica_queue_len_cache
        loads = {rid: cache.get(r.replica_id) or 0 for rid, r in by_id.items()}
        choice = self.balancer.choose(list(by_id), loads, preferred_of(pending_request))
        return [[by_id[choice]]] if choice is not None else []
