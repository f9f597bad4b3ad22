"""py-spy ``--format raw`` (collapsed stacks, ``--threads``) -> a speedscope
JSON (one profile per thread, identical stacks merged with weights: small)
and a per-thread summary of the top frames by share of samples.

    .venv/bin/python benchmarks/profile_summary.py RAW.txt [--speedscope OUT.json] [--top 6]

For each thread: its samples, the share spent waiting (leaf frame a blocking
call: epoll/poll/select/futex/condition wait/sleep/read on a socket, which
py-spy only samples with ``--idle``), and the top frames, each named by its
deepest Python frame and, with ``--native``, its leaf native frame.
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import sys

WAIT = re.compile(r"epoll_wait|epoll_pwait|\bpoll\b|__poll|ppoll|select|futex|pthread_cond_(timed)?wait|"
                  r"sem_(timed)?wait|nanosleep|clock_nanosleep|acquire|\bwait\b|_wait_for_tstate_lock|"
                  r"sleep|take_gil|PyCOND_TIMEDWAIT|__nptl_death_event|"
                  r"do_futex_wait|__lll_lock_wait|ucs_event_set_wait|pollset_work|"
                  # grpc core's futex waits go through libc's raw syscall()
                  # (cygrpc is stripped); /proc shows those threads at ~1 % CPU
                  r"^syscall")


_LIBC: list[tuple[int, str]] = []


def load_libc(base: int, path: str = "/usr/lib/x86_64-linux-gnu/libc.so.6") -> None:
    """Names libc addresses py-spy left as hex: the nearest exported symbol
    below (``nm -D``), given libc's load address in the profiled process."""
    import subprocess

    syms = []
    for line in subprocess.run(["nm", "-D", "--defined-only", path], capture_output=True, text=True).stdout.splitlines():
        parts = line.split()
        if len(parts) == 3 and parts[1] in "TtWi":
            syms.append((int(parts[0], 16), parts[2].split("@")[0]))
    syms.sort()
    _LIBC[:] = [(base, "")] + syms


def _sym(m: re.Match) -> str:
    import bisect

    if not _LIBC:
        return m.group(0)
    off = int(m.group(1), 16) - _LIBC[0][0]
    syms = _LIBC[1:]
    i = bisect.bisect_right(syms, (off, "\uffff")) - 1
    if i < 0 or off - syms[i][0] > 0x4000:
        return m.group(0)
    d = off - syms[i][0]
    # past an exported symbol's first bytes: an unexported libc function
    # (futex waits and wakes, mostly) that follows it
    return f"{syms[i][1]}+{d:#x} (libc.so.6)" if d < 0x200 else f"libc-internal@{syms[i][1]}+{d:#x} (libc.so.6)"


def parse(path: str):
    threads: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for line in open(path):
        line = line.rstrip("\n")
        if not line:
            continue
        stack, _, n = line.rpartition(" ")
        frames = [re.sub(r"^(0x[0-9a-f]+) \(libc\.so\.6\)$", _sym, f) for f in stack.split(";")]
        threads[frames[0]][tuple(frames[1:])] += int(n)
    return threads


def short(f: str) -> str:
    f = re.sub(r" \(/[^)]*site-packages/", " (", f)
    f = re.sub(r" \(/work/main/", " (", f)
    return f


def _name(f: str) -> str:
    return re.sub(r" \((?:[^()]*/)?([^/()]+?)(?::\d+)?\)$", r" (\1)", short(f)) if " (" in f else f


def label(stack: tuple[str, ...]) -> str:
    """Deepest Python frame, then (native stacks) the frame that the leaf
    was called from and the leaf, both without line numbers."""
    py = [i for i, f in enumerate(stack) if re.search(r"\.py[x]?:\d+\)", f)]
    if not stack:
        return "?"
    if not py:
        return " -> ".join(_name(f) for f in stack[-2:])
    i = py[-1]
    deep = short(stack[i])
    rest = [_name(f) for f in stack[i + 1:] if not re.match(r"(Py_X?DECREF|Py_INCREF|0x[0-9a-f]+) ", f)]
    if not rest:
        return deep
    return f"{deep} -> " + (" .. ".join(rest[-2:]) if len(rest) > 1 else rest[-1])


