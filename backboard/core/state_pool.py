"""Recurrent-state slots of the GDN layers: 1 + k slots per request with k drafts (verification
writes the state after each draft position into its own slot), and single slots held by
prefix-cache state checkpoints (core/prefix_cache.py). Both come from one pool of slots."""

from __future__ import annotations

from backboard.request import Request


def verify_slot_order(slots: list[int], current: int, num_rows: int) -> list[int]:
    """Destination slot of the state after each of a request's `num_rows` verify rows: the
    current slot first, then its other slots in order. Row j's state lands in dst[j], and the
    state after the last accepted row becomes the current one (no copy). The worker and the
    scheduler both follow this rule, so both know which slot holds a request's state."""
    return ([current] + [s for s in slots if s != current])[:num_rows]


class StatePool:
    def __init__(self, num_slots: int, slots_per_request: int) -> None:
        if slots_per_request < 1 or num_slots < slots_per_request:
            raise ValueError(f"need at least {slots_per_request} state slots, got {num_slots}")
        self.num_slots, self.slots_per_request = num_slots, slots_per_request
        self._free = list(range(num_slots - 1, -1, -1))   # pop() hands out low slots first
        self._owned = [False] * num_slots

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def max_requests(self) -> int:
        return self.num_slots // self.slots_per_request

    def can_allocate(self) -> bool:
        return len(self._free) >= self.slots_per_request

    def allocate(self, req: Request) -> list[int]:
        if req.state_slots:
            raise RuntimeError(f"{req.request_id} already holds state slots")
        if not self.can_allocate():
            raise RuntimeError("no free state slots")
        slots = [self.take() for _ in range(self.slots_per_request)]
        req.state_slots = slots
        req.current_state_slot = slots[0]
        return slots

    def take(self) -> int:
        """One slot (a prefix-cache checkpoint's)."""
        if not self._free:
            raise RuntimeError("no free state slots")
        s = self._free.pop()
        self._owned[s] = True
        return s

    def release(self, slot: int) -> None:
        if not self._owned[slot]:
            raise RuntimeError(f"state slot {slot} freed twice")
        self._owned[slot] = False
        self._free.append(slot)

    def free(self, req: Request, keep: int | None = None) -> None:
        """Free the request's slots, except `keep` (handed on, e.g. to a checkpoint)."""
        for s in req.state_slots:
            if s != keep:
                self.release(s)
        req.state_slots = []
        req.current_state_slot = -1

    def usage(self) -> float:
        return 1.0 - len(self._free) / self.num_slots

    def check_integrity(self, live: list[Request], other_owners: list[int] = ()) -> None:
        """Every slot is free, or held by one live request or one other owner (checkpoints)."""
        if len(set(self._free)) != len(self._free):
            raise AssertionError("a state slot is free twice")
        owned = [s for r in live for s in r.state_slots] + list(other_owners)
        if len(set(owned)) != len(owned):
            raise AssertionError("a state slot has two owners")
        if set(owned) | set(self._free) != set(range(self.num_slots)) or set(owned) & set(self._free):
            raise AssertionError("state slots leaked or double-booked")
        owned_set = set(owned)
        if any(self._owned[s] != (s in owned_set) for s in range(self.num_slots)):
            raise AssertionError("state slot ownership flags out of sync")
        for r in live:
            if r.state_slots and r.current_state_slot not in r.state_slots:
                raise AssertionError(f"{r.request_id}'s current state slot is not one of its slots")
