"""Who a failure is charged to, exactly: the balancer's MeshGenerator against a
real nats-server, with scripted instances (NATS subscribers that answer as a
prefill or decode instance would) so that each failure happens on cue.

- an error from prefill excludes that prefill instance, not the decode one;
- a handoff decode did not take (prefill's OVERLOADED) excludes that decode instance;
- a decode instance leaving the registry mid-stream moves the request at once,
  with the tokens so far, to the other decode instance;
- a move onto an instance dying with the one the request left (a node's death) is
  not charged; a request that kills every instance it lands on still fails, in
  bounded moves."""

import asyncio
import random
from collections.abc import Callable

import pytest
from opentelemetry.sdk.trace import TracerProvider

from services.balancer.generation import GenerationError, GenerationRequest
from services.balancer.router.move_budget import FREE_MOVES
from services.balancer.router.orchestrator import MeshGenerator
from services.balancer.router.registry import Registry
from shared.engine.sampling_params import SamplingParams
from shared.proto import mesh_pb2
from shared.runtime import subjects
from shared.runtime.bus import Bus
from shared.runtime.settings import BalancerSettings, NatsSettings
from tests.helpers.clock import Clock

PROMPT = [1, 2, 3, 4, 5]


class Mesh:
    """A registry of scripted instances and a MeshGenerator over them."""

    def __init__(self, bus: Bus) -> None:
        self.bus = bus
        self.clock = Clock()
        self.registry = Registry(misses=3, clock=self.clock)
        self.seq = 0
        self.beat("prefill", "p0", "p1")
        self.beat("decode", "d0")
        self.beat("decode", "d1", num_running=5)  # busier: d0 is the choice unless d0 is excluded
        settings = BalancerSettings(migration_limit=1, first_token_timeout_s=10, token_timeout_s=10)
        tracer = TracerProvider().get_tracer("test")
        self.gen = MeshGenerator(bus, self.registry, tracer, settings, 4, "fp", random.Random(0))
        self.runs: list[mesh_pb2.PrefillRequest] = []
        """Every PrefillRequest, in order."""
        self.to: list[str] = []
        """The prefill instance each went to."""

    def beat(self, stage: str, *instances: str, **load: int) -> None:
        self.seq += 1
        for iid in instances:
            hb = mesh_pb2.Heartbeat(stage=stage, instance_id=iid, seq=self.seq, interval_s=1.0,
                                    load=mesh_pb2.Load(**load))
            assert self.registry.on_heartbeat(hb) is None

    async def prefill(self, iid: str, act: Callable[[mesh_pb2.PrefillRequest], object]) -> None:
        """Instance iid acks every run and then does act(request) (a coroutine)."""

        async def on_run(req: mesh_pb2.PrefillRequest) -> mesh_pb2.Ack:
            self.runs.append(req)
            self.to.append(iid)
            asyncio.get_running_loop().create_task(act(req))
            return mesh_pb2.Ack(accepted=True, instance_id=iid)

        await self.bus.subscribe(subjects.prefill_run(iid), mesh_pb2.PrefillRequest, on_run)

    async def send(self, iid: str, rid: str, seq: int, tokens: list[int] = (), final: bool = False,
                   error: str = "", code: int = 0) -> None:
        chunk = mesh_pb2.TokenChunk(request_id=rid, instance_id=iid, seq=seq, token_ids=tokens, final=final,
                                    error=error, error_code=code)
        if final and not error:
            chunk.finish_reason = "length"
        await self.bus.publish(subjects.stream(iid, rid), chunk)

    async def run(self, max_tokens: int = 4) -> list[int]:
        req = GenerationRequest("r", list(PROMPT), SamplingParams(max_tokens=max_tokens, temperature=0))
        out: list[int] = []
        async for event in self.gen.generate(req):
            out += event.token_ids
        return out


@pytest.fixture
async def mesh(nats_server):  # noqa: F811
    bus = await Bus.connect(NatsSettings(url=nats_server.url), "test")
    yield Mesh(bus)
    await bus.close()


