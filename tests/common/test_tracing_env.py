"""The tracing variables the SDK takes badly are refused at start-up, one line naming the variable: an OTLP endpoint
urllib cannot parse stopped the router and the worker with a traceback, and a ratio sampler's argument that is no
number in [0, 1] made the SDK sample every trace after one warning."""

from __future__ import annotations

import random
import subprocess
import sys

import pytest

from common.errors import ConfigError
from common.tracing import check_tracing_env, configure_tracing
from tests.helpers import serve_env

BAD_ENDPOINTS = ["http://[::1", "http://collector:99999", "ftp://collector:4317", " ",
                 "http://:4317", " http://collector:4317", "http://coll ector:4317"]  # fmt: skip
GOOD_ENDPOINTS = ["http://collector:4317", "https://collector:4317/", "collector:4317", "http://[::1]:4317"]
# What the gRPC exporter dials as well: grpc:// (its host and port, over TLS unless OTEL_EXPORTER_OTLP_INSECURE), a
# path after the port (ignored), and gRPC's own target names, which it hands to gRPC whole.
EXPORTER_ENDPOINTS = ["grpc://collector:4317", "GRPC://collector:4317", "https://[::1]:4318/v1/traces",
                      "unix:///var/run/otel.sock", "dns:///collector:4317", "ipv4:127.0.0.1:4317",
                      "ipv6:[::1]:4317", "unix-abstract:otel-collector"]  # fmt: skip
# gRPC target names the exporter would dial wrongly (the authority alone: a DNS server, "tmp") or not at all
BAD_TARGETS = ["dns://8.8.8.8/collector:4317", "unix://tmp/otel.sock", "unix:", "dns:///"]


@pytest.mark.parametrize("endpoint", BAD_ENDPOINTS)
@pytest.mark.parametrize("var", ["OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"])
def test_a_bad_otlp_endpoint_is_refused_naming_the_variable(var, endpoint):
    with pytest.raises(ConfigError) as e:
        configure_tracing("test", env={var: endpoint}, set_global=False)
    assert str(e.value).startswith(f"{var}: {endpoint!r} "), e.value


@pytest.mark.parametrize("endpoint", GOOD_ENDPOINTS)
def test_an_otlp_endpoint_with_or_without_scheme_is_taken(endpoint):
    check_tracing_env({"OTEL_EXPORTER_OTLP_ENDPOINT": endpoint})


@pytest.mark.parametrize("endpoint", EXPORTER_ENDPOINTS)
def test_an_endpoint_the_grpc_exporter_dials_is_not_refused(endpoint):
    """The check refused grpc://, unix:// and dns:/// endpoints, which the OTLP/gRPC exporter serves."""
    check_tracing_env({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": endpoint})


@pytest.mark.parametrize("endpoint", BAD_TARGETS)
def test_a_grpc_target_the_exporter_would_dial_wrongly_is_refused(endpoint):
    with pytest.raises(ConfigError) as e:
        check_tracing_env({"OTEL_EXPORTER_OTLP_ENDPOINT": endpoint})
    assert str(e.value).startswith(f"OTEL_EXPORTER_OTLP_ENDPOINT: {endpoint!r} "), e.value


@pytest.mark.parametrize("arg", ["abc", "1.5", "-0.1", "nan", "inf", "10%", "0,1"])
@pytest.mark.parametrize("sampler", ["traceidratio", "parentbased_traceidratio", "TraceIdRatio"])
def test_a_ratio_that_is_no_number_in_0_1_is_refused(sampler, arg):
    with pytest.raises(ConfigError) as e:
        configure_tracing(
            "test", env={"OTEL_TRACES_SAMPLER": sampler, "OTEL_TRACES_SAMPLER_ARG": arg}, set_global=False
        )
    assert str(e.value).startswith("OTEL_TRACES_SAMPLER_ARG: "), e.value


def test_a_ratio_in_0_1_is_taken():
    ratio = str(random.random())
    check_tracing_env({"OTEL_TRACES_SAMPLER": "parentbased_traceidratio", "OTEL_TRACES_SAMPLER_ARG": ratio})
    check_tracing_env({"OTEL_TRACES_SAMPLER": "always_on", "OTEL_TRACES_SAMPLER_ARG": "abc"})  # no ratio to read


@pytest.mark.parametrize("env", [{"OTEL_EXPORTER_OTLP_ENDPOINT": "http://[::1"},
                                 {"OTEL_TRACES_SAMPLER": "traceidratio", "OTEL_TRACES_SAMPLER_ARG": "0,5"}])  # fmt: skip
def test_the_router_stops_with_one_line_and_exit_2(env):
    command = [sys.executable, "-m", "colibri.cli", "router", "--worker", "127.0.0.1:1", "--host", "127.0.0.1",
               "--port", "0", "--metrics-port", "0"]  # fmt: skip
    done = subprocess.run(command, env={**serve_env(), **env}, capture_output=True, timeout=60)
    err = done.stderr.decode()
    assert done.returncode == 2 and err.count("\n") == 1, err
    assert err.startswith(f"colibri router: error: {next(iter(env)) if len(env) == 1 else 'OTEL_TRACES_SAMPLER_ARG'}")
