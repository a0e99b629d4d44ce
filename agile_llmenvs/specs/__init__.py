"""Manifests as data: env specs, the run manifest, YAML/JSON loading and the JSON Schema.

Specs validate at load (``extra="forbid"``, field bounds, cross-field rules) and build nothing;
:mod:`agile_llmenvs.envs` turns them into live environments.
"""

from __future__ import annotations

from agile_llmenvs.specs.env import BanditEnvSpec, EnvServiceSpec, GymEnvSpec, OfflineEnvSpec
from agile_llmenvs.specs.generation import VLLMGenerationSpec, VLLMServerSpec
from agile_llmenvs.specs.llm import LLMEnvSpec
from agile_llmenvs.specs.manifest import (
    EnvSpec,
    ModelSpec,
    RunManifest,
    dump_manifest,
    load_manifest,
    manifest_json_schema,
)
from agile_llmenvs.specs.training import LoRASpec, TrainingSpec

__all__ = [
    "BanditEnvSpec",
    "EnvServiceSpec",
    "EnvSpec",
    "GymEnvSpec",
    "LLMEnvSpec",
    "LoRASpec",
    "ModelSpec",
    "OfflineEnvSpec",
    "RunManifest",
    "TrainingSpec",
    "VLLMGenerationSpec",
    "VLLMServerSpec",
    "dump_manifest",
    "load_manifest",
    "manifest_json_schema",
]
