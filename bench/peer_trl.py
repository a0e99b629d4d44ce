"""Our GRPO loop against TRL's own ``GRPOTrainer`` on the same work, one after the other.

Two rows, each run in fresh processes on the built-in tiny model, ours and TRL's in turn
(``--rounds`` times, the order swapped each round):

* **quick start** (single-turn): ``manifests/quickstart.yaml`` (the digits rows, reward
  ``contains_digit``, 8 prompts x 8 generations, 8 new tokens, lr 5e-4, loss ``dapo``, no
  KL term, a constant learning rate, AdamW, gradient clip 1.0, temperature 1) for
  ``--steps`` steps; TRL 1.16's ``GRPOTrainer`` with the same settings (``GRPOConfig``:
  ``per_device_train_batch_size=64``, ``num_generations=8``, ``max_completion_length=8``,
  ``loss_type="dapo"``, ``beta=0``, ``lr_scheduler_type="constant"``, ``use_cpu``), the same
  prompts (the rows' questions as one user message, which is what our harness renders) and
  the same reward function.
* **multi-turn**: the corridor (``manifests/grpo_corridor.yaml``, 4 turns of 4 tokens, 4
  prompts x 8) with ``credit: episode`` on our loop, and TRL through our own TRL integration
  (``TRLEnv`` as its ``rollout_func``, docs/trl.md) with the same batch, for
  ``--multi-turn-steps`` steps.

Both sides run torch's maths on the same number of intra-op threads: torch's default (one
per core), which TRL's side keeps; ours would take one thread for a model this small (its
default, chosen for busy machines), so ``training.cpu_threads`` gives it torch's count. Both
load the model without the Hub's layer kernels (``use_kernels=False``, ours by default, TRL's
through ``model_init_kwargs``). Settings
that cannot be made equal: TRL builds each batch from dataset rows drawn by its own
sampler (8 prompts, each repeated 8 times), ours deals tasks from its own assigner; the
random streams differ, so rewards are compared as means over the last 20 steps, not step by
step. Each side loads the model inside its measured time, and starts its clock with the same
libraries imported: ``torch``, ``transformers`` (its tokenizer and trainer modules),
``accelerate`` and ``datasets`` (TRL's side imports ``trl`` too, and so ``peft``); whatever
else a side's training call imports (the model's class, say) is in its time.

Figures, per row: seconds per step (the whole training call's wall time over its steps,
model loading included), the mean reward over the first and last 20 steps, and
``trl_over_ours``: TRL's seconds per step over ours (target >= 1.5, with our last-20 reward
at least TRL's on the quick start). Last line: JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = ROOT / "manifests" / "quickstart.yaml"
CORRIDOR = ROOT / "manifests" / "grpo_corridor.yaml"

_OURS = """
import json, sys, time
# the libraries TRL's script has imported when its clock starts (it imports trl itself too)
import accelerate, datasets, torch
from transformers import AutoTokenizer, TrainerCallback
from agile_llmenvs.specs import load_manifest
from agile_llmenvs.training import train_grpo

path, output_dir, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
manifest = load_manifest(path)
# torch's own thread count, which TRL's side runs with (ours would take one for a model this
# small: training.cpu_threads makes the two equal)
threads = torch.get_num_threads()
update = {"max_steps": steps, "output_dir": output_dir, "tensorboard": False, "credit": "episode",
          "cpu_threads": threads}
manifest = manifest.model_copy(update={"training": manifest.training.model_copy(update=update)})
start = time.perf_counter()
result = train_grpo(manifest)
wall = time.perf_counter() - start
rewards = [row["reward_mean"] for row in result.metrics]
print(json.dumps({"wall_s": wall, "steps": len(rewards), "rewards": rewards,
                  "threads": torch.get_num_threads()}))
"""

_TRL = """
import json, os, sys, time, warnings
import torch
warnings.filterwarnings("ignore")
os.environ["TRL_EXPERIMENTAL_SILENCE"] = "1"
from transformers import AutoTokenizer, TrainerCallback
from trl import GRPOConfig, GRPOTrainer
from agile_llmenvs.integrations.trl import TRLEnv
from agile_llmenvs.specs import load_manifest
from agile_llmenvs.tiny_model import ensure_tiny_model

