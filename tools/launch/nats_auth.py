"""Who may publish and subscribe what on the mesh's NATS, written from the
subject helpers (shared/runtime/subjects.py), and the nats-server
`authorization` block that enforces it.

Roles (each user also gets its own reply inboxes, _INBOX.<user>.>, and only
the users that answer requests may publish to reply subjects):

| user        | publishes                                              | subscribes                                  |
|-------------|--------------------------------------------------------|---------------------------------------------|
| balancer    | prefill dispatch (im.prefill.*.run), encode requests (im.vision.*.encode), cancels, the responses bucket (JetStream KV), prefix-cache resets | heartbeats, KV events, every token stream, departures |
| prefill X   | decode handoffs, X's heartbeats, KV events and streams, NIXL metadata asks (vision's) | X's dispatch, cancels, X's KV releases, X's NIXL metadata asks, X's prefix-cache resets |
| decode X    | X's heartbeats, KV events and streams, KV releases, NIXL metadata asks | X's handoffs, cancels, X's prefix-cache resets |
| vision X    | X's heartbeats                                         | X's encode requests, X's NIXL metadata asks (answers them) |
| kvcache     | its KV events (im.kv.events)                           | nothing                                     |
| monitor     | nothing                                                | heartbeats, KV events (load figures only)   |
| admin       | anything                                               | anything (`up`'s operator only)             |

`admin` exists only under `infermesh up`, for its operator (debugging, the
tests' Mesh.nats_url): its password sits in the same 0600 file as every other
one, so it grants nobody anything they could not already read there.
Every deployment makes one user per instance (X = the instance): an instance
can neither read another's prompts nor publish into another's streams.
`infermesh up` knows its instance ids; compose's are fixed services and Helm's
are StatefulSet pod names up to `stages.<stage>.maxInstances`
(deploy/nats_users.py writes both from this module). The per-stage form (X =
`*`, one user per stage) remains for a deployment that cannot name its
instances beforehand; there the balancer's check that a chunk comes from the
instance it handed the request to is what keeps instances of one stage apart.

Every user sits in one account (MESH). The system account (SYS) exports
nats-server's advisory of a client that left; MESH imports it as
`im.nats.disconnected` (subjects.CLIENT_DISCONNECTED), which only the server
feeds: the balancer hears a worker's death within milliseconds
(services/balancer/router/departures.py).

    python -m tools.launch.nats_auth --conf
        # the limits and the per-stage block (X = *), passwords read from $NATS_<ROLE>_PASSWORD
    python -m tools.launch.nats_auth --env
        # random values for those, a gRPC token per identity and their peers list, the API key,
        # Grafana's admin password

Helm's and compose's per-instance files come from deploy/nats_users.py, built on this.
Every config (up's, compose's, Helm's) begins with server_limits(): the largest
message the mesh's nats-server takes (MAX_PAYLOAD).
"""

import argparse
import inspect
import json
import os
import secrets
import sys
from dataclasses import dataclass, field
from pathlib import Path

from shared.runtime import subjects
from shared.runtime.rpc_auth import IDENTITIES, peers_setting

ANY = "__ANY__"  # stands for a wildcard while a subject helper builds a pattern
ROLES = ("balancer", "prefill", "decode", "kvcache", "monitor", "vision")


def _pattern(subject: str, wildcard: str = "*") -> str:
    return subject.replace(ANY, wildcard)


def _any(helper) -> str:  # noqa: ANN001  (a one-token subject helper)
    return _pattern(helper(ANY))


def stream_subjects(instance: str) -> str:
    """The token streams instance may publish (`*`: any instance's):
    im.stream.<instance>.> (subjects.stream_of_instance). Before stream subjects
    named the publishing instance, every worker needed im.stream.>."""
    helper = getattr(subjects, "stream_of_instance", None)
    if helper is None:
        return _pattern(subjects.stream(ANY), ">")
    return _any(helper) if instance == "*" else helper(instance)


def inbox(user: str) -> str:
    """The reply subjects of a user's requests (Bus.connect sets nats-py's inbox_prefix to match)."""
    return f"_INBOX.{subjects.check_token(user)}.>"


@dataclass(frozen=True)
class Permissions:
    publish: tuple[str, ...]
    subscribe: tuple[str, ...]
    allow_responses: bool = False
    """May answer requests (publish once to the reply subject of a message it received)."""


