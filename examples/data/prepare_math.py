#!/usr/bin/env python3
"""Turn a math question/answer dataset into verl's RL parquet format (for the GEPO / HeteroRL examples).

Run in this repository's CI on a local JSONL file (tests/test_examples.py; the Hub datasets are not reachable there).

Each output row has verl's columns::

    data_source   the dataset's name (verl routes default rewards by it; the examples use a custom reward)
    prompt        [{"role": "user", "content": <question> + " " + <instruction>}]   (chat messages)
    ability       "math"
    reward_model  {"style": "rule", "ground_truth": <answer>}
    extra_info    {"split": <split name>, "index": <row number>, ...}

A reference solution's ground truth is its last ``\\boxed{...}`` (or ``\\fbox{...}``), taken by
``gepo_plugin.rewards.boxed.last_boxed``: the function the math-verify reward uses on the model's responses,
so a response that boxes the reference answer the way the reference did matches it (that module needs
neither math-verify nor verl).

Sources: a Hugging Face dataset (``--dataset``, loaded with ``datasets.load_dataset``; the default
is the set the paper's reference code trained on, SimpleRL-Zoo's MATH level 3-5 questions) or a
local JSON / JSONL / parquet file (``--input``; works offline). Examples::

    # training set used by the GEPO/HeteroRL reference runs (needs network access to the HF Hub once)
    python examples/data/prepare_math.py --output ~/data/gepo_math/train.parquet
    # MATH-500 as the validation set
    python examples/data/prepare_math.py --dataset HuggingFaceH4/MATH-500 --split test \\
        --question-key problem --answer-key answer --split-name test --output ~/data/gepo_math/test.parquet
    # a local file with {"question": ..., "answer": ...} per line
    python examples/data/prepare_math.py --input my.jsonl --output /tmp/my.parquet
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

try:
    from gepo_plugin.rewards.boxed import last_boxed
except ImportError:  # run from a checkout without `pip install -e .`: the package is two levels up
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from gepo_plugin.rewards.boxed import last_boxed

DEFAULT_DATASET = "hkust-nlp/SimpleRL-Zoo-Data"
DEFAULT_DATA_FILES = "simplelr_qwen_level3to5/train.parquet"
DEFAULT_INSTRUCTION = "Let's think step by step and output the final answer within \\boxed{}."
COLUMNS = ("data_source", "prompt", "ability", "reward_model", "extra_info")


def read_local(path: Path) -> list[dict[str, Any]]:
    """Rows of a local ``.jsonl``, ``.json`` (a list, or {"data": [...]}) or ``.parquet`` file."""
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        import pandas as pd

        return pd.read_parquet(path).to_dict(orient="records")
    text = path.read_text(encoding="utf-8")
    if suffix == ".jsonl" or (suffix != ".json" and not text.lstrip().startswith("[")):
        return [json.loads(line) for line in text.splitlines() if line.strip()]
    data = json.loads(text)
    if isinstance(data, dict):
        lists = [value for value in data.values() if isinstance(value, list)]
        if len(lists) != 1:
            raise SystemExit(f"{path}: a JSON object must hold exactly one list of rows (found {len(lists)})")
        data = lists[0]
    return list(data)


def read_hub(name: str, subset: str | None, split: str, data_files: str | None) -> Iterable[dict[str, Any]]:
    try:
        from datasets import load_dataset
    except ImportError as error:
        raise SystemExit("--dataset needs the `datasets` package: pip install datasets (or use --input)") from error
    kwargs: dict[str, Any] = {"split": split}
    if data_files:
        kwargs["data_files"] = {split: data_files}
    return load_dataset(name, subset, **kwargs)


def _plain(value: Any) -> Any:
    """numpy scalars/arrays (from parquet) to plain Python values."""
    if hasattr(value, "tolist"):
        return value.tolist()
    return value


def convert(
    rows: Iterable[dict[str, Any]],
    *,
    data_source: str,
    split_name: str,
    question_key: str,
    answer_key: str,
    instruction: str,
    system_prompt: str | None = None,
    extract_boxed: str = "auto",
    keep_keys: tuple[str, ...] = (),
    limit: int | None = None,
) -> Iterator[dict[str, Any]]:
    """verl RL rows from question/answer rows (see the module docstring for the columns)."""
    index = 0
    for number, row in enumerate(rows):
        if limit is not None and index >= limit:
            return
        for key in (question_key, answer_key):
            if key not in row:
                raise SystemExit(
                    f"row {number} has no key {key!r}; its keys are {sorted(row)}. "
                    "Choose others with --question-key / --answer-key."
                )
        question = str(row[question_key]).strip()
        answer = _plain(row[answer_key])
        if isinstance(answer, str):
            boxed = last_boxed(answer) if extract_boxed != "never" else None
            if extract_boxed == "always" and boxed is None:
                raise SystemExit(f"row {number}: --extract-boxed always, but the answer has no \\boxed{{}}: {answer!r}")
            answer = (boxed if boxed is not None else answer).strip()
        elif isinstance(answer, list):
            answer = [str(item).strip() for item in answer]
        else:
            answer = str(answer).strip()
        if not question or answer in ("", []):
            continue
        content = f"{question} {instruction}".strip() if instruction else question
        prompt = [{"role": "user", "content": content}]
        if system_prompt:
            prompt.insert(0, {"role": "system", "content": system_prompt})
        extra_info: dict[str, Any] = {"split": split_name, "index": index}
        for key in keep_keys:
            if key in row:
                extra_info[key] = _plain(row[key])
        yield {
            "data_source": data_source,
            "prompt": prompt,
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": answer},
            "extra_info": extra_info,
        }
        index += 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="prepare_math.py",
        description="Convert a math question/answer dataset (Hugging Face Hub or a local JSON/JSONL/parquet file) "
        "into verl's RL parquet format: data_source, prompt (chat messages), ability, "
        "reward_model {style: rule, ground_truth}, extra_info {split, index}.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    source = parser.add_argument_group("source (give --input for a local file, otherwise --dataset is loaded)")
    source.add_argument(
        "--input",
        type=Path,
        default=None,
        help="local .jsonl / .json / .parquet file with one question/answer per row; no network needed",
    )
    source.add_argument(
        "--dataset",
        default=DEFAULT_DATASET,
        help="Hugging Face dataset name for datasets.load_dataset (ignored with --input). The default is "
        "SimpleRL-Zoo's MATH level 3-5 set, which the GEPO/HeteroRL reference code trained on",
    )
    source.add_argument("--subset", default=None, help="dataset configuration name (load_dataset's 2nd argument)")
    source.add_argument("--split", default="train", help="split to load from the Hub dataset")
    source.add_argument(
        "--data-files",
        default=None,
        help=f"file(s) inside the Hub dataset to load as --split (default for {DEFAULT_DATASET}: "
        f"{DEFAULT_DATA_FILES}; use simplelr_qwen_level3to5/test.parquet for its test split)",
    )
    fields = parser.add_argument_group("fields")
    fields.add_argument("--question-key", default="question", help="key of the question text in each input row")
    fields.add_argument(
        "--answer-key",
        default="gt_answer",
        help="key of the reference answer in each input row (SimpleRL-Zoo: gt_answer; MATH-500: answer; "
        "for a local file you will usually want --answer-key answer)",
    )
    fields.add_argument(
        "--extract-boxed",
        choices=["auto", "always", "never"],
        default="auto",
        help="take the last \\boxed{...} (or \\fbox{...}) of the answer field as the ground truth, parsed as "
        "the reward parses responses: auto = when there is one "
        "(e.g. --answer-key solution of the MATH dataset), always = fail on rows without, never = keep as is",
    )
    fields.add_argument(
        "--keep-keys",
        nargs="*",
        default=[],
        help="input keys copied into extra_info (e.g. level subject)",
    )
    output = parser.add_argument_group("output")
    output.add_argument("--output", type=Path, required=True, help="parquet file to write (directories are created)")
    output.add_argument(
        "--data-source",
        default=None,
        help="value of the data_source column (default: the dataset name, or the input file's stem)",
    )
    output.add_argument("--split-name", default=None, help="extra_info.split value (default: --split)")
    output.add_argument(
        "--instruction",
        default=DEFAULT_INSTRUCTION,
        help="text appended to every question (empty string: none)",
    )
    output.add_argument("--system-prompt", default=None, help="optional system message put before the question")
    output.add_argument("--limit", type=int, default=None, help="write at most this many rows")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.input is not None:
        if not args.input.is_file():
            raise SystemExit(f"--input {args.input}: no such file")
        rows: Iterable[dict[str, Any]] = read_local(args.input)
        data_source = args.data_source or args.input.stem
    else:
        data_files = args.data_files
        if data_files is None and args.dataset == DEFAULT_DATASET:
            data_files = DEFAULT_DATA_FILES
        rows = read_hub(args.dataset, args.subset, args.split, data_files)
        data_source = args.data_source or args.dataset
    records = list(
        convert(
            rows,
            data_source=data_source,
            split_name=args.split_name or args.split,
            question_key=args.question_key,
            answer_key=args.answer_key,
            instruction=args.instruction,
            system_prompt=args.system_prompt,
            extract_boxed=args.extract_boxed,
            keep_keys=tuple(args.keep_keys),
            limit=args.limit,
        )
    )
    if not records:
        raise SystemExit("no rows written: the source is empty or every row lacked a question or an answer")
    import pandas as pd

    args.output.parent.mkdir(parents=True, exist_ok=True)
    pd.DataFrame.from_records(records, columns=list(COLUMNS)).to_parquet(args.output, index=False)
    print(f"wrote {len(records)} rows to {args.output} (data_source={data_source!r})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
