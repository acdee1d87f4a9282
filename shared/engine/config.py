"""One engine configuration: every knob of one engine instance, declared once.

The same dataclass is the `engine` section of the settings every service
reads (shared/runtime/settings.py nests it), so each field is at once an
EngineConfig argument, a YAML key (`engine: {block_size: 32}`), an environment
variable (INFERMESH_ENGINE__BLOCK_SIZE), a Helm value
(settings.engine.block_size), a flag of `infermesh generate` and
`infermesh bench-mesh` (--block-size), and a line of `infermesh config` with
the docstring under the field. Adding a knob is adding a field here, with its
default and docstring, and its line in deploy/helm/infermesh/values.yaml (a
test checks that line).

No torch here: the balancer and the tools read this without loading torch.
torch_dtype() (shared/engine/dtypes.py) turns `dtype` into a torch dtype.
What is a caller's choice rather than a user's knob (text in the engine or in
the HTTP layer, KV events for the mesh, a progress bar while loading) is a
parameter of LLMEngine, not a field here.
"""

import json
from dataclasses import dataclass, fields

DTYPES: tuple[str, ...] = ("float32", "bfloat16", "float16")
# The values of `kernels`. shared/model/kernels resolves the switch and keeps
# the same tuple (it must not import the engine); a test checks they agree.
KERNEL_CHOICES: tuple[str, ...] = ("auto", "triton", "torch")
SWA_REPLAY_CHOICES: tuple[str, ...] = ("bounded", "exact")
# The values of `quantized_weights`; shared/model/kept_weights.py keeps the same tuple (a test checks).
QUANTIZED_WEIGHTS_CHOICES: tuple[str, ...] = ("dequantize", "keep")
SPECULATIVE_CHOICES: tuple[str, ...] = ("none", "ngram", "draft", "mtp")
SPEC_SCHEDULE_CHOICES: tuple[str, ...] = ("fixed", "dspark", "capacity")
# (max_num_batched_tokens, prefill_chunk_size) when unset. On an H200 with an 8B model
# (docs/perf/README.md, "whole engine"): an 8k prompt in one step runs at the runner's
# prefill rate, and a 2048-token chunk costs a decoding request ~60 ms.
STEP_SIZES_CUDA: tuple[int, int] = (8192, 2048)
STEP_SIZES_OTHER: tuple[int, int] = (2048, 512)


