"""The mesh as deployed, on this CPU: kvcache, prefill and decode each in a network
and PID namespace of its own that the test makes (tools/launch/netns.py), as on
three hosts; nats-server and the balancer in the root namespace on the bridge's
address. Closed as `infermesh up` runs it: NATS users with their permissions, the
gRPC token. What crosses namespaces goes over the bridge, as between hosts; the
same-namespace paths (the direct copy out of prefill's cache, kvcache's shared
memory) are refused, since /proc/<pid> names another process in another PID
namespace.

Greedy completions through the balancer's HTTP API equal the offline engine's
(token ids exactly, logprobs to float rounding); each went prefill -> decode, in
a bounded time; decode did not map prefill's cache; each decode span names the KV
path it took (`kv.path`), which between hosts is NIXL's, and every full block of
the prompt arrived by it.

Each request's decode span names the path its KV took: NIXL (UCX over TCP
between the namespaces), never the same-namespace copy, never kvcache's byte
stream. Without direct transfer decode loads the prompt from kvcache instead, and
kvcache writes it through NIXL too (kv.kvcache_plane=nixl), never by its byte stream.
Tensor-parallel instances (two ranks each) hand off through NIXL too: rank 0's
agent reads every rank's part. The two fault tests lose the peer during or before the read: a visible
recompute (kv.path=recompute), the right tokens, nothing hung. Needs root and `ip netns` (it skips, saying so, without them)."""

import asyncio
import concurrent.futures
import contextlib
import functools
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import nats
import openai
import pytest

from shared.engine.llm import LLM
from shared.engine.sampling_params import SamplingParams
from shared.proto import mesh_pb2
from shared.runtime import subjects
from tests.helpers.mesh import running_mesh
from tests.helpers.mesh_procs import span_attributes
from tools.launch.netns import INNER_DEVICE, HostsUnavailable, Lab, namespaces
from tools.launch.trace_view import load_spans
from tools.launch.up import Mesh, Placement

EXPECTED_KV_PATH = "nixl"
"""The KV path of every decode span here: between namespaces (hosts), NIXL over UCX's TCP."""
BLOCK = 16
REQUEST_BOUND_S = 60.0
"""No request may take longer than this (a tiny model: seconds each, on a busy 2-core machine)."""
HOSTS = ["kvcache", "prefill-0", "decode-0"]
"""The services that run in namespaces of their own (one each), by their mesh names."""
ENV = {
    "INFERMESH_ENGINE__BLOCK_SIZE": str(BLOCK),
    "INFERMESH_WORKER__HEARTBEAT_INTERVAL_S": "0.5",
    # A decode or prefill frozen for a moment (the fault tests do it) stays in the registry.
    "INFERMESH_BALANCER__HEARTBEAT_MISSES": "20",
    # NIXL between namespaces goes over TCP on each namespace's interface, never
    # through UCX's same-node shared memory (one boot, one /dev/shm): as between hosts.
    "UCX_TLS": "tcp",
    "UCX_NET_DEVICES": INNER_DEVICE,
    "INFERMESH_KV_TRANSFER__NIXL_TRANSFER_TIMEOUT_S": "5",
}
LONG_PROMPT = "".join(f"def step_{i}(values):\n    return [v * {i} + {i % 7} for v in values]\n\n" for i in range(40))
PROMPTS = [
    "import os\n\n\ndef read_lines(path):\n",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n",
    "".join(f"# line {i}: the quick brown fox jumps over the lazy dog\n" for i in range(6)),
    LONG_PROMPT,
]
MAX_TOKENS = 12
LOGPROB_TOL = 1e-4
READ_STARTS_WITHIN_S = 10.0
"""Decode's read of a handed-off prompt's KV flows within this of the request's start."""


@contextlib.contextmanager
def lab_of(labels: list[str]) -> Iterator[Lab]:
    """namespaces(labels), or the test skipped with the reason they cannot be made here."""
    with contextlib.ExitStack() as stack:
        try:
            lab = stack.enter_context(namespaces(labels))
        except HostsUnavailable as exc:
            pytest.skip(str(exc))
        yield lab


def placed_mesh(mesh_model_dir: str, state_dir: Path, lab: Lab, env: dict[str, str] | None = None,
                **options: Any) -> contextlib.AbstractContextManager[Mesh]:  # fmt: skip
    """running_mesh (Mesh's options) with nats-server and the balancer on the bridge's
    address, and each service the lab has a namespace for in it, bound to its address;
    env: settings beside ENV."""
    placements = {name: Placement(lab.gateway) for name in ("nats", "balancer")}
    for name, host in lab.hosts.items():
        placements[name] = Placement(host.address, functools.partial(lab.command, name))
    return running_mesh(mesh_model_dir, state_dir, host=lab.gateway, placements=placements,
                        extra_env={**ENV, **(env or {})}, **options)  # fmt: skip


