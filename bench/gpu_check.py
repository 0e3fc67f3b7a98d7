"""Checks GEPO's losses and the weight relay's codec on a GPU: float64-checked results, speed beside GSPO, GB/s.

Why it exists: the plugin's maths (``gepo_plugin/maths``) and the relay's codec
(``sampler/gepo_sampler/relay/codec.py``) are framework-free, but the test suite runs them on CPUs only. A lent GPU
machine has PyTorch and CUDA and none of verl, Ray, vLLM, Hydra or OmegaConf, and only 64 MiB travel to it, so this
script uses torch (plus numpy and safetensors, which that machine has) and the repository's own framework-free modules,
and nothing else:

1. correctness: GEPO's and GEPO+'s (hard and soft) loss and its gradient with respect to ``log_prob``, on the device
   in float32 and bfloat16, against a float64 CPU reference of the same functions on the same input values (grouped
   responses of varied lengths, padding, learner log-probs near the sampler's);
2. performance: GEPO's loss forward+backward (time and peak device memory) beside GSPO's, at one shape (default 512
   sequences x 8192 tokens, groups of 8). GSPO is a line-by-line copy of verl 0.9's ``compute_policy_loss_gspo``
   (verl cannot be imported there); ``tests/test_gpu_check.py`` holds the copy to verl's own function;
3. the relay codec on a state dict living on the device: snapshot (device->host copy), delta encode, apply and
   digest, in GB/s of weights. The codec works on host (numpy) arrays, so each figure is given both host-only and
   including the device<->host copy it needs.

It exits 0 when every check passed, 1 otherwise. Run it on the device machine with the ``run`` tool (the repository
travels as it is; nothing to install or carry):

    run(command="PYTHONUNBUFFERED=1 python3 bench/gpu_check.py --json $OUT/gpu_check.json", timeout_s=300)

and here, on the CPU, a quick look (seconds):

    .venv/bin/python bench/gpu_check.py --device cpu --quick
    .venv/bin/python bench/gpu_check.py --help

Packages the device machine lacks: importing ``gepo_plugin.maths`` imports pydantic (the option models of
``gepo_plugin/maths/options.py`` and ``gepo_plugin/options.py``) and the codec imports zstandard and xxhash at module
level. Where one of those three is missing, a stand-in module takes its name before the plugin is imported: pydantic's
lets the option models be defined as plain classes (nothing is validated; every option this script uses is passed
explicitly), zstandard's and xxhash's raise when used. zstd compression is not measured here; without xxhash the digest
is reported as skipped. The stand-ins used are printed and recorded in the JSON.
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import platform
import statistics
import sys
import time
import types
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, TypeVar

import torch

ROOT = Path(__file__).resolve().parents[1]

#: Packages that must never be imported here: the device machine has none of them.
FORBIDDEN = ("verl", "ray", "hydra", "omegaconf", "transformers", "vllm")

# --------------------------------------------------------------------------------------------- fixed parameters
#: clip range of w, [1 - CLIP, 1 + CLIP] (verl's clip_ratio_low/high as the plugin's examples set them)
CLIP = 0.2
#: upper cap of log w: GEPO's default, and the constant verl's GSPO clamps its log-ratio at
LOG_RATIO_CAP = 10.0
#: k3 KL toward the sampler in the correctness checks (the paper's asynchronous runs); 0 (GEPO's default) in the
#: timings, where GSPO has no such term
CHECK_SAMPLER_KL_COEF = 0.005
#: GEPO+'s KL threshold (the authors' kl_temp, the plugin's default)
GEPO_PLUS_KL_THRESHOLD = 0.002
#: the share of the relay's elements a version changes (by one unit in the last place: a small optimizer step)
RELAY_CHANGED_FRACTION = 0.1

# Tolerances of the correctness checks, as max |device - reference| / scale for the loss (scale: the larger of
# |reference loss| and the mean |advantage| of a sequence, the size of one sequence's term, as GRPO-style advantages
# sum to ~0 in a group and the loss itself may cancel to ~0) and for the gradient (scale: max |reference gradient|).
# The reference is float64 on exactly the values the device sees (inputs rounded to the dtype first), so the errors
# are the device's arithmetic alone, never input rounding.
# - float32: unit roundoff u = 2^-24 = 6e-8. The worst case is GEPO+'s per-sequence k3 KL: a sum of exp(d) over up to
#   8192 tokens minus the sum of d and the token count cancels about L ones to leave L * KL, so its error is up to
#   about L * u / (L * KL) = u / KL = 3e-5 relative at the threshold (KL = 0.002), and the soft gate
#   g = exp(-KL / threshold) passes ~1e-5 of it on to w. GEPO's own sums (8192 tokens, per-group log-sum-exps) give
#   ~1e-6 at worst; measured errors are ~3e-7 (rounding errors of random sign mostly cancel). 1e-4 is 10x the worst
#   case: a float32 result that misses it has lost precision somewhere (e.g. a sum done in bf16, TF32 on).
# - bfloat16: 8 significant bits, u = 2^-8 = 3.9e-3. The loss is computed in float32 from bf16 inputs (GEPO promotes),
#   so its error is float32's; the gradient reaches the bf16 leaf rounded to bf16 (<= u/2 of each element, measured
#   ~2.5e-3 of the largest). 2e-2 is about 5 u: any bf16 arithmetic beyond that one final rounding would show.
TOLERANCES: dict[str, float] = {"float32": 1e-4, "bfloat16": 2e-2}
#: A sequence whose reference weight lies within this relative distance of a clip edge, or whose k3 KL lies within
#: 100x it (1e-3 of the threshold: that KL cancels, see above) of GEPO+'s hard threshold, has a gradient that float64
#: and the device may put on different sides of the edge. Its advantage is set to 0 for the check (on both sides), and
#: counted.
BOUNDARY_MARGIN = 1e-5

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
QUICK = {"rows": 16, "tokens": 256, "relay_mb": 8, "repeats": 5, "warmup": 1, "relay_repeats": 2}
FULL = {"rows": 512, "tokens": 8192, "relay_mb": 512, "repeats": 20, "warmup": 3, "relay_repeats": 3}
GB = 1e9
MIB = 2**20

T = TypeVar("T")
F = TypeVar("F", bound=Callable[..., Any])


# --------------------------------------------------------------------------------------------- imports


def _pydantic_stand_in() -> types.ModuleType:
    """Just enough pydantic for ``gepo_plugin/options.py`` and ``gepo_plugin/maths/options.py`` to be imported: a
    model is a plain class whose fields read as their declared defaults. Nothing is validated."""
    module = types.ModuleType("pydantic", "gpu_check.py's stand-in for a missing pydantic (see its docstring)")

    class BaseModel:
        model_config: ClassVar[dict[str, Any]] = {}

        def __init__(self, **values: Any) -> None:
            for key, value in values.items():
                object.__setattr__(self, key, value)

    class ValidationError(ValueError):
        """Never raised: the stand-in validates nothing."""

    def field_default(default: Any = None, **_: Any) -> Any:
        return default

    def config_dict(**settings: Any) -> dict[str, Any]:
        return dict(settings)

    def validator(*_: Any, **__: Any) -> Callable[[F], F]:
        return lambda function: function

    module.__dict__.update(
        BaseModel=BaseModel,
        ValidationError=ValidationError,
        Field=field_default,
        ConfigDict=config_dict,
        model_validator=validator,
        field_validator=validator,
        StrictBool=bool,
    )
    return module


def _unusable_stand_in(name: str, purpose: str) -> types.ModuleType:
    """A module that can be imported and raises ModuleNotFoundError when anything in it is used."""
    module = types.ModuleType(name, f"gpu_check.py's stand-in for a missing {name}")

    def __getattr__(attribute: str) -> Any:
        if attribute.startswith("__"):
            raise AttributeError(attribute)
        raise ModuleNotFoundError(f"{name} is not installed here ({purpose}); gpu_check.py stood in for its import")

    module.__getattr__ = __getattr__  # type: ignore[method-assign]
    return module


#: name -> (what the plugin uses it for, its stand-in)
STAND_INS: dict[str, tuple[str, Callable[[], types.ModuleType]]] = {
    "pydantic": ("the plugin's option models; every option used here is passed explicitly", _pydantic_stand_in),
    "zstandard": ("the relay's zstd compression, not measured here", lambda: _unusable_stand_in("zstandard", "zstd")),
    "xxhash": ("the relay's digest, reported as skipped", lambda: _unusable_stand_in("xxhash", "the digest")),
}


@dataclass(frozen=True)
class Kit:
    """The framework-free modules this script uses, and the stand-ins their import needed."""

    gepo: types.ModuleType
    gepo_plus: types.ModuleType
    codec: types.ModuleType
    stand_ins: dict[str, str]


def import_framework_free() -> Kit:
    """Import ``gepo_plugin.maths.gepo``, ``.gepo_plus`` and ``gepo_sampler.relay.codec`` from this checkout,
    first standing in for whichever of :data:`STAND_INS` is not installed."""
    for folder in (ROOT, ROOT / "sampler"):  # gepo_plugin, and gepo_sampler (the relay's codec)
        if str(folder) not in sys.path:
            sys.path.insert(0, str(folder))
    stand_ins = {}
    for name, (purpose, make) in STAND_INS.items():
        try:
            importlib.import_module(name)
        except ImportError:
            sys.modules[name] = make()
            stand_ins[name] = purpose
    try:
        gepo = importlib.import_module("gepo_plugin.maths.gepo")
        gepo_plus = importlib.import_module("gepo_plugin.maths.gepo_plus")
        codec = importlib.import_module("gepo_sampler.relay.codec")
    except ImportError as error:
        raise SystemExit(
            f"gpu_check: importing the plugin's framework-free modules failed: {error!r}. If a new module-level "
            "import is missing on this machine, carry its wheel (see the device tool's README) or add a stand-in."
        ) from error
    return Kit(gepo, gepo_plus, codec, stand_ins)


def import_report() -> dict[str, Any]:
    """Which packages this process imported: the forbidden ones (must be none) and every third-party top level."""
    tops = {name.split(".")[0] for name in sys.modules if sys.modules[name] is not None}
    stdlib = getattr(sys, "stdlib_module_names", frozenset())
    return {
        "forbidden": list(FORBIDDEN),
        "forbidden_imported": sorted(name for name in FORBIDDEN if name in tops),
        "third_party_top_level": sorted(name for name in tops if name not in stdlib and not name.startswith("_")),
    }


def progress(items: Iterable[T], desc: str, enabled: bool) -> Iterable[T]:
    """``items`` under a tqdm bar on stderr where tqdm is installed and ``enabled``."""
    if not enabled:
        return items
    try:
        from tqdm import tqdm
    except ImportError:
        return items
    return tqdm(items, desc=desc, leave=False, file=sys.stderr)


# --------------------------------------------------------------------------------------------- inputs


@dataclass
class Batch:
    """One micro-batch as verl's policy losses see it: ``[rows, tokens]`` right-padded, plus each row's group."""

    log_prob: torch.Tensor
    old_log_prob: torch.Tensor
    advantages: torch.Tensor
    mask: torch.Tensor
    group_ids: torch.Tensor

    def to(self, device: torch.device | str, dtype: torch.dtype) -> Batch:
        """The float tensors (the mask too) in ``dtype`` on ``device``; group ids stay int64."""
        return Batch(
            *(t.to(device=device, dtype=dtype) for t in (self.log_prob, self.old_log_prob, self.advantages, self.mask)),
            group_ids=self.group_ids.to(device),
        )


def make_batch(rows: int, tokens: int, group_size: int, seed: int) -> Batch:
    """Float64 CPU inputs: ``rows // group_size`` prompt groups; response lengths from tokens/8 to tokens; sampler
    log-probs in [-1, -0.1]; the learner's off by a per-sequence shift (sd 0.15) plus per-token noise (sd 0.05), so
    some sequences are clipped and GEPO+'s gate takes both branches; 0/1 rewards, advantages reward minus the group's
    mean (GEPO's), 0 on padding as verl pads."""
    gen = torch.Generator().manual_seed(seed)
    f64 = torch.float64
    lengths = torch.randint(max(1, tokens // 8), tokens + 1, (rows,), generator=gen)
    mask = (torch.arange(tokens)[None, :] < lengths[:, None]).to(f64)
    old = -(0.1 + 0.9 * torch.rand(rows, tokens, generator=gen, dtype=f64))
    shift = 0.15 * torch.randn(rows, 1, generator=gen, dtype=f64)
    logp = (old + shift + 0.05 * torch.randn(rows, tokens, generator=gen, dtype=f64)).clamp(max=-1e-4)
    rewards = torch.randint(0, 2, (rows,), generator=gen).to(f64)
    per_seq = rewards - rewards.view(-1, group_size).mean(-1).repeat_interleave(group_size)
    return Batch(
        log_prob=logp * mask,
        old_log_prob=old * mask,
        advantages=per_seq[:, None] * mask,
        mask=mask,
        group_ids=torch.arange(rows) // group_size,
    )


# --------------------------------------------------------------------------------------------- the losses


def seq_mean_token_mean(token_losses: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """verl's ``agg_loss(..., "seq-mean-token-mean")`` on one rank (dp_size 1, no global batch size)."""
    mask = mask.to(token_losses.dtype)
    lengths = mask.sum(dim=-1)
    seq_losses = (token_losses * mask).sum(dim=-1) / (lengths + 1e-8)
    seq_mask = (lengths > 0).to(seq_losses.dtype)
    return (seq_losses * seq_mask).sum() / seq_mask.sum()


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """verl's ``masked_mean`` over all elements."""
    return (torch.where(mask.bool(), values, 0.0) * mask).sum() / (mask.sum() + 1e-8)


def gspo_loss(
    log_prob: torch.Tensor, old_log_prob: torch.Tensor, advantages: torch.Tensor, response_mask: torch.Tensor
) -> tuple[torch.Tensor, dict[str, float]]:
    """verl 0.9's ``compute_policy_loss_gspo`` (seq-mean-token-mean, clip 0.2/0.2, no rollout weights), line by line,
    its metrics' host transfers included: the baseline GEPO is timed against."""
    negative_approx_kl = log_prob - old_log_prob
    seq_lengths = torch.sum(response_mask, dim=-1).clamp(min=1)
    negative_approx_kl_seq = torch.sum(negative_approx_kl * response_mask, dim=-1) / seq_lengths
    log_seq_importance_ratio = log_prob - log_prob.detach() + negative_approx_kl_seq.detach().unsqueeze(-1)
    log_seq_importance_ratio = torch.clamp(log_seq_importance_ratio, max=10.0)
    seq_importance_ratio = torch.exp(log_seq_importance_ratio)
    pg_losses1 = -advantages * seq_importance_ratio
    pg_losses2 = -advantages * torch.clamp(seq_importance_ratio, 1 - CLIP, 1 + CLIP)
    pg_losses = torch.maximum(pg_losses1, pg_losses2)
    pg_loss = seq_mean_token_mean(pg_losses, response_mask)
    pg_clipfrac = masked_mean(torch.gt(pg_losses2, pg_losses1).float(), response_mask)
    pg_clipfrac_lower = torch.tensor(0.0, device=pg_loss.device)
    ppo_kl = masked_mean(-negative_approx_kl, response_mask)
    metrics = {
        "actor/pg_clipfrac": pg_clipfrac.detach().item(),
        "actor/ppo_kl": ppo_kl.detach().item(),
        "actor/pg_clipfrac_lower": pg_clipfrac_lower.detach().item(),
    }
    return pg_loss, metrics


def gepo_loss(
    kit: Kit,
    log_prob: torch.Tensor,
    batch: Batch,
    log_group_expectation: torch.Tensor,
    plus: Any = None,
    sampler_kl_coef: float = 0.0,
) -> tuple[torch.Tensor, Any]:
    """GEPO (or GEPO+ with ``plus``) as the plugin's verl loss runs it: the token losses, verl's seq-mean-token-mean,
    and the metrics moved to the host as floats (as the verl glue reports them). Returns the loss and the terms."""
    terms = kit.gepo.gepo_token_losses(
        log_prob,
        batch.old_log_prob,
        batch.advantages,
        batch.mask,
        log_group_expectation,
        clip_ratio_low=CLIP,
        clip_ratio_high=CLIP,
        sampler_kl_coef=sampler_kl_coef,
        log_ratio_cap=LOG_RATIO_CAP,
        plus=plus,
    )
    loss = seq_mean_token_mean(terms.token_losses, batch.mask)
    terms.metrics = {key: float(value) for key, value in terms.metrics.items()}
    return loss, terms


def plus_rule(kit: Kit, name: str) -> Any:
    """None for GEPO, the GEPO+ rule for ``gepo_plus_hard`` / ``gepo_plus_soft``."""
    if name == "gepo":
        return None
    return kit.gepo_plus.GEPOPlusRule(name.removeprefix("gepo_plus_"), GEPO_PLUS_KL_THRESHOLD)


# --------------------------------------------------------------------------------------------- 1. correctness

CHECKED_LOSSES = ("gepo", "gepo_plus_hard", "gepo_plus_soft")


def loss_and_grad(kit: Kit, name: str, batch: Batch) -> tuple[torch.Tensor, torch.Tensor, Any]:
    """Loss, d loss / d log_prob and the terms of ``name`` (group term included), on the batch's device and dtype."""
    leaf = batch.log_prob.detach().clone().requires_grad_()
    log_eq = kit.gepo.group_log_expectation_from_tokens(batch.old_log_prob, batch.mask, batch.group_ids)
    loss, terms = gepo_loss(kit, leaf, batch, log_eq, plus_rule(kit, name), CHECK_SAMPLER_KL_COEF)
    (grad,) = torch.autograd.grad(loss, leaf)
    return loss.detach(), grad, terms


def boundary_rows(kit: Kit, name: str, batch: Batch, terms: Any) -> torch.Tensor:
    """Rows whose float64 weight is at a clip edge or whose KL is at GEPO+'s hard threshold (see BOUNDARY_MARGIN)."""
    w = torch.exp(terms.log_weights)
    near = torch.zeros_like(w, dtype=torch.bool)
    for edge in (1 - CLIP, 1 + CLIP):
        near |= (w - edge).abs() < BOUNDARY_MARGIN * edge
    if name == "gepo_plus_hard":
        lengths = batch.mask.sum(-1).clamp(min=1)
        kl = (kit.gepo.k3_kl(batch.log_prob, batch.old_log_prob) * batch.mask).sum(-1) / lengths
        near |= (kl - GEPO_PLUS_KL_THRESHOLD).abs() < 100 * BOUNDARY_MARGIN * GEPO_PLUS_KL_THRESHOLD
    return near & terms.row_valid


def check_one(kit: Kit, name: str, dtype_name: str, batch64: Batch, device: torch.device) -> dict[str, Any]:
    """One loss in one dtype on ``device`` against float64 on the CPU, on the same (dtype-rounded) input values."""
    dtype = DTYPES[dtype_name]
    rounded = batch64.to("cpu", dtype)
    reference_inputs = rounded.to("cpu", torch.float64)
    ref_loss, ref_grad, ref_terms = loss_and_grad(kit, name, reference_inputs)
    near = boundary_rows(kit, name, reference_inputs, ref_terms)
    if bool(near.any()):  # a zero advantage takes the row's weight out of its loss: no edge left to straddle
        for inputs in (rounded, reference_inputs):
            inputs.advantages[near] = 0
        ref_loss, ref_grad, ref_terms = loss_and_grad(kit, name, reference_inputs)
    loss, grad, _ = loss_and_grad(kit, name, rounded.to(device, dtype))
    loss64, grad64 = loss.to("cpu", torch.float64), grad.to("cpu", torch.float64)
    valid = ref_terms.row_valid
    scale = max(abs(float(ref_loss)), float(reference_inputs.advantages[:, 0][valid].abs().mean()), 1e-12)
    loss_abs = abs(float(loss64 - ref_loss))
    grad_abs = float((grad64 - ref_grad).abs().max())
    grad_scale = max(float(ref_grad.abs().max()), 1e-30)
    finite = math.isfinite(float(loss64)) and bool(torch.isfinite(grad64).all())
    tolerance = TOLERANCES[dtype_name]
    result = {
        "loss": name,
        "dtype": dtype_name,
        "loss_abs_err": loss_abs,
        "loss_rel_err": loss_abs / scale,
        "grad_max_abs_err": grad_abs,
        "grad_rel_err": grad_abs / grad_scale,
        "tolerance": tolerance,
        "boundary_rows_neutralised": int(near.sum()),
        "clipped_or_own_rows": _branch_rows(name, ref_terms),
    }
    result["passed"] = finite and result["loss_rel_err"] <= tolerance and result["grad_rel_err"] <= tolerance
    return result


def _branch_rows(name: str, terms: Any) -> int:
    """How many rows took the interesting branch in the reference: clipped (GEPO) or own denominator (GEPO+)."""
    valid = terms.row_valid
    if name == "gepo":
        w = torch.exp(terms.log_weights[valid])
        return int(((w < 1 - CLIP) | (w > 1 + CLIP)).sum())
    return round(terms.totals["own_sum"])


def run_correctness(kit: Kit, args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    batch64 = make_batch(args.rows, args.tokens, args.group_size, args.seed)
    pairs = [(name, dtype) for dtype in DTYPES for name in CHECKED_LOSSES]
    checks = [
        check_one(kit, name, dtype, batch64, device) for name, dtype in progress(pairs, "correctness", args.progress)
    ]
    return {
        "shape": [args.rows, args.tokens],
        "group_size": args.group_size,
        "sampler_kl_coef": CHECK_SAMPLER_KL_COEF,
        "tolerances": TOLERANCES,
        "checks": checks,
        "passed": all(check["passed"] for check in checks),
    }


# --------------------------------------------------------------------------------------------- 2. performance


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(step: Callable[[], None], device: torch.device) -> float:
    """Seconds one ``step()`` takes: CUDA events on a GPU, perf_counter elsewhere."""
    synchronize(device)
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3
    started = time.perf_counter()
    step()
    return time.perf_counter() - started


def peak_mib(step: Callable[[], None], device: torch.device) -> float | None:
    """Peak device memory one ``step()`` allocates above what was live before it (MiB); None off CUDA."""
    if device.type != "cuda":
        return None
    synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    step()
    synchronize(device)
    return (torch.cuda.max_memory_allocated(device) - before) / MIB


def make_steps(kit: Kit, batch: Batch) -> dict[str, Callable[[], None]]:
    """One forward+backward per loss, each from a fresh leaf on the same inputs. GEPO's group term is computed once
    per training step by the trainer, over whole groups, so ``gepo`` gets it precomputed; ``gepo+term`` computes it
    in the step too (the micro-batch-scoped ``group_scope=batch``)."""
    log_eq = kit.gepo.group_log_expectation_from_tokens(batch.old_log_prob, batch.mask, batch.group_ids)
    hard = plus_rule(kit, "gepo_plus_hard")

    def leaf() -> torch.Tensor:
        return batch.log_prob.detach().requires_grad_()

    def gspo() -> None:
        gspo_loss(leaf(), batch.old_log_prob, batch.advantages, batch.mask)[0].backward()

    def gepo() -> None:
        gepo_loss(kit, leaf(), batch, log_eq)[0].backward()

    def gepo_with_term() -> None:
        term = kit.gepo.group_log_expectation_from_tokens(batch.old_log_prob, batch.mask, batch.group_ids)
        gepo_loss(kit, leaf(), batch, term)[0].backward()

    def gepo_plus() -> None:
        gepo_loss(kit, leaf(), batch, log_eq, plus=hard)[0].backward()

    return {"gspo": gspo, "gepo": gepo, "gepo+term": gepo_with_term, "gepo_plus_hard": gepo_plus}


def run_performance(kit: Kit, args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    batch = make_batch(args.rows, args.tokens, args.group_size, args.seed + 1).to(device, DTYPES[args.dtype])
    steps = make_steps(kit, batch)
    for _ in range(args.warmup):
        for step in steps.values():
            step()
    samples: dict[str, list[float]] = {name: [] for name in steps}
    for _ in progress(range(args.repeats), "loss timings", args.progress):
        for name, step in steps.items():  # interleaved: drift (clocks, other load) hits every loss alike
            samples[name].append(timed(step, device))
    losses: dict[str, dict[str, Any]] = {}
    for name, step in steps.items():
        median = statistics.median(samples[name])
        losses[name] = {
            "median_ms": median * 1e3,
            "min_ms": min(samples[name]) * 1e3,
            "peak_mib": peak_mib(step, device),
        }
    base = losses["gspo"]
    for entry in losses.values():
        entry["time_vs_gspo"] = entry["median_ms"] / base["median_ms"]
        both = entry["peak_mib"] is not None and base["peak_mib"]
        entry["memory_vs_gspo"] = entry["peak_mib"] / base["peak_mib"] if both else None
    return {
        "shape": [args.rows, args.tokens],
        "group_size": args.group_size,
        "dtype": args.dtype,
        "repeats": args.repeats,
        "warmup": args.warmup,
        "timer": "cuda events" if device.type == "cuda" else "perf_counter",
        "losses": losses,
        "gepo_over_gspo_time": losses["gepo"]["time_vs_gspo"],
        "gepo_over_gspo_memory": losses["gepo"]["memory_vs_gspo"],
    }


# --------------------------------------------------------------------------------------------- 3. relay codec

_INT_OF_WIDTH = {2: torch.int16, 4: torch.int32}


def make_state(megabytes: int, device: torch.device, seed: int) -> dict[str, torch.Tensor]:
    """A Llama-like bf16 state dict of about ``megabytes`` MiB on ``device``: layers of attention [h, h] x 4 and MLP
    [2h, h] x 2 + [h, 2h] weights (at least four layers), fp32 norms, and a fp32 tensor whose bytes are not a multiple
    of 8 (the codec's tail path)."""
    target = megabytes * MIB
    hidden = 64
    while hidden < 4096 and 20 * (2 * hidden) ** 2 <= target / 4:
        hidden *= 2
    gen = torch.Generator(device=device).manual_seed(seed)
    shapes = {"q": (hidden, hidden), "k": (hidden, hidden), "v": (hidden, hidden), "o": (hidden, hidden)}
    shapes |= {"gate": (2 * hidden, hidden), "up": (2 * hidden, hidden), "down": (hidden, 2 * hidden)}
    state: dict[str, torch.Tensor] = {}
    total, layer = 0, 0
    while total < target:
        for part, shape in shapes.items():
            weights = 0.02 * torch.randn(shape, generator=gen, device=device)
            state[f"layers.{layer}.{part}.weight"] = weights.to(torch.bfloat16)
            total += weights.numel() * 2
        for norm in ("input_norm", "post_norm"):
            state[f"layers.{layer}.{norm}.weight"] = 1 + 0.01 * torch.randn(hidden, generator=gen, device=device)
            total += hidden * 4
        layer += 1
    state["head.bias"] = 0.01 * torch.randn(1001, generator=gen, device=device)
    return state


def nudge(state: dict[str, torch.Tensor], fraction: float, seed: int) -> dict[str, torch.Tensor]:
    """The next version: ``fraction`` of the elements moved by one unit in the last place (their bits + 1)."""
    out = {}
    for name, tensor in state.items():
        gen = torch.Generator(device=tensor.device).manual_seed(seed + len(out))
        ints = tensor.view(_INT_OF_WIDTH[tensor.element_size()])
        bump = torch.rand(tensor.shape, generator=gen, device=tensor.device) < fraction
        out[name] = (ints + bump.to(ints.dtype)).view(tensor.dtype)
    return out


def wall_seconds(
    action: Callable[[Any], Any], repeats: int, device: torch.device, prepare: Callable[[], Any]
) -> list[float]:
    """The wall time of ``action(prepare())``, ``repeats`` times (the preparation not timed), after one untimed run:
    the first touch of freshly mapped host memory (page faults) is the allocator's cost, not the codec's."""
    values = []
    for attempt in range(repeats + 1):
        prepared = prepare()
        synchronize(device)
        started = time.perf_counter()
        action(prepared)
        synchronize(device)
        if attempt:
            values.append(time.perf_counter() - started)
    return values


def run_relay(kit: Kit, args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    codec = kit.codec
    old_state = make_state(args.relay_mb, device, args.seed)
    new_state = nudge(old_state, RELAY_CHANGED_FRACTION, args.seed + 100)
    synchronize(device)
    names = list(old_state)
    old_bits = codec.WeightBits.from_tensors(old_state)
    new_bits = codec.WeightBits.from_tensors(new_state)
    nbytes = old_bits.nbytes
    encoder = codec.DeltaEncoder()
    delta, changed = encoder.encode(old_bits, new_bits, names)
    staging = old_bits.copy()
    codec.apply_delta(staging, delta)
    exact = staging.equal(new_bits)
    reps = args.relay_repeats

    def nothing() -> None:
        return None

    def staging_copy() -> Any:
        return old_bits.copy()

    def apply_and_upload(weights: Any) -> None:
        codec.apply_delta(weights, delta)
        for tensor in weights.to_tensors().values():
            tensor.to(device, copy=True)

    ops: dict[str, dict[str, Any]] = {}
    timings = {
        "snapshot": (None, wall_seconds(lambda _: codec.WeightBits.from_tensors(new_state), reps, device, nothing)),
        "encode delta": (
            wall_seconds(lambda _: encoder.encode(old_bits, new_bits, names), reps, device, nothing),
            wall_seconds(
                lambda _: encoder.encode(old_bits, codec.WeightBits.from_tensors(new_state), names),
                reps,
                device,
                nothing,
            ),
        ),
        "apply delta": (
            wall_seconds(lambda w: codec.apply_delta(w, delta), reps, device, staging_copy),
            wall_seconds(apply_and_upload, reps, device, staging_copy),
        ),
    }
    digest_skipped = None
    try:
        digest_match = staging.digests() == new_bits.digests()
        timings["digest"] = (
            wall_seconds(lambda _: old_bits.digests(), reps, device, nothing),
            wall_seconds(lambda _: codec.WeightBits.from_tensors(old_state).digests(), reps, device, nothing),
        )
    except ImportError as error:
        digest_match, digest_skipped = None, str(error)
    for op, (host, with_copy) in timings.items():
        ops[op] = {}
        for kind, values in (("host", host), ("with_copy", with_copy)):
            if values is None:
                continue
            median, best = statistics.median(values), min(values)
            ops[op] |= {
                f"{kind}_seconds": median,
                f"{kind}_gb_per_s": nbytes / median / GB,
                f"{kind}_best_gb_per_s": nbytes / best / GB,
            }
    if digest_skipped:
        ops["digest"] = {"skipped": digest_skipped}
    return {
        "state_mib": nbytes / MIB,
        "tensors": len(names),
        "tensors_on": str(device),
        "codec_needs_host_arrays": True,
        "copy_included": {
            "snapshot": "WeightBits.from_tensors: the device->host copy of every tensor (the codec's input)",
            "encode delta": "with_copy: snapshot of the new version + encode; host: encode of two host snapshots",
            "apply delta": "with_copy: apply + host->device upload of every tensor; host: apply into a staging copy",
            "digest": "with_copy: snapshot + xxHash3-128 of every tensor; host: the digests of a host snapshot",
        },
        "changed_fraction": changed / old_bits.elements,
        "delta_mib": len(delta) / MIB,
        "apply_exact": exact,
        "digest_match": digest_match,
        "repeats": reps,
        "ops": ops,
        "passed": exact and digest_match is not False,
    }


# --------------------------------------------------------------------------------------------- report


def device_info(device: torch.device) -> dict[str, Any]:
    info: dict[str, Any] = {
        "device": str(device),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cpu_threads": torch.get_num_threads(),
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info |= {
            "name": props.name,
            "capability": f"{props.major}.{props.minor}",
            "memory_gib": props.total_memory / 2**30,
            "cuda": torch.version.cuda,
            "tf32_matmul": torch.backends.cuda.matmul.allow_tf32,
        }
    else:
        info["name"] = platform.processor() or platform.machine()
    return info


def _num(value: float | None, spec: str, width: int) -> str:
    return f"{'n/a':>{width}}" if value is None else f"{value:>{width}{spec}}"


def print_report(result: Mapping[str, Any]) -> None:
    info = result["device"]
    print(f"gpu_check on {info['device']} ({info['name']}), torch {info['torch']}, python {info['python']}")
    if result["imports"]["stand_ins"]:
        print(
            "stand-ins for missing packages: "
            + "; ".join(f"{k} ({v})" for k, v in result["imports"]["stand_ins"].items())
        )
    forbidden = result["imports"]["forbidden_imported"]
    print(f"forbidden packages imported: {', '.join(forbidden) if forbidden else 'none'}")

    correctness = result.get("correctness")
    if correctness:
        rows, tokens = correctness["shape"]
        print(
            f"\n1. correctness vs float64 CPU ({rows} x {tokens} tokens, groups of {correctness['group_size']}, "
            f"sampler_kl_coef {correctness['sampler_kl_coef']})"
        )
        print(
            f"{'loss':<16}{'dtype':<10}{'loss rel err':>14}{'grad max abs':>14}{'grad rel err':>14}"
            f"{'tolerance':>11}{'branch rows':>13}{'edge rows':>11}  result"
        )
        for c in correctness["checks"]:
            print(
                f"{c['loss']:<16}{c['dtype']:<10}{c['loss_rel_err']:>14.2e}{c['grad_max_abs_err']:>14.2e}"
                f"{c['grad_rel_err']:>14.2e}{c['tolerance']:>11.0e}{c['clipped_or_own_rows']:>13}"
                f"{c['boundary_rows_neutralised']:>11}  {'pass' if c['passed'] else 'FAIL'}"
            )
        print("  (branch rows: clipped for gepo, own denominator for gepo_plus; edge rows: set to advantage 0)")

    perf = result.get("performance")
    if perf:
        rows, tokens = perf["shape"]
        print(
            f"\n2. loss forward+backward, {rows} x {tokens} tokens, {perf['dtype']}, groups of {perf['group_size']} "
            f"(median of {perf['repeats']}, {perf['timer']})"
        )
        print(f"{'loss':<16}{'median ms':>11}{'min ms':>10}{'vs gspo':>9}{'peak MiB':>11}{'vs gspo':>9}")
        for name, e in perf["losses"].items():
            print(
                f"{name:<16}{e['median_ms']:>11.3f}{e['min_ms']:>10.3f}{e['time_vs_gspo']:>9.3f}"
                f"{_num(e['peak_mib'], '.1f', 11)}{_num(e['memory_vs_gspo'], '.3f', 9)}"
            )
        memory = perf["gepo_over_gspo_memory"]
        print(
            f"GEPO/GSPO: time {perf['gepo_over_gspo_time']:.3f}, peak memory "
            f"{'n/a (CPU)' if memory is None else f'{memory:.3f}'}"
        )

    relay = result.get("relay")
    if relay:
        print(
            f"\n3. relay codec: {relay['state_mib']:.1f} MiB in {relay['tensors']} tensors on {relay['tensors_on']}; "
            f"{relay['changed_fraction']:.1%} of elements changed, delta {relay['delta_mib']:.1f} MiB (no zstd)"
        )
        print("   the codec works on host arrays: 'with copy' includes the device<->host copy each step needs")
        print(f"   GB/s of weights, median of {relay['repeats']} (best)")
        print(f"{'op':<16}{'host only':>20}{'with copy':>20}")
        for op, e in relay["ops"].items():
            if "skipped" in e:
                print(f"{op:<16}  skipped: {e['skipped']}")
                continue
            cells = [
                f"{e[f'{kind}_gb_per_s']:.2f} ({e[f'{kind}_best_gb_per_s']:.2f})" if f"{kind}_gb_per_s" in e else "n/a"
                for kind in ("host", "with_copy")
            ]
            print(f"{op:<16}{cells[0]:>20}{cells[1]:>20}")
        digest = relay["digest_match"]
        print(
            f"apply exact (bit-identical): {'yes' if relay['apply_exact'] else 'NO'}; digests match: "
            f"{'skipped' if digest is None else ('yes' if digest else 'NO')}"
        )
    print(f"\noverall: {'PASS' if result['passed'] else 'FAIL'}")


# --------------------------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    default_device = "cuda" if torch.cuda.is_available() else "cpu"
    parser = argparse.ArgumentParser(
        prog="gpu_check.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--device", default=default_device, help=f"torch device to check (default here: {default_device})"
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="small sizes for a look in seconds: "
        + ", ".join(f"--{k.replace('_', '-')} {v}" for k, v in QUICK.items())
        + " (options given explicitly still win)",
    )
    parser.add_argument("--rows", type=int, help=f"sequences per batch (default {FULL['rows']})")
    parser.add_argument("--tokens", type=int, help=f"response length in tokens, padded (default {FULL['tokens']})")
    parser.add_argument("--group-size", type=int, default=8, help="responses per prompt; divides --rows (default 8)")
    parser.add_argument(
        "--dtype", choices=sorted(DTYPES), default="float32", help="input dtype of the timings (default float32)"
    )
    parser.add_argument("--repeats", type=int, help=f"timed repetitions per loss (default {FULL['repeats']})")
    parser.add_argument("--warmup", type=int, help=f"untimed warm-up repetitions per loss (default {FULL['warmup']})")
    parser.add_argument(
        "--relay-mb", type=int, help=f"size of the relay's state dict in MiB (default {FULL['relay_mb']})"
    )
    parser.add_argument(
        "--relay-repeats",
        type=int,
        help=f"timed repetitions per codec operation, after one untimed (default {FULL['relay_repeats']})",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the random inputs (default 0)")
    parser.add_argument(
        "--skip",
        nargs="+",
        choices=("correctness", "performance", "relay"),
        default=[],
        help="parts to leave out",
    )
    parser.add_argument("--json", type=Path, help="also write every figure to this JSON file")
    parser.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=sys.stderr.isatty(),
        help="tqdm bars on stderr, where tqdm is installed (default: when stderr is a terminal)",
    )
    args = parser.parse_args(argv)
    sizes = QUICK if args.quick else FULL
    for key, value in sizes.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    for key in ("rows", "tokens", "group_size", "repeats", "relay_mb", "relay_repeats"):
        if getattr(args, key) < 1:
            parser.error(f"--{key.replace('_', '-')} must be at least 1")
    if args.warmup < 0:
        parser.error("--warmup must be at least 0")
    if args.rows % args.group_size:
        parser.error(f"--rows ({args.rows}) must be a multiple of --group-size ({args.group_size})")
    try:
        device = torch.device(args.device)
    except RuntimeError as error:
        parser.error(f"--device {args.device!r}: {error}")
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: this torch sees no CUDA device (use --device cpu)")
    args.device = device
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device: torch.device = args.device
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    kit = import_framework_free()
    started = time.perf_counter()
    result: dict[str, Any] = {"device": device_info(device), "args": {**vars(args), "device": str(device)}}
    sections = {"correctness": run_correctness, "performance": run_performance, "relay": run_relay}
    for name, run in sections.items():
        if name not in args.skip:
            result[name] = run(kit, args, device)
            if device.type == "cuda":
                torch.cuda.empty_cache()  # what a section cached is not the next one's
    result["imports"] = {**import_report(), "stand_ins": kit.stand_ins}
    result["seconds"] = time.perf_counter() - started
    result["passed"] = all(result[name].get("passed", True) for name in sections if name in result)
    print_report(result)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2, default=str) + "\n")
        print(f"wrote {args.json}")
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
