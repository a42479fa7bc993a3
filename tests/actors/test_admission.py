"""Worst-case footprints and the reservation ledger: a replica is never over-reserved."""
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mtpserve.actors.admission import Footprint, ReservationLedger, request_footprint


def test_footprint_is_the_worst_case_kv_of_prompt_plus_output():
    assert request_footprint(10, 22, 4096, 16, 100) == Footprint(2)      # 32 tokens
    assert request_footprint(10, 23, 4096, 16, 100) == Footprint(3)      # 33 tokens
    assert request_footprint(4000, 500, 4096, 16, 1000) == Footprint(256), "capped by the context"


@pytest.mark.parametrize("prompt, max_tokens, message", [
    (0, 4, "empty"), (4096, 4, "context"), (100, 2000, "KV cache")])
def test_requests_that_can_never_run_are_refused(prompt, max_tokens, message):
    with pytest.raises(ValueError, match=message):
        request_footprint(prompt, max_tokens, 4096, 16, 100)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(0, 9), st.integers(1, 12)), max_size=60),
       st.integers(1, 40), st.integers(1, 6))
def test_ledger_never_exceeds_its_grant(ops, num_blocks, num_rows):
    ledger = ReservationLedger(num_blocks, num_rows)
    held = {}
    for is_reserve, rid, blocks in ops:
        rid = f"r{rid}"
        if is_reserve and rid not in held:
            fits = ledger.can_reserve(Footprint(blocks))
            assert ledger.reserve(rid, Footprint(blocks)) == fits
            if fits:
                held[rid] = blocks
        elif not is_reserve:
            assert ledger.release(rid) == (rid in held)
            held.pop(rid, None)
        ledger.check_integrity()
        assert ledger.num_reserved_blocks == sum(held.values()) <= num_blocks
        assert ledger.num_reserved_rows == len(held) <= num_rows
    assert ledger.peak_reserved_blocks <= num_blocks and ledger.peak_reserved_rows <= num_rows


def test_a_shrunken_grant_revokes_nothing_but_admits_nothing_new():
    ledger = ReservationLedger(10, 4)
    assert ledger.reserve("a", Footprint(6))
    ledger.set_grant(0, 0)
    assert "a" in ledger and not ledger.can_reserve(Footprint(1)) and not ledger.fits_grant(Footprint(1))
    assert ledger.release("a") and ledger.num_reserved_blocks == 0
