"""A clock moved by hand, for the parts that take a `clock` callable (the
balancer's registry, kvcache's store): tests set `clock.now` and assert exactly."""


class Clock:
    """Returns `now` when called; tests move it by assigning `now`."""

    def __init__(self, now: float = 100.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now
