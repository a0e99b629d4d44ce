"""GRPO with rollouts from vLLM (``vllm`` marker; runs where vllm or vllm-cpu is installed).

After every weight sync the engine must generate what the policy itself would: its greedy
ids equal those of ``transformers`` on the policy, with the same log-probs. vllm-cpu needs a
head size of at least 32, so the tiny model is built at hidden size 128; its engine needs
``VLLM_CPU_KVCACHE_SPACE`` (GiB) and starts in about a minute here.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.vllm

vllm = pytest.importorskip("vllm")

from branch_envs import door_manifest  # noqa: E402
from lora_models import untied_copy  # noqa: E402

from agile_llmenvs.backends import HFBackend, SamplingParams  # noqa: E402
from agile_llmenvs.backends.types import Generation  # noqa: E402
from agile_llmenvs.specs import ModelSpec, TrainingSpec, load_manifest  # noqa: E402
from agile_llmenvs.tiny_model import build_tiny_model  # noqa: E402
from agile_llmenvs.training import train_grpo  # noqa: E402
from agile_llmenvs.training.generation import PolicyVLLMEngine  # noqa: E402

HERE = Path(__file__).resolve().parent
GREEDY = SamplingParams(max_tokens=8, temperature=0.0)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("vllm-model") / "m", hidden_size=128)


class _SyncChecks:
    """After each real weight sync, greedy generations of the engine and of the policy."""

    def __init__(self, model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        self.pairs: list[tuple[list[Generation], list[Generation]]] = []
        real = PolicyVLLMEngine.load_weights
        reader = HFBackend(model_dir)
        tokenizer = reader.tokenizer
        questions = ("Say a digit.", "What is 2 + 3?", "Count to three.")
        prompts = [reader.encode_chat([{"role": "user", "content": q}]) for q in questions]

        def load_and_check(engine: PolicyVLLMEngine, policy: Any) -> None:
            real(engine, policy)
            training = policy.training
            policy.eval()
            ours = HFBackend.from_model(policy, tokenizer).generate(prompts, GREEDY)
            self.pairs.append((engine.backend.generate(prompts, GREEDY), ours))
            policy.train(training)

        monkeypatch.setattr(PolicyVLLMEngine, "load_weights", load_and_check)


#: LoRA on the linear layers of the tied tiny model, or on its ends too, untied.
LORA_CASES = {
    "full": None,
    "lora": {"r": 4, "alpha": 8},
    "lora-ends": {
        "r": 4,
        "alpha": 8,
        "target_modules": ["q_proj", "v_proj", "embed_tokens", "lm_head"],
    },
}


@pytest.mark.parametrize("case", list(LORA_CASES))
def test_vllm_rollouts_follow_the_policy_weights(
    model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, case: str
) -> None:
    lora = LORA_CASES[case]
    if lora:
        pytest.importorskip("peft")
    if case == "lora-ends":
        model_dir = untied_copy(model_dir, tmp_path / "untied")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    checks = _SyncChecks(model_dir, monkeypatch)
    manifest = load_manifest(HERE.parents[1] / "manifests" / "quickstart.yaml")
    assert manifest.training is not None
    training = {
        **manifest.training.model_dump(exclude_unset=True),
        "max_steps": 2,
        "batch_size": 2,
        "group_size": 4,
        "max_new_tokens": 4,
        "learning_rate": 0.05,
        "output_dir": str(tmp_path / "run"),
        "generation_backend": "vllm",
        "vllm": {"enforce_eager": True},
        "sync_check": "every",
        **({"lora": lora} if lora else {}),
    }
    env = {"rubric_file_path": str(HERE / "rubrics.py"), "rubric_name": "digit_share"}
    manifest = manifest.model_copy(
        update={
            "model": ModelSpec(path=str(model_dir), max_model_len=512),
            "env": manifest.env.model_copy(update=env),
            "training": TrainingSpec.model_validate(training),
        }
    )
    result = train_grpo(manifest)

    assert [row["step"] for row in result.metrics] == [1.0, 2.0]
    assert all(row["weight_sync_time_s"] > 0 for row in result.metrics)
    # every sync checked, the engine's log-probs of the probe the policy's own
    assert all(0 <= row["sync_check_gap"] < 1e-4 for row in result.metrics)
    assert len(checks.pairs) == 3  # at the start, then after each optimizer step
    for engine_out, policy_out in checks.pairs:
        assert [g.token_ids for g in engine_out] == [g.token_ids for g in policy_out]
        for got, want in zip(engine_out, policy_out, strict=True):
            assert got.logprobs == pytest.approx(want.logprobs, abs=2e-3)
    # the steps changed the weights: the policy's own log-probs moved
    first, last = checks.pairs[0][1], checks.pairs[-1][1]
    moved = [
        abs(a - b)
        for before, after in zip(first, last, strict=True)
        for a, b in zip(before.logprobs, after.logprobs, strict=False)
    ]
    assert max(moved) > 1e-2


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("fsdp", [False, True], ids=["data-parallel", "fsdp"])
def test_every_process_engine_follows_the_policy_weights(
    model_dir: Path, tmp_path: Path, fsdp: bool
) -> None:
    import json
    import shutil

    from training.launch import launch_two

    from agile_llmenvs.specs.manifest import dump_manifest

    if shutil.which("accelerate") is None:
        pytest.skip("needs the accelerate launcher")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    manifest = load_manifest(HERE.parents[1] / "manifests" / "quickstart.yaml")
    assert manifest.training is not None
    training = {
        **manifest.training.model_dump(exclude_unset=True),
        "max_steps": 2,
        "batch_size": 4,  # two groups per process
        "group_size": 8,
        "max_new_tokens": 4,
        "learning_rate": 0.05,
        "output_dir": str(tmp_path / "run"),
        "generation_backend": "vllm",
        "vllm": {"enforce_eager": True},
        "fsdp": fsdp,
    }
    env = {"rubric_file_path": str(HERE / "rubrics.py"), "rubric_name": "digit_share"}
    manifest = manifest.model_copy(
        update={
            "model": ModelSpec(path=str(model_dir), max_model_len=512),
            "env": manifest.env.model_copy(update=env),
            "training": TrainingSpec.model_validate(training),
        }
    )
    path = tmp_path / "manifest.yaml"
    dump_manifest(manifest, path)
    done = launch_two(HERE / "distributed_vllm_grpo.py", str(path), str(tmp_path), timeout=800)
    assert done.returncode == 0, done.stderr[-4000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [r["world_size"] for r in ranks] == [2, 2]
    for record in ranks:
        assert len(record["loads"]) == 3  # at the start, then after each optimizer step
        for load in record["loads"]:
            assert load["engine"] == load["trainer"]
            for got, want in zip(load["engine_logprobs"], load["trainer_logprobs"], strict=True):
                assert got == pytest.approx(want, abs=2e-3)
        # the steps changed the weights: the policy's own log-probs moved
        first, last = (
            record["loads"][0]["trainer_logprobs"],
            record["loads"][-1]["trainer_logprobs"],
        )
        moved = [
            abs(a - b) for x, y in zip(first, last, strict=True) for a, b in zip(x, y, strict=False)
        ]
        assert max(moved) > 1e-2
    assert ranks[0]["loads"][-1]["trainer"] == ranks[1]["loads"][-1]["trainer"]  # one policy


def test_sleeping_between_steps_is_refused_where_vllm_cannot_sleep(model_dir: Path) -> None:
    from vllm.platforms import current_platform

    from agile_llmenvs.errors import AgileLLMEnvsError
    from agile_llmenvs.specs import VLLMGenerationSpec

    if current_platform.is_sleep_mode_available():
        pytest.skip("this vLLM can sleep here")
    manifest = load_manifest(HERE.parents[1] / "manifests" / "quickstart.yaml")
    manifest = manifest.model_copy(update={"model": ModelSpec(path=str(model_dir))})
    spec = VLLMGenerationSpec(sleep_between_steps=True)
    with pytest.raises(AgileLLMEnvsError) as raised:
        PolicyVLLMEngine(manifest, spec, max_model_len=512)
    assert str(raised.value) == (
        f"training.vllm.sleep_between_steps: the installed vLLM cannot sleep on "
        f"{current_platform.device_name} (sleep mode needs a GPU); set it to false"
    )


@pytest.mark.parametrize("credit", ["turn_mc", "tree"])
def test_turn_credit_continuations_generate_on_the_engine(
    model_dir: Path, tmp_path: Path, credit: str
) -> None:
    """``credit: turn_mc`` and ``tree`` with the engine: the continuations are generated by it
    too, and under ``tree`` every token they sampled trains."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    manifest = door_manifest(
        model_dir,
        tmp_path / "run",
        model={"max_model_len": 512},
        generation_backend="vllm",
        vllm={"enforce_eager": True},
        credit=credit,
        credit_rollouts=2,
    )
    result = train_grpo(manifest)
    # 4 episodes of 3 turns a step: s_1 and s_2 of each valued
    assert [row["credit_states"] for row in result.metrics] == [8.0, 8.0]
    assert [row["credit_fallback_episodes"] for row in result.metrics] == [0.0, 0.0]
    for row in result.metrics:
        assert row["credit_tokens"] > 0
        trained = row["policy_tokens"] + (row["credit_tokens"] if credit == "tree" else 0)
        assert row["trained_tokens"] == trained


