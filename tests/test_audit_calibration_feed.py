"""The trainer's feed of trusted rollouts to the audit's bf16 calibration: which rows of a batch it hands over.

The batch is what the trainer's one TransferQueue read gives (verl's tags and padded fields); the feed must hand
over only rows that are the in-cluster samplers' (never a remote sampler's: those are what is audited), of one
weight version each and the batch's most common one, fully generated, and no more than the calibration still needs.
"""

from __future__ import annotations

import torch
from tensordict import NonTensorStack, TensorDict

from gepo_plugin.verl_glue.hetero.remote.calibration_feed import CalibrationFeed
from gepo_plugin.verl_glue.hetero.server_identity import SERVER_ID


def batch(rows: list[dict]) -> tuple[list[dict], TensorDict]:
    """``rows``: server, lo, hi (versions), prompt and response lengths, padding, masked (a tool token)."""
    width, plen = max(r["response"] for r in rows), max(r["prompt"] for r in rows)
    tags, prompts, responses, log_probs, masks, extras = [], [], [], [], [], []
    for i, r in enumerate(rows):
        tags.append({"min_global_steps": r["lo"], "max_global_steps": r["hi"], "prompt_len": r["prompt"],
                     "response_len": r["response"], "is_padding": r.get("padding", False)})  # fmt: skip
        prompts.append([100 + i] * r["prompt"] + [0] * (plen - r["prompt"]))
        responses.append([200 + i] * r["response"] + [0] * (width - r["response"]))
        log_probs.append([-0.5 - i] * r["response"] + [0.0] * (width - r["response"]))
        mask = [1] * r["response"] + [0] * (width - r["response"])
        if r.get("masked"):
            mask[0] = 0
        masks.append(mask)
        extras.append({SERVER_ID: r["server"]} if r["server"] else {})
    data = TensorDict(
        {
            "prompts": torch.tensor(prompts),
            "responses": torch.tensor(responses),
            "rollout_log_probs": torch.tensor(log_probs),
            "response_mask": torch.tensor(masks),
            "extra_fields": NonTensorStack(*extras),
        },
        batch_size=len(rows),
    )
    return tags, data


def feed(remaining: int) -> CalibrationFeed:
    return CalibrationFeed("bfloat16", 1.0, -1, 1.0, remaining, "remote/")


def row(server: str | None = "10.0.0.1:8000", lo: int = 3, hi: int = 3, prompt: int = 4, response: int = 3, **kw):
    return {"server": server, "lo": lo, "hi": hi, "prompt": prompt, "response": response, **kw}


def test_only_single_version_fully_generated_in_cluster_rows_of_the_most_common_version_are_handed_over():
    rows = [
        row(),  # 0: yes
        row(server="remote/far"),  # 1: a remote sampler's: audited, never trusted
        row(lo=2, hi=3),  # 2: spans two versions
        row(lo=2, hi=2),  # 3: another version (less common)
        row(padding=True),  # 4: verl's padding
        row(masked=True),  # 5: a tool token in the response
        row(server=None),  # 6: its server unknown: not trusted
        row(prompt=2, response=1),  # 7: yes
    ]
    tags, data = batch(rows)
    taken = feed(10).take(tags, data)
    assert [t["request_id"] for t in taken] == ["trusted-3-0", "trusted-3-7"]
    assert taken[1]["prompt_ids"] == [107, 107] and taken[1]["token_ids"] == [207]
    assert taken[0]["log_probs"] == [-0.5] * 3 and taken[0]["version"] == 3
    assert {t["temperature"] for t in taken} == {1.0} and {t["top_k"] for t in taken} == {-1}


def test_no_more_than_the_calibration_needs_and_nothing_once_it_is_done():
    tags, data = batch([row() for _ in range(5)])
    owed = feed(3)
    assert len(owed.take(tags, data)) == 3 and owed.remaining == 0
    assert owed.take(tags, data) == []
