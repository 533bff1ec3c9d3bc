"""WinoGrande from a local JSONL file, scored as lm-evaluation-harness's `winogrande` task
(lm_eval/tasks/winogrande/preprocess_winogrande.py: the same three functions)."""

from __future__ import annotations

import json
import os
from pathlib import Path

ENV = "KVLM_WINOGRANDE_PATH"


def load_local(data_path: str | None = None, **_):
    import datasets

    # no default location: the file is wherever the user keeps it (an installed kvlm has no ../shared)
    given = data_path or os.environ.get(ENV)
    if not given:
        raise FileNotFoundError(
            f'winogrande_local: no data file given; pass --metadata \'{{"data_path": "FILE"}}\' or set {ENV}=FILE '
            "(a JSONL file: sentence, option1, option2, answer per line)"
        )
    path = Path(given)
    if not path.is_file():
        raise FileNotFoundError(f"winogrande_local: no data file at {path} (from data_path or {ENV})")
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    for i, row in enumerate(rows):
        if "_" not in row.get("sentence", "") or str(row.get("answer")) not in ("1", "2"):
            raise ValueError(
                f"{path}:{i + 1}: expected sentence with a '_' blank, option1, option2, answer 1/2"
            )
        row["answer"] = str(row["answer"])
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})


def doc_to_text(doc):
    # multiple-input task: the "text" is the index of the right context among doc_to_choice's
    answer_to_num = {"1": 0, "2": 1}
    return answer_to_num[doc["answer"]]


def doc_to_target(doc):
    # the continuation scored: the sentence after the blank
    idx = doc["sentence"].index("_") + 1
    return doc["sentence"][idx:].strip()


def doc_to_choice(doc):
    # the contexts: the sentence up to the blank with each option substituted
    idx = doc["sentence"].index("_")
    options = [doc["option1"], doc["option2"]]
    return [doc["sentence"][:idx] + opt for opt in options]
