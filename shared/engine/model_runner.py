"""Executes one scheduled step on the model: SchedulerOutput in, sampled tokens out.

This is the one place where the scheduler's plain lists become device tensors
(the ForwardBatch boundary; step_inputs builds them). The runner owns the KV
cache tensors and each request's sampling state; it knows nothing about queues
or stopping rules.
"""

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from shared.engine.cuda_graphs import DecodeGraphs
from shared.engine.images import PromptEmbeds
from shared.engine.prompt_images import PromptImages
from shared.engine.prompt_logprobs import chunk_targets, score_prompt
from shared.kv.memory.region import KVRegion
from shared.kv.memory.share import Allocator, CudaVmmAllocator, SharedMemoryAllocator

from shared.engine.sampler import LogprobTensors, Sampler, SamplingState, TokenLogprobs, logprob_tensors
from shared.engine.spec.verify import emitted_logprobs, verify_batch
from shared.engine.step import ScheduledChunk, SchedulerOutput
from shared.engine.step_inputs import (
    eager_inputs, fill_placeholders, graph_rows, placeholder_sources, step_image_rows, to_device,
)  # fmt: skip
from shared.engine.structured.apply import StructuredRows
from shared.model.forward_batch import AttentionMetadata
from shared.model.interface import CausalLM
from shared.model.multimodal import InputEmbeddings


log = logging.getLogger(__name__)


@dataclass(slots=True)
class DeferredSample:
    """A launched step's logits, sampled later (ModelRunner.sample): a row's mask is made
    on the host from the token the step before sampled, not read back yet."""

    logits: torch.Tensor
    first: dict[str, int]
    """Per sampling row, the sequence position it samples (_first_sample_positions)."""


@dataclass(slots=True)
class StepHandle:
    """A launched step: its sampled tokens (and logprobs, where asked) arrive in
    `tokens` and `logprobs` once `done` fired, and so do its tokens per expert."""

    request_ids: list[str]
    tokens: torch.Tensor | None
    done: "torch.cuda.Event | None"
    logprobs: LogprobTensors | None = None
    expert_counts: torch.Tensor | None = None
    deferred: DeferredSample | None = None
    """Set while the step's forward is launched and its sampling waits for sample()."""


@dataclass(slots=True)
class RunnerOutput:
    sampled: dict[str, list[int]]
    """Per request, the tokens this step produced (one today; speculative decoding more)."""
    logprobs: dict[str, TokenLogprobs]
    expert_counts: torch.Tensor | None = None
    """[sparse layers, experts] int64 on the host: the (token, choice) pairs each expert
    got in this step's forward; None for a dense model or a step that ran nothing."""
    prompt_logprobs: dict[str, dict[int, TokenLogprobs]] = field(default_factory=dict)
    """Per request scoring its prompt (params.prompt_logprobs), the prompt positions
    this step's chunk scored (execute only: the engine steps such requests synchronously)."""
    num_accepted: dict[str, int] = field(default_factory=dict)
    """Per request whose drafted tokens this step verified, how many passed (execute only)."""
    spec_logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)
    """Per request whose drafted tokens this step verified and that asked for logprobs, those
    of each token in sampled[request] (`logprobs` holds one token's, for the others)."""
    hidden: dict[str, torch.Tensor] = field(default_factory=dict)
    """Per request, the hidden states an MTP drafter reads (``CausalLM.draft_hidden``:
    the final ones [chunk tokens, hidden]; V4's streams before its head) of the positions its
    chunk computed (chunk.start_pos on), for an MTP drafter; views valid until the next
    step. Only from execute() with ``ModelRunner.keep_hidden`` set."""


