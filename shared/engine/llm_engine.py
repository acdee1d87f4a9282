"""The engine: scheduler + KV cache manager + model runner + detokenizer, stepped
by its owner. Offline generation (shared.engine.llm) loops over step(); a
service runs step() on a thread of its own and talks to it through queues."""

import logging
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from shared.engine.config import EngineConfig
from shared.engine.dp_kv import DataParallelKVTransfer, InstanceBlockEvents, rank_connectors
from shared.engine.dp_scheduler import DataParallelScheduler
from shared.engine.dtypes import torch_dtype
from shared.engine.engine_request import EngineRequest
from shared.engine.eplb.balancer import ExpertBalancer
from shared.engine.eplb.expert_load import ExpertLoad
from shared.engine.executor.base import Executor, UniProcExecutor
from shared.engine.executor.multiproc import MultiprocExecutor
from shared.engine.executor.rank import (
    RunnerSetup, build_runner, check_split, checkpoint_recipe, load_rank_model, rank_device, splits_attention,
)  # fmt: skip
from shared.engine.images import EncodedImages, check_prompt_tokens, encode
from shared.engine.kv_transfer import KVTransfer
from shared.engine.model_runner import RunnerOutput, StepHandle
from shared.engine.outputs import (
    EngineLoad,
    KVTransferReport,
    RequestOutput,
    StepCounts,
    TokenLogprobs,
    queued_prompt_tokens,
)
from shared.engine.request import Request, RequestStatus
from shared.engine.sampling_params import InvalidParam, SamplingParams
from shared.engine.scheduler import Scheduler, SchedulerConfig
from shared.engine.spec.setup import make_speculator
from shared.engine.spec.speculator import Speculator
from shared.engine.step import SchedulerOutput
from shared.engine.structured.compile_pool import GrammarCompilePool
from shared.engine.structured.setup import check_structured
from shared.kv.block_hash import BlockHash, kv_fingerprint
from shared.kv.connectors.base import KVConnector
from shared.kv.memory.coordinator import (
    KVCacheCoordinator, blocks_for_one_request, blocks_in_budget, blocks_per_class,
)  # fmt: skip
from shared.kv.memory.dp_region import DataParallelKVRegion
from shared.kv.memory.region import KVRegion
from shared.kv.memory.state_cache import SlidingState, SlidingStateCache
from shared.model.fingerprint import model_fingerprint
from shared.model.loader import read_config
from shared.model.models import arch_traits
from shared.model.interface import CausalLM
from shared.model.parallel import SINGLE
from shared.recipe import IncrementalDetokenizer, Recipe

log = logging.getLogger(__name__)


GRAMMAR_WAIT_S = 0.002
"""An engine whose only work is grammars being compiled waits this long for one per step."""
MAX_STEP_GAP_S = 1.0
"""A decode step measured over longer than this was the engine idling (speculation's costs)."""

def _overlaps(request: Request) -> bool:
    """Whether a request can run in overlapped steps. Penalties count the token in
    flight on the device (sampler.py), logprobs travel with the tokens, and a row masked
    by the host (a grammar, min_tokens, bad words) samples once the step before is read
    back (ModelRunner.sample): all overlap. A prompt being scored (prompt_logprobs) runs
    in synchronous steps until its first token: the runner scores it from the step's
    hidden states."""
    params = request.sampling_params
    return params.prompt_logprobs is None or request.num_output_tokens > 0