@dataclass(slots=True)
class EngineConfig:
    model: str = "models/default"
    """Folder of a Hugging Face format checkpoint."""
    dtype: str = "float32"
    """Weights and KV cache: float32, bfloat16 or float16."""
    device: str = "cpu"
    """cpu, cuda, cuda:1, ..."""
    block_size: int = 16
    """Tokens per KV block; also the granularity of prefix caching and of the
    kvcache service's blocks, so every process of a mesh must agree on it."""
    num_kv_blocks: int | None = None
    """Blocks in the KV pool; None sizes the pool from kv_cache_memory_bytes."""
    kv_cache_memory_bytes: int = 256 << 20
    """Bytes of the KV pool when num_kv_blocks is None; one sequence of
    max_model_len tokens fits whatever this says. 256 MiB suits the CPU default,
    where several engines share one host; on a GPU give it what the card has
    left after the weights."""
    max_num_seqs: int = 64
    """Most requests in the running batch."""
    max_num_batched_tokens: int | None = None
    """Token budget of one step (prompt chunks + decode tokens). None: 8192 on CUDA
    (an 8k prompt in one step, at the card's matmul rate), 2048 elsewhere."""
    prefill_chunk_size: int | None = None
    """Most prompt tokens of one request in a step where other requests decode: their
    next token waits for one such chunk at most, which bounds their inter-token
    latency. A step of prompts alone takes the whole budget. None: 2048 on CUDA,
    512 elsewhere."""
    max_model_len: int | None = None
    """Longest prompt + output a request may reach; None takes the model's max_position_embeddings."""
    enable_prefix_caching: bool = True
    """Reuse the KV blocks of prompt prefixes computed before."""
    seed: int = 0
    """Seed of the sampler for requests that bring no seed of their own."""
    async_scheduling: bool | None = None
    """Schedule and launch step N+1 before reading step N's tokens back, so the
    device does not idle while the host prepares a step. None: on for CUDA.
    A step with a structured output, min_tokens or bad words launches its forward
    the same way and samples once step N's tokens are back (their masks are made on
    the host); only a prompt being scored (prompt_logprobs) runs step by step."""
    cuda_graphs: bool = True
    """Replay decode steps from CUDA graphs (on CUDA with the Triton kernels); False runs them eagerly."""
    kernels: str = "auto"
    """Attention, norm, rotary and activation code: "auto" (Triton kernels on CUDA,
    PyTorch elsewhere), "triton" (on the CPU only under TRITON_INTERPRET=1) or "torch".
    batch_invariant overrides it."""
    quantized_weights: str = "dequantize"
    """A checkpoint's quantised weights (config.json's quantization_config): "dequantize"
    (to dtype while loading, on any device) or "keep": on CUDA, FP8 block-scaled linears stay
    e4m3 with their scales (capability >= 8.9; Triton FP8 GEMM, activations quantised per
    token per 128) and GPT-OSS's MXFP4 experts stay packed (a fused MoE kernel decodes them);
    elsewhere they are dequantised as with "dequantize"."""
    batch_invariant: bool = False
    """A request's logits bitwise the same alone or in any batch, however its prompt is
    chunked (shared/model/batch_invariant.py: fixed tile shapes and reduction orders; on
    CUDA invariant Triton kernels under CUDA graphs, on the CPU PyTorch ops without
    them); dense Llama-family models only. Slower."""
    kv_direct_transfer: bool = True
    """Let a decode instance on the same host copy a request's KV straight out of this
    engine's cache (CUDA IPC on a GPU, shared memory under /dev/shm on the CPU),
    instead of through kvcache."""
    kv_share_dir: str = ""
    """A directory every prefill and decode instance on a host sees (a shared volume):
    with it the direct copy also works between containers and pods (other PID
    namespaces) of one host. The cache's memory is handed over a unix socket there
    (file descriptors; on a GPU the cache is then made with CUDA's VMM API, whose
    handles cross namespaces, where CUDA IPC's do not). "": one PID namespace only."""
    kv_lease_timeout_s: float = 10.0
    """How long finished prefill blocks are held for a direct copy before they are freed
    (the copier gives up earlier, so a block is never freed while it is being read)."""
    host_kv_cache_bytes: int = 1 << 30
    """Host memory (pinned on a GPU machine) that keeps stored KV blocks in front of
    kvcache, so a prefix evicted from the device comes back at PCIe speed; 0 turns it off."""
    swa_replay: str | None = None
    """How a prefix hit whose sliding-window KV is gone is resumed: "exact" replays
    L_swa * (W - 1) tokens, after which the state equals a cold run's; "bounded" replays
    the last W tokens (DeepSeek's SWA bounded replay: approximate by design, it drifts
    on a model not trained for it). None: bounded where the model declares it was
    trained for it (DeepSeek-V4), exact for every other model."""
    state_cache_bytes: int = 256 << 20
    """Host memory of the sliding-window state cache (0 turns it off)."""
    state_cache_ttl_s: float = 600.0
    """Seconds a saved sliding-window state is kept."""
    speculative: str = "none"
    """Speculative decoding: "none", "ngram" (prompt lookup: drafts what followed the
    context's last tokens earlier in it), "draft" (a small model with the same
    tokenizer, spec_draft_model) or "mtp" (the model's own multi-token-prediction layer
    in DeepSeek's layout, from its checkpoint: shared/model/mtp.py). Drafted tokens are
    verified losslessly: greedy output is that of plain decoding, sampled output is
    distributed as the target's."""
    spec_tokens: int = 4
    """γ: the most tokens drafted per request and step."""
    spec_schedule: str = "fixed"
    """How many drafted tokens each step verifies: "fixed" (all γ drafted), "dspark"
    (per request, as many as maximise the expected tokens per second, from the drafts'
    calibrated confidences and a steps-per-second profile measured at start) or
    "capacity" (DSpark's production variant: the count from survivals two steps old,
    the best candidates of this step). Both scheduled modes also draft less deep, or
    not at all, when drafting costs more than it yields."""
    spec_draft_model: str = "models/trained/draft"
    """Folder of the draft model for speculative = "draft" (same tokenizer as the model)."""
    tensor_parallel_size: int = 1
    """Ranks one instance's model is split over (tensor parallelism: attention heads, MLP
    columns and the vocabulary divided between them), one process per rank on one host,
    meeting through torch.distributed (NCCL on CUDA, ranks on cuda:N.. from the configured
    card; gloo on the CPU). Dense Llama-family models and DeepSeek-V4 (its query heads
    split, its one KV head and compressed caches whole on every rank, its routed experts
    whole on every rank unless enable_expert_parallel splits them); the other MoE models
    with enable_expert_parallel. In the mesh an instance of N ranks is still one instance whose
    connector moves every rank's KV (shared/kv/memory/ranked_region.py). Not yet with
    speculative decoding, CUDA graphs or kept quantized weights (each refused by name)."""
    data_parallel_size: int = 1
    """Data-parallel attention (DeepSeek's layout, vLLM's flag), with enable_expert_parallel:
    the instance runs this many ranks, each running attention (and holding the KV) for its
    own requests only, while the MoE layers' experts are split over all of them and each
    rank's tokens are all-to-alled to their experts. The scheduler pins each request to
    one rank for its life (shared/engine/dp_scheduler.py); max_num_seqs and
    max_num_batched_tokens are per rank, as each rank has its own KV pool. In the mesh the
    instance is still one instance (one registry entry, one heartbeat summing the ranks,
    one set of block events, one KV connector over every rank's cache, each request's
    KV moved in and out of its own rank: shared/engine/dp_kv.py). Not with
    tensor_parallel_size > 1, speculative decoding, CUDA graphs, kept quantized weights
    or images (each refused by name)."""
    enable_expert_parallel: bool = False
    """MoE models over the tensor_parallel_size ranks (vLLM's flag: the MoE layers become
    expert-parallel over the ranks): each rank holds 1/N of every MoE layer's experts,
    each MoE layer splits the step's tokens over the ranks and all-to-alls them to their
    experts. The attention, dense MLPs, embedding and head are tensor-parallel over the
    ranks as for a dense model (Qwen3-MoE, GPT-OSS: each rank's KV cache holds its KV
    heads; DeepSeek-V4: each rank its query heads, its one KV head and compressed caches
    whole on every rank). data_parallel_size makes the attention data-parallel
    instead. Qwen3-MoE, GPT-OSS, DeepSeek-V4."""
    enable_eplb: bool = False
    """Expert-parallel load balancing (with enable_expert_parallel): a window of the
    tokens per expert feeds a new placement every eplb_config step_interval steps,
    computed off the step loop, with redundant replicas of the hot experts; the
    weights then move one MoE layer at a time in the background, each layer switched
    between two steps on every rank. Outputs do not change."""
    eplb_config: str = ""
    """EPLB's settings as JSON, vLLM's keys: {"window_size": steps of counts placed from
    (1000), "step_interval": steps between placements (3000), "num_redundant_experts":
    slots beyond one per expert, over all ranks (0; the experts plus these must divide
    over the ranks), "blocking_moves": move on the step's path rather than in the
    background (false)}. "": the defaults."""

    def step_sizes(self) -> tuple[int, int]:
        """(max_num_batched_tokens, prefill_chunk_size), the device's defaults where unset."""
        budget, chunk = STEP_SIZES_CUDA if self.device.startswith("cuda") else STEP_SIZES_OTHER
        return self.max_num_batched_tokens or budget, self.prefill_chunk_size or chunk

    def swa_replay_for(self, trained_for_bounded_replay: bool) -> str:
        """swa_replay, or where unset the model's default: bounded only for a model trained for it."""
        if self.swa_replay is not None:
            return self.swa_replay
        return "bounded" if trained_for_bounded_replay else "exact"

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        if self.block_size < 1:
            raise ValueError(f"block_size must be at least 1, got {self.block_size}")
        if self.kernels not in KERNEL_CHOICES:
            raise ValueError(f"kernels must be one of {KERNEL_CHOICES}, got {self.kernels!r}")
        if self.quantized_weights not in QUANTIZED_WEIGHTS_CHOICES:
            raise ValueError(
                f"quantized_weights must be one of {QUANTIZED_WEIGHTS_CHOICES}, got {self.quantized_weights!r}"
            )
        if self.quantized_weights == "keep" and self.batch_invariant:
            raise ValueError("batch_invariant runs float weights only: use quantized_weights='dequantize' with it")
        if self.swa_replay is not None and self.swa_replay not in SWA_REPLAY_CHOICES:
            raise ValueError(f"swa_replay must be one of {SWA_REPLAY_CHOICES}, got {self.swa_replay!r}")
        if self.host_kv_cache_bytes < 0:
            raise ValueError(f"host_kv_cache_bytes must be >= 0, got {self.host_kv_cache_bytes}")
        if self.kv_lease_timeout_s <= 0:
            raise ValueError(f"kv_lease_timeout_s must be > 0, got {self.kv_lease_timeout_s}")
        if self.state_cache_bytes < 0 or self.state_cache_ttl_s <= 0:
            raise ValueError("state_cache_bytes must be >= 0 and state_cache_ttl_s > 0")
        if self.speculative not in SPECULATIVE_CHOICES:
            raise ValueError(f"speculative must be one of {SPECULATIVE_CHOICES}, got {self.speculative!r}")
        if self.spec_schedule not in SPEC_SCHEDULE_CHOICES:
            raise ValueError(f"spec_schedule must be one of {SPEC_SCHEDULE_CHOICES}, got {self.spec_schedule!r}")
        if self.spec_tokens < 1:
            raise ValueError(f"spec_tokens must be at least 1, got {self.spec_tokens}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be at least 1, got {self.num_kv_blocks}")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be at least 1, got {self.tensor_parallel_size}")
        if self.tensor_parallel_size > 1:
            self._check_tensor_parallel()
        if self.data_parallel_size < 1:
            raise ValueError(f"data_parallel_size must be at least 1, got {self.data_parallel_size}")
        if self.data_parallel_size > 1:
            self._check_data_parallel()
        if self.enable_expert_parallel and self.num_ranks == 1:
            raise ValueError("enable_expert_parallel splits the experts over the instance's ranks: set "
                             "tensor_parallel_size or data_parallel_size > 1")  # fmt: skip
        if self.enable_eplb and not self.enable_expert_parallel:
            raise ValueError("enable_eplb places experts across expert-parallel ranks: set enable_expert_parallel")
        if self.eplb_config and not self.enable_eplb:
            raise ValueError("eplb_config is given but enable_eplb is off: set enable_eplb, or drop eplb_config")
        self.eplb_settings()  # a malformed eplb_config fails here, not at the first rebalance

    def eplb_settings(self) -> "EplbConfig":
        """eplb_config parsed (the defaults with EPLB off, where it must be empty: no
        redundant experts, and the window only measures)."""
        return EplbConfig.from_json(self.eplb_config)

    @property
    def num_ranks(self) -> int:
        """The instance's ranks (processes): tensor_parallel_size * data_parallel_size."""
        return self.tensor_parallel_size * self.data_parallel_size

    def _check_data_parallel(self) -> None:
        """What data-parallel attention does not run, refused by name rather than ignored."""
        if not self.enable_expert_parallel:
            raise ValueError("data_parallel_size > 1 runs data-parallel attention beside expert-parallel MoE "
                             "layers: set enable_expert_parallel (an MoE model; dense models are not supported)")
        refused = [  # (what, asked, the setting that turns it off)
            ("tensor parallelism", self.tensor_parallel_size > 1, "tensor_parallel_size=1"),
            ("speculative decoding", self.speculative != "none", "speculative='none'"),
            ("quantized weights kept as stored", self.quantized_weights == "keep", "quantized_weights='dequantize'"),
            ("CUDA graphs", self.cuda_graphs and self.device.startswith("cuda"), "cuda_graphs=false"),
        ]
        for what, asked, off in refused:
            if asked:
                raise ValueError(f"not implemented yet: {what} with data_parallel_size > 1; set {off}")

    def _check_tensor_parallel(self) -> None:
        """What tensor parallelism does not run yet, refused by name rather than ignored."""
        refused = [  # (what, asked, the setting that turns it off)
            ("speculative decoding", self.speculative != "none", "speculative='none'"),
            ("quantized weights kept as stored", self.quantized_weights == "keep", "quantized_weights='dequantize'"),
            ("CUDA graphs", self.cuda_graphs and self.device.startswith("cuda"), "cuda_graphs=false"),
        ]
        for what, asked, off in refused:
            if asked:
                raise ValueError(f"not implemented yet: {what} with tensor_parallel_size > 1; set {off}")


