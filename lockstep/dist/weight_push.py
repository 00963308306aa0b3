"""Weight push trainer -> engines over torch.distributed: header, buckets, two-phase commit.

Every rank of the world calls `push_weights(ctx, manifest, version, named_tensors=..., engine=...)`
at the same point of the loop (trainer ranks pass `Trainer.named_weights()`, engine ranks their
`Engine`; a colocated rank passes both). One push:

1. Engines pause (the current step finishes) and CUDA work drains (a broadcast racing in-flight
   kernels hung sglang#22620).
2. Header on the gloo control group: every rank all-gathers each rank's [version, manifest hash,
   manifest length], the trainer source rank's row the header. Any rank whose own manifest hash
   differs makes every rank raise `ManifestMismatch` naming the first differing tensor, both
   sides' view of it.
3. Buckets on the weight group: the source packs each bucket's tensors (cast to the manifest's
   wire dtype, a no-op for the trainer's own dtype) into one flat uint8 buffer and broadcasts it;
   two buckets are in flight at once (packing bucket i+1 overlaps broadcasting bucket i). Every
   trainer rank takes the bucket's tensors from its iterator at the same point, so FSDP's gathers
   inside `named_weights()` stay in step. Engines keep each bucket's tensors as views of it and run
   `engine.weight_update.validate_update` on them: this is the staging (after the last bucket the
   parts are joined into one `ValidatedUpdate`, its names checked across buckets, so a tensor no
   bucket held fails the vote too). Where every rank is on one host, two transports replace the
   broadcast (push_transport.py; auto picks "mapped" where the weight group is gloo: ranks sharing
   a GPU, or CPU ranks): "shared" (shared_buckets.py), the source packs every bucket into shared
   memory (CUDA IPC on a GPU) and broadcasts only their handles on the control group, engines
   stage views of the mappings; "mapped" (mapped_weights.py), the source packs nothing and offers
   handles to its own tensors, engines stage the mapped tensors (where nothing is new, with no
   offer at all: _Stream._run_mapped). A pool passed in (push_transport.new_pool) keeps the
   buckets, exports and mappings for the next push.
4. Commit vote on the control group: every rank reports whether it staged (or packed) everything.
   Only if all did does each engine call `Engine.update_weights(staged, version)`, which
   re-quantises to its serving format in place (without checking the staged values again) and
   flushes its caches; otherwise every rank keeps
   the old version and raises `WeightPushError` naming the failed ranks. A sender that fails
   mid-push keeps broadcasting zero buckets, so the others reach the vote instead of a timeout.
5. Staged views are dropped; with the shared transport and a pool made for this push, engines
   unmap and the source frees its buckets after a barrier (every engine has written); a kept pool
   keeps them. A mapped push always ends at that barrier: until every engine has written, the
   trainer must not change its tensors. Engines resume (in `finally`: a failed push never
   leaves an engine paused, slime#2371).

A dead or hung peer surfaces as `DistributedError` (groups.collective) naming rank and step.
Staging holds one extra copy of the pushed weights on each engine (the received buckets; with the
shared transport on the source instead; the mapped transport holds none); engines whose memory
cannot hold it need the KV cache freed first (sglang#8076) -- not done yet.
"""

from __future__ import annotations

import contextlib
import pickle
import time
from typing import Iterator

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from lockstep.dist.groups import DistContext, DistributedError
from lockstep.dist.manifest import Bucket, Manifest, ManifestMismatch
from lockstep.dist.mapped_weights import MappedWeights
from lockstep.dist.push_transport import new_pool, pool_type, resolve_transport
from lockstep.dist.shared_buckets import BucketPool
from lockstep.engine.weight_update import ValidatedUpdate, check_version, validate_update
from lockstep.train.data_parallel import gather_full


class WeightPushError(RuntimeError):
    """A push was voted down (some rank failed to pack or stage); every engine kept its old version."""


