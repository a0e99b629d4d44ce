"""GymEnvSpec, OfflineEnvSpec, BanditEnvSpec and EnvServiceSpec: fields, bounds and rules."""

from __future__ import annotations

import json

import pytest
import yaml
from pydantic import ValidationError

from agile_llmenvs.specs import BanditEnvSpec, EnvServiceSpec, GymEnvSpec, OfflineEnvSpec


def _error_text(exc: pytest.ExceptionInfo[ValidationError]) -> str:
    return str(exc.value)


def test_gym_defaults_follow_the_reference() -> None:
    spec = GymEnvSpec(name="CartPole-v1")
    assert spec.num_envs == 32
    assert spec.env_type == "gym"
    assert spec.custom is False
    assert spec.default_type == "float32"
    assert spec.sync is False
    assert (spec.version, spec.entrypoint, spec.factory, spec.path) == (None, None, None, None)
    assert (spec.env_config, spec.env_wrappers) == (None, None)


def test_gym_env_id_appends_the_version() -> None:
    assert GymEnvSpec(name="CartPole", version=1).env_id == "CartPole-v1"
    assert GymEnvSpec(name="CartPole-v1").env_id == "CartPole-v1"


@pytest.mark.parametrize(
    ("fields", "field", "message"),
    [
        ({"num_envs": 0}, "num_envs", "greater than or equal to 1"),
        ({"name": ""}, "name", "at least 1 character"),
        ({"colour": "red"}, "colour", "Extra inputs are not permitted"),
        ({"default_type": "floaty"}, "default_type", "expected a numpy dtype name"),
        ({"factory": "not a path"}, "factory", "expected an import path"),
        ({"env_wrappers": ["bad path!"]}, "env_wrappers", "expected an import path"),
        ({"version": 2, "name": "CartPole-v1"}, "version", "already ends in a version"),
        ({"custom": True}, "custom", "needs an `entrypoint` or a `factory`"),
        ({"path": "env.py"}, "path", "names the file"),
        ({"entrypoint": "mymodule.MyEnv"}, "entrypoint", "expected 'module:attr'"),
        ({"entrypoint": "a:B", "path": "env.py"}, "entrypoint", "an attribute name"),
    ],
)
def test_gym_spec_rules_fail_naming_the_field(
    fields: dict[str, object], field: str, message: str
) -> None:
    with pytest.raises(ValidationError) as exc:
        GymEnvSpec.model_validate({"name": "CartPole-v1", **fields})
    assert field in _error_text(exc)
    assert message in _error_text(exc)


def test_gym_spec_accepts_every_entrypoint_form() -> None:
    assert GymEnvSpec(name="x", entrypoint="pkg.mod:Env").entrypoint == "pkg.mod:Env"
    assert GymEnvSpec(name="x", entrypoint="Env", path="env.py").entrypoint == "Env"
    registry_id = GymEnvSpec(name="x", entrypoint="game:Sudoku-v0", factory="gem:make")
    assert registry_id.entrypoint == "game:Sudoku-v0"


def test_gym_wrappers_round_trip_as_tuples() -> None:
    spec = GymEnvSpec(
        name="CartPole-v1",
        env_wrappers=["gymnasium.wrappers.RecordEpisodeStatistics", ("a.b:C", {"k": 1})],
    )
    again = GymEnvSpec.model_validate_json(spec.model_dump_json())
    assert again == spec
    assert again.env_wrappers == ["gymnasium.wrappers.RecordEpisodeStatistics", ("a.b:C", {"k": 1})]


def test_default_type_is_normalised() -> None:
    assert GymEnvSpec(name="x", default_type="f4").default_type == "float32"


def test_offline_needs_exactly_one_dataset() -> None:
    with pytest.raises(ValidationError, match="dataset_path: an offline env needs exactly one"):
        OfflineEnvSpec(name="CartPole-v1")
    with pytest.raises(ValidationError, match=r"\(both given\)"):
        OfflineEnvSpec(name="CartPole-v1", dataset_path="d.npz", minari_dataset_id="m/x-v0")
    with pytest.raises(ValidationError, match="remote: `remote` downloads a Minari dataset"):
        OfflineEnvSpec(name="CartPole-v1", dataset_path="d.npz", remote=True)
    spec = OfflineEnvSpec(name="CartPole-v1", dataset_path="d.npz")
    assert spec.env_type == "offline"
    assert spec.remote is False


def test_bandit_defaults_and_rules() -> None:
    spec = BanditEnvSpec()
    assert (spec.num_envs, spec.name, spec.env_type) == (1, "BanditEnv", "bandit")
    with pytest.raises(ValidationError, match="targets: `features` and `targets`"):
        BanditEnvSpec(features="f.csv")
    with pytest.raises(ValidationError, match="features: `features` and `targets`"):
        BanditEnvSpec(targets="t.csv")
    with pytest.raises(ValidationError, match="path: `path` names the file"):
        BanditEnvSpec(path="bandit.py")
    with pytest.raises(ValidationError, match="num_envs"):
        BanditEnvSpec(num_envs=0)


def test_env_service_rules() -> None:
    service = EnvServiceSpec(name="db", command=["redis-server"], port=6379)
    assert service.ready_timeout_s == 60.0
    assert service.env_vars == {}
    with pytest.raises(ValidationError, match="command: a service needs a `command`"):
        EnvServiceSpec(name="db")
    with pytest.raises(ValidationError, match=r"expected a TCP port in 1\.\.65535, got 70000"):
        EnvServiceSpec(name="db", image="redis", port=70000)
    with pytest.raises(ValidationError, match="name"):
        EnvServiceSpec(name="Bad_Name", image="redis")
    with pytest.raises(ValidationError, match="ready_timeout_s"):
        EnvServiceSpec(name="db", image="redis", ready_timeout_s=0)


@pytest.mark.parametrize(
    "spec",
    [
        GymEnvSpec(name="CartPole", version=1, num_envs=4, sync=True, env_config={"a": [1, 2]}),
        GymEnvSpec(name="x", custom=True, entrypoint="Env", path="e.py", env_config="cfg.yaml"),
        OfflineEnvSpec(name="CartPole-v1", minari_dataset_id="cartpole/random-v0", remote=True),
        BanditEnvSpec(features="f.csv", targets="t.csv", env_config={"k": 1.5}),
        EnvServiceSpec(name="db", image="redis:7", command=["redis-server"], env_vars={"A": "1"}),
    ],
)
def test_json_and_yaml_round_trip_is_identity(spec: object) -> None:
    cls = type(spec)
    assert cls.model_validate_json(spec.model_dump_json()) == spec  # type: ignore[attr-defined]
    as_yaml = yaml.safe_dump(spec.model_dump(mode="json"))  # type: ignore[attr-defined]
    assert cls.model_validate(yaml.safe_load(as_yaml)) == spec  # type: ignore[attr-defined]
    as_json = json.loads(json.dumps(spec.model_dump(mode="json")))  # type: ignore[attr-defined]
    assert cls.model_validate(as_json) == spec  # type: ignore[attr-defined]
