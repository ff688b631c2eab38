"""Faults of checkpoints in object storage (issue 29), each on a real S3-compatible server started
on loopback (moto's standalone server), with a proxy in front of it where a request must fail
(`unified.testing.object_store.FaultyEndpoint`): the store stopping in the middle of a save,
transient errors (retried by the client) and persistent ones (a clear error naming the object),
and a process SIGKILLed in the middle of a multipart upload. In every case the previous
checkpoint stays whole and loadable, and what the failed save left is never loaded.

Before this change, a store out of reach raised botocore's own exception (not an `OSError`)
out of the save on the process that met it, without naming the checkpoint or reaching the
other processes, and a killed upload left its parts on the store for good."""
from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import textwrap

import pytest

from unified.checkpoint.store import ObjectStore
from unified.errors import CheckpointError
from unified.testing.object_store import FaultyEndpoint, missing_store_packages, requests_through, s3_server

from .test_object_storage import _params, _same

pytestmark = pytest.mark.skipif(missing_store_packages() is not None, reason=str(missing_store_packages()))
torch = pytest.importorskip("torch")


def _accelerator(**kwargs):
    from unified import Accelerator

    acc = Accelerator(backend="torch", **kwargs)
    torch.manual_seed(0)
    model = acc.prepare(torch.nn.Linear(64, 32))
    optimizer = acc.prepare(torch.optim.Adam(model.parameters(), lr=0.1))
    return acc, model, optimizer


def _step(acc, model, optimizer):
    acc.backward(model(torch.ones(2, 64)).sum())
    optimizer.step()
    optimizer.zero_grad()


def _names(fs, url):
    return sorted(p.rsplit("/", 1)[-1] for p in fs.ls(url, refresh=True))


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_the_store_stopping_mid_save_fails_naming_the_object_and_the_previous_checkpoint_loads(monkeypatch, async_save):
    from unified import ProjectConfiguration

    with s3_server() as server, requests_through(server.endpoint, max_attempts=2):
        url, fs = server.bucket(), server.filesystem()
        acc, model, optimizer = _accelerator(project_config=ProjectConfiguration(
            project_dir=f"{url}/run", automatic_checkpoint_naming=True))
        acc.save_state()
        kept = _params(model)
        _step(acc, model, optimizer)
        written = []
        write = ObjectStore.write

        def stop_after_the_first_file(self, path, arrays, live):
            written.append(path)
            if len(written) == 2:
                server.stop()  # connections are refused from here on
            return write(self, path, arrays, live)

        monkeypatch.setattr(ObjectStore, "write", stop_after_the_first_file)
        with pytest.raises(CheckpointError) as caught:
            acc.save_state(async_save=async_save)
            acc.wait_for_checkpoint()  # an async save's failure is raised here
        monkeypatch.undo()
        message = str(caught.value)
        assert "was not committed" in message and "the previous checkpoint is intact" in message
        assert written[1].split("://")[1] in message  # the object it could not write
        assert "after the storage client's retries" in message and "#object-storage-unreachable" in message
        server.start()
        assert _names(fs, f"{url}/run/checkpoints") == ["checkpoint_0", "checkpoint_1"]
        assert not fs.exists(f"{url}/run/checkpoints/checkpoint_1/manifest.json")  # never committed
        _step(acc, model, optimizer)
        assert acc.load_state() == f"{url}/run/checkpoints/checkpoint_0"  # the half-written one is never loaded
        assert _same(_params(model), kept)
        assert acc.save_state() == f"{url}/run/checkpoints/checkpoint_2"
        assert _names(fs, f"{url}/run/checkpoints") == ["checkpoint_0", "checkpoint_2"]  # the leftover is gone
        acc.end_training()


def test_transient_errors_are_retried_and_persistent_ones_fail_naming_the_object():
    with s3_server() as server, FaultyEndpoint(server.endpoint) as faulty, \
            requests_through(faulty.endpoint, max_attempts=3):
        url, fs = server.bucket(), server.filesystem()
        acc, model, optimizer = _accelerator()
        faulty.fail(2, status=503, code="SlowDown", method="PUT")  # throttled twice, then answered
        assert acc.save_state(f"{url}/a") == f"{url}/a"
        assert [status for _, _, status in faulty.injected] == [503, 503]
        saved = _params(model)

        _step(acc, model, optimizer)
        faulty.fail(None, status=500, code="InternalError", method="PUT", containing="/b/optimizer_0")
        with pytest.raises(CheckpointError, match="was not committed") as caught:
            acc.save_state(f"{url}/b")
        assert "/b/optimizer_0.safetensors" in str(caught.value)
        assert len(faulty.injected) - 2 >= 3  # retried before it gave up
        faulty.heal()
        assert not fs.exists(f"{url}/b/manifest.json")

        # every read fails: so does the load, before restoring
        faulty.fail(None, status=500, code="InternalError", method="GET")
        before = _params(model)
        with pytest.raises(CheckpointError, match="after the storage client's retries") as caught:
            acc.load_state(f"{url}/a")
        assert f"{url}/a/".split("://")[1] in str(caught.value)
        assert _same(_params(model), before)
        faulty.heal()
        acc.load_state(f"{url}/a")
        assert _same(_params(model), saved)
        acc.end_training()