def _drain(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@contextlib.contextmanager
def _paused(engine, device: torch.device):
    was_paused = engine is None or engine.paused
    if engine is not None:
        engine.pause()
    _drain(device)
    try:
        yield
    finally:
        if not was_paused:
            engine.resume()


# ---- header and manifest agreement ---------------------------------------------------------

def _header(ctx: DistContext, manifest: Manifest, version: int | None, op: str) -> tuple[tuple[int, int, int], bool]:
    """The source's (version, hash, manifest length), and whether every rank's manifest hash is the
    source's: every rank learns both from one all-gather of each rank's own (version, hash, length)
    on the control group (which holds every rank, in order)."""
    mine = torch.tensor([version if version is not None else -1, manifest.hash, len(manifest.to_bytes())],
                        dtype=torch.int64)
    rows = [torch.empty_like(mine) for _ in range(ctx.world_size)]
    with ctx.collective(f"{op}: header"):
        dist.all_gather(rows, mine, group=ctx.control_group)
    source = tuple(int(x) for x in rows[ctx.weight_src].tolist())
    return source, all(int(row[1]) == source[1] for row in rows)


def _mismatch_report(ctx: DistContext, mine: Manifest, length: int, op: str) -> str:
    """Ship the source's manifest to every rank; each names its first difference; all agree on one."""
    body = torch.frombuffer(bytearray(mine.to_bytes()), dtype=torch.uint8) if ctx.rank == ctx.weight_src \
        else torch.empty(length, dtype=torch.uint8)
    with ctx.collective(f"{op}: manifest broadcast"):
        dist.broadcast(body, src=ctx.weight_src, group=ctx.control_group)
    theirs = Manifest.from_bytes(body.numpy().tobytes())
    i = theirs.first_difference(mine)
    finding = None
    if i is not None:
        finding = (i, ctx.rank, theirs.describe(i), mine.describe(i))
    elif theirs.bucket_bytes != mine.bucket_bytes:
        finding = (len(mine.entries), ctx.rank, f"bucket_bytes {theirs.bucket_bytes}", f"bucket_bytes {mine.bucket_bytes}")
    found = [None] * ctx.world_size
    with ctx.collective(f"{op}: manifest mismatch report"):
        dist.all_gather_object(found, finding, group=ctx.control_group)
    found = [f for f in found if f is not None]
    if not found:  # equal lists but different hashes: a bug in the hash, not in a model
        return f"rank {ctx.rank}: {op}: manifest hashes differ but no entry does"
    i, rank, sent, expected = min(found)
    return (f"rank {ctx.rank}: {op}: manifest mismatch at tensor #{i}: the trainer (rank {ctx.weight_src}) "
            f"sends {sent}, rank {rank} expects {expected}")


def _check_manifest(ctx: DistContext, manifest: Manifest, expected_version: int | None,
                    header: tuple[int, int, int], same_hash: bool, op: str) -> None:
    sent_version, _, length = header
    if not same_hash:  # every rank knows it: all take part in the report
        raise ManifestMismatch(_mismatch_report(ctx, manifest, length, op))
    if expected_version is not None and sent_version != expected_version:
        raise WeightPushError(f"rank {ctx.rank}: {op}: the trainer pushes version {sent_version}, this rank "
                              f"expected {expected_version} (the loop is out of step)")


# ---- buckets ---------------------------------------------------------------------------------

def _views(manifest: Manifest, bucket: Bucket, buf: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    out = []
    for spec, at in zip(manifest.entries[bucket.start:bucket.stop], bucket.offsets):
        out.append((spec.name, buf[at:at + spec.nbytes].view(spec.torch_dtype).view(spec.shape)))
    return out


def _take(tensors: Iterator, manifest: Manifest, bucket: Bucket, rank: int, op: str) -> list[torch.Tensor]:
    """The bucket's tensors from the trainer's iterator, checked against the manifest by name and shape.
    A sharded DTensor (FSDP) is gathered here: every trainer rank takes the same tensor at this point."""
    out = []
    for spec in manifest.entries[bucket.start:bucket.stop]:
        name, t = next(tensors, (None, None))
        if isinstance(t, DTensor):
            t = gather_full(t)
        if name != spec.name or tuple(t.shape) != spec.shape:
            got = "the end of named_weights()" if name is None else f"{name} {list(t.shape)}"
            raise ManifestMismatch(f"rank {rank}: {op}: the trainer's tensor #{manifest.entries.index(spec)} is "
                                   f"{got}, its manifest says {spec}")
        out.append(t)
    return out


def _pack(tensors: list[torch.Tensor], views: list[tuple[str, torch.Tensor]]) -> None:
    """A bucket's tensors into its buffer's views (_views). The buffer was zeroed when allocated: the
    alignment gaps between tensors, never written, do not depend on the allocator."""
    # one multi-tensor copy (it casts to the wire dtype as copy_ does): a copy per tensor is a launch each
    torch._foreach_copy_([view for _, view in views], [t.detach() for t in tensors])


def _engine_share(engine, pairs: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    """What the engine keeps of the pushed tensors: everything, or on an expert-parallel engine its
    experts' slices of the full expert tensors (engine_expert_parallel.py `local_tensors`); staged and
    validated as such, so the vote covers what the engine will write."""
    local = getattr(engine, "local_tensors", None)
    return local(pairs) if local is not None else pairs


class _Stream:
    """One rank's side of the bucket transfers; remembers the first local failure instead of
    stopping, so the collectives of every rank stay matched up to the vote.

    transport "broadcast": each bucket broadcast on the weight group, two in flight (packing bucket
    i + 1 overlaps broadcasting bucket i); "shared" (shared_buckets.py, one host): the source packs
    every bucket into shared memory and broadcasts their handles on the control group, engines stage
    mapped views; "mapped" (mapped_weights.py, one host): engines stage the source's own tensors,
    mapped; `pool` holds the buckets, exports and mappings (None: a pool for this push alone)."""

    def __init__(self, ctx: DistContext, manifest: Manifest, named_tensors, engine, device, version: int, op: str,
                 transport: str, pool: BucketPool | MappedWeights | None = None):
        self.ctx, self.manifest, self.engine, self.device, self.op = ctx, manifest, engine, device, op
        self.transport = transport
        self.pool, self.owns_pool = pool or new_pool(transport), pool is None
        kind = pool_type(transport)
        if type(self.pool) is not kind:
            raise ValueError(f"rank {ctx.rank}: {op}: the {transport} transport keeps a {kind.__name__}, "
                             f"got a {type(self.pool).__name__}")
        self.tensors = iter(named_tensors) if named_tensors is not None else None
        self.parts: list[ValidatedUpdate] = []  # each staged bucket's pairs
        self.staged: ValidatedUpdate | None = None  # the parts joined once every bucket is staged
        self.error: BaseException | None = None
        self.voted: list[int] | None = None  # the failed ranks, where the transport held the commit vote
        self.targets = engine.update_targets() if engine is not None else None  # every bucket's checks
        if engine is not None:
            try:  # a stale version is a staging failure: voted on, not discovered after the vote
                check_version(engine.weight_version, version, partial=False)
            except ValueError as e:
                self.error = e

    def source_tensors(self, bucket: Bucket) -> list[torch.Tensor] | None:
        """Take the bucket from the iterator (every trainer rank); None once this rank has failed."""
        if self.tensors is None or self.error is not None:
            return None
        try:
            return _take(self.tensors, self.manifest, bucket, self.ctx.rank, self.op)
        except DistributedError:
            raise  # a trainer peer is gone: there is no one to vote with
        except (ManifestMismatch, RuntimeError) as e:  # e.g. a trainer whose weights are not the manifest's
            self.error = e
            return None

    def stage(self, views: list[tuple[str, torch.Tensor]]) -> None:
        """Validate an engine's share of received tensors (views of the bytes of a bucket, or of all)."""
        if self.engine is None or self.error is not None:
            return
        self.keep(self.validated(views))

    def validated(self, views: list[tuple[str, torch.Tensor]]) -> ValidatedUpdate | ValueError:
        """The engine's share of `views` validated, or the reason it is not (nothing kept yet): a
        bucket as a partial update; the one-host transports' views, which hold every tensor at once,
        as the whole update (no join and no second pass over the names)."""
        try:
            return validate_update(self.engine.model, _engine_share(self.engine, views),
                                   partial=self.transport == "broadcast", targets=self.targets)
        except ValueError as e:
            return e

    def keep(self, outcome: ValidatedUpdate | ValueError) -> None:
        if isinstance(outcome, ValueError):
            self.error = outcome
        else:
            self.parts.append(outcome)

    def run(self) -> None:
        if self.transport == "shared":
            self._run_shared()
        elif self.transport == "mapped":
            self._run_mapped()
        else:
            self._run_broadcast()
        if self.engine is not None and self.error is None:
            try:  # the whole update's names (a tensor no bucket held): before the vote, as a staging failure
                whole = len(self.parts) == 1 and not self.parts[0].partial
                self.staged = self.parts[0] if whole else ValidatedUpdate.joined(self.parts, partial=False)
            except ValueError as e:
                self.error = e

    def _run_broadcast(self) -> None:
        n = len(self.manifest.buckets)
        in_flight = None  # (work, buffer, index): bucket i's broadcast overlaps packing bucket i + 1
        for b, bucket in enumerate(self.manifest.buckets):
            tensors = self.source_tensors(bucket)
            if self.ctx.weight_group is None:
                continue  # a trainer rank that is not the source: it only kept its gathers in step
            if self.ctx.rank == self.ctx.weight_src:  # failed earlier: zeros keep the receivers in step
                buf = torch.zeros(bucket.nbytes, dtype=torch.uint8, device=self.device)
                if tensors is not None:
                    _pack(tensors, _views(self.manifest, bucket, buf))
            else:
                buf = torch.empty(bucket.nbytes, dtype=torch.uint8, device=self.device)
            with self.ctx.collective(f"{self.op}: broadcast bucket {b + 1}/{n} ({bucket.nbytes} bytes)"):
                work = dist.broadcast(buf, src=self.ctx.weight_src, group=self.ctx.weight_group, async_op=True)
            self._finish(in_flight, n)
            in_flight = (work, buf, b)
        self._finish(in_flight, n)

    def _finish(self, in_flight, n: int) -> None:
        if in_flight is None:
            return
        work, buf, b = in_flight
        self.ctx.wait(work, f"{self.op}: broadcast bucket {b + 1}/{n}")
        self.stage(_views(self.manifest, self.manifest.buckets[b], buf))

    def _run_shared(self) -> None:
        buckets, source = self.manifest.buckets, self.ctx.rank == self.ctx.weight_src
        buffers, offer = self._pack_shared() if source else (None, None)
        if not source:
            for bucket in buckets:  # a trainer rank takes each bucket as the source does (FSDP's gathers)
                self.source_tensors(bucket)
        with self.ctx.collective(f"{self.op}: share buckets ({len(buckets)}, {self.manifest.total_bytes} bytes)"):
            dist.broadcast_object_list(box := [offer], src=self.ctx.weight_src, group=self.ctx.control_group)
        if box[0] is None:  # the source failed to pack: nothing to stage, the vote aborts
            return
        handles, unannounced = box[0]
        if not source and self.engine is not None:
            buffers = self.pool.reader_buffers(handles)
        if unannounced:  # new buckets: a CPU segment loses its name once every reader has mapped it
            with self.ctx.collective(f"{self.op}: buckets mapped"):
                dist.barrier(group=self.ctx.control_group)
            if source:
                self.pool.mapped_everywhere()
        if buffers is not None and self.engine is not None:  # every bucket at once: one finiteness read
            self.stage([pair for b, bucket in enumerate(buckets) for pair in self._bucket_views(b, bucket, buffers[b])])

    def _bucket_views(self, b: int, bucket: Bucket, buf: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        return self.pool.views((self.manifest.hash, b), lambda: _views(self.manifest, bucket, buf))

    def _run_mapped(self) -> None:
        """The source offers handles to its own tensors (mapped_weights.py), engines stage the mapped
        tensors themselves: nothing is packed. Where nothing is new -- every engine holds mappings of
        the source's current exports, and the source wrote none of them since the header (a cast
        into a kept buffer, MappedWeights.wire, is such a write) -- the push needs no offer: an
        engine validates what it mapped at an earlier push as soon as the header is past (the
        source's tensors are final then; its reads overlap the source's walk of its tensors) and the
        first vote (`_ballots`) is the commit vote. Otherwise some rank votes NOT_READY and a second
        round follows: the source broadcasts its handles, every engine maps and validates anew, and
        push_weights holds the commit vote."""
        source, names = self.ctx.rank == self.ctx.weight_src, [spec.name for spec in self.manifest.entries]
        early = None
        if not source and self.engine is not None and self.error is None and self.pool.mapped():
            early = self.validated(list(zip(names, self.pool.reader_tensors(None))))
        tensors = []
        for bucket in self.manifest.buckets:  # every trainer rank takes each bucket (FSDP's gathers)
            taken = self.source_tensors(bucket)
            if source and taken is not None:
                tensors += taken
        ballot = STAGED
        if source and self.error is None:
            try:
                wire, rewritten = self.pool.wire(tensors, [spec.torch_dtype for spec in self.manifest.entries])
                if self.pool.offer(wire) is not None or rewritten:
                    ballot = NOT_READY
                self.stage(list(zip(names, wire)))  # an engine on the source rank (colocated): its own tensors
            except (RuntimeError, ValueError) as e:
                self.error = e
        elif self.engine is not None and not source and self.error is None:
            ballot = NOT_READY if early is None else FAILED if isinstance(early, ValueError) else STAGED
        ballots = _ballots(self.ctx, FAILED if self.error is not None else ballot, self.op)
        if NOT_READY not in ballots:  # nothing new: the engines' early validation stands
            if early is not None:
                self.keep(early)
            self.voted = [r for r, b in enumerate(ballots) if b == FAILED]
            return
        op = f"{self.op}: map weights ({len(names)} tensors, {self.manifest.total_bytes} bytes)"
        ok, handles = _offer(self.ctx, not (source and self.error is not None),
                             self.pool.handles() if source and self.error is None else None, op)
        if not ok or self.engine is None or self.error is not None or source:
            return  # a failed source: nothing to stage, the commit vote aborts
        try:
            mapped = self.pool.reader_tensors(handles)
        except (RuntimeError, ValueError) as e:
            self.error = e
            return
        self.stage(list(zip(names, mapped)))

    def _pack_shared(self) -> tuple[list[torch.Tensor], tuple[list[tuple], bool] | None]:
        """The source packs every bucket into its pool's buffers, taking each bucket's tensors from the
        iterator as the other trainer ranks do: (the buffers, the offer to broadcast, BucketPool.offer,
        or None where taking a bucket failed)."""
        buffers = self.pool.source_buffers([b.nbytes for b in self.manifest.buckets], self.device)
        for b, bucket in enumerate(self.manifest.buckets):
            tensors = self.source_tensors(bucket)
            if tensors is not None:
                _pack(tensors, self._bucket_views(b, bucket, buffers[b]))
        if self.error is not None:
            return buffers, None
        _drain(self.device)  # packed before any reader stages (reads) it
        return buffers, self.pool.offer()

    def release(self, every_rank_here: bool) -> None:
        """Drop the staged views; a pool made for this push is freed: readers unmap, then the source
        frees its buckets once every rank has (`every_rank_here`: a barrier first; after a failed
        collective the peers are not waited for). A mapped push always ends at that barrier: the
        engines read the trainer's live memory, which the trainer may change once push_weights returns."""
        self.parts, self.staged = [], None
        mapped = self.transport == "mapped"
        if self.owns_pool:
            self.pool.unmap()
        if every_rank_here and (mapped or (self.owns_pool and self.transport == "shared")):
            what = "engines read the mapped weights" if mapped else "release shared buckets"
            self.ctx.barrier(f"{self.op}: {what}")
        if self.owns_pool:
            self.pool.free()


def _offer(ctx: DistContext, ok: bool, payload, op: str) -> tuple[bool, object]:
    """The source's (ok, payload) on every rank: one broadcast of two integers on the control group,
    and a second of the payload's pickle where there is one. (broadcast_object_list pays three
    collectives: ~0.6 ms on 2 CPU cores, where one is ~0.2.)"""
    source = ctx.rank == ctx.weight_src
    body = pickle.dumps(payload) if source and payload is not None else b""
    head = torch.tensor([int(ok), len(body)] if source else [0, 0], dtype=torch.int64)
    with ctx.collective(op):
        dist.broadcast(head, src=ctx.weight_src, group=ctx.control_group)
        ok, length = bool(head[0]), int(head[1])
        if not length:
            return ok, None
        data = (torch.frombuffer(bytearray(body), dtype=torch.uint8) if source
                else torch.empty(length, dtype=torch.uint8))
        dist.broadcast(data, src=ctx.weight_src, group=ctx.control_group)
    return ok, payload if source else pickle.loads(data.numpy().tobytes())


# ---- commit ----------------------------------------------------------------------------------

# a rank's ballot: it packed or staged everything; it failed; (a mapped push's first vote only) it
# is not ready: the source has new handles or rewrote a cast, or an engine has nothing mapped yet
STAGED, FAILED, NOT_READY = 0, 1, 2


def _ballots(ctx: DistContext, mine: int, op: str) -> list[int]:
    """Every rank's ballot, in rank order (every rank learns the same list)."""
    flags = [torch.zeros(1, dtype=torch.int32) for _ in range(ctx.world_size)]
    with ctx.collective(f"{op}: commit vote"):
        dist.all_gather(flags, torch.tensor([mine], dtype=torch.int32), group=ctx.control_group)
    return [int(f.item()) for f in flags]


def _vote(ctx: DistContext, error: BaseException | None, op: str) -> list[int]:
    """Ranks that failed to pack or stage (every rank learns the same list)."""
    ballots = _ballots(ctx, FAILED if error is not None else STAGED, op)
    return [r for r, b in enumerate(ballots) if b == FAILED]


# the push's phases, as push_weights times them on each rank: the header and manifest agreement;
# packing, moving and staging the buckets; the commit vote (a mapped push where nothing is new holds
# it at the end of its transfer); the engine's write (Engine.update_weights,
# and the wait for its device work); dropping the buckets (with the shared transport, a barrier)
PHASES = ("agree", "transfer", "vote", "write", "release")


def push_weights(ctx: DistContext, manifest: Manifest, version: int | None, *, named_tensors=None, engine=None,
                 device: torch.device | None = None, transport: str = "auto",
                 pool: BucketPool | MappedWeights | None = None) -> dict[str, float]:
    """One push (module docstring), called on every rank. The source rank must pass `version` and
    `named_tensors`; engine ranks may pass version None (they take the header's). `transport`:
    broadcast | shared | mapped | auto (push_transport.resolve_transport; every rank passes the same).
    `pool`: what the rank keeps from push to push (push_transport.new_pool(transport); every rank
    passes one, or none does); None: made for this push and freed at its end.
    Returns metrics `perf/weight_sync_time` (s), `perf/weight_sync_bytes` (bytes pushed) and
    `perf/weight_sync/<phase>_time` (s) for each of PHASES on this rank."""
    start = time.perf_counter()
    device = device or ctx.device
    if ctx.rank == ctx.weight_src and (named_tensors is None or version is None):
        raise ValueError(f"rank {ctx.rank}: push_weights on the trainer source rank needs named_tensors and version")
    if ctx.is_engine and engine is None:
        raise ValueError(f"rank {ctx.rank}: push_weights on an engine rank needs its engine")
    with _paused(engine, device):
        header, same_hash = _header(ctx, manifest, version,
                                    "weight push" if version is None else f"weight push v{version}")
        op = f"weight push v{header[0]}"
        _check_manifest(ctx, manifest, version, header, same_hash, op)
        version = header[0]
        stream = _Stream(ctx, manifest, named_tensors, engine, device, version, op, resolve_transport(ctx, transport),
                         pool)
        every_rank_here, update_error = False, None
        clock = [time.perf_counter()]  # the phases' ends: agreed, transferred, voted, written, released
        try:
            stream.run()
            clock.append(time.perf_counter())
            failed = stream.voted if stream.voted is not None else _vote(ctx, stream.error, op)
            clock.append(time.perf_counter())
            if not failed and engine is not None:
                try:  # every rank is past the vote: a local failure here still meets the others at release
                    engine.update_weights(stream.staged, version)
                except Exception as e:
                    update_error = e
            _drain(device)
            clock.append(time.perf_counter())
            every_rank_here = True
        finally:
            stream.release(every_rank_here)
            clock.append(time.perf_counter())
        if update_error is not None:
            raise update_error
        if failed:
            mine = f"this rank: {stream.error}" if stream.error is not None else "this rank staged everything"
            kept = f"; engines keep version {engine.weight_version}" if engine is not None else ""
            raise WeightPushError(f"rank {ctx.rank}: {op} aborted, rank(s) {failed} failed to pack or stage "
                                  f"({mine}){kept}") from stream.error
    pushed = manifest.total_bytes if ctx.weight_group is not None else 0
    return {"perf/weight_sync_time": time.perf_counter() - start, "perf/weight_sync_bytes": float(pushed),
            **{f"perf/weight_sync/{phase}_time": b - a for phase, a, b in zip(PHASES, [start, *clock], clock)}}

