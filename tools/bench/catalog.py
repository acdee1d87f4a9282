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
    tiny: tuple[str, ...] | None = None
    """The smallest arguments it runs with on the CPU, for tests/unit/test_bench_tiny.py:
    `{tmp}` is a fresh folder, `{model}` a seeded tiny llama with a tokenizer (make-model),
    `{spec_json}` bench-spec's JSON from its own tiny run. None: see not_tiny."""
    not_tiny: str = ""
    """Why it has no tiny run in that test (a GPU, too slow, or covered elsewhere)."""

    @property
    def help(self) -> str:
        """The summary as `infermesh --help` shows it: a GPU-only bench says so."""
        return f"{self.summary} (GPU only)" if self.gpu_only else self.summary


def _args(line: str) -> tuple[str, ...]:
    return tuple(line.split())


_RAW_LOG = "--log PATH: the printed table under the raw-file header"
_RAW_OUT = "--out PATH: the printed table under the raw-file header"

BENCHES: tuple[Bench, ...] = (
    Bench("bench", "serve_bench", "load against any OpenAI-compatible server: vllm bench serve's figures",
          "--out DIR: bench.json and two plots", parsed_in_cli=True,
          not_tiny="needs a running server (--base-url): tests/mesh/test_serve_bench.py runs it against LocalServer "
                   "and a mesh"),
    Bench("bench-engine", "engine_bench", "prefill and decode throughput against transformers",
          "--json PATH: a row per batch size", parsed_in_cli=True,
          tiny=_args("--model {model} --batch-sizes 1 --prompt-len 8 --output-len 4 --json {tmp}/engine.json")),
    Bench("bench-mesh", "mesh_bench", "throughput and TTFT through the mesh against the engine behind HTTP",
          "--json PATH, --log PATH", parsed_in_cli=True,
          tiny=_args("--model {model} --concurrency 1 --num-requests 2 --rounds 3 --prompt-len 8 --output-len 4 "
                     "--json {tmp}/mesh.json --log {tmp}/mesh.log")),
    Bench("bench-gpu", "gpu_bench", "Llama-3-8B-shaped decode and prefill against the card's roofline",
          "--out DIR: gpu_bench.json and .md", gpu_only=True, parsed_in_cli=True,
          not_tiny="GPU only"),
    Bench("bench-batch-invariant", "batch_invariant_bench", "the cost of batch-invariant mode, tokens compared",
          "--json PATH: the batch table",
          tiny=_args("--model {model} --batch 1 2 --prompt-len 8 --max-tokens 4 --json {tmp}/batch_invariant.json")),
    Bench("bench-cuda-vmm", "cuda_vmm", "what the driver allows for KV shared across PID namespaces",
          "--json PATH: the probe's row; prints one JSON line", gpu_only=True,
          not_tiny="GPU only"),
    Bench("bench-eplb-live", "eplb_live_bench", "in-engine ITL while live EPLB moves experts (2 CPU ranks)",
          "--json PATH: a row per round and target; " + _RAW_OUT,
          tiny=_args("--rounds 3 --requests 4 --max-tokens 16 --out {tmp}/eplb_live.txt --json {tmp}/eplb_live.json")),
    Bench("bench-eplb-live-mesh", "eplb_live_mesh_bench", "streamed ITL through the mesh while EPLB moves experts",
          "--json PATH: a row per round and target; " + _RAW_OUT,
          tiny=_args("--rounds 3 --requests 4 --max-tokens 16 --out {tmp}/eplb_live_mesh.txt --json "
                     "{tmp}/eplb_live_mesh.json")),
    Bench("bench-eplb-placement-speed", "eplb_placement_speed", "EPLB placement time and balance against a revision's",
          "--json PATH: timing rows, balance; " + _RAW_OUT,
          tiny=_args("--baseline-rev none --layers 2 --repeats 2 --warmup 1 --window 20 --out {tmp}/placement.txt "
                     "--json {tmp}/placement.json")),
    Bench("bench-eplb-sim", "eplb_sim", "EPLB placement quality and cost on a synthetic routing trace (a simulation)",
          "--json PATH: the case rows, placement times; " + _RAW_OUT,
          tiny=_args("--layers 2 --experts 128 --ep 16 --sigma 0.5 --tokens-per-step 64 --drift-steps 200 --window "
                     "20 --interval 20 --intervals 2 --repeats 2 --out {tmp}/eplb_sim.txt --json {tmp}/eplb_sim.json")),
    Bench("bench-kvcache", "kvcache_bench", "the kvcache service's gRPC byte stream against shared memory",
          "--json PATH: GB/s rows by path and step; " + _RAW_LOG,
          tiny=_args("--blocks 4 --block-mib 0.25 --rounds 1 --shm-mib 8 --log {tmp}/kvcache.log --json "
                     "{tmp}/kvcache.json")),
    Bench("bench-kvcache-nixl", "kvcache_nixl_bench", "kvcache Gets through NIXL against the byte stream, across "
          "namespaces (root)", "--json PATH: a row per round, the summary; " + _RAW_LOG + "; JSON ROUND and SUMMARY lines",
          tiny=_args("--tokens 64 --layers 1 --rounds 5 --log {tmp}/kvcache_nixl.log --json {tmp}/kvcache_nixl.json")),
    Bench("bench-nixl", "nixl_bench", "the KV handoff through NIXL alone between two namespaced processes",
          "--json PATH: a row per prompt size; prints a JSON line per row",
          tiny=_args("--device cpu --layers 2 --blocks 64 --prompts 1024 --reps 1 --json {tmp}/nixl.json")),
    Bench("bench-one-request", "one_request_bench", "a batch's tokens/s with one structured, penalties or logprobs "
          "request in it against without", "--json PATH: a row per engine and variant",
          tiny=_args("--model {model} --batch 2 --tokens 4 --rounds 1 --json {tmp}/one_request.json")),
    Bench("bench-peer-copy", "peer_copy_bench", "the direct prefill -> decode KV copy (CUDA IPC or shared memory)",
          "--json PATH: a row per prompt length; " + _RAW_LOG,
          tiny=_args("--device cpu --layers 2 --blocks 8 --reps 1 --log {tmp}/peer_copy.log --json "
                     "{tmp}/peer_copy.json")),
    Bench("bench-prefix-routing", "prefix_routing_bench", "a shared system prompt on 4 prefill instances: prefix-first "
          "routing against the KV-router cost (a simulation)", "--json PATH: a row per seed and policy; " + _RAW_OUT,
          tiny=_args("--duration-s 2 --warmup-s 0.5 --seeds 1 --system-tokens 64 --cache-blocks 64 --out "
                     "{tmp}/prefix_routing.txt --json {tmp}/prefix_routing.json")),
    Bench("bench-prefix-routing-mesh", "prefix_routing_mesh", "the same shared system prompt through two real meshes "
          "of 4 prefill instances: KV-router cost against prefix first",
          "--json PATH: a row per routing and round; " + _RAW_OUT,
          tiny=_args("--model {model} --prefill 2 --requests 4 --rounds 1 --concurrency 2 --system-tokens 64 "
                     "--out {tmp}/prefix_routing_mesh.txt --json {tmp}/prefix_routing_mesh.json")),
    Bench("bench-routing", "routing_bench", "multi-turn chats: always against conditionally disaggregated",
          "--json PATH",
          tiny=_args("--model {model} --decode 1 --conversations 2 --turns 2 --concurrency 2 --input-len 4 "
                     "--output-len 4 --rounds 1 --json {tmp}/routing.json")),
    Bench("bench-spec", "spec_bench", "speculative decoding against none: throughput and accepted length",
          "--json PATH",
          tiny=_args("--model {model} --draft {model} --batch 1 --spec-tokens 2 --max-tokens 6 --json "
                     "{tmp}/spec.json")),
    Bench("bench-spec-plain-steps", "spec_plain_steps", "a speculating engine's plain steps against a plain engine's",
          "--json PATH: a row per batch and engine",
          tiny=_args("--model {model} --draft {model} --batch 1 --rounds 1 --json {tmp}/spec_plain_steps.json")),
    Bench("bench-sps-sim", "sps_sim", "steps per second by batch and DSpark's choice on it (a simulation)",
          "--json PATH",
          tiny=_args("--model {model} --dtype float32 --device cpu --acceptance {spec_json} --batch 1 --max-tokens 8 "
                     "--json {tmp}/sps.json")),
    Bench("bench-swa", "swa_bench", "SWA replay: persisted bytes, TTFT of a cached hit, drift", "--json PATH",
          tiny=_args("--prompt-len 64 --drift-tokens 4 --json {tmp}/swa.json")),
    Bench("bench-tier", "tier_bench", "TTFT of a prefix hit from each KV tier against cold",
          "--out DIR: tiers.json and .md",
          tiny=_args("--model {model} --prompt-len 64 --repeats 1 --warmup 0 --out {tmp}/tier")),
    Bench("bench-ttft", "ttft_bench", "TTFT of a long prompt, containers' mesh (PID namespaces) against one namespace",
          "--json PATH: a row per round, the summary; prints a JSON line",
          tiny=_args("--model {model} --prompt-len 64 --rounds 1 --json {tmp}/ttft.json")),
    Bench("bench-v4", "v4_bench", "DeepSeek-V4 in the engine: decode tok/s, long-prompt TTFT, time by kind",
          "--out DIR: v4_bench.json and .md",
          tiny=_args("--model {tmp}/v4 --preset tiny --device cpu --dtype float32 --batches 1 --context 12 "
                     "--decode-steps 2 --prefill 24 --repeats 1 --no-cuda-graphs --out {tmp}/v4_out")),
    Bench("bench-v4-bf16-error", "v4_bf16_error", "V4's bf16 logprob error, our kernels against transformers'",
          "--json PATH: a row per kernels and prompt",
          tiny=_args("--device cpu --max-tokens 4 --kernels torch --json {tmp}/v4_bf16_error.json")),
    Bench("bench-v4-kv-bytes", "v4_kv_bytes", "DeepSeek-V4's persisted KV bytes per token, window kept or not",
          "--json PATH: a row per shape and kind of bytes",
          tiny=_args("--json {tmp}/v4_kv_bytes.json")),
    Bench("bench-v4-kv-pages", "v4_kv_pages", "DeepSeek-V4's KV bytes per token and tokens per budget, by layout",
          "--json PATH: a row per layout",
          tiny=_args("--json {tmp}/v4_kv_pages.json")),
    Bench("bench-vision", "vision_bench", "the vision stage: embedding cache and E/P/D against P/D, over HTTP",
          "--json PATH, --log PATH",
          tiny=_args("--figures cache --rounds 3 --requests 2 --concurrency 1 --max-tokens 2 --image-size 32 --pool "
                     "1 --json {tmp}/vision.json --log {tmp}/vision.log")),
    Bench("bench-vision-goodput", "vision_goodput", "Qwen2.5-VL requests of several images: goodput at TTFT and "
          "TPOT targets, E/P/D against aggregated, and the embedding handoff's time",
          "--json PATH: per level the rounds, ratios and trace figures; " + _RAW_OUT,
          tiny=_args("--concurrency 1 --num-requests 2 --images-per-request 2 --image-px 32 --rounds 3 --max-tokens 2 "
                     "--ttft-target-ms 60000 --tpot-target-ms 60000 --out {tmp}/vision_goodput.txt --json "
                     "{tmp}/vision_goodput.json")),
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
    "plot_rows": "`infermesh bench-plot`: any bench's --json rows as a PNG",
    "raw_file": "the raw files' header; its __main__ wraps a bench that only prints",
    "rounds": "bench-mesh's schedule and arithmetic",
    "spec_replay": "bench-spec's replayed acceptance profiles",
    "step_times": "step times by depth (bench-spec-plain-steps)",
    "workloads": "what bench sends",
}
"""Modules under tools/bench that are not benchmarks of their own, and what they serve."""

PLOT_COMMAND = "bench-plot"
"""Draws any bench's --json rows (tools/bench/plot_rows.py): not a benchmark itself."""

_BY_COMMAND = {bench.command: bench for bench in BENCHES}


def find(command: str) -> Bench | None:
    """The benchmark `infermesh <command>` runs, if command names one."""
    return _BY_COMMAND.get(command)