def test_a_sync_that_loads_other_weights_stops_the_run(
    model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A sync made wrong on purpose after the first step (the embedding, which the output
    layer shares, sent 2% larger): the check after that sync stops the run, naming it."""
    from agile_llmenvs.errors import SyncCheckError
    from agile_llmenvs.training.generation import vllm_engine

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    real = vllm_engine.local_weights
    calls = []

    def corrupted(policy: Any, **kwargs: Any) -> Any:
        calls.append(1)
        for name, tensor in real(policy, **kwargs):
            wrong = len(calls) > 1 and name == "model.embed_tokens.weight"
            yield name, tensor * 1.02 if wrong else tensor

    monkeypatch.setattr(vllm_engine, "local_weights", corrupted)
    manifest = door_manifest(
        model_dir,
        tmp_path / "run",
        model={"max_model_len": 512},
        generation_backend="vllm",
        vllm={"enforce_eager": True},
        max_steps=3,
        sync_check="every",
    )
    with pytest.raises(SyncCheckError) as raised:
        train_grpo(manifest)
    assert len(calls) == 2  # the setup sync passed; the one after step 1 did not
    assert str(raised.value).startswith(
        "after the weight sync after step 1, process 0's vLLM engine's log-probs of a "
    )
    assert "(training.sync_check_tolerance 0.001): the sampler does not hold the policy" in str(
        raised.value
    )
