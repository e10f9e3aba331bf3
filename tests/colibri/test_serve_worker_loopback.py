"""serve's router dials the worker at 127.0.0.1:--worker-port, so the worker must listen there whatever host the
environment or the config file gives workers: with COLIBRI_WORKER_HOST=::1 it listened on [::1] and the router
waited for ever."""

from __future__ import annotations

import shutil
import sys

import pytest

from common.config import flag_values, load_config_file, resolve


@pytest.mark.parametrize("env, config", [({"COLIBRI_WORKER_HOST": "::1"}, ""), ({}, "worker:\n  host: '::1'\n")])
def test_the_worker_of_serve_listens_where_the_router_dials(tmp_path, monkeypatch, env, config):
    from colibri import serve as serve_module
    from colibri.cli import build_parser
    from expert_service.serving.main import WorkerConfig

    flags = ["--worker-port", "47021"]
    if config:
        (tmp_path / "c.yaml").write_text(config)
        flags += ["--config", str(tmp_path / "c.yaml")]
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(sys, "argv", ["colibri", "serve"])
    supervisor = serve_module.Supervisor(build_parser().parse_args(["serve", "--model", str(tmp_path), *flags]))
    shutil.rmtree(supervisor.private_dir)
    assert supervisor.worker_address == "127.0.0.1:47021"
    monkeypatch.setattr(sys, "argv", ["colibri", "worker"])
    worker_args = build_parser().parse_args(supervisor.worker_cmd[3:])  # past `python -m colibri.cli`
    worker = resolve(
        WorkerConfig,
        file_values=load_config_file(worker_args.config, "worker"),
        flags=flag_values(worker_args, WorkerConfig),
    )
    assert (worker.host, worker.port) == ("127.0.0.1", 47021)
