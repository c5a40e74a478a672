"""Trace parsers on real first lines of each public trace (tests/fixtures/traces) and on broken ones."""

from __future__ import annotations

from pathlib import Path

import pytest

from pdcluster.bench.serving.traces import TraceError, TraceRow, detect_format, read_trace

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "traces"


def test_mooncake_conversation_rows_times_and_prefix_blocks() -> None:
    rows = read_trace(FIXTURES / "mooncake_conversation_first20.jsonl")
    assert len(rows) == 20
    # {"timestamp": 0, "input_length": 6758, "output_length": 500, "hash_ids": [0, 1, ..., 13]}
    assert rows[0] == TraceRow(0.0, 6758, 500, tuple(range(14)))
    assert all(len(r.hash_ids) == -(-r.input_len // 512) for r in rows)  # one id per 512-token block
    assert rows[1].hash_ids[0] == rows[0].hash_ids[0] == 0  # a shared first block
    assert [r.at for r in rows] == sorted(r.at for r in rows)


def test_mooncake_synthetic_timestamps_are_milliseconds() -> None:
    rows = read_trace(FIXTURES / "mooncake_synthetic_first20.jsonl", "mooncake")
    assert rows[0] == TraceRow(0.0, 40160, 6, tuple(range(79)))
    assert rows[2].at == pytest.approx(0.040)  # "timestamp": 40


@pytest.mark.parametrize(("name", "first", "second_at"), [
    ("azure_code_first20.csv", (4808, 10), 0.052),  # 18:17:03.9799600 → 18:17:04.0319600
    ("azure_conv_first20.csv", (374, 44), 4.3145789),  # 18:15:46.6805900 → 18:15:50.9951690
])
def test_azure_rows_are_seconds_from_the_first(name: str, first: tuple[int, int], second_at: float) -> None:
    path = FIXTURES / name
    assert detect_format(path) == "azure"
    rows = read_trace(path)
    assert len(rows) == 20
    assert (rows[0].at, rows[0].input_len, rows[0].output_len) == (0.0, *first)
    assert rows[1].at == pytest.approx(second_at, abs=1e-6)


def test_burstgpt_rows_drop_failed_requests() -> None:
    path = FIXTURES / "burstgpt_format_sample.csv"
    assert detect_format(path) == "burstgpt"
    rows = read_trace(path)
    assert len(rows) == 7  # the row with 0 response tokens is a failed request: not replayed
    assert rows[0] == TraceRow(0.0, 472, 18)
    assert rows[1] == TraceRow(113.0, 417, 276)  # timestamps are seconds; shifted to start at 0


def _broken(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


@pytest.mark.parametrize(("name", "text", "where", "what"), [
    ("m.jsonl", '{"timestamp": 0, "input_length": 5, "output_length": 1}\n{"timestamp": 1, "input_len',
     ":2:", "not JSON"),
    ("m.jsonl", '{"timestamp": 0, "input_length": 5}\n', ":1:", "missing output_length"),
    ("m.jsonl", '\n{"timestamp": -3, "input_length": 5, "output_length": 1}\n', ":2:", "timestamp"),
    ("m.jsonl", '{"timestamp": 0, "input_length": 5.5, "output_length": 1}\n', ":1:", "input_length"),
    ("a.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:17:03.9799600,4808,10\n"
     "yesterday,1,1\n", ":3:", "TIMESTAMP"),
    ("a.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:17:03.9799600,many,10\n", ":2:",
     "ContextTokens"),
    ("b.csv", "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n1,ChatGPT,5\n", ":2:",
     "columns"),
    ("x.csv", "when,prompt,answer\n1,2,3\n", ":1:", "unknown trace header"),
])
def test_a_malformed_line_is_named_by_file_and_line(tmp_path: Path, name: str, text: str, where: str,
                                                     what: str) -> None:
    path = _broken(tmp_path, name, text)
    with pytest.raises(TraceError) as caught:
        read_trace(path)
    message = str(caught.value)
    assert message.startswith(f"{path}{where}") and what in message


def test_an_empty_trace_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match="no requests"):
        read_trace(_broken(tmp_path, "e.jsonl", "\n"))
