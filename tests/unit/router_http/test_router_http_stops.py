"""StopTrimmer: streamed text never shows a stop sequence, nor a tail that might become one."""

from __future__ import annotations

from router.http.stops import StopTrimmer


def _feed(stops: tuple[str, ...], pieces: list[str], final: str | None = None) -> tuple[list[str], str]:
    trimmer = StopTrimmer(stops)
    released = [trimmer.push(p) for p in pieces]
    released.append(trimmer.finish(final))
    return released, "".join(released)


def test_without_stops_everything_passes_through() -> None:
    released, text = _feed((), ["a", "b", "c"])
    assert released == ["a", "b", "c", ""] and text == "abc"


def test_stop_split_across_pieces_is_held_then_dropped() -> None:
    released, text = _feed(("END",), ["hello E", "N", "D and more"])
    assert released[0] == "hello " and text == "hello "


def test_partial_prefix_is_released_when_generation_ends_otherwise() -> None:
    released, text = _feed(("END",), ["hello E", "N"])
    assert released[:2] == ["hello ", ""] and text == "hello EN"


def test_false_alarm_is_released_once_it_cannot_match() -> None:
    released, _ = _feed(("END",), ["xE", "x"])
    assert released[:2] == ["x", "Ex"]


def test_stop_inside_one_piece_cuts_at_its_first_character() -> None:
    assert _feed(("\n\n", "###"), ["a b\n\nc ###"])[1] == "a b"


def test_earliest_of_several_stops_wins() -> None:
    assert _feed(("zz", "b"), ["a zz b"])[1] == "a "


def test_final_text_flushes_what_the_detokenizer_held() -> None:
    released, text = _feed(("!",), ["ab"], final="abc!")
    assert released == ["ab", "c"] and text == "abc"
