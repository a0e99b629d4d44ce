"""LLMEnvSpec: the reference's fields and defaults, its one-source rule and the other rules."""

from __future__ import annotations

from typing import Any

import pytest
import yaml
from pydantic import ValidationError

from agile_llmenvs.specs import EnvServiceSpec, LLMEnvSpec
from agile_llmenvs.specs.llm import HOSTING_FIELDS

ROWS = {"dataset_path": "rows.jsonl", "rubric_file_path": "rubric.py"}


def rollout(**fields: Any) -> LLMEnvSpec:
    return LLMEnvSpec.model_validate({"env_type": "rollout", **fields})


def dataset(**fields: Any) -> LLMEnvSpec:
    return LLMEnvSpec.model_validate({"env_type": "dataset", **fields})


def test_defaults_follow_the_reference() -> None:
    spec = rollout(entrypoint="pkg.env:MyEnv")
    assert spec.num_envs is None
    assert spec.restart_keep_turns == 0
    assert spec.action_error_field == ""
    assert spec.adaptive_task_sampling is False
    assert spec.apply_chat_template is True
    assert spec.env_session_ports == {}
    assert spec.env_services == []
    assert spec.env_vars == {}
    assert spec.chat_template_kwargs == {}
    assert spec.strict_chat_template_boundary is None


def test_env_type_is_required() -> None:
    with pytest.raises(ValidationError, match="env_type\n  Field required"):
        LLMEnvSpec.model_validate({"entrypoint": "a:B"})


@pytest.mark.parametrize(
    ("fields", "source"),
    [
        (ROWS, "dataset"),
        ({"entrypoint": "pkg.env:MyEnv"}, "entrypoint"),
        ({"entrypoint": "game:Sudoku-v0-easy", "factory": "gem:make"}, "entrypoint"),
        ({"env_url": "ws://127.0.0.1:8000"}, "env_url"),
        ({"env_url": ["http://h1:1", "https://h2:2"]}, "env_url"),
        ({"env_image": "registry/env:1"}, "env_image"),
    ],
)
def test_each_single_source_is_a_valid_rollout(fields: dict[str, Any], source: str) -> None:
    spec = rollout(**fields)
    assert spec.source == source
    assert spec.dataset_backed_rollout is (source == "dataset")


def test_a_rollout_needs_a_source() -> None:
    with pytest.raises(
        ValidationError,
        match=r"entrypoint: a rollout env needs exactly one "
        r"source.*\(given: none\)",
    ):
        rollout()


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({**ROWS, "entrypoint": "a:B"}, "entrypoint: "),
        ({"entrypoint": "a:B", "env_url": "ws://h:1"}, "env_url: "),
        ({"env_url": "ws://h:1", "env_image": "img"}, "env_image: "),
        ({**ROWS, "env_image": "img"}, "env_image: "),
    ],
)
def test_a_rollout_names_only_one_source(fields: dict[str, Any], named: str) -> None:
    with pytest.raises(ValidationError, match="needs exactly one source") as exc:
        rollout(**fields)
    assert named in str(exc.value)


def test_rows_need_a_rubric_in_a_rollout_and_a_rubric_needs_rows() -> None:
    with pytest.raises(ValidationError, match="rubric_file_path: a rollout env over dataset rows"):
        rollout(dataset_path="rows.jsonl")
    with pytest.raises(ValidationError, match="rubric_file_path: a rubric scores dataset rows"):
        rollout(rubric_file_path="r.py", entrypoint="a:B")
    with pytest.raises(ValidationError, match="rubric_name: needs `rubric_file_path`"):
        rollout(entrypoint="a:B", rubric_name="exact")
    with pytest.raises(ValidationError, match="max_reward: needs `rubric_file_path`"):
        rollout(entrypoint="a:B", max_reward=2.0)


