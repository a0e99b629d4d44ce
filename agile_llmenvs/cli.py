"""The ``agile-llmenvs`` command line: thin commands over the library's layers."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from agile_llmenvs.errors import AgileLLMEnvsError, EnvBuildError, ImportPathError, ManifestError

__all__ = ["main"]

#: Sessions ``serve`` hosts at once unless told otherwise: one GRPO group of the manifest's
#: default ``group_size`` (8), each completion's episode in a session of its own.
SERVE_SESSIONS = 8


def _validate(args: argparse.Namespace) -> int:
    from agile_llmenvs.validation import report_lines, validate_file

    status = 0
    for path in args.files:
        result = validate_file(path, check_files=not args.no_files, build=not args.no_build)
        if result.ok:
            print(f"ok    {path}: {result.summary}")
            continue
        status = 2
        print("\n".join(report_lines(result)), file=sys.stderr)
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
    import os

    if not 0 <= args.port <= 65535:
        raise ManifestError(f"--port: expected 0..65535 (0: any free port), got {args.port}")
    args.token = _serve_token(args.token, args.token_file)
    working_dir = None
    if not _is_manifest(args.entrypoint) and os.getcwd() not in sys.path:
        # as uvicorn does: an entrypoint's module may sit in the working directory, which a
        # console script's sys.path lacks (a manifest's modules follow the manifest's rule)
        working_dir = os.getcwd()
        sys.path.insert(0, working_dir)
    try:
        return _serve_env(args)
    finally:
        if working_dir is not None and working_dir in sys.path:
            sys.path.remove(working_dir)


def _serve_env(args: argparse.Namespace) -> int:
    """Host the env ``args`` name until SIGINT or SIGTERM (or the server stops serving)."""
    import os
    import signal
    import threading

    from agile_llmenvs.transport.server import OpenEnvServer

    make_env, name, sessions = _env_to_serve(args)
    exposed = _exposure_warning(args.host, args.token)
    if exposed is not None:
        print(exposed, file=sys.stderr, flush=True)
    server = OpenEnvServer(
        make_env=make_env,
        host=args.host,
        port=args.port,
        env_name=name,
        max_concurrent_envs=args.max_concurrent_envs or sessions or SERVE_SESSIONS,
        advertise_host=args.advertise_host,
        token=args.token,
        mode=args.mode,
    )
    url = server.url
    stop = threading.Event()
    previous = {
        signum: signal.signal(signum, lambda *_: stop.set())
        for signum in (signal.SIGINT, signal.SIGTERM)
    }
    print(f"serving {args.entrypoint} at {url} (sessions at {url}/ws)", flush=True)
    status = 0
    try:
        while not stop.wait(1.0):
            if not server.serving:  # exit non-zero, so a supervisor restarts it
                print(f"error: the env server at {url} stopped serving", file=sys.stderr)
                status = 1
                break
    finally:
        for signum, handler in previous.items():  # a caller's own handlers, as they were
            if handler is not None:
                signal.signal(signum, handler)
    server.close()  # open sessions get a close frame; bounded by a few seconds
    if server.serving:  # an env call that never returns holds the server: leave anyway
        print(f"the env server at {url} did not stop within 5 s; exiting", file=sys.stderr)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
    return status


#: The environment variable ``serve`` reads its token from when no option gives one.
TOKEN_ENV = "AGILE_LLMENVS_TOKEN"


def _serve_token(token: str | None, token_file: Path | None) -> str | None:
    """The token ``serve`` guards its env with: ``--token`` (which ``ps`` shows to every user
    of the machine), else ``--token-file`` (its first line), else ``$AGILE_LLMENVS_TOKEN``.

    Raises:
        ManifestError: both options, an unreadable or empty file, or an empty variable.
    """
    import os

    if token is not None and token_file is not None:
        raise ManifestError("--token and --token-file: give the token one way")
    if token_file is not None:
        try:
            lines = token_file.read_text(encoding="utf-8").splitlines()
        except OSError as exc:
            raise ManifestError(f"--token-file: cannot read {token_file}: {exc}") from exc
        token = lines[0].strip() if lines else ""
        if not token:
            raise ManifestError(f"--token-file: {token_file} is empty; write the token in it")
        return token
    if token is None and TOKEN_ENV in os.environ:
        token = os.environ[TOKEN_ENV].strip()
        if not token:
            raise ManifestError(f"${TOKEN_ENV} is set but empty: set the token, or unset it")
    return token


def _exposure_warning(host: str, token: str | None) -> str | None:
    """The warning for a server any host on the network can use, or None."""
    import ipaddress

    if token is not None:
        return None
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:  # a host name: it may resolve to any interface
        loopback = False
    if loopback:
        return None
    return (
        f"warning: serving on {host} without --token: anyone who can reach this port can run "
        f"and exhaust its envs; pass --token-file FILE or set ${TOKEN_ENV} (clients send it "
        "as a Bearer token), or bind 127.0.0.1"
    )


def _env_to_serve(args: argparse.Namespace) -> tuple[Callable[[], Any], str, int | None]:
    """What ``serve`` hosts: the env factory (one env already built and closed, so a mistake
    fails now rather than in every session), the env's name, and a manifest's ``num_envs``."""
    from agile_llmenvs.llm_envs.from_spec import text_env_factory
    from agile_llmenvs.transport.resolve import env_factory

    target: str = args.entrypoint
    sessions = None
    if _is_manifest(target):
        from agile_llmenvs.specs import LLMEnvSpec, load_manifest

        if args.factory is not None or args.env_config is not None:
            raise ManifestError(
                f"--factory and --env-config configure an entrypoint; {target} is a manifest: "
                "set `factory` and `env_config` in its env section instead"
            )
        manifest = load_manifest(target)
        spec = manifest.env
        if not isinstance(spec, LLMEnvSpec):
            raise ManifestError(
                f"env.env_type: {target} declares a {spec.env_type} env; serve hosts text envs "
                "(env_type: rollout, from an entrypoint or from dataset rows with a rubric)"
            )
        make_env = _imported(target, lambda: text_env_factory(spec, seed=manifest.seed))
        name, sessions = spec.name or spec.label, spec.num_envs
    else:
        env_config = _env_config(args.env_config)
        make_env = _imported(target, lambda: env_factory(target, env_config, factory=args.factory))
        name = target
    try:
        env = make_env()
    except AgileLLMEnvsError:
        raise
    except Exception as exc:  # the env's own constructor: a wrong env_config, say
        raise EnvBuildError(f"cannot build the env {name!r}: {type(exc).__name__}: {exc}") from exc
    close = getattr(env, "close", None)
    if callable(close):
        close()
    return make_env, name, sessions


def _is_manifest(target: str) -> bool:
    return target.lower().endswith((".yaml", ".yml", ".json"))


def _imported(target: str, resolve: Callable[[], Any]) -> Any:
    """``resolve()``; a user's module that fails while it imports is named in one line."""
    try:
        return resolve()
    except AgileLLMEnvsError:
        raise
    except Exception as exc:
        raise ImportPathError(f"{target}: importing failed: {type(exc).__name__}: {exc}") from exc


