"""The load a dispatch reserves on an instance: taken at once, given back exactly
once when the handover fails, kept when the instance takes the request."""

import pytest

from services.balancer.router.registry import Instance
from services.balancer.router.reservations import Reservation
from shared.proto import mesh_pb2


def instance() -> Instance:
    return Instance("prefill", "p0", mesh_pb2.Load(), 0.0, 1.0)


def test_a_failed_handover_gives_back_exactly_once():
    inst = instance()
    with pytest.raises(RuntimeError):
        with Reservation(inst, requests=1, tokens=7) as reservation:
            assert (inst.in_flight, inst.in_flight_tokens) == (1, 7)
            raise RuntimeError("no answer")
    assert (inst.in_flight, inst.in_flight_tokens) == (0, 0)
    inst.in_flight, inst.in_flight_tokens = 2, 9  # other requests' since
    reservation.release()
    assert (inst.in_flight, inst.in_flight_tokens) == (2, 9)


def test_a_kept_reservation_stays_counted_with_the_requests_added():
    inst = instance()
    with Reservation(inst, tokens=5) as reservation:
        reservation.keep(requests=1)
    assert (inst.in_flight, inst.in_flight_tokens) == (1, 5)
    with pytest.raises(AssertionError):
        reservation.keep()


def test_giving_back_after_a_heartbeat_zeroed_the_counts_stays_at_zero():
    inst = instance()
    reservation = Reservation(inst, requests=1, tokens=4)
    inst.in_flight, inst.in_flight_tokens = 0, 0  # a heartbeat that includes it
    reservation.release()
    assert (inst.in_flight, inst.in_flight_tokens) == (0, 0)
