"""Honest synthetic answers: tokens sampled from the tiny model at the version a sampler claims, batched across the
samplers of one process, so that the learner's audit has real work at scale and passes the honest ones.

One model per process (float32), the versions pulled from the relay as the auditor pulls them
(:class:`~gepo_plugin.verl_glue.hetero.remote.auditor.VersionCache`: manifests verified, every tensor
digest-checked). Requests queue for a few milliseconds and are sampled together, one forward pass per token for all
requests of one version, prompt length and sampling settings: the distribution is the logits over the temperature
with vLLM's top-k and top-p (:func:`~gepo_plugin.hetero.audit.pit.processed_logprobs`, what the audit recomputes), and
each token's log-prob is reported from it. A configured liar (:attr:`FleetProfile.liars`) reports each log-prob
``liar_shift`` higher than it is, which the audit's log-prob test must catch.
"""

from __future__ import annotations

import asyncio
from collections import defaultdict
from dataclasses import dataclass

import torch

from gepo_plugin.hetero.audit.pit import processed_logprobs
from gepo_plugin.verl_glue.hetero.remote.auditor import VersionCache
from gepo_sampler.relay.puller import RelayPuller

#: how long a request waits for others to share its batch
GATHER_S = 0.02


@dataclass(frozen=True)
class _Ask:
    version: int
    prompt: tuple[int, ...]
    length: int
    temperature: float
    top_k: int
    top_p: float


class HonestGenerator:
    """Samples answers for every synthetic sampler of the process (start :meth:`run` on its loop)."""

    def __init__(self, model_path: str, puller: RelayPuller, seed: int) -> None:
        from transformers import AutoConfig, AutoModelForCausalLM  # lazy: only the honest fleet needs a model

        config = AutoConfig.from_pretrained(model_path)
        self.model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
        self.versions = VersionCache(puller, capacity=4)
        self.loaded: int | None = None
        self.generator = torch.Generator().manual_seed(seed)
        self._queue: list[tuple[_Ask, asyncio.Future]] = []
        self._ready = asyncio.Event()
        self.batches = 0

    async def sample(
        self, version: int, prompt: list[int], length: int, temperature: float, top_k: int, top_p: float
    ) -> tuple[list[int], list[float]]:
        """``length`` tokens sampled after ``prompt`` at ``version``, and their log-probs."""
        future = asyncio.get_running_loop().create_future()
        self._queue.append((_Ask(version, tuple(prompt), length, temperature, top_k, top_p), future))
        self._ready.set()
        return await future

    async def run(self) -> None:
        while True:
            await self._ready.wait()
            await asyncio.sleep(GATHER_S)
            self._ready.clear()
            queue, self._queue = self._queue, []
            groups: dict[tuple, list[tuple[_Ask, asyncio.Future]]] = defaultdict(list)
            for ask, future in queue:
                groups[ask.version, len(ask.prompt), ask.temperature, ask.top_k, ask.top_p].append((ask, future))
            for members in groups.values():
                try:
                    answers = await asyncio.to_thread(self._generate, [ask for ask, _ in members])
                except Exception as error:  # a version the store no longer holds: those requests fail
                    for _, future in members:
                        future.done() or future.set_exception(error)
                    continue
                for (_, future), answer in zip(members, answers, strict=True):
                    future.done() or future.set_result(answer)

    def _generate(self, asks: list[_Ask]) -> list[tuple[list[int], list[float]]]:
        first = asks[0]
        if self.loaded != first.version:
            self.model.load_state_dict(self.versions.weights(first.version), strict=False)
            self.loaded = first.version
        self.batches += 1
        ids = torch.tensor([ask.prompt for ask in asks])
        longest = max(ask.length for ask in asks)
        tokens, logprobs = [], []
        with torch.no_grad():
            for _ in range(longest):
                logits = self.model(ids).logits[:, -1]
                dist = processed_logprobs(logits, first.temperature, first.top_k, first.top_p)
                token = torch.multinomial(dist.exp(), 1, generator=self.generator)
                tokens.append(token[:, 0])
                logprobs.append(dist.gather(-1, token)[:, 0])
                ids = torch.cat([ids, token], dim=1)
        tokens_t, logprobs_t = torch.stack(tokens, 1), torch.stack(logprobs, 1)
        return [
            (tokens_t[i, : ask.length].tolist(), logprobs_t[i, : ask.length].float().tolist())
            for i, ask in enumerate(asks)
        ]