@pytest.fixture(scope="module")
def lab_mesh(mesh_model_dir, tmp_path_factory) -> Iterator[tuple[Mesh, Lab]]:
    with lab_of(HOSTS) as lab, placed_mesh(mesh_model_dir, tmp_path_factory.mktemp("netns-mesh"), lab) as mesh:
        yield mesh, lab


@pytest.fixture(scope="module")
def offline(mesh_model_dir) -> LLM:
    return LLM(mesh_model_dir, block_size=BLOCK)


def client_of(mesh: Mesh) -> openai.OpenAI:
    return openai.OpenAI(base_url=mesh.api_url, api_key="x", max_retries=0, timeout=REQUEST_BOUND_S)


def greedy(offline: LLM, prompt: str):  # noqa: ANN201 - CompletionOutput
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, logprobs=1, ignore_eos=True)
    return offline.generate([prompt], params)[0]


def request_spans(mesh: Mesh, request_id: str, timeout_s: float = 30.0) -> dict[str, list[dict]]:
    """The spans of a request's trace by name, once its decode span has been written."""
    span_attributes(mesh.trace_dir, request_id, "decode", timeout_s)  # waits for the files
    spans = load_spans(mesh.trace_dir)
    root = next(s for s in spans if s["attributes"].get("request.id") == request_id and s["parent_id"] is None)
    by_name: dict[str, list[dict]] = {}
    for s in spans:
        if s["trace_id"] == root["trace_id"]:
            by_name.setdefault(s["name"], []).append(s)
    return by_name


def kv_attributes(attributes: dict) -> str:
    return " ".join(f"{k}={v}" for k, v in sorted(attributes.items()) if k.startswith("kv."))


def same_logprobs(got: list[float], expected) -> bool:  # noqa: ANN001
    """Equal to the offline engine's, to float rounding (the batch shapes differ: seen 5e-7
    apart; test_local_prefill's bound)."""
    return got == pytest.approx([lp.logprob for lp in expected.logprobs], abs=LOGPROB_TOL)


def assert_equals_offline(choice, usage, expected) -> None:  # noqa: ANN001
    assert choice.token_ids == expected.token_ids
    assert same_logprobs(choice.logprobs.token_logprobs, expected)
    assert usage.prompt_tokens == len(expected.prompt_token_ids) and usage.completion_tokens == MAX_TOKENS


def equal_to_offline(mesh: Mesh, offline: LLM, prompt: str) -> tuple[dict[str, list[dict]], int]:
    """A greedy completion of prompt through the mesh, checked equal to the offline
    engine's; its trace's spans by name and the number of the prompt's full blocks."""
    client = client_of(mesh)
    expected = greedy(offline, prompt)
    out = client.completions.create(model=client.models.list().data[0].id, prompt=prompt, max_tokens=MAX_TOKENS,
                                    temperature=0, logprobs=1,
                                    extra_body={"return_token_ids": True, "ignore_eos": True})  # fmt: skip
    assert_equals_offline(out.choices[0], out.usage, expected)
    spans = request_spans(mesh, out.id)
    print(f"{len(expected.prompt_token_ids)} prompt tokens; decode {kv_attributes(spans['decode'][0]['attributes'])}")
    return spans, len(expected.prompt_token_ids) // BLOCK


LISTENER = """
import signal, socket, sys
signal.signal(signal.SIGTERM, lambda *_: sys.exit(7))
s = socket.create_server((sys.argv[1], 7000))
while True:
    s.accept()[0].sendall(b"hi")
"""


