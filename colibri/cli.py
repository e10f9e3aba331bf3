"""The `colibri` command. Each subcommand lives in its own module exposing ``add_arguments(parser)`` and
``run(args) -> int``; modules are imported only when their subcommand runs, so `colibri router` never
loads numba. Expected failures (``ColibriError``, and ``OSError``: the disk, permissions, ports) print one
line and exit with the error's code (docs/cli.md lists them); anything else keeps its traceback: a bug.
"""

from __future__ import annotations

import argparse
import importlib
import os
import signal
import sys
import threading

from common.errors import ColibriError

SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "convert": ("expert_service.tools.cli.convert_cmd", "convert a Hugging Face safetensors checkpoint to a model dir"),
    "verify": ("expert_service.tools.cli.verify_cmd", "re-check every tensor checksum of a model directory"),
    "make-tiny": ("expert_service.tools.cli.make_tiny_cmd", "write and convert the small random-weight test model"),
    "logits": ("expert_service.tools.cli.logits_cmd", "offline: prefill logits of token ids, saved as .npy"),
    "complete": ("expert_service.tools.cli.complete_cmd", "offline: complete token ids without services (JSON out)"),
    "router-gen": (
        "expert_service.tools.cli.router_gen_cmd",
        "build the static token -> experts routing table and report its recall",
    ),
    "worker": ("expert_service.serving.main", "run the expert worker gRPC service (owns the model and GPU)"),
    "router": ("router_service.main", "run the router gRPC service (public API, batching)"),
    "serve": ("colibri.serve", "run worker and router as two processes, for local use"),
    "generate": ("router_service.generate_cmd", "client: stream a completion from a running router"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="colibri",
        description="Colibri: an inference server for Mixture-of-Experts LLMs.",
        epilog="Run `colibri SUBCOMMAND --help` for each subcommand's options. Exit codes: docs/cli.md.",
    )
    sub = parser.add_subparsers(dest="command", metavar="SUBCOMMAND", required=True)
    for name, (module, help_text) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.set_defaults(_module=module)
        # Options are added lazily (see main) so that --help of one subcommand imports only its module.
        if name in sys.argv[1:2]:
            importlib.import_module(module).add_arguments(p)
    return parser


class _InterruptSeen:
    """Python's SIGINT behaviour (KeyboardInterrupt), remembering that it fired: an extension module whose import
    the interrupt lands in can turn it into an ImportError (numpy's does: "PyCapsule_Import could not import module
    'datetime'"), and that is the operator's Ctrl-C, not a broken install."""

    def __init__(self):
        self.fired = False

    def __call__(self, signum, frame):
        self.fired = True
        raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    interrupt = _InterruptSeen()
    own = threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGINT) is (
        signal.default_int_handler  # not where a caller installed its own
    )
    if own:
        signal.signal(signal.SIGINT, interrupt)
    try:
        return _main(sys.argv[1:] if argv is None else argv, interrupt)
    finally:
        if own and signal.getsignal(signal.SIGINT) is interrupt:  # router/worker put theirs in place: kept
            signal.signal(signal.SIGINT, signal.default_int_handler)


def _main(argv: list[str], interrupt: _InterruptSeen) -> int:
    if argv[:1] in (["router"], ["worker"]):  # before their imports: a signal then stops them cleanly (0)
        from common.lifecycle import STOP_SIGNALS

        STOP_SIGNALS.hold()
    # gRPC's C core writes its own lines to stderr as raw text, between the JSON ones (each TLS handshake a
    # plaintext client fails, at INFO); what it reports that matters reaches Python as a status or a bind failure.
    # Set before gRPC starts; the variable, given, still wins (docs/observability.md).
    os.environ.setdefault("GRPC_VERBOSITY", "NONE")
    command = argv[0] if argv[:1] and argv[0] in SUBCOMMANDS else ""
    try:
        # The parser imports the subcommand's module (numpy, numba: seconds): a Ctrl-C during it is
        # the same interruption as one during its run, not a traceback.
        saved, sys.argv = sys.argv, [sys.argv[0], *argv]
        try:
            parser = build_parser()
        finally:
            sys.argv = saved
        args = parser.parse_args(argv)
        return int(importlib.import_module(args._module).run(args) or 0)
    except ColibriError as e:
        print(f"colibri {command}: error: {e}", file=sys.stderr)
        return e.exit_code
    except OSError as e:  # disk full, permissions, a port in use: the operator's to fix, not a bug
        print(
            f"colibri {command}: error: {e.filename or ''}{': ' if e.filename else ''}{e.strerror or e}",
            file=sys.stderr,
        )
        return 1
    except KeyboardInterrupt:
        return _interrupted(command)
    except ImportError:
        if interrupt.fired:
            return _interrupted(command)
        raise


def _interrupted(command: str) -> int:
    print(f"colibri{' ' + command if command else ''}: interrupted", file=sys.stderr)
    return 130


if __name__ == "__main__":
    sys.exit(main())