async def stream_all(mesh: Mesh, req: mesh_pb2.PrefillRequest, tokens: list[int]) -> None:
    """What prefill + decode do when all is well: decode streams tokens on its subject."""
    for i, t in enumerate(tokens):
        await mesh.send(req.decode_instance, req.request_id, i, [t], final=i == len(tokens) - 1)


async def test_a_prefill_error_is_charged_to_prefill_and_the_retry_keeps_the_decode(mesh):
    async def fail(req: mesh_pb2.PrefillRequest) -> None:
        await mesh.send(mesh.to[-1], req.request_id, 0, error="prefill failed: out of memory",
                        code=mesh_pb2.ERROR_CODE_INTERNAL)

    async def ok(req: mesh_pb2.PrefillRequest) -> None:
        await stream_all(mesh, req, [7, 8, 9, 10])

    # Whichever prefill instance is chosen first fails; the other works.
    await mesh.prefill("p0", lambda req: fail(req) if len(mesh.runs) == 1 else ok(req))
    await mesh.prefill("p1", lambda req: fail(req) if len(mesh.runs) == 1 else ok(req))
    assert await mesh.run() == [7, 8, 9, 10]
    assert [r.request_id for r in mesh.runs] == ["r", "r-m1"]
    assert mesh.to[1] != mesh.to[0]  # the failing prefill is avoided ...
    assert [r.decode_instance for r in mesh.runs] == ["d0", "d0"]  # ... the decode instance is not


async def test_a_handoff_decode_did_not_take_is_charged_to_decode(mesh):
    async def handoff_fails(req: mesh_pb2.PrefillRequest) -> None:
        await mesh.send(mesh.to[-1], req.request_id, 0, code=mesh_pb2.ERROR_CODE_OVERLOADED,
                        error=f"decode instance {req.decode_instance} did not answer (NoRespondersError)")

    async def act(req: mesh_pb2.PrefillRequest) -> None:
        await (handoff_fails(req) if len(mesh.runs) == 1 else stream_all(mesh, req, [7, 8, 9, 10]))

    await mesh.prefill("p0", act)
    await mesh.prefill("p1", act)
    assert await mesh.run() == [7, 8, 9, 10]
    assert [r.decode_instance for r in mesh.runs] == ["d0", "d1"]  # d1, busier, over d0 that failed


async def test_a_decode_instance_leaving_the_registry_moves_its_request_at_once(mesh):
    async def act(req: mesh_pb2.PrefillRequest) -> None:
        if len(mesh.runs) == 1:  # two tokens, then silence: the instance died
            await mesh.send(req.decode_instance, req.request_id, 0, [7])
            await mesh.send(req.decode_instance, req.request_id, 1, [8])
        else:
            await stream_all(mesh, req, [9, 10])

    await mesh.prefill("p0", act)
    await mesh.prefill("p1", act)
    task = asyncio.create_task(mesh.run())
    while len(mesh.runs) < 1:
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.2)  # the two tokens arrive
    dead = mesh.runs[0].decode_instance
    alive = "d1" if dead == "d0" else "d0"
    mesh.clock.now += 3.5  # everyone else keeps beating; the dead one is silent
    mesh.beat("prefill", "p0", "p1")
    mesh.beat("decode", alive, num_running=5)
    assert [i.instance_id for i in mesh.registry.sweep()] == [dead]
    # Within 5 s (wait_for), half the 10 s token timeout: the sweep moved it, not a timeout.
    # (No tighter bound: the move's speed on a loaded 2-core machine is not what this checks.)
    assert await asyncio.wait_for(task, 5) == [7, 8, 9, 10]
    # Moved with the tokens so far, to the decode instance that is left.
    assert list(mesh.runs[1].prompt_token_ids) == PROMPT + [7, 8] and mesh.runs[1].sampling.max_tokens == 2
    assert mesh.runs[1].decode_instance == alive


