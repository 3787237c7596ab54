"""The engine's weight swaps as the actor's metrics records show them: the swaps since the last
record and how long each paused generation, beside the engine's running totals (swaps, failures,
skipped updates, delta checksums that failed, full updates asked for)."""

from __future__ import annotations


class SwapMetrics:
    def __init__(self, llm):
        self.llm = llm
        self.seen = 0
        """Swaps already counted in an earlier record."""

    def values(self) -> dict:
        """The swaps' part of the next metrics record (None where there is nothing to show)."""
        stats = self.llm.stats()
        history, count = self.llm.hook.recent_swaps()
        new = count - self.seen
        self.seen = count
        pauses = [s.lock_wait_s + s.load_s for s in (history[-new:] if new else [])]
        return {
            "swaps": new,
            "swaps_total": stats["swaps"],
            "swap_pause_max_s": max(pauses) if pauses else None,
            "swap_pause_mean_s": sum(pauses) / len(pauses) if pauses else None,
            "swap_lock_wait_p50_s": stats["lock_wait_p50_s"],
            "swap_load_p50_s": stats["load_p50_s"],
            "swap_failures_total": stats["swap_failures"],
            "weight_updates_skipped_total": stats["updates_skipped"],
            # Delta updates: weights that failed their checksums, full updates asked for.
            "weight_checksum_mismatches_total": stats["weight_checksum_mismatches"],
            "weight_full_requests_total": stats["weight_full_requests"],
        }
