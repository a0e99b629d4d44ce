"""Spec of the environment an LLM algorithm fine-tunes against: rollout or dataset."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, field_validator, model_validator

from agile_llmenvs.specs._types import SPEC_CONFIG, ImportPath, Port
from agile_llmenvs.specs.env import EnvServiceSpec, fail

__all__ = ["HOSTING_FIELDS", "ROW_FIELDS", "LLMEnvSpec", "RolloutSource"]

RolloutSource = Literal["dataset", "entrypoint", "env_url", "env_image"]

#: Fields that place an entrypoint env on Ray env hosts.
HOSTING_FIELDS = (
    "env_hosts",
    "env_port",
    "env_sessions_per_host",
    "env_session_ports",
    "cpus_per_env_host",
    "env_host_memory_bytes",
    "env_host_memory_limit_bytes",
    "env_host_ready_timeout_s",
    "env_services",
    "env_host_resource",
    "env_host_bind",
    "env_vars",
)
#: Fields that pick the rows of a dataset source; at most one is set.
ROW_FIELDS = ("dataset", "dataset_path", "hf_dataset_id")
#: Fields that shape dataset rows; they need a row source.
_ROW_SHAPING_FIELDS = ("columns", "prompt_template", "train_test_split", "response_column")
_RUBRIC_FIELDS = ("rubric_file_path", "rubric_name", "max_reward")
_URL_SCHEMES = ("http://", "https://", "ws://", "wss://")

PositiveInt = Annotated[int | None, Field(ge=1)]


def _d(text: str) -> Any:
    """A field description; every field carries one so the JSON Schema documents manifests."""
    return Field(None, description=text)


class LLMEnvSpec(BaseModel):
    """The dataset or interactive environment an LLM algorithm fine-tunes against.

    A rollout env (``env_type: rollout``) is generative and comes from exactly one source:

    * dataset rows plus a rubric — a single-turn env over labelled rows;
    * ``entrypoint`` — a callable returning a text env, run where training runs (or on env
      hosts under the hosting fields, which need the Ray runtime);
    * ``env_url`` — an OpenEnv service someone else hosts;
    * ``env_image`` — a prebuilt env image the Ray runtime runs as its own Pod.

    A dataset env (``env_type: dataset``) is teacher-forced over the rows; ``objective`` picks
    the loss.
    """

    model_config = SPEC_CONFIG

    num_envs: PositiveInt = _d("Parallel env instances (default: one per rollout slot).")
    version: str | int | None = _d("Free-form version label of the env.")
    env_type: Literal["rollout", "dataset"] = Field(
        description="`rollout`: generative episodes; `dataset`: teacher-forced rows."
    )
    objective: Literal["preference", "sft"] | None = _d(
        "Loss of a dataset env: `sft` or `preference` (DPO). Dataset envs only."
    )
    dataset: str | None = Field(
        None, min_length=1, description="Dataset name in the local catalog or cache."
    )
    dataset_path: str | None = Field(
        None, min_length=1, description="Local rows file: jsonl, json, csv, parquet or arrow."
    )
    hf_dataset_id: str | None = Field(
        None, min_length=1, description="Hugging Face dataset id, read from the local cache only."
    )
    columns: dict[str, str] | None = _d("Maps the env's column names to the dataset's columns.")
    response_column: str | None = Field(
        None, min_length=1, description="Column holding the target response (dataset envs)."
    )
    prompt_template: dict[str, Any] | None = _d("Template that renders a row into the prompt.")
    rubric_file_path: str | None = Field(
        None, min_length=1, description="Python file of named reward functions."
    )
    rubric_name: str | None = Field(
        None, min_length=1, description="Which reward function of `rubric_file_path` scores."
    )
    max_reward: float | None = Field(
        None, gt=0.0, description="Rubric scores are divided by this to lie in [0, 1]."
    )
    train_test_split: float | None = Field(
        None, ge=0.0, le=1.0, description="Fraction of rows held out as the test split."
    )
    entrypoint: str | None = Field(
        None,
        min_length=1,
        description="Env to build: a registry id (with `factory`), or your own `module:Class` "
        "or `path/to/envs.py:Class`.",
    )
    factory: ImportPath | None = _d("`module:attr` callable that receives the `entrypoint` id.")
    env_config: dict[str, Any] | None = _d("Leftover keyword arguments for the env.")
    name: str | None = Field(None, min_length=1, description="Catalog name shown in logs.")
    env_packages: dict[str, list[str]] | None = _d(
        'Requirements to install on first build: {"pip": [...]} or {"uv": [...]}.'
    )
    max_turns: PositiveInt = _d(
        "Turn budget of an episode. Unset: the env's own, probed when the env is built: an "
        "entrypoint env's `max_turns` attribute (a text env without one is single-turn), or "
        "`max_turns` in the state of an `env_url` env or an OpenEnv `Environment`; such an "
        "env that advertises none (OpenEnv's `State` has no `max_turns`) fails the build with "
        "an error naming `env.max_turns`: set it."
    )
    max_observation_bytes: PositiveInt = Field(
        1_000_000,
        description="Most bytes (UTF-8) of one observation's text the harness tokenizes; a "
        "longer one is cut there, a note of its size appended, before it is tokenized (a 60 MB "
        "observation would take minutes and gigabytes to tokenize, only to overflow the "
        "context).",
    )
    segment_prompt_tokens: PositiveInt = _d(
        "Bound on every prompt the policy sees: a longer context restarts as a new training "
        "segment from a prompt fitted within it."
    )
    segment_max_images: PositiveInt = _d(
        "Images one context may hold (a vision-language policy's): a turn that would pass it "
        "restarts the context from a prompt showing that turn's images."
    )
    image_field: str | None = Field(
        None,
        min_length=1,
        description="Observation field holding an observation's images (unset: the "
        "observation's `images`, else info['images']).",
    )
    restart_keep_turns: int = Field(
        0, ge=0, description="Latest turns kept when the context is restarted."
    )
    action_error_field: str = Field(
        "", description="Observation field in which the env reports an invalid action."
    )
    invalid_action_reward: float = Field(
        0.0,
        allow_inf_nan=False,
        description="Reward of a turn whose action the env's action class (or "
        "`action_parser`) refuses: the policy is shown which field was wrong and why, and "
        "the episode goes on.",
    )
    strict_chat_template_boundary: bool | None = _d(
        "Raise when the tokenizer has no chat template (default: warn and frame as ChatML)."
    )
    observation_field: str | None = Field(
        None,
        min_length=1,
        description="Observation field holding the prompt text. Unset: `prompt` (a text "
        "env's), an MCP tool's result, or else the one string field of a structured "
        "observation (OpenEnv's `done`, `reward`, `metadata` aside); an observation with "
        "several is shown as JSON, so name one here. An empty reset observation (an MCP "
        "env's) is shown as the tools the env lists.",
    )
    observation_processor: ImportPath | None = _d(
        "`module:attr` turning an observation into prompt text."
    )
    env_url: str | list[str] | None = _d("URL(s) of OpenEnv services hosted elsewhere.")
    mcp_tool: str | None = Field(
        None, min_length=1, description="MCP tool that receives the model's action."
    )
    tool_call_parser: Literal["hermes", "llama3_json", "mistral", "pythonic"] | None = _d(
        "Tool-call format the policy writes: `hermes` (default: Qwen/Hermes `<tool_call>` "
        "JSON), `llama3_json`, `mistral` (`[TOOL_CALLS]`) or `pythonic` (`[f(x=1)]`)."
    )
    strip_reasoning: bool | None = _d(
        "Send the env the action without its reasoning block (default: on when the chat "
        "template has one). Training ids keep everything the policy sampled."
    )
    reasoning_delimiters: tuple[str, str] | None = _d(
        "Open and close of the reasoning block (default: the template's, `<think>`/`</think>`)."
    )
    action_field: str | None = Field(
        None, min_length=1, description="Action field the model's text is sent in."
    )
    action_parser: str | None = Field(
        None,
        pattern=r"^[^:]+:[^:]+$",
        description="`module:attr` or `path/to/file.py:attr` callable turning the model's "
        "text into the action's fields (a dict), used instead of `action_field`; a "
        "`ValueError` it raises makes the turn invalid, its message the feedback.",
    )
    request_timeout_s: float | None = Field(
        None, ge=0.0, description="Seconds an env request may take."
    )
    max_concurrent_resets: PositiveInt = _d("Resets in flight at once across slots.")
    adaptive_task_sampling: bool = Field(
        False, description="Favour rows whose groups were informative (rollout envs)."
    )
    env_hosts: PositiveInt = _d("Ray env hosts serving the entrypoint env (default 1).")
    env_image: str | None = Field(
        None, min_length=1, description="Prebuilt env image the Ray runtime runs as a Pod."
    )
    env_port: Port | None = _d("Host i's env server listens on env_port + i (default: any).")
    env_sessions_per_host: PositiveInt = _d(
        "Concurrent env sessions each host serves (default: unlimited)."
    )
    env_session_ports: dict[str, Port] = Field(
        default_factory=dict,
        description="Named base ports: session k of host i gets base + i * "
        "env_sessions_per_host + k, as the env's `session_ports` argument.",
    )
    cpus_per_env_host: float | None = Field(
        None, gt=0.0, description="CPUs each env host holds (default 1)."
    )
    env_host_memory_bytes: int | None = Field(
        None, gt=0, description="Memory reserved per env host, in bytes."
    )
    env_host_memory_limit_bytes: int | None = Field(
        None,
        gt=0,
        description="Resident memory (host and children) past which an env host is "
        "restarted, in bytes.",
    )
    env_host_ready_timeout_s: float | None = Field(
        None,
        gt=0.0,
        description="Seconds each env host may take to become ready (default 120).",
    )
    env_services: list[EnvServiceSpec] = Field(
        default_factory=list,
        description="Sidecar processes started on each env host before its env server.",
    )
    env_host_resource: str | None = Field(
        None, min_length=1, description="Custom Ray resource each env host requires."
    )
    env_host_bind: Literal["loopback", "node"] = Field(
        "loopback",
        description="Interface each env host's server binds: `loopback` (127.0.0.1, the "
        "default: only processes on the host's own node reach it, which suits a single-node "
        "cluster) or `node` (the node's address, reachable across the cluster, so hosts on "
        "other nodes can serve this process; sessions still need the pool's token).",
    )
    env_vars: dict[str, str] = Field(
        default_factory=dict,
        description="Environment variables of each env host (and of its services).",
    )
    chat_template_kwargs: dict[str, Any] = Field(
        default_factory=dict, description="Extra keyword arguments for the chat template."
    )
    chat_template_path: str | None = Field(
        None, min_length=1, description="Jinja file that replaces the tokenizer's chat template."
    )
    apply_chat_template: bool = Field(
        True, description="Frame prompts with the chat template (False: raw text)."
    )

    @field_validator("env_url")
    @classmethod
    def _check_urls(cls, value: str | list[str] | None) -> str | list[str] | None:
        urls = [value] if isinstance(value, str) else (value or [])
        if isinstance(value, list) and not value:
            raise ValueError("expected at least one URL")
        for url in urls:
            if not url.startswith(_URL_SCHEMES) or len(url.split("://", 1)[1]) == 0:
                raise ValueError(f"expected an http(s):// or ws(s):// URL, got {url!r}")
        return value

    @field_validator("env_packages")
    @classmethod
    def _check_packages(cls, value: dict[str, list[str]] | None) -> dict[str, list[str]] | None:
        for installer in value or {}:
            if installer not in ("pip", "uv"):
                raise ValueError(f"expected the installer 'pip' or 'uv', got {installer!r}")
        return value

    @model_validator(mode="after")
    def _check_rules(self) -> LLMEnvSpec:
        rows = [f for f in ROW_FIELDS if getattr(self, f) is not None]
        if len(rows) > 1:
            raise fail(rows[1], f"give one row source, not {' and '.join(rows)}")
        if self.factory is not None and self.entrypoint is None:
            raise fail("factory", "a factory receives the `entrypoint` id; set `entrypoint`")
        if not rows:
            for field in _ROW_SHAPING_FIELDS:
                if getattr(self, field) is not None:
                    raise fail(
                        field,
                        "shapes dataset rows; set `dataset_path` (or `dataset`, `hf_dataset_id`)",
                    )
        if self.env_type == "dataset":
            self._check_dataset_env(rows)
        else:
            self._check_rollout_env(rows)
        self._check_hosting()
        return self

    def _check_dataset_env(self, rows: list[str]) -> None:
        if self.objective is None:
            raise fail("objective", "a dataset env needs an objective: 'sft' or 'preference'")
        if not rows:
            raise fail(
                "dataset_path",
                "a dataset env needs rows: set `dataset_path`, `dataset` or `hf_dataset_id`",
            )
        for field in ("entrypoint", "env_url", "env_image", *_RUBRIC_FIELDS):
            if getattr(self, field) is not None:
                raise fail(
                    field,
                    "belongs to rollout envs; a dataset env is teacher-forced "
                    "over its rows (use env_type: rollout)",
                )

    def _check_rollout_env(self, rows: list[str]) -> None:
        if self.objective is not None:
            raise fail(
                "objective",
                "belongs to dataset envs only (env_type: dataset); a "
                "rollout env is scored by its rewards",
            )
        if rows and self.rubric_file_path is None:
            raise fail(
                "rubric_file_path",
                "a rollout env over dataset rows needs a rubric to score completions",
            )
        for field in _RUBRIC_FIELDS:
            if getattr(self, field) is not None and self.rubric_file_path is None:
                raise fail(field, "needs `rubric_file_path`")
        if self.rubric_file_path is not None and not rows:
            raise fail(
                "rubric_file_path",
                "a rubric scores dataset rows; set `dataset_path` (or `dataset`, `hf_dataset_id`)",
            )
        sources = self._sources(rows)
        if len(sources) != 1:
            named = ", ".join(sources) if sources else "none"
            raise fail(
                sources[1] if len(sources) > 1 else "entrypoint",
                "a rollout env needs exactly one source: dataset rows + rubric, "
                f"`entrypoint`, `env_url` or `env_image` (given: {named})",
            )

    def _sources(self, rows: list[str]) -> list[RolloutSource]:
        found: list[RolloutSource] = []
        if rows:
            found.append("dataset")
        for field in ("entrypoint", "env_url", "env_image"):
            if getattr(self, field) is not None:
                found.append(field)
        return found

    def _check_hosting(self) -> None:
        defaults = type(self).model_fields  # a default such as env_host_bind's places nothing
        hosted = [
            f
            for f in HOSTING_FIELDS
            if f in self.model_fields_set
            and getattr(self, f)
            and getattr(self, f) != defaults[f].default
        ]
        if hosted and self.entrypoint is None and self.env_image is None:
            raise fail(
                hosted[0],
                "hosting fields place an `entrypoint` env on Ray env hosts "
                "(or configure an `env_image`); set `entrypoint`",
            )
        low, high = self.env_host_memory_bytes, self.env_host_memory_limit_bytes
        if low is not None and high is not None and high < low:
            raise fail(
                "env_host_memory_limit_bytes",
                f"the limit ({high}) is below the reservation env_host_memory_bytes ({low})",
            )

    @property
    def dataset_backed_rollout(self) -> bool:
        """Whether this rollout env serves labelled rows scored by a rubric."""
        return self.env_type == "rollout" and any(getattr(self, f) for f in ROW_FIELDS)

    @property
    def source(self) -> RolloutSource:
        """The one source a rollout env comes from (``dataset`` for dataset envs)."""
        rows = [f for f in ROW_FIELDS if getattr(self, f) is not None]
        return self._sources(rows)[0]

    @property
    def env_urls(self) -> list[str]:
        """``env_url`` as a list (empty when unset)."""
        if self.env_url is None:
            return []
        return [self.env_url] if isinstance(self.env_url, str) else list(self.env_url)

    @property
    def label(self) -> str:
        """Human-readable label: catalog name, dataset, URL, entrypoint, or image."""
        for value in (self.name, self.dataset, self.dataset_path, self.hf_dataset_id):
            if value:
                return value
        if self.env_url is not None:
            return ", ".join(self.env_urls)
        return self.entrypoint or self.env_image or "llm-env"
