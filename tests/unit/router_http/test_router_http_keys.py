"""The API key file, constant-time lookup, and per-key limits over a fake clock."""

from __future__ import annotations

from pathlib import Path

import pytest

from router.http.keys import ApiKey, KeyFileError, KeyLimits, KeyTable, load_key_file
from router.http.limits import Lease, LimitKind, RateLimiter, Refusal, TooLarge
from router.types import FinishEvent, FinishReason, TokenEvent, TokenInfo


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "keys.txt"
    path.write_text(text)
    return path


def test_key_file_format(tmp_path: Path) -> None:
    table = load_key_file(write(tmp_path, (
        "# operators\n"
        "sk-alice  name=alice rpm=60 concurrent=4 tpm=100000  # the team\n"
        "\n"
        "sk-bob concurrent=2\n"
        "sk-carol\n"
    )))
    alice, bob, carol = table.keys
    assert (alice.name, alice.limits) == ("alice", KeyLimits(rpm=60, concurrent=4, tpm=100000))
    assert (bob.name, bob.limits) == ("line-4", KeyLimits(concurrent=2))
    assert (carol.name, carol.limits) == ("line-5", KeyLimits())
    assert table.find("sk-bob") is bob and table.find("sk-carol") is carol
    assert table.find("sk-bo") is None and table.find("") is None and table.find("sk-alice ") is None


@pytest.mark.parametrize(
    ("text", "line", "complaint"),
    [
        ("sk-a rpm=0\n", 1, "`rpm` must be a whole number >= 1"),
        ("sk-a\nsk-b tpm=1.5\n", 2, "`tpm` must be a whole number >= 1"),
        ("sk-a limit=3\n", 1, "unknown field `limit=`"),
        ("sk-a sk-b\n", 1, "one key per line"),
        ("name=alice sk-a\n", 1, "must start with the key"),
        ("sk-a rpm=1 rpm=2\n", 1, "`rpm` given twice"),
        ("sk-a name=x\nsk-b name=x\n", 2, "name 'x' already used on line 1"),
        ("sk-a\n# c\nsk-a rpm=3\n", 3, "the same key as line 1"),
        ("sk-a name=\n", 1, "name '' must be 1-64 characters"),
    ],
)
def test_malformed_lines_name_file_and_line(tmp_path: Path, text: str, line: int, complaint: str) -> None:
    path = write(tmp_path, text)
    with pytest.raises(KeyFileError) as err:
        load_key_file(path)
    assert str(err.value).startswith(f"{path}:{line}: ")
    assert complaint in str(err.value)
    assert "sk-" not in str(err.value).replace(str(path), "")  # keys are never echoed


def test_empty_or_missing_file_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(KeyFileError, match="no API key"):
        load_key_file(write(tmp_path, "# nothing yet\n\n"))
    with pytest.raises(KeyFileError, match="cannot read"):
        load_key_file(tmp_path / "absent.txt")


def test_repr_shows_no_secret(tmp_path: Path) -> None:
    (key,) = load_key_file(write(tmp_path, "sk-secret-value name=ops\n")).keys
    assert "secret" not in repr(key) and repr(key.digest) not in repr(key)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def key(**limits: int) -> ApiKey:
    return ApiKey(name="k", limits=KeyLimits(**limits), digest=b"0" * 32)


def limiter(k: ApiKey) -> tuple[RateLimiter, Clock]:
    clock = Clock()
    return RateLimiter(KeyTable([k]), clock), clock


def test_requests_per_minute_roll() -> None:
    k = key(rpm=2)
    lim, clock = limiter(k)
    assert isinstance(lim.admit(k), Lease)
    clock.now += 20
    lease = lim.admit(k)
    assert isinstance(lease, Lease)
    lease.release()
    clock.now += 10
    refused = lim.admit(k)
    assert refused == Refusal(LimitKind.RPM, 30, "2 requests per minute")  # the first leaves at +60
    clock.now += 30
    assert isinstance(lim.admit(k), Lease)


def test_concurrency_slot_until_release() -> None:
    k = key(concurrent=1)
    lim, _ = limiter(k)
    lease = lim.admit(k)
    assert isinstance(lease, Lease)
    refused = lim.admit(k)
    assert isinstance(refused, Refusal) and refused.kind is LimitKind.CONCURRENT and refused.retry_after == 1
    lease.release()
    lease.release()  # idempotent: the slot is not freed twice
    assert lim.in_flight(k) == 0
    again = lim.admit(k)
    assert isinstance(again, Lease) and lim.in_flight(k) == 1


def token(index: int) -> TokenEvent:
    return TokenEvent(TokenInfo(id=5, text=" x", logprob=-1.0), index)


def test_tokens_reserved_then_settled_to_use() -> None:
    k = key(tpm=100)
    lim, clock = limiter(k)
    first = lim.admit(k)
    assert isinstance(first, Lease)
    assert first.charge(prompt_tokens=10, max_new_tokens=50) is None  # 60 reserved
    second = lim.admit(k)
    assert isinstance(second, Lease)
    over = second.charge(prompt_tokens=10, max_new_tokens=50)
    assert isinstance(over, Refusal) and over.kind is LimitKind.TPM and over.retry_after == 60
    for i in range(3):
        first.observe(token(i))
    first.observe(FinishEvent("abc", FinishReason.EOS_TOKEN, generated_tokens=3, prompt_tokens=10))
    assert first.release() == 13  # 10 prompt + 3 generated
    clock.now += 15
    third = lim.admit(k)
    assert isinstance(third, Lease) and third.charge(10, 50) is None  # 13 + 60 <= 100
    fourth = lim.admit(k)
    assert isinstance(fourth, Lease)
    wait = fourth.charge(10, 30)
    assert isinstance(wait, Refusal) and wait.retry_after == 45  # the first charge leaves at +60
    too_big = fourth.charge(1, 100)
    assert too_big == TooLarge(needed=101, limit=100)


def test_abandoned_stream_is_charged_what_it_generated() -> None:
    k = key(tpm=1000)
    lim, _ = limiter(k)
    lease = lim.admit(k)
    assert isinstance(lease, Lease) and lease.charge(7, 500) is None
    lease.observe(token(0))
    lease.observe(token(1))
    assert lease.release() == 9


def test_refund_when_never_queued() -> None:
    k = key(tpm=50)
    lim, _ = limiter(k)
    lease = lim.admit(k)
    assert isinstance(lease, Lease) and lease.charge(10, 40) is None
    lease.refund()
    assert lease.release() == 0
    again = lim.admit(k)
    assert isinstance(again, Lease) and again.charge(10, 40) is None
