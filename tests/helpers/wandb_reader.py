"""Read the history records of an offline W&B run file (.wandb: a LevelDB-style record log of protobufs)."""

import glob
import struct

_BLOCK = 32768
_HEADER = 7


def _records(data: bytes):
    pos, pending = _HEADER, b""
    while pos + _HEADER <= len(data):
        left = _BLOCK - pos % _BLOCK
        if left < _HEADER:
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + _HEADER])
        if kind == 0 and length == 0:
            pos += left
            continue
        chunk = data[pos + _HEADER:pos + _HEADER + length]
        pos += _HEADER + length
        if kind == 1:
            yield chunk
        elif kind == 2:
            pending = chunk
        elif kind == 3:
            pending += chunk
        elif kind == 4:
            yield pending + chunk
            pending = b""


def history_keys(wandb_dir: str) -> set[str]:
    """Every metric key logged to the offline runs under `wandb_dir`."""
    from wandb.proto import wandb_internal_pb2

    keys = set()
    for path in glob.glob(f"{wandb_dir}/**/*.wandb", recursive=True):
        with open(path, "rb") as fh:
            data = fh.read()
        for raw in _records(data):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(raw)
            if record.WhichOneof("record_type") == "history":
                keys.update(item.key or "/".join(item.nested_key) for item in record.history.item)
    return keys
