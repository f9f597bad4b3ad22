"""Helpers of the security scenarios: callers as other users, other engine
processes, a throwaway certificate authority (``cryptography``, imported
when a :class:`Pki` is made)."""

from __future__ import annotations

import atexit
import datetime
import ipaddress
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile

from kvd.testing.processes import child_env

NOBODY = 65534     # uid and gid of "nobody" / "nogroup" on Debian
OUTSIDER = 65532   # a uid and gid the daemons in these tests admit nowhere

# Runs as root up to the imports, then becomes ``uid:gid`` (no supplementary
# groups) and makes one call; prints one JSON line. Everything it needs is
# imported first: as another user it cannot read /root (this interpreter).
_AS_USER = r"""
import json, os, sys, mmap, uuid
import grpc
from kvd.v1 import kvd_pb2 as pb, kvd_pb2_grpc as pb_grpc
from kvd.testing.sessions import KvShape, register_request
sock, uid, gid, action, arg = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5]
# The channel is made (and grpc's lazily imported modules loaded) while still
# root: as another user this process may not read the checkout or the venv
# (a fresh clone in a 0700 directory). It connects at the first call, after
# setuid, so the daemon sees the new uid (SO_PEERCRED is taken at connect).
stub = pb_grpc.EngineServiceStub(grpc.insecure_channel(f"unix:{sock}"))
shape = KvShape(num_layers=1, num_blocks=8, block_len=1024)
os.setgroups([]); os.setgid(gid); os.setuid(uid)
out = {"ok": False, "code": "", "details": ""}
made = None
try:
    if action == "stats":
        stub.GetStats(pb.StatsRequest(), timeout=10)
    else:
        class Seg: pass
        seg = Seg()
        if action == "register-own":
            seg.name = f"/kvdtest_{os.getpid()}_{uuid.uuid4().hex[:8]}"
            fd = os.open("/dev/shm" + seg.name, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
            os.ftruncate(fd, shape.size); os.close(fd)
            made = seg.name
        else:
            seg.name = arg
        seg.size = shape.size
        req = register_request(f"as-{uid}-{action}", shape, seg)
        if action == "register-staged":  # the daemon makes the mirror; this user must be able to open it
            req.segments[0].name = ""
            req.data_path = pb.DATA_PATH_STAGED
        r = stub.RegisterEngine(req, timeout=30)
        for m in r.staging_segments:
            st = os.stat("/dev/shm" + m.name)
            out["mirror"] = {"uid": st.st_uid, "mode": st.st_mode & 0o7777}
            os.close(os.open("/dev/shm" + m.name, os.O_RDWR))  # what the staged shim does
        stub.UnregisterEngine(pb.UnregisterEngineRequest(worker=pb.EngineWorker(engine_id=f"as-{uid}-{action}"),
                                                         session_token=r.session_token), timeout=30)
    out["ok"] = True
except grpc.RpcError as e:
    out["code"], out["details"] = e.code().name, e.details()
finally:
    if made:
        os.unlink("/dev/shm" + made)
print(json.dumps(out), flush=True)
"""


def call_as(socket_path: str, uid: int, gid: int, action: str = "stats", arg: str = "-") -> dict:
    """Runs one EngineService call as ``uid:gid`` in a fresh process; returns
    ``{"ok", "code", "details"}`` (code: the gRPC status name; ``mirror``:
    the staging mirror's owner and mode, for ``register-staged``).

    ``action``: ``stats``, ``register-own`` (a segment of its own),
    ``register-staged`` (a mirror the daemon makes, opened read-write as the
    staged shim does), else register segment ``arg``."""
    r = subprocess.run([sys.executable, "-c", _AS_USER, socket_path, str(uid), str(gid), action, arg],
                       capture_output=True, text=True, timeout=120, env=child_env())
    lines = [l for l in r.stdout.splitlines() if l.startswith("{")]
    assert lines, f"child as {uid}:{gid} printed nothing (rc {r.returncode}):\n{r.stderr[-3000:]}"
    return json.loads(lines[-1])


# A listener run as another user (``python -I -c COUNTING_LISTENER unix PATH``
# or ``... tcp HOST``): binds a stream socket at the Unix path PATH (mode 0777)
# or on a free TCP port of HOST, prints one JSON line {"ready": uid, "port":
# port or 0}, counts the connections and bytes it gets until a line on
# stdin, then prints {"connections": n, "bytes": n}. A third argument
# (seconds) keeps its backlog full that long first (a connection of its own
# queued on listen(0): every other connect() waits). Stdlib only: another
# user cannot import this checkout.
COUNTING_LISTENER = r"""
import json, os, socket, sys, threading
kind, where = sys.argv[1], sys.argv[2]
if kind == "unix":
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(where)
    os.chmod(where, 0o777)
    port = 0
else:
    s = socket.socket()
    s.bind((where, 0))
    port = s.getsockname()[1]
if len(sys.argv) > 3:
    import time
    s.listen(0)
    me = socket.socket(socket.AF_UNIX if kind == "unix" else socket.AF_INET)
    me.connect(where if kind == "unix" else (where, port))
    print(json.dumps({"ready": os.getuid(), "port": port}), flush=True)
    time.sleep(float(sys.argv[3]))
s.listen(8)
got = {"connections": 0, "bytes": 0}
def serve():
    while True:
        c, _ = s.accept()
        got["connections"] += 1
        c.settimeout(2)
        try:
            while True:
                data = c.recv(65536)
                if not data:
                    break
                got["bytes"] += len(data)
        except OSError:
            pass
threading.Thread(target=serve, daemon=True).start()
if len(sys.argv) <= 3:
    print(json.dumps({"ready": os.getuid(), "port": port}), flush=True)
sys.stdin.readline()
print(json.dumps(got), flush=True)
"""


