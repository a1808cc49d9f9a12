"""lm-evaluation-harness tasks (optional: `pip install lm-eval`) on the base and on the tuned model, after an
evaluation: `python -m core.eval --run RUN --lm-eval TASKS`.

TASKS is a comma-separated list of task names or task YAML files (a local task: `dataset_path: json` with
`dataset_kwargs: {data_files: ...}`; nothing is downloaded here). Each task's figures go into the result's folder
(lm_eval.json) and come back as `eval: lm-eval <task> <metric> B -> A` lines.
"""

from __future__ import annotations

import json
from pathlib import Path

from core.eval.heldout import EvalError
from core.files import atomic_write_text, read_yaml_mapping

LM_EVAL = "lm_eval.json"


SKIP = ("sample_len", "alias", "samples")  # bookkeeping in lm-eval's results, not figures


def lm_tokenizer(base: str, adapter: str | None):
    """The tokenizer the evaluation used: the adapter folder's when it carries one, else the base's."""
    from transformers import AutoTokenizer

    has_own = adapter and (Path(adapter) / "tokenizer_config.json").is_file()
    return AutoTokenizer.from_pretrained(adapter if has_own else base)


def _tasks(spec: str) -> tuple[list[str], list[str]]:
    """(task names, folders to include) from "name,path/to/task.yaml,..."."""
    names, include = [], []
    for part in (p.strip() for p in spec.split(",")):
        if not part:
            continue
        path = Path(part).expanduser()
        if path.suffix in (".yaml", ".yml"):
            cfg = read_yaml_mapping(path) if path.is_file() else None
            if not cfg or not isinstance(cfg.get("task"), str):
                raise EvalError(f"--lm-eval: {part} is not a task YAML file with a `task:` name.")
            names.append(cfg["task"])
            include.append(str(path.resolve().parent))
        else:
            names.append(part)
    if not names:
        raise EvalError("--lm-eval: name at least one task.")
    return names, sorted(set(include))


def run_tasks(result, spec: str, batch_size: int = 8) -> list[str]:
    """Run the tasks on the base and the tuned model of an evaluation's settings; store and return the lines."""
    try:
        from lm_eval import simple_evaluate
        from lm_eval.models.huggingface import HFLM
        from lm_eval.tasks import TaskManager
    except ImportError:
        raise EvalError(
            "--lm-eval needs lm-evaluation-harness, which is not installed: pip install lm-eval"
        ) from None
    names, include = _tasks(spec)
    manager = TaskManager(include_path=include or None)
    s = result.settings
    adapter = s["tuned"] if (Path(s["tuned"]) / "adapter_config.json").is_file() else None
    models = {
        "base": {"pretrained": s["base"]},
        "tuned": {"pretrained": s["base"], "peft": adapter} if adapter else {"pretrained": s["tuned"]},
    }
    chat = bool(getattr(lm_tokenizer(s["base"], adapter), "chat_template", None))
    figures: dict[str, dict] = {}
    for side, kwargs in models.items():
        lm = HFLM(
            **kwargs, batch_size=batch_size, device=s.get("device") or "cpu", dtype=s.get("dtype") or "auto"
        )
        try:
            out = simple_evaluate(
                model=lm,
                tasks=names,
                task_manager=manager,
                log_samples=False,
                limit=s.get("limit"),  # the evaluation's own --limit
                apply_chat_template=chat,  # prompts as the run was trained: through the chat template
            )
        except Exception as exc:  # a task that does not load is the user's input
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise EvalError(f"--lm-eval: the tasks did not run ({first}).") from None
        for task, values in (out or {}).get("results", {}).items():
            for metric, value in values.items():
                number = isinstance(value, (int, float)) and not isinstance(value, bool)
                if number and metric not in SKIP and "_stderr" not in metric:
                    figures.setdefault(f"{task} {metric.split(',')[0]}", {})[side] = float(value)
    atomic_write_text(
        Path(result.folder) / LM_EVAL, json.dumps({"tasks": names, "figures": figures}, indent=1)
    )
    return [
        f"eval: lm-eval {key} {v.get('base', float('nan')):.4g} -> {v.get('tuned', float('nan')):.4g}"
        for key, v in figures.items()
    ]
