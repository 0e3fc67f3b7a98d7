"""The verifiable task, the policy and its sampling for the stability lab (:mod:`gepo_plugin.lab.stability`).

Task: zero-padded addition ``<bos>ab+c=`` with ``ab`` in ``[0, max_a)`` and ``c`` in ``[0, max_b)``; the
answer is the sum's decimal digits followed by ``<eos>`` (at most 3 response tokens with the default
ranges). The problems are split once, by ``task_seed``, into RL training prompts and a held-out eval
set, so eval accuracy measures whether the learned procedure generalises rather than whether training
prompts were memorised. Why addition: a tiny transformer learns it from a few hundred examples and then
generalises to held-out pairs, so a brief supervised warm start reaches a low but non-zero accuracy and
RL has room to improve (like a small pretrained model on math), all within seconds on a CPU.

Why fixed-width prompts: every prompt has the same length, so batched generation needs no left padding
and no attention mask (responses are right-padded after ``<eos>``, which a causal model never attends to
from earlier positions).

Policy: :func:`gepo_plugin.tiny.tiny_model_config` (a Llama-architecture LM, random init, float32) with
the character tokenizer of :func:`gepo_plugin.tiny.build_tokenizer`; nothing is downloaded.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from gepo_plugin.tiny import build_tokenizer, tiny_model_config


@dataclass(frozen=True)
class AdditionTask:
    """All problems as token tensors, split into RL-train and held-out eval indices.

    Attributes:
        prompts: ``[n, prompt_len]`` token ids (``<bos>`` + ``ab+c=``).
        answers: ``[n, answer_len]`` target response ids (digits, ``<eos>``, then ``<pad>``).
        answer_lengths: ``[n]`` number of target tokens including ``<eos>``.
        train_idx, eval_idx: disjoint problem indices.
        digit_ids: ``[10]`` token ids of ``0``..``9`` (for the optional format reward).
        eos_id, pad_id: special token ids.
    """

    prompts: torch.Tensor
    answers: torch.Tensor
    answer_lengths: torch.Tensor
    train_idx: torch.Tensor
    eval_idx: torch.Tensor
    digit_ids: torch.Tensor
    eos_id: int
    pad_id: int
    vocab_size: int

    @property
    def prompt_len(self) -> int:
        return int(self.prompts.shape[1])

    @property
    def max_new_tokens(self) -> int:
        """Longest answer (digits + ``<eos>``): generation never needs more."""
        return int(self.answers.shape[1])


def build_task(max_a: int = 50, max_b: int = 10, eval_fraction: float = 0.25, task_seed: int = 0) -> AdditionTask:
    """All ``max_a * max_b`` problems, shuffled by ``task_seed`` and split into train/eval."""
    if max_a < 1 or max_b < 1:
        raise ValueError(f"max_a and max_b must be >= 1, got {max_a}, {max_b}")
    if not 0 < eval_fraction < 1:
        raise ValueError(f"eval_fraction must be in (0, 1), got {eval_fraction}")
    tokenizer = build_tokenizer()
    vocab = tokenizer.get_vocab()
    width = len(str(max_a - 1))
    a, b = np.meshgrid(np.arange(max_a), np.arange(max_b), indexing="ij")
    a, b = a.ravel(), b.ravel()
    texts = [f"{x:0{width}d}+{y}=" for x, y in zip(a.tolist(), b.tolist(), strict=True)]
    sums = [str(x + y) for x, y in zip(a.tolist(), b.tolist(), strict=True)]
    bos, eos, pad = tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id
    prompts = torch.tensor([[bos] + [vocab[c] for c in text] for text in texts], dtype=torch.int64)
    answer_len = max(len(s) for s in sums) + 1
    answers = torch.full((len(sums), answer_len), pad, dtype=torch.int64)
    lengths = torch.tensor([len(s) + 1 for s in sums], dtype=torch.int64)
    for row, digits in enumerate(sums):  # building the fixed table once, not a training-path loop
        answers[row, : len(digits) + 1] = torch.tensor([vocab[c] for c in digits] + [eos])
    order = torch.as_tensor(np.random.default_rng(task_seed).permutation(len(sums)), dtype=torch.int64)
    n_eval = max(1, round(eval_fraction * len(sums)))
    if n_eval >= len(sums):
        raise ValueError("the eval split leaves no training problem; lower eval_fraction or widen the ranges")
    digit_ids = torch.tensor([vocab[str(d)] for d in range(10)], dtype=torch.int64)
    return AdditionTask(
        prompts=prompts,
        answers=answers,
        answer_lengths=lengths,
        train_idx=order[n_eval:].sort().values,
        eval_idx=order[:n_eval].sort().values,
        digit_ids=digit_ids,
        eos_id=eos,
        pad_id=pad,
        vocab_size=len(tokenizer),
    )


def build_policy(task: AdditionTask, seed: int, hidden: int = 64, layers: int = 2, heads: int = 4) -> torch.nn.Module:
    """A randomly initialised tiny Llama LM (float32, CPU), its init seeded by ``seed``."""
    from transformers import LlamaForCausalLM  # lazy: transformers (seconds), only when a policy is built

    torch.manual_seed(seed)
    model = LlamaForCausalLM(tiny_model_config(task.vocab_size, hidden=hidden, layers=layers, heads=heads))
    return model.to(torch.float32)


def rewards_for(
    task: AdditionTask, problems: torch.Tensor, tokens: torch.Tensor, format_reward: float = 0.0
) -> torch.Tensor:
    """Reward per response: 1 for the exact answer then ``<eos>``; else ``format_reward`` for digits then
    ``<eos>``; else 0. Vectorised over the batch.

    ``tokens`` is ``[N, T]`` with ``T == task.max_new_tokens`` (``<pad>`` after ``<eos>``).
    """
    target = task.answers[problems]
    length = task.answer_lengths[problems]
    positions = torch.arange(tokens.shape[1]).unsqueeze(0)
    exact = ((tokens == target) | (positions >= length.unsqueeze(1))).all(dim=1)
    reward = exact.to(torch.float32)
    if format_reward:
        is_eos = tokens == task.eos_id
        has_eos = is_eos.any(dim=1)
        eos_pos = torch.where(has_eos, is_eos.to(torch.int64).argmax(dim=1), tokens.shape[1])
        before = positions < eos_pos.unsqueeze(1)
        digits_only = (torch.isin(tokens, task.digit_ids) | ~before).all(dim=1)
        well_formed = has_eos & (eos_pos > 0) & digits_only
        reward = torch.where(exact, reward, well_formed.to(torch.float32) * format_reward)
    return reward


def token_log_probs(
    model: torch.nn.Module, prompts: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0
) -> torch.Tensor:
    """Per-token log-probs ``[N, T]`` of ``tokens`` after ``prompts`` (one forward, with grad if enabled)."""
    ids = torch.cat([prompts, tokens], dim=1)
    start = prompts.shape[1] - 1
    logits = model(input_ids=ids, use_cache=False).logits[:, start : start + tokens.shape[1]].float() / temperature
    return torch.log_softmax(logits, dim=-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


@torch.no_grad()
def sample_responses(
    model: torch.nn.Module,
    task: AdditionTask,
    prompts: torch.Tensor,
    temperature: float,
    generator: torch.Generator,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sample one response per prompt row; returns ``tokens``, sampler ``log_probs`` and ``mask``, all ``[N, T]``.

    The log-probs are those of the distribution actually sampled from (temperature applied), i.e. the
    behaviour policy ``q`` that bypass-mode losses need. The loop runs over the (at most 3) token
    positions, never over samples. Positions after ``<eos>`` hold ``<pad>``, log-prob 0 and mask False.
    """
    n, steps = prompts.shape[0], task.max_new_tokens
    ids = prompts
    done = torch.zeros(n, dtype=torch.bool)
    tokens = torch.full((n, steps), task.pad_id, dtype=torch.int64)
    log_probs = torch.zeros(n, steps, dtype=torch.float32)
    mask = torch.zeros(n, steps, dtype=torch.bool)
    for t in range(steps):
        logits = model(input_ids=ids, use_cache=False, logits_to_keep=1).logits[:, -1].float() / temperature
        logp = torch.log_softmax(logits, dim=-1)
        nxt = torch.multinomial(logp.exp(), 1, generator=generator).squeeze(1)
        nxt = torch.where(done, torch.full_like(nxt, task.pad_id), nxt)
        tokens[:, t] = nxt
        log_probs[:, t] = torch.where(done, 0.0, logp.gather(-1, nxt.unsqueeze(-1)).squeeze(-1))
        mask[:, t] = ~done
        done = done | (nxt == task.eos_id)
        ids = torch.cat([ids, nxt.unsqueeze(1)], dim=1)
    return tokens, log_probs, mask


