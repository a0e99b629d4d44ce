"""``backend: vllm_server`` in an eval config: validation without a server, failures as
values, and one short ``agile-llmenvs eval`` against a real ``vllm serve``."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from agile_llmenvs.backends import VLLMServerBackend
from agile_llmenvs.backends.vllm_launch import VLLMServerProcess, free_port
from agile_llmenvs.config import BackendFactory, ModelConfig
from agile_llmenvs.evaluation.command import register

EVAL = """\
environments:
  - {{name: digits, source: entry_point, entry_point: "fakes:DigitEnv", size: 3}}
model: {{backend: {backend}, model: "{model}"{urls}}}
inference: {{temperature: 0.0, max_tokens: 6}}
"""


def run(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="agile-llmenvs")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return int(args.run(args))


def evaluate(tmp_path: Path, backend: str, model: Path, urls: list[str] | None = None) -> Any:
    listed = f", urls: {json.dumps(urls)}" if urls else ""
    config = tmp_path / f"{backend}.yaml"
    config.write_text(EVAL.format(backend=backend, model=model, urls=listed), encoding="utf-8")
    output = tmp_path / f"{backend}.json"
    code = run(["eval", str(config), "--output", str(output), "--token-ids"])
    return code, json.loads(output.read_text(encoding="utf-8"))


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"backend": "vllm_server"}, "backend 'vllm_server' needs urls: [http://host:port, ...]"),
        ({"backend": "vllm_server", "urls": ["localhost:8000"]}, "urls: 'localhost:8000' is not"),
        ({"backend": "huggingface", "urls": ["http://h:1"]}, "urls is only read with backend"),
    ],
)
def test_bad_server_configs_name_the_field(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(ValidationError) as caught:
        ModelConfig.model_validate({"model": "m", **fields})
    (error,) = caught.value.errors()
    assert message in error["msg"]


def test_empty_urls_name_the_field() -> None:
    with pytest.raises(ValidationError) as caught:
        ModelConfig.model_validate({"backend": "vllm_server", "model": "m", "urls": []})
    (error,) = caught.value.errors()
    assert error["loc"] == ("urls",)


def test_factory_builds_a_server_backend(tiny_model_dir: Path) -> None:
    config = ModelConfig(
        backend="vllm_server",
        model=str(tiny_model_dir),
        urls=["http://127.0.0.1:1", "http://127.0.0.1:2/"],
        routing="round_robin",
        timeout_s=7,
    )
    backend = BackendFactory.create(config)
    assert isinstance(backend, VLLMServerBackend)
    assert backend.urls == ("http://127.0.0.1:1", "http://127.0.0.1:2")
    assert (backend.routing, backend.timeout_s) == ("round_robin", 7.0)
    assert backend.tokenizer.convert_tokens_to_ids("<|im_end|>") == 2
    backend.close()


def test_an_unreachable_server_ends_trajectories_with_backend_errors(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    closed = f"http://127.0.0.1:{free_port()}"
    _, results = evaluate(tmp_path, "vllm_server", tiny_model_dir, [closed])
    (environment,) = results["environments"]
    trajectories = environment["trajectories"]
    assert len(trajectories) == 3
    assert {t["stop_reason"] for t in trajectories} == {"backend_error"}
    assert all(closed in t["error"] for t in trajectories)


@pytest.mark.vllm_server
def test_eval_through_a_server_equals_transformers(
    tmp_path: Path, vllm_server: VLLMServerProcess, vllm_model_dir: Path
) -> None:
    code, served = evaluate(tmp_path, "vllm_server", vllm_model_dir, [vllm_server.url])
    assert code == 0
    _, local = evaluate(tmp_path, "huggingface", vllm_model_dir)

    def played(results: Any) -> list[Any]:
        (environment,) = results["environments"]
        keys = ("stop_reason", "actions", "rewards", "token_ids")
        return [tuple(t[k] for k in keys) for t in environment["trajectories"]]

    assert len(played(served)) == 3

    assert played(served) == played(local)
