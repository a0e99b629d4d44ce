"""TrainingSpec's own rules, and what an unavailable generation backend says."""

from __future__ import annotations

import sys
from collections.abc import Callable

import pytest
from pydantic import ValidationError

from agile_llmenvs.errors import OptionalDependencyError
from agile_llmenvs.specs import LoRASpec, RunManifest, TrainingSpec, VLLMGenerationSpec
from agile_llmenvs.training import train_grpo
from agile_llmenvs.validation import problems_of


def _message(error: pytest.ExceptionInfo[ValidationError]) -> str:
    return error.value.errors()[0]["msg"]


def test_defaults() -> None:
    spec = TrainingSpec(algorithm="sft")
    assert (spec.tensorboard, spec.lora, spec.generation_backend, spec.vllm) == (
        None,
        None,
        "hf",
        None,
    )
    assert LoRASpec().model_dump() == {
        "r": 8,
        "alpha": 16.0,
        "dropout": 0.0,
        "target_modules": [
            "q_proj",
            "k_proj",
            "v_proj",
            "o_proj",
            "gate_proj",
            "up_proj",
            "down_proj",
        ],
    }


@pytest.mark.parametrize("value", [True, False])
def test_scale_advantages_names_its_new_name(value: bool) -> None:
    assert TrainingSpec(algorithm="grpo").scale_rewards == "group"  # TRL's default
    env = {"env_type": "rollout", "entrypoint": "a:B"}
    with pytest.raises(ValidationError) as raised:
        RunManifest.model_validate(
            {"env": env, "training": {"algorithm": "grpo", "scale_advantages": value}}
        )
    assert [(p.field, p.message) for p in problems_of(raised.value)] == [
        ("training.scale_advantages", "renamed scale_rewards: true -> group, false -> none")
    ]


def test_vllm_generation_is_for_grpo_only() -> None:
    with pytest.raises(ValidationError) as raised:
        TrainingSpec(algorithm="sft", generation_backend="vllm")
    assert _message(raised) == (
        "Value error, generation_backend: 'vllm' generates GRPO rollouts; 'sft' does not generate"
    )


def test_engine_settings_need_the_vllm_backend() -> None:
    with pytest.raises(ValidationError) as raised:
        TrainingSpec(algorithm="grpo", vllm=VLLMGenerationSpec())
    assert _message(raised) == "Value error, vllm: engine settings need `generation_backend: vllm`"


@pytest.mark.parametrize(
    ("lora", "field"),
    [({"r": 0}, "r"), ({"dropout": 1.0}, "dropout"), ({"target_modules": []}, "target_modules")],
)
def test_lora_fields_are_checked(lora: dict[str, object], field: str) -> None:
    with pytest.raises(ValidationError) as raised:
        TrainingSpec(algorithm="sft", lora=lora)
    assert raised.value.errors()[0]["loc"] == ("lora", field)


def test_vllm_generation_without_vllm_names_the_extra(
    make_manifest: Callable[..., RunManifest], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "vllm", None)
    with pytest.raises(OptionalDependencyError) as raised:
        train_grpo(make_manifest("quickstart.yaml", max_steps=1, generation_backend="vllm"))
    assert str(raised.value) == (
        "The package 'vllm' is needed for VLLMBackend but is not installed; "
        'run: pip install "agile-llmenvs[vllm]"'
    )


@pytest.mark.parametrize(
    "generation",
    [
        {"generation_backend": "vllm"},
        {"generation_backend": "vllm", "vllm": {"sleep_between_steps": True}},
        {"generation_backend": "vllm_server", "vllm_server": {"urls": ["http://127.0.0.1:1"]}},
    ],
)
def test_vllm_generation_takes_a_sharded_policy(generation: dict[str, object]) -> None:
    spec = TrainingSpec(algorithm="grpo", fsdp=True, **generation)  # type: ignore[arg-type]
    assert spec.fsdp
    assert spec.generation_backend == generation["generation_backend"]