def test_only_one_row_source() -> None:
    with pytest.raises(
        ValidationError,
        match="hf_dataset_id: give one row source, not dataset_path and hf_dataset_id",
    ):
        rollout(**ROWS, hf_dataset_id="org/set")


def test_a_dataset_env_needs_an_objective_and_rows() -> None:
    with pytest.raises(ValidationError, match="objective: a dataset env needs an objective"):
        dataset(dataset_path="rows.jsonl")
    with pytest.raises(ValidationError, match="dataset_path: a dataset env needs rows"):
        dataset(objective="sft")
    assert dataset(objective="sft", hf_dataset_id="org/set").source == "dataset"


def test_objective_belongs_to_dataset_envs_only() -> None:
    with pytest.raises(ValidationError, match="objective: belongs to dataset envs only"):
        rollout(entrypoint="a:B", objective="sft")
    with pytest.raises(ValidationError, match="Input should be 'preference' or 'sft'"):
        dataset(objective="rl", dataset_path="rows.jsonl")


@pytest.mark.parametrize(
    "field",
    ["env_url", "env_image", "rubric_file_path", "rubric_name", "max_reward"],
)
def test_dataset_envs_reject_rollout_fields(field: str) -> None:
    value = {"env_url": "ws://h:1", "max_reward": 1.0}.get(field, "x")
    with pytest.raises(ValidationError, match=f"{field}: belongs to rollout envs"):
        dataset(objective="sft", dataset_path="rows.jsonl", **{field: value})


def test_dataset_env_rejects_entrypoint() -> None:
    with pytest.raises(ValidationError, match="entrypoint: belongs to rollout envs"):
        dataset(objective="sft", dataset_path="rows.jsonl", entrypoint="a:B")


def test_factory_needs_an_entrypoint() -> None:
    with pytest.raises(ValidationError, match="factory: a factory receives the `entrypoint` id"):
        rollout(env_url="ws://h:1", factory="gem:make")


@pytest.mark.parametrize(
    "field", ["columns", "prompt_template", "train_test_split", "response_column"]
)
def test_row_shaping_fields_need_rows(field: str) -> None:
    value = {
        "columns": {"q": "question"},
        "prompt_template": {"user": "{q}"},
        "train_test_split": 0.1,
    }.get(field, "response")
    with pytest.raises(ValidationError, match=f"{field}: shapes dataset rows"):
        rollout(entrypoint="a:B", **{field: value})


HOSTING_VALUES: dict[str, Any] = {
    "env_hosts": 2,
    "env_port": 8000,
    "env_sessions_per_host": 4,
    "env_session_ports": {"vnc": 5900},
    "cpus_per_env_host": 1.5,
    "env_host_memory_bytes": 2**30,
    "env_host_memory_limit_bytes": 2**31,
    "env_host_ready_timeout_s": 30.0,
    "env_services": [{"name": "db", "image": "redis"}],
    "env_host_resource": "sandbox",
    "env_host_bind": "node",
    "env_vars": {"MODE": "fast"},
}


def test_every_hosting_field_has_a_test_value() -> None:
    assert set(HOSTING_VALUES) == set(HOSTING_FIELDS)


@pytest.mark.parametrize("field", HOSTING_FIELDS)
def test_hosting_fields_need_an_entrypoint(field: str) -> None:
    value = HOSTING_VALUES[field]
    with pytest.raises(ValidationError, match=f"{field}: hosting fields place an `entrypoint`"):
        rollout(env_url="ws://h:1", **{field: value})
    with pytest.raises(ValidationError, match=f"{field}: hosting fields"):
        rollout(**ROWS, **{field: value})
    assert getattr(rollout(entrypoint="a:B", **{field: value}), field) is not None


def test_hosted_spec_with_all_fields_round_trips() -> None:
    spec = rollout(entrypoint="pkg.env:MyEnv", **HOSTING_VALUES)
    assert spec.env_services == [EnvServiceSpec(name="db", image="redis")]
    assert LLMEnvSpec.model_validate_json(spec.model_dump_json()) == spec
    assert LLMEnvSpec.model_validate(yaml.safe_load(yaml.safe_dump(spec.model_dump()))) == spec


