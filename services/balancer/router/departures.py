"""Instances that died, heard from nats-server at once rather than from missed
heartbeats.

A worker's process holds one NATS connection, named after its instance
(shared/runtime/service.py). When the process dies (SIGKILL, OOM, a crash) the
kernel closes that connection and nats-server publishes a `client_disconnect`
advisory within milliseconds. The mesh's NATS config (tools/launch/nats_auth.py)
imports those advisories of the mesh's account into it on
subjects.CLIENT_DISCONNECTED, which no mesh user may publish on; the balancer
then drops the instance from the registry, and its requests move at once.
Heartbeats stay the backstop for what closes no connection: a frozen process,
a lost node, a NATS without the advisories (an external server).

Trust: the advisory comes from the server, but a connection's name is chosen by
its client. A departure counts only when the connection's user could have been
that instance: the instance's own user (`infermesh up`: one user per instance)
or its stage's (Helm and compose: one user per stage). Around the balancer's own
NATS outage (while its connection is down and a grace after) no advisory counts:
it may name a connection the instance has since replaced by a new one, and the
heartbeats, counted again after the grace, tell who is really gone. Nor does an
advisory for another connection than the one the instance's heartbeats name (its
old one, closed by the server after the instance reconnected). So under `up` no
worker can make another one leave; under Helm an insider with a stage's
password could make instances of that stage fail over (not lose work).
"""

import json
from dataclasses import dataclass

from services.balancer.router.registry import Instance, Registry


@dataclass(slots=True, frozen=True)
class Departure:
    """One closed client connection, as nats-server describes it."""

    name: str
    """The connection's name (a worker names it after its instance)."""
    user: str
    reason: str
    connection: str = ""
    """`<server id>/<client id>`, as heartbeats name theirs ("" if the advisory lacks one)."""


def parse_advisory(data: bytes) -> Departure | None:
    """The departure in a `client_disconnect` advisory; None for anything else."""
    try:
        body = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError):
        return None
    client = body.get("client") if isinstance(body, dict) else None
    if not isinstance(client, dict) or body.get("type") != "io.nats.server.advisory.v1.client_disconnect":
        return None
    name, user = client.get("name"), client.get("user")
    if not isinstance(name, str) or not isinstance(user, str):
        return None
    server, cid = body.get("server"), client.get("id")
    server_id = server.get("id") if isinstance(server, dict) else None
    connection = f"{server_id}/{cid}" if isinstance(server_id, str) and isinstance(cid, int) else ""
    return Departure(name, user, str(body.get("reason", "")), connection)


def instance_departed(registry: Registry, departure: Departure) -> Instance | None:
    """Drop the instance whose connection closed; returns it, or None when the
    connection was no known instance's (the balancer's own, a monitor, a client
    that named itself after an instance whose user it is not)."""
    inst = registry.get(departure.name)
    if inst is None or departure.user not in (inst.instance_id, inst.stage):
        return None
    if not registry.accepts_departures():  # our own outage or its grace: that connection may be an old one
        return None
    if departure.connection and inst.connection and departure.connection != inst.connection:
        registry.num_departures_ignored += 1  # an old connection of it: it beats on another now
        return None
    return registry.leave(inst.instance_id, f"disconnected from NATS ({departure.reason or 'closed'})")
