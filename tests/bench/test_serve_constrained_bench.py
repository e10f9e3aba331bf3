"""bench/serve.py --workload constrained end to end on the tiny model with the cpu backend (tiny sizes): the
worker, a router, JSON-schema-constrained clients against the same clients unconstrained. Every constrained reply
must parse (the bench raises otherwise); the JSON has both sides and finite, positive ratios. No timing
assertions."""

from __future__ import annotations

import json
import math

import pytest

from bench import serve, serve_constrained

pytestmark = pytest.mark.slow


def test_serve_constrained_bench_tiny_cpu(tmp_path):
    args = ["--workload", "constrained", "--backend", "cpu", "--clients", "3", "--rounds", "2"]
    args += ["--prompt-tokens", "8", "--new-tokens", "8", "--out", str(tmp_path), "--name", "constrained"]
    assert serve.main(args) == 0
    entry = json.loads((tmp_path / "constrained.json").read_text())["models"]["tiny"]
    assert entry["tokenizer"] == "the model's"
    assert set(entry["ratios"]) == {serve_constrained.TARGET[0], "ttft_p50_constrained_x_unconstrained"}
    assert all(math.isfinite(v) and v > 0 for v in entry["ratios"].values())
    _, longest = serve_constrained.output_schema(8)
    assert len(entry["lengths"]) == 3 and all(8 <= n <= longest for n in entry["lengths"])
    json.loads(entry["sample_reply"])
    for kind in ("constrained", "unconstrained"):
        assert len(entry[kind]["rounds"]) == 2 and entry[kind]["decode_tok_s"] > 0
        assert all(r["tokens"] == sum(entry["lengths"]) for r in entry[kind]["rounds"]) or "length_changes" in entry


def test_a_reply_that_does_not_parse_fails_the_run():
    schema, _ = serve_constrained.output_schema(8)

    class Bytes:  # a tokenizer whose ids are byte values
        def decode(self, ids, skip_special_tokens=False):
            return bytes(ids).decode()

    good = list(b'{"id":1,"kind":"beta","words":["abc","defg"]}')
    serve_constrained.check_outputs([{"ids": good}], schema, Bytes())
    with pytest.raises(RuntimeError, match="does not parse"):
        serve_constrained.check_outputs([{"ids": good[:-1]}], schema, Bytes())
    with pytest.raises(RuntimeError, match="breaks the schema"):
        serve_constrained.check_outputs(
            [{"ids": list(b'{"id":1,"kind":"delta","words":["abc","defg"]}')}], schema, Bytes()
        )
