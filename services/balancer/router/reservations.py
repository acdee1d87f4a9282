"""Load reserved on an instance for a request being handed to it.

The registry's load figures come from heartbeats; between two, this balancer
counts what it sent an instance itself (Instance.in_flight and
in_flight_tokens, zeroed by the instance's next heartbeat, which includes
them: registry.py). A Reservation is taken when the instance is chosen, before
the first await, so that the requests routed meanwhile see it (a burst
otherwise all lands on the instance that looked idlest); it is given back
exactly once if the handover fails, or kept if the instance takes the request.
"""

from types import TracebackType

from services.balancer.router.registry import Instance


class Reservation:
    """`requests` and `tokens` counted on `instance` from now on. As a context
    manager it is given back on leaving the block unless kept inside it."""

    __slots__ = ("instance", "requests", "tokens", "_open")

    def __init__(self, instance: Instance, *, requests: int = 0, tokens: int = 0) -> None:
        self.instance = instance
        self.requests = requests
        self.tokens = tokens
        self._open = True
        instance.in_flight += requests
        instance.in_flight_tokens += tokens

    def keep(self, *, requests: int = 0) -> None:
        """The instance took the request: what is reserved stays counted until its next
        heartbeat, and `requests` more count as in flight from now (a prefill instance's
        request counts once it accepted it; its tokens from the choice on)."""
        assert self._open, "a reservation is kept or given back once"
        self._open = False
        self.instance.in_flight += requests

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