def _env_config(text: str | None) -> dict[str, Any] | None:
    if text is None:
        return None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ManifestError(f"--env-config: not valid JSON ({exc})") from exc
    if not isinstance(value, dict):
        raise ManifestError(
            f"--env-config: expected a JSON object of keyword arguments such as "
            f"'{{\"size\": 3}}', got {type(value).__name__}"
        )
    return value


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="agile-llmenvs", description="The environment layer of LLM reinforcement learning."
    )
    parser.add_argument("--debug", action="store_true", help="show tracebacks of errors")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _register_validate(commands)
    _register_schema(commands)
    _register_serve(commands)
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


def _register_validate(commands: argparse._SubParsersAction) -> None:
    """Add the ``validate`` subcommand."""
    validate = commands.add_parser(
        "validate",
        help="check run manifests and eval configs (YAML or JSON) without running them",
        description="Check each file's fields, then the files, imports and model it names "
        "(nothing is downloaded). Exit 2 when any file has a problem.",
    )
    validate.add_argument("files", nargs="+", type=Path, metavar="FILE")
    validate.add_argument(
        "--no-files",
        action="store_true",
        help="check the fields only, not the files, imports and model they name",
    )
    validate.add_argument(
        "--no-build",
        action="store_true",
        help="do not build one env of a rollout entrypoint to check its env_config (an env "
        "on Ray env hosts or at an env_url is never built)",
    )
    validate.set_defaults(run=_validate)


def _register_schema(commands: argparse._SubParsersAction) -> None:
    """Add the ``schema`` subcommand."""
    schema = commands.add_parser("schema", help="print the JSON Schema of run manifests")
    schema.add_argument("-o", "--output", type=Path, help="write to this file instead")
    schema.set_defaults(run=_schema)


def _register_serve(commands: argparse._SubParsersAction) -> None:
    """Add the ``serve`` subcommand."""
    serve = commands.add_parser("serve", help="host an env over OpenEnv's WebSocket protocol")
    serve.add_argument(
        "entrypoint",
        metavar="TARGET",
        help="module:Class, path/to/envs.py:Class, a registry id with --factory, or a run "
        "manifest (.yaml/.yml/.json) whose env is a rollout env of an entrypoint or of dataset "
        "rows with a rubric",
    )
    serve.add_argument(
        "--factory", help="module:attr (or file.py:attr) callable that receives the entrypoint"
    )
    serve.add_argument("--env-config", help="JSON object of keyword arguments for the env")
    serve.add_argument(
        "--max-concurrent-envs",
        type=int,
        default=None,
        help="envs alive at once (WebSocket sessions, MCP sessions and HTTP calls), a fresh "
        f"env each (default: a manifest's env.num_envs, else {SERVE_SESSIONS}: one GRPO group "
        "of the default group_size; for training use at least batch_size * group_size)",
    )
    serve.add_argument(
        "--host",
        default="127.0.0.1",
        help="interface to bind (default: 127.0.0.1, loopback; another one without --token warns)",
    )
    serve.add_argument(
        "--port", type=int, default=8000, help="port to listen on (default: 8000; 0: any free one)"
    )
    serve.add_argument("--advertise-host", help="host clients should dial, if not --host")
    serve.add_argument(
        "--token",
        help="shared secret clients must present (Authorization: Bearer); visible in `ps`: "
        f"prefer --token-file or ${TOKEN_ENV}",
    )
    serve.add_argument(
        "--token-file",
        type=Path,
        help=f"file whose first line is the token (default: ${TOKEN_ENV}, if set)",
    )
    serve.add_argument(
        "--mode",
        choices=("simulation", "production"),
        default=None,
        help="OpenEnv's server mode: simulation serves every route; production drops the "
        "simulation controls POST /reset, POST /step and GET /state (404) and keeps /ws "
        "sessions, /mcp, /health, /metadata and /schema (default: $OPENENV_MODE, else "
        "simulation)",
    )
    serve.set_defaults(run=_serve)


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
        from agile_llmenvs.validation import problems_of

        more = f" (and {exc.error_count() - 1} more)" if exc.error_count() > 1 else ""
        return f"{problems_of(exc)[0]}{more}"
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if isinstance(exc, AgileLLMEnvsError) else f"{type(exc).__name__}: {text}"


if __name__ == "__main__":
    raise SystemExit(main())
