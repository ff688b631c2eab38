"""Read back what a tracker wrote under a logging directory, with each library's own reader.

Every reader returns ``{"runs": number of runs found, "scalars": {name: [(step, value), ...]},
"config": {name: value as text}, "closed": the run was ended}`` for the project ``project``.
"""
from __future__ import annotations

import glob
import json
import os
import struct
from pathlib import Path
from typing import Dict, List, Tuple

Scalars = Dict[str, List[Tuple[int, float]]]


def read_tensorboard(logging_dir: Path, project: str) -> dict:
    """Event files through TensorBoard's own `EventAccumulator`."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams import plugin_data_pb2

    run = logging_dir / project
    files = sorted(run.glob("events.out.tfevents.*"))
    accumulator = EventAccumulator(str(run))
    accumulator.Reload()
    scalars = {tag: [(e.step, e.value) for e in accumulator.Scalars(tag)] for tag in accumulator.Tags()["scalars"]}
    hparams = EventAccumulator(str(run / "hparams"))
    hparams.Reload()
    config = {}
    for content in hparams.PluginTagToContent("hparams").values():
        data = plugin_data_pb2.HParamsPluginData.FromString(content)
        if data.HasField("session_start_info"):
            for key, value in data.session_start_info.hparams.items():
                kind = value.WhichOneof("kind")
                config[key] = str(getattr(value, kind)) if kind else ""
    return {"runs": len(files), "hparam_files": len(list((run / "hparams").glob("events.out.tfevents.*"))),
            "scalars": scalars, "config": config, "closed": None}


def read_mlflow(logging_dir: Path, project: str) -> dict:
    """The local store through MLflow's own client (the SQLite store, or a file store)."""
    import mlflow

    database = logging_dir / "mlflow.db"
    uri = f"sqlite:///{database}" if database.exists() else (logging_dir / "mlruns").as_uri()
    client = mlflow.MlflowClient(uri)
    experiment = client.get_experiment_by_name(project)
    runs = client.search_runs([experiment.experiment_id]) if experiment is not None else []
    if len(runs) != 1:
        return {"runs": len(runs), "scalars": {}, "config": {}, "closed": False}
    run = runs[0]
    scalars = {key: sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, key))
               for key in run.data.metrics}
    return {"runs": 1, "scalars": scalars, "config": dict(run.data.params), "closed": run.info.status == "FINISHED"}


def _wandb_records(path: str) -> List[bytes]:
    """The records of a ``.wandb`` file: a 7-byte header (``:W&B``, version), then a LevelDB
    log (32 KiB blocks; each record chunk has a 7-byte header: CRC32C, length, type)."""
    data = Path(path).read_bytes()
    assert data[:4] == b":W&B", path
    block, position, pending, records = 32768, 7, b"", []
    while position + 7 <= len(data):
        left = block - position % block
        if left < 7:  # the rest of a block too short for a header is padding
            position += left
            continue
        _, length, kind = struct.unpack("<IHB", data[position:position + 7])
        if kind == 0:  # zero padding at the end of a block
            position += left
            continue
        chunk = data[position + 7:position + 7 + length]
        position += 7 + length
        if kind == 1:      # FULL
            records.append(chunk)
        elif kind == 2:    # FIRST
            pending = chunk
        elif kind == 3:    # MIDDLE
            pending += chunk
        elif kind == 4:    # LAST
            records.append(pending + chunk)
            pending = b""
    return records


def read_wandb(logging_dir: Path, project: str) -> dict:
    """The offline run's ``.wandb`` file, parsed with W&B's own record schema (wandb.proto)."""
    from wandb.proto import wandb_internal_pb2

    runs = sorted(glob.glob(os.path.join(logging_dir, "wandb", "offline-run-*")))
    if len(runs) != 1:
        return {"runs": len(runs), "scalars": {}, "config": {}, "closed": False}
    files = glob.glob(os.path.join(runs[0], "run-*.wandb"))
    scalars: Scalars = {}
    config: Dict[str, str] = {}
    closed, name = False, None
    for raw in _wandb_records(files[0]):
        record = wandb_internal_pb2.Record.FromString(raw)
        kind = record.WhichOneof("record_type")
        if kind == "run":
            name = record.run.project
            config.update({item.key: item.value_json for item in record.run.config.update})
        elif kind == "config":
            config.update({item.key: item.value_json for item in record.config.update})
        elif kind == "history":
            items = {"/".join(i.nested_key) or i.key: json.loads(i.value_json) for i in record.history.item}
            for key, value in items.items():
                if not key.startswith("_"):
                    scalars.setdefault(key, []).append((record.history.step.num, float(value)))
        elif kind == "exit":
            closed = True
    return {"runs": 1 if name == project else 0, "scalars": scalars, "config": config, "closed": closed}


READERS = {"tensorboard": read_tensorboard, "mlflow": read_mlflow, "wandb": read_wandb}
# The module each reader needs besides the tracker's own package.
READER_MODULES = {"tensorboard": "tensorboard", "mlflow": "mlflow", "wandb": "wandb"}
