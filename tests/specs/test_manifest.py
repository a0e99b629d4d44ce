"""RunManifest, load_manifest / dump_manifest and the JSON Schema."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from agile_llmenvs.cli import main
from agile_llmenvs.errors import AgileLLMEnvsError, ManifestError
from agile_llmenvs.specs import (
    BanditEnvSpec,
    GymEnvSpec,
    LLMEnvSpec,
    OfflineEnvSpec,
    RunManifest,
    dump_manifest,
    load_manifest,
    manifest_json_schema,
)
from agile_llmenvs.specs import manifest as manifest_module
from agile_llmenvs.specs.manifest import MAX_MANIFEST_BYTES
from agile_llmenvs.validation import _files as validation_module

MANIFESTS = Path(__file__).resolve().parents[2] / "manifests"


def test_env_type_picks_the_spec_class() -> None:
    kinds = {
        "gym": ({"name": "CartPole-v1"}, GymEnvSpec),
        "offline": ({"name": "CartPole-v1", "dataset_path": "d.npz"}, OfflineEnvSpec),
        "bandit": ({}, BanditEnvSpec),
        "rollout": ({"entrypoint": "a:B"}, LLMEnvSpec),
        "dataset": ({"objective": "sft", "dataset_path": "d.jsonl"}, LLMEnvSpec),
    }
    for env_type, (fields, cls) in kinds.items():
        manifest = RunManifest.model_validate({"env": {"env_type": env_type, **fields}})
        assert type(manifest.env) is cls


def test_missing_or_unknown_env_type_names_the_discriminator() -> None:
    with pytest.raises(
        ValidationError, match="Unable to extract tag using discriminator 'env_type'"
    ):
        RunManifest.model_validate({"env": {"name": "CartPole-v1"}})
    with pytest.raises(ValidationError, match="env_type"):
        RunManifest.model_validate({"env": {"env_type": "atari", "name": "x"}})


def test_manifest_defaults() -> None:
    manifest = RunManifest.model_validate({"env": {"env_type": "gym", "name": "CartPole-v1"}})
    assert manifest.seed == 0
    assert manifest.training is None
    assert manifest.multi_agent is False
    assert manifest.model.path is None
    assert manifest.model.dtype == "float32"


@pytest.mark.parametrize(
    ("env", "algorithm", "message"),
    [
        (
            {"env_type": "gym", "name": "CartPole-v1"},
            "grpo",
            "'grpo' trains on an env of env_type 'rollout'; this env has env_type 'gym'",
        ),
        (
            {"env_type": "rollout", "entrypoint": "a:B"},
            "sft",
            "'sft' trains on an env of env_type 'dataset' with objective 'sft'",
        ),
        (
            {"env_type": "dataset", "objective": "sft", "dataset_path": "d.jsonl"},
            "dpo",
            "'dpo' trains on an env of env_type 'dataset' with objective 'preference'",
        ),
    ],
)
def test_algorithm_must_match_the_env(env: dict[str, str], algorithm: str, message: str) -> None:
    with pytest.raises(ValidationError, match=r"training\.algorithm: ") as exc:
        RunManifest.model_validate({"env": env, "training": {"algorithm": algorithm}})
    assert message in str(exc.value)


def test_multi_agent_needs_a_gym_env() -> None:
    with pytest.raises(
        ValidationError, match="multi_agent: PettingZoo envs use env_type 'gym', not 'bandit'"
    ):
        RunManifest.model_validate({"env": {"env_type": "bandit"}, "multi_agent": True})


@pytest.mark.parametrize("backend", ["vllm", "vllm_server"])
def test_the_tiny_vlm_generates_on_the_hf_backend(backend: str) -> None:
    env = {"env_type": "rollout", "entrypoint": "a:B"}
    training = {"algorithm": "grpo", "generation_backend": backend}
    if backend == "vllm_server":
        training["vllm_server"] = {"urls": ["http://127.0.0.1:8000"]}
    with pytest.raises(ValidationError) as exc:
        RunManifest.model_validate(
            {"env": env, "model": {"builtin": "tiny_vlm"}, "training": training}
        )
    assert (
        f"training.generation_backend: {backend!r} generates from ids alone, but "
        "`model.builtin: tiny_vlm` is a vision-language model: use `generation_backend: hf`"
    ) in str(exc.value)


@pytest.mark.parametrize("suffix", [".yaml", ".yml", ".json"])
def test_dump_then_load_is_identity(tmp_path: Path, suffix: str) -> None:
    manifest = RunManifest.model_validate(
        {
            "name": "run",
            "env": {"env_type": "rollout", "env_url": ["ws://a:1"], "max_turns": 3},
            "training": {"algorithm": "grpo", "group_size": 4},
            "seed": 7,
        }
    )
    path = tmp_path / f"m{suffix}"
    dump_manifest(manifest, path)
    assert load_manifest(path) == manifest


def test_relative_paths_resolve_next_to_the_manifest(tmp_path: Path) -> None:
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "f.csv").write_text("a\n1\n")
    path = tmp_path / "m.yaml"
    path.write_text("env: {env_type: bandit, features: data/f.csv, targets: missing.csv}\n")
    env = load_manifest(path).env
    assert isinstance(env, BanditEnvSpec)
    assert env.features == str(tmp_path / "data" / "f.csv")
    assert env.targets == "missing.csv"  # not next to the manifest: left for the working dir


def test_an_entrypoint_file_resolves_next_to_the_manifest_and_is_stored_absolute(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from agile_llmenvs.specs.manifest import absolute_paths
    from agile_llmenvs.transport.resolve import env_factory

    project, elsewhere = tmp_path / "project", tmp_path / "elsewhere"
    (project / "envs").mkdir(parents=True)
    elsewhere.mkdir()
    (project / "envs" / "coin.py").write_text(
        "class CoinEnv:\n    def __init__(self, sides=2):\n        self.sides = sides\n"
    )
    (project / "run.yaml").write_text(
        "env: {env_type: rollout, entrypoint: 'envs/coin.py:CoinEnv', env_config: {sides: 3}}\n"
    )
    monkeypatch.chdir(elsewhere)
    manifest = load_manifest("../project/run.yaml")
    env = manifest.env
    assert isinstance(env, LLMEnvSpec)
    assert env.entrypoint == "../project/envs/coin.py:CoinEnv"
    stored = absolute_paths(manifest)  # as a run folder stores it
    assert isinstance(stored.env, LLMEnvSpec)
    assert stored.env.entrypoint == f"{project / 'envs' / 'coin.py'}:CoinEnv"
    (elsewhere / "runs").mkdir()
    dump_manifest(stored, elsewhere / "runs" / "manifest.yaml")
    monkeypatch.chdir(tmp_path)  # a resume from the run folder, from anywhere
    resumed = load_manifest(elsewhere / "runs" / "manifest.yaml").env
    assert isinstance(resumed, LLMEnvSpec)
    assert resumed.entrypoint is not None
    assert env_factory(resumed.entrypoint, resumed.env_config)().sides == 3


def test_an_action_parser_file_follows_the_same_rule(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from agile_llmenvs.specs.manifest import absolute_paths

    project, elsewhere = tmp_path / "project", tmp_path / "elsewhere"
    project.mkdir()
    elsewhere.mkdir()
    (project / "parse.py").write_text("def guess(text):\n    return {'guess': int(text)}\n")
    (project / "run.yaml").write_text(
        "env: {env_type: rollout, entrypoint: 'env.py:Env', action_parser: 'parse.py:guess'}\n"
    )
    monkeypatch.chdir(elsewhere)
    env = load_manifest("../project/run.yaml").env
    assert isinstance(env, LLMEnvSpec)
    assert env.action_parser == "../project/parse.py:guess"  # found next to the manifest
    assert env.entrypoint == "env.py:Env"  # not there: left for the working directory
    stored = absolute_paths(load_manifest("../project/run.yaml")).env
    assert isinstance(stored, LLMEnvSpec)
    assert stored.action_parser == f"{project / 'parse.py'}:guess"


def test_a_module_beside_the_manifest_is_stored_as_its_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from agile_llmenvs.specs.manifest import absolute_paths
    from agile_llmenvs.transport.resolve import env_factory

    project, elsewhere = tmp_path / "project", tmp_path / "elsewhere"
    project.mkdir()
    elsewhere.mkdir()
    (project / "stored_coin.py").write_text(
        "class CoinEnv:\n    def __init__(self, sides=2):\n        self.sides = sides\n"
    )
    (project / "run.yaml").write_text(
        "env: {env_type: rollout, entrypoint: 'stored_coin:CoinEnv', env_config: {sides: 5}}\n"
    )
    monkeypatch.chdir(elsewhere)
    manifest = load_manifest(project / "run.yaml")
    stored = absolute_paths(manifest)
    assert isinstance(stored.env, LLMEnvSpec)
    assert stored.env.entrypoint == f"{project / 'stored_coin.py'}:CoinEnv"
    assert absolute_paths(load_manifest(project / "run.yaml")) == stored  # resumable: no change
    dump_manifest(stored, elsewhere / "manifest.yaml")
    resumed = load_manifest(elsewhere / "manifest.yaml").env
    assert isinstance(resumed, LLMEnvSpec)
    assert resumed.entrypoint is not None
    assert env_factory(resumed.entrypoint, resumed.env_config)().sides == 5


def test_load_errors(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        load_manifest(tmp_path / "absent.yaml")
    bad_yaml = tmp_path / "bad.yaml"
    bad_yaml.write_text("env: [unclosed\n")
    with pytest.raises(ManifestError, match=r"bad\.yaml: not valid YAML"):
        load_manifest(bad_yaml)
    bad_json = tmp_path / "bad.json"
    bad_json.write_text("{")
    with pytest.raises(ManifestError, match=r"bad\.json: not valid JSON"):
        load_manifest(bad_json)
    toml = tmp_path / "m.toml"
    toml.write_text("")
    with pytest.raises(
        ManifestError,
        match=r"expected a .yaml, .yml or .json manifest, got "
        r"'.toml'",
    ):
        load_manifest(toml)
    assert issubclass(ManifestError, AgileLLMEnvsError)
    not_a_mapping = tmp_path / "list.yaml"
    not_a_mapping.write_text("- 1\n- 2\n")
    with pytest.raises(ValidationError, match="valid dictionary"):
        load_manifest(not_a_mapping)


def test_schema_covers_every_env_type() -> None:
    schema = manifest_json_schema()
    json.dumps(schema)  # serialisable
    assert schema["title"] == "agile_llmenvs run manifest"
    definitions = schema["$defs"]
    assert {"GymEnvSpec", "OfflineEnvSpec", "LLMEnvSpec", "BanditEnvSpec", "EnvServiceSpec"} <= (
        set(definitions)
    )
    assert definitions["LLMEnvSpec"]["additionalProperties"] is False
    assert definitions["GymEnvSpec"]["properties"]["num_envs"]["minimum"] == 1
    env_mapping = schema["properties"]["env"]["discriminator"]["mapping"]
    assert set(env_mapping) == {"gym", "offline", "rollout", "dataset", "bandit"}


def test_every_spec_field_is_described() -> None:
    from agile_llmenvs.specs import EnvServiceSpec, ModelSpec, TrainingSpec

    for cls in (
        GymEnvSpec,
        OfflineEnvSpec,
        LLMEnvSpec,
        BanditEnvSpec,
        EnvServiceSpec,
        RunManifest,
        ModelSpec,
        TrainingSpec,
    ):
        missing = [name for name, field in cls.model_fields.items() if not field.description]
        assert missing == [], f"{cls.__name__} fields without a description: {missing}"


def _manifest_of_size(size: int) -> str:
    """A valid manifest of exactly ``size`` bytes: an inline list of ~150,000 numbers in
    ``env_config`` (what the pure-Python YAML parser took 2 s over), padded with a
    comment."""
    head = "name: big\nenv:\n  env_type: rollout\n  entrypoint: a:B\n  env_config:\n    items: ["
    items = ", ".join(str(i % 10) for i in range((size - 200) // 3))
    text = f"{head}{items}]\n#"
    return text + "x" * (size - len(text) - 1) + "\n"


def test_a_manifest_over_the_size_limit_is_refused_before_it_is_parsed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    over = tmp_path / "over.yaml"
    over.write_text(_manifest_of_size(MAX_MANIFEST_BYTES + 1), encoding="utf-8")
    parsed: list[str] = []
    real_safe_load = manifest_module.safe_load

    def counting_safe_load(text: str) -> Any:
        parsed.append(text[:4])
        return real_safe_load(text)

    monkeypatch.setattr(manifest_module, "safe_load", counting_safe_load)
    monkeypatch.setattr(validation_module, "safe_load", counting_safe_load)
    with pytest.raises(ManifestError) as raised:
        load_manifest(over)
    assert str(raised.value) == (
        f"{over}: the manifest is 1,048,577 bytes, more than the limit of 1,048,576 "
        "(MAX_MANIFEST_BYTES); keep data out of it, in a file it names (a dataset_path, an "
        "env_config file)"
    )
    assert main(["validate", str(over)]) == 2  # refused before it is parsed there too
    assert capsys.readouterr().err == f"error {raised.value}\n"
    assert parsed == []  # neither read it as YAML
    at_limit = tmp_path / "at_limit.yaml"
    at_limit.write_text(_manifest_of_size(MAX_MANIFEST_BYTES), encoding="utf-8")
    assert at_limit.stat().st_size == MAX_MANIFEST_BYTES
    manifest = load_manifest(at_limit)
    assert parsed == ["name"]
    assert isinstance(manifest.env, LLMEnvSpec)
    assert len(manifest.env.env_config["items"]) == (MAX_MANIFEST_BYTES - 200) // 3