def _rows(hidden: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """hidden[rows]; no index at all in the usual decode case where every row samples."""
    if len(rows) == hidden.shape[0]:
        return hidden
    return hidden.index_select(0, to_device(rows, torch.long, hidden.device))


def _chunk_rows(sched: SchedulerOutput, hidden: torch.Tensor) -> dict[str, torch.Tensor]:
    """Each chunk's rows of the step's hidden states (views, no copy)."""
    rows: dict[str, torch.Tensor] = {}
    offset = 0
    for chunk in sched.chunks:
        n = len(chunk.token_ids)
        rows[chunk.request_id] = hidden[offset : offset + n]
        offset += n
    return rows


def _first_sample_positions(sched: SchedulerOutput) -> dict[str, int]:
    """Per sampling chunk, the sequence position of the first token it samples (the
    key of its noise): the position after its last input token, or with drafted
    tokens, the position of the first of them (one more per further row)."""
    return {
        c.request_id: c.start_pos + len(c.token_ids) - len(c.spec_token_ids) for c in sched.chunks if c.sample
    }


class ModelRunner:
    def __init__(
        self,
        model: CausalLM,
        num_blocks: int | Sequence[int],
        block_size: int,
        kv_dtype: torch.dtype,
        device: torch.device,
        seed: int = 0,
        cuda_graphs: bool = False,
        max_model_len: int = 4096,
        max_batch: int = 64,
        share_kv: bool = False,
        max_graph_query: int = 1,
        kv_share_dir: str = "",
    ) -> None:
        """share_kv: make the KV cache mappable by peers on this host (direct transfer);
        kv_share_dir: also by peers in other PID namespaces that see this directory.
        max_graph_query: the longest chunk a CUDA graph step takes (1: decode steps only;
        1 + γ with speculation, so that verify steps replay graphs too); the graphs hold
        max_batch * max_graph_query rows."""
        self.model = model
        self.block_size = block_size
        self.device = device
        self.kv_layout = model.kv_layout
        # Per size class one block more than the pool hands out: the class's null block (id
        # its num_blocks), where dropped sliding-window blocks point and writes that must
        # not land go. num_blocks: every class's, or per class (coordinator.blocks_per_class).
        num_classes = len(self.kv_layout.size_classes)
        counts = [num_blocks] * num_classes if isinstance(num_blocks, int) else list(num_blocks)
        self.null_blocks = [counts[c] for c in self.kv_layout.size_class_of_group]
        """Per KV group, its class's null block id."""
        with_null = [n + 1 for n in counts]
        # A CPU cache a peer can map is made in shared memory; a GPU one is shared by CUDA IPC,
        # or, for peers in other PID namespaces, made by CUDA's VMM API with fd handles.
        allocator: Allocator | None = None
        if share_kv and device.type == "cpu":
            allocator = SharedMemoryAllocator(share_dir=kv_share_dir)
        elif share_kv and kv_share_dir and device.type == "cuda":
            allocator = CudaVmmAllocator(device.index if device.index is not None else torch.cuda.current_device(),
                                         kv_share_dir)  # fmt: skip
        try:
            self.kv_caches = model.allocate_kv_cache(with_null, block_size, kv_dtype, device, allocator)
        except OSError as exc:
            if allocator is None:
                raise
            log.warning("KV cache not shared by its memory (%s): peers read it by %s", exc,
                        "CUDA IPC in one PID namespace, NIXL or kvcache" if device.type == "cuda" else "kvcache")
            allocator.close()
            allocator = None
            self.kv_caches = model.allocate_kv_cache(with_null, block_size, kv_dtype, device)
        self.kv_region = KVRegion(self.kv_caches, self.kv_layout, allocator)
        """The cache as blocks that KV connectors and the state cache read and write."""
        self.shares_kv = share_kv and (allocator is not None or device.type == "cuda")
        """Whether peers on this host can map the cache (a CPU one only in shared memory)."""
        # Positions an SWA replay recomputes already hold these groups' KV (all but sliding ones).
        self._skips_replay = [g.spec.window is None for g in self.kv_layout.groups]
        self.graphs: DecodeGraphs | None = None
        self.max_graph_query = max_graph_query
        if cuda_graphs and device.type == "cuda" and model.supports_cuda_graphs:
            graphs = DecodeGraphs(
                model, self.kv_caches, block_size, max_model_len, max_batch * max_graph_query,
                [n * block_size for n in self.null_blocks], device,
            )  # fmt: skip
            try:
                seconds = graphs.capture_all()
            except RuntimeError:
                log.exception("capturing the CUDA graphs failed; decoding eagerly")
            else:
                self.graphs = graphs
                log.info("captured %d CUDA graphs (up to %d rows) in %.1f s", len(graphs.buckets),
                         graphs.buckets[-1], seconds)  # fmt: skip
        self.last_step_graphed = False
        """Whether the latest forward replayed a CUDA graph (else it ran eagerly)."""
        self.sampler = Sampler(seed=seed)
        self.states: dict[str, SamplingState] = {}
        self.structured = StructuredRows()
        """Structured requests' matchers (the engine sets its grammar compiler)."""
        self._last_tokens = torch.empty(0, dtype=torch.long, device=device)
        self._last_rows: dict[str, int] = {}
        self.keep_hidden = False
        """Return each chunk's hidden states from execute() (RunnerOutput.hidden): the MTP
        drafter reads them. Off, nothing is kept."""
        self.prompt_images: dict[str, PromptImages] = {}
        """Per request with images, where their tokens are and its M-RoPE positions (NewRequestData)."""
        self.image_embeds: dict[str, PromptEmbeds] = {}
        """Per request with images, the tower's output for its image tokens, in order
        (add_images), or the pixels of the images whose KV came from another instance
        (encoded here only if a step recomputes them). Kept until the request finishes,
        not only until its prefill has read them: a preempted request recomputes its
        prompt, images included, and its PNGs are gone by then. They weigh about what a
        few layers' KV of the same tokens do."""
        self.num_images_encoded = 0
        """Images the vision tower ran on for this runner's requests, when they were
        admitted or later (a step that recomputed an image whose KV was loaded)."""

    def add_images(self, request_id: str, embeds: PromptEmbeds) -> None:
        """A request's image embeddings, before its first step (on the model's device)."""
        self.image_embeds[request_id] = embeds
        self.num_images_encoded += embeds.num_encoded

    def drop_images(self, request_id: str) -> None:
        self.image_embeds.pop(request_id, None)
        self.prompt_images.pop(request_id, None)

    def _update_states(self, sched: SchedulerOutput) -> None:
        self.structured.update(sched)
        for rid in sched.finished_request_ids:
            self.states.pop(rid, None)
            self.drop_images(rid)
        for new in sched.new_requests:
            if new.images is not None:
                self.prompt_images[new.request_id] = new.images
            state = SamplingState.create(new.sampling_params, new.prompt_token_ids, new.eos_token_ids)
            state.output_token_ids += new.output_token_ids
            self.states[new.request_id] = state

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> RunnerOutput:
        """Run one step and wait for its tokens (with logprobs where asked)."""
        self._update_states(sched)
        self._load_states(sched)
        if sched.is_empty:
            return RunnerOutput({}, {}, self._pad_forward() if sched.pad_forward else None)
        hidden, sample_rows, sample_ids = self._forward(sched)
        # Copied before the sampler reads its tokens back: that read waits for this copy too.
        expert_counts = self._copy_expert_counts()
        scored = self._score_prompts(sched, hidden)
        kept = _chunk_rows(sched, self.model.draft_hidden(hidden)) if self.keep_hidden else {}
        if not sample_rows:
            if expert_counts is not None and self.device.type == "cuda":
                torch.cuda.current_stream().synchronize()
            return RunnerOutput({}, {}, expert_counts, scored, hidden=kept)
        logits = self.model.compute_logits(_rows(hidden, sample_rows))
        drafts = {c.request_id: list(c.spec_token_ids) for c in sched.chunks if c.spec_token_ids}
        num_accepted: dict[str, int] = {}
        spec_logprobs: dict[str, list[TokenLogprobs]] = {}
        first = _first_sample_positions(sched)
        if drafts:
            logits, sample_ids, sampled = self._verify(logits, sample_ids, drafts, num_accepted, first, spec_logprobs)
        else:
            sampled = {}
        states = [self.states[rid] for rid in sample_ids]
        logits = self.structured.mask(logits, sample_ids, [s.output_token_ids for s in states])
        result = self.sampler(logits, states, [first[rid] for rid in sample_ids]) if states else None
        logprobs: dict[str, TokenLogprobs] = {}
        if result is not None:
            for rid, state, token, lp in zip(sample_ids, states, result.token_ids, result.logprobs):
                state.output_token_ids.append(token)
                sampled[rid] = [token]
                if lp is not None:
                    logprobs[rid] = lp
        return RunnerOutput(sampled, logprobs, expert_counts, scored, num_accepted, hidden=kept,
                            spec_logprobs=spec_logprobs)  # fmt: skip

    def _verify(
        self,
        logits: torch.Tensor,
        sample_ids: list[str],
        drafts: dict[str, list[int]],
        num_accepted: dict[str, int],
        first: dict[str, int],
        spec_logprobs: dict[str, list[TokenLogprobs]],
    ) -> tuple[torch.Tensor, list[str], dict[str, list[int]]]:
        """Verify the drafted tokens of the requests in `drafts` (their rows of logits
        are consecutive, len(draft) + 1 each); returns the rows and ids left for the
        plain sampler, and the verified requests' emitted tokens (their logprobs, where
        asked, into spec_logprobs). All verified rows are drawn together, with one
        read-back for the step (verify_batch)."""
        plain: list[int] = []
        spans: list[tuple[str, int]] = []  # (request, its first row)
        row = 0
        while row < len(sample_ids):
            rid = sample_ids[row]
            if rid in drafts:
                spans.append((rid, row))
                row += len(drafts[rid]) + 1
            else:
                plain.append(row)
                row += 1
        if not spans:
            return logits, sample_ids, {}
        states = [self.states[rid] for rid, _ in spans]
        if any(rid in self.structured.matchers for rid, _ in spans):
            rows = torch.cat([
                self.structured.mask_draft(logits[r : r + len(drafts[rid]) + 1], rid, drafts[rid], s.output_token_ids)
                for (rid, r), s in zip(spans, states)
            ])  # fmt: skip
        else:
            plain_set = set(plain)
            rows = _rows(logits, [r for r in range(len(sample_ids)) if r not in plain_set])
        span_drafts = [drafts[rid] for rid, _ in spans]
        verified = verify_batch(rows, span_drafts, states, self.sampler, [first[rid] for rid, _ in spans])
        sampled: dict[str, list[int]] = {}
        logprobs = emitted_logprobs(rows, span_drafts, states, verified)
        for (rid, _), state, v, lps in zip(spans, states, verified, logprobs):
            state.output_token_ids += v.tokens
            sampled[rid] = v.tokens
            num_accepted[rid] = v.num_accepted
            if lps is not None:
                spec_logprobs[rid] = lps
        return _rows(logits, plain), [sample_ids[r] for r in plain], sampled

    @torch.inference_mode()
    def time_step(self, num_tokens: int, repeats: int = 3) -> float:
        """Seconds of one step computing num_tokens tokens and their logits (the fastest
        of `repeats`), for the speculative scheduler's SPS profile: replayed from a CUDA
        graph where a step of that many tokens would be, else eager. One sequence whose
        KV goes to the null block: nothing the pool hands out is touched."""
        num_blocks = -(-num_tokens // self.block_size)
        tables = [[self.null_blocks[g]] * num_blocks for g in self._groups]
        sched = SchedulerOutput(chunks=[ScheduledChunk("sps-profile", [0] * num_tokens, 0, tables, sample=True)])
        input_ids, positions, meta, _, _ = self._prepare(sched)
        graphed = self.graphs is not None and self.graphs.can_run(num_tokens, num_blocks)

        def forward() -> torch.Tensor:
            if graphed:  # as a decode or verify step of that many tokens runs: one graph row each
                return self._forward_graph(sched)[0]
            return self.model(input_ids, positions, self.kv_caches, meta)

        best = float("inf")
        for run in range(repeats + 1):  # run 0 warms up
            start = time.perf_counter()
            self.model.compute_logits(forward())
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            if run:
                best = min(best, time.perf_counter() - start)
        return best

    def _score_prompts(self, sched: SchedulerOutput, hidden: torch.Tensor) -> dict[str, dict[int, TokenLogprobs]]:
        """The prompt positions each scoring request's chunk predicts, with their logprobs."""
        scored: dict[str, dict[int, TokenLogprobs]] = {}
        offset = 0
        for chunk in sched.chunks:
            state = self.states[chunk.request_id]
            k = state.params.prompt_logprobs
            targets = chunk_targets(chunk, state.prompt_token_ids) if k is not None else []
            if targets:
                rows = [offset + row for row, _ in targets]
                ids = [state.prompt_token_ids[pos] for _, pos in targets]
                entries = score_prompt(self.model.compute_logits, hidden, rows, ids, k or 0)
                scored[chunk.request_id] = {pos: lp for (_, pos), lp in zip(targets, entries)}
            offset += len(chunk.token_ids)
        return scored

    @torch.inference_mode()
    def launch(self, sched: SchedulerOutput) -> StepHandle:
        """Start one step and return at once: the sampled tokens stay on the
        device (the next step's placeholders read them there) and are copied
        to the host in the background, with their logprobs where asked (penalties
        count the token in flight on the device: _pending_tokens). A step with a row
        masked by the host (SamplingParams.masked_by_host: a grammar, min_tokens, bad
        words) launches its forward only: its sampling waits for sample(), which the
        engine calls once the step before is collected, so that every row's output on
        the host is whole (vLLM's execute_model / sample_tokens split). Drafted tokens
        are verified by execute() only."""
        assert not any(c.spec_token_ids for c in sched.chunks), "speculative steps run through execute()"
        self._update_states(sched)
        self._load_states(sched)
        if sched.is_empty:
            if not sched.pad_forward:
                return StepHandle([], None, None)
            counts = self._pad_forward()
            return StepHandle([], None, self._record_done(counts), expert_counts=counts)
        hidden, sample_rows, sample_ids = self._forward(sched)
        expert_counts = self._copy_expert_counts()
        if not sample_rows:
            return StepHandle([], None, self._record_done(expert_counts), expert_counts=expert_counts)
        logits = self.model.compute_logits(_rows(hidden, sample_rows))
        # The positions come from the chunks: the states' own lag a step behind here.
        first = _first_sample_positions(sched)
        handle = StepHandle(sample_ids, None, None, expert_counts=expert_counts)
        if any(self.states[rid].params.masked_by_host for rid in sample_ids):
            # The whole step's sampling waits (one sampler call, as execute's): the host
            # reads the step before back while the device runs this forward.
            handle.deferred = DeferredSample(logits, first)
        else:
            self._sample_into(handle, logits, first)
        return handle

    @torch.inference_mode()
    def sample(self, handle: StepHandle) -> None:
        """Sample a launched step whose sampling waited (StepHandle.deferred; nothing
        otherwise): call it once the step before is collected. Masks from the host
        (grammars, min_tokens, bad words) go to the device and are applied to the logits
        there; the tokens stay on the device as launch's do."""
        deferred, handle.deferred = handle.deferred, None
        if deferred is not None:
            self._sample_into(handle, deferred.logits, deferred.first)

    def _sample_into(self, handle: StepHandle, logits: torch.Tensor, first: dict[str, int]) -> None:
        """Sample the handle's rows from logits; their tokens (and logprobs) into the handle,
        copied to the host in the background on CUDA."""
        sample_ids = handle.request_ids
        states = [self.states[rid] for rid in sample_ids]
        # Only a deferred step has structured rows (and their matchers are then in step with the output).
        logits = self.structured.mask(logits, sample_ids, [s.output_token_ids for s in states])
        pending = self._pending_tokens(sample_ids, states, first)
        tokens = self.sampler.sample_tokens(logits, states, [first[rid] for rid in sample_ids], pending)
        logprobs = logprob_tensors(logits, states, tokens)
        self._remember(sample_ids, tokens)
        if self.device.type == "cuda":
            host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
            host.copy_(tokens, non_blocking=True)
            handle.tokens, handle.done = host, self._record_done(host)
            handle.logprobs = logprobs.to_host() if logprobs is not None else None
        else:
            handle.tokens, handle.logprobs = tokens, logprobs

    def _pad_forward(self) -> torch.Tensor | None:
        """A one-token forward whose KV goes to the null blocks (SchedulerOutput.pad_forward:
        data-parallel attention's idle rank joins its peers' MoE collectives); its output is
        dropped. Returns the step's tokens per expert (the instance's: they are summed over
        the ranks, this token's routing among them)."""
        tables = [[self.null_blocks[g]] for g in self._groups]
        pad = SchedulerOutput(chunks=[ScheduledChunk("dp-pad", [0], 0, tables, sample=False)])
        input_ids, positions, meta, _, _ = self._prepare(pad)
        self.model(input_ids, positions, self.kv_caches, meta)
        return self._copy_expert_counts()

    def _copy_expert_counts(self) -> torch.Tensor | None:
        """The model's tokens per expert of the forward just launched, as a host tensor
        that the next forward cannot overwrite: on CUDA a non-blocking copy into pinned
        memory (complete once the step's tokens are), queued behind the forward like the
        sampled tokens' copy, so reading it costs no sync of its own."""
        counts = self.model.expert_counts
        if counts is None:
            return None
        if self.device.type != "cuda":
            return counts.clone()
        host = torch.empty(counts.shape, dtype=counts.dtype, pin_memory=True)
        return host.copy_(counts, non_blocking=True)

    def _record_done(self, copied: torch.Tensor | None) -> "torch.cuda.Event | None":
        """An event after the copies to the host just queued (None if nothing to wait for)."""
        if copied is None or self.device.type != "cuda":
            return None
        done = torch.cuda.Event()
        done.record()
        return done

    def collect(self, handle: StepHandle) -> RunnerOutput:
        """The tokens of a launched step (waits for the device if needed)."""
        assert handle.deferred is None, "a deferred step is sampled (sample()) before it is collected"
        if handle.done is not None:
            handle.done.synchronize()
        if handle.tokens is None:
            return RunnerOutput({}, {}, handle.expert_counts)
        token_ids: list[int] = handle.tokens.tolist()
        sampled = {rid: [token] for rid, token in zip(handle.request_ids, token_ids)}
        for rid, tokens in sampled.items():
            state = self.states.get(rid)
            if state is not None:
                state.output_token_ids += tokens
        logprobs: dict[str, TokenLogprobs] = {}
        if handle.logprobs is not None:
            for rid, lp in zip(handle.request_ids, handle.logprobs.unpack(token_ids)):
                if lp is not None:
                    logprobs[rid] = lp
        return RunnerOutput(sampled, logprobs, handle.expert_counts)

    def collect_passes(self, handles: list[StepHandle]) -> tuple[list[list[int]], list[list[float]] | None]:
        """The tokens of steps launched back to back over the same requests (a draft
        model's passes), [step][row], and each row's chosen-token logprob where the
        requests asked for logprobs (all or none): one wait and one read-back for all
        of them rather than collect() per step, and no history appended (the caller's
        requests sample greedily at explicit positions, so nothing reads it)."""
        handles = [h for h in handles if h.tokens is not None]
        if not handles:
            return [], None
        if handles[-1].done is not None:
            handles[-1].done.synchronize()  # one stream: the last copy completes after the others
        tokens: list[list[int]] = torch.stack([h.tokens for h in handles]).tolist()  # type: ignore[misc]
        if any(h.logprobs is None or len(h.logprobs.rows) != h.logprobs.num_rows for h in handles):
            return tokens, None
        chosen = torch.stack([h.logprobs.chosen for h in handles])  # type: ignore[union-attr]
        return tokens, chosen.tolist()

    def _pending_tokens(
        self, sample_ids: list[str], states: list[SamplingState], first: dict[str, int]
    ) -> torch.Tensor | None:
        """Per row of an overlapped step, the token the step before sampled and the
        state's output lacks (its read-back comes after this launch), read on the device
        from that step's tokens; -1 where none. None when no row has penalties (nothing
        else here reads the output): the sampler then needs no such tensor."""
        if not any(s.params.needs_output_history for s in states):
            return None
        rows = [
            self._last_rows.get(rid, -1) if first[rid] == state.next_position + 1 else -1
            for rid, state in zip(sample_ids, states)
        ]  # fmt: skip
        assert all(r >= 0 or first[rid] == s.next_position for r, rid, s in zip(rows, sample_ids, states))
        if all(r < 0 for r in rows):
            return None
        index = to_device([max(r, 0) for r in rows], torch.long, self.device)
        has = to_device([r >= 0 for r in rows], torch.bool, self.device)
        return torch.where(has, self._last_tokens[index], -1)

    def _remember(self, request_ids: list[str], tokens: torch.Tensor) -> None:
        """The last step's sampled tokens on the device, for the next step's placeholders."""
        self._last_tokens = tokens
        self._last_rows = {rid: i for i, rid in enumerate(request_ids)}

    def _load_states(self, sched: SchedulerOutput) -> None:
        """Copy saved sliding-window states into their blocks before the step reads them."""
        for load in sched.state_loads:
            self.kv_region.scatter(load.block_ids, load.state.payload)  # type: ignore[arg-type]

    def _forward(self, sched: SchedulerOutput) -> tuple[torch.Tensor, list[int], list[str]]:
        """Hidden states of the step, from a CUDA graph when its chunks are short
        enough (decode, verify, a draft model's catch-up) and fit one, else eagerly."""
        self.last_step_graphed = False
        if self.graphs is not None and all(
            len(c.token_ids) <= self.max_graph_query and not c.replay_until and not c.sliding_floor
            and not self._holds_images(c)
            for c in sched.chunks
        ):
            max_blocks = max(len(ids) for c in sched.chunks for ids in c.block_ids)
            if self.graphs.can_run(sum(len(c.token_ids) for c in sched.chunks), max_blocks):
                try:
                    out = self._forward_graph(sched)
                    self.last_step_graphed = True
                    return out
                except RuntimeError:
                    log.exception("CUDA graph replay failed; decoding eagerly from now on")
                    self.graphs = None
        input_ids, positions, meta, sample_rows, sample_ids = self._prepare(sched)
        sources = placeholder_sources([(c.request_id, c.token_ids) for c in sched.chunks], self._last_rows)
        if sources is not None:
            input_ids = fill_placeholders(input_ids, to_device(sources, torch.long, self.device), self._last_tokens)
        embeddings = self._image_embeddings(sched)
        if embeddings is None:  # a text model's forward takes no such argument
            return self.model(input_ids, positions, self.kv_caches, meta), sample_rows, sample_ids
        hidden = self.model(input_ids, positions, self.kv_caches, meta, embeddings=embeddings)  # type: ignore[call-arg]
        return hidden, sample_rows, sample_ids

    def _holds_images(self, chunk: ScheduledChunk) -> bool:
        images = self.prompt_images.get(chunk.request_id)
        return images is not None and images.overlaps(chunk.start_pos, chunk.start_pos + len(chunk.token_ids))

    def _image_embeddings(self, sched: SchedulerOutput) -> InputEmbeddings | None:
        """The step's image rows and their embeddings; None for a step without image tokens."""
        if not self.prompt_images:
            return None
        rows = step_image_rows(sched.chunks, self.prompt_images)
        if not rows:
            return None
        index = [r.row + i for _, r in rows for i in range(r.count)]
        for rid, r in rows:  # the tower, here, only for images whose loaded KV is recomputed
            self.num_images_encoded += self.image_embeds[rid].encode_for(r.first, r.count)
        embeds = torch.cat([self.image_embeds[rid].rows(r.first, r.count) for rid, r in rows]).to(self.device)
        return InputEmbeddings(to_device(index, torch.long, self.device), embeds)

    def _forward_graph(self, sched: SchedulerOutput) -> tuple[torch.Tensor, list[int], list[str]]:
        """The step replayed from the decode graphs, one row per token (graph_rows)."""
        assert self.graphs is not None
        shifts = {c.request_id: self.prompt_images[c.request_id].rope_shift(c.start_pos)
                  for c in sched.chunks if c.request_id in self.prompt_images}  # fmt: skip
        rows = graph_rows(sched, self.block_size, len(self._groups), self._last_rows, shifts)
        hidden = self.graphs.run(
            input_ids=rows.input_ids,
            positions=rows.positions,
            slots=rows.slots,
            seq_lens=rows.seq_lens,
            tables=rows.tables,
            placeholder_sources=rows.placeholder_sources,
            last_tokens=self._last_tokens,
        )
        return hidden, rows.sample_rows, rows.sample_ids

    @property
    def _groups(self) -> range:
        return range(len(self.kv_layout.groups))

    def _prepare(
        self, sched: SchedulerOutput
    ) -> tuple[torch.Tensor, torch.Tensor, list[AttentionMetadata], list[int], list[str]]:
        """The eager forward's inputs (eager_inputs); placeholders still in the ids."""
        return eager_inputs(sched, self.block_size, self.null_blocks, self._skips_replay, self.device,
                            self.prompt_images)  # fmt: skip