@torch.no_grad()
def greedy_accuracy(model: torch.nn.Module, task: AdditionTask, problems: torch.Tensor) -> float:
    """Exact-answer accuracy of greedy decoding on ``problems`` (deterministic, so evals are comparable)."""
    ids = task.prompts[problems]
    done = torch.zeros(ids.shape[0], dtype=torch.bool)
    out = []
    for _ in range(task.max_new_tokens):
        nxt = model(input_ids=ids, use_cache=False, logits_to_keep=1).logits[:, -1].argmax(dim=-1)
        nxt = torch.where(done, torch.full_like(nxt, task.pad_id), nxt)
        out.append(nxt)
        done = done | (nxt == task.eos_id)
        ids = torch.cat([ids, nxt.unsqueeze(1)], dim=1)
    return float(rewards_for(task, problems, torch.stack(out, dim=1)).mean())


@torch.no_grad()
def sampled_accuracy(
    model: torch.nn.Module, task: AdditionTask, problems: torch.Tensor, samples: int, temperature: float, seed: int
) -> float:
    """pass@1 averaged over ``samples`` sampled answers per problem (the paper's eval: pass@1 over 8 samples).

    Why sampled rather than greedy by default: it measures the distribution RL optimises (the training
    reward is a sampled accuracy) and averages over many answers, so it is far less jumpy than greedy
    exact match on a small eval set. The generator is re-seeded with ``seed`` on every call, so all
    evaluations of a run (and of every method) share their random numbers: differences between eval
    points come from the policy, not from sampling noise. ``samples=0`` means greedy decoding.
    """
    if samples == 0:
        return greedy_accuracy(model, task, problems)
    generator = torch.Generator().manual_seed(int(seed))
    repeated = problems.repeat_interleave(samples)
    tokens, _, _ = sample_responses(model, task, task.prompts[repeated], temperature, generator)
    return float(rewards_for(task, repeated, tokens).mean())


