"""The garbage collector in the long-running services.

A collection of the oldest generation scans every object the collector tracks, and a service holds tens of
thousands from start-up alone (modules, gRPC, protobuf and telemetry machinery, the model's metadata) that
never become garbage. Measured with the hop stamps of bench/serve_hops.py on the shared-prefix workload, the router
stopped once early in its serving for 11-14 ms (this project's 2-core CI machine) and 24 ms (the H200 host),
collecting nothing; the step being built when it struck reached the worker that much later, in the middle of
a burst of requests. After start-up the services collect once and freeze what survives: later collections scan
only what was created since.
"""

from __future__ import annotations

import gc
import logging

log = logging.getLogger("colibri.heap")


def freeze_startup_heap(service: str) -> None:
    """Collects, then moves every object alive now out of the collector's view for good (gc.freeze): call it once,
    when start-up is done."""
    gc.collect()
    gc.freeze()
    log.info("%s: %d objects from start-up frozen out of garbage collection", service, gc.get_freeze_count())
