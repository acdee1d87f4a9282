"""The migration loop: run a request's attempts until one finishes. When an
instance fails the request after accepting it, re-dispatch prompt + tokens
generated so far to other instances (avoiding those at fault) and go on
streaming, as Dynamo does: up to migration_limit moves, plus OUTAGE_MOVES for
moves while the bus recovers from a NATS outage (outage.py; handoffs decode did
not take then move uncounted for a while: decode may not be back yet), plus FREE_MOVES off
instances that died without a fair chance at the request (move_budget.py): a
node's death, taking a prefill and a decode instance at once, fails no request
while an instance of each stage lives."""

import dataclasses
import logging
import time
from collections.abc import AsyncIterator

from opentelemetry import trace

from services.balancer.generation import GenerationError, GenerationRequest, TokenEvent, Usage
from services.balancer.router.attempt import Attempts
from services.balancer.router.failures import InstanceFailed
from services.balancer.router.move_budget import RecentDeaths, budget_for
from services.balancer.router.outage import OUTAGE_MOVES, OutageRecovery
from services.balancer.router.wire import WireImages
from shared.runtime.metrics import Metrics
from shared.runtime.settings import BalancerSettings

log = logging.getLogger(__name__)


class MigrationLoop:
    def __init__(
        self, attempts: Attempts, outage: OutageRecovery, deaths: RecentDeaths, settings: BalancerSettings,
        metrics: Metrics,
    ) -> None:
        self.attempts = attempts
        self.outage = outage
        self.deaths = deaths
        self.settings = settings
        self.m_migrations = metrics.counter(
            "migrations_total", "Requests moved to other instances, by cause (left_mesh: the registry lost the "
            "instance; error; timeout; handoff: decode did not take prefill's handoff; lost: chunks lost in a NATS "
            "outage)", ("cause",)
        )
        self.m_migration_gap = metrics.histogram(
            "migration_gap_seconds", "What a moved request's client waited: from its last token before the failure "
            "(or its start) to its first token after the move"
        )

    async def run(self, req: GenerationRequest, images: WireImages) -> AsyncIterator[TokenEvent]:
        """Run the request with its images (every move resends them: the image
        tokens stay in the continuation's prompt, and its new instances recompute or
        reload their KV by the same image hashes); when an instance fails it after accepting it, migrate:
        re-dispatch prompt + tokens generated so far to other instances and go
        on streaming (up to migration_limit times, plus OUTAGE_MOVES for a NATS
        outage's losses), as Dynamo does. Greedy output
        is unchanged by a migration, and so is a seeded sample: its draws are keyed by
        (seed, position) and the continuation's positions go on where they stopped."""
        # The HTTP layer's request span: TTFT and cache figures belong on the trace's root.
        root = trace.get_current_span()
        started = time.perf_counter()
        generated: list[int] = []
        cached: int | None = None
        excluded: set[str] = set()
        rejected = [0]  # chunks dropped from this request's streams
        attempt = req
        last_token = started  # when tokens last went out (the start before any)
        moved = False
        migration = 0  # moves so far
        budget = budget_for(self.deaths, self.settings.migration_limit, OUTAGE_MOVES)
        handoffs_failed_since: float | None = None  # the first handoff decode did not take in a NATS outage
        while True:
            if migration:
                attempt = continuation(req, generated, migration)
            try:
                events = self.attempts.run(attempt, images, excluded, root, time.perf_counter(), rejected, migration)
                async for event in events:
                    now = time.perf_counter()
                    if moved and event.token_ids:
                        moved = False
                        self.m_migration_gap.observe(now - last_token)
                        root.set_attribute("migration.gap_ms", round((now - last_token) * 1e3, 2))
                        root.set_attribute("migration.resumed_unix", time.time())  # to line up with a death
                    if event.token_ids:
                        last_token = now
                    if not generated and event.token_ids:
                        root.set_attribute("ttft_ms", round((now - started) * 1e3, 2))
                    generated += event.token_ids
                    if event.usage is not None:
                        cached = event.usage.cached_tokens if cached is None else cached
                        u = event.usage
                        event.usage = Usage(len(req.prompt_token_ids), len(generated), cached,
                                            u.spec_drafted_tokens, u.spec_accepted_tokens)  # fmt: skip
                    yield event
                return
            except InstanceFailed as exc:
                outage = exc.cause == "lost" or self.outage.recovering()
                if outage and exc.cause == "handoff":
                    handoffs_failed_since = handoffs_failed_since or time.monotonic()
                    uncounted = await self.outage.handoff_retry(handoffs_failed_since, root)
                else:
                    uncounted = False
                if not uncounted:
                    budget.record(exc, outage)
                if not uncounted and not await budget.allows_move():
                    raise GenerationError(
                        "The mesh failed this request, also after moving it to other instances; retry.", status=503
                    ) from None
                tally = budget.tally()
                migration += 1
                moved = True
                excluded |= exc.instance_ids
                self.m_migrations.labels(exc.cause).inc()
                log.warning("request %s: %s; migrating (%d: %d of %d counted, %d off instances that died without a "
                            "fair chance%s)", req.request_id, exc, migration, tally.charged,
                            self.settings.migration_limit, tally.free, ", NATS outage" if outage else "")
                root.set_attribute("migrations", migration)
                root.set_attribute("migrations.free", tally.free)  # moves the budget did not count
                root.set_attribute("migration.failed_unix", time.time())  # when we learned of it: a death's cost to us
                root.add_event("migrate", {"cause": exc.cause, "error": str(exc), "tokens_so_far": len(generated),
                                           "outage": outage, "uncounted": uncounted})


def continuation(req: GenerationRequest, generated: list[int], migration: int) -> GenerationRequest:
    """The request as its migration-th move dispatches it: the prompt with the tokens so
    far, and what is left of its budget, under a new id."""
    p = req.params
    params = dataclasses.replace(
        p, max_tokens=p.max_tokens - len(generated), min_tokens=max(p.min_tokens - len(generated), 0),
        # The prompt's logprobs came with the first token: the continuation's longer prompt is not scored.
        prompt_logprobs=p.prompt_logprobs if not generated else None,
    )
    return GenerationRequest(
        f"{req.request_id}-m{migration}", req.prompt_token_ids + generated, params, req.cache_salt, req.priority,
        req.images,
    )