def test_the_lab_carries_tcp_forwards_sigterm_and_leaves_nothing_behind():
    with pytest.raises(ZeroDivisionError), lab_of(["a", "b"]) as lab:
        a = lab["a"].address
        server = subprocess.Popen(lab.command("a", [sys.executable, "-c", LISTENER, a]))
        client = [sys.executable, "-c", f"import socket; print(socket.create_connection(('{a}', 7000), 5).recv(2))"]
        deadline = time.monotonic() + 20
        while True:  # from namespace b, and from the root namespace over the bridge
            got = subprocess.run(lab.command("b", client), capture_output=True, text=True)
            if got.returncode == 0 or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert got.stdout.strip() == "b'hi'", got.stderr
        assert subprocess.run(client, capture_output=True, text=True).stdout.strip() == "b'hi'"
        # In a PID namespace of its own; SIGTERM reaches it through the outer process.
        assert os.readlink(f"/proc/{lab.service_pid('a')}/ns/pid") != os.readlink("/proc/self/ns/pid")
        server.send_signal(signal.SIGTERM)
        assert server.wait(10) == 7
        left = subprocess.Popen(lab.command("a", ["sleep", "60"]))
        names = [host.name for host in lab.hosts.values()] + [lab.bridge]
        1 / 0  # a failing test: the lab goes all the same
    assert left.wait(10) != 0  # killed
    assert not any(name in subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
                   for name in names[-1:] + [f"im{lab.slot}v"])
    assert not set(names[:-1]) & set(subprocess.run(["ip", "netns", "list"], capture_output=True,
                                                    text=True).stdout.split())


def test_completions_across_namespaces_equal_offline_and_name_the_nixl_path(lab_mesh, offline):
    mesh, lab = lab_mesh
    client = client_of(mesh)
    name = client.models.list().data[0].id
    assert len(greedy(offline, LONG_PROMPT).prompt_token_ids) > 512  # many KV blocks to move
    for prompt in PROMPTS:
        expected = greedy(offline, prompt)
        started = time.monotonic()
        out = client.completions.create(model=name, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, logprobs=1,
                                        extra_body={"return_token_ids": True, "ignore_eos": True})  # fmt: skip
        took = time.monotonic() - started
        assert took < REQUEST_BOUND_S
        assert_equals_offline(out.choices[0], out.usage, expected)

        spans = request_spans(mesh, out.id)
        # Disaggregated: routed to prefill-0, handed to decode-0, each in its namespace.
        route = spans["route"][0]["attributes"]
        assert route["prefill.local"] is False
        assert (route["prefill.choice"], route["decode.choice"]) == ("prefill-0", "decode-0")
        assert len(spans["prefill"]) == 1 and len(spans["decode"]) == 1
        assert spans["prefill"][0]["service"] == "prefill" and spans["decode"][0]["service"] == "decode"
        decode = spans["decode"][0]["attributes"]
        full_blocks = len(expected.prompt_token_ids) // BLOCK
        print(f"{len(expected.prompt_token_ids)} prompt tokens in {took:.1f} s: prefill held "
              f"{spans['prefill'][0]['attributes'].get('kv.held_blocks')} blocks; decode {kv_attributes(decode)}")
        # Prefill offered its cache for the same-namespace copy; decode, in another PID
        # namespace, could not map it and did not use it (kv.loaded_direct is true for a
        # NIXL read too: straight out of the peer's cache).
        if full_blocks:
            assert spans["prefill"][0]["attributes"]["kv.held_blocks"] == full_blocks
        assert decode.get("kv.path") != "peer"
        assert decode["kv.load_failed"] is False
        # Nor was kvcache's shared memory used, where kvcache served a read.
        for get in (s for group in spans.values() for s in group if "kvcache.shm" in s["attributes"]):
            assert get["attributes"]["kvcache.shm"] is False, get
        if full_blocks:
            assert decode.get("kv.path") == EXPECTED_KV_PATH, f"decode span: {decode}"
        # Every full block of the prompt reached decode, none recomputed there.
        assert decode["kv.loaded_blocks"] == full_blocks


def test_containers_sharing_a_volume_copy_kv_directly(mesh_model_dir, tmp_path, offline):
    """Prefill and decode in namespaces of their own, as containers of one host, given a
    directory both see (kv_share_dir: a shared volume): prefill hands its cache's memory
    over a unix socket there, and decode copies the held blocks straight out of it
    (kv.path=peer), not through NIXL or kvcache; the tokens equal the offline engine's."""
    env = {"INFERMESH_ENGINE__KV_SHARE_DIR": str(tmp_path / "kv-share")}
    with lab_of(HOSTS) as lab, placed_mesh(mesh_model_dir, tmp_path / "mesh", lab, env=env) as mesh:
        for prompt in (LONG_PROMPT, PROMPTS[2]):
            spans, full_blocks = equal_to_offline(mesh, offline, prompt)
            decode = spans["decode"][0]["attributes"]
            assert decode["kv.load_failed"] is False
            assert (decode["kv.path"], decode["kv.loaded_blocks"]) == ("peer", full_blocks), decode