@dataclass(frozen=True, slots=True)
class EplbConfig:
    """EngineConfig.eplb_config, parsed (its docstring says what each means)."""

    window_size: int = 1000
    step_interval: int = 3000
    num_redundant_experts: int = 0
    blocking_moves: bool = False
    """Move a layer's weights on the step's path (every rank waits for the move before
    the next forward), as vLLM's EPLB does, rather than in the background: kept to
    measure what the background moves save (tools/bench/eplb_live_bench.py)."""

    @classmethod
    def from_json(cls, text: str) -> "EplbConfig":
        """From the JSON object of eplb_config ("" for the defaults); unknown keys refused."""
        values = json.loads(text) if text.strip() else {}
        if not isinstance(values, dict):
            raise ValueError(f"eplb_config must be a JSON object, got {text!r}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"eplb_config: unknown keys {unknown}; known: {sorted(known)}")
        flags = {f.name for f in fields(cls) if f.type in (bool, "bool")}
        if not all(isinstance(v, bool) == (k in flags) and isinstance(v, int) for k, v in values.items()):
            raise ValueError(f"eplb_config: {sorted(flags)} are true or false, the others whole numbers; got {values}")
        config = cls(**values)
        if config.window_size < 1 or config.step_interval < 1 or config.num_redundant_experts < 0:
            raise ValueError(f"eplb_config: window_size and step_interval must be >= 1, "
                             f"num_redundant_experts >= 0; got {config}")  # fmt: skip
        return config