def is_wait(stack: tuple[str, ...]) -> bool:
    if stack and stack[-1].startswith("syscall"):
        return True
    tail = ";".join(stack[-4:])
    return bool(WAIT.search(tail))


ROOT = re.compile(r"^(uv_run|Thread\.run|_worker|Runner\.run) \(")


def body(stack: tuple[str, ...]) -> tuple[str, ...]:
    """The frames below a thread's or event loop's dispatch (what runs, not how it was started)."""
    idx = [i for i, f in enumerate(stack) if ROOT.match(f)]
    return stack[idx[-1] + 1:] if idx else stack


def summary(threads, top: int) -> list[dict]:
    out = []
    total = sum(sum(c.values()) for c in threads.values())
    for t, c in sorted(threads.items(), key=lambda kv: -sum(kv[1].values())):
        n = sum(c.values())
        waits = sum(v for s, v in c.items() if is_wait(s))
        labels = collections.Counter()
        for s, v in c.items():
            labels[("wait: " if is_wait(s) else "") + label(s)] += v
        out.append(dict(thread=t, samples=n, share_of_process=n / total if total else 0, wait_share=waits / n if n else 0,
                        top=[(lab, v / n) for lab, v in labels.most_common(top)]))
    return out


COMPONENTS = (  # first match wins, on any frame of the stack
    ("NIXL/UCX (make_prepped_xfer, transfer = the CMA copy, check/notifs)", r"nixl"),
    ("engine-socket gate relay (local_gate.py)", r"local_gate\.py"),
    ("kvd Python (core, engine service, client)", r"kvd/(core|daemon|client)/"),
    ("grpcio (cygrpc, grpc/_channel.py, grpc aio)", r"grpc"),
    ("protobuf (upb)", r"_message\.abi3|PyUpb|upb_"),
    ("hand-off to the NIXL thread (ThreadPoolExecutor)", r"concurrent/futures"),
    ("event loop (uvloop/asyncio) and the rest", r"."),
)
LEAF = (("wake another thread (futex wake, sem_post, cond_signal, eventfd)",
         r"__lll_lock_wake|sem_post|pthread_cond_signal|pthread_cond_broadcast|eventfd_write"),
        ("socket/pipe syscalls (read, write, sendmsg, recvmsg)", r"^(read|write|sendmsg|recvmsg|__libc_recv|__libc_send)"),
        ("other CPU", r"."))


def components(threads) -> tuple[int, list]:
    """Samples not waiting, over all threads, by component and by the kind of
    leaf: (active samples, [(component, leaf kind, share of active)])."""
    c = collections.Counter()
    for t, stacks in threads.items():
        for s, v in stacks.items():
            if is_wait(s):
                continue
            b = body(s) or s or ("?",)
            comp = next(n for n, rx in COMPONENTS if any(re.search(rx, f) for f in b))
            leaf = next(n for n, rx in LEAF if re.search(rx, s[-1] if s else ""))
            c[(comp, leaf)] += v
    n = sum(c.values())
    return n, [(comp, leaf, v / n) for (comp, leaf), v in c.most_common()]


def active_frames(threads, top: int) -> list[tuple[str, str, float]]:
    """Samples not waiting, over all threads: (thread name, frame label, share of active)."""
    c = collections.Counter()
    for t, stacks in threads.items():
        tname = re.sub(r"^thread \(\d+\): ", "", t)
        for s, v in stacks.items():
            if not is_wait(s):
                c[(tname, label(body(s)) if body(s) else label(s))] += v
    n = sum(c.values()) or 1
    return [(t, lab, v / n) for (t, lab), v in c.most_common(top)]


