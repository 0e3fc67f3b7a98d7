"""KV-cache batched decoding of a list of requests: on a CPU ~50x cheaper than one request at a time.

Requests are left-padded into one batch, prefilled together, then advanced one forward per token for the whole
batch; rows leave the batch (and the KV cache) as soon as they end. Runs in a worker thread; how answers reach the
event loop is the caller's business (:mod:`.scheduler` passes a ``finish`` callback).
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from transformers import DynamicCache

from gepo_plugin.cpu_backend.rollout.sampling import BatchParams, sample_tokens
from gepo_plugin.cpu_backend.rollout.scheduler import Finish, GenerationRequest


class BatchGenerator:
    """Decodes batches of requests with one loaded causal LM.

    Args:
        model: the loaded ``AutoModelForCausalLM`` (eval mode, no grad).
        pad_token_id: fills the left padding of shorter prompts (masked out).
        logprobs_mode: one of :data:`~.sampling.LOGPROBS_MODES`, what ``log_probs`` report.
        generator: the random stream of requests without a seed of their own (kept across batches).
    """

    def __init__(
        self, model: torch.nn.Module, pad_token_id: int, logprobs_mode: str, generator: torch.Generator
    ) -> None:
        self.model = model
        self.pad_token_id = pad_token_id
        self.logprobs_mode = logprobs_mode
        self.generator = generator
        self.vocab_size = int(model.get_input_embeddings().weight.shape[0])
        # compute logits for the last position only, where the model supports it (prefill of long prompts)
        self.logits_kwargs: dict[str, Any] = (
            {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(model.forward).parameters else {}
        )

    @torch.no_grad()
    def generate(self, requests: list[GenerationRequest], finish: Finish) -> None:
        """Generate a batch to completion (worker thread): left-padded prefill, then one step per token.

        Rows leave the batch (and the KV cache) as soon as they finish, are aborted, or reach
        ``max_tokens``; ``finish`` is called for each at once, so its answer is not held up by the others.
        """
        model = self.model
        rows = [r for r in requests if not r.abort_requested]
        for request in requests:
            if request.abort_requested:
                finish(request, "aborted")
        if not rows:
            return
        lengths = [len(r.prompt_ids) for r in rows]
        width = max(lengths)
        input_ids = torch.full((len(rows), width), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, request in enumerate(rows):
            input_ids[i, width - lengths[i] :] = torch.tensor(request.prompt_ids, dtype=torch.long)
            attention_mask[i, width - lengths[i] :] = 1
        position_ids = (attention_mask.cumsum(-1) - 1).clamp_(min=0)
        next_position = position_ids[:, -1] + 1
        cache = DynamicCache(config=model.config)
        params: BatchParams | None = None
        seen: torch.Tensor | None = None

        while rows:
            output = model(
                input_ids=input_ids,
                attention_mask=attention_mask,
                position_ids=position_ids,
                past_key_values=cache,
                use_cache=True,
                **self.logits_kwargs,
            )
            cache = output.past_key_values
            logits = output.logits[:, -1, :].float()
            if params is None:
                params = BatchParams([r.spec for r in rows], logits.shape[-1])
                if params.repetition_penalty is not None:
                    seen = torch.zeros(logits.shape, dtype=torch.bool)
                    for i, request in enumerate(rows):
                        seen[i, torch.tensor(request.prompt_ids, dtype=torch.long)] = True
            tokens, log_probs = sample_tokens(
                logits, params, seen, [r.generator for r in rows], self.generator, self.logprobs_mode
            )

            keep: list[int] = []
            for i, request in enumerate(rows):
                token = int(tokens[i])
                request.token_ids.append(token)
                if request.spec.want_logprobs:
                    request.log_probs.append(float(log_probs[i]))
                if seen is not None:
                    seen[i, token] = True
                if token in request.spec.stop_token_ids or len(request.token_ids) >= request.spec.max_tokens:
                    finish(request, "completed")
                elif request.abort_requested:
                    finish(request, "aborted")
                else:
                    keep.append(i)
            if len(keep) < len(rows):
                if not keep:
                    break
                index = torch.tensor(keep, dtype=torch.long)
                rows = [rows[i] for i in keep]
                cache.batch_select_indices(index)
                attention_mask, next_position, tokens = attention_mask[index], next_position[index], tokens[index]
                params.select(index)
                seen = seen[index] if seen is not None else None
            input_ids = tokens.unsqueeze(1)
            attention_mask = torch.cat([attention_mask, attention_mask.new_ones((len(rows), 1))], dim=1)
            position_ids = next_position.unsqueeze(1)
            next_position = next_position + 1
