"""``python benchmarks/profile_entry.py [--telemetry] [daemon_entry args] serve ...``

Runs a kvd daemon through ``benchmarks.daemon_entry`` (so ``--trace`` and
``--set`` work) and, with ``--telemetry``, turns on NIXL's per-transfer
telemetry (``nixl_agent_config(capture_telemetry=True)``) and logs, for every
transfer handle the daemon releases, NIXL's own breakdown
(``get_xfer_telemetry``: postDuration, xferDuration, descCount, totalBytes)
plus the Python-side time of ``make_prepped_xfer`` and ``transfer`` as
``TELEM`` lines on stderr. Benchmarks only (issue 5 profiles); no kvd code is
changed, the wrappers are installed at start-up.
"""

from __future__ import annotations

import sys
import time


def install_telemetry() -> None:
    from kvd.core import nixl_agent as na

    agent_cls, cfg_cls = na._nixl()
    orig_cfg_init = cfg_cls.__init__

    def cfg_init(self, *a, **k):
        k["capture_telemetry"] = True
        orig_cfg_init(self, *a, **k)

    cfg_cls.__init__ = cfg_init
    pc = time.perf_counter
    made: dict[int, tuple[float, float]] = {}
    orig_make, orig_transfer, orig_release = (agent_cls.make_prepped_xfer, agent_cls.transfer,
                                              agent_cls.release_xfer_handle)

    def make(self, *a, **k):
        t0 = pc()
        h = orig_make(self, *a, **k)
        made[id(h)] = (t0, pc())
        return h

    def transfer(self, h, *a, **k):
        t0 = pc()
        st = orig_transfer(self, h, *a, **k)
        m = made.get(id(h))
        if m is not None:
            made[id(h)] = (*m, t0, pc(), st)
        return st

    def release(self, h, *a, **k):
        m = made.pop(id(h), None)
        try:
            t = self.get_xfer_telemetry(h)
            if m is not None and len(m) == 5:
                print(f"TELEM make_us {(m[1] - m[0]) * 1e6:.1f} transfer_us {(m[3] - m[2]) * 1e6:.1f} "
                      f"state {m[4]} start {t.startTime} post_us {t.postDuration} xfer_us {t.xferDuration} "
                      f"descs {t.descCount} bytes {t.totalBytes}", file=sys.stderr, flush=True)
        except Exception as e:  # noqa: BLE001 - report, keep serving
            print(f"TELEM error {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        return orig_release(self, h, *a, **k)

    agent_cls.make_prepped_xfer, agent_cls.transfer, agent_cls.release_xfer_handle = make, transfer, release


def main(argv: list[str]) -> int:
    if argv[:1] == ["--telemetry"]:
        install_telemetry()
        argv = argv[1:]
    from benchmarks.daemon_entry import main as entry_main

    return entry_main(argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
