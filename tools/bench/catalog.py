"""Every benchmark under tools/bench and the `infermesh` command that runs it (issue 31,
point 4): one list, so that `infermesh --help` names them all and a test can tell
when a new module under tools/bench is neither a benchmark here nor a helper.

A catalogued benchmark whose flags tools/cli.py does not parse itself is run as
`infermesh bench-<kind> ARGS...`: the arguments go unchanged to the module's own
`main(argv)`, so its flags and `--help` stay the module's, and `python -m
tools.bench.<module>` keeps working as before."""

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Bench:
    command: str
    """The `infermesh` subcommand (`bench-<kind>`, or `bench` for the serving load)."""
    module: str
    """Its module under tools.bench."""
    summary: str
    """One line for `infermesh --help` (the module's docstring says the rest)."""
    output: str
    """What it writes besides the screen (JSON, or the printed table under the raw-file header), by which flag."""
    gpu_only: bool = False
    """Needs a CUDA device: it cannot run on the CPU at all."""
    parsed_in_cli: bool = False
    """Its flags are parsed by tools/cli.py (the subcommands older than this list)."""

    @property
    def help(self) -> str:
        """The summary as `infermesh --help` shows it: a GPU-only bench says so."""
        return f"{self.summary} (GPU only)" if self.gpu_only else self.summary


_RAW_LOG = "--log PATH: the printed table under the raw-file header"
_RAW_OUT = "--out PATH: the printed table under the raw-file header"

