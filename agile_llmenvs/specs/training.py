"""The training section of a run manifest: the settings the training loops share, with their
cross-field rules, and the LoRA adapters' settings."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field, model_validator

from agile_llmenvs.specs._types import SPEC_CONFIG
from agile_llmenvs.specs.env import fail
from agile_llmenvs.specs.generation import VLLMGenerationSpec, VLLMServerSpec

__all__ = ["LoRASpec", "TrainingSpec"]

# Every linear layer of a Qwen2 / Llama decoder block: LoRA's usual targets.
_DECODER_LINEAR_LAYERS = (
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
)


class LoRASpec(BaseModel):
    """Low-rank adapters (``peft``) on the policy: only the adapters train, and the base model
    with the adapters switched off is the reference (no second copy)."""

    model_config = SPEC_CONFIG

    r: int = Field(8, ge=1, description="Rank of each adapter.")
    alpha: float = Field(16.0, gt=0.0, description="Scale: the update is alpha / r * B A.")
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="Dropout on the adapters' input.")
    target_modules: list[str] = Field(
        default_factory=lambda: list(_DECODER_LINEAR_LAYERS),
        min_length=1,
        description="Names of the linear layers to adapt (default: every linear layer of a "
        "Qwen2 / Llama decoder block).",
    )


class TrainingSpec(BaseModel):
    """Settings shared by the training loops; each algorithm adds its own in its module."""

    model_config = SPEC_CONFIG

    algorithm: Literal["grpo", "dpo", "sft"] = Field(
        description="`grpo` over a rollout env; `sft` / `dpo` over a dataset env."
    )
    max_steps: int = Field(100, ge=1, description="Optimizer steps to run.")
    learning_rate: float = Field(3e-4, gt=0.0, description="AdamW learning rate.")
    batch_size: int = Field(8, ge=1, description="Prompts (GRPO groups) or rows per step.")
    group_size: int = Field(8, ge=2, description="Completions per prompt (GRPO).")
    max_new_tokens: int = Field(16, ge=1, description="Tokens generated per turn (GRPO).")
    output_dir: str | None = Field(
        None,
        min_length=1,
        description="The run's folder: metrics, plots, checkpoints and the manifest it ran. "
        "Relative: to the manifest's folder. Unset: `runs/<name>` in the working directory "
        "(`runs/<algorithm>` for a manifest without a name).",
    )
    temperature: float = Field(
        1.0, gt=0.0, le=10.0, description="Sampling temperature of GRPO rollouts."
    )
    top_p: float = Field(
        1.0,
        gt=0.0,
        le=1.0,
        description="GRPO: nucleus sampling of rollouts: the likeliest tokens holding this "
        "much mass (1: off).",
    )
    top_k: int | None = Field(
        None, ge=1, description="GRPO: sample rollouts from the k likeliest tokens only."
    )
    min_p: float = Field(
        0.0,
        ge=0.0,
        lt=1.0,
        description="GRPO: sample rollouts from the tokens at least min_p times as likely as "
        "the likeliest (0: off).",
    )
    repetition_penalty: float = Field(
        1.0,
        gt=0.0,
        le=10.0,
        description="GRPO: divide the positive logits (multiply the negative ones) of tokens "
        "already in the context, prompt included (1: off). The trainer scores with it too. "
        "A checkpoint's generation_config.json is not applied: set it here.",
    )
    truncated_logprobs: bool = Field(
        True,
        description="GRPO: score sampled tokens under the distribution top_k / top_p / min_p "
        "truncated and renormalised, the one they were sampled from: the first-pass ratio is "
        "then 1 on every backend. False: the whole vocabulary's log-softmax (the ratio then "
        "carries the kept mass on vLLM, and TRL's behaviour).",
    )
    clip_eps: float = Field(
        0.2, gt=0.0, le=1.0, description="GRPO: the importance ratio is clipped to 1 +- clip_eps."
    )
    beta: float | None = Field(
        None,
        ge=0.0,
        le=100.0,
        description="GRPO: KL coefficient to a frozen reference (unset: 0, no reference "
        "model loaded). DPO: the preference temperature (unset: 0.1).",
    )
    scale_rewards: Literal["group", "batch", "none"] = Field(
        "group",
        description="GRPO: what group-relative advantages are divided by (plus 1e-4), TRL's "
        "`scale_rewards`: `group`, the std of the episode's group; `batch`, the std of every "
        "reward of the step's batch over all processes; `none`, nothing. Bessel-corrected.",
    )
    dynamic_sampling: bool = Field(
        False, description="GRPO: drop groups with equal rewards and refill from new tasks."
    )
    max_grad_norm: float = Field(1.0, gt=0.0, description="Gradient norm clip.")
    save_every: int = Field(0, ge=0, description="Steps between checkpoints (0: only at the end).")
    eval_every: int = Field(
        0,
        ge=0,
        description="GRPO: steps between greedy evaluations of the policy on held-out tasks "
        "(0: none). A dataset env needs a test split (`train_test_split`).",
    )
    eval_tasks: int = Field(
        16,
        ge=1,
        description="GRPO: held-out tasks per evaluation (the same ones each time; a dataset "
        "env's test split is cycled through when it has fewer rows).",
    )
    eval_success_reward: float = Field(
        1.0, description="GRPO: an eval episode succeeds when its reward reaches this."
    )
    keep_checkpoints: int | None = Field(
        2,
        ge=1,
        description="Complete checkpoints kept in `output_dir` (older ones are removed once a "
        "newer one is complete); unset: keep all.",
    )
    log_every: int = Field(1, ge=1, description="Steps between progress-bar updates.")
    log_rollouts_every: int = Field(
        10,
        ge=0,
        description="GRPO: steps between writes of `log_rollouts_count` episodes (token ids, "
        "provenance, turn ids, rewards, stop reason, decoded text) to "
        "`output_dir/rollouts.jsonl`, for `agile-llmenvs show` (0: none).",
    )
    log_rollouts_count: int = Field(
        4, ge=1, description="GRPO: episodes written per logged step (the batch's first ones)."
    )
    max_failed_fraction: float = Field(
        0.25,
        ge=0.0,
        le=1.0,
        description="GRPO: a step whose share of failed episodes (the env raised, lost its "
        "connection or timed out) is above this is a failing step; `max_failed_steps` of them "
        "in a row stop the run with exit 2, naming the first error (1.0: never stop). Failed "
        "episodes score nothing and are left out of the update.",
    )
    max_failed_steps: int = Field(
        3,
        ge=1,
        description="GRPO: failing steps in a row (see `max_failed_fraction`) that stop the run.",
    )
    tensorboard: bool | None = Field(
        None,
        description="Also write every metric as a TensorBoard scalar to "
        "`output_dir/tensorboard/` (unset: when tensorboard is installed; true: require it).",
    )
    report_to: list[Literal["tensorboard", "wandb", "mlflow", "trackio"]] = Field(
        default_factory=list,
        description="Experiment trackers each step's metrics also go to, as TRL's `report_to` "
        "(each needs its package; docs/training.md#experiment-trackers): W&B offline unless "
        "`WANDB_MODE` or `WANDB_API_KEY` is set, MLflow to `output_dir/mlruns` unless "
        "`MLFLOW_TRACKING_URI` is set; `tensorboard` is `tensorboard: true`.",
    )
    run_name: str | None = Field(
        None, min_length=1, description="The trackers' run name (unset: the manifest's `name`)."
    )
    lora: LoRASpec | None = Field(
        None, description="Train LoRA adapters instead of every weight (needs `peft`)."
    )
    generation_backend: Literal["hf", "vllm", "vllm_server"] = Field(
        "hf",
        description="GRPO: what samples the rollouts: `hf` (transformers generate on the "
        "policy itself), `vllm` (an engine in this process whose weights follow the "
        "policy's each step) or `vllm_server` (running `vllm serve` processes, `vllm_server`, "
        "weights synced to them; each episode asks for its next turn as soon as its env "
        "replies).",
    )
    vllm: VLLMGenerationSpec | None = Field(
        None, description="Engine settings for `generation_backend: vllm` (unset: defaults)."
    )
    vllm_server: VLLMServerSpec | None = Field(
        None, description="The servers of `generation_backend: vllm_server`."
    )
    max_staleness: int = Field(
        0,
        ge=0,
        description="GRPO with `vllm_server`: policy versions a trained sample may lag the "
        "trainer by, so rollouts for later steps are generated while it learns (0: "
        "on-policy, no overlap). Older samples are dropped and counted (`stale_groups`).",
    )
    sync_check: Literal["auto", "every", "off"] = Field(
        "auto",
        description="GRPO with `vllm` or `vllm_server`: after a weight sync, compare the "
        "sampler's log-probs of a probe (the last 64 tokens of a row just trained on) with "
        "the policy's, and stop the run when they differ: `auto` checks the setup sync and "
        "later ones within 1% of the run's time, `every` checks each sync, `off` none.",
    )
    sync_check_tolerance: float | None = Field(
        None,
        gt=0.0,
        description="The largest mean absolute log-prob difference a sync check passes "
        "(unset: 1e-3 for a float32 policy, 5e-2 for 16-bit weights).",
    )
    micro_batch_size: int | None = Field(
        None,
        ge=1,
        description="Rows per forward/backward pass; their gradients accumulate into one "
        "optimizer step equal to the whole batch's (unset: the whole batch at once).",
    )
    logps_chunk_tokens: int = Field(
        256,
        ge=1,
        description="Scored positions whose logits are held at once (memory: this x vocab "
        "x 4 bytes, a few times over).",
    )
    fsdp: bool = Field(
        False,
        description="Shard the policy over the processes with FSDP2 (every decoder layer, "
        "then the root); launch several with `accelerate launch` or `torchrun`.",
    )
    gradient_checkpointing: bool = Field(
        False, description="Recompute the decoder's activations in the backward pass."
    )
    cpu_threads: int | None = Field(
        None,
        ge=1,
        description="torch's intra-op threads on CPU (None: one for a model under 1M "
        "parameters, torch's default above, unless `OMP_NUM_THREADS` or `torch.set_num_threads` "
        "chose); ignored on a GPU.",
    )
    mixed_precision: Literal["no", "bf16", "fp16"] = Field(
        "no",
        description="Compute precision through accelerate; the weights and optimizer state "
        "stay fp32 (`fp16` needs a GPU).",
    )
    lr_scheduler: Literal["constant", "linear", "cosine"] = Field(
        "constant", description="Learning-rate decay after the warmup, to 0 at the last step."
    )
    warmup_steps: int = Field(
        0, ge=0, description="Optimizer steps of linear warmup from 0 to `learning_rate`."
    )
    weight_decay: float = Field(
        0.0, ge=0.0, description="AdamW's decoupled weight decay (not on biases and norms)."
    )
    loss_type: Literal["grpo", "dapo", "dr_grpo", "bnpo"] = Field(
        "dapo",
        description="GRPO: how per-token losses are averaged (docs/training.md gives each "
        "formula); `dapo`: over every sampled token of the global batch.",
    )
    max_completion_tokens: int | None = Field(
        None,
        ge=1,
        description="GRPO `dr_grpo`: the constant a sample's token sum is divided by, with the "
        "row count (unset: max_new_tokens x the env's max_turns).",
    )
    num_iterations: int = Field(1, ge=1, description="GRPO: passes over each collected batch.")
    mini_batches: int = Field(
        1, ge=1, description="GRPO: optimizer steps per pass (the batch's rows split evenly)."
    )

    credit: Literal["episode", "turn_mc", "anchor", "tree"] = Field(
        "episode",
        description="GRPO: how a multi-turn episode's advantage is shared among its turns "
        "(docs/training.md#turn-level-credit): `episode`, every turn the episode's; `turn_mc`, "
        "each turn `r_t + V(s_t+1) - V(s_t)`, with V the mean return of `credit_rollouts` "
        "continuations branched from the state; `anchor`, GiGPO: turns acting from the same "
        "observation within a group compared by their discounted returns to go (no extra "
        "rollouts); `tree`, as `turn_mc` with the continuations trained too, each against its "
        "siblings (the paths from the same state).",
    )
    credit_gamma: float = Field(
        0.95,
        ge=0.0,
        le=1.0,
        description="GRPO `anchor`: the discount of the returns to go an anchor group compares "
        "(GiGPO's 0.95; 1: undiscounted, so two visits of one state before the same final "
        "reward cannot be told apart).",
    )
    credit_omega: float = Field(
        1.0,
        ge=0.0,
        description="GRPO `anchor`: the weight of the step term beside the episode's advantage "
        "(GiGPO's omega, 1).",
    )
    credit_rollouts: int = Field(
        4, ge=1, description="GRPO `turn_mc`, `tree`: continuations run from each branched state."
    )
    credit_turns: str = Field(
        "all",
        pattern=r"^(all|first:[1-9][0-9]*|entropy:[1-9][0-9]*)$",
        description="GRPO `turn_mc`, `tree`: the states valued: `all` (before every turn but the "
        "first), `first:N` (before turns 2..N+1), or `entropy:N` (after the N turns whose "
        "sampled tokens were the least likely, the sampler's estimate of the policy's entropy; "
        "every state is checkpointed while the batch plays, the others released).",
    )
    credit_max_tokens: int | None = Field(
        None,
        ge=1,
        description="GRPO `turn_mc`, `tree`: tokens one continuation may sample; one past it "
        "ends at that turn, its return the rewards so far (unset: the episode's own turn "
        "budget).",
    )
    credit_step_tokens: int | None = Field(
        None,
        ge=1,
        description="GRPO `turn_mc`, `tree`: tokens the continuations of one step may sample, "
        "per process: states are valued in turn order across the batch's episodes (each "
        "episode's first chosen state, then the second, ...) while their `credit_rollouts` "
        "continuations, expected to sample what the episode did from there, fit; the rest keep "
        "episode credit (unset: every chosen state).",
    )
    credit_branching: Literal["auto", "direct", "process_fork", "action_replay"] = Field(
        "auto",
        description="GRPO `turn_mc`, `tree`: how states are branched (docs/branching.md): `direct` "
        "(the env is deterministic given its seed and task: a state is stepped by replay), "
        "`process_fork` (any env in this process: a fork per state), `action_replay` (a fresh "
        "env replayed to the state, checked); `auto`: `direct` for an env that declares "
        "`pure_step = True`, else `process_fork`.",
    )

    @model_validator(mode="before")
    @classmethod
    def _check_renamed(cls, data: Any) -> Any:
        if isinstance(data, dict) and "scale_advantages" in data:
            raise fail("scale_advantages", "renamed scale_rewards: true -> group, false -> none")
        return data

    @model_validator(mode="after")
    def _check_report_to(self) -> TrainingSpec:
        if len(set(self.report_to)) < len(self.report_to):
            raise fail("report_to", f"names a tracker twice: {self.report_to}")
        if "tensorboard" in self.report_to and self.tensorboard is False:
            raise fail("report_to", "names tensorboard, but `tensorboard: false`: drop one")
        return self

    @model_validator(mode="after")
    def _check_credit(self) -> TrainingSpec:
        for name in ("credit_gamma", "credit_omega"):  # a default is what a dump writes
            if (
                self.credit != "anchor"
                and getattr(self, name) != type(self).model_fields[name].default
            ):
                raise fail(name, f"is `anchor`'s, and credit is {self.credit!r}: drop {name}")
        if self.credit == "episode":
            return self
        if self.algorithm != "grpo":
            raise fail("credit", f"{self.credit!r} is GRPO's; {self.algorithm!r} has no turns")
        branched = self.credit in ("turn_mc", "tree")
        if branched and self.dynamic_sampling:
            raise fail(
                "credit",
                f"{self.credit!r} values the states of the batch it trains on; with "
                "`dynamic_sampling: true` rounds are dropped and refilled: set one of them off",
            )
        return self

    @model_validator(mode="after")
    def _check_generation(self) -> TrainingSpec:
        if self.generation_backend == "vllm" and self.algorithm != "grpo":
            raise fail(
                "generation_backend",
                f"'vllm' generates GRPO rollouts; {self.algorithm!r} does not generate",
            )
        if self.sync_check_tolerance is not None and self.generation_backend == "hf":
            raise fail(
                "sync_check_tolerance",
                "a sync check needs a sampler that is synced: `generation_backend: vllm` or "
                "`vllm_server`",
            )
        if self.vllm is not None and self.generation_backend != "vllm":
            raise fail("vllm", "engine settings need `generation_backend: vllm`")
        if self.generation_backend == "vllm_server":
            if self.algorithm != "grpo":
                raise fail(
                    "generation_backend",
                    f"'vllm_server' generates GRPO rollouts; {self.algorithm!r} does not generate",
                )
            if self.vllm_server is None:
                raise fail(
                    "vllm_server",
                    "`generation_backend: vllm_server` needs the servers: "
                    "`vllm_server: {urls: [http://127.0.0.1:8000]}`",
                )
            lag = self.vllm_server.sync_every - 1
            if self.max_staleness < lag:
                raise fail(
                    "max_staleness",
                    f"vllm_server.sync_every: {lag + 1} serves weights up to {lag} steps old; "
                    f"set max_staleness >= {lag} (or sync_every: {self.max_staleness + 1})",
                )
        elif self.vllm_server is not None:
            raise fail("vllm_server", "server settings need `generation_backend: vllm_server`")
        if self.max_staleness and self.generation_backend != "vllm_server":
            raise fail(
                "max_staleness",
                "rollouts overlap learning only with `generation_backend: vllm_server`; "
                "set max_staleness: 0 or use the servers",
            )
        if self.eval_every and self.algorithm != "grpo":
            raise fail(
                "eval_every", f"evaluation during training runs for grpo, not {self.algorithm!r}"
            )
        if self.mini_batches > self.batch_size * self.group_size and self.algorithm == "grpo":
            raise fail(
                "mini_batches",
                f"{self.mini_batches} optimizer steps per pass over "
                f"{self.batch_size * self.group_size} episodes: at most one per episode",
            )
        return self