def test_tensor_parallel_instances_hand_off_through_nixl(mesh_model_dir, tmp_path, offline):
    """Prefill and decode of two ranks each (tensor parallel, the tiny Llama's 4 KV heads
    2 a rank), each instance in its namespace (host): decode's rank 0 reads every rank's
    part of the held blocks out of prefill's ranks in one NIXL read (each side's agent in
    its rank 0, every rank's cache registered there: shared/kv/memory/ranked_region.py),
    kv.path=nixl for every full block, not kvcache's byte stream; the tokens equal the
    offline engine's (tensor-parallel logits within rounding of one process's)."""
    env = {"INFERMESH_ENGINE__TENSOR_PARALLEL_SIZE": "2"}
    with lab_of(HOSTS) as lab, placed_mesh(mesh_model_dir, tmp_path / "mesh", lab, env=env) as mesh:
        for prompt in (LONG_PROMPT, PROMPTS[2]):
            spans, full_blocks = equal_to_offline(mesh, offline, prompt)
            decode = spans["decode"][0]["attributes"]
            assert decode["kv.load_failed"] is False and full_blocks > 0
            assert (decode["kv.path"], decode["kv.loaded_blocks"]) == (EXPECTED_KV_PATH, full_blocks), decode


def test_without_direct_transfer_decode_loads_from_kvcache_through_nixl(mesh_model_dir, tmp_path, offline):
    """kv_direct_transfer off: prefill holds nothing for decode, which loads the prompt's
    blocks from kvcache, in another namespace (host). kvcache cannot open decode's shared
    memory there, so it WRITEs the blocks into decode's NIXL landing buffer (UCX over TCP
    on the bridge) and gRPC carries only headers: kv.path=kvcache, kv.kvcache_plane=nixl,
    every full block, the first request's load included."""
    env = {"INFERMESH_ENGINE__KV_DIRECT_TRANSFER": "false"}
    with lab_of(HOSTS) as lab, placed_mesh(mesh_model_dir, tmp_path, lab, env=env) as mesh:
        for prompt in (LONG_PROMPT, PROMPTS[2]):
            spans, full_blocks = equal_to_offline(mesh, offline, prompt)
            decode = spans["decode"][0]["attributes"]
            assert decode["kv.loaded_direct"] is False and decode["kv.load_failed"] is False
            assert (decode["kv.path"], decode["kv.kvcache_plane"]) == ("kvcache", "nixl"), decode
            assert decode["kv.loaded_blocks"] == full_blocks
            # kvcache's side of it: its Gets wrote the blocks through NIXL, none into shared memory.
            gets = [s["attributes"] for group in spans.values() for s in group if "kvcache.nixl_bytes" in s["attributes"]]
            assert gets and not any(get["kvcache.shm"] for get in gets), gets
            assert sum(get["kvcache.nixl_bytes"] for get in gets) == decode["kv.loaded_bytes"] > 0, gets


# -- faults on the NIXL path ------------------------------------------------------------------
# kvcache is stopped first in both: the peer is then the only place the KV is, and losing
# it must end in a recompute, not a read from kvcache.


@pytest.fixture(scope="module")
def fault_mesh(mesh_model_dir, tmp_path_factory) -> Iterator[tuple[Mesh, Lab]]:
    """A mesh of its own with two prefill instances (each fault test loses one), and
    kvcache stopped."""
    with lab_of(HOSTS + ["prefill-1"]) as lab, \
         placed_mesh(mesh_model_dir, tmp_path_factory.mktemp("netns-fault-mesh"), lab, num_prefill=2) as mesh:
        kvcache = dict(mesh.procs)["kvcache"]
        kvcache.kill()  # its outer process: unshare and the service die with it
        kvcache.wait(10)
        deadline = time.monotonic() + 10
        while lab.pids("kvcache") and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not lab.pids("kvcache")
        yield mesh, lab


def first_chunk(mesh: Mesh, prompt: str):  # noqa: ANN201 - (the chunk iterator, its first chunk)
    client = client_of(mesh)
    chunks = iter(client.completions.create(
        model=client.models.list().data[0].id, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, logprobs=1,
        stream=True, stream_options={"include_usage": True}, extra_body={"return_token_ids": True, "ignore_eos": True},
    ))
    return chunks, next(chunks)


