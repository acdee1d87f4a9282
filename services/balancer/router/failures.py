"""What fails an attempt and is worth a move elsewhere: InstanceFailed, raised by
dispatch, the attempt's stream and the instance watch, caught by the migration
loop; and the refusal codes that mean "busy or stopping", not "bad request"."""

from shared.proto import mesh_pb2

RETRYABLE = (mesh_pb2.ERROR_CODE_OVERLOADED, mesh_pb2.ERROR_CODE_SHUTTING_DOWN)
"""An instance that refuses or fails a request with these is busy or draining: another may take it."""


class InstanceFailed(Exception):
    """Instances failed a request they had accepted: worth migrating, elsewhere."""

    def __init__(self, message: str, *instance_ids: str, cause: str = "error", started: bool = True) -> None:
        super().__init__(message)
        self.instance_ids = set(instance_ids)
        self.cause = cause
        self.started = started
        """Whether the instances at fault had started on the request, as far as the balancer
        knows (prefill acked it, decode streamed): if not, and they died, the move is not
        charged (move_budget.py)."""
