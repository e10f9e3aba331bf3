"""bench/options_ab.py refuses what it cannot run in one line before building anything (no GPU needed)."""

import pytest

from bench.options_ab import main


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--variants", "[1]"], "a JSON object of names to CudaOptions objects"),
        (["--variants", "{bad json"], "a JSON object of names to CudaOptions objects"),
        (["--variants", '{"a": {"no_such_option": true}}'], "--variants a: "),
        (["--variants", '{"a": {"decode_part_keys": 33}}'], "decode_part_keys"),
        (["--variants", '{"a": {}}', "--shapes", "nope-shape"], "--shapes nope-shape"),
        (["--variants", '{"a": {}}', "--expert-dtype", "int4"], "--expert-dtype int4"),
        (["--variants", '{"a": {}}', "--batches", "1,x"], "comma-separated positive integers"),
        (["--variants", '{"a": {}}', "--rounds", "0"], "a positive integer"),
        (["--variants", '{"a": {"programmatic_launch": true}}'], "programmatic_launch: must be 0, 1 or 2"),
    ],
)
def test_bad_arguments_are_refused_in_one_line(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert message in err and "Traceback" not in err
