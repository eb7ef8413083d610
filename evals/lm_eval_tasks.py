"""lm-eval tasks: names checked and datasets fetched before a run, the offline tasks built from the
bundled text, and the table of a run's results (the run itself: ``evals.lm_eval_adapter.run_tasks``).

Standard tasks (hellaswag, arc_easy, ...) fetch their datasets from the Hugging
Face hub. Offline, ``lowbit_offline`` works: three small tasks built from the
bundled *Persuasion* (deterministically, into ``$LOWBIT_CACHE/lm_eval_tasks``) and
read by lm-eval as local jsonl (``dataset_path: json``), one per request type:

* ``lowbit_persuasion_ppl``: paragraphs scored whole (loglikelihood_rolling):
  word and byte perplexity, bits per byte;
* ``lowbit_persuasion_cloze``: two sentences, then pick the one that follows
  among four of about the same length (loglikelihood): accuracy;
* ``lowbit_persuasion_gen``: complete the last words of a sentence (generate_until):
  exact match.
"""

from __future__ import annotations

import functools
import json
import random
import re
from pathlib import Path

from evals.texts import load_text
from quant.names import close_names

OFFLINE_GROUP = "lowbit_offline"
OFFLINE_TASKS = ("lowbit_persuasion_ppl", "lowbit_persuasion_cloze", "lowbit_persuasion_gen")
TASKS_VERSION = 3  # bump when the generated data or YAML change: a new directory is built


class TaskError(ValueError):
    pass


def _paragraphs(text: str) -> list[str]:
    paras = [" ".join(p.split()) for p in text.split("\n\n")]
    return [p for p in paras if len(p) >= 200 and not p.isupper()]


def _sentences(paragraph: str) -> list[str]:
    return [s for s in re.split(r"(?<=[.!?])\s+(?=[A-Z\"])", paragraph) if len(s.split()) >= 4]


def offline_docs(seed: int = 0) -> dict[str, list[dict]]:
    """The documents of each offline task, from the bundled text; the same on every machine."""
    rng = random.Random(seed)
    paras = _paragraphs(load_text("default"))
    ppl = [{"text": p} for p in paras[:24]]
    pool = [s for p in paras for s in _sentences(p)]
    cloze, gen = [], []
    for p in paras[24:]:
        sents = _sentences(p)
        if len(sents) >= 3 and len(cloze) < 40:
            answer = sents[2]
            # distractors of about the answer's length: a summed log-likelihood must not win on length alone
            near = sorted((s for s in pool if s != answer), key=lambda s: abs(len(s) - len(answer)))[:12]
            choices = [answer] + rng.sample(near, 3)
            rng.shuffle(choices)
            cloze.append({"context": f"{sents[0]} {sents[1]}", "choices": choices, "label": choices.index(answer)})
        words = sents[-1].rstrip(".!?\"").split() if sents else []
        if len(words) >= 8 and len(gen) < 30:
            gen.append({"context": " ".join(sents[:-1] + [" ".join(words[:-2])]), "answer": " ".join(words[-2:])})
    return {"lowbit_persuasion_ppl": ppl, "lowbit_persuasion_cloze": cloze, "lowbit_persuasion_gen": gen}


def _yaml(task: str, data_file: Path) -> str:
    head = (f"task: {task}\ntag: []\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {json.dumps(str(data_file))}\n"
            "test_split: test\nmetadata:\n  version: " + f"{TASKS_VERSION}.0\n")
    bodies = {
        "lowbit_persuasion_ppl": (
            'output_type: loglikelihood_rolling\ndoc_to_text: ""\ndoc_to_target: "{{text}}"\n'
            "metric_list:\n"
            "  - metric: word_perplexity\n    aggregation: weighted_perplexity\n    higher_is_better: false\n"
            "  - metric: byte_perplexity\n    aggregation: weighted_perplexity\n    higher_is_better: false\n"
            "  - metric: bits_per_byte\n    aggregation: bits_per_byte\n    higher_is_better: false\n"),
        "lowbit_persuasion_cloze": (
            'output_type: multiple_choice\ndoc_to_text: "{{context}}"\ndoc_to_choice: "{{choices}}"\n'
            'doc_to_target: "{{label}}"\ntarget_delimiter: " "\n'
            "metric_list:\n  - metric: acc\n    aggregation: mean\n    higher_is_better: true\n"
            "  - metric: acc_norm\n    aggregation: mean\n    higher_is_better: true\n"),
        "lowbit_persuasion_gen": (
            'output_type: generate_until\ndoc_to_text: "{{context}}"\ndoc_to_target: "{{answer}}"\n'
            'target_delimiter: " "\ngeneration_kwargs:\n  until: ["\\n", ".", ",", ";"]\n  max_gen_toks: 8\n'
            "  do_sample: false\nfilter_list:\n  - name: strip\n    filter:\n      - function: regex\n"
            '        regex_pattern: "^\\\\s*(.*?)\\\\s*$"\n'
            "metric_list:\n  - metric: exact_match\n    aggregation: mean\n    higher_is_better: true\n"
            "    ignore_case: true\n    ignore_punctuation: true\n"),
    }
    return head + bodies[task]


