"""bench/q8_kernels.py's --q8-shapes parsing (the bench itself needs a GPU)."""

from __future__ import annotations

import pytest

from bench.q8_kernels import main, parse_q8_shapes
from expert_service.kernels.moe_q8 import LaunchShape


def test_named_launch_shapes_parse_in_order():
    shapes = parse_q8_shapes("w2=2/2/4/2/16,rg4u1=4/4/4/1/16,late=4/2/4/2/16/1,")
    assert list(shapes) == ["w2", "rg4u1", "late"]
    assert shapes["w2"] == LaunchShape(2, 2, 4, 2, 16) and shapes["rg4u1"].rows(gated=True) == 4
    assert shapes["late"].late_scales == 1 and shapes["w2"].late_scales == 0


@pytest.mark.parametrize(
    "bad", ["=2/2/4/2/16", "a=2/2/4/2", "a=2/2/4/2/16/2", "a=2/2/4/2/16/1/1", "a=2/0/4/2/16", "a=2/x/4/2/16"]
)
def test_malformed_launch_shapes_are_refused_in_one_line(bad, capsys):
    with pytest.raises(ValueError, match="NAME=W/RG/RD/U/WPS"):
        parse_q8_shapes(bad)
    with pytest.raises(SystemExit):
        main(["--q8-shapes", bad])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "--q8-shapes" in err and "Traceback" not in err