def test_memory_limit_is_not_below_the_reservation() -> None:
    with pytest.raises(
        ValidationError,
        match=r"env_host_memory_limit_bytes: the limit \(10\) is "
        r"below the reservation env_host_memory_bytes \(20\)",
    ):
        rollout(entrypoint="a:B", env_host_memory_bytes=20, env_host_memory_limit_bytes=10)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"max_turns": 0}, "max_turns\n  Input should be greater than or equal to 1"),
        ({"restart_keep_turns": -1}, "restart_keep_turns"),
        ({"train_test_split": 1.5, **ROWS}, "train_test_split"),
        ({"request_timeout_s": -1.0}, "request_timeout_s"),
        ({"cpus_per_env_host": 0.0}, "cpus_per_env_host"),
        ({"env_port": 0}, "expected a TCP port in 1..65535, got 0"),
        ({"env_session_ports": {"vnc": 99999}}, "expected a TCP port in 1..65535, got 99999"),
        ({"rubric_name": "", **ROWS}, "rubric_name"),
        ({"max_reward": 0.0, **ROWS}, "max_reward"),
        ({"env_packages": {"conda": ["x"]}}, "expected the installer 'pip' or 'uv', got 'conda'"),
        ({"observation_processor": "nope"}, "observation_processor"),
        ({"surprise": 1}, "surprise\n  Extra inputs are not permitted"),
    ],
)
def test_bounds_and_formats(fields: dict[str, Any], message: str) -> None:
    fields = {"entrypoint": "a:B", **fields} if "dataset_path" not in fields else fields
    with pytest.raises(ValidationError) as exc:
        rollout(**fields)
    assert message in str(exc.value)


@pytest.mark.parametrize("url", ["127.0.0.1:8000", "ftp://h", "ws://", []])
def test_env_url_must_be_http_or_ws(url: Any) -> None:
    with pytest.raises(ValidationError, match="env_url"):
        rollout(env_url=url)


@pytest.mark.parametrize(
    ("fields", "label"),
    [
        ({"name": "sudoku", "entrypoint": "game:Sudoku", "factory": "gem:make"}, "sudoku"),
        (ROWS, "rows.jsonl"),
        ({"env_url": ["ws://a:1", "ws://b:2"]}, "ws://a:1, ws://b:2"),
        ({"entrypoint": "pkg.env:MyEnv"}, "pkg.env:MyEnv"),
        ({"env_image": "registry/env:1"}, "registry/env:1"),
    ],
)
def test_label(fields: dict[str, Any], label: str) -> None:
    assert rollout(**fields).label == label


def test_every_field_has_a_description() -> None:
    undocumented = [n for n, f in LLMEnvSpec.model_fields.items() if not f.description]
    assert undocumented == []


def test_tool_call_parser_and_reasoning_reach_the_harness_settings() -> None:
    from agile_llmenvs.llm_envs.from_spec import spec_settings

    spec = rollout(
        entrypoint="pkg.env:MyEnv",
        mcp_tool="act",
        tool_call_parser="pythonic",
        strip_reasoning=False,
        reasoning_delimiters=["[THINK]", "[/THINK]"],
    )
    settings = spec_settings(spec)
    assert settings["tool_call_parser"] == "pythonic"
    assert settings["strip_reasoning"] is False
    assert settings["reasoning_delimiters"] == ("[THINK]", "[/THINK]")
    assert "tool_call_parser" not in spec_settings(rollout(entrypoint="pkg.env:MyEnv"))


def test_an_unknown_tool_call_parser_names_the_field_and_the_choices() -> None:
    with pytest.raises(ValidationError, match="tool_call_parser\n  Input should be 'hermes'"):
        rollout(entrypoint="pkg.env:MyEnv", tool_call_parser="qwen")