def build_offline_tasks(directory: Path | None = None) -> Path:
    """Write the offline tasks' jsonl and YAML (once) and return the directory to give lm-eval."""
    if directory is None:
        from quant.models import cache_dir

        directory = cache_dir() / "lm_eval_tasks" / f"v{TASKS_VERSION}"
    directory = Path(directory)
    if (directory / f"{OFFLINE_GROUP}.yaml").exists():
        return directory
    directory.mkdir(parents=True, exist_ok=True)
    for task, docs in offline_docs().items():
        data = directory / f"{task}.jsonl"
        data.write_text("".join(json.dumps(d) + "\n" for d in docs))
        (directory / f"{task}.yaml").write_text(_yaml(task, data))
    # the group file last: its presence marks a complete directory
    (directory / f"{OFFLINE_GROUP}.yaml").write_text(
        f"group: {OFFLINE_GROUP}\ntask:\n" + "".join(f"  - {t}\n" for t in OFFLINE_TASKS)
        + "aggregate_metric_list: []\nmetadata:\n  version: 1.0\n")
    return directory


@functools.lru_cache(maxsize=4)
def _task_manager(include: str):
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=include)


def task_manager(include: Path | None = None):
    """lm-eval's index of tasks plus the offline ones (built once per process: indexing takes ~10 s)."""
    return _task_manager(str(include or build_offline_tasks()))


def check_task_names(names: list[str], manager) -> None:
    """Raise TaskError naming every task lm-eval does not know, with its close matches."""
    known = manager.all_tasks
    unknown = [n for n in names if n not in known]
    if not unknown:
        return
    parts = []
    for name in unknown:
        close = close_names(name, known, n=5)
        parts.append(f"{name!r}" + (f" (close matches: {', '.join(close)})" if close else " (no close match)"))
    raise TaskError(f"lm-eval does not know the task {'; '.join(parts)}. Offline, '{OFFLINE_GROUP}' runs on the "
                    "bundled text; `lm-eval ls tasks` lists the rest")


_OFFLINE_SIGNS = ("offline", "connection", "resolve", "couldn't reach", "could not reach", "network", "timed out",
                  "max retries", "name or service not known", "temporary failure", "hub")


def _is_unreachable(error: BaseException) -> bool:
    text = f"{type(error).__name__} {error}".lower()
    return isinstance(error, (ConnectionError, TimeoutError)) or any(s in text for s in _OFFLINE_SIGNS)


def load_tasks(names: list[str], manager) -> dict:
    """lm-eval's task objects (their datasets loaded), or a TaskError saying which dataset is unreachable."""
    from lm_eval.tasks import get_task_dict

    try:
        if hasattr(manager, "load"):  # lm-eval 0.4.10+; get_task_dict is deprecated there
            return manager.load(names)
        return get_task_dict(names, manager)
    except Exception as e:  # lm-eval and datasets raise many types; only the unreachable-hub case is reworded
        if not _is_unreachable(e):
            raise
        offline = [n for n in names if n == OFFLINE_GROUP or n in OFFLINE_TASKS]
        online = [n for n in names if n not in offline]
        raise TaskError(
            f"the dataset of {', '.join(online) or 'a task'} could not be fetched ({type(e).__name__}: "
            f"{str(e).splitlines()[0][:200] if str(e) else 'no detail'}): the Hugging Face hub is unreachable "
            f"from here. Offline, run '--tasks {OFFLINE_GROUP}' (built from the bundled text), or put the dataset "
            "in the local cache first") from None


def prepare_tasks(tasks: list[str]):
    """Check the names and fetch the datasets before any slow work; the task manager to run them with."""
    manager = task_manager()
    check_task_names(tasks, manager)
    load_tasks(tasks, manager)
    return manager


def tasks_table(result: dict) -> str:
    lines = ["| task | metric | value |", "|---|---|---|"]
    for task, metrics in result["tasks"].items():
        for key, value in metrics.items():
            if "stderr" in key or key == "sample_len" or not isinstance(value, (int, float)):
                continue
            lines.append(f"| {task} | {key.split(',')[0]} | {value:.4f} |")
    return "\n".join(lines)
