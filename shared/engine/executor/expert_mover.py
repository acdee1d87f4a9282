"""One rank's EPLB weight mover (issue 28): a layer's experts gathered for its new
placement on a thread of their own, over a process group of their own
(process_group.expert_move_group), into new buffers, while the steps go on with the
old placement; the switch then happens between two steps, when rank 0 orders it
(move_schedule.py says when).

Why a thread: torch's ops and gloo's collectives release the GIL, so the forward on
the main thread and the move run at once (on the CPU they share its cores; on CUDA
the move's copies run on a side stream, beside the step's kernels). A move ends with
a one-element all-reduce on the move group: once it returns on rank 0, every rank has
finished its copies, and rank 0 may order the switch.

Closing waits for the move in flight (``close``): every rank started it at the same
step, so each finishes it while the others do; a process that exits with its mover
still inside a collective has the group torn down under it and aborts ("terminate
called without an active exception").
"""

import logging
import threading
from concurrent.futures import Future
from contextlib import nullcontext

import torch
import torch.distributed as dist

from shared.engine.eplb.balancer import ExpertMove
from shared.engine.executor.move_schedule import MoveOrder
from shared.model.expert_parallel_model import MovedLayer, move_layer_weights, switch_layer
from shared.model.interface import CausalLM

log = logging.getLogger(__name__)

CLOSE_TIMEOUT_S = 10.0
"""How long close() waits for the move in flight (a tiny layer's move takes milliseconds;
a peer that died breaks the collective at once over gloo)."""


class ExpertMover:
    def __init__(self, model: CausalLM, group: dist.ProcessGroup, device: torch.device) -> None:
        self.model = model
        self.group = group
        self.device = device
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._moving: tuple[int, Future[MovedLayer]] | None = None
        self._thread: threading.Thread | None = None
        """The mover thread of the move in flight (or of the last one), joined by close()."""

    @property
    def finished(self) -> bool:
        """Whether the move in flight is done here (on rank 0: on every rank) or failed
        (the switch then raises its error)."""
        return self._moving is not None and self._moving[1].done()

    def apply(self, order: MoveOrder) -> None:
        """Rank 0's order for the next step, before its forward (every rank alike)."""
        if order.switch is not None:
            self._switch(order.switch)
        if order.start is not None:
            self._start(order.start)
            if order.wait:
                self._switch(order.start.layer)

    def _start(self, move: ExpertMove) -> None:
        if self._moving is not None:
            raise ValueError(f"layer {self._moving[0]} is still moving: one move at a time")
        future: Future[MovedLayer] = Future()
        # A daemon thread all the same: should close() give up on it (a peer hung), the
        # process must still be able to exit.
        self._thread = threading.Thread(target=self._move, args=(move, future), name=f"eplb-move-layer{move.layer}",
                                        daemon=True)  # fmt: skip
        self._thread.start()
        self._moving = (move.layer, future)

    def _move(self, move: ExpertMove, future: Future[MovedLayer]) -> None:
        future.set_running_or_notify_cancel()
        try:
            with torch.cuda.stream(self._stream) if self._stream is not None else nullcontext():
                moved = move_layer_weights(self.model, move.layer, move.slot_experts, self.group)
                done = torch.ones(1, device=self.device)
                self.group.allreduce([done]).wait()
                if self._stream is not None:
                    self._stream.synchronize()  # the new weights are written before anyone switches
            future.set_result(moved)
        except BaseException as e:  # handed to the step that switches: the instance fails loudly there
            future.set_exception(e)

    def close(self, timeout_s: float = CLOSE_TIMEOUT_S) -> None:
        """Wait for the move in flight to end on this rank (done or failed; never
        switched), before the ranks and their groups go away. Every rank closes its
        mover: rank 0 before it stops the workers, each worker when told to stop."""
        thread = self._thread
        if thread is None:
            return
        thread.join(timeout_s)
        if thread.is_alive():
            log.warning("EPLB move %s still running after %.0f s: closing without it", thread.name, timeout_s)

    def _switch(self, layer: int) -> None:
        if self._moving is None or self._moving[0] != layer:
            raise ValueError(f"layer {layer} is not moving: nothing to switch")
        moved = self._moving[1].result()  # rank 0 ordered it once done; a worker's may trail by its all-reduce
        self._moving = None
        if self._stream is not None:  # written on the side stream, read and later freed on the step's
            for weight in moved.local.stacked().values():
                weight.record_stream(torch.cuda.current_stream(self.device))
        switch_layer(self.model, moved)