async def test_after_every_instance_failed_the_client_gets_a_503_without_internals(mesh):
    async def fail(req: mesh_pb2.PrefillRequest) -> None:
        await mesh.send(mesh.to[-1], req.request_id, 0, error="prefill failed: <AioRpcError 127.0.0.1:50051>",
                        code=mesh_pb2.ERROR_CODE_INTERNAL)

    await mesh.prefill("p0", fail)
    await mesh.prefill("p1", fail)
    with pytest.raises(GenerationError) as err:
        await mesh.run()
    assert err.value.status == 503 and "127.0.0.1" not in str(err.value) and "prefill failed" not in str(err.value)


async def test_a_refused_parameter_reaches_the_client_by_name_and_is_not_retried(mesh):
    refusals: list[str] = []

    async def refuse(req: mesh_pb2.PrefillRequest) -> mesh_pb2.Ack:
        refusals.append(req.request_id)
        return mesh_pb2.Ack(accepted=False, code=mesh_pb2.ERROR_CODE_INVALID_REQUEST, param="logit_bias",
                            message="logit_bias names token ids past the vocabulary (512 tokens): [99999]")

    for iid in ("p0", "p1"):
        await mesh.bus.subscribe(subjects.prefill_run(iid), mesh_pb2.PrefillRequest, refuse)
    with pytest.raises(GenerationError) as err:
        await mesh.run()
    # The field comes from the Ack's param, not from the text (which a refusal may word otherwise).
    assert (err.value.status, err.value.param) == (400, "logit_bias") and refusals == ["r"]


async def test_a_node_dying_under_a_moved_request_fails_it_not(mesh):
    """A prefill and a decode instance die 0.1 s apart, as a node hosting both does: the
    request in prefill on the first moves to the other prefill instance, handed on to the
    decode instance dying next (d0, the idler, not yet known dead). That move had no fair
    chance: it is not charged, and the request finishes on the instances left (with
    migration_limit 1, this failed it before)."""
    async def act(req: mesh_pb2.PrefillRequest) -> None:
        if len(mesh.runs) == 1:  # in prefill when its instance dies
            await asyncio.sleep(0.05)
            mesh.registry.leave(mesh.to[0], "disconnected from NATS (test)")
            await asyncio.sleep(0.1)
            mesh.registry.leave("d0", "disconnected from NATS (test)")  # the node's decode instance, 0.1 s later
        elif len(mesh.runs) == 3:
            await stream_all(mesh, req, [7, 8, 9, 10])
        # the second run: prefill holds it while d0 dies

    await mesh.prefill("p0", act)
    await mesh.prefill("p1", act)
    assert await asyncio.wait_for(mesh.run(), 10) == [7, 8, 9, 10]
    assert [r.decode_instance for r in mesh.runs] == ["d0", "d0", "d1"]
    assert mesh.to[1] == mesh.to[2] != mesh.to[0]


async def test_a_request_that_kills_every_instance_it_lands_on_fails_in_bounded_moves(mesh):
    """A poison request: each prefill instance that takes it dies. Its first death is
    charged; the next ones look like one incident (moved off a death onto an instance that
    died within the detection window) and are free, but only FREE_MOVES of them: the next
    death is charged too, over migration_limit 1, and the client gets a 503. Of six prefill
    instances, 1 + FREE_MOVES + 1 died; the sixth never saw it."""
    mesh.beat("prefill", "p2", "p3", "p4", "p5")

    async def die(req: mesh_pb2.PrefillRequest) -> None:
        await asyncio.sleep(0.05)  # after its ack: it had started on it
        mesh.registry.leave(mesh.to[-1], "disconnected from NATS (test)")

    for iid in ("p0", "p1", "p2", "p3", "p4", "p5"):
        await mesh.prefill(iid, die)
    with pytest.raises(GenerationError) as err:
        await asyncio.wait_for(mesh.run(), 10)
    assert err.value.status == 503 and "also after moving it" in str(err.value)
    assert len(mesh.runs) == 1 + FREE_MOVES + 1 == len(set(mesh.to))
