"""What autograd saves in one forward, counted the one way the planner's tests compare against."""

import torch


def saved_storage_bytes(model, forward) -> int:
    """Bytes of the distinct non-parameter storages autograd saves while `forward()` runs `model`'s forward."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen, keep = {}, []

    def pack(t):
        keep.append(t)  # every saved tensor stays alive while counting: no address is reused
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        forward()
    return sum(seen.values())
