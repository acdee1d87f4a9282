"""The shared plumbing: settings precedence and errors, and ordered token
streams over a real nats-server."""

import dataclasses

import pytest

from shared.engine.config import EngineConfig
from shared.proto import mesh_pb2
from shared.runtime import subjects
from shared.runtime.bus import Bus, StreamReader, StreamTimeout
from shared.runtime.settings import NatsSettings, describe, field_docs, load_settings


def test_settings_defaults_then_yaml_then_env(tmp_path):
    cfg = tmp_path / "mesh.yaml"
    cfg.write_text("engine:\n  block_size: 32\n  model: /models/a\nbalancer:\n  port: 9000\n")
    s = load_settings(env={"INFERMESH_CONFIG": str(cfg), "INFERMESH_BALANCER__PORT": "9100"})
    assert s.engine.block_size == 32 and s.engine.model == "/models/a"
    assert s.balancer.port == 9100  # env beats YAML
    assert s.engine.num_kv_blocks is None and s.kvcache.ttl_s == 7 * 24 * 3600.0
    s = load_settings(env={"INFERMESH_ENGINE__NUM_KV_BLOCKS": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://j:4317"})
    assert s.engine.num_kv_blocks is None and s.telemetry.otlp_endpoint == "http://j:4317"
    assert "INFERMESH_KVCACHE__TTL_S" in describe(s)


@pytest.mark.parametrize(
    "env, message",
    [
        ({"INFERMESH_ENGINE__BLOCK_SIZE": "big"}, "cannot read 'big' as int"),
        ({"INFERMESH_ENGINE__BLOKC_SIZE": "16"}, "unknown setting engine.blokc_size"),
        ({"INFERMESH_ENGIN__MODEL": "x"}, "unknown section 'engin'"),
        ({"INFERMESH_ENGINE__DTYPE": "float64"}, "dtype must be one of"),  # EngineConfig's own check, at load
    ],
)
def test_settings_errors_name_what_to_fix(env, message):
    with pytest.raises(ValueError, match=message):
        load_settings(env=env)


def test_the_engine_section_is_engine_config_every_knob_with_its_variable_and_doc():
    settings = load_settings(env={})
    assert settings.engine == EngineConfig()
    text = describe(settings)
    docs = field_docs(EngineConfig)
    for f in dataclasses.fields(EngineConfig):
        assert f"  {f.name} = {f.default!r}    (INFERMESH_ENGINE__{f.name.upper()})" in text
        assert docs.get(f.name), f"EngineConfig.{f.name} has no docstring for `infermesh config`"
        assert f"      {docs[f.name]}" in text
    env = {
        "INFERMESH_ENGINE__KERNELS": "torch",
        "INFERMESH_ENGINE__CUDA_GRAPHS": "false",
        "INFERMESH_ENGINE__ASYNC_SCHEDULING": "true",
        "INFERMESH_ENGINE__ENABLE_PREFIX_CACHING": "0",
        "INFERMESH_ENGINE__SEED": "7",
        "INFERMESH_ENGINE__KV_CACHE_MEMORY_BYTES": "1048576",
    }
    assert load_settings(env=env).engine == EngineConfig(
        kernels="torch", cuda_graphs=False, async_scheduling=True, enable_prefix_caching=False, seed=7,
        kv_cache_memory_bytes=1 << 20,
    )


def test_subject_tokens_refuse_dots_and_wildcards():
    assert subjects.stream("decode-0", subjects.check_token("cmpl-1")) == "im.stream.decode-0.cmpl-1"
    assert subjects.stream_of_instance("decode-0") == "im.stream.decode-0.>"
    assert subjects.stream_instance("im.stream.decode-0.cmpl-1") == "decode-0"
    for bad in ("a.b", "a*", ">", "a b", ""):
        with pytest.raises(ValueError):
            subjects.check_token(bad)
        with pytest.raises(ValueError):
            subjects.stream(bad, "cmpl-1")


async def test_stream_reader_reorders_drops_duplicates_and_ends_at_final(nats_server):  # noqa: F811
    bus = await Bus.connect(NatsSettings(url=nats_server.url), "test")
    rejected: list[str] = []
    try:
        async with StreamReader(bus, "r1", lambda reason, _: rejected.append(reason)) as reader:
            await reader.listen("d0")
            subject = subjects.stream("d0", "r1")
            for seq in (1, 0, 0, 2, 1, 3):  # reordered, with duplicates
                chunk = mesh_pb2.TokenChunk(request_id="r1", seq=seq, token_ids=[100 + seq], final=seq == 3,
                                            instance_id="d0")
                await bus.publish(subject, chunk)
            got = [c.token_ids[0] async for c in reader.chunks(5, 5)]
        assert got == [100, 101, 102, 103]
        assert rejected == ["duplicate_seq", "duplicate_seq"]
        async with StreamReader(bus, "r2") as reader:
            await reader.listen("d0")
            await bus.publish(subjects.stream("d0", "r2"), mesh_pb2.TokenChunk(seq=1, request_id="r2", instance_id="d0"))
            with pytest.raises(StreamTimeout, match="no chunk 0"):  # seq 0 never comes
                async for _ in reader.chunks(0.3, 0.3):
                    pass
    finally:
        await bus.close()


async def test_request_reply_carries_trace_context_and_handler_errors(nats_server):  # noqa: F811
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider

    tracer = TracerProvider().get_tracer("test")
    bus = await Bus.connect(NatsSettings(url=nats_server.url), "test")
    seen: list[int] = []

    async def handler(req: mesh_pb2.Cancel) -> mesh_pb2.Ack:
        seen.append(trace.get_current_span().get_span_context().trace_id)
        if req.request_id == "boom":
            raise RuntimeError("boom")
        return mesh_pb2.Ack(accepted=True)

    try:
        await bus.subscribe("im.test", mesh_pb2.Cancel, handler)
        with tracer.start_as_current_span("caller") as span:
            ack = await bus.request("im.test", mesh_pb2.Cancel(request_id="ok"), mesh_pb2.Ack)
            bad = await bus.request("im.test", mesh_pb2.Cancel(request_id="boom"), mesh_pb2.Ack)
        assert ack.accepted and not bad.accepted and bad.code == mesh_pb2.ERROR_CODE_INTERNAL
        assert seen == [span.get_span_context().trace_id] * 2
    finally:
        await bus.close()
