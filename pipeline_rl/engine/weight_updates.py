"""How an engine takes the weight updates the trainer announces: a thread reads the "weights"
stream, takes part in each announced transfer (no lock held while receiving) and swaps the
received weights in through the engine's hook (the swap contract: engine/vllm_hook.py).

A failed transfer, swap or checksum is logged and counted, and the engine keeps serving the last
complete version: after a failed delta or a checksum mismatch it asks the trainer for a full
update; after a failed group (a peer died) it joins the group the sender forms next, whose first
update is full. Only a bug in this loop itself is fatal to the engine (`on_fatal`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from pipeline_rl.engine.vllm_hook import Receiver, SwapGate
from pipeline_rl.streams.api import Reader
from pipeline_rl.streams.records import WeightUpdate
from pipeline_rl.weight_sync import StaleUpdate, WeightGroupFailed
from pipeline_rl.weight_sync.delta import is_delta

log = logging.getLogger(__name__)


class WeightUpdates:
    def __init__(self, hook: SwapGate, closed: threading.Event, on_fatal: Callable[[BaseException], None]):
        self.hook, self.closed, self.on_fatal = hook, closed, on_fatal
        self.failures = 0
        """Updates that failed while receiving (the hook counts failed swaps)."""
        self.skipped = 0
        """Updates not taken: stale, or not newer than the engine's version."""
        self.checksum_mismatches = 0
        """Updates after which the engine's weights failed their checksums."""
        self.full_requests = 0
        """Full updates this engine asked for (a failed checksum, a delta it could not apply)."""
        self.group_failure: WeightGroupFailed | None = None
        """The last failure of the weight-update group (it names the member that did not
        finish), or None. The engine keeps its weights and the receiver joins the group the
        sender forms next: a dead peer is the launcher's to restart or to stop the run on."""
        self._incarnation: str | None = None
        """The sender's incarnation at the last update received (Receiver.incarnation)."""

    def start(self, receiver: Receiver, updates_reader: Reader) -> threading.Thread:
        """Start the daemon thread that takes every announced update until `closed` is set."""
        thread = threading.Thread(
            target=self._receive, args=(receiver, updates_reader), name="weight-receiver", daemon=True
        )
        thread.start()
        return thread

    def _receive(self, receiver: Receiver, updates_reader: Reader) -> None:
        while not self.closed.is_set():
            try:
                entries = updates_reader.read(timeout=1.0)
            except Exception:
                log.exception("reading weight updates failed")
                self.failures += 1
                time.sleep(1.0)
                continue
            try:
                for entry in entries:
                    if self.closed.is_set():  # the engine stops: the rest is not taken
                        return
                    self.apply(receiver, entry.record)
            except BaseException as e:  # a bug here would leave the engine on its weights for good
                log.exception("the weight receiver thread failed")
                self.on_fatal(e)
                return

    def apply(self, receiver: Receiver, update: WeightUpdate) -> bool:
        """Receive one announced update and swap it in; False (logged, counted) on failure."""
        try:
            staged = receiver.receive(update)
        except StaleUpdate as e:
            self.skipped += 1
            log.info("skipped weight update: %s", e)
            return False
        except Exception as e:
            self.failures += 1
            log.error(
                "weight update %d failed while receiving, keeping version %d: %s", update.version, self.hook.version, e
            )
            if isinstance(e, WeightGroupFailed):
                self.group_failure = e  # the sender forms a new group, whose first update is full
            elif is_delta(update):
                self._request_full(receiver)
            return False
        restarted = self._incarnation is not None and receiver.incarnation != self._incarnation
        self._incarnation = receiver.incarnation
        if restarted:
            log.warning(
                "the trainer restarted: version %d replaces version %d (from the new trainer's checkpoint)",
                update.version,
                self.hook.version,
            )
        elif update.version <= self.hook.version:
            self.skipped += 1
            log.info("skipped weight update %d: engine already has version %d", update.version, self.hook.version)
            return False
        try:
            stats = self.hook.swap(staged, update.version)
        except Exception as e:  # counted by the hook
            log.error("weight update %d not loaded, keeping version %d: %s", update.version, self.hook.version, e)
            if isinstance(e, ValueError) and is_delta(update):  # a full update can be taken
                self._request_full(receiver)
            return False
        if update.checksums:
            wrong = self.hook.mismatches(update)
            if wrong:
                self.checksum_mismatches += 1
                log.error(
                    "weight version %d: %d tensor(s) differ from the trainer's (checksums), e.g. %s; "
                    "asking for a full update",
                    update.version,
                    len(wrong),
                    wrong[:3],
                )
                self._request_full(receiver)
        log.info(
            "loaded weight version %d (lock wait %.1f ms, load %.1f ms)",
            update.version,
            stats.lock_wait_s * 1e3,
            stats.load_s * 1e3,
        )
        return True

    def _request_full(self, receiver: Receiver) -> None:
        try:
            receiver.request_full()
            self.full_requests += 1
        except Exception as e:  # the sender is gone: a new one starts with a full update anyway
            log.warning("could not ask the trainer for a full weight update: %s", e)
