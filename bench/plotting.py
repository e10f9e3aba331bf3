"""matplotlib for the benches' PNGs, headless; None when it is not installed (the JSON is the result)."""
from __future__ import annotations


def pyplot():
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt
