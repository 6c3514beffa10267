"""The ``rolloutd`` command: serve, trainer, tiny-model, checkpoints."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from typing import Any, NoReturn

from rolloutd import __version__
from rolloutd.config import ConfigError, load_config

SERVE_FLAGS: dict[str, tuple[str, Any]] = {
    # flag dest: (config key, type)
    "engine": ("engine.kind", str),
    "model": ("engine.model", str),
    "dataset": ("dataset.path", str),
    "group_size": ("group_size", int),
    "epochs": ("dataset.epochs", int),
    "grpc_port": ("grpc.port", int),
    "http_port": ("http.port", int),
    "checkpoint_dir": ("checkpoint.dir", str),
    "checkpoint_interval": ("checkpoint.interval_s", float),
    "restore": ("restore", str),
    "max_tokens": ("engine.max_tokens", int),
    "replica": ("fleet.replica", int),
    "replicas": ("fleet.replicas", int),
}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rolloutd", description="Rollout service for RL post-training of LLMs."
    )
    parser.add_argument("--version", action="version", version=f"rolloutd {__version__}")
    parser.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING, ERROR")
    parser.add_argument(
        "--log-format",
        default="text",
        choices=["text", "json"],
        help="json: one object a line, with trace_id and span_id inside a span",
    )
    # Also after the subcommand (`rolloutd serve --log-level debug`); there they win.
    after = argparse.ArgumentParser(add_help=False)
    after.add_argument("--log-level", default=argparse.SUPPRESS, help="DEBUG, INFO, WARNING, ERROR")
    after.add_argument("--log-format", default=argparse.SUPPRESS, choices=["text", "json"])
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run the service", parents=[after])
    serve.add_argument("--config", help="YAML config file")
    serve.add_argument("--engine", choices=["vllm", "synthetic"])
    serve.add_argument(
        "--model", help="local Hugging Face model directory (default: the tiny model)"
    )
    serve.add_argument(
        "--dataset", help="JSONL or Parquet prompt file (default: bundled arithmetic set)"
    )
    serve.add_argument("--group-size", type=int, help="siblings per prompt")
    serve.add_argument("--epochs", type=int, help="stop admitting after this many passes")
    serve.add_argument("--grpc-port", type=int, help="gRPC port (0: pick a free one)")
    serve.add_argument("--http-port", type=int, help="admin HTTP port (0: pick a free one)")
    serve.add_argument("--checkpoint-dir", help="snapshot directory or fsspec URL")
    serve.add_argument(
        "--checkpoint-interval", type=float, help="seconds between checkpoints (0: off)"
    )
    serve.add_argument("--restore", help="latest, none, a sequence number or a tag")
    serve.add_argument("--max-tokens", type=int, help="longest completion per sibling")
    serve.add_argument("--replica", type=int, help="this replica's index in the fleet (from 0)")
    serve.add_argument("--replicas", type=int, help="the fleet's size (replicas sharing a dataset)")

    trainer = sub.add_parser(
        "trainer", help="example trainer: fetch, train, ack, report progress", parents=[after]
    )
    trainer.add_argument(
        "--target", default="localhost:50051", help="comma-separated host:port list"
    )
    trainer.add_argument("--groups-per-step", type=int, default=8)
    trainer.add_argument("--steps", type=int, help="stop after this many steps")
    trainer.add_argument("--train-s", type=float, default=0.0, help="simulated seconds per step")
    trainer.add_argument(
        "--checkpoint-every", type=int, default=0, help="Checkpoint(step) every N steps"
    )
    trainer.add_argument("--idle-exit-s", type=float, default=30.0)
    trainer.add_argument(
        "--ready-timeout-s",
        type=float,
        default=900.0,
        help="how long to wait for the service to be ready",
    )
    trainer.add_argument(
        "--unreachable-timeout-s",
        type=float,
        default=120.0,
        help="give up on an endpoint that has not answered at all for this long (at start-up,"
        " and mid-run: a restart shorter than this is waited for)",
    )
    trainer.add_argument(
        "--token-file",
        help="file holding the bearer token (the service's auth.token); default: the "
        "environment variable ROLLOUTD_AUTH__TOKEN",
    )
    trainer.add_argument(
        "--token", help="bearer token; visible to every user in `ps`: prefer --token-file"
    )
    trainer.add_argument("--tls-ca", help="PEM CA bundle of the service's certificate (TLS)")
    trainer.add_argument("--tls-cert", help="PEM client certificate (mutual TLS)")
    trainer.add_argument("--tls-key", help="PEM key of --tls-cert")

    tiny = sub.add_parser(
        "tiny-model", help="build the tiny random Llama model into DIR", parents=[after]
    )
    tiny.add_argument("dir")
    tiny.add_argument("--seed", type=int, default=0)

    ckpt = sub.add_parser(
        "checkpoints", help="list, show or verify snapshots; repair a journal", add_help=False
    )
    ckpt.add_argument("args", nargs=argparse.REMAINDER)
    rescore = sub.add_parser(
        "rescore", help="recompute a store's rewards and report mismatches", add_help=False
    )
    rescore.add_argument("args", nargs=argparse.REMAINDER)
    return parser


_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters
_KEEP_FREED = 256 * 2**20


def _keep_freed_memory() -> None:
    """Has glibc's allocator keep up to 256 MiB of freed memory mapped, and serve blocks below that
    from its heap rather than from a fresh ``mmap`` each.

    A push hands the service a 1 MiB ``bytes`` per chunk (gRPC's copy), up to 32 MiB queued for
    writing (``rolloutd.weights.receive``). With glibc's default, adaptive thresholds the heap's
    top is given back to the kernel as the queue drains, and each new chunk faults in fresh
    zeroed pages: on the 2-core development VM close to a tenth of the service's CPU during a
    push went to page faults and zeroing, and with these settings the push moved 2,253-2,269
    MB/s against 1,891-1,968 without, in runs side by side (see the weights section of
    ``benchmarks/README.md``). The cost is freed memory the process keeps, at most this much at
    the heap's top.
    """
    import ctypes
    import platform

    if platform.libc_ver()[0] != "glibc":
        return
    libc = ctypes.CDLL(None)
    libc.mallopt(_M_MMAP_THRESHOLD, _KEEP_FREED)
    libc.mallopt(_M_TRIM_THRESHOLD, _KEEP_FREED)


def _serve(args: argparse.Namespace) -> int:
    """Ends the process itself once the service stopped or failed to start (see
    :func:`_end_process`); returns only for a configuration error."""
    from rolloutd.server import RolloutService
    from rolloutd.startup import START_FAILURES, describe

    overrides = {
        key: getattr(args, dest)
        for dest, (key, _) in SERVE_FLAGS.items()
        if getattr(args, dest) is not None
    }
    try:
        config = load_config(args.config, overrides)
    except ConfigError as exc:
        print(f"rolloutd: {exc}", file=sys.stderr)
        return 2
    _keep_freed_memory()
    sys.setswitchinterval(config.switch_interval_ms / 1000)  # see the key's description
    # before anything is created: the store, the journal, staged weights, logs
    os.umask(config.umask)

    async def main() -> int:
        try:
            service = RolloutService(config)
            service.install_signal_handlers()
            await service.start()
        except ConfigError as exc:  # a pipeline entry point or verifier that cannot be loaded
            print(f"rolloutd: {exc}", file=sys.stderr)
            return 2
        except START_FAILURES as exc:
            logging.getLogger("rolloutd").debug("start failed", exc_info=True)
            print(f"rolloutd: {describe(exc, config)}", file=sys.stderr)
            return 1
        return await service.run_until_stopped()

    code = asyncio.run(main())
    _end_process(code)


def _trainer_token(args: argparse.Namespace, parser: argparse.ArgumentParser) -> str | None:
    """``--token``, else ``--token-file``, else ``ROLLOUTD_AUTH__TOKEN`` (the variable the
    service reads its own from), else none. A file or the environment keeps the token out of
    the command line, which every user of the machine can read."""
    if args.token is not None and args.token_file is not None:
        parser.error("--token and --token-file: pass one")
    if args.token is not None:
        return str(args.token)
    if args.token_file is not None:
        try:
            with open(args.token_file) as f:
                token = f.read().strip()
        except OSError as exc:
            parser.error(f"--token-file {args.token_file}: {exc.strerror}")
        if not token:
            parser.error(f"--token-file {args.token_file} is empty")
        return token
    return os.environ.get("ROLLOUTD_AUTH__TOKEN", "").strip() or None


def _end_process(code: int) -> NoReturn:
    """Ends ``rolloutd serve`` once it has shut down in order (final checkpoint, engine stopped,
    telemetry flushed), without Python's finalization.

    Finalization has nothing left to do for the service, but it tears down native extension
    modules, and nanobind's (Triton's, which vLLM imports even where it disables Triton) print
    dozens of lines of leak reports to stderr then; a thread still running at that point could
    print an empty ``Error in sys.excepthook``. Output is flushed first."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(code)


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    # `checkpoints` has a parser of its own (rolloutd.checkpoint.inspect): what this one does not
    # know, `--help` included, is passed on to it.
    args, unknown = parser.parse_known_args(argv)
    if unknown and args.command not in ("checkpoints", "rescore"):
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    # A descriptor of its own: while vLLM starts, stdout and stderr point at vLLM's log file.
    handler = logging.StreamHandler(os.fdopen(os.dup(sys.stderr.fileno()), "w", buffering=1))
    if args.log_format == "json":
        from rolloutd.telemetry.logs import JsonFormatter

        handler.setFormatter(JsonFormatter())
    else:
        from rolloutd.telemetry.logs import TextFormatter

        handler.setFormatter(TextFormatter())
    logging.basicConfig(level=args.log_level.upper(), handlers=[handler])
    if logging.getLogger().getEffectiveLevel() > logging.DEBUG:
        # The admin server logs its own start and stop; rolloutd says where it listens.
        logging.getLogger("uvicorn").setLevel(logging.WARNING)
        # vLLM says on import, before its output goes to its log, that Triton has no CPU backend.
        logging.getLogger("vllm.triton_utils").setLevel(logging.ERROR)
    if args.command == "serve":
        return _serve(args)
    if args.command == "trainer":
        from rolloutd.trainer import RequestFailed, ServiceNotReady, TrainerConfig, run

        if (args.tls_cert is None) != (args.tls_key is None):
            parser.error("--tls-cert and --tls-key go together")

        cfg = TrainerConfig(
            endpoints=args.target.split(","),
            groups_per_step=args.groups_per_step,
            steps=args.steps,
            train_s=args.train_s,
            checkpoint_every=args.checkpoint_every,
            idle_exit_s=args.idle_exit_s,
            ready_timeout_s=args.ready_timeout_s,
            unreachable_timeout_s=args.unreachable_timeout_s,
            token=_trainer_token(args, parser),
            tls_ca=args.tls_ca,
            tls_cert=args.tls_cert,
            tls_key=args.tls_key,
        )
        from rolloutd.telemetry.providers import trainer_tracing

        tracing = trainer_tracing()
        try:
            run(cfg, out=lambda line: print(line, flush=True))
        except (ServiceNotReady, RequestFailed) as exc:
            logging.getLogger("rolloutd").debug("trainer failed", exc_info=True)
            print(f"rolloutd trainer: {exc}", file=sys.stderr)
            return 1
        except OSError as exc:  # the only files it reads are the TLS ones
            print(
                f"rolloutd trainer: {exc.filename}: {exc.strerror}; check --tls-ca, --tls-cert "
                "and --tls-key",
                file=sys.stderr,
            )
            return 1
        finally:
            tracing.shutdown()
        return 0
    if args.command == "tiny-model":
        from rolloutd.engines.tiny_model import build_tiny_model

        print(build_tiny_model(args.dir, seed=args.seed, progress=print))
        return 0
    if args.command == "checkpoints":
        from rolloutd.checkpoint.inspect import main as checkpoints_main

        return checkpoints_main([*unknown, *args.args])
    if args.command == "rescore":
        from rolloutd.rescore import main as rescore_main

        return rescore_main([*unknown, *args.args])
    raise AssertionError(args.command)


if __name__ == "__main__":
    raise SystemExit(main())