def permissions(role: str, instance: str = "*") -> Permissions:
    """What a user of role may do; instance: the one instance it is (workers), or `*`."""
    own = (lambda helper: helper(instance)) if instance != "*" else _any
    if role == "balancer":
        # STREAM_OLD_FORM (im.stream.<request>): the balancer listens there only to
        # count forgeries of the subject form before streams named their instance.
        return Permissions(
            publish=(_any(subjects.prefill_run), _any(subjects.decode_run), _any(subjects.vision_encode),
                     subjects.CANCEL, *subjects.kv_bucket_subjects(subjects.RESPONSES_BUCKET),
                     *(_any(lambda i, s=stage: subjects.reset_prefix_cache(s, i)) for stage in ("prefill", "decode"))),
            subscribe=(subjects.HEARTBEAT_ALL, subjects.KV_EVENTS_ALL, stream_subjects("*"),
                       subjects.STREAM_OLD_FORM, subjects.CLIENT_DISCONNECTED),
        )
    if role in ("prefill", "decode"):
        # Its own heartbeat and KV event subjects, as its own streams: under `up` a
        # worker cannot speak in another instance's name.
        heartbeat = own(lambda i: subjects.heartbeat(role, i))
        reset = own(lambda i: subjects.reset_prefix_cache(role, i))  # the balancer's POST /reset_prefix_cache
        if role == "prefill":
            return Permissions(
                publish=(_any(subjects.decode_admit), heartbeat, own(subjects.kv_events), stream_subjects(instance),
                         _any(subjects.kv_nixl)),  # a vision instance's NIXL metadata (its embeddings)
                subscribe=(own(subjects.prefill_run), subjects.CANCEL, own(subjects.kv_release), own(subjects.kv_nixl),
                           reset),
                allow_responses=True,
            )
        return Permissions(
            publish=(heartbeat, own(subjects.kv_events), stream_subjects(instance), _any(subjects.kv_release),
                     _any(subjects.kv_nixl)),
            subscribe=(own(subjects.decode_admit), own(subjects.decode_run), subjects.CANCEL, reset),
            allow_responses=True,
        )
    if role == "vision":  # answers the balancer's encode requests and its readers' NIXL metadata asks
        return Permissions(publish=(own(lambda i: subjects.heartbeat(role, i)),),
                           subscribe=(own(subjects.vision_encode), own(subjects.kv_nixl)), allow_responses=True)
    if role == "kvcache":
        return Permissions(publish=(subjects.KV_EVENTS,), subscribe=())
    if role == "monitor":
        return Permissions(publish=(), subscribe=(subjects.HEARTBEAT_ALL, subjects.KV_EVENTS, subjects.KV_EVENTS_ALL))
    if role == "admin":
        return Permissions(publish=(">",), subscribe=(">",), allow_responses=True)
    raise ValueError(f"unknown role {role!r} (known: {', '.join(ROLES)})")


@dataclass(frozen=True)
class User:
    name: str
    role: str
    password: str
    """The password itself, or `$VARIABLE` for nats-server to read from its environment."""
    instance: str = "*"

    @property
    def permissions(self) -> Permissions:
        return permissions(self.role, self.instance)


def _list(items: tuple[str, ...]) -> str:
    return "[" + ", ".join(json.dumps(i) for i in items) + "]"


MESH_ACCOUNT = "MESH"
SYSTEM_ACCOUNT = "SYS"
DISCONNECT_ADVISORIES = f"$SYS.ACCOUNT.{MESH_ACCOUNT}.DISCONNECT"
"""What nats-server publishes (in its system account) when a client of the mesh's account leaves."""


MAX_PAYLOAD = 8 << 20
"""The most bytes one message on the mesh's NATS holds (nats-server's max_payload;
its default is 1 MiB, 8 MiB its recommended maximum). A prefill request carries its
images as lossless PNG at their decoded size (services/balancer/router/wire.py): an
ordinary 1024x768 photo is 1.5-2 MB of PNG, which 8 MiB sends whole; past it the Bus
sends any message in parts (shared/runtime/bus_parts.py), so this is no limit on a
request, only the size of its parts. The clients learn the limit from the
server's INFO (nats-py's max_payload), so this is the only copy of it; a NATS the
deployment does not start (Helm's nats.url) keeps its own."""


def server_limits(max_payload: int | None = MAX_PAYLOAD) -> str:
    """The top of every mesh nats-server config: the limits that are not nats-server's
    defaults (max_payload None: nats-server's own 1 MiB, as a NATS the chart is pointed
    at may keep; long messages then go in parts, shared/runtime/bus_parts.py)."""
    return "" if max_payload is None else f"max_payload: {max_payload}\n"


def server_config(users: list[User], max_payload: int | None = MAX_PAYLOAD) -> str:
    """A whole nats-server config for these users: the limits, then their accounts."""
    return server_limits(max_payload) + authorization_block(users)


