"""The greedy plan: a quick valid placement, the CP-SAT hint and the fallback when the solver
finds nothing in time; packing pooled TP groups onto named nodes; and polishing a plan so
that jobs stay where they are unless moving pays."""

from __future__ import annotations

import heapq
from collections.abc import Mapping

from services.planner import domain, dp, teams
from services.planner.problem import (
    JobData,
    Placement,
    Problem,
    per_slot,
)


class FreeSlots:
    """Free slots per healthy node, bucketed by how many are free, for best-fit choices in time
    independent of the node count."""

    def __init__(self, data: Problem, placement: Mapping[str, Mapping[str, int]]) -> None:
        self.names = [n.node_id for n in data.healthy]
        self.index = {n: i for i, n in enumerate(self.names)}
        self.free = [n.slots for n in data.healthy]
        for slots in placement.values():
            for n, s in slots.items():
                self.free[self.index[n]] -= s
        self.count: dict[int, int] = {}
        self.buckets: dict[int, list[int]] = {}
        for i, c in enumerate(self.free):
            self._add(i, c)

    def _add(self, i: int, c: int) -> None:
        if c > 0:
            self.count[c] = self.count.get(c, 0) + 1
            heapq.heappush(self.buckets.setdefault(c, []), i)

    def overfull(self) -> bool:
        return any(c < 0 for c in self.free)

    def room(self, tp: int) -> int:
        """How many groups of ``tp`` slots still fit, over all nodes."""
        return sum(k * (c // tp) for c, k in self.count.items())

    def take(self, node_id: str, slots: int) -> None:
        i = self.index[node_id]
        c = self.free[i]
        if c > 0:
            self.count[c] -= 1  # its bucket entry goes stale; pick() skips it
        self.free[i] = c - slots
        self._add(i, c - slots)

    def pick(self, tp: int, groups: int) -> tuple[str, int] | None:
        """A node for up to ``groups`` groups of ``tp`` slots: the fullest that takes them all,
        else the emptiest; ties to the first in request order. Returns (node, groups it takes)."""
        sizes = sorted(c for c, k in self.count.items() if k > 0 and c >= tp)
        if not sizes:
            return None
        fits = [c for c in sizes if c // tp >= groups]
        c = fits[0] if fits else sizes[-1]
        heap = self.buckets[c]
        while self.free[heap[0]] != c:  # stale entries
            heapq.heappop(heap)
        return self.names[heap[0]], min(groups, c // tp)


def place(free: FreeSlots, slots: dict[str, int], tp: int, groups: int, first: list[str]) -> bool:
    """Adds ``groups`` TP groups to ``slots``: on the nodes in ``first`` while they have room, then
    best fit. False (and ``slots`` partly filled) when they do not all fit."""
    for n in first:
        take = min(groups, free.free[free.index[n]] // tp)
        if take:
            slots[n] = slots.get(n, 0) + take * tp
            free.take(n, take * tp)
            groups -= take
    while groups:
        chosen = free.pick(tp, groups)
        if chosen is None:
            return False
        n, take = chosen
        slots[n] = slots.get(n, 0) + take * tp
        free.take(n, take * tp)
        groups -= take
    return True


def pack(data: Problem, own: Placement, pool: Mapping[str, int]) -> Placement | None:
    """Node names for the pooled groups beside the own ones: largest TP first (which always
    succeeds when the TP degrees form a chain and the level inequalities hold), each job best
    fit. None when they do not fit."""
    placement = {jid: dict(slots) for jid, slots in own.items()}
    free = FreeSlots(data, placement)
    if free.overfull():
        return None
    order = sorted((jd for jd in data.jobs if pool[jd.job.job_id] > 0), key=lambda jd: (-jd.tp, -pool[jd.job.job_id]))
    for jd in order:
        if not place(free, placement[jd.job.job_id], jd.tp, pool[jd.job.job_id], []):
            return None
    return placement


def greedy_plan(data: Problem, targets: Mapping[str, int] | None = None) -> Placement:
    """A quick valid plan, to hint the solver with and to fall back on: keep what can be kept
    (pinned first, then the jobs earning most per slot); shrink jobs that lost a node onto the
    nodes they have left; start non-preemptible jobs at their minimum size; then, one step at a
    time, grow the job and size with the best gain per added slot (onto its own nodes first,
    then best fit), within the changed-jobs cap.

    With ``targets`` (job -> size, say the size-only optimum), a job is kept only at its target
    size, shrunk no further than it, and grown towards it (largest TP first) before the
    step-by-step growth fills what is left."""
    greedy = _Greedy(data, targets)
    greedy.keep()
    greedy.shrink_onto_own_nodes()
    greedy.start_non_preemptible()
    if targets is not None:
        greedy.grow_to_targets()
    greedy.grow_step_by_step()
    return greedy.placement


class _Greedy:
    """The greedy plan as it is built: the placement so far, the free slots, and how many
    jobs it has changed (against the cap)."""

    def __init__(self, data: Problem, targets: Mapping[str, int] | None) -> None:
        self.data, self.targets = data, targets
        self.horizon = data.horizon
        self.placement: Placement = {jd.job.job_id: {} for jd in data.jobs}
        self.free = FreeSlots(data, self.placement)
        self.cap = data.request.max_changed_jobs
        self.changes = 0
        # Slots each limited team may still take (teams.py).
        self.team_room = dict(data.request.team_limits)
        self.pool_slots = sum(node.slots for node in data.healthy)
        # Each guaranteed team takes max(its slots, its reserve) of the pool (teams.py).
        self.reserved = teams.reserves(data.request, self.pool_slots)
        self.team_used = dict.fromkeys(self.reserved, 0)
        self.loose_used = 0  # slots of the jobs outside guaranteed teams

    def target(self, jd: JobData) -> int | None:
        return None if self.targets is None or jd.job.pinned else self.targets.get(jd.job.job_id)

    def unchanged(self, jd: JobData) -> bool:
        return not jd.forced and not domain.is_changed(jd.job, self.placement[jd.job.job_id])

    def capped(self, jd: JobData) -> bool:
        """Whether changing ``jd`` (not changed yet) would pass the changed-jobs cap."""
        return self.cap is not None and self.changes >= self.cap and self.unchanged(jd)

    def room_of_team(self, jd: JobData) -> int:
        """Slots ``jd`` may add within its team's limit and the teams' reserves."""
        taken = self.loose_used + sum(max(self.team_used[t], r) for t, r in self.reserved.items())
        headroom = self.pool_slots - taken
        team = jd.job.team
        if team in self.reserved:
            headroom += max(0, self.reserved[team] - self.team_used[team])
        return min(self.team_room.get(team, self.pool_slots), headroom)

    def assign(self, jd: JobData, slots: dict[str, int]) -> None:
        was = self.unchanged(jd)
        grows = sum(slots.values()) - sum(self.placement[jd.job.job_id].values())
        if jd.job.team in self.team_room:
            self.team_room[jd.job.team] -= grows
        if jd.job.team in self.team_used:
            self.team_used[jd.job.team] += grows
        else:
            self.loose_used += grows
        self.placement[jd.job.job_id] = slots
        if was and not self.unchanged(jd):
            self.changes += 1

    def keep(self) -> None:
        free = self.free
        keepers = [jd for jd in self.data.jobs if jd.in_place]
        keepers.sort(key=lambda jd: (not jd.job.pinned, -per_slot(jd.job, jd.job.current_size)))
        for jd in keepers:
            job = jd.job
            if self.target(jd) not in (None, job.current_size):
                continue
            if job.current_size > self.room_of_team(jd):
                continue
            if job.pinned or not job.preemptible or domain.job_value(job, job.current, self.horizon) > 0:
                if all(free.free[free.index[n]] >= s for n, s in job.current.items()):
                    for n, s in job.current.items():
                        free.take(n, s)
                    self.assign(jd, dict(job.current))

    def shrink_onto_own_nodes(self) -> None:
        """A job that lost a node (or cannot keep for another reason) shrinks onto the nodes
        it has left."""
        free = self.free
        for jd in self.data.jobs:
            job, tp = jd.job, jd.tp
            if job.pinned or self.placement[job.job_id] or not jd.own:
                continue
            held = sum(min(job.current[n], free.free[free.index[n]]) // tp for n in jd.own)
            target = self.target(jd)
            limit = min(tp * held, target or 0) if target is not None else tp * held
            limit = min(limit, self.room_of_team(jd))
            best = max((x for x, v in jd.stay_value.items() if x <= limit and v > 0), default=0)
            need, slots = best // tp, {}
            for n in jd.own:
                take = min(min(job.current[n], free.free[free.index[n]]) // tp, need)
                if take:
                    slots[n] = take * tp
                    free.take(n, take * tp)
                    need -= take
            if slots:
                self.assign(jd, slots)

    def start_non_preemptible(self) -> None:
        for jd in self.data.jobs:
            job = jd.job
            if job.preemptible or job.pinned or self.placement[job.job_id] or not jd.move_value:
                continue
            start = min(jd.move_value) // jd.tp
            if start <= self.free.room(jd.tp) and start * jd.tp <= self.room_of_team(jd):
                slots: dict[str, int] = {}
                place(self.free, slots, jd.tp, start, jd.own)
                self.assign(jd, slots)

    def grow_to_targets(self) -> None:
        for jd in sorted(self.data.jobs, key=lambda jd: (-jd.tp, -(self.target(jd) or 0))):
            want, now = self.target(jd), self.placement[jd.job.job_id]
            size = sum(now.values())
            if not want or want <= size or self.capped(jd):
                continue
            room = self.free.room(jd.tp)
            team = self.room_of_team(jd)
            fits = [x for x in jd.sizes if size < x <= want and (x - size) // jd.tp <= room and x - size <= team]
            if fits:
                slots = dict(now)
                place(self.free, slots, jd.tp, (fits[-1] - size) // jd.tp, jd.own)
                self.assign(jd, slots)

    def _grown_value(self, jd: JobData, now: dict[str, int], groups: int) -> float:
        """The value of ``jd`` grown by ``groups`` TP groups onto its own nodes, as place
        puts them there."""
        grown = dict(now)
        for n in jd.own:
            take = min(groups, self.free.free[self.free.index[n]] // jd.tp)
            if take:
                grown[n] = grown.get(n, 0) + take * jd.tp
                groups -= take
        return domain.job_value(jd.job, grown, self.horizon)

    def best_step(self, jd: JobData) -> tuple[float, int] | None:
        """The growth of ``jd`` with the best gain per added slot: (gain, new size)."""
        job, tp = jd.job, jd.tp
        if job.pinned or self.capped(jd):
            return None
        now = self.placement[job.job_id]
        size = sum(now.values())
        base = domain.job_value(job, now, self.horizon)
        room, own_room = self.free.room(tp), sum(self.free.free[self.free.index[n]] // tp for n in jd.own)
        stays = all(n in job.current for n in now)
        best: tuple[float, int] | None = None
        team = self.room_of_team(jd)
        for x in jd.sizes:
            if x <= size:
                continue
            groups = (x - size) // tp
            if groups > room or x - size > team:
                break
            if stays and groups <= own_room:
                value = self._grown_value(jd, now, groups)
            else:
                value = self.horizon.value(domain.weighted_throughput(job, x), x, job.transition.seconds("migrate"))
            gain = (value - base) / (x - size)
            if gain > 0 and (best is None or gain > best[0]):
                best = (gain, x)
        return best

    def grow_step_by_step(self) -> None:
        """Grows, one step at a time, the job with the best gain per added slot (a heap of the
        jobs' best steps, each checked again when popped: another job's growth may have
        changed it)."""
        heap: list[tuple[float, int, int]] = []
        for i, jd in enumerate(self.data.jobs):
            step = self.best_step(jd)
            if step is not None:
                heap.append((-step[0], i, step[1]))
        heapq.heapify(heap)
        while heap:
            neg_gain, i, x = heapq.heappop(heap)
            jd = self.data.jobs[i]
            step = self.best_step(jd)
            if step is None:
                continue
            if step != (-neg_gain, x):
                heapq.heappush(heap, (-step[0], i, step[1]))
                continue
            slots = dict(self.placement[jd.job.job_id])
            placed = place(self.free, slots, jd.tp, (x - sum(slots.values())) // jd.tp, jd.own)
            assert placed  # room() counted whole groups
            self.assign(jd, slots)
            step = self.best_step(jd)
            if step is not None:
                heapq.heappush(heap, (-step[0], i, step[1]))


# The size-only DP seeds a second greedy plan when its table (jobs x sizes x slots) is at most
# this big: about a quarter of a second.
DP_HINT_MAX_CELLS = 200_000_000


def size_only_targets(data: Problem) -> dict[str, int] | None:
    """The size-only optimum (the paper's DP) as sizes to aim the greedy at, when it is cheap
    and the cap does not apply (the DP knows nothing of it)."""
    request = data.request
    cells = sum(len(jd.sizes) + 1 for jd in data.jobs) * (domain.healthy_slots(request) + 1)
    if request.max_changed_jobs is not None or cells > DP_HINT_MAX_CELLS:
        return None
    result = dp.plan_sizes_dp(request)
    return result.sizes if result.status == "OPTIMAL" else None


def polish(data: Problem, placement: Placement) -> Placement:
    """Puts changed jobs back where they are now when that fits beside the rest of the plan and
    earns at least as much. A search stopped within a gap (or by the time limit) may move a small
    job for nothing; this keeps "jobs stay where they are unless moving them pays" exact."""
    used = dict.fromkeys(data.nodes, 0)
    for slots in placement.values():
        for n, s in slots.items():
            used[n] += s
    out = dict(placement)
    pool = sum(node.slots for node in data.healthy)
    sizes = {job_id: sum(slots.values()) for job_id, slots in out.items()}
    for jd in data.jobs:
        job = jd.job
        new, cur = out[job.job_id], job.current
        if not jd.in_place or job.pinned or new == cur:
            continue
        fits = all(used[n] - new.get(n, 0) + s <= data.nodes[n].slots for n, s in cur.items())
        if fits and (job.team or data.request.team_guarantees):
            after = {**sizes, job.job_id: job.current_size}
            fits = not teams.over_limits(data.request, after) and not teams.over_guarantees(data.request, after, pool)
        if fits and domain.job_value(job, cur, data.horizon) >= domain.job_value(job, new, data.horizon):
            for n, s in new.items():
                used[n] -= s
            for n, s in cur.items():
                used[n] += s
            sizes[job.job_id] = job.current_size
            out[job.job_id] = dict(cur)
    return out
