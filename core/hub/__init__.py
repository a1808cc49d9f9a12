"""Models and datasets from the Hugging Face Hub by id, on huggingface_hub and datasets (no HTTP of our own).

ids: what reads as a Hub id (ORG/NAME[@REVISION]), the endpoint, offline mode and the one sentence each Hub
failure gets. remote: a repo's commit and files, its config.json and safetensors headers (planning needs no
weights). fetch: the download (only the files training needs, a free-space check first, progress, resumable),
the files preflight needs, and whether a snapshot in the cache is complete. cache: the cache you can see (list,
delete). rows: a Hub dataset, streamed for a preview or downloaded whole for training. live: which runs use a
cached repo. `python -m core.hub info|download|list|rm`.
"""
