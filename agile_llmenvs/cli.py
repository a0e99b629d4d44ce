"""The ``agile-llmenvs`` command line: thin commands over the library's layers."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from pydantic import ValidationError

from agile_llmenvs.errors import AgileLLMEnvsError, ManifestError

__all__ = ["main"]


def _describe(path: Path) -> str:
    from agile_llmenvs.specs import LLMEnvSpec, load_manifest

    manifest = load_manifest(path)
    env = manifest.env
    if isinstance(env, LLMEnvSpec):
        what = f"{env.env_type} env {env.label!r}"
        what += f" ({env.objective})" if env.objective else f" from {env.source}"
    else:
        name = getattr(env, "env_id", env.name)
        what = f"{env.env_type} env {name!r} x{env.num_envs}"
    if manifest.training is not None:
        what += f", trained with {manifest.training.algorithm}"
    return f"run {manifest.name!r}: {what}" if manifest.name else what


def _validate(args: argparse.Namespace) -> int:
    status = 0
    for path in args.files:
        try:
            print(f"ok    {path}: {_describe(path)}")
        except ValidationError as exc:
            status = 1
            print(f"error {path}: {exc.error_count()} problem(s)", file=sys.stderr)
            for error in exc.errors():
                where = ".".join(str(part) for part in error["loc"]) or "(manifest)"
                print(f"  {where}: {error['msg']}", file=sys.stderr)
        except (OSError, ManifestError) as exc:
            status = 1
            print(f"error {path}: {exc}", file=sys.stderr)
    return status


def _schema(args: argparse.Namespace) -> int:
    from agile_llmenvs.specs import manifest_json_schema

    text = json.dumps(manifest_json_schema(), indent=2) + "\n"
    if args.output is None:
        sys.stdout.write(text)
    else:
        args.output.write_text(text, encoding="utf-8")
        print(f"wrote {args.output}")
    return 0


def _serve(args: argparse.Namespace) -> int:
    import signal
    import threading

    from agile_llmenvs.transport.resolve import resolve_env

    env_config = json.loads(args.env_config) if args.env_config else None
    url, server = resolve_env(
        args.entrypoint,
        env_config,
        factory=args.factory,
        host=args.host,
        port=args.port,
        max_concurrent_envs=args.max_concurrent_envs,
        advertise_host=args.advertise_host,
        token=args.token,
    )
    assert server is not None, "serve takes an entrypoint, not a URL"
    stop = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stop.set())
    print(f"serving {args.entrypoint} at {url} (sessions at {url}/ws)", flush=True)
    while not stop.wait(1.0):
        if not server.serving:  # exit non-zero, so a supervisor restarts it
            print(f"error: the env server at {url} stopped serving", file=sys.stderr)
            server.close()
            return 1
    server.close()
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="agile-llmenvs", description="The environment layer of LLM reinforcement learning."
    )
    parser.add_argument("--debug", action="store_true", help="show tracebacks of errors")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    validate = commands.add_parser("validate", help="check run manifests (YAML or JSON)")
    validate.add_argument("files", nargs="+", type=Path, metavar="FILE")
    validate.set_defaults(run=_validate)
    schema = commands.add_parser("schema", help="print the JSON Schema of run manifests")
    schema.add_argument("-o", "--output", type=Path, help="write to this file instead")
    schema.set_defaults(run=_schema)
    serve = commands.add_parser("serve", help="host an env over OpenEnv's WebSocket protocol")
    serve.add_argument("entrypoint", help="module:Class, or a registry id with --factory")
    serve.add_argument("--factory", help="module:attr callable that receives the entrypoint")
    serve.add_argument("--env-config", help="JSON object of keyword arguments for the env")
    serve.add_argument(
        "--max-concurrent-envs",
        type=int,
        default=None,
        help="sessions served at once, a fresh env each (default 1)",
    )
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--advertise-host", help="host clients should dial, if not --host")
    serve.add_argument("--token", help="shared secret clients must present")
    serve.set_defaults(run=_serve)
    from agile_llmenvs.evaluation.command import register as register_eval

    register_eval(commands)
    from agile_llmenvs.training.command import register as register_train

    register_train(commands)
    from agile_llmenvs.viewer.command import register as register_show

    register_show(commands)
    from agile_llmenvs.bench_command import register as register_bench

    register_bench(commands)
    for command in commands.choices.values():  # --debug after the command works too
        command.add_argument(
            "--debug", action="store_true", default=argparse.SUPPRESS, help="show tracebacks"
        )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the process exit status.

    A user's mistake (a bad manifest, argument, file or setting) prints one line naming it
    and exits 2; ``--debug`` (before or after the command) shows the traceback instead.
    """
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        return int(args.run(args))
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except (AgileLLMEnvsError, ValidationError, ValueError, OSError) as exc:
        if args.debug:
            raise
        print(f"error: {_one_line(exc)} (--debug shows the traceback)", file=sys.stderr)
        return 2


def _one_line(exc: BaseException) -> str:
    """What went wrong, in one line: a validation error's first problem by field."""
    if isinstance(exc, ValidationError):
        first = exc.errors()[0]
        where = ".".join(str(part) for part in first["loc"]) or "(input)"
        more = f" (and {exc.error_count() - 1} more)" if exc.error_count() > 1 else ""
        return f"{where}: {first['msg']}{more}"
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if isinstance(exc, AgileLLMEnvsError) else f"{type(exc).__name__}: {text}"


if __name__ == "__main__":
    raise SystemExit(main())