_CHILD = textwrap.dedent("""
    import hashlib, sys, torch
    from unified import Accelerator, ProjectConfiguration

    acc = Accelerator(backend="torch", project_config=ProjectConfiguration(project_dir=sys.argv[1],
                                                                           automatic_checkpoint_naming=True))
    torch.manual_seed(1)
    model = acc.prepare(torch.nn.Linear(3000, 3000))  # 36 MB: a multipart upload of two 32 MiB parts
    acc.save_state()
    print(hashlib.sha256(b"".join(t.numpy().tobytes() for t in model.state_dict().values())).hexdigest(), flush=True)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1)
    acc.save_state()  # killed while it uploads the model's second part
    print("not killed", flush=True)
""")


def test_a_process_killed_mid_upload_leaves_nothing_that_is_loaded_or_kept(tmp_path, monkeypatch):
    from unified import Accelerator, ProjectConfiguration

    with s3_server() as server, FaultyEndpoint(server.endpoint) as faulty:
        url, fs = server.bucket(), server.filesystem()
        script = tmp_path / "child.py"
        script.write_text(_CHILD)
        child = []
        faulty.fail(1, status=503, method="PUT", containing="checkpoint_1/model_0.safetensors?partNumber=2",
                    then=lambda method, path: os.kill(child[0].pid, signal.SIGKILL))
        monkeypatch.setenv("UNIFIED_RUN_ID", "one-job")  # the child and this process: one job, restarted
        child.append(subprocess.Popen([sys.executable, str(script), f"{url}/run"], stdout=subprocess.PIPE,
                                      text=True, env={**os.environ, "AWS_ENDPOINT_URL": faulty.endpoint}))
        out, _ = child[0].communicate(timeout=300)
        assert child[0].returncode == -signal.SIGKILL and "not killed" not in out
        saved_hash = out.split()[0]
        bucket = url.split("://")[1]
        unfinished = fs.call_s3("list_multipart_uploads", Bucket=bucket).get("Uploads", [])
        assert [u["Key"] for u in unfinished] == ["run/checkpoints/checkpoint_1/model_0.safetensors"]

        acc = Accelerator(backend="torch", project_config=ProjectConfiguration(
            project_dir=f"{url}/run", automatic_checkpoint_naming=True))
        model = acc.prepare(torch.nn.Linear(3000, 3000))
        assert acc.load_state() == f"{url}/run/checkpoints/checkpoint_0"
        got = hashlib.sha256(b"".join(t.numpy().tobytes() for t in model.state_dict().values())).hexdigest()
        assert got == saved_hash
        newest = acc.save_state()
        assert not fs.call_s3("list_multipart_uploads", Bucket=bucket).get("Uploads")  # its parts were aborted
        assert acc.load_state() == newest
        acc.end_training()


_HOLDER = textwrap.dedent("""
    import sys, time, torch
    from unified import Accelerator, ProjectConfiguration

    acc = Accelerator(backend="torch", project_config=ProjectConfiguration(project_dir=sys.argv[1],
                                                                           automatic_checkpoint_naming=True))
    model = acc.prepare(torch.nn.Linear(4, 3))
    acc.save_state()
    print("saved", flush=True)
    time.sleep(300)
""")


def test_two_runs_on_one_prefix_are_refused_and_a_restarted_job_takes_its_lease_over(tmp_path, monkeypatch):
    from unified import Accelerator, ProjectConfiguration
    from unified.checkpoint.lease import LEASE_NAME, Lease

    with s3_server() as server:
        url, fs = server.bucket(), server.filesystem()
        script = tmp_path / "holder.py"
        script.write_text(_HOLDER)
        holder = subprocess.Popen([sys.executable, str(script), f"{url}/run"], stdout=subprocess.PIPE, text=True,
                                  env={**os.environ, "UNIFIED_RUN_ID": "first-job"})
        try:
            assert holder.stdout.readline().strip() == "saved"
            monkeypatch.setenv("UNIFIED_RUN_ID", "second-job")
            acc = Accelerator(backend="torch", project_config=ProjectConfiguration(
                project_dir=f"{url}/run", automatic_checkpoint_naming=True))
            acc.prepare(torch.nn.Linear(4, 3))
            with pytest.raises(CheckpointError, match="another live run saves checkpoints here") as caught:
                acc.save_state()
            assert f"pid {holder.pid}" in str(caught.value) and "#store-in-use" in str(caught.value)
            assert _names(fs, f"{url}/run/checkpoints") == ["checkpoint_0"]  # nothing written
        finally:
            holder.kill()
            holder.wait(timeout=60)
        with pytest.raises(CheckpointError, match="another live run"):  # killed: its lease runs until its term
            acc.save_state()
        monkeypatch.setenv("UNIFIED_RUN_ID", "first-job")  # the same job, restarted: its lease at once
        assert acc.save_state() == f"{url}/run/checkpoints/checkpoint_1"
        assert fs.exists(f"{url}/run/{LEASE_NAME}")
        acc.end_training()
        assert not fs.exists(f"{url}/run/{LEASE_NAME}")  # released

        # a lease whose term ended is taken over by any run; the run it was taken from learns it
        monkeypatch.setenv("UNIFIED_STORE_LEASE_SECONDS", "0.5")
        old = Lease.acquire(fs, f"{url}/other")
        old._stop.set()  # as if the run hung: no more renewals
        import time

        time.sleep(1)
        monkeypatch.setenv("UNIFIED_RUN_ID", "third-job")
        new = Lease.acquire(fs, f"{url}/other")
        with pytest.raises(CheckpointError, match="lost its lease"):
            old.check()
        new.release()
        assert not fs.exists(f"{url}/other/{LEASE_NAME}")
