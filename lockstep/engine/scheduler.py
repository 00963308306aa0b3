"""Continuous batching with chunked prefill and preemption by recompute.

Every step the scheduler picks which sequences run and how many new tokens each feeds:
1. running sequences, oldest first: a decoding one feeds its one new token; one still in
   prefill feeds a chunk of its prompt (at most `max_prefill_tokens` prompt tokens per step
   over all sequences). If the cache cannot grow to hold them, the newest running sequence
   is preempted (its memory freed, itself re-queued at the front with prompt + generated
   tokens, to be recomputed by a later prefill), until the older one fits;
2. waiting sequences are admitted in arrival order while the prefill budget, `max_num_seqs`
   and cache memory last. A leader whose siblings are parked on it is admitted only when
   their fork memory is free too (or could never be: then they prefill on their own later).

With `batch_invariant`, prefill chunks start at multiples of `max_prefill_tokens` whatever
else is scheduled, so a sequence is always cut into the same chunks (the runner then also
runs every sequence on its own).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from lockstep.engine.kv_cache import CacheManager
from lockstep.engine.request import Sequence, SequenceStatus


@dataclass
class SchedulerOutput:
    scheduled: list[tuple[Sequence, int]] = field(default_factory=list)  # (sequence, num_new tokens)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)


class Scheduler:
    def __init__(self, cache: CacheManager, max_num_seqs: int, max_prefill_tokens: int,
                 batch_invariant: bool = False):
        self.cache = cache
        self.max_num_seqs, self.max_prefill_tokens = max_num_seqs, max_prefill_tokens
        self.batch_invariant = batch_invariant
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order: the tail is preempted first

    # ---- queue ---------------------------------------------------------------------------

    def add(self, seqs: list[Sequence]) -> None:
        """Queue the n samples of one request: sample 0 prefills, the others are parked on it."""
        leader, *siblings = seqs
        for s in siblings:
            s.status = SequenceStatus.PARKED
        leader.parked = list(siblings)
        self.waiting.append(leader)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def can_admit(self) -> bool:
        """Whether a waiting sequence could join the running batch now (prefill budget aside)."""
        return bool(self.waiting) and len(self.running) < self.max_num_seqs

    def remove(self, seqs: list[Sequence]) -> None:
        """Take seqs out of every queue and give their memory back (finish or abort); call it before
        they are marked finished, their status says where they are. Each queue is filtered once at
        most, so aborting a request of n samples costs O(n + queue length): removing them one at a
        time cost O(n * (queue + parked)) (2.8 s at n = 5,000, 31 s at 20,000, issue 15)."""
        gone = set(seqs)
        where = {s.status for s in seqs}
        if SequenceStatus.RUNNING in where:
            self.running[:] = [s for s in self.running if s not in gone]
        if SequenceStatus.WAITING in where:
            kept = [s for s in self.waiting if s not in gone]
            self.waiting.clear()
            self.waiting.extend(kept)
        if SequenceStatus.PARKED in where:  # siblings park on their request's sample 0 (see add)
            for leader in {s.group.sequences[0] for s in seqs if s.status is SequenceStatus.PARKED}:
                leader.parked = [s for s in leader.parked if s not in gone]
        for s in seqs:
            self.cache.free(s)

    # ---- one step ------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self._schedule_running(out, self.max_prefill_tokens)
        if not out.preempted:  # memory just ran out: admitting now would only preempt again
            self._admit_waiting(out, budget)
        return out

    @staticmethod
    def _is_decode(seq: Sequence) -> bool:
        # one token left to feed after others were fed; a recompute after preemption is a prefill
        return seq.num_uncomputed == 1 and seq.num_computed > 0

    def _chunk(self, seq: Sequence, budget: int) -> int:
        """New tokens seq may feed now; 0: not this step."""
        if self._is_decode(seq):
            return 1
        if self.batch_invariant:
            c = self.max_prefill_tokens
            n = min(seq.num_uncomputed, c - seq.num_computed % c)
            return n if n <= budget else 0
        return min(seq.num_uncomputed, budget)

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        for seq in list(self.running):
            if seq not in self.running:  # preempted below to make room for an older one
                continue
            n = self._chunk(seq, budget)
            if n == 0:
                continue
            if not self._make_room(seq, seq.num_computed + n, out):
                continue
            self.cache.allocate(seq, seq.num_computed + n)
            out.scheduled.append((seq, n))
            if not self._is_decode(seq):
                budget -= n
        return budget

    def _make_room(self, seq: Sequence, num_tokens: int, out: SchedulerOutput) -> bool:
        """Preempt newest running sequences until seq fits; False if seq itself had to go."""
        while not self.cache.can_allocate(seq, num_tokens):
            victim = self.running[-1]
            self._preempt(victim, out)
            if victim is seq:
                return False
        return True

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        out.scheduled = [(s, n) for s, n in out.scheduled if s is not seq]
        self.running.remove(seq)
        self.cache.free(seq)
        seq.num_computed = 0
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        out.preempted.append(seq)

    def _admit_waiting(self, out: SchedulerOutput, budget: int) -> None:
        while budget > 0 and self.can_admit():
            seq = self.waiting[0]
            n = self._chunk(seq, budget)
            if n == 0 or not self._fits_with_siblings(seq, n):
                break
            self.waiting.popleft()
            self.cache.allocate(seq, n)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.scheduled.append((seq, n))
            budget -= n

    def _fits_with_siblings(self, seq: Sequence, n: int) -> bool:
        if not self.cache.can_allocate(seq, seq.num_computed + n):
            return False
        if not seq.parked:
            return True
        forks = self.cache.fork_cost() * len(seq.parked)
        if forks + 1 > self.cache.num_blocks or len(seq.parked) + 1 > self.max_num_seqs:
            return True  # the group never fits at once: admit the leader, siblings prefill later
        return self.cache.num_free_blocks() >= forks + 1 and len(self.running) + len(seq.parked) < self.max_num_seqs

    # ---- after the forward ---------------------------------------------------------------

    def fork_parked(self, leader: Sequence) -> list[Sequence]:
        """After the leader's prefill: siblings that get memory start from a copy of its cache;
        the others go back to the front of the queue to prefill on their own."""
        forked, left = [], []
        free, cost = self.cache.num_free_blocks(), self.cache.fork_cost()
        for sib in leader.parked:  # room for this one after those before it
            if len(self.running) + len(forked) < self.max_num_seqs and free - cost * len(forked) >= cost:
                forked.append(sib)
            else:
                sib.status = SequenceStatus.WAITING
                left.append(sib)
        for sib in forked:
            sib.num_computed = leader.num_computed
        self.cache.fork(leader, forked)  # all siblings in one copy per cache tensor
        for sib in forked:
            sib.routed = list(leader.routed)
            sib.status = SequenceStatus.RUNNING
            self.running.append(sib)
        leader.parked = []
        self.waiting.extendleft(reversed(left))
        return forked

    def preempt_all(self) -> list[Sequence]:
        """Every running sequence back to the queue (their cached state is stale, e.g. new weights)."""
        out = SchedulerOutput()
        for seq in reversed(list(self.running)):
            self._preempt(seq, out)
        return out.preempted
