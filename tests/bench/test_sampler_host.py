"""bench/sampler_host.py end to end on small vocabularies: every setting timed beside the previous sampler, the
JSON written; bad arguments refused in one line."""

import json

import pytest

from bench import sampler_host


def test_times_every_setting_beside_the_previous_sampler(tmp_path):
    out = tmp_path / "s.json"
    assert sampler_host.main(["--out", str(out), "--vocab", "10,500,3000", "--draws", "4"]) == 0
    results = json.loads(out.read_text())["results"]
    assert len(results) == 3 * len(sampler_host.SETTINGS)
    assert all(r["us"] > 0 and r["previous_us"] > 0 and r["x_faster"] == r["previous_us"] / r["us"] for r in results)


def test_the_previous_sampler_draws_from_the_same_distribution():
    """The reference the bench times against is the same operation: both keep top-p's nucleus only."""
    import numpy as np

    logits = np.log(np.array([0.5, 0.3, 0.1, 0.06, 0.04])).astype(np.float32)
    params = sampler_host.SETTINGS["temperature 0.7, top_p 0.9"]
    draw = sampler_host.previous(params)
    nucleus = set(np.flatnonzero(np.isfinite(sampler_host.filter_logits(logits / 0.7 - (logits / 0.7).max(), 0, 0.9))))
    assert {draw(logits) for _ in range(300)} <= nucleus


@pytest.mark.parametrize("argv,message", [(["--draws", "0"], "--draws"), (["--vocab", "x"], "--vocab")])
def test_refuses_bad_arguments(argv, message, capsys):
    with pytest.raises(SystemExit):
        sampler_host.main(argv)
    assert message in capsys.readouterr().err