def supervised_warm_start(
    model: torch.nn.Module,
    task: AdditionTask,
    seed: int,
    lr: float,
    batch_size: int,
    target_accuracy: float,
    max_steps: int,
    check_every: int,
) -> dict[str, float]:
    """Teacher-forced cross-entropy on training problems until greedy TRAIN accuracy reaches ``target_accuracy``.

    Why stop on a target rather than after a fixed number of steps: the point is a policy with low but
    non-zero accuracy (a weak "pretrained" model), and the step count that gives that varies with the
    seed. The stopping rule looks at training problems only; the held-out eval set is reported, not used.
    """
    generator = torch.Generator().manual_seed(int(seed) * 7919 + 11)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    train = task.train_idx
    steps = 0
    train_acc = greedy_accuracy(model, task, train)
    while train_acc < target_accuracy and steps < max_steps:
        for _ in range(check_every):
            problems = train[torch.randint(len(train), (batch_size,), generator=generator)]
            target = task.answers[problems]
            mask = torch.arange(target.shape[1]).unsqueeze(0) < task.answer_lengths[problems].unsqueeze(1)
            logp = token_log_probs(model, task.prompts[problems], target)
            loss = -(logp * mask).sum() / mask.sum()
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            steps += 1
        train_acc = greedy_accuracy(model, task, train)
    return {
        "warm_steps": float(steps),
        "warm_train_accuracy": train_acc,
        "warm_eval_accuracy": greedy_accuracy(model, task, task.eval_idx),
    }