class LLMEngine:
    def __init__(
        self,
        config: EngineConfig,
        model: CausalLM | None = None,
        *,
        detokenize: bool = True,
        record_kv_events: bool = False,
        load_progress: bool = False,
        kv_connector: KVConnector | None = None,
        share_kv: bool = False,
    ) -> None:
        """model: an already built model (benchmarks build one in GPU memory);
        None loads config.model. The caller's choices, not knobs of the config:
        detokenize: produce text (and honour stop strings) in the engine; a mesh
        worker and the balancer's LocalGenerator leave that to the HTTP layer and
        stream token ids only. record_kv_events: keep the hashes of blocks
        entering / leaving the prefix cache for drain_kv_events() (a mesh worker).
        load_progress: a progress bar while the weights load. kv_connector: where
        KV beyond this engine's cache comes from and goes to (the engine owns it
        and closes it in close()). share_kv: let peers on this host map this engine's
        KV cache and copy held blocks straight out of it (a prefill worker, when
        config.kv_direct_transfer is on).

        With config.num_ranks N > 1 (tensor_parallel_size * data_parallel_size) the engine starts N - 1 worker processes
        (shared/engine/executor/multiproc.py), each holding its slice of the model; this
        process is rank 0 and schedules for all. close() stops them. With
        config.enable_expert_parallel the ranks hold the MoE layers' experts split
        between them (shared/model/expert_parallel_model.py), and with config.enable_eplb
        the engine moves them as the load shifts (shared/engine/eplb/balancer.py). With
        config.data_parallel_size > 1 each rank runs attention for its own requests, with
        its own scheduler and KV pool here (shared/engine/dp_scheduler.py); in the mesh the
        instance keeps one connector, whose region maps every rank's cache under
        instance-wide block ids (shared/kv/memory/dp_region.py), each rank's pool moving
        its own requests' KV through it, and one set of block events, a hash held while
        any rank holds it (shared/engine/dp_kv.py)."""
        self.config = config
        self.detokenize = detokenize
        dtype = torch_dtype(config.dtype)
        num_ranks = config.num_ranks
        device = rank_device(config.device, 0, num_ranks)
        loaded = model is None
        multiproc = _start_ranks(config, model) if num_ranks > 1 else None
        try:
            self._init(config, model, loaded, dtype, device, multiproc, record_kv_events, load_progress,
                       kv_connector, share_kv)  # fmt: skip
        except BaseException:
            if multiproc is not None:
                multiproc.close()
            raise

    def _init(self, config: EngineConfig, model: CausalLM | None, loaded: bool, dtype: torch.dtype,
              device: torch.device, multiproc: MultiprocExecutor | None, record_kv_events: bool,
              load_progress: bool, kv_connector: KVConnector | None, share_kv: bool) -> None:  # fmt: skip
        parallel = multiproc.parallel if multiproc is not None else SINGLE
        if model is None:
            self.model = load_rank_model(config, parallel, device, load_progress)
        else:
            self.model = model
            if model.batch_invariant != config.batch_invariant:
                # Its ops table was chosen when it was built; the engine does not swap it.
                raise ValueError(f"the model was built with batch_invariant={model.batch_invariant}, the config "
                                 f"says {config.batch_invariant}: build it with build_model(..., batch_invariant=...)")
        # A checkpoint saved by transformers alone has no tokenizer: the engine
        # then takes token ids only and returns no text.
        self.recipe: Recipe | None = checkpoint_recipe(config.model) if loaded else None
        model_cfg = self.model.config
        self.eos_token_ids = frozenset(model_cfg.eos_token_ids) | (
            self.recipe.eos_token_ids if self.recipe else frozenset()
        )
        max_model_len = config.max_model_len or model_cfg.max_position_embeddings
        num_blocks = self._num_kv_blocks(max_model_len)
        # A sliding-window class (V4's state caches) gets the blocks its requests can hold
        # at once, not one per token: the budget's rest goes to the persistent classes.
        class_blocks = blocks_per_class(
            self.model.kv_layout, num_blocks, config.block_size, config.max_num_seqs, config.step_sizes()[0]
        )
        # The KV bytes depend on the weights and on the cache dtype: both name the chain.
        weights = model_fingerprint(config.model) if loaded else self.model.config.fingerprint()
        self.fingerprint = kv_fingerprint(weights, config.dtype)
        # Under tensor parallelism each rank's cache holds its own KV heads, and a saved
        # sliding-window state would be rank 0's alone: no state cache, replays instead.
        keeps_states = config.state_cache_bytes and config.num_ranks == 1
        state_cache = SlidingStateCache(config.state_cache_bytes, config.state_cache_ttl_s) if keeps_states else None
        # swa_replay resolved once, here: where unset, the model says whether bounded replay is its default.
        swa_replay = config.swa_replay_for(arch_traits(model_cfg.architecture).trained_for_bounded_replay)
        self.kv_ranks = [
            KVCacheCoordinator(
                self.model.kv_layout,
                class_blocks,
                config.block_size,
                self.fingerprint,
                config.enable_prefix_caching,
                record_events=record_kv_events,
                swa_replay=swa_replay,  # type: ignore[arg-type]
                state_cache=state_cache,
            )
            for _ in range(config.data_parallel_size)
        ]
        """Each data-parallel rank's KV pool (its runner's cache holds the same blocks); one
        without data-parallel attention."""
        self.kv = self.kv_ranks[0]
        # With a connector, the other ranks' caches are made mappable: rank 0's connector moves their blocks too.
        setup = RunnerSetup(config, class_blocks, max_model_len, self.eos_token_ids, share_kv=kv_connector is not None)
        self.runner = build_runner(setup, self.model, device, self.recipe, share_kv)
        """Rank 0's runner: its structured matchers are the engine's to read; steps go
        through the executor, which runs them on every rank."""
        self.executor: Executor
        self.kv_region: KVRegion = self.runner.kv_region
        """The instance's KV cache as its connector moves it (and peers map it): rank 0's
        region with one rank; with several, one region over every rank's cache
        (shared/kv/memory/ranked_region.py), so that every rank's KV moves."""
        if multiproc is not None:
            multiproc.start(setup, self.runner)
            self.executor = multiproc
            if kv_connector is not None:
                # Split as the ranks' attention splits its KV heads; None: each rank holds all of
                # them (replicated attention, or DeepSeek-V4's one KV head under split query heads).
                split = multiproc.parallel.is_parallel and self.model.splits_kv_heads
                heads = model_cfg.num_key_value_heads if split else None
                self.kv_region = multiproc.kv_region(heads)
        else:
            self.executor = UniProcExecutor(self.runner)
        self.speculator: Speculator | None = None
        if config.speculative != "none":
            graphs = self.runner.graphs
            self.speculator = make_speculator(config, self.model, self.executor.time_step, max_model_len, dtype, device,
                                              graph_buckets=graphs.buckets if graphs is not None else ())  # fmt: skip
            self.runner.keep_hidden = self.speculator.reads_hidden
        scheduler_config = SchedulerConfig.from_engine_config(config, max_model_len)
        self.scheduler: Scheduler | DataParallelScheduler
        self._block_events: InstanceBlockEvents | None = None
        """A data-parallel instance's block events, its ranks' joined (drain_kv_events)."""
        if config.data_parallel_size == 1:
            self.scheduler = Scheduler(scheduler_config, self.kv, kv_connector)
        else:
            # One connector for the instance; each rank's scheduler asks through its rank's view of it.
            views = rank_connectors(kv_connector, len(self.kv_ranks)) if kv_connector is not None else None
            self.scheduler = DataParallelScheduler([
                Scheduler(scheduler_config, kv, views[r] if views is not None else None)
                for r, kv in enumerate(self.kv_ranks)
            ])  # fmt: skip
            self._block_events = InstanceBlockEvents([kv.pool for kv in self.kv_ranks]) if record_kv_events else None
        self.kv_transfer: KVTransfer | DataParallelKVTransfer | None = None
        if kv_connector is not None:
            kv_connector.register_kv_region(self.kv_region)
            # What recomputing a prefix costs here, so a slow source can decline a hit.
            chunk = min(config.step_sizes()[1], max_model_len)
            kv_connector.register_recompute_rate(chunk / self.executor.time_step(chunk, repeats=1), config.block_size)
            if isinstance(self.scheduler, DataParallelScheduler):
                region = self.kv_region
                assert isinstance(region, DataParallelKVRegion)  # the executor's region over the ranks
                offsets = [region.offsets(r) for r in range(len(self.kv_ranks))]
                self.kv_transfer = DataParallelKVTransfer(self.scheduler.ranks, self.kv_ranks, offsets,
                                                          config.kv_lease_timeout_s)  # fmt: skip
            else:
                self.kv_transfer = KVTransfer(kv_connector, self.scheduler, self.kv, config.kv_lease_timeout_s)
        compiler = self.runner.structured.compiler
        self._grammars: GrammarCompilePool | None = GrammarCompilePool(compiler) if compiler is not None else None
        """Structured requests' grammars compile here, off the step (compile_pool.py)."""
        self._detokenizers: dict[str, IncrementalDetokenizer] = {}
        self._prompt_logprobs: dict[str, dict[int, TokenLogprobs]] = {}
        """Per request scoring its prompt, the positions scored so far (a preempted
        request's recomputed chunks overwrite theirs); handed out with its first token."""
        overlap = config.async_scheduling
        self._overlap = device.type == "cuda" if overlap is None else overlap
        self._in_flight: tuple[SchedulerOutput, StepHandle] | None = None
        self._steps = StepCounts()
        """The steps by how they ran (EngineLoad.steps)."""
        self._open_step_cost: tuple[float, int, int, int] | None = None
        """The last decode step for the speculator's costs: (start, requests, tokens, emitted)."""
        counts = self.model.expert_counts
        self._tokens_per_expert: torch.Tensor | None = (
            None if counts is None else torch.zeros(counts.shape, dtype=torch.int64)
        )
        """The steps' tokens per expert summed on the host (EngineLoad.tokens_per_expert)."""
        self._experts: ExpertBalancer | None = None
        """An MoE engine's placement and its window of counts (expert_load), whether its
        experts are on one rank or spread over the expert-parallel ones; it rebalances
        with config.enable_eplb. None for a dense model."""
        if counts is not None:
            # Without expert parallelism every rank holds (a slice of) every expert: one EP rank.
            num_ranks = config.num_ranks if config.enable_expert_parallel else 1
            self._experts = ExpertBalancer(counts.shape[0], counts.shape[1], num_ranks,
                                           config.eplb_settings(), rebalance=config.enable_eplb)  # fmt: skip
        log.info("engine ready: KV blocks of %d tokens, per size class %s", config.block_size, class_blocks)

    def _num_kv_blocks(self, max_model_len: int) -> int:
        cfg = self.config
        if cfg.num_kv_blocks is not None:
            return cfg.num_kv_blocks
        layout = self.model.kv_layout
        class_bytes = self.model.kv_class_bytes_per_block(cfg.block_size, torch_dtype(cfg.dtype))
        in_budget = blocks_in_budget(
            layout, class_bytes, cfg.kv_cache_memory_bytes, cfg.block_size, cfg.max_num_seqs, cfg.step_sizes()[0]
        )
        return max(in_budget, blocks_for_one_request(layout, max_model_len, cfg.block_size))

    @property
    def max_model_len(self) -> int:
        return self.scheduler.config.max_model_len

    # -- requests ------------------------------------------------------------

    def add_request(self, req: EngineRequest, encoded: EncodedImages | None = None) -> list[int]:
        """Queue a request; returns its prompt token ids. A request with images has them
        encoded here unless the caller did (``encoded``: encode_images, on a thread of
        its own, as AsyncEngine does)."""
        params = req.sampling_params
        prompt_ids = self._prompt_ids(req)
        vocab = self.model.config.vocab_size
        if any(not 0 <= t < vocab for t in prompt_ids):
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        if req.images is None:
            check_prompt_tokens(self.model, prompt_ids, has_images=False)
        elif encoded is None:
            encoded = self.encode_images(req)
        if encoded is not None and self.config.data_parallel_size > 1:  # e.g. a vision instance's embeddings
            raise InvalidParam("images", "are not supported with data_parallel_size > 1 yet: the request's rank "
                                         "would lack them")  # fmt: skip
        request = Request(
            req.request_id,
            prompt_ids,
            params,
            eos_token_ids=self.eos_token_ids,
            cache_salt=req.cache_salt,
            kv_transfer=req.kv_transfer,
            trace_carrier=req.trace_carrier,
            images=encoded.prompt if encoded is not None else None,
        )
        for token in req.resume_token_ids:
            request.append_output_token(token)
        if params.stop and self.recipe is None:
            raise ValueError("stop strings need a tokenizer; this checkpoint has none")
        params.check_vocab(vocab)
        # A bad grammar fails here; a good one compiles on the pool while the batch runs on.
        request.grammar = check_structured(params, self._grammars)
        if request.grammar is not None:
            request.status = RequestStatus.WAITING_FOR_GRAMMAR
        self.scheduler.add_request(request)
        if encoded is not None:
            self.runner.add_images(req.request_id, encoded.embeds)
        if params.prompt_logprobs is not None and not req.resume_token_ids:
            self._prompt_logprobs[req.request_id] = {}
        if self.recipe is not None and self.detokenize:
            self._detokenizers[req.request_id] = self.recipe.detokenizer(
                prompt_ids,
                skip_special_tokens=params.skip_special_tokens,
                stop=params.stop,
                include_stop_str_in_output=params.include_stop_str_in_output,
            )
        return prompt_ids

    def _prompt_ids(self, req: EngineRequest) -> list[int]:
        if isinstance(req.prompt, str):
            if self.recipe is None:
                raise ValueError(f"{self.config.model} has no tokenizer.json: give the prompt as token ids")
            return self.recipe.encode(req.prompt)
        return list(req.prompt)

    def encode_images(self, req: EngineRequest) -> EncodedImages | None:
        """The request's images checked against its prompt and run through the vision
        tower (shared/engine/images.py); None without images. It reads only the model,
        so any thread may run it while the step loop runs (AsyncEngine does, off the loop)."""
        if req.images is None:
            return None
        if self.config.num_ranks > 1:  # the tower runs here; other ranks would lack the rows
            raise InvalidParam("images", "are not supported with tensor_parallel_size or data_parallel_size > 1 yet")
        prompt_ids = self._prompt_ids(req)
        kv_brought = self._kv_brought(req, len(prompt_ids))
        return encode(self.model, prompt_ids, req.images, self.config.speculative, kv_brought)

    def _kv_brought(self, req: EngineRequest, prompt_len: int) -> int:
        """The prompt tokens whose KV a request is expected to load rather than compute:
        a resumed request that loads (decode after a handoff) brings its prompt's full
        blocks, which prefill computed; none otherwise. Only an expectation: the images
        in them are encoded later if a load fails or a preemption recomputes them."""
        t = req.kv_transfer
        if not req.resume_token_ids or t is None or not t.load:
            return 0
        return prompt_len // self.config.block_size * self.config.block_size

    @property
    def num_images_encoded(self) -> int:
        """Images the vision tower ran on in this engine since it started."""
        return self.runner.num_images_encoded

    def abort_request(self, request_id: str) -> None:
        self.scheduler.finish_request(request_id, RequestStatus.FINISHED_ABORTED)
        self.runner.drop_images(request_id)  # one the runner never saw is no finished id of a step
        if self.speculator is not None:
            self.speculator.forget(request_id)
        self._prompt_logprobs.pop(request_id, None)
        self._detokenizers.pop(request_id, None)
        if self.kv_transfer is not None:
            self.kv_transfer.drop_output(request_id)
        self._save_states()

    def reset_prefix_cache(self) -> tuple[int, int]:
        """Forget every block kept for reuse, as a restart would: the device prefix cache
        of each rank (blocks in use, leased ones too, keep their content for their holders
        but leave the index) and the connector's host tier; kvcache keeps
        its copies, so the next hit loads from there. (device blocks, host blocks) dropped."""
        device = sum(kv.pool.drop_cached() for kv in self.kv_ranks)
        for kv in self.kv_ranks:
            if kv.state_cache is not None:  # a sliding-window state is only of use beside its blocks
                kv.state_cache.clear()
        host = self.kv_transfer.connector.drop_cached() if self.kv_transfer is not None else 0
        return device, host

    def has_unfinished_requests(self) -> bool:
        return (
            self.scheduler.num_unfinished > 0
            or self._in_flight is not None
            or (self.kv_transfer is not None and self.kv_transfer.busy)  # its blocks come back when it reports
        )

    def check_ranks(self) -> None:
        """Raise WorkerFailed (naming the rank) if one of the instance's other ranks died;
        nothing with one rank. The step loop asks while idle, so a dead rank takes the
        instance down at once rather than at its next request."""
        self.executor.check_alive()

    def close(self) -> None:
        """Stop the connector's background work; unmap the shared cache."""
        if self.kv_transfer is not None:
            self.kv_transfer.connector.close()
        if self._experts is not None:
            self._experts.close()
        if self._grammars is not None:
            self._grammars.close()
        self.executor.close()
        self.kv_region.close()

    # -- the step ------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """One step: schedule, run, and turn sampled tokens into outputs. With
        async scheduling, step N+1 is launched before step N's tokens are read
        back, and this returns step N's outputs."""
        released = self.kv_transfer.poll() if self.kv_transfer is not None else []
        released += self._fail_grammars()
        speculator = self.speculator
        self._close_step_cost(time.perf_counter())
        # A step that drafts nothing (no speculation, or the schedule's choice this step)
        # takes the fast path: overlapped with the next step's scheduling, CUDA graphs.
        drafting = speculator is not None and speculator.plan(self.scheduler.running) > 0
        if self._overlap and not drafting and all(_overlaps(r) for r in self._unfinished()):
            start = time.perf_counter()
            if speculator is not None:
                speculator.skip(self.scheduler.running)
            sched = self.scheduler.schedule()
            self._start_loads()
            handle = self.executor.launch(sched)
            # Read before the step before is processed: that may finish (and forget) requests.
            deferred = self._masked_by_host(sched)
            outputs = self._finish_in_flight()
            if deferred:  # its masks read the tokens just collected
                self.executor.sample(handle)
            self._in_flight = None if sched.is_empty else (sched, handle)
            self._count_step(sched, overlapped=True, deferred=deferred)
            if speculator is not None and _decodes_only(sched):
                n = len(sched.chunks)
                self._open_step_cost = (start, n, n, n)
        else:
            outputs = self._finish_in_flight()
            if not outputs:
                start = time.perf_counter()
                if speculator is not None:
                    # Drafting needs each request's last token on the host: no overlapped steps.
                    if self._overlap and drafting:
                        speculator.count_fallback("async_scheduling")
                    speculator.propose(self.scheduler.running)
                sched = self.scheduler.schedule()
                self._start_loads()
                outputs = self._process(sched, self.executor.execute(sched))
                self._count_step(sched, overlapped=False, deferred=False)
                if speculator is not None and self.runner.graphs is not None and _verifies(sched):
                    if not self.runner.last_step_graphed:  # too many rows, or too long a table
                        speculator.count_fallback("cuda_graphs")
                if speculator is not None and _decodes_only(sched):
                    num_tokens = sum(len(c.token_ids) for c in sched.chunks)
                    emitted = sum(len(o.new_token_ids) for o in outputs)
                    self._open_step_cost = (start, len(sched.chunks), num_tokens, emitted)
        self._save_states()
        if self.kv_transfer is not None:
            outputs = self.kv_transfer.finish(outputs)
        if not outputs and not released and self._idle_on_io():
            time.sleep(0.001)  # only KV on its way: let the connector's thread run
        if not outputs and not released and self._in_flight is None and not self.scheduler.running:
            compiling = self._compiling()
            if compiling:  # only grammars on their way: wait for one rather than spin
                GrammarCompilePool.wait(compiling, GRAMMAR_WAIT_S)
        return released + outputs

    def _masked_by_host(self, sched: SchedulerOutput) -> bool:
        """Whether a row the step samples is masked by the host (SamplingParams.masked_by_host,
        as the runner of its rank reads it): its sampling waits for the step before."""
        requests = self.scheduler.requests
        return any(
            c.sample and c.request_id in requests and requests[c.request_id].sampling_params.masked_by_host
            for c in sched.chunks
        )  # fmt: skip

    def _count_step(self, sched: SchedulerOutput, overlapped: bool, deferred: bool) -> None:
        if sched.is_empty:
            return
        if not overlapped:
            self._steps.synchronous += 1
            return
        self._steps.overlapped += 1
        self._steps.sampled_after_read_back += deferred

    def _compiling(self) -> list:
        return [r.grammar for r in self.scheduler.waiting if r.grammar is not None and not r.grammar.done()]

    def _fail_grammars(self) -> list[RequestOutput]:
        """End the requests whose grammar failed to compile on the pool (admission's
        checks passed, so this is rare: xgrammar refusing what it built), as aborted."""
        failed = [
            r for r in self.scheduler.waiting
            if r.grammar is not None and r.grammar.done() and (r.grammar.cancelled() or r.grammar.exception())
        ]  # fmt: skip
        outputs = []
        for request in failed:
            error = None if request.grammar is None or request.grammar.cancelled() else request.grammar.exception()
            log.error("request %s: its grammar did not compile: %s", request.request_id, error)
            self.abort_request(request.request_id)
            outputs.append(RequestOutput(
                request_id=request.request_id, prompt_token_ids=request.prompt_token_ids,
                token_ids=request.output_token_ids, new_token_ids=[], text="", delta_text="", new_logprobs=[],
                finished=True, finish_reason=request.status.finish_reason, stop_reason=None,
                num_cached_tokens=0,
            ))  # fmt: skip
        return outputs

    def _close_step_cost(self, now: float) -> None:
        """Tell the speculator what the last decode step cost: from its start to the
        start of the next call, so the caller's own work between steps counts too (on
        the overlapped path it hides under the device's work; a drafting step, run
        synchronously, pays it in full). A gap of over MAX_STEP_GAP_S is the engine
        idling, not a step."""
        opened, self._open_step_cost = self._open_step_cost, None
        if opened is None or self.speculator is None:
            return
        start, num_requests, num_tokens, emitted = opened
        if now - start < MAX_STEP_GAP_S:
            self.speculator.step_done(num_requests, num_tokens, now - start, emitted)

    # -- the KV connector ------------------------------------------------------

    def _start_loads(self) -> None:
        if self.kv_transfer is not None:
            self.kv_transfer.start_loads()

    def release_kv_lease(self, request_id: str) -> bool:
        """A peer copied the blocks held for this request: free them (False if not held)."""
        return self.kv_transfer is not None and self.kv_transfer.release(request_id)

    def _idle_on_io(self) -> bool:
        return (
            self.kv_transfer is not None
            and self.kv_transfer.busy
            and not self.scheduler.running
            and self._in_flight is None
        )

    def _unfinished(self) -> list[Request]:
        return [*self.scheduler.running, *self.scheduler.waiting]

    def _finish_in_flight(self) -> list[RequestOutput]:
        if self._in_flight is None:
            return []
        sched, handle = self._in_flight
        self._in_flight = None
        return self._process(sched, self.executor.collect(handle))

    def _save_states(self) -> None:
        """Copy the sliding-window state of requests that ended into the state cache,
        before the next schedule may hand their blocks out."""
        saves, self.scheduler.state_saves = self.scheduler.state_saves, []
        cache = self.kv.state_cache
        for save in saves:
            if cache is None or cache.contains(save.block_hash):
                continue
            payload = self.runner.kv_region.gather(save.block_ids)
            nbytes = payload.numel() * payload.element_size()
            cache.put(save.block_hash, SlidingState(save.num_blocks, save.first_block, payload, nbytes))

    def _process(self, sched: SchedulerOutput, result: RunnerOutput) -> list[RequestOutput]:
        if result.expert_counts is not None and self._tokens_per_expert is not None:
            self._tokens_per_expert += result.expert_counts
            if self._experts is not None:
                self._experts.record(result.expert_counts.numpy())
                if self.executor.accepts_expert_move:  # one move at a time, each in the background
                    move = self._experts.next_move()
                    if move is not None:
                        self.executor.queue_expert_move(move)
        for rid, scored in result.prompt_logprobs.items():
            if rid in self._prompt_logprobs:
                self._prompt_logprobs[rid].update(scored)
        for chunk in sched.chunks:  # per request: its own drafts verified and accepted
            request = self.scheduler.requests.get(chunk.request_id)
            if chunk.spec_token_ids and request is not None and chunk.request_id in result.num_accepted:
                request.num_spec_drafted_tokens += len(chunk.spec_token_ids)
                request.num_spec_accepted_tokens += result.num_accepted[chunk.request_id]
        updated = self.scheduler.update_from_output(sched, result.sampled)
        if self.speculator is not None:
            for chunk in sched.chunks:
                if chunk.spec_token_ids and chunk.request_id in result.num_accepted:
                    self.speculator.observe(
                        chunk.request_id, len(chunk.spec_token_ids), result.num_accepted[chunk.request_id]
                    )
                if chunk.request_id in result.hidden:  # what the MTP drafter reads
                    self.speculator.observe_hidden(chunk.request_id, chunk.start_pos, result.hidden[chunk.request_id])
        outputs: list[RequestOutput] = []
        for request, new_tokens in updated:
            rid = request.request_id
            detok = self._detokenizers.get(rid)
            delta = self._detokenize(request, detok, new_tokens) if detok else ""
            if detok and detok.stop_reason is not None and not request.status.is_finished:
                self.scheduler.finish_request(rid, RequestStatus.FINISHED_STOPPED)
                request.stop_reason = detok.stop_reason
            finished = request.status.is_finished
            if finished:
                self.runner.drop_images(rid)  # now, not with the next step: an idle engine keeps none
            if finished and self.speculator is not None:
                self.speculator.forget(rid)
            if finished and detok:
                delta += detok.flush()
                del self._detokenizers[rid]
            lp = result.logprobs.get(rid)
            # A verified run's logprobs, one per token; as many as the tokens kept (a stop
            # string or max_tokens may have cut the run).
            new_logprobs = result.spec_logprobs[rid][: len(new_tokens)] if rid in result.spec_logprobs else (
                [lp] if lp is not None else [])  # fmt: skip
            outputs.append(
                RequestOutput(
                    request_id=rid,
                    prompt_token_ids=request.prompt_token_ids,
                    token_ids=request.output_token_ids,
                    new_token_ids=new_tokens,
                    text=detok.output_text if detok else "",
                    delta_text=delta,
                    new_logprobs=new_logprobs,
                    finished=finished,
                    finish_reason=request.status.finish_reason,
                    stop_reason=request.stop_reason,
                    num_cached_tokens=request.num_cached_tokens or 0,
                    kv=self._kv_report(request) if finished else None,
                    prompt_logprobs=self._scored_prompt(request),
                    queued_seconds=_queued_seconds(request) if finished else None,
                    num_spec_drafted_tokens=request.num_spec_drafted_tokens,
                    num_spec_accepted_tokens=request.num_spec_accepted_tokens,
                )
            )
        return outputs

    def _detokenize(self, request: Request, detok: IncrementalDetokenizer, new_tokens: list[int]) -> str:
        """The text of the step's tokens. Several (an accepted speculative run) go in one
        at a time: a stop string completed by one of them ends the request there, and
        the tokens after it are dropped, as decoding without speculation would have."""
        if len(new_tokens) == 1:
            return detok.add_tokens(new_tokens)
        delta = ""
        for i, token in enumerate(new_tokens):
            delta += detok.add_tokens([token])
            if detok.stop_reason is not None:
                num_dropped = len(new_tokens) - 1 - i
                if num_dropped:
                    self.scheduler.drop_last_tokens(request, num_dropped)
                    del new_tokens[i + 1 :]
                    if request.status.is_finished:  # a later token had ended it: the stop string came first
                        request.status = RequestStatus.FINISHED_STOPPED
                break
        return delta

    def _scored_prompt(self, request: Request) -> list[TokenLogprobs | None] | None:
        """The request's prompt logprobs, once (with its first token)."""
        scored = self._prompt_logprobs.pop(request.request_id, None)
        if scored is None:
            return None
        return [None] + [scored.get(pos) for pos in range(1, request.num_prompt_tokens)]

    def _kv_report(self, request: Request) -> KVTransferReport | None:
        if request.kv_transfer is None:
            return None
        return KVTransferReport(
            request.block_hashes[: request.num_prompt_tokens // self.kv.block_size],
            request.num_loaded_blocks,
            request.kv_load_failed,
            num_replayed_tokens=request.num_replayed_tokens,
            loaded_direct=request.kv_loaded_direct,
            load_path=request.kv_load_path,
            load_plane=request.kv_load_plane,
            load_seconds=request.kv_load_seconds,
            copy_seconds=request.kv_copy_seconds,
        )

    # -- KV blocks in and out (the mesh's kvcache service) -------------------

    def drain_kv_events(self) -> tuple[list[BlockHash], list[BlockHash]]:
        if self._block_events is not None:
            return self._block_events.drain()
        return self.kv.pool.drain_events()

    def kv_snapshot(self) -> list[BlockHash]:
        """All the prefix cache holds (of the group whose events are recorded; any rank's
        with data-parallel attention); drains the events."""
        if self._block_events is not None:
            return self._block_events.snapshot()
        return self.kv.pool.snapshot_events()

    def load(self) -> EngineLoad:
        sched = self.scheduler
        return EngineLoad(
            num_running=len(sched.running),
            num_waiting=len(sched.waiting),
            num_free_kv_blocks=sum(kv.pool.num_free_blocks for kv in self.kv_ranks),
            num_total_kv_blocks=sum(kv.pool.num_total_blocks for kv in self.kv_ranks),
            # The prompts not past their prefill, whole (one definition with the balancer's
            # reservation): a prompt whose last chunk is on the device has no token yet, so
            # it still counts (an 8k prompt's step is ~0.3 s of work left).
            num_queued_tokens=sum(
                queued_prompt_tokens(r.num_prompt_tokens, r.num_output_tokens, _recomputing(r))
                for r in (*sched.waiting, *sched.running)
            ),
            num_kv_save_failures=self.kv_transfer.num_save_failures if self.kv_transfer else 0,
            num_kv_saves_dropped=self.kv_transfer.num_saves_dropped if self.kv_transfer else 0,
            num_preemptions=sched.num_preemptions,
            num_prefix_query_tokens=sum(kv.num_query_tokens for kv in self.kv_ranks),
            num_prefix_hit_tokens=sum(kv.num_hit_tokens for kv in self.kv_ranks),
            num_images_encoded=self.num_images_encoded,
            num_running_per_rank=(
                sched.num_running_per_rank if isinstance(sched, DataParallelScheduler) else [len(sched.running)]
            ),
            tokens_per_expert=None if self._tokens_per_expert is None else self._tokens_per_expert.tolist(),
            expert_load=self.expert_load(),
            steps=replace(self._steps),
            **self._spec_load(),
        )

    def expert_load(self) -> ExpertLoad | None:
        """Per MoE layer, tokens per rank and balancedness over the window of the last
        steps (one rank unless the engine is expert-parallel); None for a dense model."""
        return None if self._experts is None else self._experts.expert_load()

    def _spec_load(self) -> dict[str, Any]:
        if self.speculator is None:
            return {}
        stats = self.speculator.stats
        return {
            "num_spec_drafted_tokens": stats.num_drafted_tokens,
            "num_spec_accepted_tokens": stats.num_accepted_tokens,
            "num_spec_verifications": stats.num_verifications,
            "spec_accepted_by_position": list(stats.accepted_by_position),
            "spec_fallbacks": dict(stats.fallbacks),
        }


def _start_ranks(config: EngineConfig, model: CausalLM | None) -> MultiprocExecutor:
    """The other ranks of a tensor-parallel engine, started (and joined in one group)
    once what they cannot run is refused: before any process starts."""
    if model is not None:
        raise ValueError("a model built by the caller runs in one process: tensor_parallel_size and "
                         "data_parallel_size must be 1 with it")
    model_cfg = read_config(Path(config.model))
    check_split(config, model_cfg)
    return MultiprocExecutor(config, splits_attention(config, model_cfg))


def _recomputing(request: Request) -> bool:
    """Preempted and not caught up: its freed KV (prompt and output so far, but the last
    sampled token, which the next step feeds) is being computed again."""
    return request.num_preemptions > 0 and request.num_computed_tokens < request.num_tokens - 1


def _decodes_only(sched: SchedulerOutput) -> bool:
    """A step of decoding requests only (each computes its last token and its drafts)."""
    return bool(sched.chunks) and all(len(c.token_ids) == 1 + len(c.spec_token_ids) for c in sched.chunks)


def _verifies(sched: SchedulerOutput) -> bool:
    return any(c.spec_token_ids for c in sched.chunks)


def _queued_seconds(request: Request) -> float | None:
    start = request.first_scheduled_time
    return None if start is None else start - request.arrival_time
