"""The quantization state in a ``torch.distributed.checkpoint`` (DCP), restored on any number of ranks.

te_v2's delayed-scaling state is the same on every rank wherever the amaxes are reduced
(``reduce_amax``, the default): each flush all-reduces them, so the histories and scales agree
after every step. DCP saves a plain tensor once, as replicated, so the state saved with a
sharded model (``torch.distributed.fsdp.fully_shard``) loads on any number of ranks. Loading it
needs tensors to load into, and a compiled function has its states only after its first call,
with the directions it ran: ``quantization_state_template`` makes them from the checkpoint's own
metadata instead, every entry saved, so that ``dcp.load`` fills them and
``load_quantization_state_dict`` takes them.

    dcp.save({"model": get_model_state_dict(model), "quantization": quantization_state_dict(fn)}, checkpoint_id=path)
    ...
    quantization = quantization_state_template(path)
    dcp.load({"quantization": quantization}, checkpoint_id=path)
    load_quantization_state_dict(fn, quantization)
"""

from __future__ import annotations

import os

import torch


def quantization_state_template(
    checkpoint_id: str | os.PathLike, key: str = "quantization"
) -> dict[str, torch.Tensor]:
    """Empty tensors for every entry of the quantization state saved under ``key`` in the
    filesystem checkpoint at ``checkpoint_id``, named as ``quantization_state_dict`` names them,
    with the shapes and dtypes saved, on the CPU (``load_quantization_state_dict`` copies them to
    the states' device). Raises naming ``key`` when the checkpoint holds nothing under it."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    prefix = f"{key}."
    saved = FileSystemReader(checkpoint_id).read_metadata().state_dict_metadata
    template = {
        name.removeprefix(prefix): torch.empty(meta.size, dtype=meta.properties.dtype)
        for name, meta in saved.items()
        if name.startswith(prefix) and isinstance(meta, TensorStorageMetadata)
    }
    if not template:
        keys = sorted({name.split(".", 1)[0] for name in saved})
        raise ValueError(
            f"te_v2: the checkpoint at {os.fspath(checkpoint_id)!r} holds no quantization state under "
            f"{key!r} (its top-level keys: {', '.join(keys) or 'none'}); pass the key it was saved "
            "under, as in dcp.save({..., key: quantization_state_dict(fn)})"
        )
    return template
