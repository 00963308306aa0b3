"""The background step loop behind `Engine.start()` / `generate_async`.

Callers in other threads (the HTTP server's asyncio loop, sync `generate`) never touch the
scheduler: they put ("add", RequestState) or ("abort", request_id) on a thread-safe queue and
set a wake-up event. The loop thread drains the queue between steps, steps while there is
work and the engine is not paused, and otherwise sleeps until woken. Finished requests are
handed back through each RequestState's `on_done` callback, called in the loop thread.
"""

from __future__ import annotations

import queue
import threading
import time


class BackgroundLoop:
    def __init__(self, engine):
        self.engine = engine
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._pending: set[str] = set()
        self._pending_lock = threading.Lock()
        self.last_progress = time.monotonic()  # the loop's last step end, or last idle moment

    def stalled_for(self) -> float:
        """Seconds since the loop last finished a step or sat idle: how long work has waited on it
        (a long step, a deadlock). /health turns this into a 503."""
        return time.monotonic() - self.last_progress

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stopping

    def start(self) -> None:
        if self.running:
            return
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="lockstep-engine-loop", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        if self._thread is None:
            return
        self._stopping = True
        self._wake.set()
        self._thread.join()
        self._thread = None
        self._drain()  # what arrived meanwhile is registered, so shutdown can abort it

    def wake(self) -> None:
        self._wake.set()

    def submit(self, state) -> None:
        with self._pending_lock:
            self._pending.add(state.request_id)
        self._inbox.put(("add", state))
        self._wake.set()

    def submit_abort(self, request_id: str | None) -> None:
        """Abort request_id at the next step boundary; None: every request in flight."""
        self._inbox.put(("abort", request_id))
        self._wake.set()

    def pending(self, request_id: str) -> bool:
        with self._pending_lock:
            return request_id in self._pending

    def has_pending(self) -> bool:
        return not self._inbox.empty()

    def _drain(self) -> None:
        """Register what arrived, in order. Consecutive aborts are applied together, in one pass over
        the scheduler's queues: an abort_all of k requests costs O(sequences + queue), not k passes."""
        eng, aborts = self.engine, []
        with eng._lock:
            while True:
                try:
                    kind, item = self._inbox.get_nowait()
                except queue.Empty:
                    break
                if kind == "add":
                    eng._abort_now(aborts)  # before the add: an abort never reaches a later request
                    aborts = []
                    with self._pending_lock:
                        self._pending.discard(item.request_id)
                    eng._add(item)
                else:
                    aborts += list(eng._requests) if item is None else [item]
            eng._abort_now(aborts)

    def _run(self) -> None:
        eng = self.engine
        while not self._stopping:
            self._drain()
            if eng.paused or not eng.scheduler.has_work():
                self.last_progress = time.monotonic()  # idle, or held on purpose: not stuck
                self._wake.wait(timeout=1.0)
                self._wake.clear()
                continue
            with eng._lock:
                if eng.paused:  # pause() may have landed between the check and the lock
                    continue
                try:
                    eng.step()
                except Exception as e:  # fail the requests in flight, keep serving new ones
                    eng._fail_all(e)
            self.last_progress = time.monotonic()
