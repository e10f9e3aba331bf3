"""Incremental detokenisation across split UTF-8 characters, and stop-sequence hold-back."""
import pytest

from router_service.tokenizer import IncrementalDetokenizer, StopSequenceMatcher


def test_round_trip_bytes(tokenizer):
    text = "héllo 世界 🙂"
    ids = tokenizer.encode(text)
    assert ids == list(text.encode())
    assert tokenizer.decode(ids) == text


@pytest.mark.parametrize("text", ["plain ascii", "é世🙂 mixed ü", "🙂🙂", "a\nb\tc"])
def test_incremental_emits_only_complete_characters(tokenizer, text):
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode("prompt: "))
    pieces = [detok.step(t) for t in text.encode()]
    assert "".join(pieces) + detok.flush() == text
    assert all("\ufffd" not in p for p in pieces)
    # A 4-byte emoji yields nothing until its last byte arrives.
    if text == "🙂🙂":
        assert pieces[:4] == ["", "", "", "🙂"]


def test_incomplete_character_at_end_is_flushed_as_replacement(tokenizer):
    detok = IncrementalDetokenizer(tokenizer)
    assert detok.step(ord("a")) == "a"
    assert detok.step("世".encode()[0]) == ""
    assert detok.flush() == "\ufffd"


def test_special_tokens_are_skipped(tokenizer):
    detok = IncrementalDetokenizer(tokenizer)
    assert detok.step(ord("x")) + detok.step(256) + detok.step(ord("y")) == "xy"


def test_long_output_keeps_working(tokenizer):
    detok = IncrementalDetokenizer(tokenizer)
    text = "abc世" * 200
    assert "".join(detok.step(t) for t in text.encode()) == text


def feed(matcher, pieces):
    emitted, stopped = [], False
    for p in pieces:
        out, stopped = matcher.push(p)
        emitted.append(out)
        if stopped:
            break
    return emitted, stopped


def test_stop_sequence_truncates_and_holds_back_prefix():
    m = StopSequenceMatcher(["END"])
    emitted, stopped = feed(m, ["hello E", "N", "D more"])
    assert stopped and emitted == ["hello ", "", ""]
    assert "".join(emitted) == "hello "


def test_false_prefix_is_released():
    m = StopSequenceMatcher(["END"])
    emitted, stopped = feed(m, ["E", "N", "x"])
    assert not stopped and emitted == ["", "", "ENx"]
    assert m.flush() == ""


def test_held_text_flushed_at_end_of_sequence():
    m = StopSequenceMatcher(["</s>"])
    emitted, stopped = feed(m, ["abc</"])
    assert emitted == ["abc"] and not stopped
    assert m.flush() == "</"


def test_earliest_of_several_stop_sequences_wins():
    m = StopSequenceMatcher(["world", "lo w"])
    out, stopped = m.push("hello world")
    assert stopped and out == "hel"


def test_stop_inside_one_piece_and_no_stops():
    out, stopped = StopSequenceMatcher(["\n\n"]).push("para\n\nnext")
    assert stopped and out == "para"
    assert StopSequenceMatcher([]).push("anything") == ("anything", False)


def test_stream_concatenation_equals_truncated_text(tokenizer):
    text = "The answer is 42.\n\nQ: next"
    detok, m = IncrementalDetokenizer(tokenizer), StopSequenceMatcher(["\n\nQ:"])
    out = []
    for t in text.encode():
        piece, stopped = m.push(detok.step(t))
        out.append(piece)
        if stopped:
            break
    assert "".join(out) == "The answer is 42."
