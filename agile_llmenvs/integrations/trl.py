"""TRL's ``GRPOTrainer`` on any rollout env a manifest declares; our harness plays the turns.

In a TRL script (see ``docs/trl.md``):

    env = TRLEnv.from_manifest("manifests/trl_cartpole.yaml", tokenizer)
    trainer = GRPOTrainer(model, args=GRPOConfig(...), processing_class=tokenizer,
                          **env.trainer_kwargs())   # train_dataset, reward_funcs, rollout_func

``env.dataset`` holds one row per task of the env (a dataset row, or a seed of a procedural
env), its ``prompt`` the task's first prompt as the conversation the harness renders (TRL's
conversational format: ``[{"role": ..., "content": ...}, ...]``; TRL passes it to the rollout
untouched, and the ids played are the harness's). ``env.rollout_func`` plays each group of TRL
rows as episodes of that row's task: generation is one batched ``generate`` per turn on the
trainer's current model (our ``HFBackend``, sampling at the trainer's ``temperature``,
``top_p``, ``top_k``), the env calls of each turn run concurrently, each bounded by
``io_timeout_s``, and every row TRL trains on is one token sample of the harness, unchanged:
``prompt_ids + completion_ids`` is the sample's ids, ``env_mask`` its provenance mask (0 on
the env's and the template's ids inside a multi-turn completion). The episode's reward goes
to TRL as the ``env_reward`` column, which ``env.env_reward`` returns; the policy's text alone
goes as ``policy_completion``, which reward functions added through
``env.trainer_kwargs(reward_funcs=...)`` see as their ``completions``.

How TRL 1.16 drives a ``rollout_func`` (``trl/trainer/grpo_trainer.py``), and what follows:

* It is called once per generation batch on every process, with that process's prompts
  (``per_device_train_batch_size * steps_per_generation`` of them), each drawn dataset row
  repeated ``num_generations`` times in a row. A GRPO group is ``num_generations``
  consecutive rows of the batch concatenated over processes (process ``p``'s rows start at
  ``p * len(prompts)``), so a group may straddle two processes: both play its task.
* It must return exactly one row per prompt, aligned by index; TRL then takes each row's
  advantage from the rewards of its group (``reward - mean``, optionally ``/ std``), shuffles
  the rows and splits them into ``steps_per_generation`` micro-batches. The row count is fixed.
* It sees the prompts, not the dataset rows, so a group's task is found from its prompt. Tasks
  that share a prompt are interchangeable to TRL; the rollout deals them in turn.

Restarted episodes (``segment_prompt_tokens``: one episode, several samples) give one row per
sample. With the row count fixed, a group's rows are filled with the samples of the episodes of
its task in the order the episodes were started; an episode that finds the group full is
discarded (counted), and the samples of the one that fills it past its end are dropped
(counted). Whether an episode keeps rows thus depends only on the episodes before it, never on
its own outcome. Episodes are played in waves sized by the samples an episode has given so
far: once every episode is seen to give two samples, a group plays one episode per two rows
(the first rollout plays one per row and discards half). TRL's baseline is over rows: an
episode of ``k`` samples counts ``k`` times in its group's mean (our own GRPO loop takes the
mean over episodes).

A failed episode (the env raised or outlived ``io_timeout_s``, or a connection was lost) gives
no row; the other episodes of its round go on. Its group's rows are refilled by further waves
(``max_waves`` in all); rows still free are masked rows: one pad id of prompt and completion,
``env_mask`` 0, reward None. TRL treats a row whose every reward is None as unscorable: it is
left out of its group's mean and std and its advantage is set to 0. Every term of TRL's loss is
multiplied by ``completion_mask * env_mask``, so a masked row adds exactly zero to the loss and
to its gradient; the token-normalised losses (``dapo``, the default, and ``bnpo``) divide by
the count of unmasked ids, so with them the other rows' gradients are exactly what they would
be without it. (``grpo``'s per-sequence mean and ``dr_grpo``'s
``batch x max_completion_length`` count it in their denominators: there the batch's gradient
shrinks by ``rows - masked`` over ``rows``.) Failures are logged, counted in
:attr:`TRLEnv.stats` and :attr:`TRLEnv.report`, and logged to TRL as ``env/*`` metrics; a
batch in which every episode failed raises :class:`~agile_llmenvs.errors.EnvError`.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from agile_llmenvs.errors import EnvBuildError, EnvError
from agile_llmenvs.integrations._trl_environment import ToolEnvironments
from agile_llmenvs.integrations._trl_play import EnvSlots, Messages, first_prompt, trainer_policy
from agile_llmenvs.integrations._trl_rewards import RewardFunc, policy_text_reward
from agile_llmenvs.integrations._trl_rows import GroupRows, PlayedEpisode, TRLRow, columns
from agile_llmenvs.integrations._trl_types import RolloutReport, TRLEnvConfig, TRLEnvStats
from agile_llmenvs.llm_envs.collector import Generate
from agile_llmenvs.llm_envs.harness import RolloutHarness
from agile_llmenvs.llm_envs.tasks import Task, TaskAssigner
from agile_llmenvs.specs import LLMEnvSpec, RunManifest, load_manifest

__all__ = [
    "Messages",
    "PlayedEpisode",
    "RewardFunc",
    "RolloutReport",
    "TRLEnv",
    "TRLEnvConfig",
    "TRLEnvStats",
    "TRLRow",
    "policy_text_reward",
]

logger = logging.getLogger(__name__)


class TRLEnv:
    """A manifest's rollout env as what TRL's ``GRPOTrainer`` takes: a dataset of its tasks,
    a ``rollout_func`` and a reward function (see the module docs for how rows are made).

    Args:
        spec: A rollout env spec (``env_type: rollout``), single- or multi-turn.
        tokenizer: The policy's tokenizer (the trainer's ``processing_class``).
        config: Settings; the defaults suit most runs.

    Raises:
        EnvBuildError: the spec is not a rollout env, cannot be built, or fails to reset to
            one of its tasks (each is reset once, to read its prompt).
    """

    def __init__(
        self, spec: LLMEnvSpec, tokenizer: Any, *, config: TRLEnvConfig | None = None
    ) -> None:
        if spec.env_type != "rollout":
            raise EnvBuildError(f"{spec.label!r} is a dataset env; TRLEnv needs env_type rollout")
        self.spec = spec
        self.tokenizer = tokenizer
        self.config = config or TRLEnvConfig()
        self.stats = TRLEnvStats()
        self.report: RolloutReport | None = None
        pad = tokenizer.pad_token_id
        self._pad_id = int(pad if pad is not None else tokenizer.eos_token_id)
        self._factory: Callable[[], RolloutHarness] | None = None
        self._slots: EnvSlots | None = None
        self._tool_envs: ToolEnvironments | None = None
        self.tasks, self.prompts = self._read_tasks()
        self._by_prompt: dict[str, list[Task]] = {}
        for task, prompt in zip(self.tasks, self.prompts, strict=True):
            self._by_prompt.setdefault(_prompt_key(prompt), []).append(task)

    @classmethod
    def from_manifest(
        cls,
        manifest: RunManifest | str | Path,
        tokenizer: Any,
        *,
        config: TRLEnvConfig | None = None,
    ) -> TRLEnv:
        """The env section of a run manifest (a path, or one already loaded).

        The manifest's ``seed`` and ``model.max_model_len`` fill the config's unset fields.

        Raises:
            EnvBuildError: the manifest's env is not a rollout env.
        """
        if not isinstance(manifest, RunManifest):
            manifest = load_manifest(manifest)
        if not isinstance(manifest.env, LLMEnvSpec):
            raise EnvBuildError(
                f"the manifest's env is a {manifest.env.env_type!r} env; TRLEnv needs "
                "env_type rollout"
            )
        config = config or TRLEnvConfig()
        config = dataclasses.replace(
            config,
            seed=manifest.seed if config.seed is None else config.seed,
            max_model_len=config.max_model_len or manifest.model.max_model_len,
        )
        return cls(manifest.env, tokenizer, config=config)

    # -- what GRPOTrainer takes --------------------------------------------------------------

    @property
    def dataset(self) -> Any:
        """A ``datasets.Dataset`` with one ``prompt`` per task, in task order: the task's first
        prompt as messages (TRL's conversational format), text only."""
        from datasets import Dataset

        return Dataset.from_dict({"prompt": list(self.prompts)})

    @property
    def reward_funcs(self) -> list[Callable[..., list[float | None]]]:
        """The reward functions to give TRL: :meth:`env_reward`."""
        return [self.env_reward]

    def trainer_kwargs(self, reward_funcs: Sequence[RewardFunc] = ()) -> dict[str, Any]:
        """``train_dataset``, ``reward_funcs`` and ``rollout_func``, for ``GRPOTrainer(**...)``.

        Args:
            reward_funcs: TRL reward functions to add after :meth:`env_reward` (in this order,
                for ``GRPOConfig.reward_weights``); each sees the policy's text only as its
                ``completions`` (see :func:`policy_text_reward`).
        """
        return {
            "train_dataset": self.dataset,
            "reward_funcs": [*self.reward_funcs, *map(policy_text_reward, reward_funcs)],
            "rollout_func": self.rollout_func,
        }

    def environment_kwargs(self) -> dict[str, Any]:
        """``train_dataset`` and ``environment_factory``, for ``GRPOTrainer(**...)``: TRL
        generates every turn and plays the env as tool calls (see docs/trl.md). The dataset
        is :attr:`dataset` with a ``task`` column, which each instance's ``reset`` reads."""
        return {
            "train_dataset": self.dataset.add_column("task", list(range(len(self.tasks)))),
            "environment_factory": self.tool_environments().environment_class,
        }

    def tool_environments(self) -> ToolEnvironments:
        """The env as TRL's ``environment_factory`` takes it (built once, closed with this)."""
        if self._tool_envs is None:
            from agile_llmenvs.envs import make_rollout_env_factory

            factory, _ = make_rollout_env_factory(self.spec, self.tokenizer, seed=self._seed)
            self._tool_envs = ToolEnvironments(factory, self.tasks)
        return self._tool_envs

    def env_reward(
        self,
        completions: Sequence[Any],
        env_reward: Sequence[float | None],
        log_metric: Callable[[str, float], None] | None = None,
        **kwargs: Any,
    ) -> list[float | None]:
        """TRL reward function: each row's episode reward (the ``env_reward`` column; None for
        a masked row). Also logs this batch's ``env/*`` counts through TRL's ``log_metric``."""
        report = self.report
        if log_metric is not None and report is not None:
            log_metric("env/failed_episodes", float(report.failed_episodes))
            log_metric("env/discarded_episodes", float(report.discarded_episodes))
            log_metric("env/dropped_samples", float(report.dropped_samples))
            log_metric("env/masked_rows", float(len(report.masked_rows)))
        return list(env_reward)

    def rollout_func(self, prompts: list[Messages], trainer: Any) -> dict[str, list[Any]]:
        """TRL's ``rollout_func``: play this process's rows on the trainer's current model.

        Raises:
            ValueError: a trainer setting this rollout cannot honour (``use_vllm``,
                ``min_p``, ``repetition_penalty``, ``generation_kwargs``).
            EnvError: every episode of the batch failed.
        """
        args = trainer.args
        per_turn = self.config.max_tokens_per_turn or int(args.max_completion_length)
        positions = getattr(trainer.model.config, "max_position_embeddings", None)
        self.build(
            max_tokens_per_turn=per_turn, max_model_len=self.config.max_model_len or positions
        )
        training = bool(trainer.model.training)
        num_generations = trainer.num_generations if training else trainer.num_generations_eval
        process, world = trainer.accelerator.process_index, trainer.accelerator.num_processes
        # a fresh seed per rollout and process; the sampler adds one per generate call
        seed = ((int(args.seed) * 1_000_003 + self.stats.rollouts) << 20) + (process << 12)
        with trainer_policy(trainer, self.tokenizer, max_tokens=per_turn, seed=seed) as policy:
            return self.rollout(
                prompts,
                policy,
                num_generations=num_generations,
                process_index=process,
                world_size=world,
            )

    # -- the rollout -------------------------------------------------------------------------

    def rollout(
        self,
        prompts: Sequence[Messages],
        generate: Generate,
        *,
        num_generations: int,
        process_index: int = 0,
        world_size: int = 1,
    ) -> dict[str, list[Any]]:
        """Play the episodes of one process's rows with ``generate`` as the policy.

        :meth:`rollout_func` calls it with the trainer's model; called directly, :meth:`build`
        the env first.

        Args:
            prompts: This process's prompts, as TRL passes them (each group's rows in a row):
                rows of :attr:`dataset`.
            generate: Context ids of every live episode -> sampled ids and log-probs of each.
            num_generations: Rows per GRPO group.
            process_index: This process's index (its rows start at ``process_index *
                len(prompts)`` in the global batch).
            world_size: Processes.

        Returns:
            One row per prompt: ``prompt_ids``, ``completion_ids``, ``logprobs``, ``env_mask``
            (what TRL trains on), ``env_reward``, ``env_stop_reason`` and
            ``policy_completion`` (passed to the reward functions); :attr:`report` holds what
            was played.

        Raises:
            ValueError: a prompt is not one of :attr:`dataset`'s, the rows of one group have
                different prompts (``num_generations`` is not the trainer's), or
                ``process_index`` is not below ``world_size``.
            EnvError: every episode failed.
        """
        groups = self._groups(prompts, num_generations, process_index, world_size)
        episodes: list[PlayedEpisode] = []
        for _ in range(self.config.max_waves):
            wave = self._wave(groups)
            if not wave:
                break
            free = [group.remaining for group in groups]
            tasks = [groups[g].task for g in wave]
            played = self._env_slots().play(tasks, generate)
            episodes += [groups[g].place(e) for g, e in zip(wave, played, strict=True)]
            for g in set(wave):  # a group whose wave filled nothing (all failed) stops here
                groups[g].exhausted = groups[g].remaining == free[g]
        masked = sum(group.mask_remaining(self._pad_id) for group in groups)
        rows = self._finish(groups, episodes, masked).rows
        return columns(rows, lambda ids: self.tokenizer.decode(ids, skip_special_tokens=True))

    def _groups(
        self, prompts: Sequence[Messages], num_generations: int, process: int, world: int
    ) -> list[GroupRows]:
        """This process's rows split by group, each with its task."""
        if num_generations < 1:
            raise ValueError(f"num_generations must be at least 1, got {num_generations}")
        if not 0 <= process < world:
            raise ValueError(f"need 0 <= process_index < world_size, got {process} and {world}")
        call = self.stats.rollouts
        stride = -(-world * len(prompts) // num_generations)  # groups in the global batch
        offset = process * len(prompts)
        keys = [_prompt_key(prompt) for prompt in prompts]
        groups: list[GroupRows] = []
        start = 0
        while start < len(prompts):
            group = (offset + start) // num_generations
            end = min(len(prompts), (group + 1) * num_generations - offset)
            rows = range(start, end)
            if len({keys[i] for i in rows}) != 1:
                raise ValueError(
                    f"rows {start}..{end - 1} form one GRPO group of {num_generations} but have "
                    "different prompts; pass the trainer's num_generations"
                )
            groups.append(GroupRows(group, rows, self._task(keys[start], call * stride + group)))
            start = end
        return groups

    def _task(self, key: str, draw: int) -> Task:
        """The task a group plays: the prompt's; tasks that share it are dealt in turn.

        ``draw`` counts groups over every rollout so far (the call's number times its groups,
        plus the group's index in the global batch), so every process holding rows of a group
        picks the same task without talking to the others.
        """
        candidates = self._by_prompt.get(key)
        if candidates is None:
            raise ValueError(
                f"the prompt {key[:80]!r} is not one of this env's tasks; train on "
                "TRLEnv.dataset (its rows are the env's tasks)"
            )
        return candidates[draw % len(candidates)]

    def _wave(self, groups: list[GroupRows]) -> list[int]:
        """The group of each episode of the next wave: as many per unfilled group as its free
        rows need at the samples an episode has given so far (at least one)."""
        per_episode = self.stats.samples_per_episode
        wave: list[int] = []
        for index, group in enumerate(groups):
            if group.remaining and not group.exhausted:
                wave += [index] * max(1, math.ceil(group.remaining / per_episode))
        return wave

    def _finish(
        self, groups: list[GroupRows], episodes: list[PlayedEpisode], masked: int
    ) -> RolloutReport:
        """Record the rollout in :attr:`report` and :attr:`stats`; warn about failures."""
        rows = [row for group in groups for row in group.filled]  # groups are in row order
        report = RolloutReport(
            tuple(rows), tuple(episodes), sum(group.dropped_samples for group in groups)
        )
        self.report = report
        stats = self.stats
        stats.rollouts += 1
        stats.rows += len(rows)
        stats.episodes += len(report.episodes)
        stats.samples += sum(len(e.episode.samples) for e in report.episodes if not e.failed)
        stats.failed_episodes += report.failed_episodes
        stats.discarded_episodes += report.discarded_episodes
        stats.dropped_samples += report.dropped_samples
        stats.masked_rows += masked
        if report.failed_episodes:
            first = next(e for e in report.episodes if e.failed)
            message = (
                f"{report.failed_episodes} of {len(report.episodes)} episodes failed "
                f"(first: {first.episode.info.get('error', 'unknown error')})"
            )
            if report.failed_episodes == len(report.episodes):
                raise EnvError(f"every episode of this TRL batch failed: {message}")
            logger.warning("%s; %d rows are masked (they train nothing)", message, masked)
        return report

    def _env_slots(self) -> EnvSlots:
        """The rollout's harnesses (kept between rollouts).

        Raises:
            EnvBuildError: :meth:`build` was not called yet.
        """
        if self._slots is None:
            raise EnvBuildError(
                "the rollout env is not built yet: call build() (rollout_func builds it from "
                "the trainer's settings)"
            )
        return self._slots

    # -- building ----------------------------------------------------------------------------

    def build(self, *, max_tokens_per_turn: int, max_model_len: int | None) -> None:
        """Build the rollout env (done by the first :meth:`rollout_func` call).

        Args:
            max_tokens_per_turn: Tokens generated per turn; prompts are kept to
                ``max_model_len - max_tokens_per_turn`` so every generation fits.
            max_model_len: The model's context length (None: unbounded).
        """
        if self._factory is not None:
            return
        from agile_llmenvs.envs import make_rollout_env_factory

        self._factory, _ = make_rollout_env_factory(
            self.spec,
            self.tokenizer,
            max_model_len=max_model_len,
            max_output_tokens=max_tokens_per_turn,
            seed=self._seed,
        )
        self._slots = EnvSlots(self._factory, io_timeout_s=self.config.io_timeout_s)

    @property
    def _seed(self) -> int:
        return 0 if self.config.seed is None else self.config.seed

    def _read_tasks(self) -> tuple[list[Task], list[Messages]]:
        """Every task of the env, and its first prompt as messages (read from a probe env)."""
        from agile_llmenvs.envs import make_rollout_env_factory

        factory, _ = make_rollout_env_factory(self.spec, self.tokenizer, seed=self._seed)
        harness = factory()
        try:
            rows = harness.dataset_size()
            seeds = TaskAssigner(0, seed=self._seed)
            count = rows or self.config.num_tasks
            tasks = [Task(seeds.next_task().seed, i if rows else None) for i in range(count)]
            prompts = [first_prompt(harness, task) for task in tasks]
        finally:
            harness.close()
            _close(factory)
        return tasks, prompts

    def close(self) -> None:
        """Close every env (and stop the env hosts of a hosted env)."""
        if self._slots is not None:
            self._slots.close()
            self._slots = None
        if self._tool_envs is not None:
            self._tool_envs.close()
            self._tool_envs = None
        if self._factory is not None:
            _close(self._factory)
            self._factory = None

    def __enter__(self) -> TRLEnv:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _prompt_key(prompt: Messages | str) -> str:
    """A prompt as a dict key: its messages in canonical JSON (TRL hands the rollout copies)."""
    return prompt if isinstance(prompt, str) else json.dumps(prompt, sort_keys=True)


def _close(factory: Any) -> None:
    """Stop what a harness factory holds (Ray env hosts have a ``close``)."""
    close = getattr(factory, "close", None)
    if callable(close):
        close()
