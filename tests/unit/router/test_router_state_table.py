"""The one transition table: every allowed row, and a sample of forbidden changes."""

from __future__ import annotations

import itertools

import pytest

from router.states import (
    TRANSITIONS,
    State,
    TransitionError,
    Trigger,
    check,
    describe,
    targets,
    triggers,
)

S, T = State, Trigger

# The rows the autoscaler and the operator rely on, written out again by hand on purpose: a change to
# the table must be a change to this list too.
EXPECTED = {
    (S.INACTIVE, S.LOADING_PREFILL, T.LOAD_PREFILL),
    (S.INACTIVE, S.LOADING_DECODE, T.LOAD_DECODE),
    (S.INACTIVE, S.NEW_PREFILL, T.LIVE_LOAD),
    (S.LOADING_PREFILL, S.PREFILL, T.LOADED),
    (S.LOADING_PREFILL, S.COLOCATED, T.LOADED),
    (S.LOADING_DECODE, S.DECODE, T.LOADED),
    (S.LOADING_PREFILL, S.INACTIVE, T.LOAD_FAILED),
    (S.LOADING_DECODE, S.INACTIVE, T.LOAD_FAILED),
    (S.NEW_PREFILL, S.INACTIVE, T.LOAD_FAILED),
    (S.NEW_PREFILL, S.REFRACTORY_PREFILL, T.LOADED),
    (S.REFRACTORY_PREFILL, S.PREFILL, T.ZIGZAG_DONE),
    (S.PREFILL, S.OLD_PREFILL, T.RELAY_START),
    (S.OLD_PREFILL, S.PREFILL, T.RELAY_END),
    (S.PREFILL, S.MUTATING_TO_DECODE, T.MUTATE),
    (S.MUTATING_TO_DECODE, S.DECODE, T.MUTATED),
    (S.PREFILL, S.DRAINING_PREFILL, T.DRAIN),
    (S.OLD_PREFILL, S.DRAINING_PREFILL, T.DRAIN),
    (S.DECODE, S.DRAINING_DECODE, T.DRAIN),
    (S.COLOCATED, S.DRAINING_DECODE, T.DRAIN),
    (S.DRAINING_PREFILL, S.PREFILL, T.REVIVE),
    (S.DRAINING_DECODE, S.DECODE, T.REVIVE),
    (S.DRAINING_DECODE, S.COLOCATED, T.REVIVE),
    (S.DRAINING_PREFILL, S.IDLE, T.DRAINED),
    (S.DRAINING_DECODE, S.IDLE, T.DRAINED),
    (S.IDLE, S.PREFILL, T.REACTIVATE),
    (S.IDLE, S.DECODE, T.REACTIVATE),
    (S.IDLE, S.COLOCATED, T.REACTIVATE),
    (S.IDLE, S.INACTIVE, T.EXPIRE),
    (S.PREFILL, S.DECODE, T.ASSIGN),
    (S.PREFILL, S.COLOCATED, T.ASSIGN),
    (S.DECODE, S.PREFILL, T.ASSIGN),
    (S.DECODE, S.COLOCATED, T.ASSIGN),
    (S.COLOCATED, S.PREFILL, T.ASSIGN),
    (S.COLOCATED, S.DECODE, T.ASSIGN),
    (S.DECODE, S.PREFILL, T.TAKE_PREFILL),
    *((s, S.DEAD, T.DIED) for s in State if s is not S.DEAD),
    (S.DEAD, S.INACTIVE, T.ANSWERED),
    (S.DEAD, S.PREFILL, T.ANSWERED),
    (S.DEAD, S.DECODE, T.ANSWERED),
    (S.DEAD, S.COLOCATED, T.ANSWERED),
    (S.DEAD, S.IDLE, T.ANSWERED),
}


def test_the_table_is_exactly_the_expected_rows() -> None:
    assert {(t.source, t.target, t.trigger) for t in TRANSITIONS} == EXPECTED
    assert len(TRANSITIONS) == len(EXPECTED)  # no row twice


@pytest.mark.parametrize(("source", "target", "trigger"), sorted(EXPECTED, key=str))
def test_every_allowed_row_passes(source: State, target: State, trigger: Trigger) -> None:
    check(source, target, trigger)
    assert trigger in triggers(source, target)
    assert target in targets(source, trigger)


@pytest.mark.parametrize(("source", "target", "trigger"), [
    (S.INACTIVE, S.PREFILL, T.ASSIGN),  # weights must arrive first
    (S.INACTIVE, S.DECODE, T.LOADED),
    (S.LOADING_DECODE, S.PREFILL, T.LOADED),  # loaded for decode, not prefill
    (S.NEW_PREFILL, S.PREFILL, T.LOADED),  # zigzag batches may still be in flight
    (S.DECODE, S.MUTATING_TO_DECODE, T.MUTATE),
    (S.DRAINING_DECODE, S.PREFILL, T.REVIVE),  # revive gives back the job it had
    (S.IDLE, S.NEW_PREFILL, T.LIVE_LOAD),  # it has its weights
    (S.DEAD, S.DECODE, T.REVIVE),
    (S.DEAD, S.DEAD, T.DIED),
    (S.PREFILL, S.INACTIVE, T.EXPIRE),  # only an idle replica drops its weights
    (S.DECODE, S.IDLE, T.DRAINED),  # drained only from draining
])
def test_forbidden_changes_raise(source: State, target: State, trigger: Trigger) -> None:
    with pytest.raises(TransitionError, match=f"from {source.value} to {target.value}"):
        check(source, target, trigger)


def test_a_known_pair_with_the_wrong_trigger_names_the_right_one() -> None:
    with pytest.raises(TransitionError, match="allowed on: revive"):
        check(S.DRAINING_PREFILL, S.PREFILL, T.ASSIGN)


def test_every_pair_not_in_the_table_is_forbidden_for_every_trigger() -> None:
    pairs = {(s, t) for s, t, _ in EXPECTED}
    for source, target in itertools.product(State, State):
        if (source, target) not in pairs:
            assert triggers(source, target) == frozenset()


def test_every_state_but_dead_can_be_reached_and_left() -> None:
    reached = {t.target for t in TRANSITIONS}
    left = {t.source for t in TRANSITIONS}
    assert reached == set(State)
    assert left == set(State)


def test_describe_lists_one_line_per_transition() -> None:
    text = describe()
    assert len(text.splitlines()) == len(TRANSITIONS)
    assert "idle --expire--> inactive" in text
