"""Load reserved on an instance for a request being handed to it.

The registry's load figures come from heartbeats; between two, this balancer
counts what it sent an instance itself (Instance.in_flight and
in_flight_tokens, zeroed by the instance's next heartbeat, which includes
them: registry.py). A Reservation is taken when the instance is chosen, before
the first await, so that the requests routed meanwhile see it (a burst
otherwise all lands on the instance that looked idlest); it is given back
exactly once if the handover fails, or kept if the instance takes the request.

A kept reservation on a prefill instance is counted off again as soon as the
request's prompt is done there (decode's first token reached the balancer: `done`),
unless a heartbeat came in between (it already left the request out). Counted
until the next heartbeat instead, a prefill instance that beat last looked idlest
for up to a whole interval and drew every request routed meanwhile: at 175
requests/s on four instances the kept tokens (2,800 each after 0.5 s) outweighed
any real queue, and the prompts queued on one instance at a time.
"""

from types import TracebackType

from services.balancer.router.registry import Instance


class Reservation:
    """`requests` and `tokens` counted on `instance` from now on. As a context
    manager it is given back on leaving the block unless kept inside it."""

    __slots__ = ("instance", "requests", "tokens", "_open", "_kept", "_beats")

    def __init__(self, instance: Instance, *, requests: int = 0, tokens: int = 0) -> None:
        self.instance = instance
        self.requests = requests
        self.tokens = tokens
        self._open = True
        self._kept: int | None = None
        """Requests counted once kept (None: not kept, or counted off by done)."""
        self._beats = instance.num_beats
        instance.in_flight += requests
        instance.in_flight_tokens += tokens

    def keep(self, *, requests: int = 0) -> None:
        """The instance took the request: what is reserved stays counted until its next
        heartbeat, and `requests` more count as in flight from now (a prefill instance's
        request counts once it accepted it; its tokens from the choice on)."""
        assert self._open, "a reservation is kept or given back once"
        self._open = False
        self._kept = requests
        self.instance.in_flight += requests

    def done(self) -> None:
        """The instance finished the work reserved (a prefill instance computed the prompt):
        count it off now, unless a heartbeat came since (its figures no longer hold it). Only
        a kept reservation, once."""
        if self._kept is None:
            return
        kept, self._kept = self._kept, None
        inst = self.instance
        if inst.num_beats != self._beats:
            return
        inst.in_flight = max(inst.in_flight - self.requests - kept, 0)
        inst.in_flight_tokens = max(inst.in_flight_tokens - self.tokens, 0)

    def release(self) -> None:
        """Give back what is reserved, unless kept or given back already (a heartbeat
        since may have zeroed the counts: never below 0)."""
        if not self._open:
            return
        self._open = False
        inst = self.instance
        inst.in_flight = max(inst.in_flight - self.requests, 0)
        inst.in_flight_tokens = max(inst.in_flight_tokens - self.tokens, 0)

    def __enter__(self) -> "Reservation":
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.release()
