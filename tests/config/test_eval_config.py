"""EvalConfig and its factories, from the reference document's example config."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from agile_llmenvs.backends import (
    AnthropicBackend,
    HFBackend,
    OpenAIBackend,
    OpenRouterBackend,
    SamplingParams,
)
from agile_llmenvs.branching import BranchManager
from agile_llmenvs.config import (
    BackendFactory,
    EnvironmentConfig,
    EnvironmentFactory,
    EvalConfig,
    InferenceConfig,
    ModelConfig,
    create_sampling_params,
)
from agile_llmenvs.core import Action
from agile_llmenvs.errors import EnvBuildError, ImportPathError, ManifestError
from agile_llmenvs.evaluation import run_evaluation

EXAMPLE = Path(__file__).resolve().parents[2] / "manifests" / "eval" / "leg_counting.yaml"


def test_the_example_config_loads() -> None:
    config = EvalConfig.from_yaml(EXAMPLE)
    assert config.environments == [EnvironmentConfig(name="leg_counting", size=500, seed=42)]
    assert config.model == ModelConfig(backend="huggingface", model="tiny")
    assert config.inference == InferenceConfig(temperature=0.0, max_tokens=32)
    assert (config.batch_size, config.system_prompt) == (64, "Think step by step.")
    assert create_sampling_params(config.inference) == SamplingParams(
        max_tokens=32, temperature=0.0
    )


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "eval.yaml"
    path.write_text(text, encoding="utf-8")
    return path


@pytest.mark.parametrize(
    ("text", "where", "message"),
    [
        (
            "environments: [{name: a}]\nmodel: {backend: openai, model: m}\nbatchsize: 4\n",
            ("batchsize",),
            "Extra inputs are not permitted",
        ),
        (
            "environments: [{name: a, sizes: 3}]\nmodel: {backend: openai, model: m}\n",
            ("environments", 0, "sizes"),
            "Extra inputs are not permitted",
        ),
        (
            "environments: []\nmodel: {backend: openai, model: m}\n",
            ("environments",),
            "List should have at least 1 item after validation, not 0",
        ),
        (
            "environments: [{name: a}]\nmodel: {backend: hal, model: m}\n",
            ("model", "backend"),
            "Input should be 'huggingface', 'vllm', 'vllm_server', 'openai', 'anthropic' or "
            "'openrouter'",
        ),
        (
            "environments: [{name: a}]\nmodel: {backend: openai, model: m}\n"
            "inference: {temperature: -1}\n",
            ("inference", "temperature"),
            "Input should be greater than or equal to 0",
        ),
        (
            "environments: [{name: a, branching_strategy: copy}]\n"
            "model: {backend: openai, model: m}\n",
            ("environments", 0, "branching_strategy"),
            "Input should be 'direct', 'process_fork' or 'action_replay'",
        ),
        (
            "environments: [{name: a, source: entry_point}]\nmodel: {backend: openai, model: m}\n",
            ("environments", 0),
            "Value error, source 'entry_point' needs entry_point: 'package.module:attr'",
        ),
    ],
)
def test_bad_configs_name_the_field(tmp_path: Path, text: str, where: tuple, message: str) -> None:
    with pytest.raises(ValidationError) as caught:
        EvalConfig.from_yaml(_write(tmp_path, text))
    (error,) = caught.value.errors()
    assert error["loc"] == where
    assert error["msg"] == message


def test_unreadable_configs_raise_manifest_error(tmp_path: Path) -> None:
    with pytest.raises(ManifestError, match=r"cannot read eval config"):
        EvalConfig.from_yaml(tmp_path / "missing.yaml")
    with pytest.raises(ManifestError, match=r"must hold a YAML mapping .* got list"):
        EvalConfig.from_yaml(_write(tmp_path, "- a\n- b\n"))
    with pytest.raises(ManifestError, match=r"is not valid YAML"):
        EvalConfig.from_yaml(_write(tmp_path, "a: [\n"))


def test_reasoning_gym_environment_scores_with_the_dataset() -> None:
    pytest.importorskip("reasoning_gym", reason="needs the `envs` extra")
    env = EnvironmentFactory.create(EnvironmentConfig(name="leg_counting", size=3, seed=42))
    assert (env.spec.name, env.spec.dataset_size, env.spec.max_turns) == ("leg_counting", 3, 1)
    state, _ = env.reset(options={"row_index": 0})
    assert "how many legs" in state.observation
    import reasoning_gym

    expected = reasoning_gym.create_dataset("leg_counting", size=3, seed=42)[0]["answer"]
    right = env.step(state, Action(f"Counting... <answer>{expected}</answer>"))
    assert (right.reward, right.terminated, right.info["success"]) == (1.0, True, True)
    state, _ = env.reset(options={"row_index": 0})
    wrong = env.step(state, Action("<answer>-1</answer>"))
    assert wrong.info["success"] is False
    assert wrong.reward < 1.0
    assert env.spec.pure_step  # one deterministic scoring step: the same state scores twice
    assert env.step(state, Action(f"<answer>{expected}</answer>")).reward == 1.0
    assert BranchManager.create(env).strategy_name == "direct"
    with pytest.raises(EnvBuildError, match=r"could not build dataset 'no_such_dataset'"):
        EnvironmentFactory.create(EnvironmentConfig(name="no_such_dataset", size=1))


def test_entry_point_environment() -> None:
    config = EnvironmentConfig(
        name="digits",
        source="entry_point",
        entry_point="fakes:DigitEnv",
        env_config={"bad_rows": frozenset({9})},
    )
    env = EnvironmentFactory.create(config)
    assert (env.spec.name, env.spec.dataset_size, env.spec.pure_step) == ("digits", 10, False)
    pure = EnvironmentFactory.create(config.model_copy(update={"pure_step": True}))
    assert pure.spec.pure_step
    with pytest.raises(KeyError):
        env.reset(options={"row_index": 9})
    missing = config.model_copy(update={"entry_point": "fakes:NoSuchEnv"})
    with pytest.raises(ImportPathError, match=r"has no attribute 'NoSuchEnv'"):
        EnvironmentFactory.create(missing)


def test_backend_factory(tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    local = BackendFactory.create(ModelConfig(backend="huggingface", model=str(tiny_model_dir)))
    assert isinstance(local, HFBackend)
    monkeypatch.setenv("MY_KEY", "secret")
    openai_config = ModelConfig(
        backend="openai", model="gpt-4o", max_concurrency=32, api_key_env="MY_KEY", max_retries=2
    )
    api = BackendFactory.create(openai_config)
    assert isinstance(api, OpenAIBackend)
    assert (api.model, api.max_concurrency, api._api_key) == ("gpt-4o", 32, "secret")
    assert api.config.retry.max_retries == 2
    anthropic_config = ModelConfig(backend="anthropic", model="c", base_url="http://127.0.0.1:1")
    assert isinstance(BackendFactory.create(anthropic_config), AnthropicBackend)
    router = ModelConfig(backend="openrouter", model="x/y", api_key_env="MY_KEY")
    assert isinstance(BackendFactory.create(router), OpenRouterBackend)


def test_the_reference_snippet_runs_on_the_example(tiny_model_dir: Path) -> None:
    pytest.importorskip("reasoning_gym", reason="needs the `envs` extra")
    # The reference document's Python, on the example config shrunk to a few short tasks.
    config = EvalConfig.from_yaml(EXAMPLE)
    config.environments[0].size = 4
    config.inference.max_tokens = 8
    config.model.model = str(tiny_model_dir)
    env = EnvironmentFactory.create(config.environments[0])
    backend = BackendFactory.create(config.model)
    params = create_sampling_params(config.inference)
    result = run_evaluation(
        environment=env,
        backend=backend,
        sampling_params=params,
        system_prompt=config.system_prompt,
        batch_size=config.batch_size,
    )
    assert f"Accuracy: {result.success_rate:.1%}" == "Accuracy: 0.0%"  # a random model
    assert result.num_tasks == 4
    assert result.num_errors == 0
    assert result.trajectories[0].messages[0] == {
        "role": "system",
        "content": "Think step by step.",
    }
