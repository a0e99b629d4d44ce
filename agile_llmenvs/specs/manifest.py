"""The run manifest: env + model + training settings + seed, loaded from YAML or JSON."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, Field, model_validator

from agile_llmenvs._imports import add_import_folder, module_file
from agile_llmenvs._yaml import safe_load
from agile_llmenvs.errors import ManifestError
from agile_llmenvs.specs._types import SPEC_CONFIG
from agile_llmenvs.specs.env import BanditEnvSpec, GymEnvSpec, OfflineEnvSpec, fail
from agile_llmenvs.specs.llm import LLMEnvSpec

__all__ = [
    "MAX_MANIFEST_BYTES",
    "EnvSpec",
    "LoRASpec",
    "ModelSpec",
    "RunManifest",
    "TrainingSpec",
    "VLLMGenerationSpec",
    "VLLMServerSpec",
    "absolute_paths",
    "dump_manifest",
    "load_manifest",
    "manifest_json_schema",
    "size_refusal",
]

#: The largest manifest file :func:`load_manifest` reads: it is settings, not data (a run's data
#: lives in the files its manifest names), and a many-megabyte document costs seconds and
#: hundreds of megabytes to parse before anything can be said about it.
MAX_MANIFEST_BYTES = 1024 * 1024

EnvSpec = Annotated[
    GymEnvSpec | OfflineEnvSpec | LLMEnvSpec | BanditEnvSpec,
    Field(discriminator="env_type"),
]
"""Any env section, told apart by ``env_type``: gym, offline, rollout, dataset or bandit."""

# Files a run reads, by section: looked up next to the manifest file before the working dir.
_PATH_FIELDS: dict[type[BaseModel], tuple[str, ...]] = {
    GymEnvSpec: ("path", "env_config"),
    OfflineEnvSpec: ("path", "env_config", "dataset_path"),
    BanditEnvSpec: ("path", "features", "targets"),
    LLMEnvSpec: ("dataset_path", "rubric_file_path", "chat_template_path"),
}
_MODEL_PATH_FIELDS = ("path", "tokenizer_path")
_ALGORITHM_ENV: dict[str, tuple[str, str | None]] = {
    "grpo": ("rollout", None),
    "sft": ("dataset", "sft"),
    "dpo": ("dataset", "preference"),
}


class ModelSpec(BaseModel):
    """The policy model: a local checkpoint directory, or the built-in tiny model."""

    model_config = SPEC_CONFIG

    path: str | None = Field(
        None,
        min_length=1,
        description="Local model directory (Hugging Face layout). Unset: the built-in model "
        "`builtin` names, built offline on first use.",
    )
    builtin: Literal["tiny", "tiny_vlm"] = Field(
        "tiny",
        description="The built-in model used when `path` is unset: `tiny` (a text model) or "
        "`tiny_vlm` (a Qwen2-VL-style vision-language model that reads images).",
    )
    tokenizer_path: str | None = Field(
        None, min_length=1, description="Tokenizer directory, if not the model's."
    )
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32", description="Parameter dtype the model is loaded in."
    )
    max_model_len: int | None = Field(
        None, ge=1, description="Context length prompts are truncated to."
    )


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


class VLLMGenerationSpec(BaseModel):
    """How a GRPO run's vLLM engine starts (``generation_backend: vllm``)."""

    model_config = SPEC_CONFIG

    gpu_memory_utilization: float = Field(
        0.3,
        gt=0.0,
        le=1.0,
        description="Share of GPU memory for the engine's weights and KV cache; the rest is "
        "the trainer's.",
    )
    enforce_eager: bool = Field(
        False, description="Skip graph capture: a faster start, slower generation."
    )
    sleep_between_steps: bool = Field(
        False,
        description="Put the engine to sleep (vLLM's sleep mode: KV cache dropped, weights "
        "moved to host memory) while the trainer learns, so learning has the GPU's memory; "
        "needs a GPU.",
    )