def reachable_dir() -> str:
    """A fresh directory every user can traverse (pytest's tmp_path is 0700),
    removed with what is in it when this process exits (the tests stop
    their daemons before that; left, a suite run left ~100 in /tmp)."""
    d = tempfile.mkdtemp(prefix="kvdsec-")
    os.chmod(d, 0o755)
    atexit.register(shutil.rmtree, d, ignore_errors=True)
    return d


# Another engine process: registers ``engine_id``, opens its session, prints
# its token, and waits for a line on stdin (or EOF) before it exits, without
# unregistering (like a killed engine).
_OTHER_ENGINE = r"""
import json, sys
from kvd.testing.daemons import Daemon
from kvd.testing.sessions import KvShape, Session, register_request
from kvd.testing.shm import ShmSegment
sock, engine_id = sys.argv[1], sys.argv[2]
d = Daemon(proc=None, socket=sock, log_path="")
shape = KvShape(num_layers=1, num_blocks=8, block_len=1024)
seg = ShmSegment(shape.size)
r = d.stub().RegisterEngine(register_request(engine_id, shape, seg), timeout=30)
s = Session(d, engine_id)
print(json.dumps({"token": r.session_token, "segment": seg.name}), flush=True)
sys.stdin.readline()
"""


class OtherEngine:
    """An engine worker registered by another process (pid) of the same user."""

    def __init__(self, socket_path: str, engine_id: str):
        self.proc = subprocess.Popen([sys.executable, "-c", _OTHER_ENGINE, socket_path, engine_id],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=child_env())
        line = self.proc.stdout.readline()
        assert line, f"engine process {engine_id} exited {self.proc.wait()}"
        info = json.loads(line)
        self.token, self.segment = info["token"], info["segment"]

    def exit(self) -> None:
        """Lets the engine process exit (without unregistering, like a killed engine)."""
        if self.proc.poll() is None:
            self.proc.stdin.write("\n")
            self.proc.stdin.flush()
            self.proc.wait(30)


# ---------------------------------------------------------------- certificates
class Pki:
    """A throwaway CA and certificates (``cryptography``), as PEM files in ``directory``."""

    def __init__(self, directory: str, name: str = "kvd-test-ca"):
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import NameOID

        self.dir = pathlib.Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.name = name
        self._key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        now = datetime.datetime.now(datetime.timezone.utc)
        self._cert = (x509.CertificateBuilder().subject_name(subject).issuer_name(subject)
                      .public_key(self._key.public_key()).serial_number(x509.random_serial_number())
                      .not_valid_before(now - datetime.timedelta(minutes=5))
                      .not_valid_after(now + datetime.timedelta(days=1))
                      .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
                      .add_extension(x509.KeyUsage(False, False, False, False, False, True, True, False, False),
                                     critical=True)
                      .sign(self._key, hashes.SHA256()))
        self.ca = self._write(f"{name}.pem", self._pem(self._cert))

    @staticmethod
    def _pem(obj) -> bytes:
        from cryptography.hazmat.primitives import serialization

        if hasattr(obj, "private_bytes"):
            return obj.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                     serialization.NoEncryption())
        return obj.public_bytes(serialization.Encoding.PEM)

    def _write(self, name: str, data: bytes) -> str:
        p = self.dir / name
        p.write_bytes(data)
        os.chmod(p, 0o600)
        return str(p)

    def issue(self, cn: str, hosts=("127.0.0.1", "localhost")) -> tuple[str, str]:
        """A certificate for server and client use with SANs ``hosts``; ``(cert, key)`` paths."""
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

        key = ec.generate_private_key(ec.SECP256R1())
        sans = []
        for h in hosts:
            try:
                sans.append(x509.IPAddress(ipaddress.ip_address(h)))
            except ValueError:
                sans.append(x509.DNSName(h))
        now = datetime.datetime.now(datetime.timezone.utc)
        cert = (x509.CertificateBuilder()
                .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)]))
                .issuer_name(self._cert.subject).public_key(key.public_key())
                .serial_number(x509.random_serial_number())
                .not_valid_before(now - datetime.timedelta(minutes=5))
                .not_valid_after(now + datetime.timedelta(days=1))
                .add_extension(x509.SubjectAlternativeName(sans), critical=False)
                .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                                      ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
                .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
                .sign(self._key, hashes.SHA256()))
        return self._write(f"{cn}.crt", self._pem(cert)), self._write(f"{cn}.key", self._pem(key))

    def flags(self, cn: str) -> tuple[str, ...]:
        """``kvd serve`` flags for a daemon with a fresh certificate ``cn``."""
        cert, key = self.issue(cn)
        return ("--peer-tls-cert", cert, "--peer-tls-key", key, "--peer-tls-ca", self.ca)