task, path, output_dir, steps = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
model = str(ensure_tiny_model())
training = load_manifest(path).training
start = time.perf_counter()
tokenizer = AutoTokenizer.from_pretrained(model)
env = None
if task == "quickstart":
    from datasets import Dataset
    data = os.path.join(os.path.dirname(path), "data", "digits.jsonl")
    rows = [json.loads(line) for line in open(data)]
    dataset = Dataset.from_dict({
        "prompt": [[{"role": "user", "content": row["question"]}] for row in rows],
        "answer": [row["answer"] for row in rows],
    })

    def contains_digit(completions, answer, **_):
        return [1.0 if a in c[0]["content"] else 0.0 for c, a in zip(completions, answer)]

    kwargs = {"train_dataset": dataset, "reward_funcs": [contains_digit]}
else:
    env = TRLEnv.from_manifest(path, tokenizer)
    kwargs = env.trainer_kwargs()
args = GRPOConfig(
    output_dir=output_dir, max_steps=steps,
    per_device_train_batch_size=training.batch_size * training.group_size,
    num_generations=training.group_size, max_completion_length=training.max_new_tokens,
    learning_rate=training.learning_rate, loss_type="dapo", beta=0.0,
    lr_scheduler_type="constant", use_cpu=True, bf16=False, report_to=[], logging_steps=1,
    save_strategy="no", seed=0, disable_tqdm=True,
    # as ours loads it: without the Hub's layer kernels, which transformers would otherwise
    # swap in (when `kernels` is installed) and swap again at every train/eval switch
    model_init_kwargs={"use_kernels": False},
)
trainer = GRPOTrainer(model=model, args=args, processing_class=tokenizer, **kwargs)
trainer.train()
wall = time.perf_counter() - start
rewards = [entry["reward"] for entry in trainer.state.log_history if "reward" in entry]
if env is not None:
    env.close()
print(json.dumps({"wall_s": wall, "steps": len(rewards), "rewards": rewards,
                  "threads": torch.get_num_threads()}))
"""


def _run(script: str, *args: str) -> dict[str, Any]:
    """One training run in a fresh process; its JSON line."""
    done = subprocess.run(
        [sys.executable, "-c", script, *args], capture_output=True, text=True, check=False
    )
    if done.returncode != 0:
        raise RuntimeError(f"a run failed ({args}):\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _summary(run: dict[str, Any]) -> dict[str, Any]:
    rewards = run["rewards"]
    return {
        "s_per_step": run["wall_s"] / max(run["steps"], 1),
        "wall_s": round(run["wall_s"], 2),
        "steps": run["steps"],
        "reward_first20": round(statistics.fmean(rewards[:20]), 4),
        "reward_last20": round(statistics.fmean(rewards[-20:]), 4),
        "threads": run["threads"],
    }


def measure_row(task: str, manifest: Path, steps: int, rounds: int) -> dict[str, Any]:
    """Ours and TRL's on one task, ``rounds`` times, alternating which goes first."""
    ours: list[dict[str, Any]] = []
    trl: list[dict[str, Any]] = []
    for index in range(rounds):
        order = ("ours", "trl") if index % 2 == 0 else ("trl", "ours")
        for side in order:
            with tempfile.TemporaryDirectory(prefix=f"peer-{side}-") as folder:
                if side == "ours":
                    runs = ours
                    runs.append(_summary(_run(_OURS, str(manifest), folder, str(steps))))
                else:
                    runs = trl
                    runs.append(_summary(_run(_TRL, task, str(manifest), folder, str(steps))))
            print(json.dumps({"task": task, "side": side, **runs[-1]}), flush=True)

    def median(runs: list[dict[str, Any]], key: str) -> float:
        return statistics.median(run[key] for run in runs)

    row = {
        side: {key: round(median(runs, key), 4) for key in runs[0]}
        for side, runs in (("ours", ours), ("trl", trl))
    }
    row["trl_over_ours"] = round(row["trl"]["s_per_step"] / row["ours"]["s_per_step"], 3)
    row["reward_at_least_trls"] = row["ours"]["reward_last20"] >= row["trl"]["reward_last20"]
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=800, help="quick-start steps per run")
    parser.add_argument("--multi-turn-steps", type=int, default=100)
    parser.add_argument(
        "--rounds", type=int, default=3, help="runs of each side per row (medians are reported)"
    )
    parser.add_argument(
        "--rows", nargs="+", choices=["quickstart", "corridor"], default=["quickstart", "corridor"]
    )
    args = parser.parse_args()
    report: dict[str, Any] = {"figure": "peer_trl", "rounds": args.rounds}
    if "quickstart" in args.rows:
        report["quickstart"] = measure_row("quickstart", QUICKSTART, args.steps, args.rounds)
    if "corridor" in args.rows:
        report["corridor"] = measure_row("corridor", CORRIDOR, args.multi_turn_steps, args.rounds)
    report["load_avg_1m"] = os.getloadavg()[0]
    print(json.dumps(report))


if __name__ == "__main__":
    main()
