"""Recurrent-state slots of the GDN layers: 1 + k slots per request with k drafts (verification
writes the state after each draft position into its own slot)."""

from __future__ import annotations

from backboard.request import Request


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
        slots = [self._free.pop() for _ in range(self.slots_per_request)]
        for s in slots:
            self._owned[s] = True
        req.state_slots = slots
        return slots

    def free(self, req: Request) -> None:
        for s in req.state_slots:
            if not self._owned[s]:
                raise RuntimeError(f"state slot {s} freed twice")
            self._owned[s] = False
            self._free.append(s)
        req.state_slots = []

    def usage(self) -> float:
        return 1.0 - len(self._free) / self.num_slots

    def check_integrity(self, live: list[Request]) -> None:
        if len(set(self._free)) != len(self._free):
            raise AssertionError("a state slot is free twice")
        owned = [s for r in live for s in r.state_slots]
        if len(set(owned)) != len(owned):
            raise AssertionError("a state slot has two owners")
        if set(owned) | set(self._free) != set(range(self.num_slots)) or set(owned) & set(self._free):
            raise AssertionError("state slots leaked or double-booked")
        if any(self._owned[s] != (s in set(owned)) for s in range(self.num_slots)):
            raise AssertionError("state slot ownership flags out of sync")
