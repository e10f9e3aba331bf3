"""A spy on a kernel launcher, shared by the cuda backend's tests: ``from tests.spy import Spy``."""


class Spy:
    """Counts the calls of a launcher as the module that imported it sees it, and keeps each call's keyword
    arguments (eager passes: a replayed graph makes no Python calls)."""

    def __init__(self, monkeypatch, module, name):
        self.calls, self.kwargs, original = 0, [], getattr(module, name)

        def spy(*args, **kwargs):
            self.calls += 1
            self.kwargs.append(kwargs)
            return original(*args, **kwargs)

        monkeypatch.setattr(module, name, spy)
