"""The diagnosis rules, most specific first: each names the signs, the cause, the fix, and explains a run's own
evidence (core/monitor/diagnose.py applies them; docs/troubleshooting.md is generated from them). What a rule reads
in the evidence -- its tests and its explanations -- is core.monitor.explain's."""

from __future__ import annotations

from core.monitor.evidence import Rule
from core.monitor.explain import (
    dataloader_hang,
    explain_cpu_oom,
    explain_cuda_oom,
    explain_disk_full,
    explain_file,
    explain_hang,
    explain_index,
    explain_killed,
    explain_module,
    explain_nan,
    explain_unknown,
    killed_from_outside,
    nonfinite_loss,
    oom_killed,
)

RULES: list[Rule] = [
    Rule(
        name="disk_full",
        title="Disk full",
        signs="A status reason starting 'disk full', or stderr with `No space left on device` (ENOSPC, errno 28), "
        "`Disk quota exceeded` or safetensors' `StorageFull`.",
        cause="The disk that holds the run directory filled up: checkpoints (adapter plus optimizer state, each "
        "training.save_steps), metrics and logs could not be written. The trainer stops before a checkpoint that would not "
        "fit, and on a write that fails it records why.",
        fix=[
            "Free space on the disk that holds the workspace (old runs: lora-cockpit runs delete NAME; old "
            "exports), or move the workspace to a larger disk (LORA_COCKPIT_WORKSPACE), then resume the run.",
            "Keep fewer checkpoints: set training.save_total_limit (e.g. 2), or raise training.save_steps.",
        ],
        patterns=(
            r"(?i)^disk full\b",
            r"No space left on device",
            r"Disk quota exceeded",
            r"StorageFull",
            r"\[Errno 28\]",
        ),
        explain=explain_disk_full,
    ),
    Rule(
        name="cuda_oom",
        title="GPU out of memory (CUDA OOM)",
        signs="stderr contains `torch.OutOfMemoryError: CUDA out of memory` (or CUBLAS_STATUS_ALLOC_FAILED).",
        cause="The run needed more GPU memory than was free at that moment.",
        fix=[
            "Lower training.per_device_train_batch_size and raise training.gradient_accumulation_steps to keep the effective batch.",
            "Lower training.max_length, enable training.gradient_checkpointing, or use QLoRA (4-bit) with paged_adamw_8bit.",
            "If the message shows a large 'reserved by PyTorch but unallocated' figure, memory is fragmented: "
            "set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True.",
            "If other processes hold GPU memory (the Monitor lists them from NVML), close them.",
        ],
        patterns=(r"CUDA out of memory", r"OutOfMemoryError", r"CUBLAS_STATUS_ALLOC_FAILED"),
        explain=explain_cuda_oom,
    ),
    Rule(
        name="index_out_of_range",
        title="A token id or label is out of range (device-side assert)",
        signs="`CUDA error: device-side assert triggered` with `t >= 0 && t < n_classes` or `srcIndex < "
        "srcSelectDimSize`; on CPU `IndexError: Target N is out of bounds` or `index out of range in self`.",
        cause="A label is not a valid token id of the model (>= vocab_size), a token id is past the embedding "
        "table, or a sequence is longer than the model's maximum positions.",
        fix=[
            "Run the dataset preflight on the Train page: it checks token ids, labels and lengths against the model.",
            "Use the model's own tokenizer; after adding tokens call model.resize_token_embeddings(len(tokenizer)).",
            "Keep training.max_length at or below the model's max_position_embeddings.",
        ],
        patterns=(
            r"device-side assert triggered",
            r"Assertion `t >= 0 && t < n_classes` failed",
            r"Assertion `srcIndex < srcSelectDimSize` failed",
            r"IndexError: Target -?\d+ is out of bounds",
            r"IndexError: index out of range in self",
        ),
        explain=explain_index,
    ),
    Rule(
        name="cpu_oom",
        title="Out of CPU memory (RAM)",
        signs="`DefaultCPUAllocator: can't allocate memory`, `MemoryError`, `Cannot allocate memory`, or the "
        "process vanished (SIGKILL, 'ended without reporting') with no Python traceback: the kernel's OOM killer.",
        cause="The machine ran out of RAM: loading the model in full precision before quantising, a large "
        "dataset held in memory, or many data loader workers each copying it.",
        fix=[
            "Close other memory-hungry programs, or add swap.",
            "Lower training.dataloader_num_workers (each worker holds its own copy of the dataset pipeline).",
            "Load the model directly in 4-bit (QLoRA) and with low_cpu_mem_usage; tokenise the dataset to disk "
            "(datasets map with a cache) instead of holding it in Python lists.",
        ],
        patterns=(
            r"DefaultCPUAllocator: can't allocate memory",
            r"^\s*MemoryError\b",
            r"Cannot allocate memory",
            r"std::bad_alloc",
        ),
        test=oom_killed,
        explain=explain_cpu_oom,
    ),
    Rule(
        name="killed",
        title="Killed from outside (SIGKILL)",
        signs="The process vanished (SIGKILL, 'ended without reporting') with no Python traceback while its memory "
        "at its last sample (metrics.jsonl's rss_bytes) was under half of the machine's RAM (or its container's "
        "limit): not the kernel's OOM killer.",
        cause="Something outside the run ended it with SIGKILL: `kill -9`, a job scheduler or container runtime "
        "(a time limit, a pre-emption), or the session it ran in closing.",
        fix=[
            "Find who ended it: the scheduler's or container's logs, the shell history; `journalctl -k` shows "
            "'Out of memory: Killed process <pid>' only when the kernel did it.",
            "Resume it from its newest checkpoint (Resume on the Monitor, or lora-cockpit runs resume NAME).",
            "Stop a run with Stop or lora-cockpit runs stop NAME (it saves a checkpoint first), not kill -9.",
        ],
        test=killed_from_outside,
        explain=explain_killed,
    ),
    Rule(
        name="dataloader_worker_died",
        title="A data loader worker died",
        signs="`DataLoader worker (pid N) is killed by signal` or `DataLoader worker ... exited unexpectedly`.",
        cause="A worker process of the PyTorch DataLoader was killed, most often by the kernel's OOM killer "
        "(each worker copies the dataset) or because shared memory (/dev/shm) is too small.",
        fix=[
            "Set training.dataloader_num_workers=0 (or 1-2) and launch again.",
            "Set training.dataloader_pin_memory=False; in Docker, raise --shm-size.",
        ],
        patterns=(r"DataLoader worker \(pid", r"DataLoader worker .*exited unexpectedly"),
        explain=explain_cpu_oom,
    ),
    Rule(
        name="nan_loss",
        title="Loss became NaN / inf",
        signs="A non-finite loss in metrics.jsonl, a status reason such as 'loss became NaN at step N', or "
        "stderr reporting a NaN loss / anomaly.",
        cause="The optimisation diverged: a learning rate too high for this model, or fp16 overflow (values "
        "beyond 65504).",
        fix=[
            "Lower training.learning_rate (10x), keep training.max_grad_norm=1.0 and a warmup.",
            "Use bf16 instead of fp16 on GPUs that support it.",
            "Resume from the last checkpoint before the NaN, not from the end.",
        ],
        patterns=(r"(?i)\bloss (?:is|became) (?:nan|inf)\b", r"returned nan values in its \d+th output"),
        test=nonfinite_loss,
        explain=explain_nan,
    ),
    Rule(
        name="missing_module",
        title="A Python package is missing",
        signs="`ModuleNotFoundError: No module named '...'`.",
        cause="The training process runs in a Python environment without a package it needs.",
        fix=["Install the package in the environment that runs training (python -m pip install <package>)."],
        patterns=(r"ModuleNotFoundError: No module named",),
        explain=explain_module,
    ),
    Rule(
        name="file_not_found",
        title="A model or data file was not found",
        signs="`FileNotFoundError`, `No such file or directory`, or transformers reporting a path that is not a "
        "model folder (`Repo id must be in the form`, `does not appear to have a file named`).",
        cause="A path in the run config (model folder, dataset file, checkpoint) does not exist or is incomplete.",
        fix=[
            "Check model.path and the dataset path in config.yaml; the app works offline, so models must be "
            "local folders with config.json and weights.",
        ],
        patterns=(
            r"FileNotFoundError",
            r"No such file or directory",
            r"Repo id must be in the form",
            r"is not a local folder and is not a valid model identifier",
            r"does not appear to have a file named",
        ),
        explain=explain_file,
    ),
    Rule(
        name="dataloader_hang",
        title="No progress with the GPU idle (data loader hang)",
        signs="No new step for two minutes or more while GPU utilisation stays near 0%.",
        cause="The data loader is stuck (a worker deadlock, a slow network file system, or tokenisation on the "
        "fly that cannot keep up), so the GPU waits.",
        fix=[
            "Set training.dataloader_num_workers=0 to rule out worker deadlocks, then raise it gradually.",
            "Set training.dataloader_pin_memory=False.",
            "Tokenise the dataset before training and keep it on a local disk.",
        ],
        test=dataloader_hang,
        explain=explain_hang,
    ),
    Rule(
        name="unknown",
        title="Unrecognised failure",
        signs="None of the rules above matched.",
        cause="The run failed for a reason these rules do not know; the last error line is shown below.",
        fix=["Read the stderr tail below, fix the cause, and launch again."],
        test=lambda ev: True,
        explain=explain_unknown,
    ),
]
