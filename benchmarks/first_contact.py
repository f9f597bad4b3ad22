"""First contact: a load's latency to a new peer vs the same load once warm.

Two real ``kvd serve`` daemons (P and D) on this machine, one worker each;
P holds blocks, D loads 4 of them (per region) from P: the first load pays
the handshake (PeerService call, agent metadata load, descriptor lists, UCX
wire-up), the next ones are steady state. Caches:

- ``blocks``: 1 GiB in one segment, 2 regions x 65,536 blocks of 8 KiB;
- ``segments``: 1,000 segments of 64 KiB, one region each (16 blocks of
  4 KiB), as an engine with many layers that registers each tensor apart.

``--warm-peers`` starts D's daemon with ``--warm-peers <P>/P``: the
handshake is made at registration, ahead of the first load, which then pays
only what is left of first contact (NIXL's first transfer on the pair).

``--busy N`` runs N CPU burners (spinning processes) during the loads, as an
engine's TP workers loading both cores would. Prints a markdown table
(docs/PERFORMANCE.md, "First contact"); ``--json`` writes the rows.

    .venv/bin/python -m benchmarks.first_contact [--busy 0 2] [--repeat 2] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from kvd.testing.daemons import start_daemons, stop_daemons
from kvd.testing.sessions import Session, one_group
from kvd.testing.shm import ShmSegment
from kvd.v1 import kvd_pb2 as pb

LOAD_BLOCKS = 4
STEADY = 20


def _burn(stop) -> None:
    while not stop.is_set():
        sum(range(10_000))


class Worker:
    """An engine worker played by the benchmark: ``segments`` shm segments
    (one region each when more than 1; else K and V regions of ``layers``
    layers in one segment), NHD float16, 2 KV heads in the model, 16-token
    blocks, TP rank ``rank`` of ``tp`` (``2 // tp`` heads per rank)."""

    def __init__(self, daemon, engine_id: str, *, rank: int = 0, tp: int = 1, segments: int = 1,
                 num_blocks: int = 65536, head_dim: int = 128, layers: int = 1):
        self.daemon, self.engine_id, self.rank = daemon, engine_id, rank
        heads = 2 // tp
        block_len = 16 * heads * head_dim * 2
        nreg = segments if segments > 1 else 2 * layers
        if segments > 1:
            self.segs = [ShmSegment(num_blocks * block_len) for _ in range(segments)]
            regions = [pb.Region(segment_index=i, offset=0, block_len=block_len, block_stride=block_len,
                                 name=f"layer{i // 2}/{'kv'[i % 2]}") for i in range(nreg)]
        else:
            self.segs = [ShmSegment(nreg * num_blocks * block_len)]
            regions = [pb.Region(segment_index=0, offset=i * num_blocks * block_len, block_len=block_len,
                                 block_stride=block_len, name=f"layer{i // 2}/{'kv'[i % 2]}") for i in range(nreg)]
        for seg in self.segs:
            # Touched, as an engine's allocator does (vLLM allocates its KV
            # cache with torch.zeros): else the first READ pays the page
            # faults of fresh shm pages on both sides, which no engine's does.
            seg.array[:] = 0
        layout = pb.Layout(num_blocks=num_blocks, block_size=16, kv_layout=pb.KV_LAYOUT_NHD, dtype="float16",
                           num_kv_heads=heads, head_dim=head_dim, num_layers=nreg // 2,
                           block_lens=[block_len] * nreg, total_kv_heads=2)
        req = pb.RegisterEngineRequest(
            worker=pb.EngineWorker(engine_id=engine_id, tp_rank=rank, tp_size=tp), layout=layout,
            segments=[pb.Segment(kind=pb.MEMORY_KIND_SHM, name=s.name, size=s.size) for s in self.segs],
            regions=regions, model="test-model")
        try:
            daemon.stub().RegisterEngine(req, timeout=120)
            self.session = Session(daemon, engine_id, rank)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        if getattr(self, "session", None) is not None:
            self.session.close()
        for s in self.segs:
            s.close()


def _wait(session: Session, request_id: str, timeout: float) -> pb.SessionEvent:
    deadline = time.monotonic() + timeout
    while True:
        ev = session.next(max(0.01, deadline - time.monotonic()))
        if getattr(ev, ev.WhichOneof("event")).request_id == request_id:
            return ev


def _one(sources, dst_session, p_addr: str, engine_id: str, rid: str, timeout_s: float) -> tuple[float, str]:
    """Hold on every P rank, load on D; ``(seconds from load sent to its event, event kind)``."""
    ids = list(range(LOAD_BLOCKS))
    for src in sources:
        src.session.send(hold=pb.HoldBlocks(request_id=rid, groups=one_group(ids), lease_s=60))
    time.sleep(0.02)  # the hold is in before the load names it
    t0 = time.monotonic()
    dst_session.send(load=pb.LoadBlocks(request_id=rid, local_groups=one_group(ids), remote_engine_id=engine_id,
                                        remote_address=p_addr, remote_groups=one_group(ids),
                                        remote_request_id=rid, remote_tp_size=len(sources), timeout_s=timeout_s))
    ev = _wait(dst_session, rid, timeout_s + 10)
    return time.monotonic() - t0, ev.WhichOneof("event")


CASES = {
    # name: (P TP size, segments per worker, blocks per region)
    "blocks": (1, 1, 65536),
    "segments": (1, 1000, 16),
    "tp2": (2, 1, 65536),
}


def run_case(case: str, busy: int, timeout_s: float, gap_s: float = 1.0, warm_peers: bool = False,
             token: str = "none") -> dict:
    """One fresh daemon pair: the first load of ``case`` (``gap_s`` seconds
    after the workers registered) and :data:`STEADY` more; times in ms.
    ``warm_peers``: D's daemon handshakes with P's engine at registration.
    ``token``: ``"none"`` (no peer credential), ``"vet"`` (a peer token,
    so each new metadata is loaded in a throwaway process first,
    ``vet_peer_metadata``) or ``"no-vet"`` (a token, vetting off)."""
    p_tp, nseg, nblocks = CASES[case]
    work = tempfile.mkdtemp(prefix="kvd-first-")
    flags: tuple[str, ...] = ("--log-level", "info")
    if token != "none":
        path = Path(work) / "peer.token"
        path.write_text("first-contact-benchmark-token")
        path.chmod(0o600)
        flags += ("--peer-token-file", str(path), "--vet-peer-metadata", "true" if token == "vet" else "false")
    if warm_peers:  # P's peer address is chosen at its start: D is started after it
        [p] = start_daemons((work, "P", *flags))
        try:
            [d] = start_daemons((work, "D", *flags, "--warm-peers", f"{p.peer_address}/P"))
        except BaseException:
            stop_daemons([p])
            raise
    else:
        p, d = start_daemons((work, "P", *flags), (work, "D", *flags))
    stop = mp.Event()
    burners = [mp.Process(target=_burn, args=(stop,), daemon=True) for _ in range(busy)]
    workers = []
    try:
        sources = [Worker(p, "P", rank=r, tp=p_tp, segments=nseg, num_blocks=nblocks) for r in range(p_tp)]
        workers += sources
        dst = Worker(d, "D", segments=nseg, num_blocks=nblocks)
        workers.append(dst)
        for b in burners:
            b.start()
        # An engine serves its first request well after registering its KV
        # cache (vLLM profiles, compiles and warms up in between: the tiny
        # CPU engines of kvd's tests take tens of seconds); ``gap_s`` stands
        # for that, and lets the daemon's work at registration (the agent's
        # warm-up probe, ~55 ms) end first. 0 measures the worst case.
        time.sleep(max(gap_s, 0.5 if busy else 0.0))
        first, kind = _one(sources, dst.session, p.peer_address, "P", "first", timeout_s)
        steady = []
        for i in range(STEADY):
            s, _ = _one(sources, dst.session, p.peer_address, "P", f"steady-{i}", timeout_s)
            steady.append(s)
        return {"case": case, "busy": busy, "warm_peers": warm_peers, "token": token, "first_ms": first * 1e3,
                "first_event": kind,
                "steady_p50_ms": statistics.median(steady) * 1e3, "steady_max_ms": max(steady) * 1e3}
    except BaseException:
        print(f"first contact, case {case}: failed; the daemons' logs are kept in {work}", file=sys.stderr)
        work = None
        raise
    finally:
        stop.set()
        for b in burners:
            b.join(5)
        for w in workers:
            w.close()
        stop_daemons([p, d])
        if work is not None:  # a run that passed leaves nothing in /tmp
            shutil.rmtree(work, ignore_errors=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--case", choices=[*CASES, "all"], default="all")
    ap.add_argument("--busy", type=int, nargs="*", default=[0, 2], help="CPU burner counts to run (default 0 2)")
    ap.add_argument("--repeat", type=int, default=1, help="fresh daemon pairs per (case, busy)")
    ap.add_argument("--timeout", type=float, default=30.0, help="each load's deadline, seconds")
    ap.add_argument("--gap", type=float, default=1.0,
                    help="seconds between registration and the first load (an engine's start-up; 0: worst case)")
    ap.add_argument("--warm-peers", action="store_true",
                    help="D's daemon handshakes with P's engine at registration (kvd serve --warm-peers)")
    ap.add_argument("--peer-token", choices=["none", "vet", "no-vet"], default="none",
                    help="peer credential of both daemons: none; a token with each new peer metadata loaded in a "
                         "throwaway process first (vet_peer_metadata); a token without")
    ap.add_argument("--json", help="write the rows here")
    a = ap.parse_args(argv)
    rows = []
    cases = list(CASES) if a.case == "all" else [a.case]
    print(f"load average at start: {os.getloadavg()}, gap {a.gap} s", file=sys.stderr)
    for case in cases:
        for busy in a.busy:
            for _ in range(a.repeat):
                r = run_case(case, busy, a.timeout, a.gap, a.warm_peers, a.peer_token)
                print(r, file=sys.stderr)
                rows.append(r)
    print("| cache | handshake | peer token | CPU burners | first load ms | steady p50 ms | steady max ms | "
          "first - steady ms | first event |")
    print("|---|---|---|--:|--:|--:|--:|--:|---|")
    for r in rows:
        print(f"| {r['case']} | {'ahead' if r['warm_peers'] else 'on the load'} | {r['token']} | {r['busy']} | "
              f"{r['first_ms']:.1f} | {r['steady_p50_ms']:.2f} | "
              f"{r['steady_max_ms']:.2f} | {r['first_ms'] - r['steady_p50_ms']:.1f} | {r['first_event']} |")
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
