"""Worst-case footprints and the reservation ledger: a replica is never over-reserved."""
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mtpserve.engine.admission import Footprint, RequestLimits, ReservationLedger, check_request
from mtpserve.engine.sampler import SamplingParams

LIMITS = RequestLimits(context_length=4096, block_size=16, num_usable_blocks=100, vocab_size=50)


def test_footprint_is_the_worst_case_kv_of_prompt_plus_output():
    assert check_request(10, 22, LIMITS) == Footprint(2)      # 32 tokens
    assert check_request(10, 23, LIMITS) == Footprint(3)      # 33 tokens
    big = RequestLimits(4096, 16, 1000, 50)
    assert check_request(4000, 500, big) == Footprint(256), "capped by the context"
    assert big.max_sequence_tokens == 4096 and LIMITS.max_sequence_tokens == LIMITS.kv_capacity_tokens == 99 * 16


@pytest.mark.parametrize("prompt, max_tokens, message", [
    (0, 4, "empty"), (4096, 4, "context"), (100, 2000, "KV cache"), ([1, 50], 4, "token ids"), ([], 4, "empty")])
def test_requests_that_can_never_run_are_refused(prompt, max_tokens, message):
    with pytest.raises(ValueError, match=message):
        check_request(prompt, max_tokens, LIMITS)


def test_the_kv_capacity_keeps_one_block_of_slack():
    assert check_request(10, 99 * 16 - 10, LIMITS) == Footprint(99)
    with pytest.raises(ValueError, match="KV cache"):
        check_request(10, 99 * 16 - 9, LIMITS)


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


@pytest.mark.parametrize("field,params", [
    ("stop_token_ids", dict(stop_token_ids=(3, 50))), ("stop_token_ids", dict(stop_token_ids=(2**70,))),
    ("logit_bias", dict(logit_bias=((50, 1.0),))),
])
def test_token_ids_the_parameters_name_must_be_in_the_vocabulary(field, params):
    """One id past the vocabulary in stop_token_ids (the min_tokens mask) or logit_bias indexes
    past the step's logits: refused at the door, naming the field, on every entry point."""
    bad = SamplingParams(temperature=0, max_tokens=4, **params)
    with pytest.raises(ValueError, match=f"^{field} "):
        check_request([1, 2], 4, LIMITS, bad)
    ok = SamplingParams(temperature=0, max_tokens=4, stop_token_ids=(49,), logit_bias=((0, 1.0),))
    assert check_request([1, 2], 4, LIMITS, ok) == Footprint(1)