class VLLMServerSpec(BaseModel):
    """The running ``vllm serve`` processes a GRPO run samples from
    (``generation_backend: vllm_server``)."""

    model_config = SPEC_CONFIG

    urls: list[str] = Field(
        min_length=1,
        description="Base URLs of the servers (`http://host:port`), each serving the "
        "manifest's model; requests go to the least loaded (or in turn, `routing`).",
    )
    routing: Literal["least_loaded", "round_robin"] = Field(
        "least_loaded", description="How each request picks its server."
    )
    timeout_s: float = Field(
        300.0,
        gt=0.0,
        description="Longest one generation request may take; past it the "
        "episode waiting on it fails.",
    )
    sync_every: int = Field(
        1, ge=1, description="Training steps between weight syncs to the servers."
    )
    weights_dir: str | None = Field(
        None,
        min_length=1,
        description="Folder the trainer writes synced weights to; the servers must read "
        "it (the same machine, or a shared filesystem). Relative: to the manifest's folder. "
        "Unset: `output_dir/weights-sync`.",
    )
    lora_sync: Literal["adapters", "merged"] = Field(
        "adapters",
        description="How a LoRA policy reaches the servers: `adapters` sends only the "
        "adapters, loaded in place as a served LoRA adapter (start each server with "
        "`--enable-lora --max-lora-rank R` and `VLLM_ALLOW_RUNTIME_LORA_UPDATING=True`); "
        "`merged` sends the whole model with the adapters merged in.",
    )
    weight_transfer: Literal["files", "gloo"] = Field(
        "files",
        description="How weights reach the servers: `files` (safetensors in `weights_dir`, "
        "reloaded by each server) or `gloo` (streamed a layer at a time through vLLM's "
        "weight-transfer routes over a gloo group, nothing on disk; start each server with "
        """`--weight-transfer-config '{"backend": "agile_gloo"}'`). """
        "With `gloo` a server that fails a sync fails the run's sync instead of being retired.",
    )
    transfer_host: str = Field(
        "127.0.0.1",
        min_length=1,
        description="With `weight_transfer: gloo`: the address the servers reach the "
        "training process of rank 0 at.",
    )

    @model_validator(mode="after")
    def _check_urls(self) -> VLLMServerSpec:
        for url in self.urls:
            if not url.startswith(("http://", "https://")):
                raise fail("urls", f"{url!r} is not an http(s) URL: write `http://host:port`")
        return self


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

    credit: Literal["episode", "turn_mc", "anchor"] = Field(
        "episode",
        description="GRPO: how a multi-turn episode's advantage is shared among its turns "
        "(docs/training.md#turn-level-credit): `episode`, every turn the episode's; `turn_mc`, "
        "each turn `r_t + V(s_t+1) - V(s_t)`, with V the mean return of `credit_rollouts` "
        "continuations branched from the state; `anchor`, turns acting from the same "
        "observation within a group compared with each other (GiGPO-style, no extra rollouts).",
    )
    credit_rollouts: int = Field(
        4, ge=1, description="GRPO `turn_mc`: continuations run from each branched state."
    )
    credit_turns: str = Field(
        "all",
        pattern=r"^(all|first:[1-9][0-9]*|entropy:[1-9][0-9]*)$",
        description="GRPO `turn_mc`: the states valued: `all` (before every turn but the "
        "first), `first:N` (before turns 2..N+1), or `entropy:N` (after the N turns whose "
        "sampled tokens were the least likely, the sampler's estimate of the policy's entropy; "
        "every state is checkpointed while the batch plays, the others released).",
    )
    credit_max_tokens: int | None = Field(
        None,
        ge=1,
        description="GRPO `turn_mc`: tokens one continuation may sample; one past it ends at "
        "that turn, its return the rewards so far (unset: the episode's own turn budget).",
    )
    credit_branching: Literal["auto", "direct", "process_fork", "action_replay"] = Field(
        "auto",
        description="GRPO `turn_mc`: how states are branched (docs/branching.md): `direct` "
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
        if self.credit == "episode":
            return self
        if self.algorithm != "grpo":
            raise fail("credit", f"{self.credit!r} is GRPO's; {self.algorithm!r} has no turns")
        if self.credit == "turn_mc" and self.generation_backend == "vllm_server":
            raise fail(
                "credit",
                "'turn_mc' branches states on the lock-step path; `generation_backend: "
                "vllm_server` plays episodes ahead on servers: use `hf` or `vllm`",
            )
        if self.credit == "turn_mc" and self.dynamic_sampling:
            raise fail(
                "credit",
                "'turn_mc' values the states of the batch it trains on; with "
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


class RunManifest(BaseModel):
    """One run: the env to build, the model, the training settings and the seed."""

    model_config = SPEC_CONFIG

    name: str | None = Field(None, min_length=1, description="Name of the run.")
    env: EnvSpec = Field(description="The environment section; `env_type` picks its kind.")
    multi_agent: bool = Field(
        False, description="Build a `gym` env as a vectorised PettingZoo parallel env."
    )
    model: ModelSpec = Field(default_factory=ModelSpec, description="The policy model.")
    training: TrainingSpec | None = Field(
        None, description="Training settings; unset for a manifest used only to build envs."
    )
    seed: int = Field(0, ge=0, description="Seed of every random draw of the run.")

    @model_validator(mode="after")
    def _check_pairing(self) -> RunManifest:
        if self.multi_agent and not isinstance(self.env, GymEnvSpec):
            raise fail(
                "multi_agent", f"PettingZoo envs use env_type 'gym', not {self.env.env_type!r}"
            )
        if self.training is None:
            return self
        if self.model.dtype != "float32" and self.training.lora is None:
            raise fail(
                "model.dtype",
                f"training {self.model.dtype} weights: AdamW rounds most updates away. Set "
                "`model.dtype: float32` and `training.mixed_precision: bf16` (fp32 master "
                "weights, bf16 compute), or train LoRA adapters (`training.lora`)",
            )
        env_type, objective = _ALGORITHM_ENV[self.training.algorithm]
        actual = (self.env.env_type, getattr(self.env, "objective", None))
        if actual[0] != env_type or (objective is not None and actual[1] != objective):
            want = f"env_type {env_type!r}" + (
                f" with objective {objective!r}" if objective else ""
            )
            raise fail(
                "training.algorithm",
                f"{self.training.algorithm!r} trains on an env of "
                f"{want}; this env has env_type {actual[0]!r}",
            )
        backend = self.training.generation_backend
        if self.model.path is None and self.model.builtin == "tiny_vlm" and backend != "hf":
            raise fail(
                "training.generation_backend",
                f"{backend!r} generates from ids alone, but `model.builtin: tiny_vlm` is a "
                "vision-language model: use `generation_backend: hf`",
            )
        return self


def load_manifest(path: str | Path) -> RunManifest:
    """Read a run manifest from a ``.yaml``/``.yml`` or ``.json`` file.

    A relative path in the manifest is relative to the manifest's folder: the files a run
    reads (data, rubric, env source, a rollout ``entrypoint``'s ``file.py``, ``model.path``)
    are looked up there first, then in the working directory; a relative
    ``training.output_dir`` is always there. A ``module:attr`` (entrypoint, factory, wrapper,
    processor) whose module Python cannot find is imported from the manifest's folder, then
    from the working directory (``sys.path`` is left as it is).

    Raises:
        FileNotFoundError: the file does not exist.
        ManifestError: the file is larger than :data:`MAX_MANIFEST_BYTES` (refused before it
            is read), not valid YAML/JSON, or has another extension.
        pydantic.ValidationError: the content breaks a rule; the error names the field.
    """
    path = Path(path)
    refusal = size_refusal(path)
    if refusal is not None:
        raise ManifestError(f"{path}: {refusal}")
    text = path.read_text(encoding="utf-8")
    suffix = path.suffix.lower()
    try:
        if suffix in (".yaml", ".yml"):
            data = safe_load(text)
        elif suffix == ".json":
            data = json.loads(text)
        else:
            raise ManifestError(f"{path}: expected a .yaml, .yml or .json manifest, got {suffix!r}")
    except (yaml.YAMLError, json.JSONDecodeError) as exc:
        raise ManifestError(f"{path}: not valid {suffix[1:].upper()}: {exc}") from exc
    manifest = RunManifest.model_validate(data)
    add_import_folder(path.parent)
    return _resolve_relative_paths(manifest, path.parent)


def size_refusal(path: Path) -> str | None:
    """Why the file at ``path`` is refused unread: it is larger than
    :data:`MAX_MANIFEST_BYTES` (None when it is not)."""
    size = path.stat().st_size
    if size <= MAX_MANIFEST_BYTES:
        return None
    return (
        f"the manifest is {size:,} bytes, more than the limit of {MAX_MANIFEST_BYTES:,} "
        "(MAX_MANIFEST_BYTES); keep data out of it, in a file it names (a dataset_path, an "
        "env_config file)"
    )


def dump_manifest(manifest: RunManifest, path: str | Path) -> None:
    """Write ``manifest`` as YAML or JSON (by extension); :func:`load_manifest` reads it back."""
    path = Path(path)
    data = manifest.model_dump(mode="json", exclude_unset=True)
    if path.suffix.lower() == ".json":
        path.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
    else:
        path.write_text(yaml.safe_dump(data, sort_keys=False), encoding="utf-8")


def manifest_json_schema() -> dict[str, Any]:
    """The JSON Schema of :class:`RunManifest`, for editor autocompletion of manifests."""
    schema = RunManifest.model_json_schema()
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    schema["title"] = "agile_llmenvs run manifest"
    return schema


def absolute_paths(manifest: RunManifest) -> RunManifest:
    """``manifest`` with its relative paths made absolute against the working directory, the
    way a run opens them: each file it reads that exists there, and ``training.output_dir``.
    A rollout ``entrypoint: module:attr`` whose module is a file imported from a manifest's
    folder (not found on ``sys.path``) becomes that file's absolute ``path.py:attr``.

    A run stores its manifest so (see :mod:`agile_llmenvs.training.run_folder`), and compares
    a resumed run's by the files they name, not by how each spelled them.
    """

    def input_path(value: str) -> str | None:
        return str(Path(value).resolve()) if Path(value).exists() else None

    pinned = _map_paths(manifest, input_path, lambda value: str(Path(value).resolve()))
    env = pinned.env
    if not isinstance(env, LLMEnvSpec) or env.entrypoint is None or env.factory is not None:
        return pinned
    module, _, attr = env.entrypoint.partition(":")
    found = module_file(module) if attr else None
    if found is None:
        return pinned
    # a module found beside a manifest, not on sys.path: its file, which a run folder's
    # manifest (elsewhere) still finds
    update = {"entrypoint": f"{found}:{attr}"}
    return pinned.model_copy(update={"env": env.model_copy(update=update)})


def _resolve_relative_paths(manifest: RunManifest, base: Path) -> RunManifest:
    """The manifest file's rule: a relative path is relative to ``base``, its folder (a file
    to read that is not there is left for the working directory)."""

    def input_path(value: str) -> str | None:
        return str(base / value) if (base / value).exists() else None

    return _map_paths(manifest, input_path, lambda value: str(base / value))


def _map_paths(
    manifest: RunManifest,
    input_path: Callable[[str], str | None],
    output_path: Callable[[str], str],
) -> RunManifest:
    """Rewrite each relative path field: the files a run reads with ``input_path`` (``None``
    keeps the value), ``training.output_dir`` and ``training.vllm_server.weights_dir`` with
    ``output_path``."""

    def rewritten(section: BaseModel, fields: tuple[str, ...]) -> dict[str, str]:
        updates = {}
        for field in fields:
            value = getattr(section, field)
            if isinstance(value, str) and not Path(value).is_absolute():
                new = input_path(value)
                if new is not None:
                    updates[field] = new
        return updates

    updates: dict[str, Any] = {}
    env_paths = rewritten(manifest.env, _PATH_FIELDS[type(manifest.env)])
    for field in _FILE_ATTR_FIELDS:  # `file.py:attr` names a file too
        file_attr = _relative_file_attr(manifest.env, field)
        if file_attr is not None and (new_file := input_path(file_attr[0])) is not None:
            env_paths[field] = f"{new_file}:{file_attr[1]}"
    if env_paths:
        updates["env"] = manifest.env.model_copy(update=env_paths)
    model_paths = rewritten(manifest.model, _MODEL_PATH_FIELDS)
    if model_paths:
        updates["model"] = manifest.model.model_copy(update=model_paths)
    training = manifest.training
    if training is not None:
        training_paths: dict[str, Any] = {}
        if training.output_dir and not Path(training.output_dir).is_absolute():
            training_paths["output_dir"] = output_path(training.output_dir)
        server = training.vllm_server
        if server is not None and server.weights_dir and not Path(server.weights_dir).is_absolute():
            weights_dir = output_path(server.weights_dir)
            training_paths["vllm_server"] = server.model_copy(update={"weights_dir": weights_dir})
        if training_paths:
            updates["training"] = training.model_copy(update=training_paths)
    return manifest.model_copy(update=updates) if updates else manifest


#: The rollout env's fields that may name ``path/to/file.py:attr``.
_FILE_ATTR_FIELDS = ("entrypoint", "action_parser")


def _relative_file_attr(env: BaseModel, field: str) -> tuple[str, str] | None:
    """The relative file and attribute of a rollout env's ``field: file.py:attr``, if so."""
    value = getattr(env, field, None) if isinstance(env, LLMEnvSpec) else None
    file, sep, attr = (value or "").rpartition(":")
    if sep and file.endswith(".py") and not Path(file).is_absolute():
        return file, attr
    return None