def finish(chunks, first) -> tuple[list[int], list[float]]:  # noqa: ANN001
    """Token ids and logprobs of a stream, from its first chunk on."""
    ids, logprobs = [], []
    for chunk in [first, *chunks]:
        if chunk.choices:
            ids += chunk.choices[0].token_ids or []
            logprobs += chunk.choices[0].logprobs.token_logprobs if chunk.choices[0].logprobs else []
    return ids, logprobs


def handoff_of(mesh: Mesh, send: Callable[[], None], timeout_s: float = REQUEST_BOUND_S) -> mesh_pb2.DecodeHandoff:
    """send() a request, and the handoff of it that NATS carries to decode-0 (watched as
    the operator, subscribed before the request goes): which prefill instance computed
    it, and that it has."""

    async def go() -> mesh_pb2.DecodeHandoff:
        nc = await nats.connect(mesh.nats_url)
        try:
            sub = await nc.subscribe(subjects.decode_admit("decode-0"))
            await nc.flush()
            send()
            msg = await sub.next_msg(timeout=timeout_s)
            handoff = mesh_pb2.DecodeHandoff()
            handoff.ParseFromString(msg.data)
            return handoff
        finally:
            await nc.close()

    return asyncio.run(go())


def test_prefill_killed_while_decode_reads_its_kv_ends_in_a_recompute(fault_mesh, offline):
    mesh, lab = fault_mesh
    prompt = LONG_PROMPT + "# killed while read\n"
    expected = greedy(offline, prompt)
    prefills = [name for name, proc in mesh.procs if name.startswith("prefill-") and proc.poll() is None]
    # ~4 KB of KV per token at 1 MB/s out of prefill: decode's read of the prompt takes seconds.
    for name in prefills:
        lab.limit_rate(name, "8mbit")
    try:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            started = time.monotonic()
            pending: list[concurrent.futures.Future] = []
            victim = handoff_of(mesh, lambda: pending.append(pool.submit(first_chunk, mesh, prompt))).prefill_instance
            chunks, first = pending[0].result(REQUEST_BOUND_S)  # decode sends it before it reads the KV
        sent = lab.bytes_out(victim)
        reading = False  # the read flows: the victim sends far more than its heartbeats would
        while time.monotonic() - started < READ_STARTS_WITHIN_S and not reading:
            reading = lab.bytes_out(victim) - sent > 128 << 10
            time.sleep(0.02)
        os.kill(lab.service_pid(victim), signal.SIGKILL)
        ids, logprobs = finish(chunks, first)
        took = time.monotonic() - started
    finally:
        for name in prefills:
            lab.limit_rate(name, None)
    assert took < REQUEST_BOUND_S
    assert ids == expected.token_ids and same_logprobs(logprobs, expected)
    decode = request_spans(mesh, first.id)["decode"][0]["attributes"]
    print(f"{victim} killed while decode read: {took:.1f} s; decode {kv_attributes(decode)}")
    assert reading, f"decode never read {victim}'s KV: {decode}"
    assert decode.get("kv.path") == "recompute", f"decode span: {decode}"


def test_a_nixl_peer_gone_before_decode_reads_ends_in_a_recompute(fault_mesh, offline):
    mesh, lab = fault_mesh
    prompt = LONG_PROMPT + "# gone before read\n"
    expected = greedy(offline, prompt)
    decode_pid = lab.service_pid("decode-0")
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        pending: list[concurrent.futures.Future] = []
        started = time.monotonic()
        os.kill(decode_pid, signal.SIGSTOP)  # decode takes the handoff only once its peer is gone
        try:
            # Prefill computes the prompt, holds its KV and hands it over; then it freezes (no
            # answer to decode's NIXL metadata request, no read), and it dies once decode has
            # sent the first token (from then on the balancer no longer waits on prefill).
            victim = handoff_of(mesh, lambda: pending.append(pool.submit(first_chunk, mesh, prompt))).prefill_instance
            os.kill(lab.service_pid(victim), signal.SIGSTOP)
        finally:
            os.kill(decode_pid, signal.SIGCONT)
        chunks, first = pending[0].result(REQUEST_BOUND_S)
    os.kill(lab.service_pid(victim), signal.SIGKILL)
    ids, logprobs = finish(chunks, first)
    took = time.monotonic() - started
    assert took < REQUEST_BOUND_S
    assert ids == expected.token_ids and same_logprobs(logprobs, expected)
    decode = request_spans(mesh, first.id)["decode"][0]["attributes"]
    print(f"{victim} gone before decode read: {took:.1f} s; decode {kv_attributes(decode)}")
    assert decode.get("kv.path") == "recompute", f"decode span: {decode}"