BENCHES: tuple[Bench, ...] = (
    Bench("bench", "serve_bench", "load against any OpenAI-compatible server: vllm bench serve's figures",
          "--out DIR: bench.json and two plots", parsed_in_cli=True),
    Bench("bench-engine", "engine_bench", "prefill and decode throughput against transformers",
          "none (prints; wrap in `python -m tools.bench.raw_file --out PATH --`)", parsed_in_cli=True),
    Bench("bench-mesh", "mesh_bench", "throughput and TTFT through the mesh against the engine behind HTTP",
          "--json PATH, --log PATH", parsed_in_cli=True),
    Bench("bench-gpu", "gpu_bench", "Llama-3-8B-shaped decode and prefill against the card's roofline",
          "--out DIR: gpu_bench.json and .md", gpu_only=True, parsed_in_cli=True),
    Bench("bench-batch-invariant", "batch_invariant_bench", "the cost of batch-invariant mode, tokens compared",
          "--json PATH: the batch table"),
    Bench("bench-cuda-vmm", "cuda_vmm", "what the driver allows for KV shared across PID namespaces",
          "prints one JSON line", gpu_only=True),
    Bench("bench-eplb-live", "eplb_live_bench", "in-engine ITL while live EPLB moves experts (2 CPU ranks)", _RAW_OUT),
    Bench("bench-eplb-live-mesh", "eplb_live_mesh_bench", "streamed ITL through the mesh while EPLB moves experts",
          _RAW_OUT),
    Bench("bench-eplb-placement-speed", "eplb_placement_speed", "EPLB placement time and balance against a revision's",
          _RAW_OUT),
    Bench("bench-eplb-sim", "eplb_sim", "EPLB placement quality and cost on a synthetic routing trace (a simulation)",
          _RAW_OUT),
    Bench("bench-kvcache", "kvcache_bench", "the kvcache service's gRPC byte stream against shared memory", _RAW_LOG),
    Bench("bench-kvcache-nixl", "kvcache_nixl_bench", "kvcache Gets through NIXL against the byte stream, across "
          "namespaces (root)", _RAW_LOG + "; JSON ROUND and SUMMARY lines"),
    Bench("bench-nixl", "nixl_bench", "the KV handoff through NIXL alone between two namespaced processes",
          "prints a JSON line per row"),
    Bench("bench-one-request", "one_request_bench", "a batch's tokens/s with one structured, penalties or logprobs "
          "request in it against without", "none (prints; wrap in `python -m tools.bench.raw_file --out PATH --`)"),
    Bench("bench-peer-copy", "peer_copy_bench", "the direct prefill -> decode KV copy (CUDA IPC or shared memory)",
          _RAW_LOG),
    Bench("bench-prefix-routing", "prefix_routing_bench", "a shared system prompt on 4 prefill instances: prefix-first "
          "routing against the KV-router cost (a simulation)", _RAW_OUT),
    Bench("bench-prefix-routing-mesh", "prefix_routing_mesh", "the same shared system prompt through two real meshes "
          "of 4 prefill instances: KV-router cost against prefix first", _RAW_OUT),
    Bench("bench-routing", "routing_bench", "multi-turn chats: always against conditionally disaggregated",
          "--json PATH"),
    Bench("bench-spec", "spec_bench", "speculative decoding against none: throughput and accepted length",
          "--json PATH"),
    Bench("bench-spec-plain-steps", "spec_plain_steps", "a speculating engine's plain steps against a plain engine's",
          "none (prints; wrap in `python -m tools.bench.raw_file --out PATH --`)"),
    Bench("bench-sps-sim", "sps_sim", "steps per second by batch and DSpark's choice on it (a simulation)",
          "--json PATH"),
    Bench("bench-swa", "swa_bench", "SWA replay: persisted bytes, TTFT of a cached hit, drift", "--json PATH"),
    Bench("bench-tier", "tier_bench", "TTFT of a prefix hit from each KV tier against cold",
          "--out DIR: tiers.json and .md"),
    Bench("bench-ttft", "ttft_bench", "TTFT of a long prompt, containers' mesh (PID namespaces) against one namespace",
          "prints a JSON line per round"),
    Bench("bench-v4", "v4_bench", "DeepSeek-V4 in the engine: decode tok/s, long-prompt TTFT, time by kind",
          "--out DIR: v4_bench.json and .md"),
    Bench("bench-v4-bf16-error", "v4_bf16_error", "V4's bf16 logprob error, our kernels against transformers'",
          "none (prints; wrap in `python -m tools.bench.raw_file --out PATH --`)"),
    Bench("bench-v4-kv-bytes", "v4_kv_bytes", "DeepSeek-V4's persisted KV bytes per token, window kept or not",
          "none (prints; wrap in `python -m tools.bench.raw_file --out PATH --`)"),
    Bench("bench-v4-kv-pages", "v4_kv_pages", "DeepSeek-V4's KV bytes per token and tokens per budget, by layout",
          "none (prints; wrap in `python -m tools.bench.raw_file --out PATH --`)"),
    Bench("bench-vision", "vision_bench", "the vision stage: embedding cache and E/P/D against P/D, over HTTP",
          "--json PATH, --log PATH"),
)  # fmt: skip

HELPERS: dict[str, str] = {
    "__init__": "the package",
    "bench_plots": "bench's plots",
    "catalog": "this list",
    "gpu_profile": "run by `infermesh bench-gpu --profile`",
    "local_server": "bench-mesh's http target (its __main__ is that child process)",
    "mesh_report": "bench-mesh's printed report",
    "mesh_traces": "bench-mesh's trace breakdown",
    "openai_stream": "one streamed, timed request (bench, bench-mesh)",
    "raw_file": "the raw files' header; its __main__ wraps a bench that only prints",
    "rounds": "bench-mesh's schedule and arithmetic",
    "spec_replay": "bench-spec's replayed acceptance profiles",
    "step_times": "step times by depth (bench-spec-plain-steps)",
    "workloads": "what bench sends",
}
"""Modules under tools/bench that are not benchmarks of their own, and what they serve."""

_BY_COMMAND = {bench.command: bench for bench in BENCHES}


def find(command: str) -> Bench | None:
    """The benchmark `infermesh <command>` runs, if command names one."""
    return _BY_COMMAND.get(command)