def inclusive(threads, top: int) -> list[tuple[str, float]]:
    """Python functions (kvd's and the libraries') by the share of the samples
    not waiting that have them anywhere on the stack below the dispatch."""
    c = collections.Counter()
    n = 0
    for stacks in threads.values():
        for s, v in stacks.items():
            if is_wait(s):
                continue
            n += v
            names = {re.sub(r":\d+\)$", ")", short(f)) for f in body(s) if re.search(r"\.py:\d+\)$", f)}
            for f in names:
                c[f] += v
    return [(f, v / (n or 1)) for f, v in c.most_common(top)]


def speedscope(threads, name: str) -> dict:
    frames: list[dict] = []
    idx: dict[str, int] = {}

    def fi(f: str) -> int:
        if f not in idx:
            idx[f] = len(frames)
            m = re.match(r"(.*) \((.*?)(?::(\d+))?\)$", f)
            frames.append(dict(name=m.group(1), file=m.group(2), line=int(m.group(3))) if m and m.group(3)
                          else dict(name=short(f)))
        return idx[f]

    profiles = []
    for t, c in sorted(threads.items(), key=lambda kv: -sum(kv[1].values())):
        samples, weights = [], []
        for s, v in c.items():
            samples.append([fi(f) for f in s])
            weights.append(v)
        profiles.append(dict(type="sampled", name=t, unit="none", startValue=0, endValue=sum(weights),
                             samples=samples, weights=weights))
    return {"$schema": "https://www.speedscope.app/file-format-schema.json", "name": name,
            "exporter": "benchmarks/profile_summary.py (from py-spy raw)", "activeProfileIndex": 0,
            "shared": {"frames": frames}, "profiles": profiles}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("raw")
    ap.add_argument("--speedscope", default="")
    ap.add_argument("--top", type=int, default=6)
    ap.add_argument("--json", default="")
    ap.add_argument("--under", default="", help="keep only stacks with a frame matching this regex")
    ap.add_argument("--maps", default="", help="/proc/PID/maps of the profiled process (names libc addresses)")
    ap.add_argument("--libc-base", default="", help="libc's load address in it, hex (instead of --maps)")
    args = ap.parse_args(argv)
    if args.maps:
        for line in open(args.maps):
            if "libc.so" in line:
                load_libc(int(line.split("-")[0], 16), line.split()[-1])
                break
    elif args.libc_base:
        load_libc(int(args.libc_base, 16))
    threads = parse(args.raw)
    if args.under:
        rx = re.compile(args.under)
        threads = {t: collections.Counter({s: v for s, v in c.items() if any(rx.search(f) for f in s)})
                   for t, c in threads.items()}
        threads = {t: c for t, c in threads.items() if c}
    res = summary(threads, args.top)
    for r in res:
        print(f"\n{r['thread']}: {r['samples']} samples ({r['share_of_process']:.0%} of the process's), "
              f"waiting {r['wait_share']:.0%}")
        for lab, sh in r["top"]:
            print(f"  {sh:6.1%}  {lab}")
    n, comps = components(threads)
    print(f"\nnot waiting, all threads: {n} samples")
    for comp, leaf, sh in comps:
        if sh >= 0.01:
            print(f"  {sh:6.1%}  {comp} / {leaf}")
    print(f"\ntop frames not waiting (share of the {n} samples not waiting):")
    for t, lab, sh in active_frames(threads, 2 * args.top):
        print(f"  {sh:6.1%}  [{t}] {lab}")
    print("\nPython functions on the stack, inclusive (share of the samples not waiting):")
    for f, sh in inclusive(threads, 2 * args.top):
        print(f"  {sh:6.1%}  {f}")
    if args.speedscope:
        with open(args.speedscope, "w") as f:
            json.dump(speedscope(threads, args.raw.rsplit("/", 1)[-1]), f, separators=(",", ":"))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