def authorization_block(users: list[User]) -> str:
    """nats-server's accounts for these users: all in the mesh's account, with
    their permissions; the system account exports the advisories of clients that
    leave, which the mesh's account imports on subjects.CLIENT_DISCONNECTED (the
    balancer moves a dead worker's requests at once). A password `$NAME` is left
    unquoted: nats-server reads it from its environment."""
    lines = [f"system_account: {SYSTEM_ACCOUNT}", "accounts {",
             f"  {SYSTEM_ACCOUNT} {{", f"    exports = [{{stream: {json.dumps(DISCONNECT_ADVISORIES)}}}]", "  }",
             # JetStream for the mesh's account: the balancers' responses bucket (its users'
             # permissions decide who may touch it: the balancer only).
             f"  {MESH_ACCOUNT} {{", "    jetstream: enabled", "    users = ["]
    for u in users:
        p = u.permissions
        password = u.password if u.password.startswith("$") else json.dumps(u.password)
        subscribe = (*p.subscribe, inbox(u.name))
        # An empty allow list would allow everything: deny all instead.
        publish = f"{{allow: {_list(p.publish)}}}" if p.publish else '{deny: [">"]}'
        lines.append(f"      {{user: {json.dumps(u.name)}, password: {password}, permissions: {{")
        lines.append(f"        publish: {publish}")
        lines.append(f"        subscribe: {{allow: {_list(subscribe)}}}")
        if p.allow_responses:
            lines.append("        allow_responses: true")
        lines.append("      }}")
    lines += ["    ]",
              f"    imports = [{{stream: {{account: {SYSTEM_ACCOUNT}, subject: {json.dumps(DISCONNECT_ADVISORIES)}}}, "
              f"to: {json.dumps(subjects.CLIENT_DISCONNECTED)}}}]",
              "  }", "}"]
    return "\n".join(lines) + "\n"


def password_variable(user: str) -> str:
    return "NATS_" + user.upper().replace("-", "_") + "_PASSWORD"


def role_users() -> list[User]:
    """One user per role, passwords from the environment (Helm, compose)."""
    return [User(role, role, "$" + password_variable(role)) for role in ROLES]


# The other secrets of a compose deployment, beside the NATS passwords and the gRPC tokens.
ENV_SECRETS = ("INFERMESH_API_KEY", "GRAFANA_ADMIN_PASSWORD")


def grpc_token_variable(identity: str) -> str:
    """The variable of compose's secrets.env (and key of Helm's auth Secret) holding identity's gRPC token."""
    return "INFERMESH_GRPC_TOKEN_" + identity.upper()


GRPC_PEERS_VARIABLE = "INFERMESH_GRPC_PEERS"
"""The variable (and Secret key) of the peers list every gRPC server takes (worker.grpc_peers)."""


def grpc_tokens() -> dict[str, str]:
    """A random gRPC token per identity of the mesh (shared/runtime/rpc_auth.py says why one each)."""
    return {identity: new_password() for identity in IDENTITIES}


def grpc_env() -> dict[str, str]:
    """Each identity's token and the peers list made of them, as variables."""
    tokens = grpc_tokens()
    return {**{grpc_token_variable(i): t for i, t in tokens.items()}, GRPC_PEERS_VARIABLE: peers_setting(tokens)}


def secrets_env() -> dict[str, str]:
    """What `--env` prints, as a dict (tests)."""
    return {**{password_variable(r): new_password() for r in ROLES}, **grpc_env(),
            **{n: new_password() for n in ENV_SECRETS}}


def new_password() -> str:
    """192 random bits as letters and digits, led by a letter: nats-server parses a
    variable's value as a config token, and reads "-x..." or "7e3..." as something else."""
    return "p" + secrets.token_hex(24)


@dataclass
class MeshCredentials:
    """The users `infermesh up` makes: one per instance, random passwords."""

    users: dict[str, User] = field(default_factory=dict)

    def add(self, name: str, role: str, instance: str = "*") -> User:
        user = User(name, role, new_password(), instance)
        self.users[name] = user
        return user

    def write_config(self, path: Path, listen_host: str, port: int, max_payload: int | None = MAX_PAYLOAD) -> None:
        """A nats-server config (mode 0600: it holds the passwords)."""
        text = f"listen: {json.dumps(f'{listen_host}:{port}')}\n" + server_config(list(self.users.values()), max_payload)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.chmod(path, 0o600)  # an older file keeps its mode through O_CREAT


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.launch.nats_auth", description=__doc__.split("\n\n")[0])
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--conf", action="store_true", help="the server's config: its limits, one user per role")
    what.add_argument("--env", action="store_true",
                      help="random secrets as VAR=value lines: NATS_<ROLE>_PASSWORD, "
                           "INFERMESH_GRPC_TOKEN_<IDENTITY>, INFERMESH_GRPC_PEERS, INFERMESH_API_KEY, "
                           "GRAFANA_ADMIN_PASSWORD (deploy/compose/secrets.env)")
    args = parser.parse_args(argv)
    if args.conf:
        sys.stdout.write("# Generated by `python -m tools.launch.nats_auth --conf`; do not edit.\n")
        sys.stdout.write(server_config(role_users()))
    else:
        for name, value in secrets_env().items():
            print(f"{name}={value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
